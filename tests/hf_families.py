"""Tiny transformers models of every family fxpipe is tested on, built from config objects.

No downloads: each model is ``Model(Config(...))`` with a few layers of width 32, every
dropout (and layer drop) set to 0 so that train mode is deterministic, and ``use_cache``
off. A :class:`Family` knows how to make the model and its inputs as people call it:
``input_ids`` with an ``attention_mask`` that pads some rows, ``token_type_ids`` where the
model has them, ``decoder_input_ids`` for encoder-decoders, ``pixel_values`` for vision,
and ``labels`` so that the model computes its own loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import transformers as T

VOCAB, BATCH, SEQ = 96, 4, 8
IMAGE, PATCH = 16, 8


def no_dropout(config: Any) -> Any:
    """Every dropout probability and layer-drop rate of ``config`` set to 0; no cache."""
    for key, value in list(vars(config).items()):
        if ("drop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    for sub in ("text_config", "vision_config"):
        if hasattr(config, sub):
            no_dropout(getattr(config, sub))
    if hasattr(config, "use_cache"):
        config.use_cache = False
    return config


def ids(seed: int = 0, low: int = 3, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, seq), generator=g)


def padding_mask(batch: int = BATCH, seq: int = SEQ, left: bool = False) -> torch.Tensor:
    """Padding of different lengths in both micro-batches (rows 1 and 3 keep 5/8 and 3/8 of
    the length), on the right (or the left)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    positions = torch.arange(seq)
    for row, keep in ((1, 5), (3, 3)):
        if row < batch:
            kept = max(1, keep * seq // 8)
            mask[row] = (positions >= seq - kept if left else positions < kept).long()
    return mask


def padded_labels(input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``input_ids`` as labels, ``-100`` where the mask pads: as a collator makes them."""
    return input_ids.masked_fill(mask == 0, -100)


def pixels(seed: int = 0, batch: int = BATCH) -> torch.Tensor:
    return torch.randn(batch, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(seed))


@dataclass
class Family:
    """One model family: how to build it, call it, and give it labels."""

    name: str
    build: Callable[[], torch.nn.Module]
    #: ``inputs(batch=BATCH, seq=SEQ)``: the keyword inputs of a batch
    inputs: Callable[..., dict[str, torch.Tensor]]
    #: ``labels(batch=BATCH, seq=SEQ)`` for ``labels=`` (the model then returns its own 0-dim
    #: loss); None: no labels
    labels: Callable[..., torch.Tensor] | None = None

    @property
    def lengths(self) -> bool:
        """Whether the inputs have a sequence length (images have none)."""
        return "pixel_values" not in self.inputs()

    def model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return self.build().train()


_DEC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)
_ENC = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)


def _causal(model: Callable[[], torch.nn.Module]) -> tuple[Callable, Callable, Callable]:
    def inputs(batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
        return {"input_ids": ids(0, batch=batch, seq=seq), "attention_mask": padding_mask(batch, seq)}
    return model, inputs, lambda batch=BATCH, seq=SEQ: ids(0, batch=batch, seq=seq)


def _masked(model: Callable[[], torch.nn.Module], token_types: bool) -> tuple[Callable, Callable, Callable]:
    def inputs(batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
        out = {"input_ids": ids(1, batch=batch, seq=seq), "attention_mask": padding_mask(batch, seq)}
        if token_types:
            out["token_type_ids"] = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
        return out
    return model, inputs, lambda batch=BATCH, seq=SEQ: ids(2, batch=batch, seq=seq)


def _seq2seq(model: Callable[[], torch.nn.Module]) -> tuple[Callable, Callable, Callable]:
    def inputs(batch: int = BATCH, seq: int = SEQ) -> dict[str, torch.Tensor]:
        return {"input_ids": ids(3, batch=batch, seq=seq), "attention_mask": padding_mask(batch, seq),
                "decoder_input_ids": ids(4, batch=batch, seq=seq)}
    return model, inputs, lambda batch=BATCH, seq=SEQ: ids(4, batch=batch, seq=seq)


FAMILIES: list[Family] = [
    Family("gpt2", *_causal(lambda: T.GPT2LMHeadModel(no_dropout(T.GPT2Config(
        n_layer=3, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64))))),
    Family("gptj", *_causal(lambda: T.GPTJForCausalLM(no_dropout(T.GPTJConfig(
        n_layer=3, n_embd=32, n_head=4, rotary_dim=4, vocab_size=VOCAB, n_positions=64))))),
    Family("gpt_neox", *_causal(lambda: T.GPTNeoXForCausalLM(no_dropout(T.GPTNeoXConfig(**_DEC))))),
    Family("llama", *_causal(lambda: T.LlamaForCausalLM(no_dropout(T.LlamaConfig(**_DEC, num_key_value_heads=2))))),
    Family("mistral", *_causal(lambda: T.MistralForCausalLM(no_dropout(T.MistralConfig(
        **_DEC, num_key_value_heads=2))))),
    Family("qwen2", *_causal(lambda: T.Qwen2ForCausalLM(no_dropout(T.Qwen2Config(**_DEC, num_key_value_heads=2))))),
    Family("gemma", *_causal(lambda: T.GemmaForCausalLM(no_dropout(T.GemmaConfig(
        **_DEC, num_key_value_heads=2, head_dim=8))))),
    Family("phi", *_causal(lambda: T.PhiForCausalLM(no_dropout(T.PhiConfig(**_DEC))))),
    Family("opt", *_causal(lambda: T.OPTForCausalLM(no_dropout(T.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=64,
        max_position_embeddings=64, word_embed_proj_dim=32))))),
    Family("falcon", *_causal(lambda: T.FalconForCausalLM(no_dropout(T.FalconConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4))))),
    Family("bloom", *_causal(lambda: T.BloomForCausalLM(no_dropout(T.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=3, n_head=4))))),
    Family("bert", *_masked(lambda: T.BertForMaskedLM(no_dropout(T.BertConfig(**_ENC))), True)),
    Family("roberta", *_masked(lambda: T.RobertaForMaskedLM(no_dropout(T.RobertaConfig(
        **_ENC, pad_token_id=1))), False)),
    Family("albert", *_masked(lambda: T.AlbertForMaskedLM(no_dropout(T.AlbertConfig(
        **_ENC, embedding_size=16))), True)),
    Family("distilbert", *_masked(lambda: T.DistilBertForMaskedLM(no_dropout(T.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, hidden_dim=64, max_position_embeddings=64))), False)),
    Family("electra", *_masked(lambda: T.ElectraForMaskedLM(no_dropout(T.ElectraConfig(
        **_ENC, embedding_size=16))), True)),
    Family("t5", *_seq2seq(lambda: T.T5ForConditionalGeneration(no_dropout(T.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0))))),
    Family("bart", *_seq2seq(lambda: T.BartForConditionalGeneration(no_dropout(T.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64))))),
    Family("vit", lambda: T.ViTForImageClassification(no_dropout(T.ViTConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, num_labels=5))),
        lambda batch=BATCH, seq=SEQ: {"pixel_values": pixels(batch=batch)},
        lambda batch=BATCH, seq=SEQ: torch.tensor([0, 3, 1, 4])[:batch]),
    Family("clip_text", lambda: T.CLIPTextModelWithProjection(no_dropout(T.CLIPTextConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, projection_dim=16))),
        lambda batch=BATCH, seq=SEQ: {"input_ids": ids(5, batch=batch, seq=seq),
                                      "attention_mask": padding_mask(batch, seq)}),
    Family("clip_vision", lambda: T.CLIPVisionModelWithProjection(no_dropout(T.CLIPVisionConfig(
        image_size=IMAGE, patch_size=PATCH, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        intermediate_size=64, projection_dim=16))),
        lambda batch=BATCH, seq=SEQ: {"pixel_values": pixels(1, batch=batch)}),
]

BY_NAME = {f.name: f for f in FAMILIES}
