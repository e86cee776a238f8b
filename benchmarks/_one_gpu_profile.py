"""``one_gpu.py --profile DIR``: where one fxpipe step spends its time beyond the model's
work (issue 21 §0).

One ``fxpipe.pipeline(..., chunks=1, checkpoint='never')`` step of the model, after warm-up,
under ``torch.profiler`` (CPU, and CUDA on a GPU; Python stacks, memory). Every operator
event is attributed to the innermost frame of its Python stack that belongs to fxpipe or to
the model: an operator called from fxpipe's own code (copies, merges, RNG snapshots, portals,
phonies, checks) is fxpipe's cost, charged to that frame; one called from the model's code
(the stages' generated ``forward``, transformers, ``torch.nn``) is the model's work. The
table lists fxpipe's frames by time; ``DIR`` gets the Chrome trace and torch's own table.
"""

from __future__ import annotations

import copy
import re
from collections import defaultdict
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
from torch import nn

import fxpipe

import _one_gpu_rows as R

#: a frame of fxpipe's own code (the stages' generated code is the model's)
_FXPIPE = re.compile(r"(^|/)fxpipe/")
#: frames of the model's code: generated stage/graph modules, transformers, torch.nn, the loss
_MODEL = re.compile(r"<eval_with_key>|(^|/)transformers/|(^|/)torch/nn/|loss_of")
_BACKWARD = "autograd::engine::evaluate_function:"


def _device_time(e: Any) -> float:
    return float(getattr(e, "self_device_time_total", 0) or 0)


def place_of(e: Any) -> str:
    """The innermost of: an fxpipe frame (its cost), the model's code ('model forward'), an
    autograd node's backward ('model backward': fxpipe's own autograd Functions have Python
    frames inside it, found first); 'other' when none (the caller's loop, threads not followed)."""
    node = e
    if re.search(r"threading\.py\(\d+\): wait|queue\.py\(\d+\): get", e.name):
        return "waiting (a thread blocked)"
    while node is not None:
        name = node.name
        if _FXPIPE.search(name) and "(" in name:
            return re.sub(r"^.*?(fxpipe/)", r"\1", name)
        if _MODEL.search(name):
            return "model forward"
        if name.startswith(_BACKWARD):
            return "model backward"
        node = node.cpu_parent
    return "other"


def attribute(events: List[Any]) -> Dict[str, Dict[str, float]]:
    """Self CPU and device time (us) and event count per place (:func:`place_of`). Self times
    partition the step, Python functions' own time included (with_stack records them)."""
    places: Dict[str, Dict[str, Any]] = defaultdict(lambda: {"cpu_us": 0.0, "device_us": 0.0, "ops": 0})
    seen: Dict[str, float] = defaultdict(float)
    for e in events:
        if getattr(e, "device_type", None) is not None and e.device_type != torch.autograd.DeviceType.CPU:
            continue
        where = place_of(e)
        p = places[where]
        p["cpu_us"] += e.self_cpu_time_total
        p["device_us"] += _device_time(e)
        p["ops"] += 1
        if where == "other":
            seen[e.name] += e.self_cpu_time_total
    if "other" in places:  # what it is: waits on other threads, the profiler's own calls
        places["other"]["largest"] = dict(sorted(seen.items(), key=lambda kv: -kv[1])[:5])
    return dict(places)


def _all_threads() -> Any:
    """The profiler config that follows the worker threads fxpipe runs stages on (torch >= 2.8
    or so); None where this torch has no such option (then only the calling thread is seen)."""
    from torch.profiler import _ExperimentalConfig

    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        return None


def profile_pipe(master: nn.Module, ids: torch.Tensor, targets: torch.Tensor, device: torch.device,
                 out_dir: str, model: str, warmup: int) -> Dict[str, Any]:
    """Profiles one chunks=1 'never' step; prints the table, writes the trace; returns the places."""
    from torch.profiler import ProfilerActivity, profile

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    model_copy = copy.deepcopy(master).train()
    pipe = fxpipe.pipeline(model_copy, ids, R.STAGES, chunks=1, checkpoint="never", devices=[device] * R.STAGES,
                           balance_by="params", progress=False)
    runner = R.Runner(model_copy, pipe, close=pipe.close)
    try:
        for _ in range(max(warmup, 1)):
            runner.zero()
            runner.step(ids, targets)
        runner.zero()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        config = _all_threads()
        with profile(activities=activities, with_stack=True, profile_memory=True, record_shapes=False,
                     **({"experimental_config": config} if config is not None else {})) as prof:
            runner.step(ids, targets)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    finally:
        runner.close()
    trace = Path(out_dir) / f"{model}_pipe1_never_trace.json.gz"
    prof.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    (Path(out_dir) / f"{model}_pipe1_never_ops.txt").write_text(prof.key_averages().table(sort_by=sort, row_limit=60))
    places = attribute(list(prof.events()))
    print_places(model, places, str(trace), all_threads=config is not None)
    return {"trace": str(trace), "places": places, "all_threads": config is not None}


def print_places(model: str, places: Dict[str, Dict[str, float]], trace: Optional[str] = None,
                 all_threads: bool = True) -> None:
    total_cpu = sum(p["cpu_us"] for p in places.values()) or 1.0
    total_dev = sum(p["device_us"] for p in places.values()) or 1.0
    print()
    print(f"Profile of one fxpipe chunks=1 'never' step on {model}: self time of the operators each place "
          f"called{'' if all_threads else ' (this torch profiles the calling thread only)'} (trace: {trace}):")
    print("| called from | events | CPU ms | CPU share | device ms | device share |")
    print("|---|--:|--:|--:|--:|--:|")
    fx = {k: v for k, v in places.items() if k.startswith("fxpipe/")}
    total = {"cpu_us": sum(v["cpu_us"] for v in fx.values()), "device_us": sum(v["device_us"] for v in fx.values()),
             "ops": sum(v["ops"] for v in fx.values())}
    rest = {k: v for k, v in places.items() if k not in fx}
    head = [(k, rest[k]) for k in ("model forward", "model backward") if k in rest]
    head += [(f"**fxpipe, all {len(fx)} frames**", total)]
    head += [(k, v) for k, v in rest.items() if k not in ("model forward", "model backward")]
    frames = sorted(fx.items(), key=lambda kv: (-kv[1]["device_us"], -kv[1]["cpu_us"]))
    for name, p in head + frames[:20]:
        print(f"| {name} | {int(p['ops'])} | {p['cpu_us'] / 1e3:.2f} | {p['cpu_us'] / total_cpu:.3f} "
              f"| {p['device_us'] / 1e3:.2f} | {p['device_us'] / total_dev:.3f} |")
    if len(frames) > 20:
        print(f"| ({len(frames) - 20} more fxpipe frames, in the JSON) | | | | | |")
