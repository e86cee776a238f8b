"""Every transformers family, trained the way people train them (issue #10).

For each family of :mod:`tests.hf_families` (tiny configs, no downloads), in train mode with
dropout 0: ``fxpipe.pipeline(model, ..., 3 stages, chunks=2)`` against the eager model,
outputs and every parameter gradient (None vs tensor included):

* called as people call it: ``input_ids`` plus ``attention_mask`` with padding (and
  ``token_type_ids``, ``decoder_input_ids`` where the model takes them) as keywords, the
  causal mask built inside the model;
* with ``labels=``: the model computes its loss, a 0-dim ``loss`` output merged with
  ``output_merge={'loss': 'mean'}``, exact because both micro-batches hold the same number
  of samples and of labelled tokens.

Each pipeline is then called at two other lengths and with a smaller last batch (an odd
one: uneven micro-batches), labels padded with ``-100``, outputs and gradients exact at each
call: one pipeline takes every length (issue #31). A token mean that counts other numbers of
tokens per micro-batch (``-100`` labels) is weighted by those counts: see test_ignored_labels.py.

On a GPU (tests marked ``cuda``), every family also builds and matches eager with TF32 on and
under bf16 autocast: the build-time checks follow the numerics in effect (issue #18).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxpipe  # noqa: E402
from fxpipe.errors import MicroBatchError  # noqa: E402

from exact import assert_exact, weighted_loss  # noqa: E402
from exact import assert_close_at  # noqa: E402
from hf_families import BY_NAME, FAMILIES, Family, ids, padded_labels  # noqa: E402

STAGES, CHUNKS = 3, 2
# Larger families (encoder-decoders, rotary decoders with more ops): slow on 2 CPU cores.
SLOW = {"t5", "bart", "gptj", "falcon", "bloom", "gemma", "qwen2", "mistral", "phi", "gpt_neox"}


def _params(names, with_labels: bool = False):
    out = []
    for name in names:
        fam = BY_NAME[name]
        if with_labels and fam.labels is None:
            continue
        marks = [pytest.mark.slow] if name in SLOW else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


ALL = [f.name for f in FAMILIES]
#: (batch, length) of the calls after the sample's (4, 8): shorter, longer, a smaller odd batch
LATER = ((4, 5), (4, 13), (3, 11))


def _later(fam: Family, labels: bool = False) -> list[tuple[tuple, dict]]:
    calls = []
    for batch, seq in LATER if fam.lengths else ((3, None),):
        kwargs = fam.inputs(batch=batch, seq=seq) if seq else fam.inputs(batch=batch)
        if labels:
            y = fam.labels(batch=batch, seq=seq) if seq else fam.labels(batch=batch)
            kwargs["labels"] = padded_labels(y, kwargs["attention_mask"]) if "attention_mask" in kwargs else y
        calls.append(((), kwargs))
    return calls


@pytest.mark.parametrize("name", _params(ALL))
def test_family_matches_eager_in_train_mode(name):
    fam = BY_NAME[name]
    model = fam.model()
    pipe = assert_exact(model, (), STAGES, kwargs=fam.inputs(), chunks=CHUNKS, balance_by="params",
                        later=_later(fam))
    assert len(pipe.stages) == STAGES
    # Bloom's GeLUFunction (a custom autograd.Function) keeps torch.export out: fx, its model opaque
    assert pipe.training and pipe.capture.method == ("fx" if name == "bloom" else "export")


@pytest.mark.parametrize("name", _params(ALL, with_labels=True))
def test_family_with_labels_matches_eager(name):
    fam = BY_NAME[name]
    model = fam.model()
    kwargs = {**fam.inputs(), "labels": fam.labels()}
    pipe = assert_exact(model, (), STAGES, kwargs=kwargs, chunks=CHUNKS, balance_by="params",
                        output_merge={"loss": "mean"}, later=_later(fam, labels=True))
    out = pipe(**kwargs)
    assert out.loss.dim() == 0 and out.loss.requires_grad


def test_loss_needs_a_declared_merge_and_says_so():
    fam = BY_NAME["llama"]
    kwargs = {**fam.inputs(), "labels": fam.labels()}
    with pytest.raises(MicroBatchError) as info:
        fxpipe.pipeline(fam.model(), (), STAGES, sample_kwargs=kwargs, chunks=CHUNKS, balance_by="params")
    msg = str(info.value)
    assert "'loss'" in msg and "output_merge={'loss': 'mean'}" in msg
    assert "samples of equal-sized micro-batches" in msg and "labels that are not ignore_index" in msg
    assert "its mask's sum" in msg


@pytest.mark.parametrize("merge", ["callable", "sum"])
def test_loss_merge_declared_otherwise(merge):
    """A callable merge is the user's own reduction; 'sum' of two micro-batch means is not
    the batch mean, and the build-time check refuses it instead of training on it."""
    fam = BY_NAME["gpt2"]
    kwargs = {**fam.inputs(), "labels": fam.labels()}
    if merge == "callable":
        pipe = assert_exact(fam.model(), (), STAGES, kwargs=kwargs, chunks=CHUNKS, balance_by="params",
                            output_merge={"loss": lambda parts: torch.stack(parts).mean()})
        assert pipe(**kwargs).loss.dim() == 0
        return
    with pytest.raises(MicroBatchError) as info:
        fxpipe.pipeline(fam.model(), (), STAGES, sample_kwargs=kwargs, chunks=CHUNKS, balance_by="params",
                        output_merge={"loss": "sum"})
    assert "output 'loss' differs" in str(info.value)


def test_rotary_decoder_profiled_by_time_matches_eager():
    """The default balance_by='time' on a rotary LLM.

    transformers 4.x computes the rotary embedding under ``torch.no_grad()``: the export graph
    then holds a ``wrap_with_set_grad_enabled`` region the profiler must time as one call.
    transformers 5.x (``@dynamic_rope_update``, no region) has none; the region itself is
    covered model-independently by test_export_hops.py::test_no_grad_region_profiled_by_time.
    """
    fam = BY_NAME["llama"]
    pipe = assert_exact(fam.model(), (), STAGES, kwargs=fam.inputs(), chunks=CHUNKS)
    code = "\n".join(pipe.stage_code(k) for k in range(STAGES))
    calls = [n for n in pipe.plan.assignment if n.startswith("wrap_with_set_grad_enabled")]
    if calls:
        assert "torch.ops.higher_order.wrap_with_set_grad_enabled(False, submod_" in code
        assert all(pipe.plan.stages[pipe.plan.stage_of(n)].cost >= 0 for n in calls)


@pytest.mark.parametrize("leaf", ["by_type", "by_name"])
def test_rotary_decoder_with_opaque_layers(leaf):
    """leaf_modules on the torch.export path: each decoder layer is one call_module node."""
    fam = BY_NAME["llama"]
    model = fam.model()
    layer_cls = type(model.model.layers[0])
    leaves = [layer_cls] if leaf == "by_type" else ["model.layers.1"]
    pipe = assert_exact(model, (), STAGES, kwargs=fam.inputs(), chunks=CHUNKS, balance_by="params",
                        leaf_modules=leaves)
    expected = ["model.layers.0", "model.layers.1", "model.layers.2"] if leaf == "by_type" else ["model.layers.1"]
    assert pipe.capture.method == "export" and pipe.capture.leaves == expected
    calls = [n for s in pipe.stages for n in s.graph.nodes if n.op == "call_module"]
    assert sorted(n.target for n in calls) == expected
    assert not any(str(n.meta.get("fxpipe_module", "")).startswith("model.layers.1.")
                   for s in pipe.stages for n in s.graph.nodes)


def test_clip_contrastive_logits_are_refused():
    """CLIPModel's logits compare every image with every text of the batch: a micro-batch
    sees only its own pairs. The two towers pipeline exactly (clip_text, clip_vision)."""
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64),
        vision_config=dict(image_size=16, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=64), projection_dim=16)
    model = transformers.CLIPModel(config)
    kwargs = {"input_ids": ids(), "pixel_values": torch.randn(4, 3, 16, 16)}
    with pytest.raises(MicroBatchError, match="logits_per_image"):
        fxpipe.pipeline(model, (), 2, sample_kwargs=kwargs, chunks=2, balance_by="params")


# -- on a GPU with the usual reduced-precision settings (issue #18) ----------------------------

REDUCED = {"tf32": 2.0 ** -10, "bf16 autocast": torch.finfo(torch.bfloat16).eps}


@pytest.fixture
def tf32_on():
    """TF32 for cuBLAS and cuDNN, as GPU training scripts set it; put back after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def reduced_precision_matches_eager(name: str, labels: bool, setting: str, device: str = "cuda:0") -> None:
    """The family built on ``device`` under ``setting`` (with TF32 on where the device has it),
    against eager in the same setting: outputs and every gradient within a few epsilons of the
    reduced precision (tests/test_numerics.py's assert_close_at)."""
    fam = BY_NAME[name]
    model = fam.model().to(device)
    kwargs = {k: v.to(device) for k, v in fam.inputs().items()}
    if labels:
        kwargs["labels"] = fam.labels().to(device)
    ref = copy.deepcopy(model)
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
        pipe = fxpipe.pipeline(model, (), STAGES, sample_kwargs=kwargs, chunks=CHUNKS, devices=[device] * STAGES,
                               balance_by="params", output_merge={"loss": "mean"} if labels else None)
        got, expected = pipe(**kwargs), ref(**kwargs)
        got_loss, ref_loss = (got.loss, expected.loss) if labels else (weighted_loss(got), weighted_loss(expected))
    eps = REDUCED[setting]
    assert_close_at(eps, got, expected)
    got_loss.backward()
    ref_loss.backward()
    assert [(n, p.grad is None) for n, p in model.named_parameters()] == \
        [(n, p.grad is None) for n, p in ref.named_parameters()]
    assert_close_at(eps, [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()], grads=True)


@pytest.mark.cuda
@pytest.mark.parametrize("setting", sorted(REDUCED))
@pytest.mark.parametrize("name, labels", [(f.name, False) for f in FAMILIES]
                         + [(f.name, True) for f in FAMILIES if f.labels is not None])
def test_family_builds_on_a_gpu_with_tf32_and_under_bf16_autocast(name, labels, setting, tf32_on):
    """A 1B Llama with TF32 on was refused: the micro-batch check saw the matmul's own rounding
    at another batch size. bf16/fp16 with labels= was refused by the loss's gradient check."""
    reduced_precision_matches_eager(name, labels, setting)
