"""Ignored labels (``-100``) decided at call time: exact for a mean over counted labels, else refused (issue #18, 1.3).

A clean sample (no ``-100``) then collator batches whose padding is labelled ``-100``: the
micro-batches count different numbers of labels, and a ``'mean'`` merge by micro-batch size
gave another loss and other gradients with no error. Now:

* transformers' causal LM loss (shift included) and masked LM loss, and ``F.cross_entropy`` /
  ``F.nll_loss`` / ``nn.CrossEntropyLoss`` with reduction ``'mean'``, are weighted by each
  micro-batch's count of counted labels: loss and every gradient equal eager on the whole
  batch, across chunks, checkpoint modes, a sample with ``-100`` and several optimizer steps;
* any other ``'mean'`` loss is refused with a ``MicroBatchError`` naming the argument, before
  anything runs, when the call's labels hold an ignored label.

Gradients are compared at a tolerance scaled to the model's largest gradient.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

transformers = pytest.importorskip("transformers")

import fxpipe  # noqa: E402
from fxpipe.errors import MicroBatchError  # noqa: E402

from hf_families import BATCH, BY_NAME, SEQ, VOCAB  # noqa: E402


def assert_grads_close(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter's gradient (None vs tensor included), atol relative to the largest one."""
    grads = [q.grad for q in ref.parameters() if q.grad is not None]
    scale = max(float(g.abs().max()) for g in grads)
    assert scale > 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda m: f"grad of {name}: {m}")


def padded_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels of right-padded rows (padding labelled -100)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(lengths), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def masked_lm_batch(seed: int) -> dict[str, torch.Tensor]:
    """A BERT batch as an MLM collator makes it: labels -100 but at a few masked positions,
    a different number per row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    chosen = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    for row, n in enumerate([1, 4, 2, 6][:BATCH]):
        chosen[row, torch.randperm(SEQ, generator=g)[:n]] = True
    token_types = torch.zeros_like(ids)
    return {"input_ids": ids.masked_fill(chosen, 1), "attention_mask": torch.ones_like(ids),
            "token_type_ids": token_types, "labels": ids.masked_fill(~chosen, -100)}


def build(name: str, sample: dict, train: bool = True, **options) -> tuple[fxpipe.Pipeline, nn.Module, nn.Module]:
    model = BY_NAME[name].model().train(train)
    ref = copy.deepcopy(model)
    options = {"chunks": 2, "balance_by": "params", "output_merge": {"loss": "mean"}, **options}
    pipe = fxpipe.pipeline(model, (), 3, sample_kwargs=sample, devices=["cpu"] * 3, progress=False, **options)
    return pipe, model, ref


def assert_call_exact(pipe: fxpipe.Pipeline, model: nn.Module, ref: nn.Module, batch: dict) -> None:
    model.zero_grad()
    ref.zero_grad()
    out, want = pipe(**batch), ref(**batch)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.logits, want.logits)
    out.loss.backward()
    want.loss.backward()
    assert_grads_close(model, ref)


def clean_causal_sample() -> dict[str, torch.Tensor]:
    sample = padded_batch([SEQ] * BATCH, seed=0)
    assert not (sample["labels"] == -100).any()
    return sample


@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_causal_lm_clean_sample_then_padded_labels(chunks, checkpoint):
    """The issue's case: built on a clean sample, called with rows padded to other lengths in
    every micro-batch. Size-weighted, this was off by 0.0065 in the loss and 0.046 in gradients."""
    pipe, model, ref = build("gpt2", clean_causal_sample(), chunks=chunks, checkpoint=checkpoint)
    assert_call_exact(pipe, model, ref, padded_batch([3, SEQ, 6, 2], seed=1))
    assert_call_exact(pipe, model, ref, clean_causal_sample())  # and a clean call still
    assert_call_exact(pipe, model, ref, padded_batch([SEQ, 4, 5, 7, 1, SEQ], seed=2))  # another batch size


@pytest.mark.parametrize("chunks", [2, 4])
def test_masked_lm_clean_sample_then_collator_labels(chunks):
    """BERT's masked LM loss (no shift): labels -100 but at a few positions per row."""
    sample = masked_lm_batch(seed=0)
    sample["labels"] = sample["input_ids"].clone()  # clean
    pipe, model, ref = build("bert", sample, chunks=chunks, checkpoint="always")
    assert_call_exact(pipe, model, ref, masked_lm_batch(seed=1))


def test_sample_with_ignored_labels_builds_exact():
    """A sample padded with -100 (once refused by the build's gradient check) builds: the
    check merges it weighted as the calls will be."""
    pipe, model, ref = build("gpt2", padded_batch([2, SEQ, SEQ, 5], seed=0))
    assert_call_exact(pipe, model, ref, padded_batch([SEQ, 3, 6, SEQ], seed=3))


