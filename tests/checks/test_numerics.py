"""The build-time checks follow the numerics in effect (issue #18, section 2; fxpipe.capture._numerics).

A per-sample model gives slightly other values on a micro-batch than on the whole batch, by
how much depends on the precision: TF32 matmuls, bf16/fp16 weights, autocast. The checks run
float32 math at full precision (TF32 and reduced-precision reductions off, flags restored
after) and their tolerance follows what cannot be switched off. A model that mixes the
samples of its batch is refused under every setting.

On the CPU TF32 does not exist and ``set_float32_matmul_precision('medium')`` may change
nothing, so the flag handling is tested through torch's own flag state (settable on any
build), the tolerance through :func:`fxpipe.capture._numerics.tolerance`, and whole builds under
bf16 weights and ``torch.autocast('cpu', torch.bfloat16)``. tests/test_families.py builds
every transformers family on a GPU with TF32 on and under bf16 autocast.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from exact import assert_close_at, assert_exact
from fxpipe.capture import _numerics as numerics
from fxpipe.errors import MicroBatchError
from test_batching import CenterInTraining, CountingNorm, Mixer

NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
BF16_EPS = torch.finfo(torch.bfloat16).eps
KEYS = [(b, o) for b in ("generic", "cuda", "mkldnn") for o in ("all", "matmul", "conv", "rnn")
        if not (b == "generic" and o != "all")]
REDUCTIONS = ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction")


def _read(get):
    try:
        return get()
    except RuntimeError as e:  # legacy and new APIs mixed: torch will not say
        return "unreadable" if "mix" in str(e) else e


def _flags() -> dict:
    """Every piece of torch's float32-precision state that fxpipe.capture._numerics touches."""
    state = {"legacy_matmul": _read(torch.get_float32_matmul_precision),
             "legacy_cublas": _read(torch._C._get_cublas_allow_tf32),
             "legacy_cudnn": _read(lambda: torch.backends.cudnn.allow_tf32)}
    for name in REDUCTIONS:
        state[name] = getattr(torch.backends.cuda.matmul, name)
    if NEW_API:
        for b, o in KEYS:
            state[(b, o)] = torch._C._get_fp32_precision_getter(b, o)
    return state


@pytest.fixture
def restore_flags():
    """Puts torch's precision flags back as they were (the defaults), whatever a test set."""
    legacy = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn.allow_tf32
    saved = _flags()
    yield
    if NEW_API:
        torch.backends.fp32_precision = "none"
    torch.set_float32_matmul_precision(legacy)
    torch.backends.cudnn.allow_tf32 = cudnn
    for name in REDUCTIONS:
        setattr(torch.backends.cuda.matmul, name, saved[name])
    if NEW_API:
        for b, o in KEYS:
            torch._C._set_fp32_precision_setter(b, o, saved[(b, o)])


# -- the tolerance ----------------------------------------------------------------------------

def test_float32_tolerance_is_unchanged_and_low_precision_follows_the_dtype():
    assert numerics.tolerance(torch.float32) == (1e-3, 1e-4)
    assert numerics.tolerance(torch.float64) == (1e-3, 1e-4)
    assert numerics.tolerance(torch.bfloat16) == (4 * BF16_EPS, 4 * BF16_EPS)
    fp16 = 4 * torch.finfo(torch.float16).eps
    assert numerics.tolerance(torch.float16) == (fp16, fp16)
    assert numerics.tolerance(torch.int64) == (1e-3, 1e-4)


def test_inside_the_checks_float32_values_get_the_models_precision():
    """A bf16 model's float32 outputs (an upcast loss) are only as precise as its bf16 math."""
    x = torch.randn(4, 8)
    with numerics.checking(nn.Linear(8, 8), [x]):
        assert numerics.tolerance(torch.float32) == (1e-3, 1e-4)
    with numerics.checking(nn.Linear(8, 8).to(torch.bfloat16), [x]):
        assert numerics.tolerance(torch.float32) == (4 * BF16_EPS, 4 * BF16_EPS)
    with numerics.checking(nn.Linear(8, 8), [x.half()]):
        assert numerics.tolerance(torch.float32)[0] == 4 * torch.finfo(torch.float16).eps
    assert numerics.tolerance(torch.float32) == (1e-3, 1e-4)  # and back after


