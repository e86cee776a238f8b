"""A torch.export capture keeps each size symbolic where the model's code allows (issue #31):
one graph for every length, checked at each call against what export assumed (equal lengths,
a size of at least 2), and a size that regroups the batch's rows with another size keeps that
other size fixed, so that the build's micro-batch check stays proven at every size it admits."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.capture._shape_guards import ShapeGuards
from fxpipe.errors import InputMismatchError


class _Pairs(nn.Module):
    """Rows of token pairs: ``reshape(b * t // 2, 2 * d)``. At an even length each pair lies in
    one sample; at an odd one, pairs cross samples and a micro-batch regroups them (silently
    other values), so the length may not vary. The dim check keeps torch.fx out."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("expected 3 dims")
        b, t, d = x.shape
        return self.b(self.a(x).reshape(b * t // 2, 2 * d)).reshape(b, -1)


class _Tokens(nn.Module):
    """Per-token work and a mask of the same length: the length stays symbolic, equal in both."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("expected 3 dims")
        return self.b(torch.relu(self.a(x)) * mask.unsqueeze(-1))


def test_a_size_that_regroups_the_batchs_rows_is_kept_fixed():
    torch.manual_seed(0)
    model = _Pairs()
    pipe = fxpipe.pipeline(model, torch.randn(4, 8, 4), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert pipe.capture.method == "export" and pipe.capture.fixed == {0: (None, 8, 4)}
    x = torch.randn(6, 8, 4)  # the batch still varies
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(InputMismatchError, match="dim 1 of x is 7, but it was fixed at 8.*regroups the batch's rows"):
        pipe(torch.randn(4, 7, 4))


def test_lengths_vary_and_the_guards_name_what_breaks_them():
    torch.manual_seed(0)
    model = _Tokens()
    pipe = fxpipe.pipeline(model, (torch.randn(4, 8, 4), torch.ones(4, 8)), 2, chunks=2, devices=["cpu"] * 2,
                           progress=False)
    assert pipe.capture.method == "export" and pipe.capture.fixed == {0: (None, None, 4)}  # the width: Linear's
    for b, t in ((4, 3), (2, 17), (3, 8)):
        x, mask = torch.randn(b, t, 4), (torch.rand(b, t) > 0.3).float()
        out = pipe(x, mask)
        torch.testing.assert_close(out, model(x, mask))
    with pytest.raises(InputMismatchError, match="dim 1 of mask is 6, but dim 1 of x is 5"):
        pipe(torch.randn(4, 5, 4), torch.ones(4, 6))
    with pytest.raises(InputMismatchError, match="dim 1 of x is 1, but the captured graph holds for sizes 2 or more"):
        pipe(torch.randn(4, 1, 4), torch.ones(4, 1))


def test_guards_check_equal_symbols_ranges_and_derived_sizes():
    guards = ShapeGuards({0: (None, "s1"), 1: (None, "s1", "s1 + 1"), 2: (None, "s2")},
                         {"s1": (2, 64), "s2": (2, None)})
    names = ["a", "b", "c"]
    t = torch.zeros
    assert guards.problems([t(4, 5), t(4, 5, 6), t(4, 9)], names) == []
    [(what, _)] = guards.problems([t(4, 5), t(4, 6, 6), t(4, 9)], names)
    assert what.startswith("dim 1 of b is 6, but dim 1 of a is 5"), what
    [(what, _)] = guards.problems([t(4, 5), t(4, 5, 5), t(4, 9)], names)
    assert what.startswith("dim 2 of b is 5, but the model's graph has it equal to s1 + 1 = 6"), what
    [(what, todo)] = guards.problems([t(4, 70), t(4, 70, 71), t(4, 9)], names)
    assert "holds for sizes 2 to 64 only: the model's code bounds it at 64" in what and todo == \
        "pass at most 64 there, the model's own limit"
    [(what, _)] = guards.problems([t(4, 5, 1), t(4, 5, 6), t(4, 9)], names)
    assert what == "a has 3 dims but the sample's had 2"


class _Even(nn.Module):
    """A branch on the length's parity: torch.export keeps the sample's branch and a guard."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if x.shape[1] % 2 == 0:
            h = h * 2
        if x.shape[0] % 2 == 0:  # on the batch: checked per micro-batch
            h = h + 1
        return self.b(torch.relu(h))


def test_a_branch_on_a_size_is_followed_or_refused_never_silently_other():
    """Found by a new-user trial: the parity branch ran at an odd length too (every output off,
    by up to 0.89), since only equalities and ranges were checked."""
    torch.manual_seed(0)
    model = _Even()
    pipe = fxpipe.pipeline(model, torch.randn(4, 10, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert pipe.capture.method == "export" and len(pipe.capture.guards.conditions) == 2
    for b, t in ((4, 12), (8, 4)):
        x = torch.randn(b, t, 8)
        torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(InputMismatchError, match=r"kept that branch only: its guard Mod\(x.shape\[1\], 2\) == 0 does "
                                                 r"not hold with x.shape\[1\] = 11"):
        pipe(torch.randn(4, 11, 8))
    with pytest.raises(InputMismatchError, match=r"a micro-batch of this call: .*x.shape\[0\] = 3"):
        pipe(torch.randn(6, 10, 8))


class _Groups(nn.Module):
    """torch.fx: the batch's tokens, flattened, padded to groups of 4 and mixed within each
    group. At 4 x 8 every micro-batch's groups lie within its samples; at 5 x 6 they cross them
    (a new-user trial found 448 of 960 outputs off, up to 0.17), so the length may not vary."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.a(x).flatten(0, 1)
        n = h.shape[0]
        h = nn.functional.pad(h, (0, 0, 0, (-n) % 4)).view(-1, 4, d)
        h = h + h.mean(1, keepdim=True)
        return self.b(h.reshape(-1, d)[:n].view(b, t, d))


def test_an_fx_graph_that_regroups_the_batch_keeps_its_lengths_fixed():
    torch.manual_seed(0)
    model = _Groups()
    pipe = fxpipe.pipeline(model, torch.randn(4, 8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert pipe.capture.method == "fx" and pipe.capture.fixed == {0: (None, 8, 8)}
    x = torch.randn(6, 8, 8)
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(InputMismatchError, match="dim 1 of x is 6, but it was fixed at 8.*regroups the batch's rows"):
        pipe(torch.randn(5, 6, 8))
    heads = nn.Sequential(nn.Linear(8, 8), nn.Unflatten(2, (2, 4)), nn.Flatten(2), nn.Linear(8, 8))
    plain = fxpipe.pipeline(heads, torch.randn(4, 8, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert plain.capture.method == "fx" and plain.capture.fixed == {}  # nothing regroups: every length


def test_a_loop_over_the_samples_in_the_root_is_refused_saying_so():
    """torch.export unrolled the loop at the sample's 8 samples; the build's micro-batch of 4
    then failed with an IndexError and advice about chunk_dims (a trial)."""
    import fxpipe
    from fxpipe.errors import MicroBatchError

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 16), torch.nn.Linear(16, 2)

        def forward(self, x, lengths):
            h = self.a(x)
            return self.b(torch.stack([h[i, :lengths[i]].mean(0) for i in range(h.shape[0])]))

    with pytest.raises(MicroBatchError, match=r"holds only for batches of at least 8 samples.*Python loop over the"):
        fxpipe.pipeline(Pooled(), (torch.randn(8, 5, 6), torch.randint(1, 6, (8,))), 2, chunks=2,
                        devices=["cpu"] * 2, progress=False)


class Folds(torch.nn.Module):
    """A reshape naming the batch, so the symbolic size scan runs."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x).reshape(x.shape[0], -1, 8))


def test_a_symbolic_scan_past_its_budget_keeps_every_size_but_the_batch(monkeypatch):
    """A diffusion U-Net's scan over symbolic sizes took minutes (a trial); past its budget the
    capture keeps the sizes, as where a size regroups the rows: other sizes are refused, typed."""
    import fxpipe
    import fxpipe.capture._shape_guards as guards
    from fxpipe.errors import InputMismatchError

    monkeypatch.setattr(guards, "SCAN_SECONDS", 0.0)
    x = torch.randn(4, 6, 8)
    pipe = fxpipe.pipeline(Folds(), x, 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert pipe.capture.method == "fx" and pipe.capture.fixed
    torch.testing.assert_close(pipe(torch.randn(6, 6, 8)).shape, torch.Size([6, 6, 8]))  # any batch
    with pytest.raises(InputMismatchError):
        pipe(torch.randn(4, 5, 8))


def test_the_symbolic_scan_budget_does_not_follow_the_machines_load(monkeypatch):
    """The budget counts this thread's CPU time: counted by the clock, a model's accepted lengths
    followed the machine's load (a trial's first build fixed them, its second did not)."""
    import time

    import fxpipe
    import fxpipe.capture._shape_guards as guards

    class Waits(torch.nn.Module):  # kept opaque; in the scan it waits on the clock, not the CPU (a busy machine)
        def forward(self, h):
            if isinstance(h, torch._subclasses.FakeTensor):
                time.sleep(1.0)
            return h

    class Folds(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.w, self.b = torch.nn.Linear(8, 8), Waits(), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(self.w(self.a(x)).reshape(x.shape[0], -1, 8))

    monkeypatch.setattr(guards, "SCAN_SECONDS", 0.8)  # above the scan's own CPU time, below the wait
    x = torch.randn(4, 6, 8)
    pipe = fxpipe.pipeline(Folds(), x, 2, chunks=2, devices=["cpu"] * 2, leaf_modules=["w"], progress=False)
    assert pipe.capture.method == "fx" and not pipe.capture.fixed
    assert pipe(torch.randn(4, 5, 8)).shape == (4, 5, 8)  # another length


def test_a_scan_past_its_budget_is_not_run_again_for_the_same_graph(monkeypatch):
    """A graph following the modes is captured once per mode: its second scan paid the budget
    again for the same answer (a review: 22 s builds where 12 s gave the same sizes)."""
    import fxpipe
    import fxpipe.capture._shape_guards as guards

    scans = []
    real = guards.symbolic_inputs
    monkeypatch.setattr(guards, "symbolic_inputs", lambda flat: scans.append(1) or real(flat))
    monkeypatch.setattr(guards, "SCAN_SECONDS", -1.0)  # past the budget at once
    pipe = fxpipe.pipeline(Folds(), torch.randn(4, 6, 8), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    assert pipe.capture.fixed and len(scans) == 1
