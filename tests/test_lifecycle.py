"""A pipeline's lifecycle: close(), ``with``, garbage collection, copies and pickles.

Both front ends (``fxpipe.pipeline`` and ``fxpipe.GPipe``) share it. Whatever a pipeline
borrows from the user's model (BatchNorm classes, for ``deferred_batch_norm=True``) is
given back exactly; copies of a pipeline are independent pipelines over a copy of the
model; every check compares outputs and gradients with the plain eager model.
"""

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import FxpipeError
from fxpipe.gpipe import ChunksError, PipelinePicklingError, PlacementError
from fxpipe.runtime._batchnorm import DEFERRED_ATTRIBUTES
from fxpipe.runtime._pipeline import PipelineClosedError

from exact import assert_all_close

CHUNKS = 3
BATCH = 12


class Scale(nn.Module):
    """A custom layer (defined at module level, so models using it pickle)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def make_model() -> nn.Sequential:
    # The BatchNorm sees the same input in the pipeline and in the full-batch model, so its
    # deferred running statistics can be compared exactly.
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), Scale(8), nn.ReLU(), nn.Linear(8, 8),
                         nn.ReLU(), nn.Linear(8, 3))


def build_fx(model: nn.Module, chunks: int = CHUNKS, **options) -> fxpipe.Pipeline:
    return fxpipe.pipeline(model, torch.randn(BATCH, 6), 2, chunks=chunks, devices=["cpu"] * 2,
                           balance_by="params", **options)


def build_gpipe(model: nn.Sequential, chunks: int = CHUNKS, **options) -> fxpipe.GPipe:
    return fxpipe.GPipe(model, [3, len(model) - 3], devices=["cpu"] * 2, chunks=chunks, **options)


BUILDERS = {"pipeline": build_fx, "GPipe": build_gpipe}
front_ends = pytest.mark.parametrize("build", list(BUILDERS.values()), ids=list(BUILDERS))


def model_of(pipe) -> nn.Module:
    """The model a pipeline trains (GPipe holds the layers in its partitions)."""
    return pipe.module if isinstance(pipe, fxpipe.Pipeline) else pipe.partitions


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()


def run_eager(ref: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(ref, nn.ModuleList):  # GPipe's partitions
        for partition in ref:
            x = partition(x)
        return x
    return ref(x)


def eager_step(ref: nn.Module, x: torch.Tensor, chunks: int = CHUNKS) -> torch.Tensor:
    """What a pipeline computes in training: the eager model on each micro-batch."""
    out = torch.cat([run_eager(ref, c) for c in x.chunk(chunks)])
    loss_of(out).backward()
    return out


def pipe_step(pipe, x: torch.Tensor) -> torch.Tensor:
    out = pipe(x)
    loss_of(out).backward()
    return out


def assert_same_training(model: nn.Module, ref: nn.Module) -> None:
    """Same parameters (after optimizer steps too) and gradients, name by name, to the
    rounding of sums over micro-batches (tests/exact.py)."""
    named, ref_named = list(model.named_parameters()), list(ref.named_parameters())
    assert len(named) == len(ref_named)
    assert_all_close((name, p, q) for (name, p), (_, q) in zip(named, ref_named))
    assert_all_close((f"grad of {name}", p.grad, q.grad) for (name, p), (_, q) in zip(named, ref_named))


def batch_norms(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def assert_plain(module: nn.Module) -> None:
    """Every BatchNorm is its own class again, with no deferred attribute left."""
    for bn in batch_norms(module):
        assert type(bn) is nn.BatchNorm1d
        assert not set(DEFERRED_ATTRIBUTES) & set(vars(bn))


# -- close() and ``with`` ---------------------------------------------------------------------

@front_ends
def test_close_gives_the_model_back_exactly(build):
    model = make_model()
    ref_full = copy.deepcopy(model)
    x = torch.randn(BATCH, 6)
    pipe = build(model, deferred_batch_norm=True)
    assert all(type(bn) is not nn.BatchNorm1d for bn in batch_norms(model))
    pipe_step(pipe, x)
    ref_full(x)
    pipe.close()
    assert pipe.closed
    assert_plain(model)
    torch.testing.assert_close(model[1].running_mean, ref_full[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref_full[1].running_var)

    # Eager training updates the running statistics again, exactly as the untouched model.
    model.zero_grad()
    ref_full.zero_grad()
    for step in range(2):
        y = torch.randn(BATCH, 6) + step
        loss_of(model(y)).backward()
        loss_of(ref_full(y)).backward()
    assert_same_training(model, ref_full)
    for a, b in zip(model.buffers(), ref_full.buffers()):
        torch.testing.assert_close(a, b)

    # And the model pickles as the plain model it is.
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert_plain(loaded)
    torch.testing.assert_close(loaded.eval()(x), ref_full.eval()(x))


@front_ends
def test_with_block_runs_exactly_then_closes(build):
    model = make_model()
    ref = copy.deepcopy(model)
    x = torch.randn(BATCH, 6)
    with build(model, deferred_batch_norm=True) as pipe:
        out = pipe_step(pipe, x)
    torch.testing.assert_close(out, eager_step(ref, x))
    assert_same_training(model, ref)
    assert pipe.closed
    assert_plain(model)
    with pytest.raises(PipelineClosedError, match=r"fxpipe\.(Pipeline|GPipe) was closed") as info:
        pipe(x)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, FxpipeError)
    assert "Build a new pipeline" in str(info.value)
    pipe.close()  # idempotent
    assert_plain(model)


@front_ends
def test_close_ends_the_worker_threads(build):
    pipe = build(make_model())
    pipe._runtime.threads = True  # CPU pipelines run inline unless asked for threads
    ref = copy.deepcopy(model_of(pipe))
    x = torch.randn(BATCH, 6)
    torch.testing.assert_close(pipe_step(pipe, x), eager_step(ref, x))
    threads = list(pipe._runtime.workers.threads)
    assert threads and all(t.is_alive() for t in threads)
    pipe.close()
    assert not any(t.is_alive() for t in threads)  # close() waits for them


@front_ends
def test_garbage_collection_restores_and_is_not_kept_alive(build):
    model = make_model()
    pipe = build(model, deferred_batch_norm=True)
    pipe_step(pipe, torch.randn(BATCH, 6))
    ref = weakref.ref(pipe)
    del pipe
    gc.collect()
    assert ref() is None
    assert_plain(model)


@front_ends
def test_two_pipelines_share_the_deferred_layers(build):
    # One pipeline per mode, or two configurations, on one model: closing one must not take
    # the other's deferred layers away.
    model = make_model()
    ref_full = copy.deepcopy(model)
    first = build(model, deferred_batch_norm=True)
    second = build(model, chunks=2, deferred_batch_norm=True)
    first.close()
    assert all(type(bn) is not nn.BatchNorm1d for bn in batch_norms(model))
    x = torch.randn(BATCH, 6)
    pipe_step(second, x)
    ref_full(x)
    torch.testing.assert_close(model[1].running_mean, ref_full[1].running_mean)
    torch.testing.assert_close(model[1].running_var, ref_full[1].running_var)
    second.close()
    assert_plain(model)


def test_a_failing_gpipe_constructor_converts_nothing():
    model = make_model()
    with pytest.raises(IndexError, match="too few devices"):
        fxpipe.GPipe(model, [2, 2, 3], devices=["cpu"] * 2, deferred_batch_norm=True)
    assert_plain(model)


# -- the model while a pipeline is alive --------------------------------------------------------

@front_ends
def test_model_pickles_and_copies_as_plain_while_the_pipeline_lives(build):
    model = make_model()
    x = torch.randn(BATCH, 6)
    pipe = build(model, deferred_batch_norm=True)
    pipe_step(pipe, x)
    expected = copy.deepcopy(model)  # the copy is plain too
    assert_plain(expected)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for copied in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))):
        assert_plain(copied)
        assert list(copied.state_dict()) == list(model.state_dict())
        for (name, a), b in zip(model.state_dict().items(), copied.state_dict().values()):
            torch.testing.assert_close(a, b, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(copied.eval()(x), expected.eval()(x))
    # The pipeline itself still defers and still trains the model.
    ref = copy.deepcopy(model)
    model.zero_grad()
    torch.testing.assert_close(pipe_step(pipe, x), eager_step(ref, x))
    assert_same_training(model, ref)
    pipe.close()


# -- copies of a pipeline ---------------------------------------------------------------------

@front_ends
@pytest.mark.parametrize("calls_before", [0, 1])
@pytest.mark.parametrize("deferred", [False, True])
def test_deepcopy_is_an_independent_pipeline(build, calls_before, deferred):
    model = make_model()
    pipe = build(model, deferred_batch_norm=deferred)
    pipe._runtime.threads = True
    x = torch.randn(BATCH, 6)
    for _ in range(calls_before):
        pipe_step(pipe, x)
    model.zero_grad(set_to_none=True)
    original = copy.deepcopy(model_of(pipe)).state_dict()

    twin = copy.deepcopy(pipe)
    twin_model = model_of(twin)
    ref = copy.deepcopy(twin_model)
    ref_full = copy.deepcopy(twin_model)
    own = {id(p) for p in twin_model.parameters()}
    assert not own & {id(p) for p in model.parameters()}
    if isinstance(twin, fxpipe.Pipeline):
        assert {id(p) for stage in twin.stages for p in stage.parameters()} <= own
    assert all((type(bn) is not nn.BatchNorm1d) == deferred for bn in batch_norms(twin_model))

    # Train the copy: eager-exact, and the original model is untouched.
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        y = x + step
        out = pipe_step(twin, y)
        ref_out = eager_step(ref, y)
        run_eager(ref_full, y)
        torch.testing.assert_close(out, ref_out)
        assert_same_training(twin_model, ref)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        with torch.no_grad():  # the full-batch reference follows the trained weights
            for p, q in zip(ref_full.parameters(), ref.parameters()):
                p.copy_(q)
    if deferred:
        bn, ref_bn = batch_norms(twin_model)[0], batch_norms(ref_full)[0]
        torch.testing.assert_close(bn.running_mean, ref_bn.running_mean)
        torch.testing.assert_close(bn.running_var, ref_bn.running_var)
    for (name, a), b in zip(original.items(), model_of(pipe).state_dict().values()):
        torch.testing.assert_close(b, a, msg=lambda m: f"{name} of the original changed: {m}")
    assert all(p.grad is None for p in model.parameters())

    # Each closes on its own.
    twin.close()
    assert_plain(twin_model)
    assert not pipe.closed
    if deferred:
        assert all(type(bn) is not nn.BatchNorm1d for bn in batch_norms(model))
    pipe.close()
    assert_plain(model)


@front_ends
def test_deepcopy_of_a_closed_pipeline_is_closed(build):
    pipe = build(make_model(), deferred_batch_norm=True)
    pipe.close()
    twin = copy.deepcopy(pipe)
    assert_plain(model_of(twin))
    with pytest.raises(PipelineClosedError):
        twin(torch.randn(BATCH, 6))


@front_ends
def test_shallow_copy_shares_the_model_not_the_threads(build):
    model = make_model()
    pipe = build(model, deferred_batch_norm=True)
    pipe._runtime.threads = True
    x = torch.randn(BATCH, 6)
    pipe_step(pipe, x)
    twin = copy.copy(pipe)
    assert twin._runtime is not pipe._runtime
    assert all(a is b for a, b in zip(twin.parameters(), model.parameters()))
    pipe.close()  # the copy still holds the deferred layers and runs
    model.zero_grad()
    ref = copy.deepcopy(model)
    torch.testing.assert_close(pipe_step(twin, x), eager_step(ref, x))
    assert_same_training(model, ref)
    assert all(type(bn) is not nn.BatchNorm1d for bn in batch_norms(model))
    twin.close()
    assert_plain(model)


@pytest.mark.parametrize("deferred", [False, True])
def test_gpipe_pickles_round_trip(deferred):
    pipe = build_gpipe(make_model(), deferred_batch_norm=deferred)
    pipe._runtime.threads = True
    x = torch.randn(BATCH, 6)
    pipe_step(pipe, x)
    pipe.zero_grad(set_to_none=True)
    loaded = pickle.loads(pickle.dumps(pipe))
    ref = copy.deepcopy(loaded.partitions)
    ref_full = copy.deepcopy(loaded.partitions)
    assert all((type(bn) is not nn.BatchNorm1d) == deferred for bn in batch_norms(loaded))
    torch.testing.assert_close(pipe_step(loaded, x), eager_step(ref, x))
    run_eager(ref_full, x)
    assert_same_training(loaded.partitions, ref)
    if deferred:
        torch.testing.assert_close(loaded[1].running_mean, ref_full[0][1].running_mean)
        torch.testing.assert_close(loaded[1].running_var, ref_full[0][1].running_var)
    assert all(p.grad is None for p in pipe.parameters())  # independent of the original
    loaded.close()
    pipe.close()
    assert_plain(loaded.partitions)


def test_fxpipe_pipeline_refuses_pickling_with_what_to_save():
    pipe = build_fx(make_model())
    for dump in (pickle.dumps, lambda p: torch.save(p, io.BytesIO())):
        with pytest.raises(PipelinePicklingError, match=r"plan\.save.*plan=") as info:
            dump(pipe)
        assert isinstance(info.value, TypeError) and isinstance(info.value, FxpipeError)


# -- settings -----------------------------------------------------------------------------

def test_pipeline_refuses_bool_and_fractional_chunks():
    for bad in (True, 0, 2.5, float("nan"), float("inf")):
        with pytest.raises(ChunksError, match=f"chunks={bad!r}") as info:
            build_fx(make_model(), chunks=bad)
        assert isinstance(info.value, ValueError)


@front_ends
def test_integral_float_chunks_are_taken_as_int(build):
    """torchgpipe stores GPipe(..., chunks=42.000) as 42; so do both front ends."""
    pipe = build(make_model(), chunks=2.0)
    assert pipe.chunks == 2 and type(pipe.chunks) is int
    pipe.chunks = 4.0
    assert pipe.chunks == 4 and type(pipe.chunks) is int


class CountCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


@front_ends
def test_chunks_is_validated_on_assignment(build):
    model = make_model()
    pipe = build(model)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ChunksError, match="number of chunks must be positive integer"):
            pipe.chunks = bad
    assert pipe.chunks == CHUNKS
    pipe.chunks = 4
    ref = copy.deepcopy(model)
    x = torch.randn(BATCH, 6)
    out = pipe_step(pipe, x)
    torch.testing.assert_close(out, eager_step(ref, x, chunks=4))
    assert_same_training(model, ref)


def test_gpipe_runs_the_assigned_number_of_micro_batches():
    counter = CountCalls()
    pipe = fxpipe.GPipe(nn.Sequential(nn.Linear(6, 6), counter), [1, 1], devices=["cpu"] * 2, chunks=2)
    pipe.chunks = 4
    pipe(torch.randn(BATCH, 6))
    assert counter.calls == 4


def test_moving_names_the_pipeline_class_and_what_to_do():
    pipe = build_fx(make_model())
    with pytest.raises(PlacementError, match=r"because fxpipe\.Pipeline should manage device placement") as info:
        pipe.to("cpu")
    assert "devices=" in str(info.value) and "GPipe" not in str(info.value)
    assert isinstance(info.value, TypeError)
    gpipe = build_gpipe(make_model())
    with pytest.raises(PlacementError, match=r"because fxpipe\.GPipe should manage device placement"):
        gpipe.cuda()


def test_parameter_and_buffer_names_are_the_models():
    model = make_model()
    pipe = build_fx(model)
    names = [name for name, _ in pipe.named_parameters()]
    assert names == [name for name, _ in model.named_parameters()]
    assert set(names) <= set(pipe.state_dict())
    assert all(a is b for a, b in zip(pipe.parameters(), model.parameters()))
    assert [n for n, _ in pipe.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert all(a is b for a, b in zip(pipe.buffers(), model.buffers()))

    # Optimizer parameter groups by name train the pipeline exactly as the model.
    ref = copy.deepcopy(model)

    def groups(named):
        named = dict(named)
        decay = [p for n, p in named.items() if n.endswith("weight")]
        rest = [p for n, p in named.items() if not n.endswith("weight")]
        return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]

    opt = torch.optim.SGD(groups(pipe.named_parameters()), lr=0.1)
    ref_opt = torch.optim.SGD(groups(ref.named_parameters()), lr=0.1)
    x = torch.randn(BATCH, 6)
    for _ in range(2):
        torch.testing.assert_close(pipe_step(pipe, x), eager_step(ref, x))
        opt.step()
        ref_opt.step()
        assert_same_training(model, ref)
        opt.zero_grad()
        ref_opt.zero_grad()


@pytest.mark.parametrize("name", ["unet", "gpt_tied"])
def test_deepcopy_keeps_portals_and_tied_weights(name):
    from zoo import ZOO

    model, args, _ = ZOO[name]()
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, balance_by="params")
    if name == "unet":
        assert pipe.stages.portals  # values cross stages through portals
    loss_of(pipe(*args)).backward()
    model.zero_grad(set_to_none=True)
    original = copy.deepcopy(model.state_dict())

    twin = copy.deepcopy(pipe)
    ref = copy.deepcopy(twin.module)
    if name == "gpt_tied":
        assert twin.module.head.weight is twin.module.tok.weight  # still one Parameter
    out = twin(*args)
    loss_of(out).backward()
    ref_out = ref(*args)
    loss_of(ref_out).backward()
    torch.testing.assert_close(out, ref_out)
    # Micro-batched sums round differently (the repo-wide gradient tolerance, tests/exact.py).
    assert_same_training(twin.module, ref)
    assert all(p.grad is None for p in model.parameters())
    for (key, a), b in zip(original.items(), model.state_dict().values()):
        torch.testing.assert_close(b, a, msg=lambda m: f"{key}: {m}")


class _CountsCalls(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # Python state the output does not depend on
        return super().forward(x)


def test_building_leaves_python_attributes_and_version_counters_as_they_were():
    """The build runs the model several times (capture, checks); afterwards a forward-side
    counter reads as before, and a graph recorded before the build still backpropagates
    (buffers are put back by value without bumping their version counters)."""
    torch.manual_seed(0)
    counted = _CountsCalls(8, 8)
    counted.calls = 0
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), counted, nn.Linear(8, 2)).eval()
    x = torch.randn(8, 8)
    pending = model(x)  # eval BatchNorm saves running_mean/var for backward
    versions = [b._version for b in model.buffers()]
    # kept opaque (a counter in traced code is refused: fxpipe.capture._trace_time), it runs in the build's checks
    fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False,
                    leaf_modules=[_CountsCalls])
    assert counted.calls == 1
    assert [b._version for b in model.buffers()] == versions
    pending.sum().backward()  # torch raises if a saved buffer was written in place
    assert model[0].weight.grad is not None


class _MeanLoss(torch.nn.Module):
    """Returns its loss as a 0-dim output (the split check then takes its gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 1)

    def forward(self, h: torch.Tensor) -> dict:
        return {"loss": self.b(torch.tanh(self.a(h))).pow(2).mean()}


