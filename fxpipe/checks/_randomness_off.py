"""torch's dropout and elementwise random draws made constant while the build's training-mode
checks run.

The training-mode check compares the whole batch with its micro-batches merged; a graph that
draws random numbers there is compared for structure only, since the micro-batches draw other
values. Dropout is by far the commonest draw, and a functional one (``F.dropout(h, p,
self.training)``, as transformers' attention writes it; an export graph's ``aten.dropout``)
stays random when the check switches dropout modules off; so do timm's DropPath
(``x.new_empty(B, 1).bernoulli_(keep)``) and noise augmentation (``x + torch.randn_like(x) *
std``). Batch mixing anywhere in such a model went unchecked in training mode (new-user trials:
``h - h.mean(0)`` under ``if self.training``, 0.47 and 0.32 off). Under :func:`randomness_off`
every dropout returns its input and every elementwise draw a constant of its distribution
(``rand`` 0.5, ``randn`` 0, ``bernoulli`` 1, ``uniform_(a, b)`` its middle, ``normal_(m, s)`` m,
``exponential_`` -- F.gumbel_softmax's noise -- its mean, ``torch.normal``, ``poisson`` and the
gamma and Dirichlet draws of ``torch.distributions`` their means), integer draws fixed values
that still reach across the batch (``randperm`` the reversal, ``randint`` its least value,
``multinomial`` the likeliest), and attention's own dropout (``scaled_dot_product_attention(...,
dropout_p=0.1)``, GPT-2's in training) runs with ``dropout_p=0``, drawing nothing. One draw of
a kind left random turned value comparison off for the whole model (a trial: a Gumbel quantizer
or a MoCo shuffle beside a training-only ``h - h.mean(0)``, 1.6e-2 and 2.9e-2 off, silently).
:func:`randomness_off` says whether it replaced anything: where it did not, the checks run
without it (nothing to switch off, and no per-op interception to pay).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["randomness_off", "backward_under_modes"]

_aten = torch.ops.aten
_IDENTITY = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout,
             torch.dropout, torch.feature_dropout, torch.alpha_dropout, torch.feature_alpha_dropout,
             _aten.dropout.default, _aten.feature_dropout.default, _aten.alpha_dropout.default,
             _aten.feature_alpha_dropout.default}
#: draws that make a new tensor: the constant each is made of (name before any overload)
_MADE = {"rand": 0.5, "randn": 0.0, "rand_like": 0.5, "randn_like": 0.0}
#: attention ops with a dropout of their own: the position of ``dropout_p`` in their arguments
_ATTENTION_DROPOUT = {F.scaled_dot_product_attention: 4, _aten.scaled_dot_product_attention.default: 4,
                      _aten._scaled_dot_product_attention_math.default: 4,
                      _aten._scaled_dot_product_flash_attention_for_cpu.default: 3,
                      _aten._scaled_dot_product_flash_attention.default: 3,
                      _aten._scaled_dot_product_efficient_attention.default: 5}
_NOT_FACTORY = ("generator", "pin_memory")


def _arg(args: tuple, kwargs: dict, at: int, key: str, default: Any) -> Any:
    return args[at] if len(args) > at else kwargs.get(key, default)


def _in_place(name: str, args: tuple, kwargs: dict) -> Optional[float]:
    """The constant an in-place draw fills with (its distribution's mean, or its median where
    it has none), or None when ``name`` is none."""
    if name == "bernoulli_":
        return 1.0
    if name == "uniform_":
        low = args[1] if len(args) > 1 else kwargs.get("from", kwargs.get("a", 0.0))
        high = args[2] if len(args) > 2 else kwargs.get("to", kwargs.get("b", 1.0))
        return (float(low) + float(high)) / 2
    if name == "normal_":
        return float(_arg(args, kwargs, 1, "mean", 0.0))
    if name == "exponential_":  # F.gumbel_softmax's noise: -log(1) = 0
        return 1.0 / float(_arg(args, kwargs, 1, "lambd", 1.0))
    if name == "geometric_":
        return 1.0 / float(_arg(args, kwargs, 1, "p", 0.5))
    if name == "log_normal_":
        return math.exp(float(_arg(args, kwargs, 1, "mean", 1.0)))
    if name == "cauchy_":
        return float(_arg(args, kwargs, 1, "median", 0.0))
    if name == "random_":  # random_(to), random_(from, to): its least value
        return float(args[1]) if len(args) > 2 else 0.0
    return None


def _integer_draw(name: str, args: tuple, kwargs: dict) -> Any:
    """``randperm``, ``randint``, ``randint_like``, ``multinomial`` made fixed, or
    :data:`_NOT_RANDOM`. A permutation is the reversal (row 0 with the last: a shuffle or a mixup
    partner reaches across every micro-batch boundary, where the identity would hide it); an
    integer draw its least value, the same for every element (a draw per sample -- a diffusion
    timestep, a SpecAugment start -- must get the same value in the whole batch and in its
    micro-batch: values spread by flat index were refused as a mixing, a review), which as an
    index into the batch still points at a sample other than a micro-batch's own."""
    made = {k: v for k, v in kwargs.items() if k not in _NOT_FACTORY and k not in ("low", "high", "size")}
    if name == "randperm":
        n = int(args[0] if args else kwargs["n"])
        return torch.arange(n - 1, -1, -1, **{"dtype": torch.int64, **made})
    if name in ("randint", "randint_like"):
        rest = args[1:] if name == "randint_like" else args
        sizes = [a for a in rest if isinstance(a, (list, tuple, torch.Size))] or [kwargs.get("size")]
        bounds = [int(a) for a in rest if isinstance(a, int)]
        low, high = (bounds if len(bounds) == 2 else [kwargs.get("low", 0), bounds[0] if bounds else kwargs["high"]])
        if name == "randint_like":
            return torch.full_like(args[0], low, dtype=made.get("dtype", args[0].dtype))
        return torch.full(tuple(sizes[0]), low, dtype=made.get("dtype", torch.int64), device=made.get("device"))
    if name == "multinomial":
        probs = args[0]
        k = int(_arg(args, kwargs, 1, "num_samples", 1))
        if _arg(args, kwargs, 2, "replacement", False) or k > probs.shape[-1]:
            return probs.argmax(-1, keepdim=True).expand(*probs.shape[:-1], k).clone()
        return probs.topk(k, -1).indices
    return _NOT_RANDOM


