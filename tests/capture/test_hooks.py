"""Module hooks: a captured graph would run them once, while tracing (fxpipe.capture._hooks)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_exact
from fxpipe.errors import TraceError

MODES = ["always", "except_last", "never"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
                         nn.Linear(8, 2))


@pytest.mark.parametrize("mode", MODES)
def test_hooked_submodule_is_opaque_and_its_hooks_run_per_micro_batch(mode):
    model = _model()
    calls = []
    model[1].register_forward_hook(lambda m, i, o: o * 2)  # changes the output: must stay exact
    model[1].register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))  # a side effect
    with pytest.warns(UserWarning, match=r"'1' \(Sequential\) has hooks: kept opaque"):
        pipe = assert_exact(model, (torch.randn(6, 8),), 3, chunks=3, checkpoint=mode, balance_by="params")
    assert "1" in pipe.capture.leaves
    calls.clear()
    pipe(torch.randn(6, 8)).sum().backward()
    recomputed = {"never": 0, "except_last": 2, "always": 3}[mode]
    assert calls == [2] * (3 + recomputed)  # each micro-batch, and each recomputation


def test_backward_hook_on_a_submodule_runs():
    model = _model()
    grads = []
    model[0].register_full_backward_hook(lambda m, gi, go: grads.append(go[0].shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = fxpipe.pipeline(model, torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    pipe(torch.randn(6, 8, requires_grad=True)).sum().backward()
    assert sorted(grads) == [3, 3]


def test_hooks_on_the_model_itself_are_refused():
    model = _model()
    model.register_forward_hook(lambda m, i, o: o + 1)
    with pytest.raises(TraceError, match="itself has forward or backward hooks.*register them on the pipeline"):
        fxpipe.pipeline(model, torch.randn(6, 8), 2, devices=["cpu"] * 2, balance_by="params")
