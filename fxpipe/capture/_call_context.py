"""What a captured graph fixed of the context it was called in: autocast, grad mode, the inputs' flags.

A forward can ask how it is being called: ``torch.is_autocast_enabled()``,
``torch.is_grad_enabled()``, ``if x.requires_grad:`` (an input-gradient penalty),
``if h.dtype == torch.float16: h = h.clamp(...)`` (T5's feed-forward), ``mask.to(h.dtype)``.
The capture runs that Python once, in the build's context, and the graph keeps the answers as
constants. A pipeline built in float32 and called under ``torch.autocast`` -- or with an input
that requires grad where the sample's did not -- then computes the build's branch where eager
takes the other: loss 0.127 against eager's 0.045, silently (a new-user trial).

What is read, and where, is recorded while the model is captured (:class:`ContextReads`):

* torch.fx: only the context functions can be read for real (a tensor's ``dtype`` or
  ``requires_grad`` is a proxy, and a branch on it is a trace error). The innermost module
  reading one is kept opaque -- it runs its own forward each call, in the caller's context, as
  eager -- and in the root forward the capture falls back to torch.export.
* torch.export: the context functions and, in the model's own code, every tensor's ``dtype``
  and ``requires_grad`` (its fake tensors answer with the build's values). When any was read,
  the capture keeps a :class:`ContextCheck`.

At each call, :meth:`ContextCheck.check` compares the call's :class:`CallContext` with the
build's: the same context (the common case: a comparison of a few values) runs. A new one is
checked once, without running the graph: the model's forward is run twice on fake tensors (no
memory, no compute), in the build's context and in the call's, recording what its code reads;
if the two runs read the same values in the same places, the graph the build captured is the
one eager would run, and the context is remembered (:data:`LIMIT` of them). Otherwise
:class:`~fxpipe.errors.ModelChangedError` names the first line that reads another value and
says to build the pipeline in the context it is called in; so does a model whose fake run
fails (a data-dependent op), where nothing could be checked.

The same recording notes where the model's code registers a tensor hook: a torch.export graph
drops it (:class:`TensorHookError`).

Why fake runs rather than a refusal of every new context: most transformers models read
dtypes (a mask made in the embeddings' dtype) that autocast leaves as they were, and they are
exact under autocast when built without; a read that changes is what makes the graph wrong,
and the fake runs see exactly that.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import ModelChangedError, TraceError
from ..runtime._autocast import AutocastState, autocast_state
from ..runtime._autocast import entered as entered_autocast
from ..runtime._randomness import generator_states, set_generator_states
from ._shared_patch import SharedPatch
from ._user_code import cached_is_user_file

__all__ = ["CallContext", "ContextRead", "ContextReads", "ContextCheck", "ReadsCallContext", "TensorHookError", "LIMIT"]

#: contexts remembered as checked, per capture (each a handful of values)
LIMIT = 16

_FUNCTIONS = tuple(name for name in (
    "is_autocast_enabled", "get_autocast_dtype", "is_autocast_cpu_enabled", "get_autocast_cpu_dtype",
    "get_autocast_gpu_dtype", "is_grad_enabled", "is_inference_mode_enabled") if hasattr(torch, name))
_GETTERS = ("dtype", "requires_grad")


class ContextRead(NamedTuple):
    """One read of the call's context by the model's code: ``what`` was read, ``where`` (the
    model's source line, '' when unknown), in which ``module`` (fx only) and its ``value``."""

    what: str
    where: str
    module: str
    value: str

    def said(self) -> str:
        return f"{self.what} read at {self.where}" if self.where else f"{self.what} read by the model's code"


class ReadsCallContext(TraceError):
    """A traced forward asked torch for the call's context (autocast, grad mode) while torch.fx
    traced it: the answer would be baked into the graph. The module is kept opaque (it asks
    again each call); the root forward goes to torch.export, whose graph is checked per call."""

    def __init__(self, read: ContextRead) -> None:
        where = f"module '{read.module}'" if read.module else "the root forward"
        at = f" at {read.where}" if read.where else ""
        super().__init__(f"{where} reads {read.what}{at} while torch.fx traces it: the graph would keep the build's "
                         "answer", module=read.module, reason="the call's context read at trace time")


class TensorHookError(TraceError):
    """The model's code registers a tensor hook (``h.register_hook(fn)``) in code torch.fx could
    not trace -- torch.fx takes no function as an argument, so the module registering one is
    kept opaque, where it runs its own forward, hook included, per micro-batch; in the root
    forward the capture falls back to torch.export, which records aten operations only and
    drops the hook: the gradients would silently miss it (a trial: half of eager's, for
    ``g * 2``). Refused."""

    def __init__(self, where: str) -> None:
        super().__init__(
            f"the model's root forward registers a tensor hook at {where}: torch.fx cannot trace that call, and "
            "torch.export (the fallback) drops tensor hooks from its graph, so the gradients would silently miss it. "
            "What to do: move the code registering the hook into a submodule; fxpipe keeps that module opaque (it "
            "runs its own forward, hook included, once per micro-batch)", reason="a tensor hook under torch.export")


@dataclass(frozen=True)
class CallContext:
    """What a capture's answers depend on: the autocast state, grad mode, and per flat input
    its ``(dtype, requires_grad)`` (None for a non-tensor)."""

    autocast: AutocastState
    grad: bool
    inputs: Tuple[Optional[Tuple[torch.dtype, bool]], ...]

    @classmethod
    def of(cls, flat: List[Any]) -> "CallContext":
        return cls(autocast_state(), torch.is_grad_enabled(),
                   tuple((x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else None for x in flat))

    def differences(self, other: "CallContext", names: List[str]) -> List[str]:
        """How ``self`` (a call's) differs from ``other`` (the build's), said plainly."""
        said = []
        if self.autocast != other.autocast:
            said.append(f"autocast {_autocast_said(self.autocast)} (the build: {_autocast_said(other.autocast)})")
        if self.grad != other.grad:
            said.append(f"grad mode {'on' if self.grad else 'off'} (the build: {'on' if other.grad else 'off'})")
        for name, now, then in zip(names, self.inputs, other.inputs):
            if now is not None and then is not None and now != then:
                parts = ([f"dtype {now[0]} (the sample's {then[0]})"] if now[0] != then[0] else []) + (
                    [f"requires_grad={now[1]} (the sample's {then[1]})"] if now[1] != then[1] else [])
                said.append(f"{name}: {', '.join(parts)}")
        return said


def _autocast_said(state: AutocastState) -> str:
    on = [f"{device} {str(dtype).replace('torch.', '')}" for device, enabled, dtype in state[0] if enabled]
    return f"on ({', '.join(on)})" if on else "off"


def _user_line() -> str:
    """The innermost frame of the model's own code calling now, as 'file, line N' ('' if none).
    Asked on every dtype read of an export: the file test is the cached one."""
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    return f"{name}, line {frame.f_lineno}" if cached_is_user_file(name) else ""


# -- recording -------------------------------------------------------------------------------
def _replacements() -> List[Tuple[Any, str, Any]]:
    return ([(torch, name, _function(name, getattr(torch, name))) for name in _FUNCTIONS]
            + [(torch.Tensor, name, _getter(name, torch._C.TensorBase.__dict__[name])) for name in _GETTERS]
            + [(torch.Tensor, "register_hook", _hook_registration(torch.Tensor.register_hook))])


_PATCH: "SharedPatch[ContextReads]" = SharedPatch(_replacements)


def _function(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def asked(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        if _PATCH.sessions:
            where = _user_line()
            if where:
                for session in _PATCH.sessions:
                    session._saw(f"torch.{name}()", where, value)
        return value
    asked.__wrapped__ = original  # type: ignore[attr-defined]
    return asked


def _getter(name: str, descriptor: Any) -> property:
    def set_(t: Any, value: Any) -> None:  # requires_grad is settable; dtype refuses as torch does
        descriptor.__set__(t, value)

    def get(t: Any) -> Any:
        value = descriptor.__get__(t)
        if _PATCH.sessions:
            where = _user_line()
            if where:
                for session in _PATCH.sessions:
                    if session.getters:
                        session._saw(f"a tensor's .{name}", where, value)
        return value
    return property(get, set_)


def _hook_registration(original: Callable[..., Any]) -> Callable[..., Any]:
    def registered(t: Any, hook: Any) -> Any:
        if _PATCH.sessions:
            where = _user_line()
            if where:
                for session in _PATCH.sessions:
                    session._hooked(where)
        return original(t, hook)
    return registered


class ContextReads:
    """While active (one capture or fake run, in this thread), records each read of the call's
    context by the model's own code, first first. ``getters``: tensors' ``dtype`` and
    ``requires_grad`` too (fake tensors only: torch.fx gives the model proxies); ``module``:
    the module being traced now (fx); ``skip()``: whether the code running now is a module
    kept opaque (it runs its own forward at call time: nothing of it is baked). Also records
    where the model's code registers a tensor hook (``hooks``): a torch.export graph drops
    it. torch's functions and ``torch.Tensor``'s attributes are wrapped while any recording
    runs (their results unchanged) and put back after the last."""

    def __init__(self, *, getters: bool, module: Callable[[], str] = lambda: "",
                 skip: Callable[[], bool] = lambda: False) -> None:
        self.getters = getters
        self.module = module
        self.skip = skip
        self.reads: List[ContextRead] = []
        self.hooks: List[str] = []
        self._thread = 0

    def _saw(self, what: str, where: str, value: Any) -> None:
        if threading.get_ident() == self._thread and not self.skip():
            self.reads.append(ContextRead(what, where, self.module(), str(value)))

    def _hooked(self, where: str) -> None:
        if threading.get_ident() == self._thread and not self.skip():
            self.hooks.append(where)

    def __enter__(self) -> "ContextReads":
        self._thread = threading.get_ident()
        _PATCH.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _PATCH.exit(self)


# -- the check per call ----------------------------------------------------------------------
@dataclass
class ContextCheck:
    """A torch.export capture's reads of its context (``reads``, the first few), the context
    it was captured in (``built``), and the contexts checked to read the same since."""

    reads: List[ContextRead]
    built: CallContext
    in_spec: pytree.TreeSpec
    checked: Dict[CallContext, None] = field(default_factory=dict)
    refused: Dict[CallContext, str] = field(default_factory=dict)

    def check(self, model: nn.Module, flat: List[Any], names: Callable[[], List[str]], device: torch.device) -> None:
        """Returns when this call's context reads as the build's did (see the module), else
        raises :class:`~fxpipe.errors.ModelChangedError` naming the read that differs."""
        now = CallContext.of(flat)
        if now == self.built or now in self.checked:
            return
        why = self.refused.get(now)
        if why is None:
            why = self._compare(model, flat, now, device)
            if not why:
                self.checked[now] = None
                while len(self.checked) > LIMIT:
                    del self.checked[next(iter(self.checked))]
                return
            self.refused[now] = why
        raise ModelChangedError(
            f"this call's context differs from the build's -- {'; '.join(now.differences(self.built, names()))} -- and "
            f"the model's code reads it, which the graph fixed at the build: {why}. Eager would compute otherwise. "
            "Build the pipeline in the context it is called in (under the same torch.autocast or grad mode, from a "
            "sample with the call's dtypes and requires_grad; pipelines of one model share its parameters), or "
            "keep the module that reads it opaque (leaf_modules=[...]): it then runs its own forward each call")

    def _compare(self, model: nn.Module, flat: List[Any], now: CallContext, device: torch.device) -> str:
        then = fake_reads(model, flat, self.in_spec, self.built, device)
        later = fake_reads(model, flat, self.in_spec, now, device)
        if isinstance(then, str) or isinstance(later, str):
            first = self.reads[0].said()
            return (f"it reads {first}, and running it on fake tensors to compare what it reads failed "
                    f"({then if isinstance(then, str) else later})")
        for a, b in zip(then, later):
            if a != b:
                return f"{a.what} read at {a.where or 'an unknown line'} is {b.value} here, {a.value} at the build"
        if len(then) != len(later):
            extra = (then if len(then) > len(later) else later)[min(len(then), len(later))]
            return f"{extra.what} at {extra.where or 'an unknown line'} is read in one context and not the other"
        return ""


def fake_reads(model: nn.Module, flat: List[Any], in_spec: pytree.TreeSpec, context: CallContext,
               device: torch.device) -> List[ContextRead] | str:
    """What ``model``'s code reads of its context when called with ``flat`` (as their sizes,
    the dtypes and requires_grad of ``context``) in ``context``, run through
    ``torch.func.functional_call`` on fake tensors made on ``device`` (the first stage's: a
    model whose weights sit on several devices, or on meta on a rank, runs whole there); the
    model's own tensors untouched, the generators put back. The error said, when it fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def fake(t: torch.Tensor, dtype: torch.dtype, requires_grad: bool) -> torch.Tensor:
        made = torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=device)
        return made.requires_grad_(requires_grad) if made.is_floating_point() or made.is_complex() else made

    rng = generator_states()
    try:
        with FakeTensorMode():
            fakes: Dict[int, torch.Tensor] = {}
            state = {}
            for name, t in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
                if id(t) not in fakes:
                    fakes[id(t)] = fake(t, t.dtype, t.requires_grad)
                state[name] = fakes[id(t)]
            inputs = [fake(x, *want) if isinstance(x, torch.Tensor) and want is not None else x
                      for x, want in zip(flat, context.inputs)]
            args, kwargs = pytree.tree_unflatten(inputs, in_spec)
            with ContextReads(getters=True) as reads, entered_autocast(context.autocast), \
                    torch.set_grad_enabled(context.grad):
                torch.func.functional_call(model, state, tuple(args), dict(kwargs), strict=False)
        return reads.reads
    except Exception as e:  # noqa: BLE001 - whatever stops the fake run, it checked nothing
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        set_generator_states(rng)
