"""Capture any ``nn.Module`` as a flat ``torch.fx.GraphModule``.

Why flat: every later stage (profile, partition, emit, runtime) wants to reason about a
graph whose inputs are the leaves of ``tree_flatten((args, kwargs))`` and whose output is a
flat tuple; the pytree specs kept in :class:`Capture` rebuild the user's structures.

Strategy, in order (see :func:`capture`):

1. torch.fx symbolic tracing. Standard ``torch.nn`` layers and the user's ``leaf_modules``
   stay opaque (``call_module``). A submodule whose forward cannot be traced is made a
   leaf automatically and tracing is retried.
2. ``torch.export.export(strict=False)`` when fx fails at the root, or when the automatic
   leaves would swallow most of the parameters (a graph with one giant opaque node cannot
   be pipelined). The aten graph is rebuilt with the model's own Parameters.
3. :class:`~fxpipe.errors.TraceError` naming module, source line, reason and remedy.
"""

from __future__ import annotations

import inspect
import keyword
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ._attr_reads import AttrRead, AttributeReads, plain_attributes
from ._custom_functions import autograd_function_in, refusing_in_export
from ._call_inputs import call_signature, check_micro_batches, flatten_call, call_input_names, in_sample_order
from ._export import _Failure, export_graph
from ._export_outputs import compose_out_spec
from ._shape_guards import ShapeGuards, fixed_batch, fixed_dims, fx_entangled_size, split_dim
from ._trace_errors import (checkpointing_todo, describe, lost_records_error, output_error, reason_of, trace_error,
                            user_frame)
from ._export_leaves import leaf_paths
from ..errors import TraceError
from ._hooks import hooked_modules
from ._grad_regions import RegionGraphModule, inference_values
from ._mutation import KEEP_REASON, KEEP_WITH
from ._opaque_calls import OpaqueCalls
from ._reentrant import reentrant_checkpoint_in, refusing_reentrant_checkpoint
from ._meta import has_meta_tensors
from ..tree import flatten
from ._values import kept_for_comparison
from ._trace_time import ComputedAtTrace, DrewFromPython, KeepsState, python_drew_since, python_states
from ._fx_trace import is_standard_layer, trace_fx
from ._call_context import CallContext, ContextCheck, ContextReads, ReadsCallContext, TensorHookError

__all__ = ["Capture", "TraceError", "capture", "flatten_output", "retarget_devices"]

# fx output with auto-leaves holding more than this share of parameters: prefer export
_EXPORT_IF_OPAQUE_SHARE = 0.5


def flatten_output(out: Any) -> tuple[list[Any], pytree.TreeSpec]:
    """``tree_flatten`` that also understands (unregistered) dataclasses (see fxpipe.tree)."""
    return flatten(out)


