"""Typed random DAG models for the pipeline-vs-eager sweep (tests/test_pipeline_random.py).

A model is a static :class:`Spec`: a list of nodes, each reading earlier values through one
op. Values are typed, so a node reads only what it can use:

    f   float activation (B, D)            i   int64 indices (B, D), from argsort
    j   int64 indices (B,), from argmax    m   bool mask (B, D)
    n0  Python int x.shape[0] (the batch)  n1  Python int x.size(1)
    c   a container returned by an opaque leaf module (``Producer``): a transformers
        ``ModelOutput``, an unregistered dataclass, a namedtuple, a dict or a ``split`` tuple

Besides out-of-place float ops, nodes mutate activations in place: ``+=``, ``add_``,
``mul_``, ``relu_`` chains (``torch.relu_``, ``.relu_()``, ``F.relu(inplace=True)``,
``nn.ReLU(inplace=True)``), setitem on a fresh tensor, in-place ops through a view whose
base is read later, and ``x[:, 1:4] += y``. The generator only mutates what eager autograd
allows (a value no backward node has saved, never a model input, never a tensor held inside
a container), so eager runs and the pipeline must agree with it. Every value nobody reads is
an output (no dead code; a leaf's container too, returned whole), so every op matters for
the result; integers, masks and containers are often read once more by a last node, so
that they travel far (through portals).

fx cannot trace setitem (``x[:, 1:4] += y`` ends in one): models using it are captured by
torch.export (aten graphs, where ``x[...] = y`` is a slice and ``copy_``), so both capture
paths are swept.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

D = 6

#: op -> (input types, output type). ``*`` marks an op that mutates its first input in place
#: and whose value is that (mutated) input.
OPS: dict[str, tuple[tuple[str, ...], str]] = {
    # out of place, float
    "linear": (("f",), "f"),          # act(Linear(sum of 1-3 inputs))
    "add": (("f", "f"), "f"),         # 2-3 inputs
    "cat": (("f", "f"), "f"),         # Linear(k*D, D)(cat(2-3 inputs))
    "mul": (("f", "f"), "f"),
    "tanh": (("f",), "f"),
    "scale": (("f",), "f"),
    "sub_mean": (("f",), "f"),
    # in place
    "iadd": (("f", "f"), "*"),        # x += o, on a local name (every name of x sees it) or rebinding them
    "add_": (("f", "f"), "*"),        # x.add_(o)
    "mul_": (("f",), "*"),            # x.mul_(c)
    "relu_": (("f",), "*"),           # torch.relu_ / .relu_() / F.relu(inplace) / nn.ReLU(inplace)
    "view_": (("f", "f"), "*"),       # through a view of x; x (the base) is what later nodes read
    "slice_iadd": (("f", "f"), "*"),  # x[:, 1:4] += o[:, :3] (torch.export captures it: slice, add_, copy_)
    "setitem": (("f", "f"), "f"),     # z = zeros_like(a); z[:, :3] = b[:, 3:] * 2 (torch.export captures it)
    # integers, masks, Python ints
    "argsort": (("f",), "i"),
    "gather": (("f", "i"), "f"),
    "argmax": (("f",), "j"),
    "lookup": (("j",), "f"),          # index_select(table, 0, idx)
    "mask": (("f",), "m"),
    "masked_fill": (("f", "m"), "f"),
    "where": (("m", "f", "f"), "f"),
    "size0": (("f",), "n0"),
    "size1": (("f",), "n1"),
    "use_n0": (("f", "n0"), "f"),     # y.reshape(n, -1) * 0.5
    "use_n1": (("f", "n1"), "f"),     # y / n
    # containers from leaf modules
    "leaf": (("f",), "c"),
    "unpack": (("c",), "f"),
}
ACTS = ("relu", "tanh", "gelu", "none")
KINDS = ("model_output", "dataclass", "namedtuple", "dict", "split")
RELU_FORMS = ("torch", "method", "functional", "module")
VIEW_FORMS = ("slice", "narrow", "view")

INPLACE = {name for name, (_, out) in OPS.items() if out == "*"}
DISCRETE = {"argsort", "gather", "argmax", "lookup", "mask", "masked_fill", "where", "size0", "size1",
            "use_n0", "use_n1"}
CONSUMERS = {"gather", "lookup", "masked_fill", "where", "use_n0", "use_n1", "unpack"}
BASIC = {"linear", "add", "cat", "mul", "tanh", "scale", "sub_mean"}
FEATURES = {
    "basic": BASIC,
    "inplace": BASIC | INPLACE | {"setitem"},
    "discrete": BASIC | DISCRETE,
    "containers": BASIC | {"leaf", "unpack"},
    "all": set(OPS),
    "fx": set(OPS) - {"setitem", "slice_iadd"},  # fx cannot trace setitem: those go through torch.export
}


@dataclasses.dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[int, ...]
    arg: Any = None  # the activation, constant, variant or container kind, per op


@dataclasses.dataclass(frozen=True)
class Spec:
    n_inputs: int                 # value ids 0 .. n_inputs-1 are the model's inputs
    nodes: tuple[Node, ...]       # node i has value id n_inputs + i
    outputs: tuple[int, ...]
    out_kind: str                 # 'tensor' | 'tuple' | 'dict' | 'nested'
    dropout: float = 0.0          # p of a Dropout after every 'linear' and 'cat' (compare modes, not eager)

    def roots(self) -> list[int]:
        """Per value id the id of the tensor object it is (in-place ops alias their input)."""
        roots = list(range(self.n_inputs))
        for node in self.nodes:
            roots.append(roots[node.inputs[0]] if OPS[node.op][1] == "*" else len(roots))
        return roots


def pack_outputs(outs: list[Any], kind: str) -> Any:
    """The model's output structure: 'tensor', 'tuple', 'dict' or 'nested' (a dict holding a list)."""
    if kind == "tensor":
        return outs[0]
    if kind == "tuple":
        return tuple(outs)
    if kind == "dict":
        return {f"o{k}": v for k, v in enumerate(outs)}
    return {"first": outs[0], "rest": outs[1:]}


