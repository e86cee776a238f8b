"""What reading the loss costs per step, against a GPT-2 step at the test sizes (CPU).

``pipe.step(loss_fn=...)`` reads ``loss_fn`` once per micro-batch shape (two ``make_fx``
traces on fake tensors) and, at every call, computes each micro-batch's count with the
loss's own code for it (:mod:`fxpipe.checks._loss_fn`); the model's own ``labels=`` loss
counts its labels the same way (:mod:`fxpipe.checks._counted_labels`). Goal (issue #29): the
per-step cost of that analysis is at most 2% of a step.

Model: transformers' ``GPT2LMHeadModel`` (3 layers, width 64, vocabulary 512), batch 8 x 64
tokens with right padding (-100 labels), 2 stages, 4 micro-batches, ``schedule='1f1b'``.
Each repetition times, in a rotating order so drifts hit both alike:

* ``step``: one ``pipe.step(ids, loss_fn=..., target=labels)`` (forward, loss, backward);
* ``reading``: the per-call part of the analysis alone, ``reading.weights(...)`` with the
  reading cached, as the step calls it;
* ``own_step`` and ``own_counts``: ``pipe.step(input_ids=ids, labels=labels)`` on a pipeline
  built with ``labels=`` (the model's own loss), and its per-call counts alone
  (``pipe.batching.weights``);

and, separately, ``first_shape``: a fresh reading of a new shape (both traces), paid once per
shape. Reported: medians, their ratios to the step, and the command.

Usage::

    .venv/bin/python benchmarks/loss_reading.py            # writes results/loss_reading.json
    .venv/bin/python benchmarks/loss_reading.py --repeat 10 --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from _gpt2_steps import gpt2_and_batch, rotating_medians, timed

import fxpipe
from fxpipe.checks._loss_fn import LossFnReading, out_dims_of


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal LM loss, written out: the shift, then a token mean over labels != -100."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "loss_reading.json"))
    ns = parser.parse_args()
    repeat = 5 if ns.quick else ns.repeat
    model, ids, labels = gpt2_and_batch()
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs={"input_ids": ids}, chunks=4, devices=["cpu"] * 2,
                           schedule="1f1b", progress=False)
    own = fxpipe.pipeline(model, (), 2, sample_kwargs={"input_ids": ids, "labels": labels}, chunks=4,
                          devices=["cpu"] * 2, schedule="1f1b", output_merge={"loss": "mean"}, progress=False)
    logits_fn = lambda out, y: _loss(out.logits, y)  # noqa: E731

    # the reading as step() uses it: cached per shape, weights per call
    reading = pipe._loss_reading(logits_fn)
    with torch.no_grad():  # one micro-batch's flat outputs, as step() sees them
        micro_a, _ = pipe.batching.split(pipe.capture.flatten_inputs((), {"input_ids": ids}), 4)
        out0 = list(pipe.capture.graph_module(*micro_a[0]))
    flat = own.capture.flatten_inputs((), {"input_ids": ids, "labels": labels})
    micro, sizes = own.batching.split(flat, 4)
    targets = list(labels.split(sizes))

    def clear() -> None:
        model.zero_grad(set_to_none=True)

    one_step = timed(lambda: pipe.step(input_ids=ids, target=labels, loss_fn=logits_fn), clear)
    own_step = timed(lambda: own.step(input_ids=ids, labels=labels), clear)
    one_reading = timed(lambda: reading.weights(out0, targets, sizes))
    own_counts = timed(lambda: own.batching.weights(flat, micro))

    def first_shape() -> float:  # a fresh reading each time: a new shape's cost
        fresh = LossFnReading(logits_fn, out_dims_of(pipe.batching.merges), pipe.capture.unflatten_output)
        return timed(lambda: fresh.weights(out0, targets, sizes))()

    one_step(), one_reading(), first_shape()  # warm up (the first fake-tensor trace of the process)
    own_step()
    med = rotating_medians([("step", one_step), ("reading", one_reading), ("own_step", own_step),
                            ("own_counts", own_counts)], repeat)
    firsts = [first_shape() for _ in range(max(3, repeat // 5))]
    pipe.close()
    own.close()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "repeat": repeat,
        "median_s": med,
        "first_shape_median_s": statistics.median(firsts),
        "reading_over_step": med["reading"] / med["step"],
        "own_counts_over_step": med["own_counts"] / med["own_step"],
        "first_shape_over_step": statistics.median(firsts) / med["step"],
        "goal": "reading_over_step <= 0.02 and own_counts_over_step <= 0.02",
    }
    result["met"] = result["reading_over_step"] <= 0.02 and result["own_counts_over_step"] <= 0.02
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"step {med['step'] * 1e3:.1f} ms; per-call reading {med['reading'] * 1e3:.2f} ms "
          f"({result['reading_over_step']:.2%}); labels= step {med['own_step'] * 1e3:.1f} ms, its counts "
          f"{med['own_counts'] * 1e3:.2f} ms "
          f"({result['own_counts_over_step']:.2%}); a new shape {result['first_shape_median_s'] * 1e3:.0f} ms "
          f"({result['first_shape_over_step']:.2f} steps), once per shape; goal met: {result['met']}")


if __name__ == "__main__":
    main()
