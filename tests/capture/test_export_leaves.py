"""export_leaves on its own: which modules stay opaque, and each call of one becoming one node.

test_export_hops.py checks leaf_modules on the export path through pipelines. Here the
export graph is read directly after the collapse: one ``call_module`` node per call (a leaf
called twice is two nodes, the second fed the first's output), the call's own arguments
(constants and keywords included), each output form (one tensor, a tuple, a dict, an input
returned as is), nothing of a leaf's insides left behind, a nested leaf inside a traced
module, and the refusal of a call whose insides the rest of the graph reads.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx, nn

from fxpipe.capture._export import Exported, _Failure, export_graph
from fxpipe.capture._export_leaves import _call_key, leaf_paths, output_leaf
from fxpipe.errors import TraceError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, scale=2.0, mask=None):
        return {"y": self.b(torch.tanh(self.a(x))) * scale + mask, "z": x.sum(-1)}


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.post = Inner(), nn.Linear(8, 8)

    def forward(self, x):
        h = self.inner(x)
        return self.post(h) * 0.5, h


class Pass(nn.Module):
    """Returns its input as is beside a new value."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x, self.lin(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.mid = nn.Linear(8, 8), nn.Linear(8, 8)
        self.block, self.outer, self.passthru = Block(), Outer(), Pass()

    def forward(self, x):  # flat in, flat tuple out: the model is its own flat root
        r = self.block(self.pre(x), 3.0, mask=x)
        r2 = self.block(self.mid(r["y"]), 0.5, mask=x)
        o, h = self.outer(r2["y"])
        same, p = self.passthru(o + h)
        return (same * p + r["z"][:, None] + r2["z"][:, None],)


# -- which modules ---------------------------------------------------------------------------
def test_leaf_paths_are_the_outermost_by_type_or_name() -> None:
    model = Net()
    assert leaf_paths(model, [Block, "passthru"]) == ["block", "passthru"]
    # a leaf inside a leaf is moot: only the outer one is kept
    assert leaf_paths(model, [Outer, Inner]) == ["outer"]
    assert leaf_paths(model, ["outer.inner", "outer"]) == ["outer"]
    assert leaf_paths(model, [Inner]) == ["outer.inner"]
    assert leaf_paths(model, [nn.Linear]) == ["pre", "mid", "block.a", "block.b", "outer.inner.lin",
                                               "outer.post", "passthru.lin"]
    assert leaf_paths(model, [Net]) == [] and leaf_paths(model, []) == []  # never the root itself


def test_call_keys_follow_exports_naming() -> None:
    assert _call_key("L__self___block", "block") == "block"
    assert _call_key("L__self___block@1", "block") == "block@1"
    assert _call_key("weird@x", "block") == "block"


def test_output_leaf_is_exports_flattening() -> None:
    assert output_leaf({"y": 1, "z": (2, 3)}, 2) == 3


# -- the collapse ------------------------------------------------------------------------------
def _export(model: nn.Module, leaves: list[str]) -> Exported:
    ex = export_graph(model, model, [torch.randn(6, 8)], ["x"], leaves=leaves)
    assert isinstance(ex, Exported), ex
    return ex


@pytest.fixture(scope="module")
def collapsed() -> tuple[Net, Exported]:
    torch.manual_seed(0)
    model = Net()
    return model, _export(model, leaf_paths(model, [Block, Outer, Inner, "passthru"]))


def _calls(ex: Exported) -> list[fx.Node]:
    return [n for n in ex.graph.nodes if n.op == "call_module"]


def test_each_call_is_one_call_module_node_with_its_own_arguments(collapsed) -> None:
    _, ex = collapsed
    assert ex.leaves == ["block", "outer", "passthru"]
    calls = _calls(ex)
    assert [n.target for n in calls] == ["block", "block", "outer", "passthru"]
    first, second = calls[:2]
    x = next(n for n in ex.graph.nodes if n.op == "placeholder")
    assert first.args[1] == 3.0 and second.args[1] == 0.5  # constants stay arguments
    assert first.kwargs == {"mask": x} and second.kwargs == {"mask": x}  # keywords stay keywords
    # the second call reads the first call's output through the rebuilt node
    feeding = second.args[0].args[0]
    assert feeding.target is output_leaf and feeding.args == (first, 0)
    assert all(n.meta["fxpipe_module"] == n.target for n in calls)