def test_the_build_writes_no_gradient_outside_the_model():
    """A sample with autograd history (a trainable projection before the model, a leaf with
    requires_grad): the build's gradient check took .grad into them (twice a step's gradient
    at the user's next backward, measured)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(4, 6)
    x = torch.randn(8, 4, requires_grad=True)
    model = _MeanLoss()
    fxpipe.pipeline(model, proj(x), 2, chunks=2, devices=["cpu"] * 2, progress=False,
                    output_merge={"loss": "mean"})
    assert proj.weight.grad is None and proj.bias.grad is None and x.grad is None
    assert all(p.grad is None for p in model.parameters())


def test_functional_call_on_a_pipeline_says_to_call_it_on_the_model():
    """torch.func.functional_call(pipe, params, x) looked the model's submodules up on the
    pipeline and failed with torch's bare "Pipeline has no attribute `0`" (a trial): the
    pipeline's stages run the model's own tensors and cannot swap them for a call. Now the cause
    is a typed error saying so; functional_call on the model is unaffected."""
    from fxpipe.errors import SubmoduleAccessError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(4, 8)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False)
    doubled = {n: p.detach() * 2 for n, p in pipe.named_parameters()}
    with pytest.raises(AttributeError) as info:
        torch.func.functional_call(pipe, doubled, (x,))
    assert isinstance(info.value.__cause__, SubmoduleAccessError) or isinstance(info.value, SubmoduleAccessError)
    assert "call functional_call on the model" in str(info.value.__cause__ or info.value)
    torch.testing.assert_close(torch.func.functional_call(pipe.module, doubled, (x,)),
                               torch.func.functional_call(copy.deepcopy(model), doubled, (x,)))
    assert not hasattr(pipe, "0") and pipe.module is model  # attribute lookups as before
    torch.testing.assert_close(pipe(x), model(x))
