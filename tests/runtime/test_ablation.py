"""The runtime's ablation switches (``PipelineRunner.copy_streams_on``, ``recompute_ahead``,
``order_backward``; used by ``benchmarks/throughput.py``) change scheduling only, never values.

Each setting is checked against the eager model (outputs and every gradient) in every
checkpoint mode, on CPU where it applies and on one GPU split into two stages, the
configuration the GPU benchmark measures.
"""

import copy

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_grads_equal, assert_same, weighted_loss
from skip_models import DTYPE, unet

MODES = ["always", "except_last", "never"]
KNOBS = ("copy_streams_on", "recompute_ahead", "order_backward")
# cuBLAS/cuDNN pick other kernels for a micro-batch than for the whole batch (tests/test_cuda.py).
GPU_TOL = dict(rtol=1e-3, atol=5e-5)
# Every switch alone, then all of them off together.
SETTINGS = [{k: False} for k in KNOBS] + [dict.fromkeys(KNOBS, False)]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4))


def _check_gpipe(model: nn.Module, x: torch.Tensor, devices, mode: str, setting: dict, balance) -> fxpipe.GPipe:
    ref = copy.deepcopy(model).to(devices[0])
    pipe = fxpipe.GPipe(copy.deepcopy(model), balance, devices=devices, chunks=4, checkpoint=mode)
    for name, value in setting.items():
        setattr(pipe._runtime, name, value)
    tol = GPU_TOL if torch.device(devices[0]).type == "cuda" else {}  # {}: the dtype's default, tests/exact.py
    got, expected = pipe(x.to(devices[0])), ref(x.to(devices[0]))
    assert_same(got, expected.to(got.device), **tol)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    # Partitions on another GPU hold their gradients there.
    assert_grads_equal(pipe, ref, check_device=False, **tol)
    pipe.close()
    return pipe


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(sorted(s)))
@pytest.mark.parametrize("mode", MODES)
def test_cpu_switches_keep_values(mode, setting):
    _check_gpipe(_mlp(), torch.randn(8, 8), ["cpu"] * 3, mode, setting, [2, 2, 1])


@pytest.mark.parametrize("mode", MODES)
def test_cpu_switches_keep_portal_values(mode):
    # @skippable portals across partitions, with every switch off.
    x = torch.randn(6, 8, dtype=DTYPE)
    _check_gpipe(unet(), x, ["cpu"] * 4, mode, dict.fromkeys(KNOBS, False), [2, 2, 2, 2])


def test_copy_streams_off_uses_the_compute_stream():
    pipe = fxpipe.GPipe(_mlp(), [3, 2], devices=["cpu", "cpu"], chunks=2)
    pipe._runtime.copy_streams_on = False
    from fxpipe.runtime._stream import current_stream

    streams = pipe._runtime.copy_streams(3)
    assert [len(s) for s in streams] == [3, 3]
    assert all(s is current_stream(d) for s_j, d in zip(streams, pipe.devices) for s in s_j)


def _cuda_pairs():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # One GPU split into stages, and two GPUs when there are.
    return [["cuda:0", "cuda:0"]] + ([["cuda:0", "cuda:1"]] if count > 1 else [])


@pytest.mark.cuda
@pytest.mark.parametrize("setting", [{}] + SETTINGS, ids=lambda s: "-".join(sorted(s)) or "defaults")
@pytest.mark.parametrize("mode", MODES)
def test_cuda_switches_keep_values(mode, setting):
    for devices in _cuda_pairs():
        pipe = _check_gpipe(_mlp(), torch.randn(8, 8), devices, mode, setting, [3, 2])
        if setting.get("copy_streams_on", True):
            assert all(isinstance(s, torch.cuda.Stream) and s != torch.cuda.current_stream(s.device)
                       for s in pipe._runtime._copy_streams[1])


@pytest.mark.cuda
@pytest.mark.parametrize("setting", [{}, dict.fromkeys(KNOBS, False)], ids=["defaults", "all-off"])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_portals_keep_values(mode, setting):
    x = torch.randn(6, 8, dtype=DTYPE)
    for devices in _cuda_pairs():
        devices = (devices * 2)[:4] if devices[0] != devices[1] else ["cuda:0"] * 4
        _check_gpipe(unet(), x, devices, mode, setting, [2, 2, 2, 2])


@pytest.fixture
def no_tf32():
    """Convolutions in true fp32: with TF32 (cuDNN's default) a micro-batch and the whole
    batch round differently, beyond the exactness tolerance."""
    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_generated_stages_with_switches(mode, no_tf32):
    # fxpipe.pipeline (generated stage code, portals between stages) on one GPU, switches off.
    from zoo import unet as zoo_unet

    model, args = zoo_unet()[:2]
    model = model.cuda()
    args = tuple(a.cuda() for a in args)
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, checkpoint=mode, devices=["cuda:0"] * 3, balance_by="params")
    for name in KNOBS:
        setattr(pipe._runtime, name, False)
    got, expected = pipe(*args), ref(*args)
    assert_same(got, expected, **GPU_TOL)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    assert_grads_equal(model, ref, **GPU_TOL)
    pipe.close()


