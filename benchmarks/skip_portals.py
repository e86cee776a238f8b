"""Skip connections through portals vs. threaded through every partition (paper §3.3, Table 1).

Two versions of one U-Net with long skips, same weights, same GPipe balance and chunks:

  (a) sequential: each layer returns ``(x, skip1, skip2, ...)``; every skip tensor crosses
      every partition boundary between its producer and its consumer (and its gradient
      crosses them back);
  (b) portals: ``@skippable`` encoders stash, decoders pop; a skip travels once, from its
      stash partition straight to its pop partition.

Reported per training step (forward + backward):

* ``move() bytes``: bytes passed to the runtime's single transfer function
  ``fxpipe.runtime._copy.move`` (batch copies, ``Copy``) plus the portals' reference to it
  (``fxpipe.runtime._portal.move``, ``PortalCopy``), forward and backward. On CPU the runtime
  skips batch copies between partitions on the same CPU device entirely, so in (a) this is
  0 on CPU while (b) still counts its portal copies (which are no-op ``.to('cpu')`` calls).
* ``logical bytes``: what crosses partition boundaries whatever the device: the tensors of
  every partition's input batch for partitions j > 0 (first forward pass only, not the
  recomputation), plus their gradients for those that require grad, plus the portal bytes
  (forward tensor + backward gradient). This is what would travel between GPUs.
* step time: median over ``--steps`` timed steps (after warm-up), forward + backward, the
  two forms timed alternately (A B B A ...) so that machine noise hits both alike.
* peak memory: ``torch.cuda.max_memory_allocated`` minus the allocation before the step on
  CUDA; on CPU ``benchmarks/_memory.py``'s ``cpu_peak``: over one step under
  ``torch.profiler(profile_memory=True)``, the raw allocator ``[memory]`` records (+bytes per
  allocation, -bytes per free, every thread) sorted by timestamp, running sum, maximum (not
  the allocator's caching). ``peak_memory_end_bytes`` is the running sum at the end: the
  parameter bytes, i.e. the new ``.grad`` tensors the step leaves; the step also frees the
  previous ones (``zero_grad(set_to_none=True)``), but the profiler records no free of a
  block allocated before it started. Everything else the step allocates is freed by its end.

Usage::

    python benchmarks/skip_portals.py                 # CPU, devices=['cpu'] * 4
    python benchmarks/skip_portals.py --device cuda   # one GPU per partition if available

Writes ``benchmarks/results/skip_portals.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fxpipe.runtime._copy as runtime_copy  # noqa: E402
import fxpipe.runtime._portal as portal_mod  # noqa: E402
from fxpipe import GPipe, is_recomputing  # noqa: E402
from fxpipe.skip import Namespace, pop, skippable, stash  # noqa: E402
from _memory import cpu_peak  # noqa: E402
from _device import stage_devices  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "skip_portals.json")


# ----------------------------------------------------------------------------- the U-Net


def block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class Cores(nn.Module):
    """The weights of the U-Net, shared (by deep copy) by both forms."""

    def __init__(self, depth: int, base: int, in_ch: int = 3, classes: int = 4) -> None:
        super().__init__()
        chans = [base * 2 ** k for k in range(depth + 1)]
        self.stem = nn.Conv2d(in_ch, base, 3, padding=1)
        self.enc = nn.ModuleList(block(chans[k], chans[k]) for k in range(depth))
        self.down = nn.ModuleList(nn.Conv2d(chans[k], chans[k + 1], 1) for k in range(depth))
        self.mid = block(chans[depth], chans[depth])
        self.up = nn.ModuleList(nn.ConvTranspose2d(chans[k + 1], chans[k], 2, stride=2) for k in range(depth))
        self.dec = nn.ModuleList(block(2 * chans[k], chans[k]) for k in range(depth))
        self.head = nn.Conv2d(base, classes, 1)


def encode(cores: Cores, k: int, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    h = cores.enc[k](x)
    return cores.down[k](F.max_pool2d(h, 2)), h


def decode(cores: Cores, k: int, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    return cores.dec[k](torch.cat([cores.up[k](x), skip], dim=1))


# (b) portals ---------------------------------------------------------------------------


class Stem(nn.Module):
    def __init__(self, cores: Cores) -> None:
        super().__init__()
        self.conv = cores.stem

    def forward(self, x):
        return self.conv(x)


@skippable(stash=["skip"])
class PortalEncoder(nn.Module):
    def __init__(self, cores: Cores, k: int) -> None:
        super().__init__()
        self.k = k
        self.enc, self.down = cores.enc[k], cores.down[k]

    def forward(self, x):
        h = self.enc(x)
        yield stash("skip", h)
        return self.down(F.max_pool2d(h, 2))


class Middle(nn.Module):
    def __init__(self, cores: Cores) -> None:
        super().__init__()
        self.mid = cores.mid

    def forward(self, x):
        return self.mid(x)


@skippable(pop=["skip"])
class PortalDecoder(nn.Module):
    def __init__(self, cores: Cores, k: int) -> None:
        super().__init__()
        self.up, self.dec = cores.up[k], cores.dec[k]

    def forward(self, x):
        skip = yield pop("skip")
        return self.dec(torch.cat([self.up(x), skip], dim=1))


class Head(nn.Module):
    def __init__(self, cores: Cores) -> None:
        super().__init__()
        self.head = cores.head

    def forward(self, x):
        return self.head(x)


def portal_unet(cores: Cores, depth: int) -> nn.Sequential:
    ns = [Namespace() for _ in range(depth)]
    layers: List[nn.Module] = [Stem(cores)]
    layers += [PortalEncoder(cores, k).isolate(ns[k]) for k in range(depth)]
    layers += [Middle(cores)]
    layers += [PortalDecoder(cores, k).isolate(ns[k]) for k in reversed(range(depth))]
    layers += [Head(cores)]
    return nn.Sequential(*layers)


# (a) sequential form: skips threaded through every layer as tuple elements ----------------


class SeqEncoder(nn.Module):
    def __init__(self, cores: Cores, k: int) -> None:
        super().__init__()
        self.enc, self.down = cores.enc[k], cores.down[k]

    def forward(self, x_and_skips):
        x, *skips = x_and_skips if isinstance(x_and_skips, tuple) else (x_and_skips,)
        h = self.enc(x)
        return (self.down(F.max_pool2d(h, 2)), *skips, h)


class SeqMiddle(nn.Module):
    def __init__(self, cores: Cores) -> None:
        super().__init__()
        self.mid = cores.mid

    def forward(self, x_and_skips):
        x, *skips = x_and_skips
        return (self.mid(x), *skips)


class SeqDecoder(nn.Module):
    def __init__(self, cores: Cores, k: int) -> None:
        super().__init__()
        self.up, self.dec = cores.up[k], cores.dec[k]

    def forward(self, x_and_skips):
        x, *skips = x_and_skips
        out = self.dec(torch.cat([self.up(x), skips[-1]], dim=1))
        return (out, *skips[:-1]) if len(skips) > 1 else out


def sequential_unet(cores: Cores, depth: int) -> nn.Sequential:
    layers: List[nn.Module] = [Stem(cores)]
    layers += [SeqEncoder(cores, k) for k in range(depth)]
    layers += [SeqMiddle(cores)]
    layers += [SeqDecoder(cores, k) for k in reversed(range(depth))]
    layers += [Head(cores)]
    return nn.Sequential(*layers)


# ----------------------------------------------------------------------------- measuring


def nbytes(t) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


class Counters:
    def __init__(self) -> None:
        self.enabled = False
        self.move_bytes = 0         # runtime.copy.move + portal.move, fwd + bwd
        self.portal_bytes = 0       # portal.move only, fwd + bwd
        self.boundary_bytes = 0     # partition inputs j > 0, fwd + grads

    def reset(self) -> None:
        self.move_bytes = self.portal_bytes = self.boundary_bytes = 0


@contextmanager
def instrumented(pipe: GPipe, counters: Counters) -> Iterator[None]:
    real_copy_move, real_portal_move = runtime_copy.move, portal_mod.move

    def copy_move(tensors, a, b):
        if counters.enabled:
            counters.move_bytes += sum(nbytes(t) for t in tensors)
        return real_copy_move(tensors, a, b)

    def portal_move(tensors, a, b):
        if counters.enabled:
            n = sum(nbytes(t) for t in tensors)
            counters.move_bytes += n
            counters.portal_bytes += n
        return real_portal_move(tensors, a, b)

    def pre_hook(module, args):
        if not counters.enabled or is_recomputing():
            return
        values = args[0] if isinstance(args[0], tuple) else (args[0],)
        for v in values:
            if isinstance(v, torch.Tensor):
                counters.boundary_bytes += nbytes(v) * (2 if v.requires_grad else 1)

    runtime_copy.move, portal_mod.move = copy_move, portal_move
    handles = [p.register_forward_pre_hook(pre_hook) for p in list(pipe.partitions)[1:]]
    try:
        yield
    finally:
        runtime_copy.move, portal_mod.move = real_copy_move, real_portal_move
        for h in handles:
            h.remove()


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def step(pipe: GPipe, x: torch.Tensor) -> None:
    pipe.zero_grad(set_to_none=True)
    y = pipe(x)
    y.float().pow(2).mean().backward()


def timed_step(pipe: GPipe, x: torch.Tensor, device: str) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    step(pipe, x)
    synchronize(device)
    return time.perf_counter() - t0


def interleaved_times(pipes: Dict[str, GPipe], x: torch.Tensor, args: argparse.Namespace) -> Dict[str, List[float]]:
    """Times the forms in alternating order (ABBA...) so drift and noise hit both alike."""
    names = list(pipes)
    for _ in range(args.warmup):
        for name in names:
            step(pipes[name], x)
    times: Dict[str, List[float]] = {name: [] for name in names}
    for i in range(args.steps):
        for name in (names if i % 2 == 0 else names[::-1]):
            times[name].append(timed_step(pipes[name], x, args.device))
    return times


def measure(name: str, pipe: GPipe, x: torch.Tensor, args: argparse.Namespace, times: List[float]) -> Dict[str, float]:
    counters = Counters()
    with instrumented(pipe, counters):
        step(pipe, x)                       # warm-up (workers, streams, allocator)
        counters.enabled = True
        step(pipe, x)
        counters.enabled = False
    logical = counters.boundary_bytes + counters.portal_bytes

    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step(pipe, x)
        synchronize(args.device)
        peak = torch.cuda.max_memory_allocated() - base
        peak_end = torch.cuda.memory_allocated() - base
        peak_how = "cuda max_memory_allocated - allocated before the step"
    elif args.no_profile:
        peak, peak_how, peak_end = float("nan"), "not measured", float("nan")
    else:
        prof = cpu_peak(lambda: step(pipe, x))
        peak, peak_how, peak_end = prof["peak_bytes"], prof["how"], prof["end_bytes"]

    return {
        "form": name,
        "move_bytes_per_step": counters.move_bytes,
        "portal_bytes_per_step": counters.portal_bytes,
        "boundary_bytes_per_step": counters.boundary_bytes,
        "logical_bytes_per_step": logical,
        "step_time_median_s": statistics.median(times),
        "step_time_min_s": min(times),
        "step_times_s": times,
        "peak_memory_bytes": peak,
        "peak_memory_end_bytes": peak_end,
        "peak_memory_how": peak_how,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image", type=int, default=64)
    parser.add_argument("--base", type=int, default=16, help="channels of the first level")
    parser.add_argument("--depth", type=int, default=3, help="encoder/decoder pairs (long skips)")
    parser.add_argument("--balance", type=str, default=None, help="comma-separated; default: by layer count")
    parser.add_argument("--checkpoint", default="except_last", choices=["always", "except_last", "never"])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--no-profile", action="store_true", help="skip the CPU memory profile")
    parser.add_argument("--output", default=RESULTS)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: depth 2, base 8, 32x32, batch 8, chunks 4, 3 steps, no CPU memory profile")
    args = parser.parse_args(argv)
    if args.quick:
        args.depth, args.base, args.image, args.batch, args.chunks = 2, 8, 32, 8, 4
        args.steps, args.warmup, args.no_profile = 3, 1, True

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)

    n_layers = 2 * args.depth + 3
    if args.balance:
        balance = [int(b) for b in args.balance.split(",")]
    else:
        base, extra = divmod(n_layers, args.partitions)
        balance = [base + (1 if j < extra else 0) for j in range(args.partitions)]
    devices = stage_devices(args.device, len(balance))  # contiguous stages per GPU

    torch.manual_seed(0)
    cores = Cores(args.depth, args.base)
    models = {
        "sequential": sequential_unet(copy.deepcopy(cores), args.depth),
        "portals": portal_unet(copy.deepcopy(cores), args.depth),
    }
    x = torch.randn(args.batch, 3, args.image, args.image, device=devices[0])

    # Same weights, same function: check once before timing.
    pipes = {name: GPipe(m, balance, devices=devices, chunks=args.chunks, checkpoint=args.checkpoint)
             for name, m in models.items()}
    with torch.no_grad():
        ya, yb = pipes["sequential"](x), pipes["portals"](x)
    torch.testing.assert_close(ya, yb)

    times = interleaved_times(pipes, x, args)
    rows = [measure(name, pipe, x, args, times[name]) for name, pipe in pipes.items()]
    seq, por = rows

    def ratio(a, b):
        return a / b if b else float("nan")

    summary = {
        "logical_bytes_ratio_portals_over_sequential": ratio(por["logical_bytes_per_step"], seq["logical_bytes_per_step"]),
        "step_time_ratio_portals_over_sequential": ratio(por["step_time_median_s"], seq["step_time_median_s"]),
        "throughput_gain_portals": ratio(seq["step_time_median_s"], por["step_time_median_s"]) - 1,
        "peak_memory_ratio_portals_over_sequential": ratio(por["peak_memory_bytes"], seq["peak_memory_bytes"]),
    }
    config = {
        "device": args.device, "devices": devices, "balance": balance, "chunks": args.chunks,
        "checkpoint": args.checkpoint, "batch": args.batch, "image": args.image, "base": args.base,
        "depth": args.depth, "steps": args.steps, "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    result = {"config": config, "rows": rows, "summary": summary,
              "counting": (__doc__ or "").split("Reported per training step")[1].split("Usage::")[0].strip()}

    mib = 2 ** 20
    print(f"U-Net depth {args.depth} ({n_layers} layers), batch {args.batch}x3x{args.image}x{args.image}, "
          f"balance {balance}, chunks {args.chunks}, checkpoint={args.checkpoint}, devices {devices[0]} x{len(devices)}, "
          f"torch threads {torch.get_num_threads()}")
    header = f"{'form':<11} {'move() MiB':>11} {'logical MiB':>12} {'portal MiB':>11} {'step median ms':>15} {'step min ms':>12} {'peak MiB':>9}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['form']:<11} {r['move_bytes_per_step'] / mib:>11.2f} {r['logical_bytes_per_step'] / mib:>12.2f} "
              f"{r['portal_bytes_per_step'] / mib:>11.2f} {r['step_time_median_s'] * 1e3:>15.1f} "
              f"{r['step_time_min_s'] * 1e3:>12.1f} {r['peak_memory_bytes'] / mib:>9.1f}")
    print()
    print(f"portals / sequential: logical bytes x{summary['logical_bytes_ratio_portals_over_sequential']:.3f}, "
          f"step time x{summary['step_time_ratio_portals_over_sequential']:.3f} "
          f"(throughput {summary['throughput_gain_portals'] * 100:+.1f}%), "
          f"peak memory x{summary['peak_memory_ratio_portals_over_sequential']:.3f}")
    print("move(): bytes through fxpipe.runtime._copy.move + fxpipe.runtime._portal.move per step (fwd+bwd); on CPU the "
          "runtime skips same-device batch copies, so the sequential form shows 0 there.")
    print("logical: partition inputs for j>0 (+ their gradients) + portal tensors and gradients: what would cross "
          "devices. Peak memory: " + rows[0]["peak_memory_how"] + ".")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {os.path.relpath(args.output)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
