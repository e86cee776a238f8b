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
    grads.clear()  # the build's checks compared the hooked module's gradients: it ran there too
    pipe(torch.randn(6, 8, requires_grad=True)).sum().backward()
    assert sorted(grads) == [3, 3]


def test_hooks_on_the_model_itself_are_refused():
    model = _model()
    model.register_forward_hook(lambda m, i, o: o + 1)
    with pytest.raises(TraceError, match="itself has forward or backward hooks.*register them on the pipeline"):
        fxpipe.pipeline(model, torch.randn(6, 8), 2, devices=["cpu"] * 2, balance_by="params")


class Branchy(nn.Module):
    """torch.fx cannot trace it (a Python ``if`` on a shape): captured by torch.export."""

    def __init__(self, no_grad_b: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)
        self.no_grad_b = no_grad_b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if x.shape[1] == 8:
            h = h + 1
        if self.no_grad_b:
            with torch.no_grad():
                t = self.b(h)
            return self.c(h + t)
        return self.c(torch.relu(self.b(h)))


@pytest.mark.parametrize("mode", MODES)
def test_hooked_torch_layer_runs_per_micro_batch_under_torch_export(mode):
    """torch.export goes into torch.nn layers; a hooked one is kept opaque there too, its hook
    run on each micro-batch (and recomputation), not baked in once. No warning: a torch.nn
    layer's hooks are expected to run per call."""
    model = Branchy()
    calls = []
    model.b.register_forward_hook(lambda m, i, o: o * 2)  # changes the output: must stay exact
    model.b.register_forward_hook(lambda m, i, o: calls.append(o.shape[0]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fxpipe warning about the hooks
        pipe = assert_exact(model, (torch.randn(6, 8),), 2, chunks=3, checkpoint=mode, balance_by="params")
    assert pipe.capture.method == "export" and "b" in pipe.capture.leaves
    calls.clear()
    pipe(torch.randn(6, 8)).sum().backward()
    recomputed = {"never": 0, "except_last": 2, "always": 3}[mode]
    assert calls == [2] * (3 + recomputed)  # each micro-batch, and each recomputation


def test_hooked_torch_layer_under_no_grad_is_refused_by_name_under_torch_export():
    model = Branchy(no_grad_b=True)
    model.b.register_forward_hook(lambda m, i, o: None)
    with pytest.raises(TraceError, match=r"cannot keep 'b' opaque \(it is in leaf_modules, or it has hooks.*no_grad"):
        fxpipe.pipeline(model, torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params")


def test_a_pre_hook_changing_the_arguments_under_torch_export_is_refused_naming_it():
    """torch.export records a kept module's call with the arguments its pre-hooks returned, so
    the kept call would apply such a hook twice: the build's check against eager refuses it,
    naming the module. A pre-hook that returns nothing (weight_norm's, prune's) stays exact."""
    model = Branchy()
    model.b.register_forward_pre_hook(lambda m, args: (args[0] * 3,))
    with pytest.raises(TraceError, match=r"'b' kept opaque under torch.export with forward pre-hooks"):
        fxpipe.pipeline(model, torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    model = Branchy()
    seen = []
    model.b.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    pipe = assert_exact(model, (torch.randn(6, 8),), 2, chunks=3, balance_by="params")
    assert pipe.capture.method == "export" and "b" in pipe.capture.leaves


@pytest.mark.parametrize("collected", ["tensor", "int", "tensor beside a slice"])
def test_a_hook_collecting_outputs_into_the_return_value_is_refused_not_lost(collected):
    """A hook on a module kept whole for it runs per micro-batch inside a stage, never while
    the graph is traced: what it collects into the model's return value would be missing,
    whether tensors or Python values, beside whatever else the output holds. The capture check
    refuses the graph, naming the missing output."""

    class Collects(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.store: list = []

        def forward(self, x: torch.Tensor) -> dict:
            self.store = []
            out = {"out": self.b(self.a(x)), "feats": tuple(self.store)}
            if collected == "tensor beside a slice":
                out["window"] = slice(0, 2)  # a leaf fxpipe.tree does not open
            return out

    model = Collects()
    model.a.register_forward_hook(lambda m, i, o: model.store.append(o.shape[-1] if collected == "int" else o))
    with pytest.raises(TraceError, match=r"returns \d values where model\(\*sample\) returns \d; missing: feats\.0"):
        fxpipe.pipeline(model, torch.randn(4, 4), 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
