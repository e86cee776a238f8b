"""Models that call ``torch.utils.checkpoint(..., use_reentrant=True)`` themselves.

The re-entrant checkpoint hides its function under no_grad from any graph capture, so a
traced pipeline would silently give the parameters inside no gradient. fxpipe keeps the
calling module opaque (its own forward, checkpoint included, runs in its stage: exact) and
refuses with :class:`~fxpipe.capture._reentrant.ReentrantCheckpointError` where nothing can be opaque.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import fxpipe
from exact import assert_exact, assert_grads_equal
from fxpipe.capture._reentrant import ReentrantCheckpointError

MODES = ["always", "except_last", "never"]


class ReentrantBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch_checkpoint.checkpoint(lambda t: torch.tanh(self.lin(t)), x, use_reentrant=True) + x


class ReentrantRoot(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch_checkpoint.checkpoint(self.a, x, use_reentrant=True))


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's "kept opaque" and torch's no-grad-input warnings
        yield


@pytest.mark.parametrize("mode", MODES)
def test_reentrant_checkpoint_in_a_submodule_is_kept_opaque_and_exact(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ReentrantBlock(), ReentrantBlock(), nn.Linear(8, 2))
    pipe = assert_exact(model, (torch.randn(6, 8),), 2, chunks=3, checkpoint=mode, balance_by="params")
    assert {"1", "2"} <= set(pipe.capture.leaves)


def test_reentrant_checkpoint_in_the_root_forward_is_refused_naming_the_line():
    with pytest.raises(ReentrantCheckpointError) as info:
        fxpipe.pipeline(ReentrantRoot(), torch.randn(4, 8), 2, devices=["cpu"] * 2, balance_by="params")
    msg = str(info.value)
    assert "use_reentrant=True" in msg and "use_reentrant=False" in msg and "checkpoint=" in msg
    assert "test_reentrant_checkpoint.py" in info.value.location
    assert isinstance(info.value, fxpipe.errors.TraceError)


def test_torch_reentrant_checkpoint_is_itself_again_after_a_build():
    try:
        fxpipe.pipeline(ReentrantRoot(), torch.randn(4, 8), 2, devices=["cpu"] * 2, balance_by="params")
    except ReentrantCheckpointError:
        pass
    assert "apply" not in vars(torch_checkpoint.CheckpointFunction)
    model = ReentrantRoot()
    x = torch.randn(4, 8, requires_grad=True)
    model(x).sum().backward()
    assert model.a.weight.grad is not None


def _reentrant_gpt2():
    """A tiny GPT-2 with transformers' reentrant gradient checkpointing, in training mode."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    return model.train()


def test_transformers_reentrant_gradient_checkpointing_is_exact():
    model = _reentrant_gpt2()
    ids = torch.randint(0, 64, (4, 10))
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, ids, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False)
    got, expected = pipe(ids).logits, ref(ids).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    got.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_transformers_reentrant_gradient_checkpointing_with_a_labels_loss_is_exact(schedule):
    """The build's gradient check of a merged loss used torch.autograd.grad, which a reentrant
    checkpoint refuses: a bare RuntimeError ended the build. It now backwards into .grad (put
    back), and the step is eager's, -100 padding included."""
    model = _reentrant_gpt2()
    ids = torch.randint(0, 64, (4, 10))
    labels = ids.clone()
    labels[1, 4:], labels[3, 7:] = -100, -100
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs={"input_ids": ids, "labels": labels}, chunks=2,
                           devices=["cpu"] * 2, balance_by="params", progress=False, output_merge={"loss": "mean"},
                           schedule=schedule)
    assert all(p.grad is None for p in model.parameters()), "the build's check leaves .grad as it was"
    loss = pipe.step(input_ids=ids, labels=labels)
    want = ref(input_ids=ids, labels=labels).loss
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    assert_grads_equal(model, ref)
