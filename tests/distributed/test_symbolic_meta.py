"""A new micro-batch shape's ``PipelineStage`` metadata read from a torch.export graph's symbolic
values, or from one symbolic fake run (issue #31): equal to a fake run at that shape, field by
field, for every shape it covers; a shape it does not cover (a micro-batch of one sample, a size
the run fixed) says so, and gets a fake run of its own. No ranks needed: the stages are emitted
as ``fxpipe.distributed`` emits them (portals carried) and run in this process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.distributed._carry import carried_plan
from fxpipe.distributed._graph_meta import GraphMetas
from fxpipe.distributed._meta import stage_metas, stage_runs
from fxpipe.distributed._symbolic_meta import ShapeMetas, SymbolicMetas
from fxpipe.emit._stages import emit_stages

transformers = pytest.importorskip("transformers")

from hf_families import BY_NAME, VOCAB, no_dropout, padded_labels, padding_mask  # noqa: E402


class _Sizes(nn.Module):
    """torch.fx: sizes read and used in arithmetic, a slice of a learned position table, ints
    crossing stages."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(64, 8))
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.a(x) + self.pos[:t]
        h = self.b(h).reshape(b, t // 2, 2 * d)
        return self.c(h).mean(1)


def _stages(model: nn.Module, sample: dict, n: int = 3):
    pipe = fxpipe.pipeline(model, (), n, sample_kwargs=sample, chunks=2, devices=["cpu"] * n, progress=False,
                           balance_by="params", output_merge={"loss": "mean"} if "labels" in sample else None)
    gm = pipe.capture.graph_module
    return pipe.capture, emit_stages(gm, carried_plan(gm, pipe.plan))


def _same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.in_kinds == w.in_kinds and g.out_kinds == w.out_kinds
        for a, b in zip((*g.input_args, *g.output_args), (*w.input_args, *w.output_args)):
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad)
        assert len(g.outputs) == len(w.outputs)
        for a, b in zip(g.outputs, w.outputs):
            if isinstance(b, torch.Tensor):
                assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad)
            else:
                assert a == b


def _gpt2_batch(b: int, t: int) -> dict:
    ids = torch.randint(3, VOCAB, (b, t), generator=torch.Generator().manual_seed(t))
    mask = padding_mask(b, t)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_gpt2s_metadata_at_every_length_equals_a_fake_run():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(no_dropout(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64))).train()
    capture, stages = _stages(model, _gpt2_batch(4, 8))
    cpu = torch.device("cpu")
    micro = lambda b, t: capture.flatten_inputs((), _gpt2_batch(b, t))  # noqa: E731 - one micro-batch
    symbolic = SymbolicMetas.trace(stages.modules, micro(2, 8), stages.input_names, cpu)
    assert symbolic is not None
    for b, t in ((2, 8), (2, 13), (3, 5), (2, 40)):
        _same(symbolic.at(micro(b, t)), stage_metas(stages.modules, micro(b, t), stages.input_names, cpu))
    assert symbolic.at(micro(1, 8)) is None  # a micro-batch of one: below the symbols' range, a fake run
    shapes = ShapeMetas(stages.modules, stages.input_names, cpu)
    for b, t in ((2, 8), (2, 13), (1, 9), (2, 21)):
        _same(shapes(micro(b, t)), stage_metas(stages.modules, micro(b, t), stages.input_names, cpu))
    # lengths 13 and 21 read from the graph; the build's shape and the one-sample one: fake runs
    assert (shapes.read, shapes.evaluated, shapes.fake_runs) == (2, 0, 2)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "bart", "vit"])
def test_the_export_graphs_sizes_give_every_shapes_metadata_without_a_run(name):
    family = BY_NAME[name]
    model = family.model()

    def batch(b: int, t: int) -> dict:
        inputs = family.inputs(batch=b, seq=t)
        if family.labels is not None:
            labels = family.labels(batch=b, seq=t)
            mask = inputs.get("attention_mask")
            inputs["labels"] = padded_labels(labels, mask) if mask is not None and labels.dim() == 2 else labels
        return inputs

    capture, stages = _stages(model, batch(4, 8))
    assert capture.method == "export"
    cpu = torch.device("cpu")
    micro = lambda b, t: capture.flatten_inputs((), batch(b, t))  # noqa: E731 - one micro-batch
    reading = GraphMetas.of(stages.modules, stage_runs(stages.modules, micro(2, 8), cpu), micro(2, 8))
    assert reading is not None
    shapes = [(2, 8), (2, 5), (3, 17), (2, 31)] if family.lengths else [(2, 8), (3, 8)]
    for b, t in shapes:
        want = stage_metas(stages.modules, micro(b, t), stages.input_names, cpu)
        from fxpipe.distributed._meta import metas_of
        _same(metas_of(reading.at(micro(b, t)), stages.input_names), want)
    assert reading.at(micro(1, 8)) is None  # a micro-batch of one: below the batch symbol's range


def test_an_fx_models_size_arithmetic_is_evaluated_or_refused_to_a_fake_run():
    torch.manual_seed(0)
    capture, stages = _stages(_Sizes(), {"x": torch.randn(4, 8, 8)})
    assert capture.method == "fx"
    cpu = torch.device("cpu")
    micro = lambda b, t: [torch.randn(b, t, 8)]  # noqa: E731
    symbolic = SymbolicMetas.trace(stages.modules, micro(2, 8), stages.input_names, cpu)
    assert symbolic is not None
    for b, t in ((2, 8), (2, 12), (5, 30)):
        _same(symbolic.at(micro(b, t)), stage_metas(stages.modules, micro(b, t), stages.input_names, cpu))
