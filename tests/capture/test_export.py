"""export.export_graph on its own: the rebuilt graph's contract, and caches taken apart and rebuilt.

test_capture.py checks the export fallback through capture() on one model, and
test_capture_fallback.py runs cached models through whole pipelines. Here the rebuilt graph
is inspected node by node (flat named placeholders, a flat tuple output, every get_attr bound
to the model's own Parameter or buffer object, no dtype/device pins, module meta), run
against eager for in-place updates of buffers and inputs, and the transformers-cache output
is followed from the flat graph outputs back to a cache object.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.utils import _pytree as pytree

from fxpipe.capture._export import Exported, _Failure, export_graph
from fxpipe.capture._export_outputs import compose_out_spec, unsupported_output

cu = pytest.importorskip("transformers.cache_utils")


class Stateful(nn.Module):
    """Parameters, BatchNorm stats, a counter buffer and a plain tensor attribute; it updates
    its second input in place, takes a non-tensor, casts (which export pins with
    ``_assert_tensor_metadata``) and makes a tensor of the batch's size."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros(()))
        self.const = torch.linspace(0, 1, 4)  # neither parameter nor buffer: an export constant

    def forward(self, x, y, scale):
        x = x.to(torch.float64).to(torch.float32)  # export pins each .to's input dtype and device
        self.steps.add_(1)
        y.mul_(2)
        h = self.bn(F.relu(self.fc(x))) * scale + y + self.const
        return h, torch.ones(x.size(0), 4)


def _module(ex: Exported) -> fx.GraphModule:
    return fx.GraphModule(ex.table, ex.graph)


@pytest.fixture(scope="module")
def stateful() -> tuple[Stateful, Exported]:
    torch.manual_seed(0)
    model = Stateful().train()
    ex = export_graph(model, model, [torch.randn(6, 4), torch.randn(6, 4), 2.0], ["x", "y", "scale"])
    assert isinstance(ex, Exported), ex
    return model, ex


def test_placeholders_are_the_flat_inputs_by_name(stateful) -> None:
    _, ex = stateful
    # one per flat input, in order, named as given; the non-tensor is specialised: unused
    phs = [n for n in ex.graph.nodes if n.op == "placeholder"]
    assert [n.target for n in phs] == ["x", "y", "scale"]
    assert not phs[2].users


def test_output_is_one_flat_tuple(stateful) -> None:
    _, ex = stateful
    (out,) = [n for n in ex.graph.nodes if n.op == "output"]
    assert isinstance(out.args[0], tuple) and len(out.args[0]) == 2
    assert all(isinstance(v, fx.Node) for v in out.args[0])
    assert ex.leaf_specs == [None, None] and ex.leaves == []


def test_get_attr_nodes_are_the_models_own_objects(stateful) -> None:
    model, ex = stateful
    targets = {n.target for n in ex.graph.nodes if n.op == "get_attr"}
    assert targets == {"fc.weight", "fc.bias", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var",
                       "bn.num_batches_tracked", "steps", "const"}
    for t in targets - {"const"}:
        owner, _, name = t.rpartition(".")
        assert ex.table[t] is getattr(model.get_submodule(owner), name), t
    assert ex.table["const"].data_ptr() == model.const.data_ptr()  # the model's storage, not a copy
    gm = _module(ex)
    assert gm.get_parameter("fc.weight") is model.fc.weight  # training the graph trains the model


def test_pins_are_dropped_and_every_node_names_its_module(stateful) -> None:
    _, ex = stateful
    assert all(n.target is not torch.ops.aten._assert_tensor_metadata.default for n in ex.graph.nodes)
    assert all("fxpipe_module" in n.meta for n in ex.graph.nodes)
    by_target = {n.target: n.meta["fxpipe_module"] for n in ex.graph.nodes if n.op == "call_function"}
    assert by_target[torch.ops.aten.linear.default] == "fc"
    assert by_target[torch.ops.aten.batch_norm.default] == "bn"
    attrs = {n.target: n.meta["fxpipe_module"] for n in ex.graph.nodes if n.op == "get_attr"}
    assert attrs["bn.running_mean"] == "bn" and attrs["steps"] == ""


