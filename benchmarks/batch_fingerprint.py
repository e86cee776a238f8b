"""What checking that every rank was given the same batch costs, against a GPT-2 step (CPU, gloo).

``fxpipe.distributed``'s ``step`` and ``eval_step`` fingerprint the call's inputs and targets on
every rank (three int64 sums over their bits, :func:`fxpipe.distributed._failures.fingerprint`)
and compare the fingerprints in the all-reduce that already agrees on each rank's checks: a few
more bytes in a collective that runs anyway, so the cost is the fingerprint itself. Goal (issue
#30): at most 1% of a step.

Model: transformers' ``GPT2LMHeadModel`` (3 layers, width 64, vocabulary 512), batch 8 x 64
tokens, labels with right padding, a token-mean cross entropy; one gloo rank holding both
stages (``schedule='interleaved1f1b'``, 2 stages per rank, 4 micro-batches): the whole step's
work on the one rank, the fingerprint as every rank computes it. Each repetition times, in a
rotating order, ``step`` (one ``pipe.step(ids, target=labels)``, fingerprint included) and
``fingerprint`` (the fingerprint of the same inputs and targets alone). Reported: medians, their
ratio, and the command.

Usage::

    .venv/bin/python benchmarks/batch_fingerprint.py        # writes results/batch_fingerprint.json
    .venv/bin/python benchmarks/batch_fingerprint.py --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _gpt2_steps import gpt2_and_batch, rotating_medians, timed


def _loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "batch_fingerprint.json"))
    ns = parser.parse_args()
    repeat = 5 if ns.quick else ns.repeat
    import fxpipe.distributed as fpd
    from fxpipe.distributed._failures import fingerprint
    from fxpipe.distributed._launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        model, ids, labels = gpt2_and_batch()
        pipe = fpd.pipeline(model, (), sample_kwargs={"input_ids": ids}, chunks=4, stages_per_rank=2,
                            schedule="interleaved1f1b", loss_fn=lambda out, y: _loss(out.logits, y), progress=False)

        one_step = timed(lambda: pipe.step(input_ids=ids, target=labels), lambda: model.zero_grad(set_to_none=True))
        one_print = timed(lambda: fingerprint(([ids], labels), torch.device("cpu")).tolist())

        one_step(), one_print()  # warm up
        med = rotating_medians([("step", one_step), ("fingerprint", one_print)], repeat)
        pipe.close()
    finally:
        dist.destroy_process_group()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeat": repeat,
        "median_s": med,
        "fingerprint_over_step": med["fingerprint"] / med["step"],
        "goal": "fingerprint_over_step <= 0.01",
    }
    result["met"] = result["fingerprint_over_step"] <= 0.01
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"step {med['step'] * 1e3:.1f} ms; fingerprint of inputs and targets {med['fingerprint'] * 1e6:.0f} us "
          f"({result['fingerprint_over_step']:.3%}); goal <= 1%: {'met' if result['met'] else 'NOT met'}")


if __name__ == "__main__":
    main()
