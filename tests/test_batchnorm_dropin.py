"""``fxpipe.batchnorm.DeferredBatchNorm``: torchgpipe's hand conversion, exact.

torchgpipe code does ``DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)``;
after one mini-batch of ``chunks`` micro-batches the running statistics must equal those of
the plain BatchNorm run on the whole mini-batch, while outputs and gradients are those of
the plain model run on each micro-batch (normalisation is per micro-batch, as in GPipe).
"""

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.batchnorm import BatchNormConversionError, DeferredBatchNorm
from fxpipe.errors import FxpipeError

from exact import assert_all_close, assert_grads_equal

BATCH = 12


def bn_models():
    # The BatchNorm comes first after a layer whose output does not depend on the batch, so
    # the pipelined and the full-batch model feed it the same values.
    yield "1d", nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)), (BATCH, 5)
    yield "1d-seq", nn.Sequential(nn.Conv1d(3, 4, 1), nn.BatchNorm1d(4, momentum=None), nn.Flatten(), nn.Linear(20, 3)), (BATCH, 3, 5)
    yield "2d", nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, momentum=0.3), nn.ReLU(), nn.Flatten(),
                              nn.Linear(64, 3)), (BATCH, 3, 4, 4)
    yield "3d", nn.Sequential(nn.Conv3d(3, 2, 1), nn.BatchNorm3d(2, affine=False), nn.Flatten(), nn.Linear(16, 3)), (BATCH, 3, 2, 2, 2)


MODELS = {name: (model, shape) for name, model, shape in bn_models()}
models = pytest.mark.parametrize("name", list(MODELS))


def fresh(name):
    model, shape = MODELS[name]
    torch.manual_seed(1)
    return copy.deepcopy(model), torch.randn(*shape) * 2 + 1


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum()


def assert_grads(model: nn.Module, ref: nn.Module) -> None:
    assert_grads_equal(model, ref)


def assert_stats(model: nn.Module, ref: nn.Module) -> None:
    """Running statistics: deferred ones are sums over micro-batches, rounded in another order
    than the whole batch's (tests/exact.py's tolerance); counts exactly."""
    named, ref_named = list(model.named_buffers()), list(ref.named_buffers())
    assert [n for n, _ in named] == [n for n, _ in ref_named]
    assert_all_close((name, a, b) for (name, a), (_, b) in zip(named, ref_named))


def test_conversion_replaces_layers_sharing_their_tensors():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.BatchNorm1d(4, track_running_stats=False)))
    model.eval()
    bn = model[1]
    keys = list(model.state_dict())
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, 4)
    assert converted is model  # submodules are replaced in place
    assert type(model[1]) is DeferredBatchNorm and model[1].chunks == 4
    assert model[1].weight is bn.weight and model[1].bias is bn.bias
    assert model[1].running_mean is bn.running_mean and model[1].running_var is bn.running_var
    assert model[1].num_batches_tracked is bn.num_batches_tracked
    assert not model[1].training  # the layer's mode is kept
    assert type(model[2][0]) is nn.BatchNorm1d  # nothing to defer without running stats
    assert list(model.state_dict()) == keys
    assert DeferredBatchNorm.convert_deferred_batch_norm(model, 4)[1] is model[1]  # idempotent
    rechunked = DeferredBatchNorm.convert_deferred_batch_norm(model, 2)[1]
    assert rechunked.chunks == 2 and rechunked.running_mean is bn.running_mean

    root = nn.BatchNorm2d(3)
    new_root = DeferredBatchNorm.convert_deferred_batch_norm(root, 2)
    assert isinstance(new_root, DeferredBatchNorm) and new_root.weight is root.weight


@models
def test_commits_once_every_chunks_calls(name):
    # torchgpipe's contract, eagerly: chunks training calls make one mini-batch.
    model, x = fresh(name)
    full = copy.deepcopy(model)
    DeferredBatchNorm.convert_deferred_batch_norm(model, 3)
    before = [b.clone() for b in model.buffers()]
    parts = x.chunk(3)
    model(parts[0])
    model(parts[1])
    for a, b in zip(model.buffers(), before):
        torch.testing.assert_close(a, b)  # nothing committed mid mini-batch
    model(parts[2])
    full(x)
    assert_stats(model, full)


