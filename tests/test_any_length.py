"""One pipeline for every sequence length and batch size (issue #31), as training loops call it.

A data loader pads each batch to its longest sequence, so the length changes every step, and
the last batch of an epoch is smaller. Built once, on one batch, a pipeline of a transformers
model (a torch.export capture) must take every later batch exactly: right and left padding
with ``attention_mask``, explicit ``position_ids`` as generation computes them, ``labels``
padded with ``-100`` (each micro-batch then counts other numbers of tokens), and an optimizer
over several steps under both one-process schedules. Nothing is captured, checked or planned
again: the same stage modules run every shape.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxpipe  # noqa: E402

from exact import assert_close_scaled, assert_exact  # noqa: E402
from hf_families import VOCAB, no_dropout, padded_labels, padding_mask  # noqa: E402

#: (batch, length, left padding) of each call after the sample (4, 8, right padding)
CALLS = ((4, 5, True), (4, 13, False), (3, 11, True), (4, 8, True))


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64)
        return transformers.GPT2LMHeadModel(no_dropout(config)).train()
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(no_dropout(config)).train()


def _batch(batch: int, length: int, left: bool, seed: int = 0) -> dict:
    """A padded batch as a collator makes it, with the positions generation gives padded rows."""
    ids = torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed + length))
    mask = padding_mask(batch, length, left=left)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
            "labels": padded_labels(ids, mask)}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_left_and_right_padding_positions_and_ignored_labels_at_every_length(name: str) -> None:
    pipe = assert_exact(_model(name), (), 3, kwargs=_batch(4, 8, left=False), chunks=2, balance_by="params",
                        output_merge={"loss": "mean"},
                        later=[((), _batch(b, t, left)) for b, t, left in CALLS])
    assert pipe.capture.method == "export" and pipe.capture.fixed == {}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_training_on_a_length_per_step_and_a_smaller_last_batch_is_eagers(schedule: str) -> None:
    """AdamW over steps of other lengths and a smaller last batch: ``pipe.step``'s losses and
    the weights after each step are eager's (the micro-batches' -100 counts weigh the loss)."""
    model = _model("llama")
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs=_batch(4, 8, left=False), chunks=2, balance_by="params",
                           devices=["cpu"] * 2, output_merge={"loss": "mean"}, schedule=schedule, progress=False)
    stages = pipe.stages
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, ref))
    for step, (b, t, left) in enumerate(CALLS):
        batch = _batch(b, t, left, seed=step)
        loss = pipe.step(**batch)
        want = ref(**batch).loss
        want.backward()
        assert_close_scaled(loss, want.detach(), what=f"loss of step {step}")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close_scaled(p.detach(), q.detach(), {"atol": 1e-4}, what=f"{n} after step {step}")
    assert pipe.stages is stages  # the same stages ran every shape: nothing captured or planned again