def test_micro_batch_without_counted_labels():
    """A micro-batch whose labels are all ignored has the mean 0/0: it weighs 0, gives a zero
    gradient, and the merged loss is the whole batch's, finite."""
    pipe, model, ref = build("gpt2", clean_causal_sample(), chunks=4)
    batch = padded_batch([SEQ, 1, 5, 0], seed=4)  # rows 1 and 3 count no label (shifted)
    assert (batch["labels"][1, 1:] == -100).all() and (batch["labels"][3] == -100).all()
    assert_call_exact(pipe, model, ref, batch)


def test_eval_without_grad_is_weighted_too():
    pipe, model, ref = build("gpt2", clean_causal_sample(), train=False)  # the export graph bakes eval in
    batch = padded_batch([2, SEQ, 7, 7], seed=5)  # 8 and 12 counted labels
    with torch.no_grad():
        torch.testing.assert_close(pipe(**batch).loss, ref(**batch).loss, rtol=1e-5, atol=1e-6)


def test_several_optimizer_steps_with_padded_batches():
    """Three SGD steps (momentum) on batches padded differently: the parameters stay eager's."""
    pipe, model, ref = build("gpt2", clean_causal_sample(), checkpoint="always")
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    for step, lengths in enumerate([[2, SEQ, 6, 3], [SEQ, SEQ, 1, 4], [5, 2, SEQ, SEQ]]):
        batch = padded_batch(lengths, seed=10 + step)
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe(**batch).loss.backward()
        ref(**batch).loss.backward()
        assert_grads_close(model, ref)
        opt.step()
        ref_opt.step()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} after step {step}: {m}")


# -- custom models (torch.fx captures) -------------------------------------------------------
class Tagger(nn.Module):
    """Three losses fxpipe recognises: a shifted F.cross_entropy with label smoothing (its mean
    too divides by the counted labels), F.nll_loss with its own ignore index, an
    nn.CrossEntropyLoss module passed through .float()."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 20)
        self.ce = nn.CrossEntropyLoss(ignore_index=-1)

    def forward(self, x, labels, tags):
        logits = self.head(self.body(self.emb(x)))
        shifted = F.cross_entropy(logits[:, :-1].reshape(-1, 20), labels[..., 1:].reshape(-1), label_smoothing=0.1)
        nll = F.nll_loss(F.log_softmax(logits, -1).view(-1, 20), tags.view(-1), ignore_index=-1)
        module = self.ce(logits.view(-1, 20), tags.view(-1))
        return {"shifted": shifted, "nll": nll, "module": module.float(), "logits": logits}


class HandMadeMean(nn.Module):
    """A token mean written by hand: fxpipe cannot tell what it divides by."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, x, targets):
        logp = F.log_softmax(self.head(self.emb(x)), -1)
        counted = targets != -100
        nll = -logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (nll * counted).sum() / counted.sum()


