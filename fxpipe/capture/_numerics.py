"""The float precision the build-time checks run at, and the tolerance that follows from it.

The build compares the captured graph run on the whole sample with the same graph run on
micro-batches and merged (:mod:`fxpipe.checks._batching`, :mod:`fxpipe.checks._modes`,
:mod:`fxpipe.checks._loss`). The two differ by rounding even when nothing mixes the samples
of the batch: a matmul of another batch size may run another kernel that sums in another
order. How much depends on the numerics in effect, and a tolerance made for float32 refuses
models that are perfectly per sample: a 1B Llama on a GPU with TF32 on (0.0065 on logits of
5.8), bf16 weights (gradients 1e-3 apart).

Two things keep the check tight where it can be and fair where it cannot:

* :func:`full_precision` runs the checks with float32 math in IEEE float32: TF32 off for
  cuBLAS and cuDNN (``torch.backends.cuda.matmul.allow_tf32``, ``set_float32_matmul_precision``,
  ``torch.backends.cudnn.allow_tf32`` and their ``fp32_precision`` counterparts), no bf16
  for oneDNN float32 math, and half-precision GEMMs reducing in float32. Whether the samples
  mix is a property of the graph, not of the precision, so a float32 model is checked at
  float32's own tolerance whatever the user's flags; every flag is put back afterwards, and
  the pipeline then runs with the user's settings (its TF32 results differ from eager's
  whole-batch ones as eager's own do between batch sizes).
* What cannot be switched off sets the tolerance (:func:`tolerance`): the dtype of the
  values compared, of the model's parameters and buffers and of the inputs, the dtype of an
  autocast in effect on a device the model uses, and reduced float32 math still in effect
  (:func:`compute_eps` reads the flags, so it also holds outside :func:`full_precision`). Genuine
  mixing (a batch statistic, in-batch negatives, a loss weighted per micro-batch) moves values
  by a sizeable fraction of themselves and is still refused at bf16's tolerance.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Iterator, List, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ["full_precision", "checking", "compute_eps", "tolerance", "dtype_eps", "FP32_EPS", "TF32_EPS"]

FP32_EPS = torch.finfo(torch.float32).eps
#: TF32 keeps 10 of float32's 23 mantissa bits
TF32_EPS = 2.0 ** -10
_REDUCED_EPS = {"tf32": TF32_EPS, "bf16": torch.finfo(torch.bfloat16).eps}
#: how many machine epsilons of the working precision two runs may differ by, as rtol and as
#: a fraction of the largest |value|. Measured on the tiny transformers families in bf16 and
#: fp16 weights and under bf16 autocast: at most 1 eps of either (GPT-2's bf16 gradients),
#: and the -100 label imbalance of a token mean moves gradients by 20% or more of the largest.
EPS_FACTOR = 4.0
#: the float32 tolerance (rtol, atol as a fraction of the largest |value|), the floor of all
_FP32_TOL = (1e-3, 1e-4)

# The working precision of the checks in progress (the largest machine epsilon), set by checking().
_check_eps: ContextVar[float] = ContextVar("fxpipe_check_eps", default=0.0)


def dtype_eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating (or complex) dtype; 0 for any other."""
    if dtype.is_complex:
        dtype = {torch.complex32: torch.float16, torch.complex64: torch.float32}.get(dtype, torch.float64)
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def tolerance(dtype: torch.dtype) -> Tuple[float, float]:
    """``(rtol, atol as a fraction of the largest |value|)`` for comparing two runs of values of
    ``dtype`` under the checks in progress (:func:`checking`): float32's where everything is
    float32 or wider, else :data:`EPS_FACTOR` epsilons of the lowest precision in effect."""
    eps = max(dtype_eps(dtype), _check_eps.get())
    factor = EPS_FACTOR * eps
    return max(_FP32_TOL[0], factor), max(_FP32_TOL[1], factor)


# -- what is in effect -------------------------------------------------------------------------
# torch >= 2.9 keeps float32 precision per (backend, op) ('fp32_precision', the "new API", which
# the kernels read) beside the legacy flags, and refuses to read a legacy flag that disagrees
# with it ("mix of the legacy and new APIs"). Where it exists it is the truth here.
_NEW_API = hasattr(torch._C, "_get_fp32_precision_getter")
_OPS = ("matmul", "conv", "rnn")


def _fp32_flag(backend: str, op: str) -> str:
    """The new API's float32 precision of (backend, op) resolved through its parents ('none'
    inherits): 'ieee', 'tf32', 'bf16', or 'none' (nothing set: IEEE)."""
    for b, o in ((backend, op), (backend, "all"), ("generic", "all")):
        value = torch._C._get_fp32_precision_getter(b, o)
        if value != "none":
            return "none" if backend == "cuda" and value == "bf16" else value  # cuda has no bf16
    return "none"


def _fp32_math_eps(device_type: str) -> float:
    """Machine epsilon float32 matmul/convolution/RNN math reaches on ``device_type`` now."""
    backend = {"cuda": "cuda", "cpu": "mkldnn"}.get(device_type)
    if backend is None:
        return FP32_EPS
    if _NEW_API:
        return max(_REDUCED_EPS.get(_fp32_flag(backend, op), FP32_EPS) for op in _OPS)
    precision = torch.get_float32_matmul_precision()  # torch < 2.9: the legacy flags only
    if device_type == "cuda":
        return TF32_EPS if precision != "highest" or torch.backends.cudnn.allow_tf32 else FP32_EPS
    return _REDUCED_EPS["bf16"] if precision == "medium" else FP32_EPS


