"""Autocast (issue #8, item 6): the documented AMP pattern, exact in every checkpoint mode.

Forward under ``torch.autocast``, backward outside it. The recomputation of a checkpointed
stage runs during backward, so it must re-enter the forward's autocast state; worker threads
must inherit it too.
"""

import copy

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_grads_equal, assert_same, weighted_loss

MODES = ["always", "except_last", "never"]
BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16),
                         nn.Tanh(), nn.Linear(16, 4))


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_cpu_bf16_forward_in_autocast_backward_outside(mode, chunks, threads):
    model = _model()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, 3, chunks=chunks, checkpoint=mode, devices=["cpu"] * 3,
                           balance_by="params")
    pipe._runtime.threads = threads
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = pipe(x)
        expected = ref(x)
        assert got.dtype == expected.dtype == torch.bfloat16
        got_loss, ref_loss = weighted_loss(got), weighted_loss(expected)
    assert_same(got, expected, **BF16_TOL)
    got_loss.backward()
    ref_loss.backward()
    assert_grads_equal(model, ref, **BF16_TOL)


@pytest.mark.parametrize("mode", MODES)
def test_autocast_off_inside_the_forward_stays_off_in_recomputation(mode):
    """A region that turns autocast off (as rotary embeddings do) recomputes in float32."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 8)

        def forward(self, x):
            h = self.a(x)
            with torch.autocast("cpu", enabled=False):
                h = self.b(h.float())
            return self.c(h)

    torch.manual_seed(0)
    model = Mixed()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, checkpoint=mode, devices=["cpu"] * 2, leaf_modules=[Mixed])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = pipe(x), ref(x)
    assert_same(got, expected, **BF16_TOL)
    got.float().sum().backward()
    expected.float().sum().backward()
    assert_grads_equal(model, ref, **BF16_TOL)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_autocast(dtype, mode):
    model = _model().cuda()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8, device="cuda")
    pipe = fxpipe.pipeline(model, x, 2, chunks=3, checkpoint=mode, devices=["cuda"] * 2, balance_by="params")
    with torch.autocast("cuda", dtype=dtype):
        got, expected = pipe(x), ref(x)
    assert_same(got, expected, **BF16_TOL)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    assert_grads_equal(model, ref, **BF16_TOL)
