"""Named GPU kinds for ``fxpipe tune --gpu``: the figures a roofline needs, so a user tuning a
model on meta need not look up peak FLOP/s and bandwidth.

Each row is the vendor's data-sheet figure for the SXM/OAM part (dense bf16, no sparsity),
the memory per device, and the bandwidth of one device's link to a peer, one way (NVLink
4 on H100/H200: 900 GB/s both ways, 450 one way; NVLink 3 on A100: 600 and 300; NVLink 5 on
B200: 1.8 TB/s and 900; MI300X: one Infinity Fabric link to each of 7 peers, 128 GB/s both
ways, 64 one way). A data sheet's peak is not reached: ``--efficiency`` (default 1) scales it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuKind", "GPUS"]


@dataclass(frozen=True)
class GpuKind:
    device_flops: str  # dense bf16 peak, FLOP/s
    bandwidth: str  # memory bandwidth
    memory: str  # per device
    link: str  # to one peer, one way


GPUS: dict[str, GpuKind] = {
    "a100": GpuKind("312e12", "2.039TB/s", "80GB", "300GB/s"),
    "h100": GpuKind("989e12", "3.35TB/s", "80GB", "450GB/s"),
    "h200": GpuKind("989e12", "4.8TB/s", "141GB", "450GB/s"),
    "b200": GpuKind("2250e12", "8TB/s", "180GB", "900GB/s"),
    "mi300x": GpuKind("1307e12", "5.3TB/s", "192GB", "64GB/s"),
}
