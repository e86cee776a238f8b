"""fxpipe.pipeline on Hugging Face transformers models (tiny random configs, no downloads).

GPT-2 (tied wte / lm_head) and BERT (with an attention_mask keyword tensor) are captured
through torch.export (torch.fx cannot trace them), cut into 2-3 stages, run with 2
micro-batches and compared with eager deep copies: the ModelOutput type and keys, every
output tensor and every parameter gradient.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import fxpipe  # noqa: E402

import exact  # noqa: E402
VOCAB, BATCH, SEQ = 100, 4, 8


def gpt2():
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=1,
    )
    return transformers.GPT2LMHeadModel(config)


def bert_config():
    return transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, 5:] = 0  # padding in the first micro-batch only
    mask[3, 2:] = 0  # and more of it in the second
    return ids, mask


def weighted(t: torch.Tensor, k: int = 1) -> torch.Tensor:
    return (t * torch.linspace(-1, 1, t.numel()).view_as(t) * k).sum()


def assert_grads_equal(model, ref) -> None:
    named = list(model.named_parameters())
    assert [n for n, _ in named] == [n for n, _ in ref.named_parameters()]
    exact.assert_grads_equal(model, ref)


def assert_outputs_equal(out, expected) -> None:
    assert type(out) is type(expected)
    assert list(out.keys()) == list(expected.keys())
    for key in expected.keys():
        torch.testing.assert_close(out[key], expected[key], msg=lambda m: f"output {key!r}: {m}")


# Export graphs carry the batch size as a SymInt node (sym_size_int); with 3 stages it skips
# a stage by portal, and a checkpointed stage that pops it reads it again when recomputed.
@pytest.mark.parametrize("n_stages,checkpoint", [
    (2, "except_last"), (3, "never"), (3, "always")])
def test_gpt2_lm_matches_eager_with_tied_weights(n_stages, checkpoint):
    torch.manual_seed(0)
    model = gpt2()
    ref = copy.deepcopy(model)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, _ = inputs()
    pipe = fxpipe.pipeline(model, ids, n_stages, chunks=2, devices=["cpu"] * n_stages,
                           checkpoint=checkpoint, balance_by="params")
    assert len(pipe.stages) == n_stages
    assert pipe.capture.method == "export"  # fx cannot trace GPT-2

    out = pipe(ids)
    expected = ref(ids)
    assert isinstance(out, transformers.modeling_outputs.CausalLMOutputWithCrossAttentions)
    assert_outputs_equal(out, expected)

    def loss(o):  # LM loss computed outside the model, plus a weighted sum of all logits
        logits = o.logits
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        return lm + weighted(logits) * 1e-2

    loss(out).backward()
    loss(expected).backward()
    assert_grads_equal(model, ref)

    # Still one tied parameter; its gradient is the sum of both uses, as in eager.
    assert model.lm_head.weight is model.transformer.wte.weight
    exact.assert_close_scaled(model.lm_head.weight.grad, ref.lm_head.weight.grad, what="grad of lm_head.weight")
    if n_stages == 3:
        users = [k for k, s in enumerate(pipe.stages) if any(p is model.transformer.wte.weight for p in s.parameters())]
        assert users[0] == 0 and users[-1] == n_stages - 1, users
    owned = {id(p) for s in pipe.stages for p in s.parameters()}
    assert owned <= {id(p) for p in model.parameters()}  # no copies
    assert list(pipe.state_dict()) == list(model.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("n_stages,checkpoint", [(2, "except_last"), (3, "never")])
def test_bert_with_attention_mask_matches_eager(n_stages, checkpoint):
    torch.manual_seed(0)
    model = transformers.BertModel(bert_config())
    ref = copy.deepcopy(model)
    ids, mask = inputs(1)
    pipe = fxpipe.pipeline(model, ids, n_stages, sample_kwargs={"attention_mask": mask}, chunks=2,
                           devices=["cpu"] * n_stages, checkpoint=checkpoint, balance_by="params")
    assert len(pipe.stages) == n_stages
    assert pipe.capture.method == "export"

    out = pipe(ids, attention_mask=mask)
    expected = ref(ids, attention_mask=mask)
    assert isinstance(out, transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions)
    assert list(out.keys()) == ["last_hidden_state", "pooler_output"]
    assert_outputs_equal(out, expected)
    # The mask is split with the batch: an all-ones mask gives other values for padded rows.
    unmasked = ref(ids, attention_mask=torch.ones_like(mask)).last_hidden_state
    assert not torch.allclose(unmasked[1], out.last_hidden_state[1])
    torch.testing.assert_close(unmasked[0], out.last_hidden_state[0])

    (weighted(out.last_hidden_state) + weighted(out.pooler_output, 2)).backward()
    (weighted(expected.last_hidden_state) + weighted(expected.pooler_output, 2)).backward()
    assert_grads_equal(model, ref)
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_bert_masked_lm_tied_decoder_matches_eager():
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(bert_config())
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ref = copy.deepcopy(model)
    ids, mask = inputs(2)
    pipe = fxpipe.pipeline(model, ids, 2, sample_kwargs={"attention_mask": mask}, chunks=2,
                           devices=["cpu"] * 2, checkpoint="always", balance_by="params")
    out = pipe(ids, attention_mask=mask)
    expected = ref(ids, attention_mask=mask)
    assert isinstance(out, transformers.modeling_outputs.MaskedLMOutput)
    assert_outputs_equal(out, expected)
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
    F.cross_entropy(out.logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    F.cross_entropy(expected.logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    assert_grads_equal(model, ref)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_export_capture_takes_another_sequence_length_and_refuses_what_its_guards_exclude():
    """torch.export keeps the sequence length symbolic (issue #31): another length runs on the
    same pipeline, exact. What the capture assumed is checked up front, naming the arguments,
    instead of failing inside a stage: lengths the model needs equal, a length of 1 (export
    treats sizes 0 and 1 apart), another number of dims. The batch may vary, and keywords may
    come in any order (they bind by name)."""
    from fxpipe.errors import InputMismatchError

    model = gpt2()
    ref = copy.deepcopy(model)
    ids, mask = inputs()
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs={"input_ids": ids, "attention_mask": mask, "labels": ids},
                           chunks=2, balance_by="params", output_merge={"loss": "mean"})
    assert pipe.capture.method == "export" and pipe.capture.fixed == {}
    longer = torch.randint(0, VOCAB, (BATCH, SEQ + 2))
    out = pipe(input_ids=longer, attention_mask=torch.ones_like(longer), labels=longer)
    want = ref(input_ids=longer, attention_mask=torch.ones_like(longer), labels=longer)
    torch.testing.assert_close(out.logits, want.logits)
    with pytest.raises(InputMismatchError) as info:
        pipe(input_ids=longer, attention_mask=mask, labels=longer)
    msg = str(info.value)
    assert msg.startswith("GPT2LMHeadModel: this call does not match the sample")
    for word in (f"dim 1 of attention_mask is {SEQ}, but dim 1 of input_ids is {SEQ + 2}",
                 "the model's graph has them equal"):
        assert word in msg, msg
    one = torch.randint(0, VOCAB, (BATCH, 1))
    with pytest.raises(InputMismatchError, match="dim 1 of input_ids is 1, but the captured graph holds for sizes "
                                                 "2 or more only.*sizes 0 and 1 apart.*build a pipeline from a sample"):
        pipe(input_ids=one, attention_mask=torch.ones_like(one), labels=one)
    with pytest.raises(InputMismatchError, match="input_ids has 3 dims but the sample's had 2"):
        pipe(input_ids=ids[None], attention_mask=mask, labels=ids)
    # another batch size, keywords in another order: runs, and equals eager
    ids6, mask6 = torch.randint(0, VOCAB, (2 * BATCH, SEQ)), torch.ones(2 * BATCH, SEQ, dtype=torch.long)
    out = pipe(labels=ids6, attention_mask=mask6, input_ids=ids6)
    want = ref(input_ids=ids6, attention_mask=mask6, labels=ids6)
    torch.testing.assert_close(out.logits, want.logits)
    exact.assert_close_scaled(out.loss, want.loss, what="loss merged over micro-batches")


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_gradient_checkpointing_enabled_model_matches_eager(checkpoint):
    """``gradient_checkpointing_enable()``: its layers ask ``torch.is_grad_enabled()`` at each call,
    so the capture is torch.fx's, which keeps what it cannot trace opaque (in transformers 5.x
    the whole ``transformer``). Exact, and the warning says what to do instead (a trial got
    advice about a mask's ``if`` and ``use_cache``)."""
    torch.manual_seed(0)
    model = gpt2().train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()  # the new name in transformers 5.x
    ids, _ = inputs()
    with pytest.warns(UserWarning, match=r"gradient checkpointing on.*gradient_checkpointing_disable\(\)"):
        exact.assert_exact(model, (ids,), 2, chunks=2, checkpoint=checkpoint, balance_by="params",
                           loss=lambda o: weighted(o.logits))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_with_dropout_builds_in_training_mode(reentrant):
    """Gradient checkpointing and dropout: the build's training-mode check makes dropout constant,
    and its backward recomputes each checkpointed layer. The recomputation ran without the switch
    (torch runs a function mode's handler with the mode popped, Tensor.backward among them): the
    dropout drew there and torch.utils.checkpoint refused the build with its own CheckpointError
    (a trial). Built now; with dropout drawing, the pipeline is compared between checkpoint modes
    (the same masks, loss and gradients)."""
    grads = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = gpt2()
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = 0.2
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        ids, _ = inputs()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe = fxpipe.pipeline(model, (), 2, sample_kwargs={"input_ids": ids, "labels": ids}, chunks=2,
                                   devices=["cpu"] * 2, output_merge={"loss": "mean"}, balance_by="params",
                                   checkpoint=checkpoint)
        torch.manual_seed(1)
        loss = pipe(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        pipe.close()
    (loss_a, a), (loss_b, b) = grads
    exact.assert_close_scaled(loss_a, loss_b, what="loss")
    top = max(exact.largest(g) for g in a.values())
    for name in a:
        exact.assert_close_scaled(a[name], b[name], what=f"grad {name}", floor_of=top)


def test_output_hidden_states_gives_the_same_graph_at_every_build():
    """transformers registers its output-capturing hooks on the blocks at the model's first call
    with ``output_hidden_states=True``: the first build makes that call. The hooks record only
    inside the model's own forward, so they are traced through: the second build's graph is the
    first's, and a plan made at the first (``fxpipe.tune``'s) fits the second."""
    torch.manual_seed(0)
    model = gpt2().eval()
    ids, _ = inputs()
    kw = {"output_hidden_states": True}

    def loss(o):
        return weighted(o.logits) + sum(weighted(h, k + 2) for k, h in enumerate(o.hidden_states))

    first = exact.assert_exact(model, (ids,), 2, kwargs=kw, chunks=2, balance_by="params", loss=loss)
    model(ids, **kw)  # transformers installs its hooks now, if the copy above did not
    assert any(m._forward_hooks for m in model.modules())
    second = exact.assert_exact(model, (ids,), 2, kwargs=kw, chunks=2, balance_by="params", loss=loss,
                                plan=first.plan)
    assert [str(s.code) for s in second.stages] == [str(s.code) for s in first.stages]
    assert not second.capture.leaves


def test_outputs_recorded_by_hooks_on_a_module_kept_whole_are_not_lost():
    """transformers records ``hidden_states`` / ``attentions`` with hooks that run only inside
    the model's own forward. A module torch.fx keeps whole (a ``leaf_modules`` entry, or one fx
    cannot trace, as RoBERTa's eager self-attention) never runs them while tracing: the graph
    returned the output without those entries, silently. The capture now goes to torch.export,
    which runs a kept module's hooks, and the pipeline returns every entry, exact."""
    torch.manual_seed(0)
    model = transformers.BertModel(bert_config()).eval()
    ids, mask = inputs()
    kw = {"attention_mask": mask, "output_hidden_states": True}

    def loss(o):
        return weighted(o.last_hidden_state) + sum(weighted(h, k + 2) for k, h in enumerate(o.hidden_states))

    layer = type(model.encoder.layer[0])
    pipe = exact.assert_exact(model, (ids,), 2, kwargs=kw, chunks=2, balance_by="params", loss=loss,
                              leaf_modules=[layer])
    assert pipe.capture.method == "export"
    assert len(pipe(ids, **kw).hidden_states) == len(model(ids, **kw).hidden_states) == 3
    config = transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        attn_implementation="eager", pad_token_id=1)
    roberta = transformers.RobertaForMaskedLM(config).eval()
    kw = {"output_attentions": True}
    ids = ids % (VOCAB - 2) + 2  # no padding id (1)
    pipe = exact.assert_exact(roberta, (ids,), 2, kwargs=kw, chunks=2, balance_by="params",
                              loss=lambda o: weighted(o.logits) + sum(weighted(a) for a in o.attentions))
    assert len(pipe(ids, **kw).attentions) == 2


def test_outputs_hooks_record_are_refused_by_name_when_torch_export_fails_too(monkeypatch):
    """Where torch.export cannot capture the model either, the fx graph (which would lose those
    outputs) is not used: a TraceError names the module kept whole and what to do."""
    from fxpipe.capture import _tracing
    from fxpipe.capture._export import _Failure
    from fxpipe.errors import TraceError

    monkeypatch.setattr(_tracing, "export_graph", lambda *a, **k: _Failure("", RuntimeError("export refused it")))
    torch.manual_seed(0)
    model = transformers.BertModel(bert_config()).eval()
    ids, _ = inputs()
    with pytest.raises(TraceError, match=r"'encoder.layer.0' .*would be kept whole by torch.fx.*export refused it"
                                         r".*What to do: leave those outputs out of the call"):
        fxpipe.pipeline(model, ids, 2, chunks=2, devices=["cpu"] * 2, sample_kwargs={"output_hidden_states": True},
                        leaf_modules=["encoder.layer.0"], balance_by="params")
