"""The paper's headline claims: throughput against torchgpipe, and the runtime's ablation.

(a) **Throughput.** A ResNet-like ``nn.Sequential`` (stem, bottleneck residual blocks with
GroupNorm -- BatchNorm would make micro-batching change the values --, pooled linear head),
one training step ``out = model(x); out.square().mean().backward()``, in samples/s, for:
``eager`` (the plain model), ``fxpipe.GPipe``, ``torchgpipe`` 0.0.7's ``GPipe`` (both on the
same even balance and devices), and ``fxpipe.pipeline`` cut at the same layers
(``split_points``), for several stage counts n and chunks m, ``checkpoint='except_last'``.

(b) **Ablation** on skip_portals.py's U-Net (the same model and forms; see there), n stages,
m chunks, fxpipe.GPipe: the full runtime, then one thing off per row -- *portals* (the
sequential form: skips carried through every stage), *copy streams* (copies on the compute
stream), *recompute ahead* (recomputation where backward first unpacks a saved tensor,
after the gradient copy, not forked ahead of it) and *backward order* (no Fork/Join between
micro-batches); one row turns recompute-ahead on everywhere, since the default uses it only
where a later stage is on another device (on one GPU: nowhere). The switches are ``PipelineRunner`` attributes (fxpipe/runtime/_pipeline.py);
a row whose switch this checkout lacks is skipped with a message. On CPU the copy-stream and
recompute-ahead switches change nothing (no streams; CPU pipelines recompute where the first
saved tensor is unpacked; order_backward's default leaves the Fork/Join out on CPU), and on one GPU split into stages the stages share one compute
stream, so what the switches buy there is bounded; several GPUs show the paper's setting.

Before timing, every contender's output and every gradient is compared with the eager
model (``torch.testing.assert_close``; on CUDA with TF32 off, rtol 1e-3 / atol 1e-4, since
micro-batches pick other kernels); a contender that differs is reported and not timed, and
the script exits 1. Timing: steps interleaved across contenders in a rotating order,
medians; ``_device.timed`` synchronizes the GPUs around each step. Peak memory (CUDA):
``max_memory_allocated`` over one step.

Usage::

    python benchmarks/throughput.py --device cpu --quick     # tiny sizes, a smoke run
    python benchmarks/throughput.py --device cuda --quick    # GPU-sized, short (~1 min on an H100)
    python benchmarks/throughput.py --device cuda            # more configurations and steps
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import fxpipe  # noqa: E402
from fxpipe.runtime._pipeline import PipelineRunner  # noqa: E402
from _device import add_device_argument, check_device, describe, first_device, label, peak_bytes, stage_devices, timed  # noqa: E402
from skip_portals import Cores, portal_unet, sequential_unet  # noqa: E402

ABLATIONS: Dict[str, Dict[str, Any]] = {
    "full runtime": {},
    "no portals (skips through every stage)": {"form": "sequential"},
    "no copy streams": {"copy_streams_on": False},
    "no recompute ahead": {"recompute_ahead": False},
    "recompute ahead everywhere": {"recompute_ahead": True},
    "no backward order (Fork/Join)": {"order_backward": False},
}
# Sizes: (cpu, cuda) x (quick, full).
SIZES = {
    ("cpu", True): dict(width=16, blocks=6, image=16, batch=16, ns=[2, 4], ms=[2, 4], steps=3, warmup=1,
                        unet=dict(depth=2, base=8, image=32, batch=8, n=4, m=4)),
    ("cpu", False): dict(width=32, blocks=14, image=32, batch=32, ns=[2, 4], ms=[1, 4, 8], steps=5, warmup=2,
                         unet=dict(depth=3, base=16, image=64, batch=32, n=4, m=8)),
    ("cuda", True): dict(width=256, blocks=14, image=32, batch=128, ns=[2, 4], ms=[4, 16], steps=6, warmup=2,
                         unet=dict(depth=4, base=64, image=128, batch=32, n=4, m=8)),
    ("cuda", False): dict(width=256, blocks=30, image=32, batch=256, ns=[1, 2, 4, 8], ms=[1, 4, 16, 32], steps=10,
                          warmup=3, unet=dict(depth=5, base=64, image=256, batch=32, n=4, m=8)),
}


class Bottleneck(nn.Module):
    """ResNet's bottleneck, GroupNorm instead of BatchNorm (exact under micro-batching)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        mid = max(width // 4, 4)
        g = 4 if mid % 4 == 0 else 1
        self.f = nn.Sequential(
            nn.Conv2d(width, mid, 1, bias=False), nn.GroupNorm(g, mid), nn.ReLU(),
            nn.Conv2d(mid, mid, 3, padding=1, bias=False), nn.GroupNorm(g, mid), nn.ReLU(),
            nn.Conv2d(mid, width, 1, bias=False), nn.GroupNorm(g, width),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.f(x))


