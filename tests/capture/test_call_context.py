"""A forward that reads how it is called -- ``torch.is_autocast_enabled()``, ``if h.dtype ==
torch.bfloat16:``, ``if x.requires_grad:``, ``torch.is_grad_enabled()`` -- was captured with the
build's answers baked in: called under ``torch.autocast`` (or with an input requiring grad)
where the build was not, the pipeline silently took the build's branch (a new-user trial: loss
0.127 against eager's 0.045). Now a module reading it under torch.fx is kept opaque (it asks
again each call), and a torch.export capture checks each new context once, on fake tensors:
it runs where the code reads the same answers and is refused where it does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_grads_equal, assert_same
from fxpipe.errors import ModelChangedError

BF16 = dict(rtol=2e-2, atol=2e-2)


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)


class DtypeBranch(Base):  # T5's feed-forward clamps in float16
    def forward(self, x):
        h = self.a(x)
        if h.dtype == torch.bfloat16:
            h = h.clamp(-0.1, 0.1)
        return self.c(self.b(h.float()))


class AutocastBranch(Base):
    def forward(self, x):
        h = self.a(x)
        if torch.is_autocast_enabled("cpu"):
            h = h.clamp(-0.1, 0.1)
        return self.c(self.b(h.float()))


class RequiresGradBranch(Base):  # an input-gradient penalty switched by the input's flag
    def forward(self, x):
        h = self.a(x)
        if x.requires_grad:
            h = h * 2
        return self.c(self.b(h))


class GradModeBranch(Base):
    def forward(self, x):
        h = self.a(x)
        if torch.is_grad_enabled():
            h = h + 1
        return self.c(self.b(h))


class Clamp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h):
        if torch.is_autocast_enabled("cpu"):
            h = h.clamp(-0.1, 0.1)
        return self.lin(h)


class ReadsInASubmodule(Base):
    def __init__(self) -> None:
        super().__init__()
        self.clamp = Clamp()

    def forward(self, x):
        return self.c(self.b(self.clamp(self.a(x)).float()))


class EmbeddingDtype(nn.Module):
    """Reads the dtype of an embedding's output, which autocast leaves in float32 (a mask made
    in it, as transformers models do): the same answer in both contexts."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids, mask):
        e = self.emb(ids)
        bias = (1.0 - mask.to(e.dtype)) * torch.finfo(e.dtype).min
        if e.dtype == torch.float16:
            e = e.clamp(-1000, 1000)
        h = self.a(e).softmax(-1) + bias.unsqueeze(-1).clamp(min=-1)
        return self.b(h).sum(1)


def _pipe(model, *sample, **kwargs):
    return fxpipe.pipeline(model, sample, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False,
                           **kwargs)


@pytest.mark.parametrize("cls", [DtypeBranch, AutocastBranch])
def test_a_branch_on_autocast_is_refused_under_another_autocast(cls):
    x = torch.randn(8, 8)
    pipe = _pipe(cls(), x)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ModelChangedError) as info:
        pipe(x)
    message = str(info.value)
    assert "autocast on (cpu bfloat16) (the build: off)" in message and "test_call_context.py, line" in message
    pipe(x)  # the build's context still runs
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ModelChangedError):
        pipe(x)  # refused again, from what the first refusal found


@pytest.mark.parametrize("cls", [DtypeBranch, AutocastBranch])
def test_built_under_autocast_it_is_exact_there(cls):
    model = cls()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = _pipe(model, x)
        got, want = pipe(x), ref(x)
    assert_same(got, want, **BF16)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    assert_grads_equal(model, ref, **BF16)


def test_an_input_requiring_grad_is_refused_where_the_code_reads_it():
    model = RequiresGradBranch()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    with pytest.raises(ModelChangedError, match=r"x: requires_grad=True \(the sample's False\)"):
        pipe(x.clone().requires_grad_())
    # built from a sample that requires grad, it takes the branch as eager does
    xr = x.clone().requires_grad_()
    pipe = _pipe(model, xr)
    got, want = pipe(xr), ref(xr)
    assert_same(got, want)
    got.sum().backward()
    want.sum().backward()
    assert_grads_equal(model, ref)


def test_grad_mode_read_is_refused_under_no_grad():
    x = torch.randn(8, 8)
    pipe = _pipe(GradModeBranch(), x)
    with torch.no_grad(), pytest.raises(ModelChangedError, match="grad mode off"):
        pipe(x)


def test_a_submodule_reading_autocast_is_kept_opaque_and_exact_in_both():
    model = ReadsInASubmodule()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    assert pipe.capture.method == "fx" and "clamp" in pipe.capture.leaves
    assert_same(pipe(x), ref(x))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = pipe(x), ref(x)
    assert_same(got, want, **BF16)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    assert_grads_equal(model, ref, **BF16)


def test_reads_that_autocast_leaves_alone_run_exact_under_autocast():
    model = EmbeddingDtype()
    ref = copy.deepcopy(model)
    ids, mask = torch.randint(0, 10, (8, 5)), (torch.rand(8, 5) > 0.3).long()
    pipe = _pipe(model, ids, mask)
    assert pipe.capture.method == "export" and pipe.capture.context is not None
    before = torch.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = pipe(ids, mask), ref(ids, mask)
    assert_same(got, want, **BF16)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    assert_grads_equal(model, ref, **BF16)
    assert len(pipe.capture.context.checked) == 1  # the context checked once, then remembered
    assert torch.equal(before, torch.get_rng_state())  # no dropout here: the fake runs drew nothing


def test_the_fake_runs_leave_buffers_and_generators_as_they_were():
    class WithNorm(DtypeBranch):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(8)
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return super().forward(self.drop(self.norm(x)))

    from fxpipe.capture._call_context import CallContext, fake_reads

    model = WithNorm()
    x = torch.randn(8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    reads = fake_reads(model, [x], torch.utils._pytree.tree_flatten(((x,), {}))[1], CallContext.of([x]), torch.device("cpu"))
    assert [r.value for r in reads] == ["torch.float32"]
    assert torch.equal(rng, torch.get_rng_state())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


class CheckpointsWithGrad(nn.Module):
    """The common 'checkpoint only when training with grad' block."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))

    def forward(self, x):
        if torch.is_grad_enabled() and self.training:
            return x + torch.utils.checkpoint.checkpoint(self.l, x, use_reentrant=False)
        return x + self.l(x)


def test_modules_asking_for_grad_mode_everywhere_stay_opaque_under_fx():
    """Every block asking: their share made the capture prefer torch.export, which fixed the
    answer, and validation under no_grad was refused (a trial). torch.fx's graph, the blocks
    opaque, follows both modes."""
    torch.manual_seed(0)
    model = nn.Sequential(*[CheckpointsWithGrad() for _ in range(4)], nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    assert pipe.capture.method == "fx"
    got, want = pipe(x), ref(x)
    assert_same(got, want)
    got.sum().backward()
    want.sum().backward()
    assert_grads_equal(model, ref)
    with torch.no_grad():
        assert_same(pipe(x), ref(x))
