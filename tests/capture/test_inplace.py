"""In-place ops and buffers updated in forward (issue #8, items 2 and 3).

In-place ops on activations must be exact at every cut: fxpipe runs them on a copy, so the
graph's edges carry the dependency. Buffers updated in forward are applied once per
micro-batch, in order, never twice by a recomputation, and building a pipeline leaves the
model's state untouched. What cannot be made exact is refused with a MutationError.
"""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from exact import assert_exact, assert_grads_equal, weighted_loss
from fxpipe.errors import MicroBatchError, MutationError

MODES = ["always", "except_last", "never"]


class InplaceChain(nn.Module):
    """The issue's model: in-place ops on values that cross every possible cut."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.l2 = nn.Linear(8, 8)
        self.l3 = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu_(self.l1(x))
        g = self.l2(h)
        g.add_(h)
        g.mul_(0.5)
        return self.l3(F.relu(g, inplace=True))


class InplaceModules(nn.Module):
    """nn.ReLU(inplace=True), ``+=`` on activations, ``x.add_()`` and ``setitem``."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Linear(8, 8)
        self.conv3 = nn.Linear(8, 8)

    def forward(self, x):
        identity = self.act(self.conv1(x))
        out = self.conv2(identity)
        out += identity
        out = self.act(out)
        z = torch.zeros_like(out)
        z[:, :4] = out[:, :4] * 2
        y = self.conv3(z)
        y.add_(out)
        return y, out


def _compute_nodes(pipe):
    return [n.name for n in pipe.capture.graph_module.graph.nodes
            if n.op in ("call_module", "call_function", "call_method")]


@pytest.mark.parametrize("model_cls", [InplaceChain, InplaceModules])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2])
def test_inplace_ops_every_balance(model_cls, mode, chunks):
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(4, 8)
    for n_stages in (2, 3, 4, 5):
        assert_exact(model, (x,), n_stages, chunks=chunks, checkpoint=mode, balance_by="params")


@pytest.mark.parametrize("model_cls", [InplaceChain, InplaceModules])
def test_inplace_ops_every_cut(model_cls):
    """Every legal pair of cut points, every checkpoint mode."""
    torch.manual_seed(0)
    model = model_cls()
    x = torch.randn(4, 8)
    probe = fxpipe.pipeline(copy.deepcopy(model), x, 1, devices=["cpu"])
    nodes = _compute_nodes(probe)
    for a, b in itertools.combinations(range(1, len(nodes)), 2):
        stage_of = {n: (0 if i < a else 1 if i < b else 2) for i, n in enumerate(nodes)}
        keep = probe.capture.graph_module.graph
        if any(stage_of.get(n.name) != stage_of.get(o) for n in keep.nodes for o in n.meta.get("fxpipe_keep_with", ())):
            continue  # a cut inside an op and its copy: refused, tested below
        for mode in MODES:
            assert_exact(model, (x,), 3, chunks=2, checkpoint=mode, split_points=None,
                         plan=_plan_with(probe, stage_of, 3))


def _plan_with(probe, stage_of, n_stages):
    from fxpipe.plan._value import Plan
    from fxpipe.plan._make import opgraph_for

    graph = opgraph_for(probe.capture, (torch.randn(4, 8),), {}, "params")
    assignment = {}
    order = [n.name for n in probe.capture.graph_module.graph.nodes]
    last = 0
    for name in order:
        if name in stage_of:
            last = stage_of[name]
        assignment[name] = last
    for n in probe.capture.graph_module.graph.nodes:
        if n.op == "placeholder":
            assignment[n.name] = 0
        elif n.op == "output":
            assignment[n.name] = n_stages - 1
        elif n.op == "get_attr":
            users = sorted(n.users, key=lambda u: order.index(u.name))
            assignment[n.name] = stage_of.get(users[0].name, 0) if users else 0
    return Plan.from_assignment(graph, assignment, balance_by="params", cost_attr="params")


