"""runtime/_checkpoint.py: Checkpoint/Recompute reproduce dropout; is_checkpointing/is_recomputing."""

import pytest
import torch
from torch import nn

from fxpipe import GPipe, is_checkpointing, is_recomputing


def dropout_model():
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8))


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_dropout_bit_exact_between_checkpoint_modes(chunks):
    results = {}
    for mode in ["always", "except_last", "never"]:
        torch.manual_seed(0)
        model = dropout_model()
        pipe = GPipe(model, [2, 1, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
        torch.manual_seed(1234)
        x = torch.randn(9, 8)
        out = pipe(x)
        out.sum().backward()
        results[mode] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    ref_out, ref_grads = results["never"]
    for mode in ["always", "except_last"]:
        out, grads = results[mode]
        assert torch.equal(out, ref_out), mode
        for g, r in zip(grads, ref_grads):
            assert torch.equal(g, r), mode


class RNNDropout(nn.Module):
    """An RNN whose dropout between layers is drawn inside torch's kernel (no Dropout layer);
    ``export``: a loop over a Python int of a tensor makes fx fail, so torch.export captures it
    and the stage calls ``aten.lstm``/``aten.gru``/... directly."""

    def __init__(self, rnn, export):
        super().__init__()
        self.a, self.rnn, self.b, self.export = nn.Linear(8, 8), rnn(8, 8, num_layers=2, dropout=0.5,
                                                                     batch_first=True), nn.Linear(8, 8), export

    def forward(self, x):
        for _ in range(int(x.numel() > 0) if self.export else 1):
            x = self.a(x)
        return self.b(self.rnn(x)[0])


@pytest.mark.parametrize("export", [False, True], ids=["fx", "export"])
@pytest.mark.parametrize("rnn", [nn.LSTM, nn.GRU, nn.RNN], ids=lambda r: r.__name__)
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_rnn_dropout_is_recomputed_with_the_same_masks(rnn, export, mode):
    import copy
    import warnings

    import fxpipe
    from exact import assert_grads_equal

    torch.manual_seed(0)
    ref = RNNDropout(rnn, export)
    x = torch.randn(4, 5, 8)
    model = copy.deepcopy(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = fxpipe.pipeline(model, x, 3, chunks=2, checkpoint=mode, balance_by="params", progress=False,
                               devices=["cpu"] * 3)
    assert pipe.capture.method == ("export" if export else "fx")
    torch.manual_seed(1)
    out = pipe(x)
    out.pow(2).sum().backward()
    torch.manual_seed(1)  # eager, micro-batch by micro-batch: the pipeline's order of draws
    expected = torch.cat([ref(c) for c in x.chunk(2)])
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_grads_equal(model, ref, rtol=0, atol=0)


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.events = []

    def forward(self, x):
        self.events.append((is_checkpointing(), is_recomputing()))
        return torch.tanh(x)  # saves its result: backward needs the recomputation


def test_is_checkpointing_and_is_recomputing():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    # micro-batch 0 checkpointed then recomputed, micro-batch 1 plain.
    assert sorted(probe.events) == sorted([(True, False), (False, False), (False, True)])
    assert not is_checkpointing() and not is_recomputing()


def test_no_checkpointing_in_eval_or_no_grad():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    pipe.eval()
    pipe(torch.randn(4, 2))
    assert probe.events == [(False, False)] * 4


class Saves(nn.Module):
    """Counts its runs; ``save`` says whether it saves a tensor for backward."""

    def __init__(self, save):
        super().__init__()
        self.save, self.runs = save, 0

    def forward(self, x):
        self.runs += 1
        return torch.tanh(x) if self.save else x + 1.0


@pytest.mark.parametrize("save", [True, False])
def test_a_stage_that_saves_nothing_is_not_recomputed(save):
    probe = Saves(save)
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    pipe(torch.randn(4, 2)).sum().backward()
    assert probe.runs == (4 if save else 2)


@pytest.mark.parametrize("ahead", [None, True, False])
@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recompute_ahead_or_lazily_gives_the_same_results(monkeypatch, ahead, mode):
    """``PipelineRunner.recompute_ahead`` (True: the Recompute node of accelerator pipelines, run here on CPU)
    changes when the recomputation runs, never what it computes."""
    from fxpipe.runtime._checkpoint import Checkpointing
    from fxpipe.runtime._pipeline import PipelineRunner

    monkeypatch.setattr(PipelineRunner, "recompute_ahead", ahead)
    ahead_calls = []
    real = Checkpointing.recompute_ahead
    monkeypatch.setattr(Checkpointing, "recompute_ahead", lambda self: (ahead_calls.append(1), real(self))[1])
    results = {}
    for m in [mode, "never"]:
        torch.manual_seed(0)
        model = dropout_model()
        pipe = GPipe(model, [2, 1, 2], devices=["cpu"] * 3, chunks=3, checkpoint=m)
        torch.manual_seed(1)
        out = pipe(torch.randn(9, 8))
        out.sum().backward()
        results[m] = (out.detach(), [p.grad for p in model.parameters()])
    assert bool(ahead_calls) == bool(ahead)
    assert torch.equal(results[mode][0], results["never"][0])
    for g, r in zip(results[mode][1], results["never"][1]):
        assert torch.equal(g, r)


def test_rng_states_are_saved_only_for_partitions_that_may_draw(monkeypatch):
    from fxpipe.runtime import _checkpoint as checkpoint_mod

    calls = []
    real = checkpoint_mod.save_rng_states
    monkeypatch.setattr(checkpoint_mod, "save_rng_states", lambda device: (calls.append(device), real(device))[1])
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8))
    pipe = GPipe(model, [2, 3], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    pipe(torch.randn(4, 8)).sum().backward()
    assert len(calls) == 2  # the second partition, once per micro-batch


class ShiftsItsInput(nn.Module):
    def forward(self, x):
        return torch.tanh(x.add_(1.0))


def test_an_input_modified_in_place_is_refused_not_recomputed_wrong():
    from fxpipe.errors import CheckpointBackwardError

    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), ShiftsItsInput()), [1, 1], devices=["cpu"] * 2, chunks=2,
                 checkpoint="always")
    with pytest.raises(CheckpointBackwardError, match="partition 1 modified its input in place"):
        pipe(torch.randn(4, 2))
    pipe = GPipe(nn.Sequential(nn.Tanh(), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2, chunks=2,
                 checkpoint="always")
    x = torch.randn(4, 2, requires_grad=True)
    y = x * 1.0  # the pipeline's input, modified after its forward
    out = pipe(y)
    with torch.no_grad():
        y.mul_(2)
    with pytest.raises(CheckpointBackwardError, match="modified in place after its forward"):
        out.sum().backward()


class Flaky(nn.Module):
    """Saves one tensor more on every run: a forward whose operations change between runs."""

    def __init__(self):
        super().__init__()
        self.runs = 0

    def forward(self, x):
        self.runs += 1
        for _ in range(self.runs):
            x = torch.tanh(x)
        return x


def test_a_recomputation_that_differs_is_refused():
    from fxpipe.errors import CheckpointBackwardError

    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), Flaky()), [1, 1], devices=["cpu"] * 2, chunks=1, checkpoint="always")
    with pytest.raises(CheckpointBackwardError, match="saved 2 tensors for backward where its forward saved 1"):
        pipe(torch.randn(4, 2)).sum().backward()


