"""From a model and its sample to the graph that gets planned, leaving the model as it was.

Every front end that plans (``fxpipe.pipeline``, the CLI) comes through :func:`prepare`, so
the plan a user prints is the plan that runs. It

* captures the model (:func:`fxpipe.capture._tracing.capture`);
* catches buffers that torch.fx updated *at trace time*. fx runs ``self.count += 1`` or
  ``self.avg.mul_(0.9)`` on the real buffer while tracing and leaves it out of the graph,
  so the pipeline would never apply it. The module whose forward does that is kept opaque
  (it then runs eagerly, once per micro-batch) and the capture is repeated; an update in
  the root forward, which cannot be opaque, is refused naming the buffer and the line;
* rewrites in-place ops on activations out of place and finds the buffers the forward
  updates (:mod:`fxpipe.capture._mutation`);
* opens containers the graph returns whole into output leaves (:mod:`fxpipe.capture._open_outputs`).

:func:`preserved` wraps a whole build: tracing twice, profiling and the checks all run the
model, and none of that may show in the user's buffers, parameters, RNG or modes.
"""

from __future__ import annotations

import inspect
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ._attr_reads import REGISTRIES
from ._mode_flags import modes_kept
from ._tracing import Capture, capture
from ._values import same_value
from ..errors import MutationError, TraceError
from ._mutation import Mutations, find_and_fix_mutations
from ._export_outputs import is_cache
from ._open_outputs import open_output_containers
from ..progress import Progress
from ..runtime._randomness import generator_states, set_generator_states
from ._trace_time import python_drew_since, python_states
from ..tree import flatten, leaf_names
from ._user_code import is_user_file

__all__ = ["Prepared", "prepare", "preserved", "mode_sensitivity", "check_capture"]


@contextmanager
def written_kept(model: nn.Module, names: Sequence[str]) -> Generator[None, None, None]:
    """Runs the block, then puts back the values of the trainable parameters among ``names``
    (the state the capture found the forward writing in place: a weight constraint,
    ``with torch.no_grad(): self.weight.clamp_(min=0)``), which :func:`preserved` does not copy
    for every model: the build's checks ran the forward and left the user's weights clamped.
    Through ``.data``, as :func:`preserved` writes back."""
    params = dict(model.named_parameters())
    kept = _copies(params[n] for n in names if n in params and params[n].requires_grad)
    try:
        yield
    finally:
        _put_back(kept)


def _copies(tensors: Iterable[torch.Tensor]) -> List[Tuple[torch.Tensor, int, torch.Tensor]]:
    """Each tensor, its version and a copy of its values, for :func:`_put_back`."""
    return [(t, t._version, t.detach().clone()) for t in tensors]


def _put_back(kept: Sequence[Tuple[torch.Tensor, int, torch.Tensor]]) -> None:
    """The values of :func:`_copies` written back into each tensor an in-place op changed since,
    through ``.data`` (its version counter as it is)."""
    with torch.no_grad():
        for t, version, copy in kept:
            if t._version != version:
                t.data.copy_(copy)