class LossPlusPenalty(nn.Module):
    """F.cross_entropy plus a per-sample mean: a sum of two means fxpipe does not weigh."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, x, targets):
        h = self.emb(x)
        return F.cross_entropy(self.head(h).view(-1, 20), targets.view(-1)) + 0.1 * h.pow(2).mean()


def _tokens(seed: int, shape=(4, 6)) -> torch.Tensor:
    return torch.randint(0, 20, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunks", [2, 4])
def test_custom_losses_recognised_are_exact(chunks):
    torch.manual_seed(0)
    model = Tagger()
    ref = copy.deepcopy(model)
    x, labels, tags = _tokens(0), _tokens(1), _tokens(2)
    pipe = fxpipe.pipeline(model, (x,), 2, sample_kwargs={"labels": labels, "tags": tags}, chunks=chunks,
                           devices=["cpu"] * 2, balance_by="params", progress=False,
                           output_merge={"shifted": "mean", "nll": "mean", "module": "mean"})
    assert pipe.capture.method == "fx"
    labels, tags = labels.clone(), tags.clone()
    labels[0, 2:], labels[3, 4:] = -100, -100
    tags[1, 1:], tags[2, :3] = -1, -1
    out, want = pipe(x, labels=labels, tags=tags), ref(x, labels=labels, tags=tags)
    for key in ("shifted", "nll", "module"):
        torch.testing.assert_close(out[key], want[key], rtol=1e-5, atol=1e-6)
    (out["shifted"] + 2 * out["nll"] + 3 * out["module"]).backward()
    (want["shifted"] + 2 * want["nll"] + 3 * want["module"]).backward()
    assert_grads_close(model, ref)


@pytest.mark.parametrize("model_cls", [LossPlusPenalty])
def test_unrecognised_mean_loss_refused_at_call_time(model_cls):
    """Built on a clean sample, exact on clean calls; a call with -100 labels is refused before
    anything runs, naming the argument and what to do."""
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)
    x, targets = _tokens(0), _tokens(1)
    pipe = fxpipe.pipeline(model, (x, targets), 2, chunks=2, devices=["cpu"] * 2, balance_by="params",
                           output_merge="mean", progress=False)
    torch.testing.assert_close(pipe(x, _tokens(2)), ref(x, _tokens(2)))
    padded = targets.clone()
    padded[0, 2:] = -100
    with pytest.raises(MicroBatchError) as info:
        pipe(x, padded)
    msg = str(info.value)
    for words in ("argument 'targets' holds -100 (an ignored label) in this call", "merged over micro-batches "
                  "with 'mean'", "would silently differ", "merge both with 'sum'", "outside the pipeline"):
        assert words in msg, msg
    assert all(p.grad is None for p in model.parameters())
    one = fxpipe.pipeline(copy.deepcopy(ref), (x, targets), 2, chunks=1, devices=["cpu"] * 2,
                          balance_by="params", output_merge="mean", progress=False)
    torch.testing.assert_close(one(x, padded), ref(x, padded))  # one micro-batch merges nothing


def _exact_step(model, args, chunks=2):
    ref = copy.deepcopy(model)
    with fxpipe.pipeline(model, args, 2, chunks=chunks, devices=["cpu"] * 2, balance_by="params",
                         output_merge="mean", progress=False) as pipe:
        loss = pipe.step(*args)
    want = ref(*args)
    want.backward()
    torch.testing.assert_close(loss, want.detach())
    assert_grads_close(model, ref)


def test_a_hand_made_mean_over_counted_labels_is_weighed_by_its_own_count():
    """``(nll * counted).sum() / counted.sum()``: the sum of a mask divides it, and each
    micro-batch weighs by its own (once refused; now exact, the sample holding -100 too)."""
    torch.manual_seed(0)
    x, targets = _tokens(0), _tokens(1)
    targets[1, 3:] = -100
    targets[0, 1:] = -100
    _exact_step(HandMadeMean(), (x, targets))


class MaskMean(nn.Module):
    """A token mean over an attention mask: no label is ignored, but the micro-batches count
    different numbers of tokens. Its head starts at zero, so every token costs log(20) and the
    merged value is the batch's; the weights show in the gradients only."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x, targets, mask):
        nll = F.cross_entropy(self.head(self.emb(x)).transpose(1, 2), targets, reduction="none")
        return (nll * mask).sum() / mask.sum()


def test_mean_over_a_padding_mask_is_weighed_by_the_mask():
    """Values alike, gradients not, under a size-weighted merge (the build's gradient check
    once refused it, issue #13); weighed by each micro-batch's mask sum it is exact."""
    torch.manual_seed(0)
    x, targets = _tokens(0), _tokens(1)
    mask = torch.ones(4, 6)
    mask[0, 1:] = 0
    _exact_step(MaskMean(), (x, targets, mask))




def test_a_loss_divided_by_num_items_in_batch_merges_by_sum():
    """transformers' Trainer passes ``num_items_in_batch`` (the whole batch's count, a 0-dim
    tensor every micro-batch gets whole): the loss is then a sum of its micro-batches' parts.
    'mean' is refused saying so; 'sum' is exact, outputs and every gradient."""
    from hf_families import no_dropout

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(no_dropout(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64))).train()
    ref = copy.deepcopy(model)

    def batch(seed: int, length: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (4, length), generator=g)
        mask = torch.ones(4, length, dtype=torch.long)
        mask[1, length - 3:] = 0
        mask[3, length - 5:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels,
                "num_items_in_batch": (labels[:, 1:] != -100).sum()}

    with pytest.raises(MicroBatchError, match="num_items_in_batch\\), is a sum of its micro-batches' parts: merge it "
                                              "with 'sum'"):
        fxpipe.pipeline(copy.deepcopy(model), (), 2, sample_kwargs=batch(0, 8), chunks=2, devices=["cpu"] * 2,
                        progress=False, output_merge={"loss": "mean"})
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs=batch(0, 8), chunks=2, devices=["cpu"] * 2, progress=False,
                           output_merge={"loss": "sum"})
    b = batch(1, 11)
    got, want = pipe(**b).loss, ref(**b).loss
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max().item()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6 * scale + 1e-12, msg=lambda m: f"{name}: {m}")
