"""A value that needs no gradient reaches a later stage needing none, as in eager (issue 33).

The model's input image carried by a portal to the head, or a value computed from buffers
alone, must arrive with ``requires_grad=False``: otherwise autograd computes its gradient,
throws it away, and keeps the gradient of the ``cat`` that reads it alive until the stash
stage's backward. Probes (leaf modules called inside the stages) record what each stage
receives, in every forward and recomputation; a value that does need a gradient is probed
too, so the check cannot pass by everything arriving detached. Outputs and every gradient
are compared with eager's.

Covered: portals of generated stages (``fxpipe.pipeline``), over two stages and to the next
one, including a tuple mixing both kinds; the boundary edges; torchgpipe ``@skippable``
portals (``fxpipe.GPipe``); and the scheduling of accelerator pipelines run on CPU
(``order_backward`` and ``recompute_ahead``, whose Fork/Join between micro-batches once made
a stage's input need a gradient).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Set, Tuple

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_grads_equal, assert_same, weighted_loss
from fxpipe.runtime._pipeline import PipelineRunner
from fxpipe.skip import pop, skippable, stash
from no_grad_models import SPLITS, Probe, SkipNet, flags_of

DTYPE = torch.float64
BATCH = 6


def _eager_flags() -> Dict[str, Set[bool]]:
    log: List[Tuple[str, bool]] = []
    SkipNet(log).double()(torch.randn(BATCH, 4, dtype=DTYPE))
    return flags_of(log)


def test_eager_reference_mixes_both_kinds() -> None:
    """What the pipeline tests compare with: eager hands the head an activation that needs a
    gradient and, beside it, values that need none."""
    flags = _eager_flags()
    assert flags["activation at the head"] == {True}
    assert flags["(input, activation) at the head[1]"] == {True}
    for tag in ("input at the head", "buffer-derived at the head", "buffer-derived at the boundary",
                "(input, activation) at the head[0]"):
        assert flags[tag] == {False}, tag


@pytest.mark.parametrize("gpu_order", [False, True], ids=["cpu-order", "accelerator-order"])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("n_stages", [3, 4])
def test_pipeline_hands_no_grad_values_on_as_eager(monkeypatch: pytest.MonkeyPatch, n_stages: int, chunks: int,
                                                    checkpoint: str, gpu_order: bool) -> None:
    if gpu_order:  # what pipelines over accelerators do, here on CPU: Fork/Join, recompute ahead
        monkeypatch.setattr(PipelineRunner, "order_backward", True)
        monkeypatch.setattr(PipelineRunner, "recompute_ahead", True)
    log: List[Tuple[str, bool]] = []
    model = SkipNet(log).double()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(BATCH, 4, dtype=DTYPE), n_stages, chunks=chunks,
                           devices=["cpu"] * n_stages, checkpoint=checkpoint, balance_by="params",
                           split_points=SPLITS[n_stages], leaf_modules=[Probe], progress=False)
    assert {r.value for r in pipe.plan.routes if r.is_portal} >= {"x", "mul"}, pipe.plan
    x = torch.randn(BATCH, 4, dtype=DTYPE)
    log.clear()
    got = pipe(x)
    weighted_loss(got).backward()
    pipe_flags = flags_of(log)

    ref_log: List[Tuple[str, bool]] = []
    for m in ref.modules():
        if isinstance(m, Probe):
            m.log = ref_log
    expected = ref(x)
    weighted_loss(expected).backward()
    assert pipe_flags == flags_of(ref_log)
    assert_same(got, expected)
    assert_grads_equal(model, ref)
    pipe.close()


@skippable(stash=["image"])
class StashImage(nn.Module):
    def forward(self, x: torch.Tensor) -> Any:
        yield stash("image", x)
        return x


@skippable(pop=["image"])
class PopImage(nn.Module):
    def __init__(self, log: List[Tuple[str, bool]]) -> None:
        super().__init__()
        self.log = log

    def forward(self, h: torch.Tensor) -> Any:
        image = yield pop("image")
        self.log.append(("image", image.requires_grad))
        return torch.cat([h, image], dim=1)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3])
def test_skippable_portal_hands_the_image_on_as_eager(checkpoint: str, chunks: int) -> None:
    """torchgpipe's ``@skippable``: the input image stashed by partition 0, popped by partition
    2, arrives needing no gradient."""
    log: List[Tuple[str, bool]] = []
    model = nn.Sequential(StashImage(), nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), PopImage(log),
                          nn.Linear(12, 3)).double()
    ref = copy.deepcopy(model)
    pipe = fxpipe.GPipe(model, [2, 2, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(BATCH, 4, dtype=DTYPE)
    got = pipe(x)
    weighted_loss(got).backward()
    assert log and {needs for _, needs in log} == {False}, log
    expected = ref(x)
    weighted_loss(expected).backward()
    assert_same(got, expected)
    assert_grads_equal(model, ref)