@contextmanager
def preserved(model: nn.Module) -> Generator[None, None, None]:
    """Runs the block, then puts back the model's buffers (objects and values), the values of
    frozen parameters and of those a forward renormalises in place (``nn.Embedding(max_norm=)``:
    the build's runs changed 25 rows of a trial's by up to 3.4), every parameter's ``.grad``,
    every submodule's training flag and plain Python attributes (numbers, strings, None: a
    forward counting its calls), the submodules, parameters and buffers each module registers (a
    forward creating one at its first call: the build's runs are not that call), and the RNG
    states. Values are written back through ``.data``,
    which leaves the tensors' version counters alone: a graph the user recorded before the
    build still backpropagates."""
    buffers = [(m, name, b, b._version, b.detach().clone())
               for m in model.modules() for name, b in m._buffers.items() if b is not None]
    renormed = {id(m.weight) for m in model.modules()
                if getattr(m, "max_norm", None) is not None and isinstance(getattr(m, "weight", None), torch.Tensor)}
    frozen = _copies(p for p in model.parameters() if not p.requires_grad or id(p) in renormed)
    grads = [(p, p.grad) for p in model.parameters()]
    modes = [(m, m.training) for m in model.modules()]
    scalars = [(m, {k: v for k, v in vars(m).items() if v is None or type(v) in _PLAIN})
               for m in model.modules()]
    # lists and dicts a forward fills or counts in (refused, but the build's runs must not show)
    containers = [(v, list(v) if type(v) is list else dict(v)) for m in model.modules() for v in vars(m).values()
                  if type(v) in (list, dict)]
    # what each module registers: a forward creating a submodule or buffer on its first call (in
    # one mode) registers it during the build's runs; the model keeps the ones it had
    registries = [(m, {k: dict(m.__dict__[k]) for k in REGISTRIES}) for m in model.modules()]
    rng, python = generator_states(), python_states()
    try:
        yield
    finally:
        python_drew_since(python)  # Python's and numpy's generators put back
        for m, held in registries:
            for key, entries in held.items():
                now = m.__dict__[key]
                if now.keys() != entries.keys():
                    for name in [n for n in now if n not in entries]:
                        del now[name]
                    now.update({n: v for n, v in entries.items() if n not in now})
        with torch.no_grad():
            for m, name, b, version, copy in buffers:
                m._buffers[name] = b
                # BatchNorm's kernel updates running_mean/var without bumping _version: values too
                if b._version != version or (not b.is_meta and not torch.equal(b, copy)):
                    b.data.copy_(copy)
        _put_back(frozen)
        for p, grad in grads:
            p.grad = grad
        for m, training in modes:
            m.training = training
        for m, attrs in scalars:
            for key, value in attrs.items():
                if key not in m.__dict__ or m.__dict__[key] is not value:  # also one a module was set to
                    m.__dict__[key] = value
        for container, content in containers:
            if len(container) != len(content) or (any(a is not b for a, b in zip(container, content)) if
                                                  type(container) is list else container.keys() != content.keys()
                                                  or any(container[k] is not v for k, v in content.items())):
                container.clear()
                (container.extend if type(container) is list else container.update)(content)
        set_generator_states(rng)


_PLAIN = (int, float, bool, str, complex)


def _versions(model: nn.Module) -> Dict[str, Tuple[int, int]]:
    return {name: (id(b), b._version) for name, b in model.named_buffers(remove_duplicate=False)}


_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}


class _BufferWriters(TorchFunctionMode):
    """Records, for in-place torch calls on the given buffers, the user frame making them."""

    def __init__(self, buffers: Dict[int, str]) -> None:
        super().__init__()
        self.buffers = buffers
        self.found: Dict[str, Tuple[str, Optional[nn.Module]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and (
                name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))):
            key = self.buffers.get(id(args[0]))
            if key is not None and key not in self.found:
                self.found[key] = _user_frame()
        return func(*args, **(kwargs or {}))


def _user_frame() -> Tuple[str, Optional[nn.Module]]:
    """'file:line: code' of the innermost user frame (:mod:`fxpipe.capture._user_code`), and its ``self``."""
    frame = inspect.currentframe()
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            filename = os.path.abspath(frame.f_code.co_filename)
            info = inspect.getframeinfo(frame)
            line = (info.code_context or [""])[0].strip()
            code = frame.f_code
            owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            return f"{filename}:{info.lineno}: {line}", owner if isinstance(owner, nn.Module) else None
        frame = frame.f_back
    return "unknown", None


def _trace_time_writers(model: nn.Module, changed: List[str], args: tuple,
                        kwargs: dict) -> Dict[str, Tuple[str, Optional[nn.Module]]]:
    """Where each changed buffer is updated: one eager forward under a watcher (state restored)."""
    buffers = {id(b): name for name, b in model.named_buffers(remove_duplicate=False) if name in changed}
    watcher = _BufferWriters(buffers)
    with preserved(model), torch.no_grad(), watcher:
        try:
            model(*args, **kwargs)
        except Exception:  # noqa: BLE001 - only the locations are wanted; capture already ran it
            pass
    return watcher.found