def resnet(width: int, blocks: int, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.GroupNorm(4, width), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
    return nn.Sequential(stem, *[Bottleneck(width) for _ in range(blocks)], head)


def even_balance(layers: int, n: int) -> List[int]:
    q, r = divmod(layers, n)
    return [q + 1 if k < r else q for k in range(n)]


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    loss_of(out).backward()
    return out


def zero(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def check(out: torch.Tensor, params: Sequence[nn.Parameter], ref_out: torch.Tensor,
          ref_grads: Sequence[torch.Tensor], tol: Dict[str, float]) -> Tuple[bool, float, str]:
    """Output and every gradient against eager: (exact, max abs error, first mismatch)."""
    pairs = [("output", out, ref_out)] + [(f"grad {k}", p.grad, g) for k, (p, g) in enumerate(zip(params, ref_grads))]
    worst = 0.0
    for name, a, b in pairs:
        if a is None or b is None:
            return False, float("inf"), f"{name}: missing"
        a, b = a.detach().cpu(), b.detach().cpu()
        worst = max(worst, (a - b).abs().max().item())
        try:
            torch.testing.assert_close(a, b, **tol)
        except AssertionError as exc:
            return False, worst, f"{name}: {str(exc).splitlines()[0]}"
    return True, worst, ""


class Contender:
    """One model to time: a step function, its parameters and an exactness verdict."""

    def __init__(self, name: str, model: nn.Module, params: Sequence[nn.Parameter], x: torch.Tensor) -> None:
        self.name, self.model, self.params, self.x = name, model, list(params), x
        self.times: List[float] = []
        self.exact, self.max_err, self.why = True, 0.0, ""
        self.peak: Optional[int] = None

    def run(self) -> torch.Tensor:
        zero(self.params)
        return step(self.model, self.x)


def time_interleaved(contenders: List[Contender], device: str, steps: int, warmup: int) -> None:
    """Warm-up, then ``steps`` rounds over the exact contenders in a rotating order."""
    live = [c for c in contenders if c.exact]
    for c in live:
        for _ in range(warmup):
            c.run()
        c.peak = peak_bytes(device, c.run)
    for r in range(steps):
        for c in live[r % len(live):] + live[:r % len(live)]:
            zero(c.params)
            c.times.append(timed(device, lambda: step(c.model, c.x)))


def summary(c: Contender, batch: int) -> Dict[str, Any]:
    if not c.exact:
        return {"name": c.name, "exact": False, "max_abs_error": c.max_err, "mismatch": c.why}
    med = statistics.median(c.times)
    return {"name": c.name, "exact": True, "max_abs_error": c.max_err, "median_step_ms": med * 1e3,
            "min_step_ms": min(c.times) * 1e3, "samples_per_s": batch / med, "peak_bytes": c.peak,
            "steps_ms": [round(t * 1e3, 3) for t in c.times]}


def verify(contenders: List[Contender], ref: Contender, tol: Dict[str, float]) -> None:
    ref_out = ref.run().detach()
    ref_grads = [p.grad.detach().clone() for p in ref.params]
    for c in contenders:
        if c is ref:
            continue
        out = c.run()
        c.exact, c.max_err, c.why = check(out, c.params, ref_out, ref_grads, tol)
        if not c.exact:
            print(f"  NOT EXACT, not timed: {c.name}: {c.why}", flush=True)


def throughput_rows(a: argparse.Namespace, s: Dict[str, Any], tg: Any, tol: Dict[str, float]) -> List[Dict[str, Any]]:
    base = resnet(s["width"], s["blocks"])
    layers = len(base)
    torch.manual_seed(1)
    x = torch.randn(s["batch"], 3, s["image"], s["image"], device=first_device(a.device))
    rows = []
    for n in s["ns"]:
        for m in s["ms"]:
            balance, devices = even_balance(layers, n), stage_devices(a.device, n)
            cuts = [str(sum(balance[:k])) for k in range(1, n)]
            eager = copy.deepcopy(base).to(first_device(a.device))
            cs = [Contender("eager", eager, eager.parameters(), x)]
            fx = fxpipe.GPipe(copy.deepcopy(base), balance, devices=devices, chunks=m, checkpoint=a.checkpoint)
            cs.append(Contender("fxpipe.GPipe", fx, fx.parameters(), x))
            if tg is not None:
                t = tg.GPipe(copy.deepcopy(base), balance, devices=devices, chunks=m, checkpoint=a.checkpoint)
                cs.append(Contender("torchgpipe", t, t.parameters(), x))
            model = copy.deepcopy(base).to(first_device(a.device))
            pl = fxpipe.pipeline(model, x, n, chunks=m, devices=devices, checkpoint=a.checkpoint,
                                 split_points=cuts or None, balance_by="params")
            cs.append(Contender("fxpipe.pipeline", pl, model.parameters(), x))
            verify(cs, cs[0], tol)
            time_interleaved(cs, a.device, s["steps"], s["warmup"])
            row = {"n": n, "m": m, "balance": balance, "devices": devices,
                   "contenders": [summary(c, s["batch"]) for c in cs]}
            rows.append(row)
            print(format_throughput_row(row), flush=True)
            for c in cs:
                if hasattr(c.model, "close"):
                    c.model.close()
            del cs, fx, pl
    return rows


def throughput_table(rows: List[Dict[str, Any]]) -> str:
    head = ("| n | m | eager samples/s | fxpipe.GPipe | torchgpipe | fxpipe.pipeline | GPipe fx/tg | "
            "pipeline fx/tg | peak MiB fx / tg |\n|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    return "\n".join([head] + [format_throughput_row(r) for r in rows])


def _by_name(row: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    return {c["name"]: c for c in row["contenders"]}


def _sps(c: Optional[Dict[str, Any]]) -> str:
    if c is None:
        return "absent"
    return f"{c['samples_per_s']:.1f}" if c["exact"] else "NOT EXACT"


def _ratio(a: Optional[Dict[str, Any]], b: Optional[Dict[str, Any]]) -> str:
    if not (a and b and a["exact"] and b["exact"]):
        return "n/a"
    return f"{a['samples_per_s'] / b['samples_per_s']:.2f}"


def _mib(c: Optional[Dict[str, Any]]) -> str:
    return f"{c['peak_bytes'] / 2**20:.0f}" if c and c.get("peak_bytes") is not None else "-"


def format_throughput_row(r: Dict[str, Any]) -> str:
    c = _by_name(r)
    e, g, t, p = c.get("eager"), c.get("fxpipe.GPipe"), c.get("torchgpipe"), c.get("fxpipe.pipeline")
    return (f"| {r['n']} | {r['m']} | {_sps(e)} | {_sps(g)} | {_sps(t)} | {_sps(p)} | {_ratio(g, t)} | "
            f"{_ratio(p, t)} | {_mib(g)} / {_mib(t)} |")


def ablation_rows(a: argparse.Namespace, s: Dict[str, Any], tol: Dict[str, float]) -> List[Dict[str, Any]]:
    u = s["unet"]
    torch.manual_seed(0)
    cores = Cores(u["depth"], u["base"])
    layers = 2 * u["depth"] + 3
    balance, devices = even_balance(layers, u["n"]), stage_devices(a.device, u["n"])
    x = torch.randn(u["batch"], 3, u["image"], u["image"], device=first_device(a.device))
    ref_cores = copy.deepcopy(cores).to(first_device(a.device))
    cs = [Contender("eager", sequential_unet(ref_cores, u["depth"]), ref_cores.parameters(), x)]
    skipped: Dict[str, str] = {}
    for name, spec in ABLATIONS.items():
        switches = {k: v for k, v in spec.items() if k != "form"}
        missing = [k for k in switches if not hasattr(PipelineRunner, k)]
        if missing:
            skipped[name] = f"this checkout's PipelineRunner has no {', '.join(missing)} switch"
            print(f"  skipped '{name}': {skipped[name]}", flush=True)
            continue
        own = copy.deepcopy(cores)
        form = sequential_unet if spec.get("form") == "sequential" else portal_unet
        pipe = fxpipe.GPipe(form(own, u["depth"]), balance, devices=devices, chunks=u["m"], checkpoint=a.checkpoint)
        for k, v in switches.items():
            setattr(pipe._runtime, k, v)
        cs.append(Contender(name, pipe, own.parameters(), x))
    verify(cs, cs[0], tol)
    time_interleaved(cs, a.device, s["steps"], s["warmup"])
    rows = [summary(c, u["batch"]) for c in cs]
    for name, why in skipped.items():
        rows.append({"name": name, "skipped": why})
    for c in cs:
        if hasattr(c.model, "close"):
            c.model.close()
    return rows


def ablation_table(rows: List[Dict[str, Any]]) -> str:
    full = next((r for r in rows if r["name"] == "full runtime" and r.get("exact")), None)
    lines = ["| configuration | step median ms | samples/s | vs full runtime | peak MiB | max abs err vs eager |",
             "|---|--:|--:|--:|--:|--:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} | | | | |")
        elif not r["exact"]:
            lines.append(f"| {r['name']} | NOT EXACT: {r['mismatch']} | | | | {r['max_abs_error']:.1e} |")
        else:
            rel = f"{r['samples_per_s'] / full['samples_per_s']:.3f}" if full else "n/a"
            mib = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] is not None else "-"
            lines.append(f"| {r['name']} | {r['median_step_ms']:.1f} | {r['samples_per_s']:.1f} | {rel} | {mib} | "
                         f"{r['max_abs_error']:.1e} |")
    return "\n".join(lines)


def import_torchgpipe() -> Any:
    try:
        import torchgpipe  # type: ignore
        return torchgpipe
    except ImportError as exc:
        print(f"torchgpipe not importable ({exc}); its column reads 'absent'. Install the bench extra: "
              "pip install torchgpipe==0.0.7", flush=True)
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_device_argument(p)
    p.add_argument("--quick", action="store_true", help="short run: fewer configurations and steps")
    p.add_argument("--only", choices=["throughput", "ablation"], default=None, help="run one part")
    p.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender")
    p.add_argument("--out", default=None, help="JSON (default results/throughput[-quick]-<device>.json)")
    p.add_argument("--markdown", default=None, help="also write the tables to this markdown file")
    a = p.parse_args(argv)
    check_device(a.device)
    s = dict(SIZES[(a.device, a.quick)])
    if a.steps:
        s["steps"] = a.steps
    if a.device == "cuda":
        # Exactness is checked in fp32; TF32 would round differently per micro-batch size.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        if torch.cuda.device_count() > 1:
            s["ns"] = sorted(set(s["ns"]) | {torch.cuda.device_count()})
    tol = dict(rtol=1e-3, atol=1e-4) if a.device == "cuda" else dict(rtol=1e-4, atol=1e-5)
    started = _dt.datetime.now().astimezone()
    print(f"throughput.py on {label(a.device)}; torch {torch.__version__}; sizes {s}", flush=True)
    result: Dict[str, Any] = {"benchmark": "throughput", "date": started.isoformat(timespec="seconds"),
                              "command": " ".join(["python", "benchmarks/throughput.py"] + list(argv or sys.argv[1:])),
                              "machine": describe(a.device), "sizes": s, "checkpoint": a.checkpoint, "tolerance": tol}
    md = [f"Device: {label(a.device)}; torch {torch.__version__}; checkpoint `{a.checkpoint}`; "
          f"command `{result['command']}`"]
    if a.only in (None, "throughput"):
        tg = import_torchgpipe()
        result["torchgpipe"] = getattr(tg, "__version__", None)
        print(f"(a) throughput, ResNet-like width {s['width']} x {s['blocks']} blocks, batch {s['batch']}, "
              f"{s['image']}x{s['image']}, samples/s (median of {s['steps']}):", flush=True)
        print(throughput_table([]).rstrip("\n"), flush=True)
        result["throughput"] = throughput_rows(a, s, tg, tol)
        md += ["", f"(a) Throughput, samples/s, ResNet-like (width {s['width']}, {s['blocks']} bottleneck blocks, "
               f"GroupNorm), batch {s['batch']}, {s['image']}x{s['image']}, same even balance:", "",
               throughput_table(result["throughput"])]
    if a.only in (None, "ablation"):
        u = s["unet"]
        print(f"(b) ablation, U-Net depth {u['depth']} base {u['base']}, batch {u['batch']}, "
              f"{u['image']}x{u['image']}, n={u['n']}, m={u['m']}:", flush=True)
        result["ablation"] = ablation_rows(a, s, tol)
        table = ablation_table(result["ablation"])
        print(table, flush=True)
        md += ["", f"(b) Ablation, fxpipe.GPipe on skip_portals.py's U-Net (depth {u['depth']}, base {u['base']}), "
               f"batch {u['batch']}, {u['image']}x{u['image']}, n={u['n']}, m={u['m']}:", "", table]
    out = Path(a.out) if a.out else HERE / "results" / f"throughput{'-quick' if a.quick else ''}-{a.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    if a.markdown:
        Path(a.markdown).write_text("\n".join(md) + "\n")
    exact = all(c.get("exact", True) for r in result.get("throughput", []) for c in r["contenders"])
    exact = exact and all(r.get("exact", True) for r in result.get("ablation", []))
    if not exact:
        print("some contender is NOT EXACT (see above): exit 1")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
