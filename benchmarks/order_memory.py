"""Activation memory of a training step in GPipe's order and in 1F1B's, per stage and whole.

For each model, chunks ``m`` and checkpoint mode, one ``pipe.step(x, loss_fn=...)`` of
``fxpipe.pipeline(model, x, 4, chunks=m, checkpoint=mode, schedule=order)`` (every stage on
one device: one memory pool) is measured in both orders, and ``out = pipe(x)`` with
``loss(out).backward()`` as well, next to the GPipe floor that
``benchmarks/activation_memory.py`` computes (``benchmarks/_floor.py``):

* **step peak**: the whole step's peak (``benchmarks/_memory.py``: CPU profiler records,
  or ``torch.cuda.max_memory_allocated``), activations and temporaries, after a warm-up step;
* **per stage**: what each stage holds for later backward, at most, during the step (a second,
  unprofiled run): the storages its non-checkpointed forwards saved (saved-tensor hooks: a
  task's bytes count while autograd keeps any of them), and the inputs its checkpointed tasks
  keep for their recomputation (weak references); each storage counted once, for the first
  task that holds it; parameters, buffers and the user's batch not counted. Beside the bytes,
  the most micro-batches a stage held at once: ``m`` in GPipe's order, ``n - j`` in 1F1B's.
  CPU only: on CUDA the stages run on worker threads, which this thread's saved-tensor hooks
  do not reach (the columns show '-').

The floor is GPipe's for ``out = pipe(x); loss(out).backward()``, the merged output held
meanwhile, which ``pipe(x)`` rows measure. A GPipe-order ``step`` never merges the outputs, so
it may fall a little below; 1F1B's order holds fewer micro-batches than any GPipe
implementation must, so it falls below by far (that is the point).
The loss is ``out.float().pow(2).mean()`` per micro-batch (one 'mean' over the batch).

Usage::

    .venv/bin/python benchmarks/order_memory.py                          # CPU: U-Net and GPT, chunks 4 and 8
    .venv/bin/python benchmarks/order_memory.py --device cuda --chunks 8 --models gpt
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple  # noqa: E402

import torch  # noqa: E402

import activation_memory as am  # noqa: E402  (puts the repository, tests/ and benchmarks/ on the path)
import fxpipe  # noqa: E402
from fxpipe import is_checkpointing, is_recomputing  # noqa: E402

import _floor as floor  # noqa: E402
from _memory import peak  # noqa: E402
from _results import header, write_json  # noqa: E402

#: 'pipe(x)': ``out = pipe(x); loss(out).backward()`` (GPipe's order, the merged output held, as
#: ``activation_memory.py`` measures it); 'gpipe' and '1f1b': ``pipe.step`` in that order
ORDERS = ("pipe(x)", "gpipe", "1f1b")
MIB = float(1 << 20)


def loss_fn(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


class _Task:
    """One forward task's held storages: (key, bytes) first counted for it."""

    def __init__(self, j: int, i: int) -> None:
        self.j, self.i = j, i
        self.storages: List[Tuple[int, int]] = []


class HeldPerStage:
    """What each stage holds for backward, sampled at every stage call (see the docstring)."""

    def __init__(self, stages: Sequence[torch.nn.Module], exclude: Set[int]) -> None:
        self.stages = list(stages)
        self.exclude = set(exclude)
        self.tasks: List[weakref.ref] = []  # non-checkpointed tasks, alive while autograd holds their saves
        self.kept: List[Tuple[int, int, List[Tuple[weakref.ref, int, int]]]] = []  # checkpointed: (j, i, inputs)
        self.counted: Dict[int, int] = {}  # storage key -> stage that first held it
        self.calls = [0] * len(self.stages)
        self.most_bytes = [0] * len(self.stages)
        self.most_micro = [0] * len(self.stages)
        self._current: Optional[_Task] = None
        self._alive: List[_Task] = []  # strong refs would keep tasks alive: tokens live in the packs

    def _sample(self) -> None:
        held = [0] * len(self.stages)
        micro: List[Set[int]] = [set() for _ in self.stages]
        seen: Set[int] = set()
        for ref in self.tasks:
            task = ref()
            if task is None:
                continue
            for key, nbytes in task.storages:
                if key not in seen:
                    seen.add(key)
                    held[task.j] += nbytes
                    micro[task.j].add(task.i)
        for j, i, inputs in self.kept:
            for ref, key, nbytes in inputs:
                if ref() is not None and key not in seen:
                    seen.add(key)
                    held[j] += nbytes
                    micro[j].add(i)
        for j in range(len(self.stages)):
            self.most_bytes[j] = max(self.most_bytes[j], held[j])
            self.most_micro[j] = max(self.most_micro[j], len(micro[j]))

    def run(self, fn: Callable[[], Any]) -> Dict[str, List[int]]:
        def pre(j: int) -> Callable[..., None]:
            def hook(module: Any, args: Any) -> None:
                self._sample()
                if is_recomputing():
                    self._current = None
                    return
                i = self.calls[j]
                self.calls[j] += 1
                if is_checkpointing():
                    inputs = [(weakref.ref(a), floor.storage_key(a), a.untyped_storage().nbytes())
                              for a in args if isinstance(a, torch.Tensor)]
                    self.kept.append((j, i, [x for x in inputs if x[1] not in self.exclude]))
                    self._current = None
                else:
                    self._current = _Task(j, i)
                    self.tasks.append(weakref.ref(self._current))
            return hook

        def post(module: Any, args: Any, out: Any) -> None:
            self._current = None
            self._sample()

        def pack(t: torch.Tensor) -> Any:
            task = self._current
            if task is not None:
                key = floor.storage_key(t)
                if key not in self.exclude and key not in {k for k, _ in task.storages}:
                    task.storages.append((key, t.untyped_storage().nbytes()))
            return (t, task)  # the task lives as long as autograd keeps one of its saved tensors

        handles = [s.register_forward_pre_hook(pre(j)) for j, s in enumerate(self.stages)]
        handles += [s.register_forward_hook(post) for s in self.stages]
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p[0]):
                fn()
        finally:
            for h in handles:
                h.remove()
        return {"held_bytes": self.most_bytes, "held_micro_batches": self.most_micro}