def test_autocast_in_effect_sets_the_precision():
    params = list(nn.Linear(8, 8).parameters())
    assert numerics.compute_eps(params) == numerics.FP32_EPS
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert numerics.compute_eps(params) == BF16_EPS
        with torch.autocast("cpu", enabled=False):
            assert numerics.compute_eps(params) == numerics.FP32_EPS
    # an autocast of a device the model is not on changes nothing
    with torch.autocast("cuda", dtype=torch.float16, enabled=torch.cuda.is_available()):
        assert numerics.compute_eps(params) == numerics.FP32_EPS


@pytest.mark.parametrize("api", ["legacy", "new"])
def test_reduced_float32_math_sets_the_precision_unless_switched_off(api, restore_flags):
    """TF32 on CUDA, bf16 for oneDNN float32 matmuls on the CPU: the precision they allow,
    and IEEE float32 inside full_precision() with every flag back as it was after. With the new
    API alone (as transformers' enable_tf32 sets it) torch refuses to read the legacy flags."""
    if api == "new" and not NEW_API:
        pytest.skip("torch < 2.9 has no fp32_precision API")
    if api == "legacy":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")  # cuBLAS TF32, oneDNN bf16
    else:
        torch.backends.fp32_precision = "tf32"
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    before = _flags()
    assert (before["legacy_matmul"] == "unreadable") == (api == "new")
    assert numerics._fp32_math_eps("cuda") == numerics.TF32_EPS
    assert numerics._fp32_math_eps("cpu") == BF16_EPS
    assert numerics.compute_eps([torch.empty(0, device="meta")]) == numerics.FP32_EPS  # meta: no math
    with numerics.full_precision():
        assert numerics._fp32_math_eps("cuda") == numerics.FP32_EPS
        assert numerics._fp32_math_eps("cpu") == numerics.FP32_EPS
        # what cuBLAS reads (legacy and new flags in step: no 'mix of the legacy and new APIs')
        assert torch._C._get_cublas_allow_tf32() is False
        if api == "legacy":
            assert torch.backends.cudnn.allow_tf32 is False
        for name in REDUCTIONS:
            assert getattr(torch.backends.cuda.matmul, name) is False
    assert _flags() == before


def test_full_precision_with_mixed_api_flags(restore_flags):
    """Legacy TF32 on, then the new API's matmul flag off: a state torch will not read back
    through the legacy flag. The check runs at IEEE float32 and leaves the state as it was."""
    if not NEW_API:
        pytest.skip("torch < 2.9 has no fp32_precision API")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    torch.backends.cudnn.conv.fp32_precision = "ieee"
    before = _flags()
    assert before["legacy_cublas"] == before["legacy_cudnn"] == "unreadable"
    with numerics.full_precision():
        assert numerics._fp32_math_eps("cuda") == numerics.FP32_EPS
        assert torch._C._get_cublas_allow_tf32() is False
    assert _flags() == before


def test_flags_are_restored_when_the_check_raises(restore_flags):
    torch.backends.cuda.matmul.allow_tf32 = True
    before = _flags()
    with pytest.raises(MicroBatchError):
        fxpipe.pipeline(Mixer(CenterInTraining()), torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2,
                        leaf_modules=["n"])
    assert _flags() == before and torch.backends.cuda.matmul.allow_tf32


# -- whole builds -----------------------------------------------------------------------------

BF16_TOL = dict(rtol=2e-2, atol=2e-2)


def _bf16(model: nn.Module) -> nn.Module:
    return model.to(torch.bfloat16)


def test_build_under_bf16_autocast_and_bf16_weights_is_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 4))
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_exact(model, (x,), 3, chunks=3, balance_by="params", tol=BF16_TOL)
    assert_exact(_bf16(model), (x.bfloat16(),), 3, chunks=3, balance_by="params", tol=BF16_TOL)


@pytest.mark.parametrize("setting", ["bf16 weights", "bf16 autocast", "fp16 weights"])
@pytest.mark.parametrize("norm, leaves", [(CenterInTraining, ["n"]), (lambda: CountingNorm(16), ())])
def test_batch_mixing_is_refused_at_low_precision(setting, norm, leaves):
    torch.manual_seed(0)
    model = Mixer(norm())
    x = torch.randn(6, 8)
    if setting != "bf16 autocast":
        dtype = torch.bfloat16 if setting.startswith("bf16") else torch.float16
        model, x = model.to(dtype), x.to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
        with pytest.raises(MicroBatchError, match=r"(?s)in training mode.*module whose output differs.*'n'"):
            fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, leaf_modules=leaves)


