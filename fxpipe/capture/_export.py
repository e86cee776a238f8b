"""torch.export fallback of :func:`fxpipe.capture._tracing.capture`.

Used when torch.fx cannot trace a model (HF transformers models, root-level tricks fx
does not support). The exported aten graph is rebuilt so that it satisfies the same
contract as the fx path: flat placeholders, flat tuple output, get_attr nodes bound to the
model's own Parameters/buffers, ``fxpipe_module`` and ``stack_trace`` meta on every node.

transformers caches in the output are taken apart into their tensors for export and rebuilt
by the output spec (:mod:`fxpipe.capture._export_outputs`).

Regions export wraps in higher-order ops (no_grad, autocast) keep their bodies, other such
ops are refused (:mod:`fxpipe.capture._export_hops`); ``leaf_modules`` calls become one node each
(:mod:`fxpipe.capture._export_leaves`).
"""

from __future__ import annotations

import contextlib
import io
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from ..errors import TraceError
from ._export_leaves import collapse_leaf_calls
from ._export_hops import hop_error, keep_body, unsupported_hop
from ._export_outputs import encoding_root
from ._meta import exported_as_cpu
from ._module_paths import module_path
from ._shape_guards import entangled_size, split_dim

__all__ = ["export_graph", "Exported"]


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
    #: each symbol's range of values, as export found it (``ep.range_constraints``)
    ranges: dict[Any, Any] = field(default_factory=dict)

    def __iter__(self) -> Any:  # ``graph, table = export_graph(...)``, as before leaf_specs
        return iter((self.graph, self.table))


# -- export -------------------------------------------------------------------------------
@contextlib.contextmanager
def attribute_objects_kept(root: nn.Module) -> Any:
    """The modules keep their own container attributes through ``torch.export``.

    Why: torch.export (2.13, ``_detect_attribute_assignment``) puts every module's own
    attributes back after tracing from a pytree copy, so each dict, list and tuple attribute
    becomes a new object of equal contents. The model would then hold other objects than the
    user's, and a traced read of such an attribute kept by identity (the ``_kernel_funcs``
    dict of modules that transformers >= 5.25 kernelizes, e.g. Llama's attention) looked
    changed at the pipeline's first call (``ModelChangedError``, measured). The original
    object goes back wherever torch's copy holds the very same leaves."""
    before = [(m.__dict__, k, v) for m in root.modules() for k, v in m.__dict__.items()
              if type(v) in (dict, list, tuple)]
    try:
        yield
    finally:
        for attrs, key, value in before:
            now = attrs.get(key, value)
            if now is not value and type(now) is type(value) and _same_leaves(now, value):
                attrs[key] = value


def _same_leaves(a: Any, b: Any) -> bool:
    leaves_a, spec_a = pytree.tree_flatten(a)
    leaves_b, spec_b = pytree.tree_flatten(b)
    return spec_a == spec_b and all(x is y for x, y in zip(leaves_a, leaves_b))


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
    target = encoding_root(root, names, record)
    ep, err = None, None
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # export logs/prints failed graphs at length
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            for sample, shapes in _attempts(flat, split_dims):
                try:
                    # a meta model: the CPU graph; the model's own attribute objects kept
                    with exported_as_cpu(model, sample) as inputs, attribute_objects_kept(target):
                        ep = torch.export.export(target, tuple(inputs), dynamic_shapes=shapes, strict=False,
                                                preserve_module_call_signature=tuple(leaves))
                    if shapes is not None and len(shapes) and entangled_size(ep, flat, split_dims) is not None:
                        ep = None  # the batch's rows regrouped by another size: that size fixed (next attempt)
                        continue
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
    return Exported(g, table, list(record.get("specs") or []), used, dict(ep.range_constraints))


def _attempts(flat: list[Any], split_dims: list[int | None] | None) -> list[tuple[list[Any], Any]]:
    """The exports tried, most general first: every dim of every tensor input dynamic
    (``Dim.AUTO``: export keeps symbolic what the code allows, and specialises the rest), then
    the split dim alone (micro-batches are smaller than the sample), then every size fixed.

    An input that is not split (``chunk_dims`` None) is dynamic too: a mask shared by the
    samples follows the sequence's length. A sample of one along the split dim would have export fix it (sizes 0 and 1 are
    specialised), so the dynamic exports trace it doubled, each input concatenated with itself
    along the split dim: the same values, a batch of two, which keeps the batch symbolic."""
    split = [split_dim(split_dims, i, v) for i, v in enumerate(flat)]
    single = any(d is not None and flat[i].shape[d] == 1 for i, d in enumerate(split))
    traced = [torch.cat([v, v], dim=d) if d is not None and single else v for v, d in zip(flat, split)]
    every = tuple({k: torch.export.Dim.AUTO for k in range(v.dim())} if isinstance(v, torch.Tensor) and v.dim()
                  else None for v in flat)
    batch = tuple({d: torch.export.Dim.AUTO} if d is not None else None for d in split)
    return [(traced, every), (traced, batch), (flat, None)]


def _body_name(model: nn.Module, name: str, taken: dict[str, Any]) -> str:
    """``submod_1``, unless the model itself has a top-level attribute of that name."""
    new = name
    while hasattr(model, new) or new in taken:
        new = f"_{new}"
    return new


def _clean_path(path: str, attr: Any) -> str:
    if isinstance(attr, str):  # owner of a parameter / buffer
        return attr.rpartition(".")[0]
    return module_path(path)


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