def test_nothing_of_a_leaf_is_left_in_the_graph(collapsed) -> None:
    _, ex = collapsed
    inside = ("block.", "outer.", "passthru.")
    for n in ex.graph.nodes:
        if n.op == "get_attr":
            assert not str(n.target).startswith(inside), n.target  # its parameters go with the call
        elif n.op == "call_function" and n.target not in (operator.getitem, output_leaf):
            assert not str(n.meta["fxpipe_module"]).startswith(inside) \
                and n.meta["fxpipe_module"] not in ("block", "outer", "passthru"), n.format_node()
    assert set(ex.table) >= {"block", "outer", "passthru"} and ex.table["block"] is collapsed[0].block


def test_each_output_form_is_read_back(collapsed) -> None:
    _, ex = collapsed
    users = {c.target + str(i): sorted({(u.target.__name__, u.args[1]) for u in c.users})
             for i, c in enumerate(_calls(ex))}
    # a dict: output_leaf in export's flattening order; a tuple of tensors: getitem
    assert users["block0"] == [("output_leaf", 0), ("output_leaf", 1)]
    assert users["outer2"] == [("getitem", 0), ("getitem", 1)]
    # an input returned as is is read from where it came from: only the new value is taken
    assert users["passthru3"] == [("getitem", 1)]
    # what reads a call's outputs belongs to the leaf, not to a module inside it
    for call in _calls(ex):
        assert {u.meta["fxpipe_module"] for u in call.users} == {call.target}


def test_collapsed_graph_runs_each_leaf_once_per_call_like_eager(collapsed) -> None:
    model, ex = collapsed
    ref = copy.deepcopy(model)
    counts: dict[str, int] = {}
    hooks = [getattr(model, name).register_forward_pre_hook(
        lambda m, a, name=name: counts.__setitem__(name, counts.get(name, 0) + 1))
        for name in ("block", "outer", "passthru")]
    try:
        x = torch.randn(6, 8)
        (got,) = fx.GraphModule(ex.table, ex.graph)(x)
    finally:
        for h in hooks:
            h.remove()
    assert counts == {"block": 2, "outer": 1, "passthru": 1}
    (want,) = ref(x)
    torch.testing.assert_close(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_a_nested_leaf_alone_is_collapsed_inside_its_traced_parent() -> None:
    model = Net()
    ex = _export(model, ["outer.inner"])
    assert ex.leaves == ["outer.inner"]
    (call,) = _calls(ex)
    assert call.target == "outer.inner"
    # outer itself is traced: its post layer is plain ops reading the inner call
    post = [n for n in ex.graph.nodes if n.meta.get("fxpipe_module") == "outer.post" and n.op == "call_function"]
    assert post and any(call in n.all_input_nodes for n in post)
    assert not any(str(n.target).startswith("outer.inner.") for n in ex.graph.nodes if n.op == "get_attr")


def test_a_leaf_never_called_is_not_reported() -> None:
    class Spare(Net):
        def __init__(self) -> None:
            super().__init__()
            self.spare = Pass()

    ex = _export(Spare(), ["spare", "passthru"])
    assert ex.leaves == ["passthru"]


class Leaky(nn.Module):
    """Keeps a value of its call on itself, which the caller then reads."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        self.last = h
        return h * 2


class ReadsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.leaky = Leaky()

    def forward(self, x):
        y = self.leaky(x)
        return (y + self.leaky.last,)


@pytest.mark.filterwarnings("ignore:The tensor attribute self.leaky.last was assigned during export")
def test_a_call_whose_insides_are_read_elsewhere_is_refused_naming_it() -> None:
    model = ReadsInside()
    got = export_graph(model, model, [torch.randn(6, 8)], ["x"], leaves=["leaky"])
    assert isinstance(got, _Failure) and isinstance(got.refusal, TraceError)
    assert got.refusal.module == "leaky"
    msg = str(got.refusal)
    assert "cannot keep 'leaky' opaque (it is in leaf_modules" in msg
    assert "a value inside the call that it does not return" in msg
    assert "keep a module that encloses it opaque instead (leaf_modules=[...]); or drop 'leaky' from " \
        "leaf_modules" in msg