def test_a_plan_separating_an_op_from_its_copy_is_refused():
    model = InplaceChain()
    x = torch.randn(4, 8)
    probe = fxpipe.pipeline(copy.deepcopy(model), x, 1, devices=["cpu"])
    nodes = _compute_nodes(probe)
    copy_at = next(i for i, n in enumerate(nodes) if n.endswith("_copy"))
    stage_of = {n: (0 if i <= copy_at else 1) for i, n in enumerate(nodes)}
    with pytest.raises(MutationError, match="must share a stage"):
        fxpipe.pipeline(copy.deepcopy(model), x, 2, devices=["cpu"] * 2, plan=_plan_with(probe, stage_of, 2))


def test_mutating_an_input_is_refused_naming_the_line():
    class Mutates(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            x.mul_(2)  # the line the error must name
            return self.l(x)

    with pytest.raises(MutationError, match=r"(?s)line \d+.*x\.mul_\(2\).*model input.*clone"):
        fxpipe.pipeline(Mutates(), torch.randn(4, 8), 1, devices=["cpu"])


def test_mutating_through_a_view_updates_its_base_exactly():
    class ViewMutation(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)
            self.m = nn.Linear(8, 8)

        def forward(self, x):
            h = self.l(x)
            v = h.view(-1)
            v.add_(1)  # also changes h, which is read below
            return self.m(h * 2)

    torch.manual_seed(0)
    for mode in MODES:
        for n in (2, 3):
            assert_exact(ViewMutation(), (torch.randn(4, 8),), n, chunks=2, checkpoint=mode, balance_by="params")


def test_mutating_a_view_while_another_view_is_read_later_is_refused():
    class TwoViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)

        def forward(self, x):
            h = self.l(x)
            v = h.view(-1)
            w = h[0]
            v.add_(1)  # changes w too, which is read below
            return w * 2 + h

    with pytest.raises(MutationError, match="shares its memory"):
        fxpipe.pipeline(TwoViews(), torch.randn(4, 8), 1, devices=["cpu"])


