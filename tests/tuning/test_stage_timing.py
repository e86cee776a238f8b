"""The tuner's stage timing (``fxpipe.tuning._stage_timing``): every stage's actions timed as
the runtime runs them, the model left as it was, and the arithmetic that turns stage times
into action times (``_costs.action_seconds``). No timed assertions: only which passes hold
time, and which do not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.build import BuildOptions, capture_and_check
from fxpipe.capture._prepare import preserved
from fxpipe.plan._make import make_plan
from fxpipe.plan._op_graph import build_opgraph
from fxpipe.plan._value import Plan
from fxpipe.progress import as_progress
from fxpipe.tuning import _search_timing
from fxpipe.tuning._costs import StageTimes, action_seconds, first_stage_in_weight_pass
from fxpipe.tuning._orders import Action
from fxpipe.tuning._stage_timing import _one_run, carried_stages, time_stage_actions
from dist_models import SharedLayers
from zoo import TinyGPT, UNet


class Net(nn.Module):
    """Embedding (first stage: inputs need no gradient), BatchNorm (a buffer updated in
    forward), dropout (randomness), an in-place ReLU, a skip connection across stages and an
    int (a size) read stages later."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.b = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.1)
        self.c = nn.Linear(8, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        n = idx.shape[0]
        h = self.emb(idx).mean(1)
        skip = self.a(h)
        y = torch.relu_(self.bn(skip))
        y = self.drop(self.b(y)) + skip
        return self.c(y).reshape(n, -1)


def _plan(model: nn.Module, x: Any, n_stages: int):
    """The captured model and its plan by parameters (``x``: one input, or a tuple of them)."""
    options = BuildOptions(n_stages, 1, None, "params", (), None, None, 0, None, as_progress(False))
    checked = capture_and_check(model, x if isinstance(x, tuple) else (x,), {}, options)
    plan = make_plan(checked.capture, checked.args, checked.kwargs, n_stages, balance_by="params", chunks=1,
                     batching=checked.batching, progress=as_progress(False))
    return checked, plan


@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_every_pass_is_timed_where_the_runtime_runs_it(n_stages: int) -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randint(0, 16, (8, 5))
    checked, plan = _plan(model, x, n_stages)
    gm = checked.capture.graph_module
    whole = time_stage_actions(gm, plan, [x], split=False, repeat=1)
    split = time_stage_actions(gm, plan, [x], split=True, repeat=1)
    assert len(whole) == len(split) == n_stages
    for t in whole:  # the whole backward is the input-gradient pass
        assert t.forward > 0 and t.input_grad > 0 and t.weight_grad == 0
    # torch: the first stage has no input pass, its whole backward runs in the weight pass
    assert split[0].input_grad == 0 and split[0].weight_grad > 0
    for t in split[1:]:
        assert t.forward > 0 and t.input_grad > 0 and t.weight_grad > 0


class Splits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.a(x).split(8, dim=1)
        return self.b(parts[0]) * parts[1]


@pytest.mark.parametrize("split", [False, True])
def test_a_tuple_of_tensors_crossing_stages_is_received_as_its_tensors(split: bool) -> None:
    # the tuple `split` made in stage 0 and read in stage 1: each of its tensors is a value the
    # next stage receives (fresh leaves), so each stage's backward stops at its own inputs
    # (TinyGPT cut after a qkv split: "backward through the graph a second time")
    torch.manual_seed(0)
    model, x = Splits(), torch.randn(4, 8)
    options = BuildOptions(2, 1, None, "params", (), None, None, 0, None, as_progress(False))
    checked = capture_and_check(model, (x,), {}, options)
    gm = checked.capture.graph_module
    assignment, stage = {}, 0
    for node in gm.graph.nodes:
        assignment[node.name] = stage
        if node.op == "call_method" and node.target == "split":
            stage = 1
    plan = Plan.from_assignment(build_opgraph(gm), assignment, balance_by="params", cost_attr="seconds")
    assert [r.value for r in plan.routes] == ["split"]  # the tuple is what crosses
    times = time_stage_actions(gm, plan, [x], split=split, repeat=1)
    assert times[0].forward > 0 and times[0].backward > 0 and times[1].backward > 0


class FrozenPrefix(nn.Module):
    """Fine-tuning: a frozen prefix, a float mask that needs no gradient, a trained head."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.frozen.requires_grad_(False)
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(x) * mask)


def _same_gradients_as_eager(model: nn.Module, args: tuple, n_stages: int, split: bool) -> tuple:
    """Runs the timed passes once (they accumulate into .grad) and compares with eager's
    ``out.float().mean().backward()``: the passes did the backward the runtime does."""
    checked, plan = _plan(model, args, n_stages)
    stages = carried_stages(checked.capture.graph_module, plan)
    model.zero_grad(set_to_none=True)
    times = _one_run(stages, list(args), split, None)
    got = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model(*args).float().mean().backward()
    for name, p in model.named_parameters():
        if p.grad is None:
            assert got[name] is None, name
        else:
            torch.testing.assert_close(got[name], p.grad, msg=name)
    return times, stages


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("n_stages", [1, 2, 3])
def test_the_timed_passes_compute_the_runtimes_gradients(n_stages: int, split: bool) -> None:
    torch.manual_seed(0)
    _same_gradients_as_eager(Net().eval(), (torch.randint(0, 16, (8, 5)),), n_stages, split)
    # tied weights across stages: TinyGPT's head is its token embedding
    _same_gradients_as_eager(TinyGPT(), (torch.randint(0, 64, (2, 16)),), n_stages, split)
    # one Linear and one LayerNorm at every depth (torch's weight pass alone fails on it)
    _same_gradients_as_eager(SharedLayers(), (torch.randn(4, 8),), n_stages, split)


def test_the_callers_grad_mode_does_not_turn_the_backwards_off() -> None:
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randint(0, 16, (8, 5))
    checked, plan = _plan(model, x, 2)
    with torch.no_grad():
        for split in (False, True):
            times = time_stage_actions(checked.capture.graph_module, plan, [x], split=split, repeat=1)
            assert times[1].backward > 0 and times[0].backward > 0, times  # skipped passes time 0.0


@pytest.mark.parametrize("split", [False, True])
def test_a_frozen_prefix_and_a_float_mask_get_no_input_gradient(split: bool) -> None:
    # what a stage receives needs grad only where the value sent did, as torch's receive
    # buffers: the frozen stages do no backward at all (the runtime's do none either)
    torch.manual_seed(0)
    x, mask = torch.randn(4, 8), (torch.rand(4, 8) > 0.5).float()
    model = FrozenPrefix()
    times, stages = _same_gradients_as_eager(model, (x, mask), 3, split)
    frozen = [k for k, stage in enumerate(stages) if not any(p.requires_grad for p in stage.parameters())]
    assert len(frozen) >= 2, frozen  # the cut leaves two stages with only frozen layers
    for k in frozen:
        assert times[k][1:] == [0.0, 0.0], (k, times[k])


def test_timing_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = Net(), torch.randint(0, 16, (8, 5))
    model.train()
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 0.5)
        grads[name] = p.grad
    checked, plan = _plan(model, x, 3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with preserved(model):
        for split in (False, True):
            time_stage_actions(checked.capture.graph_module, plan, [x], split=split, repeat=2)
    for name, p in model.named_parameters():  # the same .grad objects, untouched
        assert p.grad is grads[name] and torch.equal(p.grad, torch.full_like(p, 0.5)), name
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert torch.equal(torch.get_rng_state(), rng)
    # the captured graph is not rewritten (the timing carries portals on a copy)
    assert not any("carry" in n.name for n in checked.capture.graph_module.graph.nodes)


def test_a_stage_that_cannot_be_timed_falls_back_to_the_profile_and_says_so(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise RuntimeError("no such kernel\nmore")

    monkeypatch.setattr(_search_timing, "time_interleaved", refuse)  # every size at once, then
    monkeypatch.setattr(_search_timing, "time_stage_actions", refuse)  # each alone
    torch.manual_seed(0)
    model, x = Net(), torch.randint(0, 16, (8, 5))
    t = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe",), chunks=[1, 2], checkpoint=("never",),
                    optimizer="sgd")
    assert all(c.step_s > 0 for c in t.choices)
    assert "could not time" in str(t) and "RuntimeError: no such kernel" in str(t)


def test_action_seconds_recomputes_once_in_the_first_backward_pass() -> None:
    t = StageTimes(forward=1.0, input_grad=2.0, weight_grad=3.0)
    # fxpipe.pipeline / 1f1b: the whole backward, plus the recomputation when checkpointed
    assert action_seconds(Action("B", 1, 0), t, False, False) == 5.0
    assert action_seconds(Action("B", 1, 0), t, True, False) == 6.0
    assert action_seconds(Action("F", 1, 0), t, True, False) == 1.0
    # zero bubble: recomputed in I, never again in W
    assert action_seconds(Action("I", 1, 0), t, True, True) == 3.0
    assert action_seconds(Action("W", 1, 0), t, True, True) == 3.0
    # the first stage: its I is empty, W holds its backward and the recomputation
    first = first_stage_in_weight_pass([t, t])
    assert first[0] == StageTimes(1.0, 0.0, 5.0) and first[1] == t
    assert action_seconds(Action("I", 0, 0), first[0], True, True) == 0.0
    assert action_seconds(Action("W", 0, 0), first[0], True, True) == 6.0
    assert first_stage_in_weight_pass([]) == []


@pytest.mark.parametrize("which", ["gpt", "unet"])
def test_the_zoos_models_are_timed_stage_by_stage_never_from_the_profile(which: str) -> None:
    torch.manual_seed(0)
    model, x = (TinyGPT(), torch.randint(0, 64, (4, 16))) if which == "gpt" else (UNet(4), torch.randn(2, 3, 16, 16))
    one = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe",), chunks=[1, 2], optimizer="sgd")
    ranks = fxpipe.tune(model, x, 2, schedules=("1f1b", "zbv"), chunks=[2], optimizer="sgd")
    for t in (one, ranks):
        assert "each stage timed" in str(t) and "could not time" not in str(t), str(t)
