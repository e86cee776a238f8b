"""torch.compile and fxpipe pipelines (issue #8, item 7).

* Compiling each stage (``for s in pipe.stages: s.compile()``) is exact: the portal calls
  ``fxpipe.portals.stash/pop`` are ``torch.compiler.disable``-d, so dynamo breaks
  the stage's graph around them instead of tracing the skip trackers and the portals'
  autograd Functions (which lost 33-78% of the gradients of values skipping stages).
  Outputs and every gradient are compared with the eager model for every checkpoint mode,
  with skips spanning 2 and 3 stages, and with dropout against the uncompiled pipeline.
* ``torch.compile(pipe)`` raises :class:`fxpipe.emit._compiling.CompileError` at the first call,
  naming the supported way; the pipeline still works uncompiled afterwards.

Fast tests use dynamo with the ``aot_eager`` backend (dynamo + AOTAutograd, the parts that
decide the graph breaks and the gradients); the inductor tests compile C++ and are slow.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.emit._compiling import CompileError
from fxpipe.errors import FxpipeError
from fxpipe.portals import pop, stash

from exact import assert_grads_equal as assert_grads_close

# Outputs: compiled kernels (inductor) reassociate float sums. Gradients, which micro-batching
# also sums in another order than the whole batch does: the tolerance of tests/exact.py.
TOL = dict(rtol=1e-4, atol=1e-5)
MODES = ("always", "except_last", "never")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class LongSkip(nn.Module):
    """An MLP whose input projection skips to the end (over every stage) and whose third
    block skips to the end too (over the middle stages), with optional dropout."""

    def __init__(self, d: int = 16, depth: int = 6, p: float = 0.0) -> None:
        super().__init__()
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(depth))
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h0 = self.inp(x)
        h, mid = h0, None
        for i, block in enumerate(self.blocks):
            h = block(self.drop(h) if i % 2 else h)
            if i == 1:
                mid = h
        return self.out(h + h0 + 0.5 * mid)


def long_skip(p: float = 0.0, batch: int = 6):
    torch.manual_seed(0)
    model = LongSkip(p=p)
    x = torch.randn(batch, 8, generator=torch.Generator().manual_seed(1))
    return model, x


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """Every output element weighted differently: no gradient can hide in a sum."""
    return (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum() + out.square().mean()


def assert_grads_equal(model: nn.Module, ref: nn.Module) -> None:
    """Every parameter has a gradient (these models use them all), as eager's."""
    for name, q in ref.named_parameters():
        assert q.grad is not None, name
    assert_grads_close(model, ref)


def exact_steps(pipe: nn.Module, model: nn.Module, ref: nn.Module, x: torch.Tensor, steps: int = 2) -> None:
    """Training steps of the pipeline and of eager, compared; from the second on, cached compiled code runs."""
    for _ in range(steps):
        model.zero_grad()
        ref.zero_grad()
        out = pipe(x)
        expected = ref(x)
        torch.testing.assert_close(out, expected, **TOL)
        loss_of(out).backward()
        loss_of(expected).backward()
        assert_grads_equal(model, ref)