def test_recompute_ahead_only_where_a_gradient_copy_comes_from_another_device():
    """The default policy: ahead overlaps the recomputation with the incoming gradient copy, so
    it is used only on an accelerator partition some later partition of which is elsewhere.
    Stages sharing one GPU recompute lazily (ahead cost them memory and gained no time)."""
    from fxpipe.runtime._pipeline import PipelineRunner

    def policy(*devices, setting=None):
        runner = PipelineRunner([nn.Identity()] * len(devices), [torch.device(d) for d in devices])
        runner.recompute_ahead = setting
        return runner._recompute_ahead()

    assert policy("cuda:0", "cuda:0", "cuda:1", "cuda:1") == [True, True, False, False]
    assert policy("cuda:0", "cuda:0", "cuda:0") == [False, False, False]
    assert policy("cpu", "cpu") == [False, False]
    assert policy("cpu", "cuda:0") == [False, False]
    assert policy("cuda:0", "cpu") == [True, False]
    assert policy("cpu", "cpu", setting=True) == [True, True]
    assert policy("cuda:0", "cuda:1", setting=False) == [False, False]


def bn_dropout_model():
    return nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.Dropout(0.3),
                         nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2))


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("between", ["eval", "freeze"])
def test_modes_changed_between_forward_and_backward_do_not_reach_the_recomputation(mode, between):
    """``model.eval()`` (BatchNorm in eval mode saved tensors of other shapes: the autograd engine
    crashed) or ``requires_grad_(False)`` between forward and backward: eager differentiates the
    graph its forward recorded, so the recomputation must run with the forward's flags."""
    import copy

    import fxpipe
    from exact import assert_grads_equal

    def switch(model):
        if between == "eval":
            model.eval()
        else:
            model[3].requires_grad_(False)

    torch.manual_seed(0)
    ref = bn_dropout_model()
    x = torch.randn(8, 8)
    model = copy.deepcopy(ref)
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, checkpoint=mode, balance_by="params", progress=False,
                           devices=["cpu"] * 3)
    torch.manual_seed(1)
    out = pipe(x)
    switch(model)
    out.sum().backward()
    torch.manual_seed(1)
    expected = torch.cat([ref(c) for c in x.chunk(2)])
    switch(ref)
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    assert_grads_equal(model, ref)
    assert [m.training for m in model.modules()] == [m.training for m in ref.modules()]
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in ref.parameters()]


