"""capture/_export.py: the rebuilt torch.export graph keeps the fx path's contract.

Flat placeholders with the forward's argument names, a flat tuple output, ``get_attr`` nodes
that are the model's own Parameter objects (so training the pipeline trains the model), a
buffer updated in forward updated in the model's buffer, and a transformers cache in the
output taken apart into its tensors and rebuilt around them.
"""

import torch
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.capture._tracing import capture


class Root(nn.Module):
    """fx cannot trace ``len`` of a tensor in the root: captured by torch.export."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x, mask, *, bias):
        if len(x) > 0:
            self.calls.add_(1)
        h = self.norm(self.lin(x)) * mask + bias
        return {"out": h, "pair": (h.sum(), h.mean(0))}


def _capture():
    torch.manual_seed(0)
    model = Root().train()
    x, mask, bias = torch.randn(6, 4), torch.ones(6, 4), torch.zeros(4)
    return model, capture(model, (x, mask), {"bias": bias}), (x, mask, bias)


def test_placeholders_are_flat_and_named_after_the_forward():
    _, c, _ = _capture()
    assert c.method == "export"
    assert [n.name for n in c.graph_module.graph.nodes if n.op == "placeholder"] == ["x", "mask", "bias"]


def test_the_output_is_a_flat_tuple_and_the_spec_rebuilds_the_structure():
    model, c, (x, mask, bias) = _capture()
    out = c.graph_module(x, mask, bias)
    assert isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
    rebuilt = c.unflatten_output(list(out))
    assert set(rebuilt) == {"out", "pair"} and isinstance(rebuilt["pair"], tuple)


def test_parameters_and_buffers_are_the_models_own_objects():
    model, c, _ = _capture()
    gm = c.graph_module
    attrs = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert {"lin.weight", "lin.bias", "norm.weight", "norm.bias"} <= attrs
    for name in ("lin.weight", "norm.bias"):
        assert gm.get_parameter(name) is model.get_parameter(name)
    assert gm.get_buffer("calls") is model.calls


def test_buffer_updates_in_forward_land_in_the_models_buffers():
    """torch 2.13's export keeps an in-place update of a buffer in place (``add_`` on the
    ``get_attr``); a functionalised export returns it as a mutation, rebuilt as ``copy_`` into
    the buffer. Either way running the graph updates the model's own buffers, as eager does."""
    model, c, (x, mask, bias) = _capture()
    calls, mean = model.calls.clone(), model.norm.running_mean.clone()
    c.graph_module(x, mask, bias)
    assert model.calls == calls + 1
    assert not torch.equal(model.norm.running_mean, mean)
    writes = [n for n in c.graph_module.graph.nodes if n.op == "call_function"
              and (n.meta.get("fxpipe_buffer_update") or str(n.target).startswith("aten.add_"))]
    assert writes, "the update is a node of the graph, not lost"


def test_a_transformers_cache_is_taken_apart_and_rebuilt():
    import transformers as T

    torch.manual_seed(0)
    config = T.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16)
    model = T.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 50, (2, 6))
    c = capture(model, (), {"input_ids": ids, "use_cache": True})
    out = c.graph_module(ids, True)  # use_cache: a specialised value, its placeholder unused
    assert all(isinstance(t, torch.Tensor) for t in out)  # keys and values are plain outputs
    rebuilt = c.unflatten_output(list(out))
    eager = model(input_ids=ids, use_cache=True)
    cache, want = rebuilt.past_key_values, eager.past_key_values
    assert type(cache) is type(want)
    got_leaves = [t for t in pytree.tree_leaves([(layer.keys, layer.values) for layer in cache.layers])]
    want_leaves = [t for t in pytree.tree_leaves([(layer.keys, layer.values) for layer in want.layers])]
    assert len(got_leaves) == 2 * config.n_layer
    for a, b in zip(got_leaves, want_leaves):
        torch.testing.assert_close(a, b)
