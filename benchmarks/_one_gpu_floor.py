"""``one_gpu.py --floor``: each uncompiled pipeline row's peak next to the activation-memory
floor of its chunks and checkpoint mode (``benchmarks/_floor.py``, as
``activation_memory.py`` computes it, with this benchmark's cross-entropy loss).

The floor counts what the step allocates beyond parameters, buffers and existing ``.grad``,
so the peak set beside it is measured the same way: one more step with the gradients zeroed
in place (the timed steps set them to None, and count them). The floor's per-stage terms
(what the other micro-batches hold while the last one runs stage ``p``'s backward, plus that
micro-batch's own peak then) are in the JSON.
"""

from __future__ import annotations

import gc
from typing import Any, Dict, List

import torch

import _floor as floor
import _one_gpu_rows as R
from _memory import Meter

MODES = ("never", "except_last", "always")


def floor_parts(pipe: Any, model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor, chunks: int,
                device: torch.device) -> Dict[str, Any]:
    """The floor of every checkpoint mode for ``chunks`` micro-batches of ``pipe``'s stages."""
    stages = pipe.stages.modules
    flat = pipe.capture.flatten_inputs((ids,), {})
    micro, sizes = pipe.batching.split(flat, chunks)
    exclude = {floor.storage_key(t) for t in [*model.parameters(), *model.buffers(), *floor.tensors(flat)]}
    leaves = micro[-1]

    def merge(outputs: List[List[Any]]) -> Any:
        return pipe.capture.unflatten_output(pipe.batching.merge(outputs, sizes))

    def loss(out: Any) -> None:
        R.loss_of(out, targets).backward()

    received = floor.received_bytes(stages, leaves, exclude)
    saved = floor.saved_bytes(stages, leaves, exclude)
    with torch.no_grad():
        ios = floor.walk(stages, leaves)
    rest = [ios[-1].output] * (len(micro) - 1)
    gc.collect()
    phases = floor.last_micro_batch_phases(stages, leaves, rest, merge, loss, device)
    alone = floor.stage_alone_peaks(stages, ios, rest, merge, loss, exclude, device)
    return {"received_bytes": received, "saved_bytes": saved, "last_micro_batch_phases": phases,
            "stage_alone_peak_bytes": alone, "floors": floor.floors(len(micro), received, saved, phases, alone)}


def peak_with_grads_kept(runner: R.Runner, ids: torch.Tensor, targets: torch.Tensor, device: torch.device) -> int:
    """One step's peak with ``.grad`` already allocated and zeroed in place (as the floor counts)."""
    for _, p in runner.named:
        if p.grad is not None:
            p.grad.zero_()
    gc.collect()
    return int(Meter(device).run(lambda: runner.step(ids, targets))["peak_bytes"])


def floor_row(runner: R.Runner, key: str, ids: torch.Tensor, targets: torch.Tensor, device: torch.device,
              cache: Dict[int, Dict[str, Any]]) -> Dict[str, Any]:
    """The row's peak (gradients kept) and its mode's floor; ``cache``: floors per chunks."""
    chunks, mode, _ = R.parse_pipe(key)
    runner.zero()
    runner.step(ids, targets)  # .grad exists from here on
    peak = peak_with_grads_kept(runner, ids, targets, device)
    if chunks not in cache:
        runner.zero()
        cache[chunks] = floor_parts(runner.call, runner.model, ids, targets, chunks, device)
    best = cache[chunks]["floors"][mode]
    return {"peak_grads_kept_bytes": peak, "floor_bytes": best["floor_bytes"], "floor_phase": best["phase"],
            "floor_held_bytes": best["held_bytes"], "floor_last_bytes": best["last_bytes"],
            "ratio": peak / best["floor_bytes"] if best["floor_bytes"] else None,
            "parts": {k: v for k, v in cache[chunks].items() if k != "floors"}}


def print_floors(model: str, rows: List[Dict[str, Any]], gib: bool) -> None:
    measured = [r for r in rows if "floor" in r]
    if not measured:
        return
    unit, div = ("GiB", 2**30) if gib else ("MiB", 2**20)
    print()
    print(f"Activation memory against its floor on {model} (peak of one step with .grad kept, as the floor counts; "
          "benchmarks/_floor.py):")
    print(f"| run | peak {unit} | floor {unit} | peak / floor | floor set in | held {unit} | last micro-batch {unit} |")
    print("|---|--:|--:|--:|---|--:|--:|")
    for r in measured:
        f = r["floor"]
        if "error" in f:
            print(f"| {r['label']} | | | | **{f['error']}** | | |")
            continue
        where = "forward" if f["floor_phase"] < 0 else f"stage {f['floor_phase']} backward"
        ratio = f"{f['ratio']:.3f}" if f["ratio"] is not None else ""
        print(f"| {r['label']} | {f['peak_grads_kept_bytes'] / div:.2f} | {f['floor_bytes'] / div:.2f} | {ratio} "
              f"| {where} | {f['floor_held_bytes'] / div:.2f} | {f['floor_last_bytes'] / div:.2f} |")