def _made_from(name: str, args: tuple, kwargs: dict) -> Any:
    """Draws parameterised by tensors, made their mean: ``torch.normal``, ``poisson``,
    ``binomial``, and the gamma and Dirichlet draws of ``torch.distributions`` (Beta, a mixup's
    ``lam``); or :data:`_NOT_RANDOM`."""
    if name == "normal":
        mean = _arg(args, kwargs, 0, "mean", 0.0)
        std = _arg(args, kwargs, 1, "std", 1.0)
        if isinstance(mean, torch.Tensor):
            return (mean + torch.zeros_like(std) if isinstance(std, torch.Tensor) else mean).clone()
        if isinstance(std, torch.Tensor):
            return torch.full_like(std, float(mean))
        size = _arg(args, kwargs, 2, "size", ())
        made = {k: v for k, v in kwargs.items() if k in ("dtype", "device")}
        return torch.full(tuple(size), float(mean), **{"dtype": torch.get_default_dtype(), **made})
    if name in ("poisson", "_standard_gamma"):
        return args[0].clone()
    if name == "binomial":
        return (args[0] * args[1]).round()
    if name == "_sample_dirichlet":
        return args[0] / args[0].sum(-1, keepdim=True)
    return _NOT_RANDOM


class _Constant(TorchFunctionMode):
    """The switch: every random op of the block made constant; ``replaced`` once one was."""

    def __init__(self) -> None:
        super().__init__()
        self.replaced = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        done = _constant(func, args, kwargs)
        if done is _NOT_RANDOM:
            return func(*args, **kwargs)
        self.replaced = True
        return done


