"""torch.export fallback of :func:`fxpipe.capture._tracing.capture`.

Used when torch.fx cannot trace a model (HF transformers models, root-level tricks fx
does not support). The exported aten graph is rebuilt so that it satisfies the same
contract as the fx path: flat placeholders, flat tuple output, get_attr nodes bound to the
model's own Parameters/buffers, ``fxpipe_module`` and ``stack_trace`` meta on every node.

transformers caches in the output (``past_key_values``: a ``DynamicCache`` when
``use_cache=True``, the default) are not pytree nodes, and torch.export refuses them.
Their key/value tensors are taken out as ordinary outputs (concatenated over micro-batches
like any output) and the cache object is rebuilt around them by the output spec, so the
pipeline returns the same cache as eager. Caches holding other tensors (static caches,
sliding-window tensors, quantized caches) are refused: see :func:`unsupported_output`.

Regions export wraps in higher-order ops (no_grad, autocast) keep their bodies, other such
ops are refused (:mod:`fxpipe.capture._export_hops`); ``leaf_modules`` calls become one node each
(:mod:`fxpipe.capture._export_leaves`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ._export_leaves import collapse_leaf_calls
from ._export_hops import hop_error, keep_body, unsupported_hop
from ._meta import exported_as_cpu

__all__ = ["export_graph", "Exported", "compose_out_spec"]


@dataclass
class _Failure:
    """Why one strategy failed: the module being traced and the exception."""

    module: str
    error: BaseException
    auto: list[str] = field(default_factory=list)  # submodules made opaque before failing
    #: an output object fxpipe cannot return faithfully ("transformers DynamicCache with ...")
    bad_output: str = ""
    #: export succeeded but its graph holds something fxpipe refuses (a higher-order op)
    refusal: TraceError | None = None


@dataclass
class Exported:
    """A rebuilt export graph, its attribute table, and how its output leaves changed.

    ``leaf_specs[i]`` is the spec that replaces leaf ``i`` of the model's output spec
    (a cache taken apart into its tensors), ``None`` where the leaf is output as is.
    """

    graph: fx.Graph
    table: dict[str, Any]
    leaf_specs: list[pytree.TreeSpec | None]
    #: modules kept opaque (``leaf_modules`` honoured: one call_module node per call)
    leaves: list[str] = field(default_factory=list)

    def __iter__(self) -> Any:  # ``graph, table = export_graph(...)``, as before leaf_specs
        return iter((self.graph, self.table))


# -- transformers caches in the output ------------------------------------------------------
def _cache_base() -> type | None:
    mod = sys.modules.get("transformers.cache_utils")  # a model returning one has imported it
    return getattr(mod, "Cache", None)


_PLAIN = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size,
          torch.SymInt, torch.SymFloat, torch.SymBool, type, nn.Module)


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is or (a few levels down its attributes and containers) holds a tensor."""
    if isinstance(value, torch.Tensor):
        return True
    if depth > 3 or isinstance(value, _PLAIN):
        return False
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_tensor(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return any(_holds_tensor(v, depth + 1) for v in value.values())
    attrs = getattr(value, "__dict__", None)
    return isinstance(attrs, dict) and any(
        _holds_tensor(v, depth + 1) for v in attrs.values())


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _plain_problem(name: str, value: Any) -> str:
    """Why an attribute cannot be kept in a template and copied into every rebuilt cache."""
    if _holds_tensor(value):
        return f"{name} holds tensors"
    leaves = pytree.tree_leaves(value)
    if any(isinstance(v, _SYMBOLIC) for v in leaves):
        return f"{name} depends on the batch size"
    try:
        copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - streams, handles: not a plain value
        return f"{name} ({type(value).__name__}) cannot be copied"
    return ""


class _CacheTemplate:
    """A cache's structure without its tensors: classes and plain attributes.

    Built from the object the model returned at capture time; :meth:`build` makes a new
    object of the same classes with the same plain attributes around new key/value tensors.
    Compared by identity (it is a TreeSpec context: one capture, one template).
    """

    def __init__(self, obj: Any, cache_base: type) -> None:
        self.cls = type(obj)
        self.attrs: dict[str, Any] = {}
        self.layers: list[tuple[type, dict[str, Any], bool]] | None = None
        self.nested: dict[str, _CacheTemplate] = {}
        self.n_tensors = 0
        for name, value in vars(obj).items():
            if name == "layers" and isinstance(value, list):
                self.layers = []
                for i, layer in enumerate(value):
                    plain = {k: v for k, v in vars(layer).items() if k not in ("keys", "values")}
                    bad = [why for k, v in plain.items() for why in [_plain_problem(k, v)] if why]
                    if bad:
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds more than keys and values: "
                                           f"{'; '.join(bad)}")
                    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
                    has_kv = isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)
                    if not has_kv and (keys is not None or values is not None):
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds keys/values that are not tensors")
                    if has_kv and (keys.dim() == 0 or values.dim() == 0):
                        raise _Unsupported(f"layer {i} ({type(layer).__name__}) holds 0-dim keys/values")
                    self.layers.append((type(layer), plain, has_kv))
                    self.n_tensors += 2 if has_kv else 0
            elif isinstance(value, cache_base):
                self.nested[name] = _CacheTemplate(value, cache_base)
                self.n_tensors += self.nested[name].n_tensors
            elif _plain_problem(name, value):
                raise _Unsupported(f"attribute {_plain_problem(name, value)}")
            else:
                self.attrs[name] = value
        if self.layers is None and not self.nested:
            raise _Unsupported("structure is unknown (no cache layers, no nested caches)")

    def tensors(self, obj: Any) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for name, tpl in self.nested.items():
            out += tpl.tensors(getattr(obj, name))
        for (_, _, has_kv), layer in zip(self.layers or [], getattr(obj, "layers", [])):
            if has_kv:
                out += [layer.keys, layer.values]
        return out

    def build(self, tensors: Sequence[Any]) -> Any:
        it = iter(tensors)
        return self._build(it)

    def _build(self, it: Any) -> Any:
        obj = object.__new__(self.cls)
        obj.__dict__.update(copy.deepcopy(self.attrs))
        for name, tpl in self.nested.items():
            obj.__dict__[name] = tpl._build(it)
        if self.layers is not None:
            layers = []
            for cls, plain, has_kv in self.layers:
                layer = object.__new__(cls)
                layer.__dict__.update(copy.deepcopy(plain))
                layer.keys = layer.values = None
                if has_kv:
                    layer.keys, layer.values = next(it), next(it)
                    if "device" in plain:
                        layer.device = layer.keys.device
                    if "dtype" in plain:
                        layer.dtype = layer.keys.dtype
                layers.append(layer)
            obj.__dict__["layers"] = layers
        return obj

    def __repr__(self) -> str:
        return f"{self.cls.__name__}({self.n_tensors} tensors)"


