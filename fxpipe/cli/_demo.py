"""The main job (``fxpipe demo``): pipeline a U-Net with long skips and check it against eager.

The U-Net below is an ordinary ``nn.Module`` (not ``nn.Sequential``): its encoder outputs
are used again by the decoder, so once cut into stages some of them skip stages and travel
as portals. The demo

1. builds ``fxpipe.pipeline(model, x, 4, chunks=4, balance_by='time')`` on the available
   devices (the CUDA devices if any, else the CPU for every stage),
2. runs one training step through the pipeline and the same step eagerly on an identical
   copy of the model, and compares outputs and every parameter gradient,
3. prints the plan table and the code of the stages that stash and pop a portal.

Exit code 0 and ``PASS`` when outputs and gradients match, 1 and ``FAIL`` otherwise.
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..progress import status_line
from ..runtime._devices import default_devices, set_threads

__all__ = ["UNet", "make_unet", "run_demo"]


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv2(F.relu(self.conv1(x))))


class UNet(nn.Module):
    """A small U-Net: 3 down-sampling and 3 up-sampling levels, skips from each encoder
    level to the decoder level of the same resolution (concatenated)."""

    def __init__(self, in_channels: int = 3, classes: int = 2, width: int = 8) -> None:
        super().__init__()
        c = width
        self.enc1 = DoubleConv(in_channels, c)
        self.enc2 = DoubleConv(c, 2 * c)
        self.enc3 = DoubleConv(2 * c, 4 * c)
        self.bottleneck = DoubleConv(4 * c, 8 * c)
        self.up3 = nn.ConvTranspose2d(8 * c, 4 * c, 2, stride=2)
        self.dec3 = DoubleConv(8 * c, 4 * c)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = DoubleConv(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec1 = DoubleConv(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        b = self.bottleneck(F.max_pool2d(e3, 2))
        d3 = self.dec3(torch.cat([self.up3(b), e3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


def make_unet(batch: int = 8, size: int = 32, seed: int = 0) -> tuple:
    """``(model, x)``: usable as ``fxpipe plan fxpipe.cli._demo:make_unet --stages 4``."""
    torch.manual_seed(seed)
    model = UNet()
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(seed + 1))
    return model, x


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def run_demo(stages: int = 4, chunks: int = 4, balance_by: str = "time",
             devices: Optional[Sequence[torch.device]] = None, threads: Optional[int] = None,
             out=None) -> int:
    """Runs the demo; returns the exit code (0: PASS, 1: FAIL)."""
    import fxpipe


    out = out or sys.stdout
    say = lambda *a: print(*a, file=out)  # noqa: E731
    model, x = make_unet()
    reference = copy.deepcopy(model)
    if devices is None:
        devices = default_devices(stages)
    say(f"fxpipe {fxpipe.__version__} demo: U-Net ({sum(p.numel() for p in model.parameters()) / 1e3:.1f}k params), "
        f"input {'x'.join(map(str, x.shape))}, {stages} stages x {chunks} micro-batches, balance_by={balance_by!r}")
    threads = set_threads(threads, devices)
    say(f"devices: {', '.join(str(d) for d in devices)} ({threads} intra-op thread{'s' if threads != 1 else ''})")

    t = time.perf_counter()
    status_line("tracing and profiling the U-Net ...")
    pipe = fxpipe.pipeline(model, x, stages, chunks=chunks, devices=devices, balance_by=balance_by)
    status_line(f"pipeline built in {time.perf_counter() - t:.1f} s", done=True)
    say("")
    say(pipe.plan)

    # one training step, pipelined and eager
    status_line("training step (pipeline) ...")
    y = pipe(x.to(devices[0]))
    _loss(y).backward()
    status_line("training step (eager) ...")
    ref_dev = devices[-1]
    reference.to(ref_dev)
    y_ref = reference(x.to(ref_dev))
    _loss(y_ref).backward()
    status_line("")

    out_diff = (y.to(ref_dev) - y_ref).abs().max().item()
    ref_params = dict(reference.named_parameters())
    grad_diff, worst, missing = 0.0, "", []
    for name, p in model.named_parameters():
        g, g_ref = p.grad, ref_params[name].grad
        if g is None or g_ref is None:
            missing.append(name)
            continue
        d = (g.to(ref_dev) - g_ref).abs().max().item()
        if d > grad_diff:
            grad_diff, worst = d, name
    grad_scale = max(ref_params[n].grad.abs().max().item() for n in ref_params if ref_params[n].grad is not None)
    out_ok = torch.allclose(y.to(ref_dev), y_ref, rtol=1e-4, atol=1e-5)
    grad_ok = not missing and grad_diff <= 1e-5 + 1e-4 * grad_scale

    pops = [k for k in range(pipe.n_stages) if pipe.stages.pops(k)]
    stashes = [k for k in range(pipe.n_stages) if pipe.stages.stashes(k)]
    shown = ([stashes[0]] if stashes else []) + ([pops[-1]] if pops else [])
    for k in dict.fromkeys(shown):
        say("")
        say(pipe.stages.describe(k).rstrip())
    if not pops:
        say("\n(no portals: no value skips a stage in this plan)")

    say("")
    say(f"outputs:   max abs difference vs eager {out_diff:.3e}  {'ok' if out_ok else 'MISMATCH'}")
    say(f"gradients: max abs difference vs eager {grad_diff:.3e} ({worst or '-'}; largest gradient "
        f"{grad_scale:.3e})  {'ok' if grad_ok else 'MISMATCH'}")
    if missing:
        say(f"gradients missing for: {', '.join(missing)}")
    ok = out_ok and grad_ok
    say("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run_demo())
