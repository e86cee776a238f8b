"""What the runtime keeps alive: a checkpointed stage's inputs go once its backward ran.

A checkpointed task keeps its inputs for the recomputation, and nothing needs them once
that task's backward is done. The autograd graph itself lives until the whole backward
ends, so anything of the runtime's that the graph references (an autograd Function's
``ctx`` attributes, saved-tensor hooks) must not hold the inputs, or every checkpointed
micro-batch's inputs would stay until the end of the step and the activation memory of
``benchmarks/activation_memory.py`` would be above its floor.
"""

import weakref

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe import GPipe, is_checkpointing

from zoo import unet


def _alive_when_backward_ends(pipe, stages, x):
    """Weak references to every checkpointed (first-pass) input of ``stages``, read at the
    very end of backward (the input's gradient hook), while the graph is still alive."""
    refs = []

    def remember(module, args):
        if is_checkpointing():
            refs.extend(weakref.ref(a) for a in args if isinstance(a, torch.Tensor))

    handles = [s.register_forward_pre_hook(remember) for s in stages]
    seen = []
    x = x.detach().requires_grad_()
    x.register_hook(lambda g: seen.append(sum(r() is not None for r in refs)))
    try:
        pipe(x).float().pow(2).mean().backward()
    finally:
        for h in handles:
            h.remove()
    assert refs, "no stage ran checkpointed"
    return seen


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_gpipe_checkpointed_inputs_released_after_their_backward(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = GPipe(model, [2, 2, 1], devices=["cpu"] * 3, chunks=3, checkpoint=mode)
    assert _alive_when_backward_ends(pipe, list(pipe.partitions)[1:], torch.randn(6, 4)) == [0]


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_pipeline_checkpointed_inputs_released_after_their_backward(mode):
    model, (x,), _ = unet()  # portals from stage 0 to later stages
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, devices=["cpu"] * 3, checkpoint=mode, balance_by="params")
    try:
        assert pipe.plan.portals, "the U-Net should have a portal across stages"
        assert _alive_when_backward_ends(pipe, pipe.stages.modules[1:], x) == [0]
    finally:
        pipe.close()
