"""call_inputs on a Capture directly: which calls fit the sample, and how a misfit is named.

test_messages.py checks the messages through whole pipelines with flat arguments. Here the
capture is called directly (no plan, no stages), so cases a pipeline cannot isolate are
reached: the flat list a fitting call returns (its order is the graph's, whatever the
keywords' order), arguments nested in dicts, lists and namedtuples named by their path,
specialisation that compares types as well as values, the sizes a torch.export capture fixes
(read from the graph and checked at each call), and a forward whose signature is unknown.
"""

from __future__ import annotations

import collections
import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.capture._call_inputs import in_sample_order
from fxpipe.capture._shape_guards import fixed_dims
from fxpipe.capture._values import same_plain as same_value
from fxpipe.capture._tracing import Capture, capture
from fxpipe.errors import FxpipeError, InputMismatchError, MicroBatchError

Pt = collections.namedtuple("Pt", "a b")
Other = collections.namedtuple("Other", "a b")

X = torch.randn(2, 4)
IDS, P0, P1, PA, PB, MASK, EA, EB = (torch.randn(2, 4) for _ in range(8))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, batch, pt, scale=0.5, *, mask=None, **extra):
        y = self.l(x) * scale + batch["ids"] + batch["pos"][0] + batch["pos"][1] + pt.a + pt.b
        if mask is not None:
            y = y + mask
        for v in extra.values():  # **extra: forward sees these in call order
            y = y - v
        return y


def _args():
    return (X, {"ids": IDS, "pos": [P0, P1]}, Pt(PA, PB))


def _kwargs():
    return {"scale": 0.5, "mask": MASK, "a": EA, "b": EB}


#: the sample's leaves in flatten order; index 6 is scale (specialised, not a tensor)
SAMPLE_FLAT = [X, IDS, P0, P1, PA, PB, 0.5, MASK, EA, EB]


@pytest.fixture(scope="module")
def cap() -> Capture:
    c = capture(Net(), _args(), _kwargs())
    assert c.method == "fx" and c.specialized == {6: 0.5} and not c.fixed
    return c


def _same_leaves(got, want) -> bool:
    return len(got) == len(want) and all(g is w if isinstance(w, torch.Tensor) else g == w
                                         for g, w in zip(got, want))


