"""runtime/_randomness.py: which partitions may draw random numbers (when unsure: they may)."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpipe.runtime._randomness import may_draw_random, restored_rng_states, save_rng_states


class UsesRand(nn.Module):
    def forward(self, x):
        return x + torch.rand_like(x)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.lin(x)).sum(-1, keepdim=True) * x.shape[0]


class FunctionalDropout(nn.Module):
    def forward(self, x):
        return F.dropout(x, 0.1, self.training)


class NoisyMethod(nn.Module):
    def forward(self, x):
        return x.clone().bernoulli_(0.5)


class Opaque(nn.Module):
    """A leaf whose forward the graph does not show."""

    def forward(self, x):
        return x * 2


class Tracer(fx.Tracer):
    def is_leaf_module(self, m, qualname):
        return isinstance(m, Opaque) or super().is_leaf_module(m, qualname)


def traced(module):
    return fx.GraphModule(module, Tracer().trace(module))


def test_graphs_without_random_ops_draw_nothing():
    assert not may_draw_random(traced(Plain()))
    assert not may_draw_random(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.LayerNorm(4), nn.BatchNorm1d(4)))


@pytest.mark.parametrize("module", [UsesRand(), FunctionalDropout(), NoisyMethod()], ids=lambda m: type(m).__name__)
def test_random_ops_in_a_graph_are_found(module):
    assert may_draw_random(traced(module))


@pytest.mark.parametrize("module", [
    nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)),
    nn.Sequential(nn.Sequential(nn.RReLU())),
    nn.MultiheadAttention(4, 2),
    nn.Sequential(Opaque()),  # user code: unknown, so it may
    nn.LSTM(4, 4, num_layers=2, dropout=0.5),  # draws inside the RNN kernel
    nn.GRU(4, 4, num_layers=2, dropout=0.1),
    nn.RNN(4, 4, num_layers=2, dropout=0.1),
    nn.TransformerEncoderLayer(4, 2, dim_feedforward=8),
    nn.FractionalMaxPool2d(2, output_ratio=0.5),
], ids=["dropout", "nested-rrelu", "mha", "user-module", "lstm", "gru", "rnn", "transformer-layer",
        "fractional-max-pool"])
def test_modules_that_may_draw(module):
    assert may_draw_random(module)


def test_rnns_without_dropout_draw_nothing():
    assert not may_draw_random(nn.Sequential(nn.LSTM(4, 4, num_layers=2), nn.GRU(4, 4, dropout=0.0)))


def test_export_rnn_ops_may_draw():
    """torch.export graphs call the RNN kernels (which draw their dropout masks) as aten ops."""
    for op in (torch.ops.aten.lstm.input, torch.ops.aten.gru.data, torch.ops.aten.rnn_tanh.input,
               torch.ops.aten.rnn_relu.data):
        graph = fx.Graph()
        x = graph.placeholder("x")
        graph.output(graph.call_function(op, (x,)))
        assert may_draw_random(fx.GraphModule(nn.Module(), graph)), op


def test_an_opaque_leaf_in_a_graph_may_draw():
    gm = traced(nn.Sequential(nn.Linear(4, 4), Opaque()))
    assert any(n.op == "call_module" and n.target == "1" for n in gm.graph.nodes)
    assert may_draw_random(gm)


def test_a_plain_callable_may_draw():
    assert may_draw_random(lambda x: x)


def test_restored_rng_states_replay_and_leave_the_caller_alone():
    device = torch.device("cpu")
    states = save_rng_states(device)
    first = torch.rand(3)
    after = torch.get_rng_state()
    with restored_rng_states(device, states):
        again = torch.rand(3)
    assert torch.equal(first, again)
    assert torch.equal(torch.get_rng_state(), after)


def test_stage_generators_are_found_in_graph_constants_and_module_attributes():
    from fxpipe.runtime._randomness import stage_generators

    g, h = torch.Generator(), torch.Generator()

    class Uses(nn.Module):
        def forward(self, x):
            return x * torch.rand(x.shape, generator=g)

    class Keeps(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = h

    assert stage_generators(traced(Uses())) == (g,)
    assert stage_generators(nn.Sequential(Keeps())) == (h,)
    assert stage_generators(traced(Plain())) == ()
