"""What a traced forward computes while it is traced, which a graph would bake in as constants.

torch.fx runs the model's Python once, on proxies; whatever does not touch a proxy runs for
real, then, and its result is a constant of the graph. Three such things were silently frozen
at the build's value where eager recomputes them each call (new-user trials):

* **random numbers** drawn without a tensor argument (:class:`DrewAtTrace`): ``torch.rand([])
  < p`` of a LayerDrop, ``torch.randint(0, 3, ())`` of a time mask; and draws from Python's
  ``random`` or numpy (:class:`DrewFromPython`, refused wherever they are: fxpipe replays only
  torch's generators in recomputation);
* **Python state the forward sets** (:class:`KeepsState`): ``self.calls += 1``, a step counter
  (refused wherever it is set);
* **a model's tensor read as a number** (:class:`ReadsAsNumber`): ``float(self.step)`` of a
  warm-up buffer, ``self.temp.item()``, ``self.state[0].item()`` (a view of one): the buffer, updated in place or by ``load_state_dict``
  afterwards, kept its build-time value in the graph.

Each is found while tracing (the default generators' states around every module call; the
attribute recording's writes; ``Tensor.item`` and the number conversions watched for the
model's own tensors, :func:`baked_at_trace`) and raised as a ``TraceError``. For a draw or a
number read, the innermost module doing it is kept opaque: it runs its own forward each call,
as eager; in the root forward, which cannot be, the capture falls back to torch.export (which
records random calls and ``.item()`` as ops) or is refused naming the line. State set by the
forward is refused wherever it is set.
"""

from __future__ import annotations

import random
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.overrides import TorchFunctionMode

from ..errors import TraceError
from ._attr_reads import AttributeReads
from ._call_context import ContextReads, ReadsCallContext
from ._shared_patch import SharedPatch
from ..runtime._randomness import generator_states, set_generator_states

__all__ = ["DrewAtTrace", "DrewFromPython", "KeepsState", "ReadsAsNumber", "ComputedAtTrace", "TensorsReadAsNumbers",
           "TensorsComputedOn", "drew_since",
           "python_states", "python_drew_since", "baked_at_trace"]


class DrewAtTrace(TraceError):
    """A forward drew random numbers from torch while torch.fx traced it: a call without a
    tensor argument (``torch.rand([]) < p`` of a LayerDrop, ``torch.randint(0, 3, ())`` of a
    time mask) runs at trace time, and its value, or the branch it decided, would be baked
    into the graph: every call would then repeat that one draw where eager draws anew. The
    module that drew is kept opaque (it runs eagerly, drawing per call); the root forward,
    which cannot be, is captured by torch.export instead, which records such calls as ops."""

    def __init__(self, module: str) -> None:
        where = f"module '{module}'" if module else "the root forward"
        super().__init__(f"{where} drew random numbers while torch.fx traced it (a torch.rand / randint / randn "
                         "call without a tensor argument): torch.fx would bake that one draw into the graph",
                         module=module, reason="random numbers drawn at trace time")


class KeepsState(TraceError):
    """A forward set a number attribute of its module (``self.calls += 1``, a step counter
    for a warm-up), stored a value it computed (``self.aux_loss = ...`` of a mixture of
    experts, a list of features for deep supervision) or changed a plain container
    (``self.stats['calls'] += 1``): Python state, which a traced graph neither updates nor
    reads again. Any value computed from it is baked into the graph at the build's value, and
    the attribute stops changing (or holds a value of the trace): the pipeline would silently
    compute the model as it was at the build.
    Refused, wherever it is: a module kept opaque would count once per micro-batch, and the
    build's check takes a count that differs between runs for randomness, comparing structure
    only. A buffer updated in place is the pipeline's documented per-micro-batch state."""

    def __init__(self, label: str) -> None:
        owner = label.rpartition(".")[0]
        super().__init__(
            f"the traced forward sets '{label}' while it runs (Python state: a call or step counter, an auxiliary "
            "loss or features stored on the module): a graph neither updates it nor reads it again, so the pipeline "
            "would leave it at the build's value. What to do: return a computed value (an auxiliary loss, features) "
            "as an output of forward; keep a counter in a buffer (register_buffer, updated in place: "
            "self.calls.add_(1); a pipeline updates it once per micro-batch, as GPipe does), or update it "
            "outside the forward (in the training loop)", module=owner, reason="Python state set by the forward")


class DrewFromPython(TraceError):
    """A forward drew from Python's ``random`` or numpy's global generator while it was captured
    (timm-style stochastic depth written ``random.random() < p``): the draw would be baked into
    the graph (torch.fx and torch.export alike run that Python once), and kept opaque the module
    would draw anew when a checkpointed stage is recomputed, where fxpipe replays torch's
    generators only. Refused, naming the module, with the advice to draw with torch."""

    def __init__(self, module: str) -> None:
        where = f"module '{module}'" if module else "the model's forward"
        super().__init__(
            f"{where} draws from Python's random or numpy's global generator: a captured graph would keep the "
            "build's one draw, and fxpipe replays only torch's generators when it recomputes a checkpointed stage. "
            "What to do: draw with torch (torch.rand(()) < p, or x.new_empty(...).bernoulli_(p)), which fxpipe "
            "follows per call and replays exactly", module=module, reason="random numbers drawn from Python or numpy")