class _Unsupported(Exception):
    pass


class _CacheNode:
    """Pytree stand-in for a transformers cache in a model's output (private, never the user's type)."""

    __slots__ = ("template", "tensors")

    def __init__(self, template: _CacheTemplate, tensors: list[torch.Tensor]) -> None:
        self.template, self.tensors = template, tensors


pytree.register_pytree_node(
    _CacheNode,
    lambda n: (list(n.tensors), n.template),
    lambda values, template: template.build(list(values)),
    serialized_type_name="fxpipe.capture._export._CacheNode",
)


def unsupported_output(value: Any) -> str:
    """Why an output leaf cannot be returned faithfully, or '' when it can.

    Tensors and plain values can; a transformers cache only through :class:`_CacheNode`
    (checked there); any other object holding tensors cannot: micro-batches would each
    produce one, and only the first micro-batch's could be returned.
    """
    base = _cache_base()
    if base is not None and isinstance(value, base):
        try:
            _CacheTemplate(value, base)
        except _Unsupported as e:
            return f"a transformers {type(value).__name__} whose {e}"
        return ""
    if not isinstance(value, torch.Tensor) and _holds_tensor(value):
        return f"a {type(value).__module__}.{type(value).__qualname__} holding tensors"
    return ""


def _encode_leaves(leaves: Sequence[Any], record: dict[str, Any]) -> tuple[Any, ...]:
    """Output leaves with caches replaced by their tensors; specs and problems go to ``record``."""
    base = _cache_base()
    out: list[Any] = []
    specs: list[pytree.TreeSpec | None] = []
    problems: list[str] = []
    for leaf in leaves:
        if base is not None and isinstance(leaf, base):
            try:
                tpl = _CacheTemplate(leaf, base)
            except _Unsupported as e:
                problems.append(f"a transformers {type(leaf).__name__} whose {e}")
                out.append(leaf)
                specs.append(None)
                continue
            sub, spec = pytree.tree_flatten(_CacheNode(tpl, tpl.tensors(leaf)))
            out += sub
            specs.append(spec)
        else:
            why = unsupported_output(leaf)
            if why:
                problems.append(why)
            out.append(leaf)
            specs.append(None)
    record["specs"], record["problems"] = specs, problems
    return tuple(out)