def test_rebuilt_graph_runs_like_eager_with_its_updates(stateful) -> None:
    model, ex = stateful
    gm = _module(ex)
    ref = copy.deepcopy(model)
    for batch in (6, 3):  # the batch dim is dynamic: a micro-batch runs on the same graph
        x, y = torch.randn(batch, 4), torch.randn(batch, 4)
        y_ref = y.clone()
        got = gm(x, y, 2.0)
        want = ref(x, y_ref, 2.0)
        assert isinstance(got, tuple) and len(got) == 2
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
        torch.testing.assert_close(y, y_ref)  # the input updated in place, as eager does
        for name, buf in ref.named_buffers():  # BatchNorm stats and the counter: the model's own
            torch.testing.assert_close(model.get_buffer(name), buf, msg=name)
    assert model.steps.item() == 2.0
    got[0].pow(2).sum().backward()
    want[0].pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


# -- transformers caches in the output -----------------------------------------------------
class Caching(nn.Module):
    """Fills a DynamicCache as HF decoder layers do and returns it beside the hidden state."""

    def __init__(self, layers: int = 2, d: int = 8) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))

    def forward(self, x):
        cache = cu.DynamicCache()
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).chunk(3, dim=-1)
            k, v = cache.update(k.unsqueeze(1), v.unsqueeze(1), i)
            x = x + (torch.softmax(q.unsqueeze(1) @ k.transpose(-1, -2), -1) @ v).squeeze(1)
        return x, cache  # a flat root's output: a flat tuple of leaves


def test_a_dynamic_cache_leaves_as_its_tensors_and_comes_back_as_a_cache() -> None:
    torch.manual_seed(0)
    model = Caching()
    x = torch.randn(3, 5, 8)
    ex = export_graph(model, model, [x], ["x"])
    assert isinstance(ex, Exported), ex
    eager = model(x)
    _, spec = pytree.tree_flatten(eager)  # the cache is not a pytree node: one leaf of the model's spec
    assert spec.num_leaves == 2 and ex.leaf_specs[0] is None and ex.leaf_specs[1] is not None
    out = fx.GraphModule(ex.table, ex.graph)(x)
    # the graph returns plain tensors: the hidden state and each layer's keys and values
    assert len(out) == 1 + 2 * 2 and all(isinstance(t, torch.Tensor) for t in out)
    full = compose_out_spec(spec, ex.leaf_specs)
    first, second = (pytree.tree_unflatten(list(out), full) for _ in range(2))
    cache = first[1]
    assert type(cache) is cu.DynamicCache and len(cache.layers) == 2
    torch.testing.assert_close(first[0], eager[0])
    for got, want in zip(cache.layers, eager[1].layers):
        assert type(got) is type(want)
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)
    assert cache.get_seq_length() == eager[1].get_seq_length()
    # each rebuild is a new object: nothing shared between the caches of two calls
    assert second[1] is not cache and second[1].layers[0] is not cache.layers[0]


def test_compose_out_spec_replaces_only_the_given_leaves() -> None:
    _, spec = pytree.tree_flatten({"a": 1, "b": (2, 3)})
    assert compose_out_spec(spec, [None, None, None]) is spec
    _, sub = pytree.tree_flatten([7, 8])
    new = compose_out_spec(spec, [None, sub, None])
    assert pytree.tree_unflatten([1, 7, 8, 3], new) == {"a": 1, "b": ([7, 8], 3)}


def test_outputs_that_cannot_be_returned_faithfully_are_named() -> None:
    class Holder:
        def __init__(self, t):
            self.inner = {"t": [t]}

    assert unsupported_output(torch.ones(2)) == "" and unsupported_output(3.0) == ""
    assert unsupported_output(None) == "" and unsupported_output("text") == ""
    assert "Holder holding tensors" in unsupported_output(Holder(torch.ones(2)))  # found two levels down
    sliding = cu.Cache(layers=[cu.DynamicSlidingWindowLayer(sliding_window=4)])
    sliding.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    why = unsupported_output(sliding)
    assert why.startswith("a transformers Cache whose layer 0 (DynamicSlidingWindowLayer)") and "holds tensors" in why

    class Odd(cu.Cache):  # a cache fxpipe does not know how to take apart
        def __init__(self) -> None:
            self.blob = 1

    assert unsupported_output(Odd()) == "a transformers Odd whose structure is unknown (no cache layers, no nested caches)"
    full = cu.DynamicCache()
    full.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    assert unsupported_output(full) == ""


def test_an_output_holding_tensors_fails_the_export_naming_it() -> None:
    class Holder:
        def __init__(self, t):
            self.t = t

    class Returns(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return (Holder(self.lin(x)),)

    model = Returns()
    got = export_graph(model, model, [torch.randn(2, 4)], ["x"])
    assert isinstance(got, _Failure) and "Holder holding tensors" in got.bad_output