def python_states() -> Tuple[Any, Any]:
    """Python's ``random`` state and numpy's global one (None where numpy is not imported)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), numpy.random.get_state() if numpy is not None else None


def python_drew_since(states: Tuple[Any, Any]) -> bool:
    """Whether Python's or numpy's generator moved since ``states``; puts them back."""
    python, legacy = states
    moved = random.getstate() != python
    if moved:
        random.setstate(python)
    numpy = sys.modules.get("numpy")
    if legacy is not None and numpy is not None:
        now = numpy.random.get_state()
        if now[2] != legacy[2] or not numpy.array_equal(now[1], legacy[1]):
            numpy.random.set_state(legacy)
            moved = True
    return moved


def drew_since(states: list[torch.Tensor]) -> bool:
    """Whether torch's default generators moved since ``states`` were taken; puts them back, so
    that tracing leaves the RNG as it found it."""
    now = generator_states()
    moved = len(now) != len(states) or any(not torch.equal(a, b) for a, b in zip(now, states))
    if moved:
        set_generator_states(states)
    return moved


class ReadsAsNumber(TraceError):
    """A forward read one of the model's tensors as a Python number (see the module)."""

    def __init__(self, module: str, tensor: str) -> None:
        where = f"module '{module}'" if module else "the root forward"
        super().__init__(f"{where} reads '{tensor}' as a Python number (.item(), float(), int(), bool()) while torch.fx "
                         "traces it: the graph would hold its value at the build, and an update in place or a "
                         "load_state_dict afterwards would be silently ignored", module=module,
                         reason="a model tensor read as a number at trace time")


class ComputedAtTrace(ReadsAsNumber):
    """A forward computed with one of the model's tensors and no traced value while torch.fx
    traced it (``(self.var + eps).sqrt()`` of a normaliser, ``self.mask > 0`` of a pruning
    mask, ``self.scales[0].exp()`` of a parameter kept in a Python list): torch.fx ran it once
    and stored the result as a constant of the graph, blind to ``load_state_dict``, updates in
    place and training (a trial: 0.46 off after loading a normaliser's statistics; a parameter
    so reached failed the second backward). The module doing it is kept opaque; the root forward
    goes to torch.export, which records the ops."""

    def __init__(self, module: str, tensor: str, reached: bool = False) -> None:
        where = f"module '{module}'" if module else "the root forward"
        if reached:  # torch.export's variant, refused: no capture keeps it live
            TraceError.__init__(
                self, f"the model reaches '{tensor}' other than as a module attribute (a Python list or dict holding "
                "it, in code torch.fx could not trace), and torch.export keeps it as a constant: without its gradient, "
                f"blind to later values. What to do: reach it as a module attribute (self.{tensor.rpartition('.')[2]}; "
                "an nn.ParameterList for several), or move that code into a submodule, which fxpipe then keeps opaque",
                module=module, reason="a model tensor reached through a Python container")
            return
        TraceError.__init__(self, f"{where} computes with '{tensor}' alone (no input involved) while torch.fx traces it: "
                            "the graph would keep the result as a constant, blind to later updates of the tensor",
                            module=module, reason="a model tensor computed on at trace time")


#: Tensor methods that read a tensor's metadata, not its values: free at trace time
_METADATA = frozenset({"__get__", "size", "dim", "numel", "stride", "is_floating_point", "is_complex", "element_size",
                       "__len__", "__format__", "__repr__", "type", "data_ptr", "is_contiguous", "storage_offset",
                       "nelement", "ndimension", "get_device", "is_signed", "__hash__", "__eq__", "__ne__"})


def _tensor_names(model: nn.Module, attributes: bool = False) -> Dict[int, str]:
    """id -> name of ``model``'s parameters and buffers; with ``attributes``, also of the tensors
    its modules keep as attributes or one level inside a list, tuple or dict attribute."""
    names: Dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), name)
    if not attributes:
        return names
    for prefix, m in model.named_modules():
        for key, value in vars(m).items():
            if key.startswith("_"):
                continue
            label = f"{prefix}.{key}" if prefix else key
            if isinstance(value, torch.Tensor):
                names.setdefault(id(value), label)
            elif isinstance(value, (list, tuple, dict)):  # self.temps[0].sqrt(): one level in
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for k, v in items:
                    if isinstance(v, torch.Tensor):
                        names.setdefault(id(v), f"{label}[{k!r}]")
    return names