# -- leaf modules returning containers ------------------------------------------------------
@dataclasses.dataclass
class Plain:  # deliberately not registered with pytree
    hidden: torch.Tensor
    aux: torch.Tensor
    scale: float = 2.0


class Pair(NamedTuple):
    hidden: torch.Tensor
    gate: torch.Tensor


class Producer(nn.Module):
    """Kept opaque (``leaf_modules=[Producer]``); returns its result inside a container."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.lin(x))
        if self.kind == "model_output":
            from transformers.modeling_outputs import BaseModelOutput

            return BaseModelOutput(last_hidden_state=h, hidden_states=(x * 0.5, h * x))
        if self.kind == "dataclass":
            return Plain(h, torch.sigmoid(x))
        if self.kind == "namedtuple":
            return Pair(h, torch.sigmoid(x))
        if self.kind == "dict":
            return {"a": h, "b": x * 2.0}
        return h.split(2, dim=1)  # three (B, 2) views of h


def unpack(p: Any, kind: str, sel: int) -> torch.Tensor:
    """A float (B, D) value from a container: sel 0 reads one field, sel 1 combines fields."""
    if kind == "model_output":
        return p.last_hidden_state if sel == 0 else p.hidden_states[0] + p.hidden_states[1] * p.last_hidden_state
    if kind == "dataclass":
        return p.hidden if sel == 0 else p.hidden * p.scale + p.aux
    if kind == "namedtuple":
        return p.gate if sel == 0 else p.hidden * p.gate
    if kind == "dict":
        return p["a"] if sel == 0 else p["a"] - p["b"]
    return torch.cat([p[2], p[0], p[1]], 1) if sel == 0 else torch.cat(p, 1) * 2.0


# -- the model ------------------------------------------------------------------------------
class DagModel(nn.Module):
    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.roots = spec.roots()
        layers: dict[str, nn.Module] = {}
        tables = {}
        for i, node in enumerate(spec.nodes):
            if node.op == "linear":
                layers[f"n{i}"] = nn.Linear(D, D)
                if spec.dropout:
                    layers[f"d{i}"] = nn.Dropout(spec.dropout)
            elif node.op == "cat":
                layers[f"n{i}"] = nn.Linear(len(node.inputs) * D, D)
                if spec.dropout:
                    layers[f"d{i}"] = nn.Dropout(spec.dropout)
            elif node.op == "leaf":
                layers[f"n{i}"] = Producer(node.arg)
            elif node.op == "relu_" and node.arg[0] == "module":
                layers[f"n{i}"] = nn.ReLU(inplace=True)
            elif node.op == "lookup":
                tables[f"n{i}"] = nn.Parameter(torch.randn(D, D) * 0.5)
        self.layers = nn.ModuleDict(layers)
        self.tables = nn.ParameterDict(tables)

    def forward(self, *inputs: torch.Tensor) -> Any:
        spec = self.spec
        vals: list[Any] = list(inputs)
        for i, node in enumerate(spec.nodes):
            vals.append(self._node(i, node, [vals[j] for j in node.inputs], vals))
        outs = [vals[j] for j in spec.outputs]
        return pack_outputs(outs, spec.out_kind)

    def _rebind(self, vals: list[Any], target: int, value: Any) -> Any:
        """Every name of the mutated tensor now reads the in-place op's result."""
        root = self.roots[target]
        for k in range(len(vals)):
            if self.roots[k] == root:
                vals[k] = value
        return value

    def _node(self, i: int, node: Node, xs: list[Any], vals: list[Any]) -> Any:
        op, arg = node.op, node.arg
        layer = self.layers[f"n{i}"] if f"n{i}" in self.layers else None
        if op == "linear":
            h = xs[0]
            for x in xs[1:]:
                h = h + x
            y = layer(h)
            if f"d{i}" in self.layers:
                y = self.layers[f"d{i}"](y)
            return {"relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu}.get(arg, lambda t: t)(y)
        if op == "add":
            y = xs[0]
            for x in xs[1:]:
                y = y + x
            return y
        if op == "cat":
            y = layer(torch.cat(xs, dim=-1))
            return self.layers[f"d{i}"](y) if f"d{i}" in self.layers else y
        if op == "mul":
            return xs[0] * xs[1]
        if op == "tanh":
            return torch.tanh(xs[0])
        if op == "scale":
            return xs[0] * arg
        if op == "sub_mean":
            return xs[0] - xs[0].mean(-1, keepdim=True)
        # -- in place: the value of the node is the mutated input ---------------------------
        target = node.inputs[0]
        if op == "iadd":
            x = xs[0]
            x += xs[1]  # in place: xs[0], and every other name of it, sees the change
            return self._rebind(vals, target, x) if arg == "rebind" else xs[0]
        if op == "add_":
            out = xs[0].add_(xs[1])
            return self._rebind(vals, target, out) if arg == "rebind" else xs[0]
        if op == "mul_":
            const, mode = arg
            out = xs[0].mul_(const)
            return self._rebind(vals, target, out) if mode == "rebind" else xs[0]
        if op == "relu_":
            form, mode = arg
            if form == "torch":
                out = torch.relu_(xs[0])
            elif form == "method":
                out = xs[0].relu_()
            elif form == "functional":
                out = F.relu(xs[0], inplace=True)
            else:
                out = layer(xs[0])
            return self._rebind(vals, target, out) if mode == "rebind" else xs[0]
        if op == "view_":
            x, o = xs
            if arg == "slice":
                x[:, :3].add_(o[:, :3])
            elif arg == "narrow":
                x.narrow(1, 2, 3).mul_(-0.5)
            else:  # view
                x.view(-1, 2, 3)[:, 1].add_(o[:, 3:])
            return x  # the base, read by later nodes
        if op == "slice_iadd":
            x, o = xs
            x[:, 1:4] += o[:, :3]  # getitem, in-place add on the view, setitem back
            return x
        if op == "setitem":
            z = torch.zeros_like(xs[0])
            z[:, :3] = xs[1][:, 3:] * 2.0
            return z
        # -- integers, masks, Python ints -----------------------------------------------
        if op == "argsort":
            return xs[0].argsort(-1, descending=bool(arg))
        if op == "gather":
            return torch.gather(xs[0], 1, xs[1])
        if op == "argmax":
            return xs[0].argmax(-1)
        if op == "lookup":
            return torch.index_select(self.tables[f"n{i}"], 0, xs[0])
        if op == "mask":
            return xs[0] > arg
        if op == "masked_fill":
            return xs[0].masked_fill(xs[1], 0.0)
        if op == "where":
            return torch.where(xs[0], xs[1], xs[2])
        if op == "size0":
            return xs[0].shape[0]
        if op == "size1":
            return xs[0].size(1)
        if op == "use_n0":
            return xs[0].reshape(xs[1], -1) * 0.5
        if op == "use_n1":
            return xs[0] / xs[1]
        # -- containers -------------------------------------------------------------------
        if op == "leaf":
            return layer(xs[0])
        if op == "unpack":
            return unpack(xs[0], spec_kind(self.spec, node.inputs[0]), arg)
        raise AssertionError(op)


def spec_kind(spec: Spec, value: int) -> str:
    """The container kind of value id ``value`` (made by a 'leaf' node)."""
    return spec.nodes[value - spec.n_inputs].arg


# -- eager-autograd bookkeeping for the generator --------------------------------------------
# A value whose content a backward node saved cannot be mutated afterwards (eager backward
# fails), so the generator does not.
def _saves(node: Node) -> list[int]:
    """Value ids whose current content a backward node saves when ``node`` runs."""
    op = node.op
    if op == "linear" and len(node.inputs) == 1:
        return [node.inputs[0]]  # F.linear saves its input; a sum of inputs is a new tensor
    if op == "mul":
        return list(node.inputs)
    if op in ("gather", "leaf"):
        return [node.inputs[0]]
    return []


def _saves_output(node: Node) -> bool:
    return (node.op == "linear" and node.arg in ("relu", "tanh")) or node.op in ("tanh", "relu_")


@st.composite
def specs(draw, features: str = "all", max_nodes: int = 9, dropout: float = 0.0,
          exact_discrete: bool = False, exclude: tuple[str, ...] = ()) -> Spec:
    """Random typed specs using the ops of ``FEATURES[features]`` but those in ``exclude``.

    ``exact_discrete``: indices and masks are computed from the model inputs only. Under
    autocast, values computed in bfloat16 differ by rounding between a micro-batch and the
    whole batch, which flips argmax and comparisons; the inputs stay float32 and exact.
    """
    allowed = FEATURES[features] - set(exclude)
    n_inputs = draw(st.integers(1, 2))
    n = draw(st.integers(2, max_nodes))
    types = ["f"] * n_inputs
    roots = list(range(n_inputs))
    saved = [False] * n_inputs
    mutable = [False] * n_inputs  # model inputs are never mutated (fxpipe refuses that)
    nodes: list[Node] = []

    def pick(ids: list[int], label: str) -> int:
        # The latest such value (a chain) or anything earlier (a long skip: a portal).
        return draw(st.one_of(st.just(ids[-1]), st.sampled_from(ids)), label=label)

    for _ in range(n):
        avail = {t: [v for v, ty in enumerate(types) if ty == t] for t in ("f", "i", "j", "m", "n0", "n1", "c")}
        targets = [v for v in avail["f"] if mutable[roots[v]] and not saved[roots[v]]]
        # Two-operand in-place ops read another tensor than the one they change.
        paired = [v for v in targets if any(roots[u] != roots[v] for u in avail["f"])]
        ok = []
        for op in sorted(allowed):
            ins, _ = OPS[op]
            if any(not avail[t] for t in ins):
                continue
            if op in INPLACE and not (paired if len(ins) == 2 else targets):
                continue
            ok.append(op)
        # Readers of integers, masks and containers come half the time when there is one to read.
        readers = [op for op in ok if op in CONSUMERS]
        if readers and draw(st.booleans(), label="read one"):
            op = draw(st.sampled_from(readers), label="op")
        else:
            op = draw(st.sampled_from(ok), label="op")
        ins, out = OPS[op]
        arg: Any = None
        if op in INPLACE:
            first = pick(paired if len(ins) == 2 else targets, "target")
            rest = [pick([v for v in avail["f"] if roots[v] != roots[first]], "other")] if len(ins) == 2 else []
            inputs = (first, *rest)
            if op in ("add_", "iadd"):
                arg = draw(st.sampled_from(["keep", "rebind"]))
            elif op == "mul_":
                arg = (draw(st.sampled_from([0.5, -2.0])), draw(st.sampled_from(["keep", "rebind"])))
            elif op == "relu_":
                arg = (draw(st.sampled_from(RELU_FORMS)), draw(st.sampled_from(["keep", "rebind"])))
            elif op == "view_":
                arg = draw(st.sampled_from(VIEW_FORMS))
        else:
            if op in ("linear", "add", "cat"):  # 1-3 (linear) or 2-3 float inputs
                kinds = ("f",) * draw(st.integers(1 if op == "linear" else 2, 3))
            else:
                kinds = ins
            if op in ("argsort", "argmax", "mask") and exact_discrete:
                inputs = (pick(list(range(n_inputs)), "in0"),)  # float32 model inputs
            else:
                inputs = tuple(pick(avail[t], f"in{q}") for q, t in enumerate(kinds))
            if op == "linear":
                arg = draw(st.sampled_from(ACTS))
            elif op == "scale":
                arg = draw(st.sampled_from([0.5, -1.5, 2.0]))
            elif op == "argsort":
                arg = draw(st.booleans())
            elif op == "mask":
                arg = draw(st.sampled_from([0.0, 0.3]))
            elif op == "leaf":
                arg = draw(st.sampled_from(KINDS))
            elif op == "unpack":
                arg = draw(st.integers(0, 1))
        node = Node(op, inputs, arg)
        for v in _saves(node):
            saved[roots[v]] = True
        nodes.append(node)
        if out == "*":  # an alias: saved and mutable are kept per root
            types.append("f")
            roots.append(roots[inputs[0]])
            saved.append(False)
            mutable.append(False)
            if _saves_output(node):
                saved[roots[inputs[0]]] = True
        else:
            types.append(out)
            roots.append(len(roots))
            saved.append(_saves_output(node))
            # A field read straight out of a container is shared with it: not mutated.
            mutable.append(out == "f" and not (op == "unpack" and arg == 0))
    # Late readers: integers, masks, Python ints and containers read once more at the very end,
    # so that they travel far (through portals) when the model is cut into several stages.
    late = {"c": "unpack", "i": "gather", "j": "lookup", "m": "masked_fill", "n0": "use_n0", "n1": "use_n1"}
    for v in range(n_inputs, len(types)):
        if types[v] in late and late[types[v]] in allowed and draw(st.booleans(), label="late read"):
            op = late[types[v]]
            last_f = max(u for u in range(len(types)) if types[u] == "f")
            inputs = {"unpack": (v,), "lookup": (v,)}.get(op, (last_f, v))
            nodes.append(Node(op, inputs, 1 if op == "unpack" else None))
            types.append("f")
    # Every value nobody reads is an output, so no op is dead code (a value mutated later is
    # read by the op). The batch size n0 cannot be an output (it differs per micro-batch):
    # one nobody reads does not count as reading its input.
    read = {j for node in nodes for j in node.inputs}
    unread_n0 = {n_inputs + i for i, node in enumerate(nodes) if node.op == "size0" and n_inputs + i not in read}
    read = {j for i, node in enumerate(nodes) if n_inputs + i not in unread_n0 for j in node.inputs}
    sinks = [v for v in range(n_inputs, len(types)) if v not in read and types[v] != "n0"]
    if not sinks:  # only batch sizes were made: give the model something to compute
        nodes.append(Node("tanh", (n_inputs - 1,)))
        types.append("f")
        sinks = [len(types) - 1]
    outputs = tuple(draw(st.permutations(sinks)))
    kinds = ["tuple", "dict", "nested"] + (["tensor"] if len(outputs) == 1 and types[outputs[0]] == "f" else [])
    out_kind = draw(st.sampled_from(kinds))
    if out_kind == "nested" and len(outputs) == 1:
        out_kind = "tuple"
    return Spec(n_inputs, tuple(nodes), outputs, out_kind, dropout)


def make(spec: Spec, batch: int, seed: int) -> tuple[DagModel, tuple]:
    torch.manual_seed(seed)
    model = DagModel(spec)
    g = torch.Generator().manual_seed(seed + 1)
    args = tuple(torch.randn(batch, D, generator=g) for _ in range(spec.n_inputs))
    return model, args