# -- result --------------------------------------------------------------------------------
@dataclass
class Capture:
    """A captured model: flat GraphModule plus the specs to rebuild user structures.

    - ``graph_module``: one placeholder per leaf of ``tree_flatten((args, kwargs))``, output
      a flat tuple of output leaves; parameters/submodules are the model's own objects.
    - ``in_spec`` / ``out_spec``: pytree specs of ``(args, kwargs)`` and of the output.
    - ``method``: ``'fx'`` or ``'export'``.
    - ``specialized``: flat input index -> the non-tensor sample value baked into the graph
      (its placeholder is unused); :meth:`flatten_inputs` checks later calls against it.
    - ``leaves``: qualified names kept opaque besides standard torch.nn layers (user
      ``leaf_modules`` and automatic fallbacks; for ``'export'`` the user's leaves called).
    - ``signature``: the model's forward signature, to name arguments in call errors.
    - ``fixed``: flat input index -> its size per dim where the graph is specialised on it
      (``None``: any size). torch.export fixes the sizes the model's code depends on; fx none
      (empty).
    - ``guards``: what torch.export assumed of the sizes it kept symbolic (equal lengths, a
      range), checked at each call (:mod:`fxpipe.capture._shape_guards`); fx none.
    - ``reads``: the plain attributes the traced code read, baked into the graph
      (:mod:`fxpipe.capture._attr_reads`); :mod:`fxpipe.capture._model_check` checks them at each call.
    """

    graph_module: fx.GraphModule
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    method: str
    specialized: dict[int, object] = field(default_factory=dict)
    leaves: list[str] = field(default_factory=list)
    signature: inspect.Signature | None = field(default=None, repr=False, compare=False)
    fixed: dict[int, tuple[int | None, ...]] = field(default_factory=dict)
    reads: list[AttrRead] = field(default_factory=list, repr=False, compare=False)
    #: torch.export fixed the split dim (a batch-1 sample): every micro-batch holds one sample
    batch_fixed: bool = False
    guards: ShapeGuards = field(default_factory=ShapeGuards)
    #: what a torch.export capture's code read of its context (autocast, grad mode, the inputs'
    #: dtypes and requires_grad), checked per call (:mod:`fxpipe.capture._call_context`); fx none
    context: ContextCheck | None = field(default=None, repr=False, compare=False)

    def flatten_inputs(self, args: tuple, kwargs: dict | None = None) -> list[Any]:
        """Flatten a call's inputs, checking them against the captured sample.

        The call must pass the same arguments positionally / by keyword as the sample (named
        keywords in any order), the same containers, tensors where the sample had tensors,
        the specialised values where it had other values, and tensors of the sizes in
        :attr:`fixed`; otherwise :class:`~fxpipe.errors.InputMismatchError` names the
        argument and says what to do (:func:`fxpipe.capture._call_inputs.flatten_call`).
        """
        return flatten_call(self, tuple(args), dict(kwargs or {}))

    def check_context(self, model: nn.Module, args: tuple, kwargs: dict | None, flat: list[Any],
                      device: torch.device) -> None:
        """A call in another context than the build's (autocast, grad mode, an input's dtype or
        requires_grad) where the model's code reads it: checked once per context (on fake
        tensors on ``device``), refused with :class:`~fxpipe.errors.ModelChangedError` where it
        reads otherwise."""
        if self.context is not None:
            names = lambda: call_input_names(self, tuple(args), in_sample_order(self, dict(kwargs or {})))  # noqa: E731
            self.context.check(model, flat, names, device)

    def check_micro_batches(self, args: tuple, kwargs: dict | None, micro: Sequence[Sequence[Any]]) -> None:
        """The guards torch.export recorded on the batch's size, at each micro-batch's sizes
        (:class:`~fxpipe.errors.InputMismatchError` naming them)."""
        check_micro_batches(self, tuple(args), dict(kwargs or {}), micro)

    def unflatten_output(self, leaves: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(list(leaves), self.out_spec)


# -- flat root -----------------------------------------------------------------------------
def _key_str(k: Any) -> str:
    for attr in ("idx", "key", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def positional_names(model: nn.Module) -> tuple[list[str], str | None]:
    """The names of ``model.forward``'s positional parameters, and of its ``*args`` (or None)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    var = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), None)
    return [p.name for p in params if p.kind in kinds], var


def _input_names(model: nn.Module, paths: list[tuple]) -> list[str]:
    """Readable placeholder names from the forward signature (``x``, ``mask``, ``x_0``)."""
    pos, var_name = positional_names(model)
    var = var_name or "arg"
    names: list[str] = []
    for path in paths:
        top, first, rest = _key_str(path[0]), path[1], path[2:]
        if top == "0":
            i = int(_key_str(first))
            base = pos[i] if i < len(pos) else f"{var}_{i}"
        else:
            base = _key_str(first)
        base = "_".join([base, *(_key_str(k) for k in rest)])
        name = re.sub(r"\W", "_", base) or "arg"
        if name[0].isdigit() or keyword.iskeyword(name) or name in ("self", "_fxpipe_impl"):
            name = "_" + name
        while name in names:
            name += "_"
        names.append(name)
    return names


def _flat_root(model: nn.Module, names: list[str], in_spec: pytree.TreeSpec,
               consts: dict[int, Any], out_specs: list[pytree.TreeSpec]) -> nn.Module:
    """A module that *is* the model for fx/export purposes but takes flat inputs.

    It shares the model's ``_parameters/_buffers/_modules`` dicts, so qualified names and
    objects are the model's own; its generated ``forward(self, x, mask, ...)`` gives the
    placeholders readable names and calls the model's real forward (bound to the model).
    Non-tensor leaves are replaced by their sample values (specialisation).
    """
    def impl(flat: list[Any]) -> tuple[Any, ...]:
        leaves = [consts[i] if i in consts else v for i, v in enumerate(flat)]
        args, kwargs = pytree.tree_unflatten(leaves, in_spec)
        out_leaves, spec = flatten_output(model.forward(*args, **kwargs))
        out_specs.append(spec)
        return tuple(out_leaves)

    src = f"def forward(self, {', '.join(names)}):\n    return _fxpipe_impl([{', '.join(names)}])\n"
    ns: dict[str, Any] = {"_fxpipe_impl": impl}
    exec(compile(src, "<fxpipe-flat-forward>", "exec"), ns)
    cls = type(type(model).__name__, (nn.Module,), {"forward": ns["forward"]})
    root = cls()
    for attr in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        root.__dict__[attr] = model.__dict__[attr]
    root.__dict__["training"] = model.training
    return root


# -- entry point ---------------------------------------------------------------------------
def capture(model: nn.Module, args: tuple, kwargs: dict | None = None, *,
            leaf_modules: Iterable[type | str] = (), split_dims: list[int | None] | None = None,
            export_only: bool = False) -> Capture:
    """Capture ``model(*args, **kwargs)`` as a flat GraphModule sharing the model's state.

    ``leaf_modules``: module classes or qualified names to keep opaque (``call_module``).
    ``split_dims``: per flat input leaf, the dim micro-batches split (None: not split); a
    torch.export capture keeps that dim dynamic (default: dim 0 of every tensor).
    Non-tensor inputs are specialised (see :attr:`Capture.specialized`). Python-level
    decisions taken at capture time stay baked in: ``self.training`` read inside a traced
    forward (fx), and the whole training mode for ``'export'`` graphs (aten ops carry it).
    Export graphs also carry the sample's device in factory ops: see :func:`retarget_devices`.
    ``export_only``: torch.export without trying torch.fx first (a capture in other modes of a
    model first captured by export: torch.fx may trace it in those modes, into a graph the
    plan's cut cannot be carried to, :mod:`fxpipe._mode_variants`).
    Raises :class:`TraceError` when neither torch.fx nor torch.export can capture the model.
    """
    args, kwargs = tuple(args), dict(kwargs or {})
    leaf_types = tuple(x for x in leaf_modules if isinstance(x, type))
    leaf_names = {x for x in leaf_modules if isinstance(x, str)}
    known = {name for name, _ in model.named_modules()}
    if leaf_names - known:
        raise ValueError(f"leaf_modules: {sorted(leaf_names - known)} are not submodules of {type(model).__name__}")
    leaf_names |= set(hooked_modules(model, lambda m: isinstance(m, leaf_types), is_standard_layer))
    flat_with_path, in_spec = pytree.tree_flatten_with_path((args, kwargs))
    flat = [v for _, v in flat_with_path]
    names = _input_names(model, [p for p, _ in flat_with_path])
    specialized = {i: kept_for_comparison(v) for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
    out_specs: list[pytree.TreeSpec] = []
    root = _flat_root(model, names, in_spec, specialized, out_specs)

    if export_only:
        fx_res: Any = _Failure("", TraceError("torch.fx not tried: the model's first capture was torch.export"))
    else:
        with refusing_reentrant_checkpoint():  # while tracing only: the checks run the real one
            fx_res = trace_fx(model, root, leaf_types, leaf_names)
    lost_records: list[str] = []
    if not isinstance(fx_res, _Failure):
        graph, opaque, auto, fx_reads, lost_records = fx_res
        fx_out_spec = out_specs[-1]
        # lost records: the graph would lack what their hooks record; torch.export runs a kept module's hooks
        if not lost_records and (not auto or _opaque_share(model, [f.module for f in auto]) <= _EXPORT_IF_OPAQUE_SHARE):
            return _finish_fx(model, root, graph, in_spec, fx_out_spec, specialized, opaque, auto, fx_reads, flat,
                              split_dims)
    kept = leaf_paths(model, [*leaf_types, *leaf_names])  # export traces them too: their reads are their own
    kept_modules = [model.get_submodule(p) for p in kept]
    exported = _unaliased(flat)
    built = CallContext.of(exported)
    with OpaqueCalls(kept_modules) as in_kept, refusing_reentrant_checkpoint(), refusing_in_export(in_kept), \
            AttributeReads(model, in_kept) as ex_reads, ContextReads(getters=True, skip=lambda: in_kept.inside) as context:
        python = python_states()
        ex_res = export_graph(model, root, exported, names, split_dims, kept)
        if python_drew_since(python) and not isinstance(ex_res, _Failure):  # baked into the graph as well
            raise DrewFromPython("")
    reads = ex_reads.reads()
    if context.hooks and not isinstance(ex_res, _Failure):  # a graph of aten ops holds no tensor hook
        error = TensorHookError(context.hooks[0])
        ex_res = _Failure("", error, refusal=error)
    state = ex_reads.written_numbers()
    if state and not isinstance(ex_res, _Failure):  # torch.export keeps no module opaque but the user's leaves
        raise KeepsState(state[0])
    if isinstance(ex_res, _Failure) and not ex_res.bad_output and ex_res.refusal is None:
        # dynamo-traced regions (torch.cond's branches) cannot run the recording: export again
        # unrecorded, and check every plain attribute of the traced modules instead
        with OpaqueCalls(kept_modules) as in_kept, refusing_reentrant_checkpoint(), refusing_in_export(in_kept):
            unrecorded = export_graph(model, root, _unaliased(flat), names, split_dims, kept)
        if not isinstance(unrecorded, _Failure) or unrecorded.refusal is not None:
            ex_res, reads = unrecorded, plain_attributes(model, kept_modules)
    kept_as_constant = [] if isinstance(ex_res, _Failure) else model_tensor_constants(model, ex_res.table)
    if kept_as_constant:  # refused, unless torch.fx's coarser graph holds it live
        error = ComputedAtTrace("", kept_as_constant[0], reached=True)
        ex_res = _Failure("", error, refusal=error)
    asks = [r for r in context.reads if r.what.startswith("torch.")]  # is_grad_enabled(), is_autocast_enabled()
    if asks and not isinstance(ex_res, _Failure) and not isinstance(fx_res, _Failure):
        # torch.fx kept the modules asking opaque (they ask each call); torch.export would fix the answer
        # and refuse a validation under no_grad (a trial: checkpointing only when grad is on)
        error = ReadsCallContext(asks[0])
        ex_res = _Failure("", error, refusal=error)
    if not isinstance(ex_res, _Failure):
        gm = fx.GraphModule(ex_res.table, ex_res.graph, class_name=type(model).__name__)
        gm.training = model.training
        if has_meta_tensors(model):  # exported as on the CPU (fxpipe.capture._meta); it runs on meta
            retarget_devices(gm, "meta")
        # caches in the output (past_key_values) come out as their tensors; the spec rebuilds them
        out_spec = compose_out_spec(out_specs[-1], ex_res.leaf_specs)
        return Capture(gm, in_spec, out_spec, "export", specialized, ex_res.leaves, call_signature(model),
                       fixed_dims(gm, flat, split_dims), reads, fixed_batch(gm, flat, split_dims),
                       ShapeGuards.of(gm, flat, split_dims, ex_res.ranges),
                       ContextCheck(context.reads[:8], built, in_spec) if context.reads else None)
    if ex_res.bad_output:
        # The fx graph returns the same object, from an opaque node: each micro-batch would
        # make one and only the first could be returned. Refuse rather than mislead.
        raise output_error(model, ex_res.bad_output) from ex_res.error
    if lost_records:
        raise lost_records_error(lost_records, ex_res.error) from ex_res.error
    if not isinstance(fx_res, _Failure):  # export failed too: a coarse fx graph is still correct
        return _finish_fx(model, root, graph, in_spec, fx_out_spec, specialized, opaque, auto, fx_reads, flat,
                          split_dims)
    for failure in (ex_res, fx_res):  # said plainly rather than as a capture failure
        refusal = reentrant_checkpoint_in(failure.error) or autograd_function_in(failure.error)
        if refusal is not None:
            raise refusal from None
    if ex_res.refusal is not None:  # export worked, but its graph holds what fxpipe refuses
        raise ex_res.refusal from fx_res.error
    raise trace_error(model, fx_res, ex_res) from fx_res.error


def model_tensor_constants(model: nn.Module, table: dict[str, Any]) -> list[str]:
    """The model's parameters and buffers that a torch.export graph holds as constants: reached
    other than as module attributes (a Python list or dict holding them), export lifts a
    detached copy sharing their storage, without their gradient and blind to new values."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    storages = {t.untyped_storage().data_ptr(): name for name, t in
                (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False))
                if not t.is_meta and t.untyped_storage().data_ptr()}
    return [storages[ptr] for value in table.values() if isinstance(value, torch.Tensor) and id(value) not in own
            and not value.is_meta and (ptr := value.untyped_storage().data_ptr()) in storages]


def _unaliased(flat: list[Any]) -> list[Any]:
    """``flat`` with every tensor that repeats an earlier one (by identity) cloned.

    torch.export merges arguments that are the same tensor object into one graph input (the
    transformers idiom ``model(input_ids=ids, labels=ids)``); the rebuilt graph would then read
    one argument where the model reads the other, and every later call with different values
    would silently use the wrong one. A clone gives each argument its own placeholder, which
    the graph reads exactly as the model does.
    """
    seen: set[int] = set()
    out = []
    for v in flat:
        if isinstance(v, torch.Tensor):
            if id(v) in seen:
                v = v.clone()
            seen.add(id(v))
        out.append(v)
    return out


def _finish_fx(model: nn.Module, root: nn.Module, graph: fx.Graph, in_spec: pytree.TreeSpec,
               out_spec: pytree.TreeSpec, specialized: dict[int, object], opaque: list[str], auto: list[_Failure],
               reads: list[AttrRead], flat: list[Any], split_dims: Sequence[int | None] | None) -> Capture:
    todo = checkpointing_todo(model) if auto else ""
    for f in auto:
        warnings.warn(f"fxpipe: {describe(model, f.module)} could not be traced by torch.fx "
                      f"({reason_of(f.error)} at {user_frame(f.error) or '?'}); kept opaque"
                      f"{'. ' + todo if todo else ''}", stacklevel=3)
    # Why each automatic leaf is opaque, for the plan's imbalance warning (fxpipe.plan._make).
    why = {f.module: f"torch.fx could not trace it: {reason_of(f.error)}" for f in auto}
    for node in graph.nodes:
        if node.op == "call_module" and node.target in why:
            node.meta["fxpipe_auto_leaf"] = why[node.target]
            if todo:
                node.meta["fxpipe_auto_leaf_todo"] = todo
    for node in graph.nodes:  # np.sqrt(d_k) in `scores / np.sqrt(d_k)`: generated code cannot name numpy
        node.args, node.kwargs = fx.node.map_aggregate((node.args, node.kwargs), _python_number)
    for node, users in inference_values(graph):  # an inference tensor cannot cross stages
        node.meta.setdefault(KEEP_WITH, []).extend(u.name for u in users)
        node.meta[KEEP_REASON] = ("it computes in torch.inference_mode() and its result, an inference tensor, "
                                  "cannot cross stages (use torch.no_grad() for a region that may be cut)")
    # root, not model: fx stores untracked tensor constants (_tensor_constant0) on the root
    # running it enters the grad-mode/autocast regions recorded on its nodes
    gm = RegionGraphModule(root, graph, class_name=type(model).__name__)
    gm.training = model.training
    # fx fixes no size, unless one regroups the batch's rows with another (fxpipe.capture._shape_guards)
    fixed = _every_size_but_the_batch(flat, split_dims) if fx_entangled_size(gm, flat, split_dims) else {}
    return Capture(gm, in_spec, out_spec, "fx", specialized, list(opaque), call_signature(model), fixed, reads=reads)


def _python_number(value: Any) -> Any:
    """A numpy scalar as the Python number it equals (``np.float64`` is a ``float`` already: the
    same arithmetic), anything else as it is."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and not isinstance(value, numpy.ndarray):
        return value.item()
    return value


def _every_size_but_the_batch(flat: list[Any], split_dims: Sequence[int | None] | None
                              ) -> dict[int, tuple[int | None, ...]]:
    out = {}
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor) and x.dim():
            split = split_dim(split_dims, i, x)
            out[i] = tuple(None if d == split else int(n) for d, n in enumerate(x.shape))
    return out


def _opaque_share(model: nn.Module, names: list[str]) -> float:
    total = sum(p.numel() for p in model.parameters()) or 1
    seen: set[int] = set()
    n = 0
    for name in names:
        for p in model.get_submodule(name).parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
    return n / total


def retarget_devices(gm: fx.GraphModule, device: torch.device | str) -> fx.GraphModule:
    """Rewrite literal ``device=`` kwargs (factory ops in export graphs) to ``device``.

    fx graphs compute devices from their inputs; export graphs bake in the sample's device,
    also positionally (``aten.to.device``) and inside the bodies of higher-order ops
    (:mod:`fxpipe.capture._export_hops`), which belong to the stage calling them.
    """
    dev = torch.device(device)
    for n in gm.graph.nodes:
        if n.op == "call_function":
            if isinstance(n.kwargs.get("device"), torch.device):
                n.kwargs = {**n.kwargs, "device": dev}
            if any(isinstance(a, torch.device) for a in n.args):
                n.args = tuple(dev if isinstance(a, torch.device) else a for a in n.args)
        elif n.op == "get_attr":
            body = gm.get_submodule(n.target) if isinstance(getattr(gm, n.target, None), fx.GraphModule) else None
            if body is not None:
                retarget_devices(body, device)
    gm.recompile()
    return gm