def _name_of(names: Dict[int, str], t: Any) -> Optional[str]:
    """The name of ``t`` in ``names``, or of the tensor it is a view of (``self.state[0]``)."""
    name = names.get(id(t))
    base = getattr(t, "_base", None)
    return names.get(id(base)) if name is None and base is not None else name


class TensorsComputedOn(TorchFunctionMode):
    """While active (one fx trace), notes the first torch op that takes one of ``model``'s
    parameters, buffers or tensor attributes and no traced value (:class:`ComputedAtTrace`),
    with the innermost module being traced then. In-place updates are left to the buffer-write
    measurement (:mod:`fxpipe.capture._prepare`), metadata reads are free."""

    def __init__(self, model: nn.Module, where: Callable[[], str]) -> None:
        super().__init__()
        self.names = _tensor_names(model, attributes=True)
        self.where = where
        self.found: List[tuple] = []

    def _watched(self, value: Any) -> Optional[str]:
        return _name_of(self.names, value) if isinstance(value, torch.Tensor) else None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not self.found:
            name = getattr(func, "__name__", "")
            if (name not in _METADATA or _compares_values(name, args)) \
                    and not (name.endswith("_") and not name.endswith("__")) and not name.startswith("__i"):
                values = [*args, *kwargs.values()]
                values += [v for a in values if isinstance(a, (list, tuple)) for v in a]
                if not any(isinstance(v, fx.Proxy) for v in values):
                    watched = next((w for w in map(self._watched, values) if w is not None), None)
                    if watched is not None:
                        self.found.append((self.where(), watched))
        return func(*args, **kwargs)


def _compares_values(name: str, args: tuple) -> bool:
    """``==`` / ``!=`` of a tensor with a number or a tensor: a computation on its values
    (``self.calibrated == 0``, baked at trace as a constant: 0.50 off once the loop set the flag,
    a trial), not the identity test a container's lookup makes (``tensor == None``)."""
    return name in ("__eq__", "__ne__") and len(args) == 2 and isinstance(args[1], (torch.Tensor, int, float, bool))


_CONVERSIONS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")


def _watching(original: Any) -> Any:
    def converted(t: Any, *args: Any, **kwargs: Any) -> Any:
        for session in _PATCH.sessions:
            session._saw(t)
        return original(t, *args, **kwargs)
    return converted


_PATCH: "SharedPatch[TensorsReadAsNumbers]" = SharedPatch(
    lambda: [(torch.Tensor, method, _watching(getattr(torch.Tensor, method))) for method in _CONVERSIONS])


class TensorsReadAsNumbers:
    """While active (one trace), notes each of ``model``'s parameters and buffers read as a
    number, with the innermost module being traced then (``where()``): ``(module, tensor
    name)``, first read first. ``torch.Tensor``'s conversion methods are wrapped while any
    trace watches (their behaviour unchanged) and put back when the last one ends."""

    def __init__(self, model: nn.Module, where: Callable[[], str]) -> None:
        self.names = _tensor_names(model)
        self.where = where
        self.found: List[tuple] = []
        self._thread = 0

    def _saw(self, t: Any) -> None:
        name = _name_of(self.names, t)
        if name is not None and threading.get_ident() == self._thread:
            self.found.append((self.where(), name))

    def __enter__(self) -> "TensorsReadAsNumbers":
        self._thread = threading.get_ident()
        _PATCH.enter(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _PATCH.exit(self)


def baked_at_trace(before: List[torch.Tensor], numbers: TensorsReadAsNumbers, computed: TensorsComputedOn,
                   reads: AttributeReads, context: ContextReads,
                   opaque: Callable[[str], bool]) -> Optional[Tuple[TraceError, str]]:
    """What a finished fx trace baked that it must not, as ``(error, module to keep opaque)``
    (``''``: none can be, the root's or refused), else None. ``before``: the generators'
    states when the trace began (a draw in a module call was raised by the tracer already);
    ``opaque(module)``: whether that module is kept opaque already, so that its read came from
    code outside it."""
    if drew_since(before):  # in the root's own forward, which cannot be kept opaque
        return DrewAtTrace(""), ""
    if numbers.found:  # the module reading it is kept opaque: it reads the live value each call
        module, tensor = numbers.found[0]
        if module and not opaque(module):
            return ReadsAsNumber(module, tensor), module
        return ReadsAsNumber("", tensor), ""
    if computed.found:  # the same: the module computing on it runs its own forward each call
        module, tensor = computed.found[0]
        if module and not opaque(module):
            return ComputedAtTrace(module, tensor), module
        return ComputedAtTrace("", tensor), ""
    if context.reads:  # the reading module asks again each call; the root goes to torch.export
        read = context.reads[0]
        if read.module and not opaque(read.module):
            return ReadsCallContext(read), read.module
        return ReadsCallContext(read._replace(module="")), ""
    state = reads.written_numbers()
    if state:  # refused, not kept opaque: run per micro-batch it would count per micro-batch
        return KeepsState(state[0]), ""
    return None