def _encoding_root(root: nn.Module, names: list[str], record: dict[str, Any]) -> nn.Module:
    """``root`` (same state, same argument names) whose output has caches taken apart."""
    base_forward = type(root).forward
    args = ", ".join(names)
    src = f"def forward(self, {args}):\n    return _fxpipe_encode(_fxpipe_base(self, {args}), _fxpipe_record)\n"
    ns: dict[str, Any] = {"_fxpipe_encode": _encode_leaves, "_fxpipe_base": base_forward, "_fxpipe_record": record}
    exec(compile(src, "<fxpipe-export-forward>", "exec"), ns)
    cls = type(type(root).__name__, (type(root),), {"forward": ns["forward"]})
    new = object.__new__(cls)
    new.__dict__.update(root.__dict__)  # the same _parameters/_buffers/_modules dicts
    return new


def compose_out_spec(spec: pytree.TreeSpec, leaf_specs: Sequence[pytree.TreeSpec | None]) -> pytree.TreeSpec:
    """``spec`` with leaf ``i`` replaced by ``leaf_specs[i]`` where that is not None."""
    if not any(s is not None for s in leaf_specs):
        return spec
    it = iter(leaf_specs)

    def walk(s: pytree.TreeSpec) -> pytree.TreeSpec:
        if s.is_leaf():
            new = next(it)
            return s if new is None else new
        return pytree.TreeSpec(s.type, s.context, [walk(c) for c in s.children()])

    return walk(spec)