def compute_eps(tensors: Iterable[Tensor]) -> float:
    """The largest machine epsilon of the math that produces values from ``tensors`` (a model's
    parameters and buffers, its inputs): their floating dtypes, an autocast enabled on a device
    they are on, and the float32 math precision of that device."""
    eps = 0.0
    devices = set()
    for t in tensors:
        eps = max(eps, dtype_eps(t.dtype))
        devices.add(t.device.type)
    for device_type in devices:
        if device_type == "meta":
            continue
        eps = max(eps, _fp32_math_eps(device_type))
        try:
            if torch.is_autocast_enabled(device_type):
                eps = max(eps, dtype_eps(torch.get_autocast_dtype(device_type)))
        except (RuntimeError, TypeError):  # a device type autocast does not know
            pass
    return eps


# -- running at full precision ---------------------------------------------------------------
def _legacy(read: Callable[[], Any]) -> Any:
    """A legacy flag's value, or None where torch refuses to read it (legacy and new APIs mixed)."""
    try:
        return read()
    except RuntimeError:
        return None


def _keep_new_flags(undo: List[Callable[[], None]], keys: Sequence[Tuple[str, str]]) -> None:
    """The new API's raw flags of ``keys`` (maybe 'none') put back by ``undo``. Registered before
    a legacy flag's restore, so that it runs after it (a legacy setter rewrites new flags)."""
    if not _NEW_API:
        return
    saved = [(b, o, torch._C._get_fp32_precision_getter(b, o)) for b, o in keys]

    def restore() -> None:
        for b, o, v in saved:
            torch._C._set_fp32_precision_setter(b, o, v)
    undo.append(restore)


def _set_new_flags(keys: Sequence[Tuple[str, str]], value: str) -> None:
    if _NEW_API:
        for b, o in keys:
            torch._C._set_fp32_precision_setter(b, o, value)


def _matmul_ieee(undo: List[Callable[[], None]]) -> None:
    """cuBLAS and oneDNN float32 matmuls in IEEE float32. Through the legacy setter too where
    the legacy flag is readable, so that legacy and new flags stay in step meanwhile."""
    keys = [("cuda", "matmul"), ("mkldnn", "matmul")]
    legacy = _legacy(torch.get_float32_matmul_precision)
    _keep_new_flags(undo, keys)
    if legacy is not None:
        undo.append(lambda: torch.set_float32_matmul_precision(legacy))
        torch.set_float32_matmul_precision("highest")
    _set_new_flags(keys, "ieee")


def _conv_rnn_ieee(undo: List[Callable[[], None]]) -> None:
    """cuDNN and oneDNN float32 convolutions and RNNs in IEEE float32, the legacy cuDNN flag
    too where it is readable."""
    keys = [("cuda", "conv"), ("cuda", "rnn"), ("mkldnn", "conv"), ("mkldnn", "rnn")]
    legacy = _legacy(lambda: torch.backends.cudnn.allow_tf32)
    _keep_new_flags(undo, keys)
    if legacy is not None:
        def restore() -> None:
            torch.backends.cudnn.allow_tf32 = legacy
        undo.append(restore)
        torch.backends.cudnn.allow_tf32 = False
    _set_new_flags(keys, "ieee")


def _half_reductions_fp32(undo: List[Callable[[], None]]) -> None:
    """fp16/bf16 cuBLAS GEMMs accumulating and reducing in float32."""
    matmul: Any = torch.backends.cuda.matmul
    for name in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction",
                 "allow_fp16_accumulation"):
        try:
            value = getattr(matmul, name)
        except AttributeError:  # an older torch
            continue
        if value:
            try:  # torch >= 2.8 keeps a split-k flag beside it, set together
                value = (value, getattr(matmul, f"{name}_split_k"))
            except AttributeError:
                pass
            undo.append(lambda name=name, value=value: setattr(matmul, name, value))
            setattr(matmul, name, False)


@contextmanager
def full_precision() -> Iterator[None]:
    """Float32 math in IEEE float32 and half-precision GEMMs reducing in float32 for the block
    (see the module docstring); every flag put back after, in reverse order. A legacy flag torch
    refuses to read (its legacy and new APIs mixed) is left as it is; the new API's flags, which
    the kernels read, are set either way. The flags are process-wide: a pipeline running in another thread
    meanwhile runs its float32 math at full precision too, which changes nothing it relies on."""
    undo: List[Callable[[], None]] = []
    try:
        for step in (_matmul_ieee, _conv_rnn_ieee, _half_reductions_fp32):
            step(undo)
        yield
    finally:
        for restore in reversed(undo):
            restore()


@contextmanager
def checking(model: nn.Module, inputs: Sequence[Any]) -> Iterator[None]:
    """The build-time checks of ``model`` on ``inputs`` (flat sample leaves): at
    :func:`full_precision`, with :func:`tolerance` following what remains of reduced precision."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers()) + list(inputs)
               if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]
    with full_precision():
        token = _check_eps.set(compute_eps(tensors))
        try:
            yield
        finally:
            _check_eps.reset(token)