@pytest.mark.cuda
@pytest.mark.parametrize("setting", ["tf32", "bf16 autocast"])
@pytest.mark.parametrize("norm, leaves", [(CenterInTraining, ["n"]), (lambda: CountingNorm(16), ())])
def test_batch_mixing_is_refused_on_a_gpu(setting, norm, leaves, restore_flags):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    model, x = Mixer(norm()).cuda(), torch.randn(6, 8, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
        with pytest.raises(MicroBatchError, match=r"(?s)in training mode.*module whose output differs.*'n'"):
            fxpipe.pipeline(model, x, 2, chunks=2, devices=["cuda:0"] * 2, leaf_modules=leaves)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # put back


class TokenMean(nn.Module):
    """A next-token loss, a token mean with ignore_index: merged by 'mean' over micro-batches
    that hold other numbers of counted tokens, it is not the batch's loss."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(32, 16), nn.Linear(16, 32)

    def forward(self, ids, labels):
        logits = self.head(torch.tanh(self.emb(ids)))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("setting", ["bf16 weights", "bf16 autocast"])
def test_ignored_labels_in_one_micro_batch_are_weighted_at_low_precision(setting):
    """A cross entropy mean with -100 labels in one micro-batch only is merged weighted by
    counted labels (fxpipe.checks._counted_labels), at low precision too: the build's checks pass
    and loss and gradients match eager's on the whole batch within that precision."""
    torch.manual_seed(0)
    model = TokenMean()
    if setting == "bf16 weights":
        model = model.to(torch.bfloat16)
    ids = torch.randint(0, 32, (4, 8))
    labels = ids.roll(-1, 1)
    labels[0, 1:] = -100
    ref, piped = copy.deepcopy(model), copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=setting == "bf16 autocast"):
        pipe = fxpipe.pipeline(piped, (ids, labels), 2, chunks=2, devices=["cpu"] * 2, output_merge="mean")
        got, expected = pipe(ids, labels), ref(ids, labels)
    got.backward()
    expected.backward()
    eps = torch.finfo(torch.bfloat16).eps
    assert_close_at(eps, got, expected)
    assert_close_at(eps, [p.grad for p in piped.parameters()], [p.grad for p in ref.parameters()], grads=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_transformers_causal_lm_in_half_precision_with_labels_matches_eager(dtype):
    """Issue #18: bf16/fp16 weights with labels= were refused ('gradient differs by 0.000977 ...
    exact when no label is ignored') though no label is ignored."""
    pytest.importorskip("transformers")
    from hf_families import BY_NAME

    fam = BY_NAME["llama"]
    kwargs = {**fam.inputs(), "labels": fam.labels()}
    model = fam.model().to(dtype)
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, (), 3, sample_kwargs=kwargs, chunks=2, devices=["cpu"] * 3, balance_by="params",
                           output_merge={"loss": "mean"})
    got, expected = pipe(**kwargs), ref(**kwargs)
    eps = torch.finfo(dtype).eps
    assert_close_at(eps, [got.loss, got.logits], [expected.loss, expected.logits])
    got.loss.backward()
    expected.loss.backward()
    grads = [(n, p.grad is None) for n, p in model.named_parameters()]
    assert grads == [(n, p.grad is None) for n, p in ref.named_parameters()]
    assert_close_at(eps, [p.grad for p in model.parameters()], [p.grad for p in ref.parameters()], grads=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_checks_comparison_decides_as_torchs_allclose_in_double(dtype):
    """Decided in float32 where the absolute part of the tolerance covers it (a double copy of
    GPT-2's logits cost a second), torch's allclose in double otherwise: the same answers. inf
    and NaN compare by place (a NaN raised torch's "atol must be greater than or equal to zero")."""
    from fxpipe.capture._values import same_value

    torch.manual_seed(0)
    rtol, atol = numerics.tolerance(dtype)
    a = (torch.randn(64, 33) * 3).to(dtype)
    scale = float(a.double().abs().max())
    step = (atol * scale) / 4
    cases = [a.clone(), (a.double() + step).to(dtype), (a.double() + step * 8).to(dtype),
             (a.double() * (1 + rtol / 2)).to(dtype), (a.double() * (1 + rtol * 8)).to(dtype)]
    inf, nan = a.clone(), a.clone()
    inf[3, 4], nan[5, 6] = float("inf"), float("nan")
    for b in cases:
        want = torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol * max(scale, 1.0))
        assert same_value(a, b) is want
    assert same_value(inf, inf.clone()) and not same_value(a, inf) and not same_value(inf, a)
    assert same_value(nan, nan.clone()) and not same_value(a, nan) and not same_value(nan, a)