def _refused(c: Capture, args, kwargs) -> str:
    with pytest.raises(InputMismatchError) as info:
        c.flatten_inputs(args, kwargs)
    assert isinstance(info.value, FxpipeError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert msg.startswith("Net: this call does not match the sample"), msg
    assert "TreeSpec" not in msg, msg
    return msg


# -- calls that fit -----------------------------------------------------------------------
def test_a_fitting_call_returns_the_leaves_in_the_graphs_order(cap: Capture) -> None:
    assert _same_leaves(cap.flatten_inputs(_args(), _kwargs()), SAMPLE_FLAT)


def test_named_keywords_in_any_order_fit_and_come_back_in_the_samples_order(cap: Capture) -> None:
    # scale and mask are named parameters: Python binds them by name, so their order is free.
    # The leaves must still come back in the graph's order, or mask would feed scale's slot.
    shuffled = {"mask": MASK, "a": EA, "scale": 0.5, "b": EB}
    assert _same_leaves(cap.flatten_inputs(_args(), shuffled), SAMPLE_FLAT)
    assert list(in_sample_order(cap, shuffled)) == ["scale", "mask", "a", "b"]


def test_var_keywords_keep_their_call_order(cap: Capture) -> None:
    # a and b land in **extra, which forward sees in call order: not reordered, refused.
    swapped = {"scale": 0.5, "mask": MASK, "b": EB, "a": EA}
    assert list(in_sample_order(cap, swapped)) == ["scale", "mask", "b", "a"]
    msg = _refused(cap, _args(), swapped)
    assert "b, a reach Net.forward's **kwargs in this order" in msg and "order a, b" in msg, msg
    # named ones moved around them are still fine: only the relative order of a and b counts
    assert _same_leaves(cap.flatten_inputs(_args(), {"a": EA, "mask": MASK, "b": EB, "scale": 0.5}),
                        SAMPLE_FLAT)


def test_extra_keywords_go_last(cap: Capture) -> None:
    assert list(in_sample_order(cap, {"zz": 1, "mask": MASK, "scale": 0.5, "a": EA, "b": EB})) == \
        ["scale", "mask", "a", "b", "zz"]


def test_any_tensor_size_fits_an_fx_capture(cap: Capture) -> None:
    # an fx graph takes its shapes from its inputs: nothing is fixed
    big = torch.randn(3, 7, 5)
    got = cap.flatten_inputs((X, {"ids": big, "pos": [P0, P1]}, Pt(PA, PB)), _kwargs())
    assert got[1] is big


# -- calls that do not fit: each names the argument, by its path -------------------------
def _call(positional=None, drop=(), **kw):
    """The sample call with some positionals replaced ({index: value}), keywords dropped or set."""
    args = list(_args())
    for i, v in (positional or {}).items():
        args[i] = v
    kwargs = {k: v for k, v in {**_kwargs(), **kw}.items() if k not in drop}
    return tuple(args), kwargs


MISMATCHES = [
    # (args, kwargs, words the message must contain, id)
    (*_call(drop=["mask"]), ["mask= is missing", "the sample passed mask (a tensor)", "pass mask=..."],
     "keyword missing"),
    (*_call(c=X), ["c= is passed but the sample did not pass c", "sample_kwargs={'c': ...}"], "extra keyword"),
    (*_call(c=None), ["c=None is passed", "sample_kwargs={'c': None, ...}"], "extra keyword None"),
    (_args()[:2], _kwargs(), ["positional argument pt is missing",
                              "the sample passed 3 positional arguments, this call 2"], "positional missing"),
    ((*_args(), 0.5, X), _call(drop=["scale"])[1],
     ["Net.forward takes 4 positional arguments (x, batch, pt, scale) but this call passes 5"], "too many"),
    ((*_args(), 0.5), _kwargs(), ["scale is passed twice, positionally and as scale=", "pass scale once"],
     "positional and keyword"),
    ((*_args(), 0.5), _call(drop=["scale"])[1],
     ["scale is passed positionally but the sample passed it by keyword", "pass it as scale=..."],
     "positional for a keyword"),
    (_args()[:2], _call(pt=Pt(PA, PB))[1],
     ["pt is passed by keyword (pt=...) but the sample passed it positionally"], "keyword for a positional"),
    (*_call({1: {"pos": [P0, P1], "ids": IDS}}), ["batch has its keys in the order ['pos', 'ids']",
                                                  "the sample's in the order ['ids', 'pos']"], "dict key order"),
    (*_call({1: {"ids": IDS, "pos": [P0, P1], "len": X}}), ["batch has keys", "unexpected ['len']"],
     "dict extra key"),
    (*_call({1: {"ids": IDS, "pos": (P0, P1)}}), ["batch['pos'] is a tuple of 2 items",
                                                  "the sample passed a list of 2 items"], "list vs tuple"),
    (*_call({1: {"ids": IDS, "pos": [P0]}}), ["batch['pos'] is a list of 1 item",
                                              "pass batch['pos'] with 2 items"], "list length"),
    (*_call({1: {"ids": IDS, "pos": [P0, 3]}}), ["batch['pos'][1] is 3 (int) but the sample passed a tensor",
                                                 "pass a tensor for batch['pos'][1]"], "nested non-tensor"),
    (*_call({1: {"ids": [IDS], "pos": [P0, P1]}}),
     ["batch['ids'] is a list of 1 item but the sample passed a tensor"], "container for a tensor"),
    (*_call({2: (PA, PB)}), ["pt is a tuple of 2 items but the sample passed a namedtuple Pt"],
     "namedtuple vs tuple"),
    (*_call({2: Other(PA, PB)}), ["pt is a namedtuple Other structured differently"], "another namedtuple"),
    (*_call({2: Pt(PA, "b")}), ["pt.b is 'b' (str) but the sample passed a tensor"], "namedtuple field"),
    (*_call(scale=0.25), ["scale is 0.25 but the graph was specialised on the sample's 0.5",
                          "pass 0.5 for scale"], "specialised value"),
    (*_call(scale=1), ["scale is 1 but the graph was specialised on the sample's 0.5"], "specialised type"),
    (*_call(scale=X), ["scale is a tensor of shape (2, 4) but the graph was specialised"], "tensor for a value"),
]


@pytest.mark.parametrize("args, kwargs, words", [m[:3] for m in MISMATCHES], ids=[m[3] for m in MISMATCHES])
def test_each_mismatch_is_refused_naming_the_argument(cap: Capture, args, kwargs, words) -> None:
    msg = _refused(cap, args, kwargs)
    for word in words:
        assert word in msg, msg


def test_specialised_values_compare_type_and_value() -> None:
    assert same_value(0.5, 0.5) and same_value("gelu", "gelu") and same_value(None, None)
    assert not same_value(1, 1.0) and not same_value(True, 1) and not same_value(0.5, np.float64(0.5))
    # no boolean ==: only the very same object fits
    a = np.arange(3)
    assert same_value(a, a) and not same_value(a, np.arange(3))


def test_unknown_signature_names_by_position_and_keeps_keyword_order(cap: Capture) -> None:
    blind = dataclasses.replace(cap, signature=None)
    msg = _refused(blind, (*_args(), 0.5, X), {k: v for k, v in _kwargs().items() if k != "scale"})
    assert "args[3], args[4] are passed positionally" in msg, msg
    # any keyword may land in **kwargs: another order than the sample's is refused, not reordered
    msg = _refused(blind, _args(), {"mask": MASK, "scale": 0.5, "a": EA, "b": EB})
    assert "scale, mask" in msg and "mask, scale" in msg, msg
    assert _same_leaves(blind.flatten_inputs(_args(), _kwargs()), SAMPLE_FLAT)


# -- sizes a torch.export capture fixed --------------------------------------------------
class Two(nn.Module):
    def forward(self, x, y):
        return x.sum(-1) + y.sum(-1)


@pytest.fixture(scope="module")
def exported() -> torch.fx.GraphModule:
    b = torch.export.Dim("b")
    ep = torch.export.export(Two(), (torch.randn(4, 3), torch.randn(4, 5)), dynamic_shapes=({0: b}, {0: b}))
    return ep.module()


def test_fixed_dims_reads_what_export_specialised(exported: torch.fx.GraphModule) -> None:
    x, y = torch.randn(4, 3), torch.randn(4, 5)
    # dim 0 is symbolic (dynamic), dim 1 a plain int: fixed
    assert fixed_dims(exported, [x, y], None) == {0: (None, 3), 1: (None, 5)}
    # the split dim is free whatever export made of it; an input with nothing fixed is left out
    assert fixed_dims(exported, [x, y], [None, 1]) == {0: (None, 3)}
    assert fixed_dims(exported, [x, y], [1, -1]) == {}
    # a non-tensor, or a tensor with other dims than the placeholder's, is not a sized input
    assert fixed_dims(exported, [x, 3], None) == {0: (None, 3)}
    assert fixed_dims(exported, [x, torch.randn(4)], None) == {0: (None, 3)}


def test_fx_graph_fixes_no_size() -> None:
    c = capture(Two(), (torch.randn(4, 3), torch.randn(4, 5)))
    assert c.method == "fx" and fixed_dims(c.graph_module, [torch.randn(4, 3), torch.randn(4, 5)], None) == {}


def test_fixed_sizes_are_checked_at_each_call(cap: Capture) -> None:
    # as an export capture would have it: batch['ids'] (flat 1) has 4 in dim 1, dim 0 free
    sized = dataclasses.replace(cap, fixed={1: (None, 4)})
    args = _args()
    ok = (X, {"ids": torch.randn(9, 4), "pos": [P0, P1]}, Pt(PA, PB))
    assert sized.flatten_inputs(ok, _kwargs())[1] is ok[1]["ids"]  # the free dim may change
    msg = _refused(sized, (X, {"ids": torch.randn(2, 6), "pos": [P0, P1]}, args[2]), _kwargs())
    assert "dim 1 of batch['ids'] is 6, but it was fixed at 4" in msg and "only dim 0 of it may vary" in msg, msg
    msg = _refused(sized, (X, {"ids": torch.randn(2, 4, 1), "pos": [P0, P1]}, args[2]), _kwargs())
    assert "batch['ids'] has 3 dims but the sample's had 2" in msg, msg
    # a size problem is named alongside a structural one, in one message
    msg = _refused(sized, (X, {"ids": torch.randn(2, 6), "pos": [P0, P1]}, args[2]), {**_kwargs(), "scale": 2.0})
    assert "dim 1 of batch['ids'] is 6" in msg and "scale is 2.0" in msg, msg


class _FlattensTheBatch(nn.Module):
    """reshape(-1, ...) merges the batch into rows; the dim check stops torch.fx."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError("expected 3 dims")
        return self.b(self.a(x).reshape(-1, 8)).reshape(x.shape[0], -1)


@pytest.mark.parametrize("model", [_FlattensTheBatch, lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))],
                         ids=["export", "fx"])
def test_a_batch_of_one_takes_any_batch_without_micro_batches_and_is_refused_with_them(model):
    """A batch-1 sample (issue #31): torch.export would fix the batch at 1 (it specialises a
    size of 1), so the capture traces it doubled and the batch stays symbolic; with chunks=1
    the pipeline takes any batch, exact. With chunks > 1 the build is refused with advice: one
    sample cannot show that micro-batches give the whole batch's result."""
    torch.manual_seed(0)
    model = model()
    with pytest.raises(MicroBatchError, match="one sample.*chunks=4.*Build from a sample of 2 or more"):
        fxpipe.pipeline(model, torch.randn(1, 3, 4), 2, chunks=4, devices=["cpu"] * 2, progress=False)
    pipe = fxpipe.pipeline(model, torch.randn(1, 3, 4), 2, chunks=1, devices=["cpu"] * 2, progress=False)
    assert not pipe.capture.batch_fixed
    for x in (torch.randn(4, 3, 4), torch.randn(1, 3, 4), torch.randn(8, 5, 4)):
        torch.testing.assert_close(pipe(x), model(x))


def test_an_options_object_changed_in_place_is_refused() -> None:
    """A SimpleNamespace of options given again after ``opts.scale = 3.0``: the graph baked
    1.0, and the check compared the object with itself (a trial: loss 0.0908 against 0.4899)."""
    import types

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x, opts):
            return self.a(x) * opts.scale

    opts, x = types.SimpleNamespace(scale=1.0), torch.randn(8, 8)
    pipe = fxpipe.pipeline(Scaled(), x, 2, chunks=2, devices=["cpu"] * 2, sample_kwargs={"opts": opts}, progress=False)
    pipe(x, opts=opts)
    opts.scale = 3.0
    with pytest.raises(InputMismatchError, match=r"opts is namespace\(scale=3.0\)"):
        pipe(x, opts=opts)
    opts.scale = 1.0
    pipe(x, opts=opts)
