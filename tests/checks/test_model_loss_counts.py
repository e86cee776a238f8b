"""The model's own ``'mean'`` loss whose denominator depends on the data: weighed by what it
divides by, at every call, whatever the sample's micro-batches happened to weigh.

A masked mean ``(l * mask).sum() / mask.sum()`` built on an all-ones mask, and a class-weighted
cross entropy built on one-class labels, passed the build's check (their micro-batches weighed
the same on the sample) and were silently off on real batches. Now each micro-batch's loss is
weighed by its mask's sum, or by the class weights of its targets; a denominator fxpipe cannot
weigh (``.clamp(min=1)``, or one it cannot read) is refused at the build.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import MicroBatchError

from exact import assert_close_scaled, assert_grads_equal

VOCAB = 12


class OwnLoss(nn.Module):
    """Returns {'loss', 'logits'}; ``kind`` chooses the loss; ``export`` forces torch.export."""

    def __init__(self, kind: str, export: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.export = kind, export
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)
        self.register_buffer("class_weights", torch.linspace(0.1, 3.0, VOCAB))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> dict:
        if self.export and ids.dim() != 2:
            raise ValueError("expected 2-d ids")  # stops torch.fx: captured by torch.export
        logits = self.head(torch.tanh(self.emb(ids)))
        flat, target = logits.flatten(0, 1), labels.flatten()
        if self.kind == "masked":
            per_token = F.cross_entropy(flat, target, reduction="none")
            m = mask.flatten().float()
            loss = (per_token * m).sum() / m.sum()
        elif self.kind == "weighted":
            loss = F.cross_entropy(flat, target, weight=self.class_weights)
        elif self.kind == "soft":  # class probabilities as targets: divides by rows, not weights
            probs = F.one_hot(target, VOCAB).float() * 0.9 + 0.1 / VOCAB
            loss = F.cross_entropy(flat, probs, weight=self.class_weights)
        elif self.kind == "per_sequence":  # each sequence's masked mean, then the mean over sequences
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            m = mask.float()
            loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1.0)).mean()
        elif self.kind == "per_sequence_mixed":  # per sequence only while the mask is all ones
            per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
            m = mask.float()
            loss = ((per_token * m).sum(1) / (m.sum(1) + m.sum() - m.numel())).mean()
        elif self.kind == "selected":  # a mean over a boolean selection
            per_token = F.cross_entropy(flat, target, reduction="none")
            loss = per_token[mask.flatten()].mean()
        else:  # 'clamped': a denominator that is not a count
            per_token = F.cross_entropy(flat, target, reduction="none")
            m = mask.flatten().float()
            loss = (per_token * m).sum() / m.sum().clamp(min=1.0)
        return {"loss": loss, "logits": logits}


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (8, 5), generator=g)
    labels = torch.randint(0, VOCAB, (8, 5), generator=g)
    mask = torch.rand(8, 5, generator=g) < torch.linspace(0.1, 0.95, 8)[:, None]
    mask[:, 0] = True
    return ids, labels, mask


def _sample():
    ids, labels, _ = _data(0)
    return ids, labels.zero_(), torch.ones(8, 5, dtype=torch.bool)  # all-ones mask, one class


@pytest.mark.parametrize("export", [False, True])
@pytest.mark.parametrize("kind", ["masked", "weighted", "soft", "per_sequence"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_data_dependent_denominator_is_weighed_at_every_call(kind, export, schedule):
    model = OwnLoss(kind, export)
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, _sample(), 2, chunks=4, devices=["cpu"] * 2, progress=False,
                           output_merge={"loss": "mean"}, schedule=schedule)
    assert pipe.capture.method == ("export" if export else "fx")
    with pipe:
        for seed in (1, 2):
            batch = _data(seed)
            model.zero_grad()
            ref.zero_grad()
            loss = pipe.step(*batch)
            want = ref(*batch)["loss"]
            want.backward()
            assert_close_scaled(loss, want.detach(), what="loss")
            assert_grads_equal(model, ref)
            with torch.no_grad():
                assert_close_scaled(pipe(*batch)["loss"], want.detach(), what="forward's merged loss")


def test_a_denominator_that_is_not_a_count_is_refused_at_the_build():
    with pytest.raises(MicroBatchError, match=r"divides by .*clamp.*'sum'"):
        fxpipe.pipeline(OwnLoss("clamped"), _sample(), 2, chunks=4, devices=["cpu"] * 2, progress=False,
                        output_merge={"loss": "mean"})


def test_a_divisor_per_sample_only_on_the_sample_is_refused_at_the_build():
    """``mask.sum(1) + mask.sum() - mask.numel()`` is ``mask.sum(1)`` on the sample's all-ones
    mask; on random masks it mixes the samples, and the build sees it there."""
    with pytest.raises(MicroBatchError, match=r"divides by"):
        fxpipe.pipeline(OwnLoss("per_sequence_mixed"), _sample(), 2, chunks=4, devices=["cpu"] * 2, progress=False,
                        output_merge={"loss": "mean"})


class PerSampleMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) - y).pow(2).sum() / x.size(0)  # a mean over samples: weighed by sizes


def test_a_division_by_the_batch_size_is_the_size_weighted_mean():
    torch.manual_seed(0)
    model = PerSampleMean()
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 4), torch.randn(10, 4)
    with fxpipe.pipeline(model, (x, y), 2, chunks=4, devices=["cpu"] * 2, progress=False,
                         output_merge="mean") as pipe:
        loss = pipe.step(x, y)  # micro-batches of 3, 3, 3, 1
    want = ref(x, y)
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


def test_a_mean_over_a_boolean_selection_is_refused_at_the_build():
    """``l[mask].mean()`` divides each micro-batch by its own count: silently off on padded
    batches when built on an unpadded sample; refused, saying to write the masked mean."""
    with pytest.raises(MicroBatchError, match=r"selection the data decide.*\(l \* mask\)\.sum\(\) / mask\.sum\(\)"):
        fxpipe.pipeline(OwnLoss("selected"), _sample(), 2, chunks=4, devices=["cpu"] * 2, progress=False,
                        output_merge={"loss": "mean"})


class LossModule(nn.Module):
    """A transformers-style head: its own nn.CrossEntropyLoss, kept opaque, running its own code."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, 6)
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.emb(ids)))
        return {"loss": self.loss_fct(logits.flatten(0, 1), labels.flatten()), "logits": logits}


