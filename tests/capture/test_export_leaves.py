"""capture/_export_leaves.py: under torch.export, each call of a kept-opaque module is one
``call_module`` node fed the call's own arguments, whichever way it was called."""

import torch
from torch import nn

from fxpipe.capture._export_leaves import leaf_paths
from fxpipe.capture._tracing import capture


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x, shift=None):
        y = torch.tanh(self.inner(x)) * self.scale
        return (y + shift, y.sum(-1)) if shift is not None else (y, y.sum(-1))


class Root(nn.Module):
    """fx cannot trace ``len`` of a tensor in the root: captured by torch.export."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = Block()
        self.post = nn.Linear(4, 4)

    def forward(self, x):
        if len(x) > 0:
            x = self.pre(x)
        a, s1 = self.block(x, x)              # the same module called twice, on other inputs
        b, s2 = self.block(a, x)              # (export wants one call signature per module)
        return self.post(b) + (s1 + s2).unsqueeze(-1)


def test_leaf_paths_keep_the_outermost_leaves_only():
    model = Root()
    assert leaf_paths(model, [Block, "block.inner"]) == ["block"]
    assert leaf_paths(model, [nn.Linear]) == ["pre", "block.inner", "post"]
    assert leaf_paths(model, []) == []


def test_each_call_of_a_leaf_is_one_node_and_the_graph_is_the_model():
    torch.manual_seed(0)
    model = Root()
    x = torch.randn(6, 4)
    c = capture(model, (x,), {}, leaf_modules=["block"])
    assert c.method == "export" and c.leaves == ["block"]
    gm = c.graph_module
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "block"]
    assert len(calls) == 2
    inside = [n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).startswith("block.")]
    assert not inside, "the leaf's parameters are read by its own forward, not by the graph"
    assert gm.get_submodule("block") is model.block  # the model's own module runs
    y = torch.randn(3, 4)
    torch.testing.assert_close(gm(y)[0], model(y))
    # and its backward reaches the leaf's parameters through the module call
    gm(y)[0].sum().backward()
    assert model.block.scale.grad is not None and model.block.inner.weight.grad is not None


def test_without_leaves_export_traces_through_the_block():
    model = Root()
    c = capture(model, (torch.randn(6, 4),), {})
    assert c.method == "export"
    assert not [n for n in c.graph_module.graph.nodes if n.op == "call_module"]
