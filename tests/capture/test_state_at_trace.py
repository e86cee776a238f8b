"""A forward that sets a number attribute while it runs (``self.calls += 1``, a warm-up step
counter) keeps Python state, which a traced graph neither updates nor reads again: every
value computed from it was baked at the build's value, and the counter stopped (a trial:
loss 0.3762 against eager's 0.1270 from the second call on). Refused, naming the attribute
(a buffer updated in place is the pipeline's per-micro-batch state). A model tensor read as a
number is kept live instead: the module reading it is kept opaque."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import TraceError


class Counted(nn.Module):
    """A call counter; ``uses``: the forward computes with it (else it is a tally for logging)."""

    def __init__(self, uses: bool = True) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.calls, self.uses = 0, uses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.a(x) * (self.calls % 2 + 1) if self.uses else self.a(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.counted, self.out = nn.Linear(8, 8), Counted(), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.counted(torch.tanh(self.inp(x))))


class RootCounted(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.counted.calls += 1
        return self.out(torch.tanh(self.inp(x)) * self.counted.calls)


class Tallied(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = Counted(uses=False)


@pytest.mark.parametrize("cls", [Net, Tallied])
def test_a_submodule_keeping_state_is_refused_naming_it(cls) -> None:
    """Kept opaque it would count once per micro-batch (and the build's check, seeing another
    value on a rerun, compares structure only): refused, a tally for logging too."""
    with pytest.raises(TraceError, match=r"sets 'counted.calls' while it runs.*register_buffer"):
        fxpipe.pipeline(cls(), torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)


def test_a_root_forward_keeping_state_is_refused_naming_it() -> None:
    with pytest.raises(TraceError, match=r"the traced forward sets 'counted.calls' while it runs"):
        fxpipe.pipeline(RootCounted(), torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)


class Tempered(nn.Module):
    """A temperature buffer read as a number: its value would be a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("temp", torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) / self.temp.item()


class WithTempered(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = Tempered()


class RootTempered(Tempered):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) * min(1.0, float(self.temp) / 10.0)  # a Python min of it: no graph holds it


@pytest.mark.parametrize("cls, method", [(WithTempered, "fx"), (Tempered, "export")])
def test_a_buffer_read_as_a_number_follows_its_updates(cls, method) -> None:
    """Updated in place or by load_state_dict after the build, the graph kept the build's value
    (a trial: loss 0.1149 against 0.3453)."""
    torch.manual_seed(0)
    model, x = cls(), torch.randn(8, 8)
    with fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False) as pipe:
        assert pipe.capture.method == method
        for value in (0.5, 4.0):
            model.load_state_dict({**model.state_dict(), ("counted.temp" if cls is WithTempered else "temp"):
                                   torch.tensor(value)})
            with torch.no_grad():
                torch.testing.assert_close(pipe(x), model(x))


def test_a_python_computation_on_a_buffers_number_in_the_root_is_refused() -> None:
    with pytest.raises(TraceError, match=r"min\(1.0, float\(self.temp\) / 10.0\)"):
        fxpipe.pipeline(RootTempered(), torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)


class Indexed(nn.Module):
    """Reads one element of a buffer as a number: ``self.state[0]`` is a view, not the buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("state", torch.tensor([0.5, 2.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.state[0].item()


class WithIndexed(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = Indexed()


def test_an_element_of_a_buffer_read_as_a_number_follows_its_updates() -> None:
    """The view was not watched: the graph kept 0.5 after the buffer became 3.0 (0.64 off)."""
    torch.manual_seed(0)
    model, x = WithIndexed(), torch.randn(8, 8)
    with fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False) as pipe:
        with torch.no_grad():
            model.counted.state[0] = 3.0
            torch.testing.assert_close(pipe(x), model(x))


class Normalizer(nn.Module):
    """An observation normaliser: math on its buffers alone, which torch.fx ran once at trace
    time and stored as a constant (`_tensor_constant0`) until buffers were traced as get_attr."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(8))
        self.register_buffer("var", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / (self.var + 1e-5).sqrt()


class Normalized(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = Normalizer()


def test_math_on_buffers_alone_follows_load_state_dict_and_updates_in_place() -> None:
    """A trial: 0.46 off after loading statistics (also FrozenBatchNorm2d, pruning masks)."""
    torch.manual_seed(0)
    model, x = Normalized(), torch.randn(8, 8)
    with fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False) as pipe:
        assert "counted" in pipe.capture.leaves  # kept opaque: it computes on its buffers each call
        model.load_state_dict({**model.state_dict(), "counted.mean": torch.full((8,), 0.5),
                               "counted.var": torch.full((8,), 9.0)})
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x))
            model.counted.var.mul_(4)
            torch.testing.assert_close(pipe(x), model(x))