# -- export -------------------------------------------------------------------------------
def export_graph(model: nn.Module, root: nn.Module, flat: list[Any], names: list[str],
                 split_dims: list[int | None] | None = None, leaves: Sequence[str] = ()) -> Exported | _Failure:
    """Export the flat root and rebuild a contract-conforming graph.

    Why not ``ep.module()`` or ``torch.export.unflatten``: both return modules with their
    own attribute hierarchy and pytree codegen; rebuilding the graph from
    ``ep.graph_signature`` gives flat placeholders, a flat output, get_attr nodes that
    resolve to the model's own Parameters (so training the pipeline trains the model), and
    explicit ``copy_`` nodes for the buffer mutations export returns as outputs (an in-place
    update it keeps in place, as torch 2.13 does, runs on the model's own buffer as it is).

    ``leaves``: qualified names of modules to keep opaque; each of their calls becomes one
    ``call_module`` node (:mod:`fxpipe.capture._export_leaves`).
    """
    from torch.export.graph_signature import InputKind, OutputKind

    record: dict[str, Any] = {}
    target = _encoding_root(root, names, record)
    # The dim each input is split along (the batch) is dynamic: micro-batches are smaller.
    dims = split_dims if split_dims is not None else [0] * len(flat)
    dyn = tuple({d % v.dim(): torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() and d is not None
                else None for v, d in zip(flat, dims))
    ep, err = None, None
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # export logs/prints failed graphs at length
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            for shapes in (dyn, None):  # dynamic batch first: micro-batches are smaller than the sample
                try:
                    with exported_as_cpu(model, flat) as inputs:  # a meta model: the CPU graph
                        ep = torch.export.export(target, tuple(inputs), dynamic_shapes=shapes, strict=False,
                                                preserve_module_call_signature=tuple(leaves))
                    break
                except Exception as e:  # noqa: BLE001
                    err = err or e
                    if record.get("problems"):
                        break  # the output itself is the problem: a static shape will not help
    finally:
        quiet.setLevel(level)
    bad = "; ".join(record.get("problems") or [])
    if ep is None or bad:
        return _Failure("", err or RuntimeError(f"the output holds {bad}"), bad_output=bad)

    sig, src = ep.graph_signature, ep.graph_module.graph
    g = fx.Graph()
    phs = [g.placeholder(n) for n in names]
    tensor_ph = [p for p, v in zip(phs, flat) if isinstance(v, torch.Tensor)]
    user = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    user_ph = phs if len(user) == len(phs) else tensor_ph
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, fx.Node] = {}
    bodies: dict[str, fx.GraphModule] = {}  # bodies of higher-order op calls (see export_hops)
    src_ph = [n for n in src.nodes if n.op == "placeholder"]
    for spec, node in zip(sig.input_specs, src_ph):
        if spec.kind == InputKind.USER_INPUT:
            env[node] = user_ph.pop(0)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            env[node] = attrs[spec.target] = g.get_attr(spec.target)
        else:
            return _Failure("", RuntimeError(f"unsupported exported input kind {spec.kind}"))
        env[node].meta.update(node.meta)
    for node in src.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "output":
            outs = []
            for spec, val in zip(sig.output_specs, node.args[0]):
                val = env.get(val, val) if isinstance(val, fx.Node) else val
                if spec.kind == OutputKind.BUFFER_MUTATION:
                    update = g.call_function(torch.ops.aten.copy_.default, (attrs[spec.target], val))
                    update.meta["fxpipe_buffer_update"] = True
                elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                    tgt = next(env[p] for s, p in zip(sig.input_specs, src_ph) if s.arg.name == spec.target)
                    g.call_function(torch.ops.aten.copy_.default, (tgt, val))
                else:
                    outs.append(val)
            g.output(tuple(outs))
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue  # pins dtype/device of the sample; stages may run elsewhere
        body = getattr(ep.graph_module, str(node.target), None) if node.op == "get_attr" else None
        if isinstance(body, fx.GraphModule):  # a higher-order op's region: the stage calling it holds it
            name = _body_name(model, str(node.target), bodies)
            bodies[name] = keep_body(body)
            env[node] = g.get_attr(name)
            env[node].meta.update(node.meta)
            continue
        env[node] = g.node_copy(node, lambda n: env[n])
    for n in g.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        n.meta["fxpipe_module"] = _clean_path(path, n.target if n.op == "get_attr" and n.target not in bodies else None)
    try:
        by_name = {n.name: env[n] for n in src.nodes if n in env}
        used = collapse_leaf_calls(g, ep.module_call_graph, list(leaves), lambda p: _clean_path(p, None), by_name)
    except TraceError as e:
        return _Failure(e.module, e, refusal=e)
    hop = unsupported_hop(g, bodies)  # after the collapse: a leaf module may hold it
    if hop is not None:
        stack = hop.meta.get("nn_module_stack") or {}
        refusal = hop_error(type(model).__qualname__, hop, _clean_path(list(stack.values())[-1][0], None) if stack else "")
        return _Failure(refusal.module, refusal, refusal=refusal)
    table = {**_attr_table(model, g, ep.constants, bodies), **bodies}
    table.update({n.target: model.get_submodule(n.target) for n in g.nodes if n.op == "call_module"})
    return Exported(g, table, list(record.get("specs") or []), used)


def _body_name(model: nn.Module, name: str, taken: dict[str, Any]) -> str:
    """``submod_1``, unless the model itself has a top-level attribute of that name."""
    new = name
    while hasattr(model, new) or new in taken:
        new = f"_{new}"
    return new


def _clean_path(path: str, attr: Any) -> str:
    if isinstance(attr, str):  # owner of a parameter / buffer
        return attr.rpartition(".")[0]
    if "nn_module_stack" in path:  # export's placeholder for nodes without a module
        return ""
    path = re.sub(r"^L\['self'\]\.?|^L__self___?", "", path)
    return re.sub(r"\.?_modules\['([^']*)'\]", r".\1", path).strip(".")


def _attr_table(model: nn.Module, graph: fx.Graph, ep_consts: dict[str, Any],
                bodies: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op == "get_attr" and n.target not in bodies:
            try:
                table[n.target] = model.get_parameter(n.target)
            except AttributeError:
                try:
                    table[n.target] = model.get_buffer(n.target)
                except AttributeError:
                    table[n.target] = ep_consts[n.target]
    return table
