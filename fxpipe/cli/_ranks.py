"""The rank side of ``fxpipe demo --nproc N`` and ``fxpipe timeline ... --nproc N``.

torchrun runs ``python -m fxpipe.cli._ranks --workdir DIR --options JSON`` on every
rank (:mod:`fxpipe.distributed._launch` starts it); ``--options`` is the parsed command line. Each rank joins a
gloo group (torchrun's environment, 127.0.0.1) whose timeout is the command's ``--timeout``,
writes its pid into ``DIR`` (so the parent can kill it at the deadline), runs the command,
and rank 0 writes the command's result to ``DIR/result.json``. A rank whose command raises
prints one line, ``fxpipe rank R: error: ...`` (and the traceback with ``--debug``), and
exits 1; the others then fail within seconds (gloo: "Connection closed by peer").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from ..distributed._launch import RESULT_FILE, error_line_of_rank

__all__ = ["main", "run_timeline"]


def run_timeline(ns: argparse.Namespace) -> Optional[dict]:
    """Trains ``ns.model`` on the ranks for one warm-up step and ``ns.steps`` recorded ones;
    rank 0 writes the Chrome trace (one lane per rank) and its PNG, and prints the bubble."""
    from fxpipe.cli._commands import load_model_and_sample, training_loss
    from fxpipe.capture._meta import is_meta_model
    from fxpipe.cli._model_loader import UsageError
    from fxpipe.cli.viz._rank_trace import plot_rank_timeline, save_rank_chrome_trace
    from fxpipe.cli.viz._trace import have_matplotlib, png_skipped

    from ..distributed import pipeline
    from ..distributed.trace import bubble_fractions, record

    rank, world = dist.get_rank(), dist.get_world_size()
    model, args, kwargs = load_model_and_sample(ns)
    if is_meta_model(model):
        raise UsageError(f"{ns.model} is built on the meta device (no weights): --nproc runs it, so its factory "
                         "must build it on the CPU")
    model.train()
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    target = torch.zeros(tensors[0].shape[0] if tensors and tensors[0].dim() else 1)  # training_loss ignores it
    pipe = pipeline(model, args, chunks=ns.chunks, loss_fn=lambda out, _target: training_loss(out),
                    schedule=ns.schedule, stages_per_rank=ns.stages // world, sample_kwargs=kwargs,
                    balance_by=ns.balance_by, leaf_modules=tuple(ns.leaf), split_points=ns.split_at or None,
                    checkpoint=ns.checkpoint, timeout=ns.timeout)

    def step() -> None:
        pipe.step(*args, target=target, **kwargs)
        for p in pipe.parameters():
            p.grad = None

    step()  # the first step pays one-time set-up costs; not recorded
    with record(pipe) as trace:
        for _ in range(ns.steps):
            step()
    bubbles = bubble_fractions(trace.spans)
    pipe.close()
    if rank != 0:
        return None
    title = (f"{type(model).__name__}: {pipe.n_stages} stages on {world} rank{'s' if world != 1 else ''} (gloo), schedule {ns.schedule!r}, "
             f"{ns.chunks} micro-batches, checkpoint={ns.checkpoint}")
    steps = [s for s in trace.spans if s.kind == "step"]
    total = max(s.end for s in steps) - min(s.start for s in steps)
    n_events = save_rank_chrome_trace(ns.output, trace.spans, trace.stages, title=title, bubbles=bubbles)
    print(f"recorded {ns.steps} step(s) on {world} rank{'s' if world != 1 else ''} in {total * 1e3:.1f} ms: {len(trace.spans)} spans")
    print("bubble (idle share of pipe.step): " + ", ".join(f"rank {r} {100 * b:.1f}%" for r, b in enumerate(bubbles)))
    print(f"wrote {ns.output} ({n_events} events; open in https://ui.perfetto.dev or chrome://tracing)")
    png = os.path.splitext(ns.output)[0] + ".png"
    if have_matplotlib():
        plot_rank_timeline(png, trace.spans, trace.stages, title=title, bubbles=bubbles)
        print(f"wrote {png}")
    else:
        print(png_skipped(png))
    return {"ok": True, "bubbles": bubbles}


def _run(ns: argparse.Namespace) -> Optional[dict]:
    if ns.command == "demo":
        from ._distributed_demo import run_demo_on_ranks

        return run_demo_on_ranks(ns)
    if ns.command == "timeline":
        return run_timeline(ns)
    raise ValueError(f"no rank side for the command {ns.command!r}")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxpipe.cli._ranks",
                                     description="the rank side of fxpipe's --nproc commands (run by torchrun)")
    parser.add_argument("--workdir", required=True, help="where the pid and rank 0's result are written")
    parser.add_argument("--options", required=True, help="the parsed fxpipe command line, as JSON")
    own = parser.parse_args(argv)
    ns = argparse.Namespace(**json.loads(own.options))
    rank = int(os.environ.get("RANK", "0"))
    workdir = Path(own.workdir)
    (workdir / f"pid.{rank}").write_text(str(os.getpid()))
    torch.set_num_threads(ns.threads or 1)  # the ranks share the host's cores
    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=ns.timeout))
        try:
            result = _run(ns)
        finally:
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - one line per rank; the parent shows them
        from fxpipe.cli._main import error_line

        if getattr(ns, "debug", False):
            traceback.print_exc()
        # one write, under the pipe's atomic size: the ranks' lines never interleave
        sys.stderr.write(error_line_of_rank(rank, error_line(e)[:3000]) + "\n")
        sys.stderr.flush()
        return 1
    if rank == 0:
        (workdir / RESULT_FILE).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