# -- buffers updated in forward ---------------------------------------------------------------
class Tracker(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        self.count += 1
        self.avg.mul_(0.9).add_(x.mean(0).detach() * 0.1)
        return self.lin(x)


class WithTracker(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.t = Tracker()
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.tanh(self.b(self.t(self.a(x)))))


def _row_loss(out):
    """A loss that decomposes over samples: micro-batch losses add up to the batch's."""
    return (out * torch.linspace(-1, 1, out.shape[-1])).sum()


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_state(model, expected):
    got = model.state_dict()
    assert got.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(got[k], expected[k], msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_buffers_updated_once_per_micro_batch_never_by_recomputation(mode, chunks):
    torch.manual_seed(0)
    model = WithTracker()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    before = _state(model)
    rng = torch.get_rng_state()
    with pytest.warns(UserWarning, match=r"'t' updates buffer 't\.(count|avg)'"):
        pipe = fxpipe.pipeline(model, x, 3, chunks=chunks, checkpoint=mode, devices=["cpu"] * 3,
                               balance_by="params")
    _assert_state(model, before)  # building touched nothing
    assert torch.equal(torch.get_rng_state(), rng)
    for _ in range(2):  # two training steps, forward and backward
        _row_loss(pipe(x)).backward()
        # eager reference: the model run on each micro-batch in order
        for part in x.chunk(chunks):
            _row_loss(reference(part)).backward()
    _assert_state(model, _state(reference))
    assert int(model.t.count) == 2 * chunks
    assert_grads_equal(model, reference)


class ReassignedAverage(nn.Module):
    """Replaces its buffer in forward (not in place): torch.fx cannot trace that, so it is kept
    opaque; its writes were not seen, recomputation applied them again (0.18 off) and
    data-parallel replicas drifted apart (a trial)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(8))

    def forward(self, x):
        self.avg = 0.9 * self.avg + 0.1 * x.detach().mean(0)
        return x - self.avg


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_replaced_in_forward_is_updated_once_per_micro_batch(mode):
    from fxpipe.build import BuildOptions, capture_and_check

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), ReassignedAverage(), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    checked = capture_and_check(model, (x,), {}, BuildOptions(2, balance_by="params", chunks=2))
    assert checked.prepared.mutations.state_names() == ["1.avg"]  # what replicas refuse (distributed/_mesh)
    before = _state(model)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, checkpoint=mode, devices=["cpu"] * 2, balance_by="params",
                           progress=False)
    _assert_state(model, before)  # the build put the buffer back
    for _ in range(2):
        _row_loss(pipe(x)).backward()
        for part in x.chunk(2):
            _row_loss(reference(part)).backward()
    _assert_state(model, _state(reference))
    assert_grads_equal(model, reference)


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_running_stats_not_updated_again_by_recomputation(mode):
    """Without deferred_batch_norm, each micro-batch updates the statistics once, like the
    model run on the micro-batches in order; recomputation no longer adds updates."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                          nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    x = torch.randn(12, 8)
    pipe = fxpipe.pipeline(model, x, 3, chunks=3, checkpoint=mode, devices=["cpu"] * 3, balance_by="params")
    _row_loss(pipe(x)).backward()
    for part in x.chunk(3):
        _row_loss(reference(part)).backward()
    _assert_state(model, _state(reference))
    assert_grads_equal(model, reference)


def test_update_in_the_root_forward_is_refused_naming_buffer_and_line():
    class RootCounter(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(8, 8)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls += 1
            return self.l(x)

    model = RootCounter()
    with pytest.raises(MutationError, match=r"(?s)'calls'.*self\.calls \+= 1.*submodule"):
        fxpipe.pipeline(model, torch.randn(4, 8), 1, devices=["cpu"])
    assert float(model.calls) == 0.0


def test_building_leaves_modes_grads_and_rng_as_they_were():
    torch.manual_seed(0)
    model = WithTracker()
    model.b.eval()  # a mixed-mode model
    weighted_loss(model(torch.randn(4, 8))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = _state(model)
    modes = [m.training for m in model.modules()]
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2)  # profiles: runs fwd+bwd
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(torch.get_rng_state(), rng)
    _assert_state(model, state)
    for p, g in zip(model.parameters(), grads):
        assert torch.equal(p.grad, g)


class _SliceWrites(nn.Module):
    """``h[:, 1:4] += y`` and ``h[:, 0] = v`` in a traced forward: torch.fx records them as
    getitem, the in-place op on the view, and ``operator.setitem`` (its own proxies refuse
    item assignment, which used to send such models to torch.export, or to a TraceError
    when export could not take the model either)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        h, o = self.a(x), self.b(x)
        h[:, 1:4] += o[:, :3]
        h[:, 0] = o[:, 5] * 2
        return self.c(h) + h


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("n_stages", [2, 3])
def test_slice_writes_are_traced_by_fx_and_exact(checkpoint, n_stages):
    torch.manual_seed(0)
    pipe = assert_exact(_SliceWrites(), (torch.randn(4, 6),), n_stages, chunks=2, checkpoint=checkpoint,
                        balance_by="params")
    assert pipe.capture.method == "fx"


class MaxNormEmbedding(nn.Module):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up, in place in its weight, at
    every call; ``functional`` does the same through F.embedding in traced code."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.functional = functional
        self.emb = nn.Embedding(32, 16, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(3)  # most rows longer than max_norm: the renorm changes them
        self.l1, self.l2 = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, ids):
        if self.functional:
            h = F.embedding(ids, self.emb.weight, max_norm=1.0)
        else:
            h = self.emb(ids)
        return self.l2(torch.tanh(self.l1(h)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("functional", [False, True])
def test_embedding_with_max_norm_is_exact_when_checkpointed(mode, functional):
    """Issue #18: the recomputation ran on a snapshot of the renormalised weight that did not
    require grad, saved nothing for backward, and was refused as 'control flow depends on
    something that changed'. Micro-batches sharing rows renormalise them once, as eager does."""
    torch.manual_seed(0)
    model = MaxNormEmbedding(functional)
    ids = torch.randint(0, 32, (6, 5))
    ids[3:, 0] = ids[0, 0]  # a row both micro-batches look up
    ref, piped = copy.deepcopy(model), copy.deepcopy(model)
    pipe = fxpipe.pipeline(piped, ids, 2, chunks=2, checkpoint=mode, devices=["cpu"] * 2, balance_by="params")
    if functional:  # F.embedding(max_norm=) on a weight: the build's sample runs renormalised the rows it read
        piped.load_state_dict(model.state_dict())
    else:  # nn.Embedding(max_norm=): the build puts the weight back (25 rows of a trial's changed by up to 3.4)
        torch.testing.assert_close(piped.emb.weight, model.emb.weight, rtol=0, atol=0)
    got, expected = pipe(ids), ref(ids)
    torch.testing.assert_close(got, expected)
    weighted_loss(got).backward()
    weighted_loss(expected).backward()
    for (name, p), q in zip(piped.named_parameters(), ref.parameters()):
        scale = float(q.grad.abs().max())
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")
    # renormalised alike (a row renormalised twice may move by an ulp: its norm lands on max_norm)
    torch.testing.assert_close(piped.emb.weight, ref.emb.weight)


class _NormAfterInplace(nn.Module):
    """An in-place add and BatchNorm's running statistics (a write its aten schema does not
    declare), or neither."""

    def __init__(self, writes: bool):
        super().__init__()
        self.a, self.b, self.writes = nn.Linear(8, 8), nn.Linear(8, 8), writes
        self.norm = nn.BatchNorm1d(8) if writes else nn.LayerNorm(8)

    def forward(self, x):
        h = self.a(x)
        if self.writes:
            h.add_(1.0)
        return self.b(torch.relu(self.norm(h)))


@pytest.mark.parametrize("writes", [False, True])
def test_an_export_graph_that_writes_nothing_is_not_run_to_find_writes(writes, monkeypatch):
    import fxpipe.capture._mutation as mutation
    import fxpipe.capture._tracing as tracing
    from fxpipe.errors import TraceError

    monkeypatch.setattr(tracing, "trace_fx", lambda *a, **k: tracing._Failure("", TraceError("export it")))
    runs = []
    real = mutation._Watcher.run
    monkeypatch.setattr(mutation._Watcher, "run", lambda self, *a, **k: runs.append(1) or real(self, *a, **k))
    torch.manual_seed(0)
    model = _NormAfterInplace(writes).train()
    # BatchNorm in training mixes the batch: one micro-batch there
    pipe = assert_exact(model, (torch.randn(8, 8),), 2, chunks=1 if writes else 2, balance_by="params",
                        progress=False)
    assert pipe.capture.method == "export"
    assert mutation.writes_nothing(pipe.capture.graph_module) is not writes and len(runs) == int(writes)
    if writes:  # the writes found: BatchNorm's statistics updated by the pipeline's call as by eager's
        assert int(pipe.module.norm.num_batches_tracked) == 1  # the build left it at 0: one call since


class TrainingAverage(nn.Module):
    """Updates its average in training mode only."""

    def __init__(self):
        super().__init__()
        self.register_buffer("avg", torch.zeros(8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(0.1 * x.mean(0))
                self.steps.add_(1)
        return x - self.avg


@pytest.mark.parametrize("mode", MODES)
def test_a_write_in_training_only_is_found_when_built_in_eval(mode):
    # a trial: kept opaque by a hook, built in eval for a first validation, then trained: the
    # search ran in eval, found no write, and recomputation applied the update again (4 for 2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), TrainingAverage(), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    model[1].register_forward_hook(lambda m, i, o: None)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    model.eval()
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, checkpoint=mode, devices=["cpu"] * 2, balance_by="params",
                           progress=False)
    model.train()
    _row_loss(pipe(x)).backward()
    for part in x.chunk(2):
        _row_loss(reference(part)).backward()
    assert int(model[1].steps) == 2
    _assert_state(model, _state(reference))
    assert_grads_equal(model, reference)



class GrownCache(nn.Module):
    """A rotary-style table made anew, larger, when a longer sequence comes: a cache, not state."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.cos(torch.arange(4.0)[:, None] * torch.ones(8)), persistent=False)

    def forward(self, x):
        if x.shape[1] > self.table.shape[0]:
            self.table = torch.cos(torch.arange(float(x.shape[1]))[:, None] * torch.ones(x.shape[-1]))
        return x * self.table[:x.shape[1]]


def test_a_cache_buffer_made_anew_at_another_size_is_not_state():
    # a regression trial: counted as a state write, the build ended in a bare size mismatch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), GrownCache(), nn.Linear(8, 8)).eval()
    pipe = fxpipe.pipeline(model, torch.randn(4, 6, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params",
                           progress=False, leaf_modules=[GrownCache])
    x = torch.randn(4, 10, 8)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


class CalibratesOnce(nn.Module):
    """Creates a submodule and a buffer at its first call in training mode (a calibration)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(8))
        self.calibrated, self.extra = False, None

    def forward(self, x):
        if self.training and not self.calibrated:
            self.calibrated = True
            self.extra = nn.Linear(8, 8)
            self.register_buffer("seen", torch.zeros(8))
        if self.extra is not None:
            x = self.extra(x)
        return x * self.scale


def test_building_leaves_what_each_module_registers_as_it_was():
    # a regression trial: the build's training-mode runs created the submodule, and putting the
    # attribute back lost it (a bare AttributeError; an IndexError before today)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), CalibratesOnce(), nn.Linear(8, 2)).eval()
    x = torch.randn(8, 8)
    before = model(x)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params", progress=False,
                           leaf_modules=[CalibratesOnce])
    assert model[1].extra is None and not model[1].calibrated
    assert [n for n, _ in model.named_buffers()] == ["1.scale"]
    torch.testing.assert_close(model(x), before)
    torch.testing.assert_close(pipe(x), before)


class ClampedInForward(nn.Linear):
    """A weight constraint applied in place at every forward, kept opaque."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


@pytest.mark.parametrize("balance_by", ["params", "time"])
def test_a_weight_written_in_place_by_an_opaque_forward_is_refused_naming_it(balance_by):
    """Kept opaque, the write ran again at the next micro-batch's forward before the earlier
    micro-batch's backward, and the build failed with autograd's bare 'modified by an inplace
    operation' from inside the checks (a review). Refused naming the weight and the module; the
    model is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), ClampedInForward(32, 32), nn.Tanh(), nn.Linear(32, 8))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MutationError, match=r"module `2` \(ClampedInForward\) writes the parameter `2.weight`"
                                            r".*outside forward.*register_parametrization"):
        fxpipe.pipeline(model, torch.randn(8, 16), 2, chunks=2, devices=["cpu"] * 2,
                        leaf_modules=[ClampedInForward], balance_by=balance_by, progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


class TiedMaxNormLM(nn.Module):
    """nn.Embedding(max_norm=) whose weight the LM head reads too: eager renormalises the batch's
    rows once, before the head; per micro-batch, the first micro-batch's head would read rows the
    later ones renormalise after it."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(40, 16, max_norm=1.0)
        with torch.no_grad():
            self.embed.weight.mul_(3)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 40, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.body(self.embed(ids)))


def test_a_renormalised_embedding_tied_to_the_head_is_refused():
    """The whole-sample run renormalised the sample's rows and the micro-batch runs found them so;
    reruns then differed by 1e-7 (renormalised again) and the check compared structure only. It
    built, and trained 0.515 off (magnitude 3.1) under 1F1B, silently (a trial)."""
    torch.manual_seed(0)
    model = TiedMaxNormLM()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(MicroBatchError, match="'head'"):
        fxpipe.pipeline(model, torch.randint(0, 40, (8, 5)), 1, chunks=4, devices=["cpu"], progress=False)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