@models
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_gpipe_mini_batch_is_exact(name, checkpoint):
    model, x = fresh(name)
    per_micro = copy.deepcopy(model)
    full = copy.deepcopy(model)
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, 4)
    pipe = fxpipe.GPipe(converted, [2, len(converted) - 2], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    out = pipe(x)
    loss_of(out).backward()
    ref_out = torch.cat([per_micro(c) for c in x.chunk(4)])
    loss_of(ref_out).backward()
    full(x)
    torch.testing.assert_close(out, ref_out)
    assert_grads(model, per_micro)
    assert_stats(model, full)  # recomputation tracked nothing
    assert model[1].num_batches_tracked.item() == 1

    # Evaluation normalises with the running statistics, as the plain layer does.
    pipe.eval()
    full.eval()
    torch.testing.assert_close(pipe(x), full(x))
    pipe.close()
    assert type(model[1]) is DeferredBatchNorm  # the user's conversion is the user's


@models
def test_fxpipe_pipeline_mini_batch_is_exact(name):
    model, x = fresh(name)
    per_micro = copy.deepcopy(model)
    full = copy.deepcopy(model)
    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, 3)
    with fxpipe.pipeline(converted, x, 2, chunks=3, devices=["cpu"] * 2, balance_by="time",
                         leaf_modules=[DeferredBatchNorm]) as pipe:
        out = pipe(x)
        loss_of(out).backward()
    ref_out = torch.cat([per_micro(c) for c in x.chunk(3)])
    loss_of(ref_out).backward()
    full(x)
    torch.testing.assert_close(out, ref_out)
    assert_grads(model, per_micro)
    # Profiling ran the model while building; the layers started the mini-batch afresh.
    assert_stats(model, full)


def test_deferred_pipeline_option_leaves_converted_layers_alone():
    model, x = fresh("2d")
    full = copy.deepcopy(model)
    DeferredBatchNorm.convert_deferred_batch_norm(model, 4)
    with fxpipe.GPipe(model, [2, 3], devices=["cpu"] * 2, chunks=4, deferred_batch_norm=True) as pipe:
        pipe(x)
    full(x)
    assert_stats(model, full)  # committed once, not twice
    assert type(model[1]) is DeferredBatchNorm


def test_converted_model_pickles_as_itself():
    model, x = fresh("2d")
    DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    model(x[:6])  # half a mini-batch tracked
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    copies = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))]
    model(x[6:])
    for loaded in copies:
        assert type(loaded[1]) is DeferredBatchNorm and loaded[1].chunks == 2
        loaded(x[6:])  # completes the mini-batch it was saved in
        assert_stats(loaded, model)


def test_conversion_refusals_are_typed():
    lazy = nn.Sequential(nn.LazyBatchNorm1d())
    with pytest.raises(BatchNormConversionError, match="LazyBatchNorm1d has not inferred num_features") as info:
        DeferredBatchNorm.convert_deferred_batch_norm(lazy, 2)
    assert isinstance(info.value, ValueError) and isinstance(info.value, FxpipeError)
    for bad in (0, True):
        with pytest.raises(BatchNormConversionError, match="chunks must be a positive integer"):
            DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(3), bad)


def test_training_call_under_no_grad_commits_its_own_statistics():
    """A training-mode call under no_grad updates running statistics, as eager BatchNorm does,
    and does not leak its statistics into the next mini-batch's commit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(8, 4), 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True)
    first, second = torch.randn(8, 4), torch.randn(8, 4)
    with torch.no_grad():
        pipe(first)
        reference(first)
    pipe(second).sum().backward()
    reference(second).sum().backward()
    got = model[1].state_dict()
    assert_all_close((key, got[key], value) for key, value in reference[1].state_dict().items())
