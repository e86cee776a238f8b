"""The tolerance policy of tests/exact.py: it forgives float summation order, scaled to the
magnitude of what is summed, and nothing that a real bug would change.

A real bug changes gradients by far more than rounding: a lost gradient (None, or zeros, or
one element), a gradient scaled by a wrong micro-batch weight (1.01 is already caught), a
micro-batch counted twice. Rounding moves an element by a few float32 epsilons of the
largest values involved, however small the element itself is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from exact import (BF16, EXACT, FLOOR, FP16, FP32, FP64, Tol, as_tol, assert_all_close, assert_close_scaled,
                   assert_grads_equal, assert_same)

EPS = torch.finfo(torch.float32).eps


def _grad_like() -> torch.Tensor:
    """A position-embedding-like gradient: large entries, and entries near 0 from cancellation."""
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 40
    g[::3] *= 1e-3
    return g


def test_rounding_of_the_largest_terms_passes_where_a_bare_1e_5_failed():
    """The CI failure of issue 18: one near-zero element 1.9e-5 off in a gradient of size ~120."""
    want = _grad_like()
    got = want.clone()
    got[3, 5] = want[3, 5] + 1.9e-5
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert_close_scaled(got, want)
    # every element moved by a few epsilons of the largest value: still rounding
    noise = torch.randn(want.shape, generator=torch.Generator().manual_seed(1)) * 8 * EPS * want.abs().max()
    assert_close_scaled(want + noise, want)


@pytest.mark.parametrize("bug", ["scaled_1.01", "scaled_0.99", "one_element_zeroed", "one_small_element_zeroed",
                                 "one_element_doubled", "all_zeros", "sign"])
def test_a_wrong_gradient_fails(bug):
    want = _grad_like()
    got = want.clone()
    if bug == "scaled_1.01":
        got *= 1.01
    elif bug == "scaled_0.99":
        got *= 0.99
    elif bug == "one_element_zeroed":
        got[10, 7] = 0
    elif bug == "one_small_element_zeroed":  # under 1e-4 of the tensor's largest, yet no rounding
        got[3, 7] = 0
        assert want[3, 7].abs() < 1e-4 * want.abs().max()
    elif bug == "one_element_doubled":
        got[20, 3] *= 2
    elif bug == "all_zeros":
        got.zero_()
    elif bug == "sign":
        got = -got
    with pytest.raises(AssertionError):
        assert_close_scaled(got, want)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _backward(model: nn.Module, x: torch.Tensor, weights: list[float]) -> None:
    """Gradients accumulated over micro-batches of two rows each, micro-batch i weighted weights[i]."""
    for xb, w in zip(x.chunk(len(weights)), weights):
        (model(xb).pow(2).sum() * w).backward()


def test_micro_batch_accumulation_passes_and_a_wrong_weighting_fails():
    """The whole batch at once against the sum over micro-batches: rounding only. The same
    with one micro-batch weighted 1.01 (or dropped, or counted twice) fails."""
    model = _mlp()
    x = torch.randn(8, 6) * 3
    ref = copy.deepcopy(model)
    _backward(ref, x, [1.0])
    ok = copy.deepcopy(model)
    _backward(ok, x, [1.0] * 4)
    assert_grads_equal(ok, ref)
    for weights in ([1.0, 1.0, 1.01, 1.0], [1.0, 1.0, 0.0, 1.0], [1.0, 2.0, 1.0, 1.0]):
        bad = copy.deepcopy(model)
        _backward(bad, x, weights)
        with pytest.raises(AssertionError):
            assert_grads_equal(bad, ref)


def _with_grads_of(model: nn.Module) -> nn.Module:
    twin = copy.deepcopy(model)  # deepcopy leaves .grad behind
    for p, q in zip(twin.parameters(), model.parameters()):
        p.grad = None if q.grad is None else q.grad.clone()
    return twin


def test_one_lost_or_scaled_small_gradient_fails_in_a_model_with_large_ones():
    """The magnitude floor (FLOOR of the model's largest gradient) must not hide a small
    tensor's error: a bias whose gradient is 1e-3 of the largest, scaled by 1.01 or lost."""
    model = _mlp()
    x = torch.randn(8, 6)
    ref = copy.deepcopy(model)
    _backward(ref, x, [1.0])
    ref[0].weight.grad.mul_(1e3)  # the largest gradient of the model is now 1e3 x the others
    bias = ref[2].bias.grad
    assert bias.abs().max() < 1e-2 * ref[0].weight.grad.abs().max()
    for change in ("scale", "zero", "none"):
        got = _with_grads_of(ref)
        if change == "scale":
            got[2].bias.grad.mul_(1.01)
        elif change == "zero":
            got[2].bias.grad.zero_()
        else:
            got[2].bias.grad = None
        with pytest.raises(AssertionError, match="grad of 2.bias"):
            assert_grads_equal(got, ref)
    assert_grads_equal(_with_grads_of(ref), ref)


def test_gradient_zero_in_exact_arithmetic_is_compared_at_the_models_magnitude():
    """A key bias before softmax has gradient 0 in exact arithmetic: its computed value is
    rounding noise of the other gradients' size, and two such noises differ."""
    big = torch.randn(32, 32) * 5
    noise_a, noise_b = torch.randn(32) * 20 * EPS, torch.randn(32) * 20 * EPS
    assert_all_close([("w", big.clone(), big), ("k_bias", noise_a, noise_b)])
    with pytest.raises(AssertionError, match="k_bias"):  # alone, it is compared with itself
        assert_close_scaled(noise_a, noise_b, what="k_bias")
    with pytest.raises(AssertionError, match="k_bias"):  # and more than noise still fails
        assert_all_close([("w", big.clone(), big), ("k_bias", torch.full((32,), 1e-3), noise_b)])


def test_none_against_a_tensor_fails_both_ways():
    t = torch.ones(3)
    assert_all_close([("p", None, None)])
    for got, want in ((None, t), (t, None)):
        with pytest.raises(AssertionError, match="None"):
            assert_all_close([("p", got, want)])


def test_outputs_structure_integers_and_python_values():
    out = {"x": torch.randn(4, 3) * 100, "ids": torch.arange(4), "n": 3}
    assert_same(copy.deepcopy(out), out)
    with pytest.raises(AssertionError):
        assert_same({**out, "ids": torch.arange(4).flip(0)}, out)
    with pytest.raises(AssertionError):
        assert_same({**out, "n": 4}, out)
    with pytest.raises(AssertionError):
        assert_same({**out, "x": out["x"] * 1.01}, out)
    with pytest.raises(AssertionError):
        assert_same((out["x"],), [out["x"]])


def test_python_numbers_and_structures_are_not_guessed_at():
    with pytest.raises(TypeError):
        assert_close_scaled(torch.tensor(1.0), 1.0)
    with pytest.raises(TypeError):
        assert_close_scaled({"a": torch.ones(2)}, {"a": torch.ones(2)})


def test_infinities_do_not_widen_the_tolerance():
    want = torch.tensor([1.0, float("inf"), 2.0])
    assert_close_scaled(want.clone(), want)
    with pytest.raises(AssertionError):
        assert_close_scaled(torch.tensor([1.1, float("inf"), 2.0]), want)


def test_tolerances_spelled_as_keywords_and_the_named_ones():
    assert as_tol() == FP32
    assert as_tol(rtol=0, atol=0) == EXACT
    assert as_tol(dict(rtol=2e-2, atol=2e-2)) == BF16  # an atol scales beyond magnitude 1
    assert as_tol(FP32, scale=1e-6) == Tol(rtol=1e-4, scale=1e-6)
    x = torch.randn(5)
    with pytest.raises(AssertionError):
        assert_close_scaled(x + EPS * x.abs().max(), x, EXACT)
    assert_close_scaled(x * (1 + 1e-2), x, BF16)
    assert 0 < FLOOR <= 0.1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_the_default_follows_the_dtype(dtype):
    """No tolerance named: rounding of the expected tensor's own dtype passes, a 1.01 scaling
    fails (bfloat16: 1.05, its epsilon being 2**-7), and float64 is held far tighter."""
    assert as_tol(dtype=dtype) == {torch.float64: FP64, torch.float32: FP32, torch.bfloat16: BF16,
                                   torch.float16: FP16}[dtype]
    want = _grad_like().to(dtype) / 40
    eps = torch.finfo(dtype).eps
    noise = (torch.rand(want.shape, generator=torch.Generator().manual_seed(2)) * 4 - 2).to(dtype) * eps
    assert_close_scaled(want + noise * want.abs().max(), want)
    with pytest.raises(AssertionError):
        assert_close_scaled(want * (1.05 if dtype == torch.bfloat16 else 1.01), want)
    if dtype == torch.float64:
        with pytest.raises(AssertionError):  # float32 rounding is not float64 rounding
            assert_close_scaled(want.float().double() + 1e-6 * want.abs().max(), want)