class CountingBackend:
    """aot_eager that counts the graphs it compiles and records what they call."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return self.inner(gm, example_inputs)


def make_pipe(model: nn.Module, x: torch.Tensor, n_stages: int, chunks: int, checkpoint: str) -> fxpipe.Pipeline:
    pipe = fxpipe.pipeline(model, x, n_stages, chunks=chunks, devices=["cpu"] * n_stages,
                           checkpoint=checkpoint, balance_by="params")
    spans = [p.dst - p.src for p in pipe.plan.portals]
    assert spans and max(spans) >= 2, pipe.plan  # a skip over at least one whole stage
    return pipe


# -- compiled stages ------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("n_stages,chunks", [(3, 2), (4, 3)])
def test_compiled_stages_match_eager_across_portals(n_stages, chunks, checkpoint):
    model, x = long_skip()
    ref = copy.deepcopy(model)
    pipe = make_pipe(model, x, n_stages, chunks, checkpoint)
    assert {p.dst - p.src for p in pipe.plan.portals} >= {n_stages - 1}  # h0 skips every middle stage
    backend = CountingBackend()
    for stage in pipe.stages:
        stage.compile(backend=backend)

    exact_steps(pipe, model, ref, x)

    assert len(backend.graphs) >= n_stages  # the stages really were compiled
    for gm in backend.graphs:  # ... and no portal call was traced into a graph
        called = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert stash not in called and pop not in called


def test_portal_calls_are_opaque_to_dynamo():
    """Generated code keeps naming them stash/pop; dynamo graph-breaks on them."""
    assert getattr(stash, "_torchdynamo_disable", False) and getattr(pop, "_torchdynamo_disable", False)
    assert stash.__name__ == "stash" and pop.__name__ == "pop"
    model, x = long_skip()
    pipe = make_pipe(model, x, 3, 2, "never")
    codes = [s.code for s in pipe.stages]
    assert any("fxpipe_portals_stash(" in c for c in codes)
    assert any("fxpipe_portals_pop(" in c for c in codes)


@pytest.mark.parametrize("checkpoint", MODES)
def test_compiled_stages_with_dropout_match_uncompiled_pipeline(checkpoint):
    """Dropout draws the same masks compiled and uncompiled (checkpoint recomputation
    included), so the compiled pipeline equals the uncompiled one, gradients too."""
    model, x = long_skip(p=0.5)
    twin = copy.deepcopy(model)
    plain = make_pipe(model, x, 4, 2, checkpoint)
    compiled = make_pipe(twin, x, 4, 2, checkpoint)
    backend = CountingBackend()
    for stage in compiled.stages:
        stage.compile(backend=backend)
    for seed in (1, 2):
        model.zero_grad()
        twin.zero_grad()
        torch.manual_seed(seed)
        out = plain(x)
        torch.manual_seed(seed)
        out_c = compiled(x)
        torch.testing.assert_close(out_c, out, **TOL)
        loss_of(out).backward()
        loss_of(out_c).backward()
        assert_grads_equal(twin, model)
    assert backend.graphs


# -- fxpipe.pipeline(..., compile=...) -------------------------------------------------------
@pytest.mark.parametrize("checkpoint", MODES)
def test_compile_option_compiles_every_stage_and_stays_exact(checkpoint):
    model, x = long_skip()
    ref = copy.deepcopy(model)
    backend = CountingBackend()
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, devices=["cpu"] * 3, checkpoint=checkpoint,
                           balance_by="params", compile={"backend": backend})
    assert max(p.dst - p.src for p in pipe.plan.portals) >= 2
    exact_steps(pipe, model, ref, x)
    assert len(backend.graphs) >= 3  # every stage compiled (more: graph breaks at portals)
    for gm in backend.graphs:
        called = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert stash not in called and pop not in called


def test_compiled_pipeline_deepcopies_and_the_copy_is_exact():
    model, x = long_skip()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, devices=["cpu"] * 3, balance_by="params",
                           compile={"backend": "aot_eager"})
    twin = copy.deepcopy(pipe)
    out = twin(x)
    expected = ref(x)
    torch.testing.assert_close(out, expected, **TOL)
    loss_of(out).backward()
    loss_of(expected).backward()
    assert_grads_equal(twin.module, ref)
    assert all(p.grad is None for p in model.parameters())  # the copy has its own parameters


@pytest.mark.parametrize("option,fragment", [
    ("yes", "compile must be True, False or a dict"),
    ({"mdoe": "max-autotune"}, "['mdoe']"),
])
def test_compile_option_is_checked_before_building(option, fragment):
    from fxpipe.errors import ArgumentError

    model, x = long_skip()
    with pytest.raises(ArgumentError, match=re.escape(fragment)) as info:
        fxpipe.pipeline(model, x, 3, devices=["cpu"] * 3, compile=option)
    assert info.value.argument == "compile"


@pytest.mark.parametrize("options,graphs", [
    ({"mode": "reduce-overhead"}, True),
    ({"mode": "max-autotune"}, True),
    ({"mode": "max-autotune-no-cudagraphs"}, False),
    ({}, False),
    ({"mode": "reduce-overhead", "options": {"triton.cudagraphs": False}}, False),
    ({"options": {"triton.cudagraphs": True}}, True),
    ({"mode": "reduce-overhead", "backend": "aot_eager"}, False),
])
def test_which_compile_options_replay_cuda_graphs(options, graphs):
    from fxpipe.emit._compiling import uses_cuda_graphs

    assert uses_cuda_graphs(options) is graphs


def test_cuda_graphs_on_worker_threads_are_refused_before_building_where_torch_cannot(monkeypatch):
    """torch before 2.13 kept CUDA graph trees' state per thread and failed on fxpipe's worker
    threads with an AssertionError from inductor (issue 21, torch 2.11): refused, typed, with
    what works instead, before the model is captured. Where torch can, nothing is refused."""
    import fxpipe.emit._compiling as compiling
    from fxpipe.errors import CompileError

    model, x = long_skip()
    monkeypatch.setattr(compiling, "threads_replay_graphs", lambda: False)
    with pytest.raises(CompileError, match=r"replays CUDA graphs.*compile=\{'mode': 'max-autotune-no-cudagraphs'\}"):
        fxpipe.pipeline(model, x, 2, devices=["cuda:0"] * 2, compile={"mode": "reduce-overhead"})
    compiling.check_graph_replay({"mode": "reduce-overhead"}, [torch.device("cpu")] * 2)  # no graphs on the CPU
    compiling.check_graph_replay({"mode": "default"}, [torch.device("cuda:0")])
    monkeypatch.setattr(compiling, "threads_replay_graphs", lambda: True)
    compiling.check_graph_replay({"mode": "reduce-overhead"}, [torch.device("cuda:0")])


# -- inductor (the default backend): C++ compilation, slow -----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("checkpoint", MODES)
def test_inductor_compiled_stages_match_eager_unet(checkpoint):
    zoo = pytest.importorskip("zoo")
    model, args, _ = zoo.unet()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, checkpoint=checkpoint,
                           balance_by="params", compile=True)
    assert any(p.dst - p.src >= 2 for p in pipe.plan.portals)  # encoder skips over the middle stage
    out = pipe(*args)
    expected = ref(*args)
    torch.testing.assert_close(out, expected, **TOL)
    loss_of(out).backward()
    loss_of(expected).backward()
    assert_grads_equal(model, ref)


@pytest.mark.slow
def test_inductor_compiled_stages_with_dropout_match_uncompiled_pipeline():
    model, x = long_skip(p=0.5)
    twin = copy.deepcopy(model)
    plain = make_pipe(model, x, 3, 3, "except_last")
    compiled = make_pipe(twin, x, 3, 3, "except_last")
    for stage in compiled.stages:
        stage.compile()
    with torch._inductor.config.patch(fallback_random=True):  # eager's RNG, not inductor's own
        torch.manual_seed(3)
        out = plain(x)
        torch.manual_seed(3)
        out_c = compiled(x)
        torch.testing.assert_close(out_c, out, **TOL)
        loss_of(out).backward()
        loss_of(out_c).backward()
    assert_grads_equal(twin, model)


@pytest.mark.slow
def test_inductor_own_rng_dropout_is_recomputed_exactly():
    """With inductor's own random numbers (the default), checkpoint recomputation draws the
    same masks as the forward: every checkpoint mode gives the outputs and gradients of
    the pipeline that recomputes nothing."""
    results = {}
    for checkpoint in ("never", "always", "except_last"):
        torch._dynamo.reset()
        model, x = long_skip(p=0.5)
        pipe = make_pipe(model, x, 3, 2, checkpoint)
        for stage in pipe.stages:
            stage.compile()
        torch.manual_seed(5)
        out = pipe(x)
        loss_of(out).backward()
        results[checkpoint] = (out.detach(), model)
    out0, model0 = results["never"]
    for checkpoint in ("always", "except_last"):
        out, model = results[checkpoint]
        torch.testing.assert_close(out, out0, **TOL)
        assert_grads_equal(model, model0)


# -- the whole pipeline -----------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"backend": "eager"}, {"mode": "reduce-overhead"}])
def test_compiling_the_whole_pipeline_is_refused_with_the_supported_way(options):
    model, x = long_skip()
    ref = copy.deepcopy(model)
    pipe = make_pipe(model, x, 3, 2, "except_last")
    with pytest.raises(CompileError) as info:
        torch.compile(pipe, **options)(x)
    err = info.value
    assert isinstance(err, FxpipeError) and isinstance(err, RuntimeError)
    msg = str(err)
    assert "torch.compile of a whole fxpipe pipeline is not supported" in msg
    assert "compile=True" in msg and "stage.compile()" in msg and "pipe.stages" in msg

    # nothing half-done: the pipeline itself still runs, exactly
    exact_steps(pipe, model, ref, x, steps=1)


def test_fullgraph_compile_of_the_whole_pipeline_reports_the_refusal():
    """With fullgraph=True dynamo reports every exception met while tracing as its own
    ``Unsupported`` ("Observed exception"); the CompileError and its advice are in it."""
    model, x = long_skip()
    pipe = make_pipe(model, x, 3, 2, "never")
    with pytest.raises(RuntimeError) as info:
        torch.compile(pipe, fullgraph=True)(x)
    msg = str(info.value)
    assert isinstance(info.value, CompileError) or "CompileError" in msg
    assert "torch.compile of a whole fxpipe pipeline is not supported" in msg and "stage.compile()" in msg


def test_compiled_code_calling_a_pipeline_is_refused():
    model, x = long_skip()
    pipe = make_pipe(model, x, 3, 2, "never")
    step = torch.compile(lambda t: F.relu(pipe(t)).sum(), backend="eager")
    with pytest.raises(CompileError, match="stage.compile"):
        step(x)
    pipe.compile(backend="eager")  # nn.Module.compile on the pipeline: the same refusal
    with pytest.raises(CompileError):
        pipe(x)
