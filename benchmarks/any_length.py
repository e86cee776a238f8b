"""One pipeline for every sequence length (issue #31): what a length per step costs.

A training run whose batches are padded to their longest sequence, lengths drawn from a
realistic distribution (``--distinct`` lengths between 16 and 128, skewed short as text is,
over ``--steps`` steps), trained with ``pipe.step(**batch)`` (the model's own ``labels=`` loss,
``-100`` padding) on one pipeline built once. Side by side, in one process:

* **first call at a new length / a normal call**: each step at a length seen for the first
  time against the median of the later steps at that length (goal <= 1.5x: nothing captured,
  checked or planned again; fxpipe's stage graphs are torch.export's dynamic ones);
* **a later call / a pipeline built for that length alone**: for a few lengths, the pipeline's
  step time against a pipeline captured with every size but the batch fixed (how fxpipe
  captured before this issue), interleaved, medians (goal <= 1.02x);
* **the whole run**: against eager on the same batches, and against building a pipeline per
  length (the run's step times plus one build per distinct length, the build's time measured
  on two lengths and its median used);
* **memory of shapes**: a one-process pipeline keeps nothing per shape (one graph); each rank of
  ``fxpipe.distributed`` keeps torch's stages for the last ``LIMIT`` shapes
  (:mod:`fxpipe.distributed._shape_runs`): with ``--distributed`` two gloo ranks train the same
  run, and each reports the receive-buffer bytes its kept shapes hold after each step (the
  largest, and one shape's at the longest length), the first step at a new length against
  the later ones, and how many shapes it made.

Models: ``gpt2`` (transformers ``GPT2LMHeadModel`` at GPT-2's width 768 and 12 heads, ``--layers``
layers, default 4 to fit a CPU run) and ``llama`` (a tiny ``LlamaForCausalLM``). Batch 4,
2 stages, chunks 2, one thread.

Usage::

    .venv/bin/python benchmarks/any_length.py                      # both models, results/any_length.json
    .venv/bin/python benchmarks/any_length.py --models llama --steps 30 --distinct 10
    .venv/bin/python benchmarks/any_length.py --distributed    # also on two gloo ranks
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxpipe  # noqa: E402
from benchmarks._results import header, write_json  # noqa: E402
from fxpipe.capture import _export  # noqa: E402
from fxpipe.distributed._shape_runs import LIMIT  # noqa: E402

VOCAB, BATCH, STAGES, CHUNKS = 512, 4, 2, 2


def make_model(name: str, layers: int) -> torch.nn.Module:
    import transformers as T

    torch.manual_seed(0)
    if name == "gpt2":
        config = T.GPT2Config(n_layer=layers, n_embd=768, n_head=12, vocab_size=VOCAB, n_positions=256,
                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(config).train()
    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256, max_position_embeddings=256,
                           bos_token_id=0, eos_token_id=0)
    return T.LlamaForCausalLM(config).train()


def lengths(steps: int, distinct: int, seed: int = 0) -> List[int]:
    """``steps`` lengths using ``distinct`` values in [16, 128], short ones more often (a
    log-normal-like draw over the sorted choices), each value used at least once."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.linspace(16, 128, distinct).round().long().tolist()
    weights = torch.tensor([1.0 / (i + 2) for i in range(distinct)])
    drawn = torch.multinomial(weights, steps - distinct, replacement=True, generator=g).tolist()
    order = choices + [choices[i] for i in drawn]
    perm = torch.randperm(len(order), generator=g).tolist()
    return [order[i] for i in perm]