def _constant(func: Any, args: tuple, kwargs: dict) -> Any:
    """What ``func`` returns with its randomness constant, or :data:`_NOT_RANDOM` (a module
    function, not a static method: torch.dynamo, tracing a model that compiles a region
    under this mode, failed on the static method's missing ``__func__``)."""
    if func in _IDENTITY:
        return args[0] if args else kwargs["input"]
    if func is _aten.native_dropout.default:
        return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
    at = _ATTENTION_DROPOUT.get(func)
    if at is not None:
        p = args[at] if len(args) > at else kwargs.get("dropout_p", 0.0)
        if not p:
            return _NOT_RANDOM
        if len(args) > at:
            args = (*args[:at], 0.0, *args[at + 1:])
        else:
            kwargs = {**kwargs, "dropout_p": 0.0}
        return func(*args, **kwargs)
    name = getattr(func, "__name__", "").split(".")[0]
    if name in _MADE:
        made = {k: v for k, v in kwargs.items() if k not in _NOT_FACTORY}
        if name.endswith("_like"):
            return torch.full_like(args[0], _MADE[name], **made)
        size = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple, torch.Size)) else args
        return torch.full(tuple(size), _MADE[name], **{"dtype": torch.get_default_dtype(), **made})
    if name == "bernoulli":  # bernoulli(probabilities) or bernoulli(input, p): every draw a 1
        return torch.ones_like(args[0])
    if func is F.gumbel_softmax:  # a torch function of its own: the mode is off for its inner draws
        return _gumbel_softmax(*args, **kwargs)
    if func in (F.rrelu, torch.rrelu):  # its training-mode slope drawn: the mean slope, as in eval
        return func(*args[:3], **{**{k: v for k, v in kwargs.items() if k != "inplace"}, "training": False})
    for fixed in (_integer_draw, _made_from):
        done = fixed(name, args, kwargs)
        if done is not _NOT_RANDOM:
            return done
    fill = _in_place(name, args, kwargs)
    if fill is not None:
        with torch.no_grad():
            return args[0].fill_(fill)
    return _NOT_RANDOM


_NOT_RANDOM: Any = object()


def _gumbel_softmax(logits: torch.Tensor, tau: float = 1.0, hard: bool = False, eps: float = 1e-10,
                    dim: int = -1) -> torch.Tensor:
    """``F.gumbel_softmax`` with its Gumbel noise at 0 (``-log`` of an exponential draw of 1)."""
    soft = (logits / tau).softmax(dim)
    if not hard:
        return soft
    index = soft.argmax(dim, keepdim=True)
    return torch.zeros_like(logits).scatter_(dim, index, 1.0) - soft.detach() + soft


@contextmanager
def randomness_off() -> Iterator[_Constant]:
    """While the block runs (this thread), torch's dropout returns its input and its elementwise
    draws a constant (see the module). Yields the switch: its ``replaced`` says afterwards
    whether anything was made constant."""
    with _Constant() as mode:
        yield mode


def backward_under_modes(value: torch.Tensor) -> None:
    """``value.backward(retain_graph=True)`` with the torch function modes active here (this
    module's switch) active in the backward too: a region the model checkpoints
    (``torch.utils.checkpoint``, transformers' ``gradient_checkpointing_enable``) is recomputed
    there, and must compute as its forward did. ``Tensor.backward`` would hand the call to the
    switch, which torch runs with the switch popped: the recomputed dropout drew, and
    torch.utils.checkpoint refused the recomputed tensors (a bare CheckpointError from the build,
    a trial). The engine's own entry is called instead; where torch has none, ``backward()``."""
    engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if engine is None:
        value.backward(retain_graph=True)
        return
    engine((value,), (torch.ones_like(value),), True, False, (), allow_unreachable=True, accumulate_grad=True)