def _labels(pad: int) -> tuple:
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, VOCAB, (8, 10), generator=g), torch.randint(1, 6, (8, 10), generator=g)
    for r, n in enumerate([10, 2, 7, 1, 10, 5, 3, 9]):
        y[r, n:] = pad
    return ids, y


@pytest.mark.parametrize("change", ["weight", "ignore_index"])
def test_a_loss_modules_weight_or_ignore_index_set_after_the_build_is_followed(change):
    # a trial: counted with the build's values, 0.03 off in the gradients
    model = LossModule()
    ref = copy.deepcopy(model)
    ids, y = _labels(-100)
    pipe = fxpipe.pipeline(model, (ids, y), 2, chunks=4, devices=["cpu"] * 2, balance_by="params",
                           progress=False, output_merge={"loss": "mean"})
    for m in (model, ref):
        if change == "weight":
            m.loss_fct.weight = torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0, 0.1])
        else:
            m.loss_fct.ignore_index = 0
    ids, y = _labels(-100 if change == "weight" else 0)
    got, want = pipe(ids, y)["loss"], ref(ids, y)["loss"]
    got.backward()
    want.backward()
    assert_close_scaled(got, want, what="loss")
    assert_grads_equal(model, ref)


def test_a_loss_modules_reduction_changed_after_the_build_is_refused():
    model = LossModule()
    ids, y = _labels(-100)
    pipe = fxpipe.pipeline(model, (ids, y), 2, chunks=4, devices=["cpu"] * 2, balance_by="params",
                           progress=False, output_merge={"loss": "mean"})
    model.loss_fct.reduction = "sum"
    with pytest.raises(fxpipe.errors.ModelChangedError, match="loss_fct.reduction"):
        pipe(ids, y)
