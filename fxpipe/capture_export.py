"""torch.export fallback of :func:`fxpipe.capture.capture`.

Used when torch.fx cannot trace a model (HF transformers models, root-level tricks fx
does not support). The exported aten graph is rebuilt so that it satisfies the same
contract as the fx path: flat placeholders, flat tuple output, get_attr nodes bound to the
model's own Parameters/buffers, ``fxpipe_module`` and ``stack_trace`` meta on every node.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

__all__ = ["export_graph"]


@dataclass
class _Failure:
    """Why one strategy failed: the module being traced and the exception."""

    module: str
    error: BaseException
    auto: list[str] = field(default_factory=list)  # submodules made opaque before failing


def export_graph(model: nn.Module, root: nn.Module, flat: list[Any],
                 names: list[str]) -> tuple[fx.Graph, dict[str, Any]] | _Failure:
    """Export the flat root and rebuild a contract-conforming graph.

    Why not ``ep.module()`` or ``torch.export.unflatten``: both return modules with their
    own attribute hierarchy and pytree codegen; rebuilding the graph from
    ``ep.graph_signature`` gives flat placeholders, a flat output, get_attr nodes that
    resolve to the model's own Parameters (so training the pipeline trains the model), and
    explicit ``copy_`` nodes for buffer mutations (BatchNorm running stats).
    """
    from torch.export.graph_signature import InputKind, OutputKind

    dyn = tuple({0: torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() else None for v in flat)
    ep, err = None, None
    quiet = logging.getLogger("torch")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # export logs/prints failed graphs at length
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            for shapes in (dyn, None):  # dynamic batch first: micro-batches are smaller than the sample
                try:
                    ep = torch.export.export(root, tuple(flat), dynamic_shapes=shapes, strict=False)
                    break
                except Exception as e:  # noqa: BLE001
                    err = err or e
    finally:
        quiet.setLevel(level)
    if ep is None:
        return _Failure("", err)

    sig, src = ep.graph_signature, ep.graph_module.graph
    g = fx.Graph()
    phs = [g.placeholder(n) for n in names]
    tensor_ph = [p for p, v in zip(phs, flat) if isinstance(v, torch.Tensor)]
    user = [s for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    user_ph = phs if len(user) == len(phs) else tensor_ph
    env: dict[fx.Node, Any] = {}
    attrs: dict[str, fx.Node] = {}
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
                    g.call_function(torch.ops.aten.copy_.default, (attrs[spec.target], val))
                elif spec.kind == OutputKind.USER_INPUT_MUTATION:
                    tgt = next(env[p] for s, p in zip(sig.input_specs, src_ph) if s.arg.name == spec.target)
                    g.call_function(torch.ops.aten.copy_.default, (tgt, val))
                else:
                    outs.append(val)
            g.output(tuple(outs))
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue  # pins dtype/device of the sample; stages may run elsewhere
        env[node] = g.node_copy(node, lambda n: env[n])
    for n in g.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        path = list(stack.values())[-1][0] if stack else ""
        n.meta["fxpipe_module"] = _clean_path(path, n.target if n.op == "get_attr" else None)
    return g, _attr_table(model, g, ep.constants)


def _clean_path(path: str, attr: Any) -> str:
    if isinstance(attr, str):  # owner of a parameter / buffer
        return attr.rpartition(".")[0]
    if "nn_module_stack" in path:  # export's placeholder for nodes without a module
        return ""
    path = re.sub(r"^L\['self'\]\.?|^L__self___?", "", path)
    return re.sub(r"\.?_modules\['([^']*)'\]", r".\1", path).strip(".")


def _attr_table(model: nn.Module, graph: fx.Graph, ep_consts: dict[str, Any]) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for n in graph.nodes:
        if n.op == "get_attr":
            try:
                table[n.target] = model.get_parameter(n.target)
            except AttributeError:
                try:
                    table[n.target] = model.get_buffer(n.target)
                except AttributeError:
                    table[n.target] = ep_consts[n.target]
    return table
