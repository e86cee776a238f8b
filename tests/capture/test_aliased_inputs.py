"""One tensor passed as two arguments: ``model(input_ids=ids, labels=ids)``.

torch.export merges arguments that are the same tensor object into one graph input; the
capture then read ``input_ids`` from ``labels`` on every later call (GPT-2's logits off by
0.79, ``-100`` labels an IndexError). Each argument now has its own placeholder, whatever
the sample or the call aliases.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers as T
from torch import nn

import fxpipe
from tests.exact import assert_grads_equal, assert_same
from tests.hf_families import VOCAB, ids, no_dropout


class LenRoot(nn.Module):
    """A root forward torch.fx cannot trace (``len`` of a tensor): captured by torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        h = self.emb(input_ids)
        if len(input_ids) > 0:
            h = torch.tanh(self.mid(h))
        logits = self.head(h)
        # labels enter as values too, so reading one argument for the other shows in the output
        logits = logits + labels.unsqueeze(-1).float() * 0.01
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"logits": logits, "loss": loss}


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(no_dropout(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                                      n_positions=64))).train()


def _check(model: nn.Module, sample: dict, calls: list[dict], chunks: int = 2, **options) -> fxpipe.Pipeline:
    ref, piped = copy.deepcopy(model), copy.deepcopy(model)
    pipe = fxpipe.pipeline(piped, (), 2, sample_kwargs=sample, chunks=chunks, devices=["cpu"] * 2,
                           output_merge={"loss": "mean"}, progress=False, **options)
    for call in calls:
        got, expected = pipe(**call), ref(**call)
        assert_same(dict(got), dict(expected))
        got["loss"].backward()
        expected["loss"].backward()
        assert_grads_equal(piped, ref)
    return pipe


@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_labels_is_input_ids_in_the_sample_export(checkpoint: str) -> None:
    sample_ids = ids(0)
    x, y = ids(1), ids(2)
    pipe = _check(LenRoot(), dict(input_ids=sample_ids, labels=sample_ids),
                  [dict(input_ids=x, labels=y), dict(input_ids=y, labels=y), dict(input_ids=x, labels=x.clone())],
                  checkpoint=checkpoint)
    assert pipe.capture.method == "export"
    placeholders = [n.name for n in pipe.capture.graph_module.graph.nodes if n.op == "placeholder"]
    assert placeholders == ["input_ids", "labels"]


def test_aliased_only_at_call_time_export() -> None:
    _check(LenRoot(), dict(input_ids=ids(0), labels=ids(3)), [dict(input_ids=ids(1), labels=ids(1)) for _ in range(1)])


def test_labels_is_input_ids_gpt2() -> None:
    """The issue's case: transformers' idiom in the sample, other labels (with -100) later."""
    sample_ids = ids(0)
    y = ids(2)
    y[:, :2] = -100  # ignored prompt tokens, the same count in both micro-batches
    _check(gpt2(), dict(input_ids=sample_ids, labels=sample_ids),
           [dict(input_ids=ids(1), labels=y), dict(input_ids=ids(3), labels=ids(3))])


def test_aliased_views_export() -> None:
    """Two views of one storage are two arguments too (no merging, no cloning needed)."""
    base = ids(0)
    _check(LenRoot(), dict(input_ids=base, labels=base[:]), [dict(input_ids=ids(1), labels=ids(2))])


def test_sample_left_as_given() -> None:
    sample_ids = ids(0)
    before = sample_ids.clone()
    _check(LenRoot(), dict(input_ids=sample_ids, labels=sample_ids), [dict(input_ids=ids(1), labels=ids(2))])
    torch.testing.assert_close(sample_ids, before, rtol=0, atol=0)