@dataclass
class Prepared:
    """The graph to plan and what was learnt making it.

    ``leaf_modules`` includes the modules kept opaque because they update buffers;
    ``mode_sensitive`` says why the graph cannot follow ``.train()``/``.eval()`` ('' if it can).
    """

    capture: Capture
    mutations: Mutations
    leaf_modules: List[Union[type, str]]
    mode_sensitive: str


def prepare(model: nn.Module, args: tuple, kwargs: dict, leaf_modules: Sequence[Union[type, str]] = (),
            split_dims: Optional[List[Optional[int]]] = None, report: Optional[Progress] = None,
            export_only: bool = False) -> Prepared:
    """Capture ``model`` exactly (see the module docstring). Wrap the call in :func:`preserved`:
    tracing runs the model. ``split_dims``: see :func:`fxpipe.capture._tracing.capture`. ``report``
    shows the phases (:mod:`fxpipe.progress`)."""
    report = report if report is not None else Progress(enabled=False)
    with report.phase("capturing the model"):
        captured, leaves, sensitive = _captured(model, args, kwargs, leaf_modules, split_dims, export_only)
    with report.phase("finding in-place updates"):
        flat = captured.flatten_inputs(args, kwargs)
        mutations = find_and_fix_mutations(model, captured.graph_module, flat)
        open_output_containers(captured, flat, mutations.sample_outputs)  # the same run's outputs
        mutations.sample_outputs = None
    return Prepared(captured, mutations, leaves, sensitive)


def _captured(model: nn.Module, args: tuple, kwargs: dict, leaf_modules: Sequence[Union[type, str]],
              split_dims: Optional[List[Optional[int]]], export_only: bool = False
              ) -> Tuple[Capture, List[Union[type, str]], str]:
    """The capture, with modules fx would drop buffer updates of kept opaque, the leaf modules
    that took, and why the graph cannot follow .train()/.eval() ('' if it can)."""
    leaves: List[Union[type, str]] = list(leaf_modules)
    names = {id(m): name for name, m in model.named_modules()}
    for _ in range(8):
        before = _versions(model)
        captured = capture(model, args, kwargs, leaf_modules=leaves, split_dims=split_dims, export_only=export_only)
        after = _versions(model)
        changed = [name for name, v in before.items() if after.get(name) != v]
        if not changed or captured.method == "export":
            break
        writers = _trace_time_writers(model, changed, args, kwargs)
        added = False
        for name in changed:
            where, owner = writers.get(name, ("unknown", None))
            owner_name = names.get(id(owner)) if owner is not None else None
            if not owner_name:
                raise MutationError(
                    f"the forward updates buffer '{name}' in place at {where}, in the root module's "
                    "own forward. torch.fx runs that update while tracing and leaves it out of the "
                    "graph, so a pipeline would never apply it, and a root forward cannot be kept "
                    "opaque. What to do: move the update into a submodule (it then runs once per "
                    "micro-batch), or out of forward.")
            if owner_name not in leaves:
                leaves.append(owner_name)
                added = True
                warnings.warn(
                    f"fxpipe: '{owner_name}' updates buffer '{name}' in place in its forward ({where}); "
                    "torch.fx would drop that update, so the module is kept opaque and runs eagerly, "
                    "updating the buffer once per micro-batch", stacklevel=4)
        if not added:
            raise MutationError(
                f"buffers {changed} are updated in place while the model is traced and the update "
                f"cannot be kept in the graph (at {[writers.get(n, ('unknown',))[0] for n in changed]}). "
                "What to do: keep the module that updates them opaque with leaf_modules=[...].")
    return captured, leaves, mode_sensitivity(model, captured, args, kwargs, leaves, split_dims)