def test_a_parameter_modified_between_forward_and_backward_is_refused():
    """Eager refuses it ("modified by an inplace operation"); a recomputation would silently use
    the new weights."""
    import fxpipe
    from fxpipe.errors import CheckpointBackwardError

    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(4, 4)
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, checkpoint="always", balance_by="params", progress=False,
                           devices=["cpu"] * 3)
    out = pipe(x)
    with torch.no_grad():
        model[2].weight.mul_(0.5)  # e.g. optimizer.step() before backward
    with pytest.raises(CheckpointBackwardError, match=r"parameter '2\.weight' of partition 1 was modified in place"):
        out.sum().backward()


def test_a_recomputation_saving_other_shapes_is_refused():
    """Same count of saved tensors, other shapes: refused, never handed to autograd."""
    from fxpipe.errors import CheckpointBackwardError

    class Grows(nn.Module):
        def __init__(self):
            super().__init__()
            self.runs = 0

        def forward(self, x):
            self.runs += 1
            return torch.tanh(torch.cat([x] * self.runs, 1)).sum(1, keepdim=True)

    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), Grows()), [1, 1], devices=["cpu"] * 2, chunks=1, checkpoint="always")
    with pytest.raises(CheckpointBackwardError, match="saved tensors of other shapes"):
        pipe(torch.randn(4, 2)).sum().backward()


class OwnGenerator(nn.Module):
    """Draws from a torch.Generator of its own, which the default RNG states do not cover."""

    def __init__(self, seed):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.g = torch.Generator().manual_seed(seed)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * torch.rand(x.shape, generator=self.g)


class OpaqueOwnGenerator(OwnGenerator):
    """The same, kept an opaque leaf: the generator is only a module attribute."""


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_a_stage_generator_draws_the_same_in_its_recomputation(mode):
    import copy

    import fxpipe
    from exact import assert_grads_equal

    torch.manual_seed(0)
    ref = nn.Sequential(OwnGenerator(5), OpaqueOwnGenerator(6), OwnGenerator(7), nn.Linear(8, 2))
    x = torch.randn(8, 8)
    model = copy.deepcopy(ref)
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, checkpoint=mode, balance_by="params", progress=False,
                           devices=["cpu"] * 3, leaf_modules=[OpaqueOwnGenerator])
    for a, b in zip(model[:3], ref[:3]):
        a.g.set_state(b.g.get_state())  # the build ran the sample: start both from the same states
    out = pipe(x)
    out.pow(2).sum().backward()
    expected = torch.cat([ref(c) for c in x.chunk(2)])  # one generator per stage: same order of draws
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert_grads_equal(model, ref, rtol=0, atol=0)
    for a, b in zip(model[:3], ref[:3]):  # drawn once per micro-batch, as eager drew
        assert torch.equal(a.g.get_state(), b.g.get_state())