class Calibrated(nn.Module):
    """A flag buffer compared with a number in the root forward (torch.fx froze the comparison's
    result at trace: 0.50 off once the loop set the flag, a trial)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)
        self.register_buffer("calibrated", torch.zeros(()))
        self.register_buffer("center", torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        use = (self.calibrated == 0).to(h.dtype)
        return self.b(torch.relu(h - (1 - use) * self.center))


def test_a_buffer_compared_with_a_number_follows_its_updates() -> None:
    torch.manual_seed(0)
    model, x = Calibrated().eval(), torch.randn(8, 8)
    with fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False) as pipe:
        torch.testing.assert_close(pipe(x), model(x))
        model.calibrated.fill_(1.0)
        torch.testing.assert_close(pipe(x), model(x))


class ScaledInAList(nn.Module):
    """A parameter reached through a plain Python list: torch.fx computed ``exp`` on it once (a
    constant holding its autograd graph: the second backward failed), torch.export lifted a
    detached copy (its gradient silently None)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.log_scale = nn.Parameter(torch.zeros(8))
        self.scales = [self.log_scale]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.scales[0].exp())


class WithScaled(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = ScaledInAList()


def test_a_parameter_reached_through_a_list_trains_in_a_submodule_and_is_refused_in_the_root() -> None:
    from fxpipe.capture._trace_time import ComputedAtTrace

    torch.manual_seed(0)
    model, x = WithScaled(), torch.randn(8, 8)
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert "counted" in pipe.capture.leaves  # kept opaque: it reads the live parameter each call
    for _ in range(2):
        pipe(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        torch.testing.assert_close(model.counted.log_scale.grad, ref.counted.log_scale.grad)
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.sub_(0.5 * p.grad)
                q.sub_(0.5 * q.grad)
                p.grad = q.grad = None
    with pytest.raises(ComputedAtTrace, match=r"reaches 'log_scale' other than as a module attribute"):
        fxpipe.pipeline(ScaledInAList(), x, 2, chunks=2, devices=["cpu"] * 2, progress=False)


class StoresAux(nn.Module):
    """A mixture-of-experts layer storing its load-balancing loss on itself, as many do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.how = nn.Linear(8, 8), how
        self.aux_loss = torch.zeros(())
        self.features: list = []
        self.stats = {"calls": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.how == "aux":
            self.aux_loss = h.softmax(-1).mean(0).pow(2).sum()
        elif self.how == "features":
            self.features.append(h)
        else:
            self.stats["calls"] += 1
        return h


class WithAux(Net):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.counted = StoresAux(how)


@pytest.mark.parametrize("how, label", [("aux", "counted.aux_loss"), ("features", "counted.features"),
                                        ("counts", "counted.stats")])
def test_a_value_stored_on_the_module_by_forward_is_refused_naming_it(how, label) -> None:
    """After pipe(x) the attribute held the build's detached value (aux 2.238 against eager's
    2.214, the router's gradient 7.5e-2 off, a trial), or a list of stale features, or a count
    the build had bumped to 3 that no call updated."""
    model = WithAux(how)
    before = copy.deepcopy(model.counted.stats), list(model.counted.features)
    with pytest.raises(TraceError, match=rf"the traced forward sets '{label}' while it runs"):
        fxpipe.pipeline(model, torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert (model.counted.stats, model.counted.features) == before


class SamplesSeen(nn.Module):
    """Counts the samples it has seen in a buffer: ``self.n += x.shape[0]``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("n", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += x.shape[0]
        return self.a(x)


class WithSamplesSeen(Net):
    def __init__(self) -> None:
        super().__init__()
        self.counted = SamplesSeen()


def test_a_buffer_counting_samples_builds_and_counts_them() -> None:
    """Refused with a RegionError about grad mode (false, a trial): torch.fx replaced the
    buffer with the traced sum. Kept opaque, it counts each micro-batch's samples."""
    torch.manual_seed(0)
    model, x = WithSamplesSeen(), torch.randn(8, 8)
    with fxpipe.pipeline(model, x, 2, chunks=4, devices=["cpu"] * 2, progress=False) as pipe:
        assert "counted" in pipe.capture.leaves and int(model.counted.n) == 0
        pipe(x)
        pipe(x[:6])
        assert int(model.counted.n) == 14