def mode_sensitivity(model: nn.Module, captured: Capture, args: tuple, kwargs: dict,
                     leaf_modules: Sequence[Union[type, str]],
                     split_dims: Optional[List[Optional[int]]] = None) -> str:
    """Why the captured graph cannot follow .train()/.eval(), or '' when it can.

    torch.export bakes the mode into aten ops (dropout, batch_norm). torch.fx keeps
    nn.Dropout / BatchNorm as modules that follow the mode, but a ``self.training`` read
    inside a traced forward becomes a constant: trace once more in the other mode and
    compare the code (before any rewriting of the graph).
    """
    if captured.method == "export":
        return "captured with torch.export"
    try:
        with modes_kept(model), warnings.catch_warnings():  # each module's flag back, not the root's for all
            model.train(not model.training)
            warnings.simplefilter("ignore")
            other = capture(model, args, kwargs, leaf_modules=leaf_modules, split_dims=split_dims)
    except Exception:  # noqa: BLE001 - a model that traces in one mode only is mode-sensitive
        return "the model does not trace the same way in the other mode"
    if other.graph_module.code != captured.graph_module.code:
        return "a traced forward reads self.training"
    return ""


def check_capture(eager: Any, graph_leaves: Sequence[Any], names: Sequence[str], deterministic: bool,
                  pre_hooked: Sequence[str] = ()) -> None:
    """Refuses a captured graph that does not reproduce the model on the sample.

    ``eager`` is the model's own output and ``graph_leaves`` the graph's flat outputs, both
    from :func:`fxpipe.checks._micro_batches.sample_run`. A capture can be silently unfaithful:
    a forward that changes Python state (``self.calls += 1`` on an int attribute) runs that
    code once, while torch.fx traces, and the graph keeps the value it had then as a
    constant. Values are compared only when the graph is deterministic (``deterministic``).
    ``pre_hooked``: modules kept opaque under torch.export that have forward pre-hooks, named as
    the other known cause: export records a kept module's call with the arguments its pre-hooks
    returned, so a pre-hook that returns new arguments runs again on them.
    """
    leaves, _ = flatten(eager)
    if len(leaves) != len(graph_leaves):
        # A transformers cache (which fxpipe.tree does not open) comes out of the capture taken
        # apart into its tensors, so the counts differ; otherwise a graph returning fewer values
        # than the model lost some (what a hook collected while the model's forward ran).
        if len(graph_leaves) > len(leaves) or any(is_cache(v) for v in leaves):
            return
        returned = set(names)
        missing = [n for n in leaf_names(eager) if n not in returned] or ["?"]
        raise TraceError(
            f"the captured graph does not reproduce the model on the sample: it returns {len(graph_leaves)} values "
            f"where model(*sample) returns {len(leaves)}; missing: {', '.join(missing[:6])}"
            f"{', ...' if len(missing) > 6 else ''}. A known cause: something that records outputs while the "
            "model's own forward runs (a hook collecting into a list, transformers' output_hidden_states) on a "
            "module kept whole. What to do: leave that output out of the call, or make the module traceable "
            "(remove it from leaf_modules).")
    for name, a, b in zip(names, leaves, graph_leaves):
        if not same_value(a, b, values=deterministic):
            label = f"output {name!r}" if name else "the output"
            hooks = (f" Or, here: {', '.join(map(repr, pre_hooked))} kept opaque under torch.export with forward "
                     "pre-hooks: a pre-hook that returns new arguments is applied to what it already returned. "
                     "What to do then: apply that change inside the module's forward, or register the hook on "
                     "an enclosing module.") if pre_hooked else ""
            raise TraceError(
                f"the captured graph does not reproduce the model on the sample: {label} differs from "
                "model(*sample). A known cause: a forward that changes Python state (`self.calls += 1` on "
                "an int attribute): torch.fx runs it once while tracing and the graph keeps the value it "
                "had then as a constant. What to do: move that update out of forward (the pipeline runs "
                "forward once per micro-batch, not once per call)." + hooks)
