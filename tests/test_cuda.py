"""The pipeline on a real GPU: the same exactness checks as on the CPU, on CUDA streams.

On the CPU every stage runs on the caller's thread or a worker with no streams, so nothing
here can be checked there: the copy streams, the recomputation ordering, CUDA RNG states in
recomputed dropout, and events between stages sharing one device are CUDA-only. Every test
puts all stages on ``cuda:0`` (one GPU split into stages, as ``benchmarks/gpu.sh`` does);
with several GPUs the last test spreads the stages over them.

Every test is marked ``cuda`` and skips cleanly without a device (tests/conftest.py).
TF32 is turned off. Even so, cuBLAS picks other kernels (and reduction orders) for a
micro-batch than for the whole batch, so float32 results differ in the last bits: about 2e-5
absolute on a gradient element of 0.01 was seen on an H100. ``GPU_TOL`` allows that and no more
than a thousandth of any element: a lost or doubled micro-batch contribution is far larger.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import fxpipe
from exact import assert_all_close, assert_grads_equal, assert_same, weighted_loss
from zoo import dropout_model, gpt_tied, kwargs_dict_model, resnet_like, unet

pytestmark = pytest.mark.cuda

GPU_TOL = dict(rtol=1e-3, atol=5e-5)  # tests/exact.py scales atol with tensors above magnitude 1
MODES = ("never", "except_last", "always")
ZOO = {"gpt_tied": gpt_tied, "unet": unet, "resnet_like": resnet_like, "kwargs_dict": kwargs_dict_model}
# BatchNorm in training mode normalises each micro-batch on its own statistics, as GPipe does:
# the reference for these runs the eager model micro-batch by micro-batch.
BATCHNORM = {"resnet_like"}


@pytest.fixture(autouse=True)
def _no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _on_cuda(sample):
    model, args, kwargs = sample
    move = lambda v: v.cuda() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return model.cuda(), tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def _exact_on_cuda(sample, n_stages: int, devices, *, micro_batched: bool = False, **options) -> None:
    model, args, kwargs = _on_cuda(sample)
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, n_stages, sample_kwargs=kwargs or None, devices=devices, **options)
    got = pipe(*args, **kwargs)
    if micro_batched:
        (x,) = args
        expected = torch.cat([ref(part) for part in x.chunk(options["chunks"])])
    else:
        expected = ref(*args, **kwargs)
    assert_same(got, expected, **GPU_TOL)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    torch.cuda.synchronize()
    assert_grads_equal(model, ref, **GPU_TOL)


@pytest.mark.parametrize("name", sorted(ZOO))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 4])
def test_zoo_exact_on_one_gpu(name, mode, chunks):
    _exact_on_cuda(ZOO[name](batch=8), 3, ["cuda:0"] * 3, chunks=chunks, checkpoint=mode,
                   micro_batched=name in BATCHNORM)


@pytest.mark.parametrize("mode", MODES)
def test_sgd_steps_on_one_gpu(mode):
    """Three optimizer steps on a next-token loss: weights, not only the first gradients, stay with eager."""
    model, (x,), _ = _on_cuda(gpt_tied(batch=8))
    target = torch.roll(x, -1, dims=1)
    loss_of = lambda out: F.cross_entropy(out.flatten(0, 1), target.flatten())  # noqa: E731
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (x,), 4, chunks=4, checkpoint=mode, devices=["cuda:0"] * 4)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        loss_of(pipe(x)).backward()
        loss_of(ref(x)).backward()
        for opt in opts:
            opt.step()
    torch.cuda.synchronize()
    assert_all_close(((name, p, q) for (name, p), q in zip(model.named_parameters(), ref.parameters())), **GPU_TOL)


def test_dropout_same_across_checkpoint_modes_on_gpu():
    """Recomputed dropout draws the CUDA RNG exactly as the first forward did.

    The split is fixed (balance by parameters): which stage holds which dropout decides the
    order in which micro-batches draw, so two timed splits may draw different masks.
    """
    model, (x,), _ = _on_cuda(dropout_model(batch=16))
    results = []
    for mode in MODES:
        piped = copy.deepcopy(model)
        pipe = fxpipe.pipeline(piped, (x,), 2, chunks=4, checkpoint=mode, devices=["cuda:0"] * 2, balance_by="params")
        torch.manual_seed(7)
        out = pipe(x)
        weighted_loss(out).backward()
        results.append((out.detach(), [p.grad.clone() for p in piped.parameters()]))
    for out, grads in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=0, atol=0)
        for g, r in zip(grads, results[0][1]):
            torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("mode", MODES)
def test_input_on_cpu_reaches_gpu_stages(mode):
    """A CPU batch is moved to the first stage's device and the outputs come back on the last."""
    model, (x,), _ = _on_cuda(unet(batch=8))
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (x,), 2, chunks=2, checkpoint=mode, devices=["cuda:0"] * 2)
    got = pipe(x.cpu())
    assert got.device.type == "cuda"
    expected = ref(x)
    assert_same(got, expected, **GPU_TOL)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    assert_grads_equal(model, ref, **GPU_TOL)


def test_compiled_stages_on_gpu():
    """compile=True through inductor/Triton: exact up to inductor's reassociation."""
    model, (x,), _ = _on_cuda(gpt_tied(batch=8))
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (x,), 2, chunks=2, checkpoint="except_last", devices=["cuda:0"] * 2, compile=True)
    got, expected = pipe(x), ref(x)
    tol = dict(rtol=1e-3, atol=1e-4)
    assert_same(got, expected, **tol)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    assert_grads_equal(model, ref, **tol)


@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_replay_is_exact_against_the_uncompiled_pipeline(mode):
    """compile={'mode': 'reduce-overhead'}: stages replayed from CUDA graphs on fxpipe's worker
    threads, with portals (U-Net), 4 micro-batches (a later replay must not overwrite outputs an
    earlier micro-batch still needs) and recomputation; three steps: warm-up, record, replay.
    Where torch cannot replay on worker threads, the build refuses it (tests/emit/test_compile.py)."""
    from fxpipe.emit._compiling import threads_replay_graphs

    if not threads_replay_graphs():
        pytest.skip(f"torch {torch.__version__} refuses CUDA graphs on worker threads (CompileError)")
    model, (x,), _ = _on_cuda(unet(batch=8))
    ref = copy.deepcopy(model)
    devices = ["cuda:0"] * 2
    plain = fxpipe.pipeline(ref, (x,), 2, chunks=4, checkpoint=mode, devices=devices)
    graphed = fxpipe.pipeline(model, (x,), 2, chunks=4, checkpoint=mode, devices=devices,
                              compile={"mode": "reduce-overhead"})
    tol = dict(rtol=1e-3, atol=1e-4)
    for step in range(3):
        got, want = graphed(x), plain(x)
        assert_same(got, want, **tol)
        weighted_loss(got).backward()
        weighted_loss(want).backward()
        torch.cuda.synchronize()
        assert_grads_equal(model, ref, **tol)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_stages_spread_over_gpus():
    n = min(torch.cuda.device_count(), 4)
    _exact_on_cuda(unet(batch=8), n, [f"cuda:{i}" for i in range(n)], chunks=4, checkpoint="except_last")