def measure(pipe: Any, model: torch.nn.Module, x: torch.Tensor, device: torch.device, order: str) -> Dict[str, Any]:
    def step() -> None:
        if order == "pipe(x)":
            am.step(pipe, x)
        else:
            pipe.step(x, loss_fn=loss_fn)

    step()  # warm-up: .grad exists from now on
    am.zero_grads(model)
    gc.collect()
    row = peak(step, device)
    row.pop("phases", None)
    am.zero_grads(model)
    if device.type != "cpu":  # stages run on worker threads there, outside this thread's saved-tensor hooks
        row.update(held_bytes=None, held_micro_batches=None)
        return row
    exclude = {floor.storage_key(t) for t in [*model.parameters(), *model.buffers(), x]}
    row.update(HeldPerStage(pipe.stages.modules, exclude).run(step))
    return row


def run_model(name: str, a: argparse.Namespace, device: torch.device) -> Dict[str, Any]:
    model, x, what = am.build(name, a, device)
    devices = [device] * a.stages
    plan = fxpipe.pipeline(model, x, a.stages, chunks=1, devices=devices, balance_by=a.balance_by,
                           progress=False).plan
    rows: List[Dict[str, Any]] = []
    for chunks in a.chunks:
        parts: Optional[Dict[str, Any]] = None
        for mode in a.modes:
            for order in ORDERS:
                pipe = fxpipe.pipeline(model, x, a.stages, chunks=chunks, devices=devices, checkpoint=mode,
                                       plan=plan, progress=False,
                                       schedule="gpipe" if order == "pipe(x)" else order)
                try:
                    row = measure(pipe, model, x, device, order)
                    if parts is None:
                        parts = am.floor_parts(pipe, model, x, chunks, device)
                finally:
                    pipe.close()
                best = parts["floors"][mode]
                row.update(model=name, chunks=chunks, checkpoint=mode, order=order, floor_bytes=best["floor_bytes"],
                           ratio=row["peak_bytes"] / best["floor_bytes"])
                rows.append(row)
                del pipe
                model.zero_grad(set_to_none=True)
                gc.collect()
    return {"model": name, "description": what, "stages": a.stages, "rows": rows}


def print_table(result: Dict[str, Any], device: str) -> None:
    n = result["stages"]
    print(f"\n{result['description']}, {n} stages on {device}")
    stage_cols = " | ".join(f"stage {j} MiB (micro-batches)" for j in range(n))
    print(f"| chunks | checkpoint | order | step peak MiB | GPipe floor MiB | peak / floor | {stage_cols} |")
    print("|--:|---|---|--:|--:|--:|" + "--:|" * n)
    for r in result["rows"]:
        held = zip(r["held_bytes"], r["held_micro_batches"]) if r["held_bytes"] is not None else [None] * n
        stages = " | ".join("-" if h is None else f"{h[0] / MIB:.2f} ({h[1]})" for h in held)
        print(f"| {r['chunks']} | {r['checkpoint']} | {r['order']} | {r['peak_bytes'] / MIB:.2f} | "
              f"{r['floor_bytes'] / MIB:.2f} | {r['ratio']:.3f} | {stages} |")


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a, device = am.parse_model_arguments(p, argv, chunks=[4, 8])
    t0 = time.perf_counter()
    results = [run_model(name, a, device) for name in a.models]
    for result in results:
        print_table(result, a.device)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    out = Path(a.out) if a.out else am.ROOT / "benchmarks" / "results" / f"order_memory_{a.device}.json"
    doc = {
        **header("order_memory", a.device, cuda=torch.cuda.get_device_name(0) if a.device == "cuda" else None),
        "command": " ".join(["benchmarks/order_memory.py", *(argv if argv is not None else sys.argv[1:])]),
        "config": {k: v for k, v in vars(a).items() if k != "out"},
        "models": results,
    }
    write_json(str(out), doc)


if __name__ == "__main__":
    main()