def batch(length: int, step: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, VOCAB, (BATCH, length), generator=g)
    mask = torch.ones(BATCH, length, dtype=torch.long)
    for row in range(1, BATCH, 2):  # padded rows: each batch is padded to its longest sequence
        mask[row, length - length // (row + 2):] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def build(model: torch.nn.Module, length: int) -> fxpipe.Pipeline:
    return fxpipe.pipeline(model, (), STAGES, sample_kwargs=batch(length, 10_000), chunks=CHUNKS, balance_by="params",
                           devices=["cpu"] * STAGES, output_merge={"loss": "mean"}, progress=False)


def build_fixed(model: torch.nn.Module, length: int) -> fxpipe.Pipeline:
    """A pipeline captured as before this issue: every size but the batch fixed."""
    attempts = _export._attempts
    _export._attempts = lambda flat, dims: attempts(flat, dims)[1:]  # the batch-only and the static export
    try:
        return build(model, length)
    finally:
        _export._attempts = attempts


def timed(run: Callable[[], Any]) -> float:
    t = time.perf_counter()
    run()
    return time.perf_counter() - t


def run_model(name: str, layers: int, steps: int, distinct: int, alone: int, repeat: int) -> Dict[str, Any]:
    model = make_model(name, layers)
    eager = copy.deepcopy(model)
    plan = lengths(steps, distinct)
    build(copy.deepcopy(model), plan[0])  # untimed: a process's first build imports torch.export's machinery
    t0 = time.perf_counter()
    pipe = build(model, plan[0])
    build_s = time.perf_counter() - t0
    times: List[float] = []
    eager_times: List[float] = []
    seen: set = set()
    first: Dict[int, float] = {}
    for step, length in enumerate(plan):
        b = batch(length, step)
        t = timed(lambda: pipe.step(**b))
        model.zero_grad(set_to_none=True)
        eager_times.append(timed(lambda: eager(**b).loss.backward()))
        eager.zero_grad(set_to_none=True)
        times.append(t)
        if length not in seen:
            seen.add(length)
            first[length] = t
    later: Dict[int, List[float]] = {}
    for length, t in zip(plan, times):
        later.setdefault(length, []).append(t)
    ratios = []
    for length, t in first.items():
        rest = later[length][1:]
        if rest:
            ratios.append(t / statistics.median(rest))
    # later calls against a pipeline captured for that length alone (sizes fixed), interleaved
    alone_rows = []
    for length in sorted(set(plan))[:: max(1, len(set(plan)) // alone)][:alone]:
        fixed = build_fixed(copy.deepcopy(model), length)
        b = batch(length, 0)
        ours, theirs = [], []
        for _ in range(repeat):
            ours.append(timed(lambda: pipe.step(**b)))
            theirs.append(timed(lambda: fixed.step(**b)))
        model.zero_grad(set_to_none=True)
        alone_rows.append({"length": length, "ratio": statistics.median(ours) / statistics.median(theirs),
                           "one_pipeline_s": statistics.median(ours), "built_alone_s": statistics.median(theirs)})
    rebuilds = [timed(lambda: build(copy.deepcopy(model), n)) for n in sorted(set(plan))[:2]]
    rebuild = statistics.median(rebuilds)
    total = sum(times)
    return {
        "model": name, "layers": layers if name == "gpt2" else 4, "steps": steps, "distinct_lengths": len(set(plan)),
        "lengths": plan, "build_s": build_s, "step_s": times, "eager_step_s": eager_times,
        "first_call_over_normal": {"median": statistics.median(ratios), "max": max(ratios), "n": len(ratios)},
        "later_over_built_alone": alone_rows,
        "total": {"one_pipeline_s": total + build_s, "eager_s": sum(eager_times),
                  "rebuild_per_length_s": total + rebuild * len(set(plan)), "rebuild_s": rebuilds,
                  "one_pipeline_over_eager": (total + build_s) / sum(eager_times),
                  "one_pipeline_over_rebuilding": (total + build_s) / (total + rebuild * len(set(plan)))},
        "shape_memory": {"one_process_bytes": 0, "distributed_shapes_kept": LIMIT},
    }


def _rank(rank: int, world: int, port: int, name: str, layers: int, steps: int, distinct: int, out: str) -> None:
    """One gloo rank of the distributed run: step times, shapes made, receive-buffer bytes."""
    import json
    from datetime import timedelta

    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.distributed._shape_runs import receive_buffer_bytes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    plan = lengths(steps, distinct)
    pipe = fpd.pipeline(make_model(name, layers), (), sample_kwargs=batch(plan[0], 10_000), chunks=CHUNKS,
                        timeout=120, progress=False)
    times, held, one = [], [], []
    for step, length in enumerate(plan):
        b = batch(length, step)
        t = time.perf_counter()
        pipe.step(**b)
        times.append(time.perf_counter() - t)
        pipe.module.zero_grad(set_to_none=True)
        held.append(sum(receive_buffer_bytes(run.stages) for run in pipe._runs._runs.values()))
        one.append(receive_buffer_bytes(pipe._run.stages))  # the shape this step ran
    Path(out, f"rank{rank}.json").write_text(json.dumps({"times": times, "held": held, "made": pipe._runs.made,
                                                         "kept": len(pipe._runs), "one_shape_longest": max(one)}))
    pipe.close()
    dist.barrier()
    dist.destroy_process_group()


def run_distributed(name: str, layers: int, steps: int, distinct: int) -> Dict[str, Any]:
    import json
    import tempfile

    import torch.multiprocessing as mp

    from fxpipe.distributed._launch import free_port

    plan = lengths(steps, distinct)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(2, free_port(), name, layers, steps, distinct, tmp), nprocs=2,
                           start_method="spawn")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(2)]
    rows = []
    for r, got in enumerate(ranks):
        firsts, later, seen = [], {}, set()
        for length, t in zip(plan, got["times"]):
            later.setdefault(length, []).append(t)
        for i, length in enumerate(plan):
            if length not in seen and i > 0:  # the first step (the sample's shape) was made at the build
                seen.add(length)
                rest = later[length][1:]
                if rest:
                    firsts.append(got["times"][i] / statistics.median(rest))
            seen.add(length)
        rows.append({"rank": r, "shapes_made": got["made"], "shapes_kept": got["kept"],
                     "receive_buffer_bytes_max": max(got["held"]), "receive_buffer_bytes_last": got["held"][-1],
                     "one_shape_at_longest_bytes": got["one_shape_longest"],
                     "first_call_over_normal": {"median": statistics.median(firsts) if firsts else None,
                                                "max": max(firsts) if firsts else None, "n": len(firsts)},
                     "step_s": got["times"]})
    return {"model": name, "ranks": rows, "limit": LIMIT, "lengths": plan}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--distinct", type=int, default=20)
    parser.add_argument("--alone", type=int, default=3, help="lengths compared with a pipeline built for them alone")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--distributed", action="store_true", help="also two gloo ranks (fxpipe.distributed)")
    parser.add_argument("--out", default="benchmarks/results/any_length.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = header("any_length", "cpu", threads=1)
    result["command"] = " ".join(["benchmarks/any_length.py", *sys.argv[1:]])
    result["goals"] = {"first_call_over_normal": 1.5, "later_over_built_alone": 1.02}
    result["models"] = []
    for name in args.models:
        row = run_model(name, args.layers, args.steps, args.distinct, args.alone, args.repeat)
        result["models"].append(row)
        print(f"{name}: first call at a new length {row['first_call_over_normal']['median']:.2f}x a normal call "
              f"(max {row['first_call_over_normal']['max']:.2f}); later calls "
              + ", ".join(f"{r['ratio']:.3f}x" for r in row["later_over_built_alone"])
              + f" a pipeline built for the length; run {row['total']['one_pipeline_over_eager']:.2f}x eager, "
              f"{row['total']['one_pipeline_over_rebuilding']:.2f}x rebuilding per length", flush=True)
    if args.distributed:
        result["distributed"] = []
        for name in args.models:
            row = run_distributed(name, args.layers, args.steps, args.distinct)
            result["distributed"].append(row)
            for r in row["ranks"]:
                print(f"{name} distributed rank {r['rank']}: first step at a new length "
                      f"{r['first_call_over_normal']['median']:.2f}x a normal step (max "
                      f"{r['first_call_over_normal']['max']:.2f}); {r['shapes_made']} shapes made, {r['shapes_kept']} "
                      f"kept, receive buffers at most {r['receive_buffer_bytes_max'] / 2**20:.1f} MiB "
                      f"(one shape at the longest length: {(r['one_shape_at_longest_bytes'] or 0) / 2**20:.2f} MiB)",
                      flush=True)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
