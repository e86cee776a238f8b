"""Recordings derived for other micro-batch sizes equal the recordings themselves, and a
model whose storages change with the size is refused (recorded size by size)."""

from __future__ import annotations

import torch

from fxpipe.build import BuildOptions, capture_and_check
from fxpipe.capture._prepare import preserved
from fxpipe.tuning._costs import micro_inputs
from fxpipe.tuning._nodes import record_nodes
from fxpipe.tuning._scaling import derive, fit, same
from zoo import TinyGPT


def recordings(model: torch.nn.Module, x: torch.Tensor, sizes: list[int]) -> dict:
    with preserved(model):
        checked = capture_and_check(model, (x,), {}, BuildOptions(2, balance_by="params"))
        flat = checked.capture.flatten_inputs(checked.args, checked.kwargs)
        return {s: record_nodes(checked.capture.graph_module, micro_inputs(checked.batching, flat, s)) for s in sizes}


def test_derived_sizes_equal_recorded_ones() -> None:
    torch.manual_seed(0)
    recs = recordings(TinyGPT(64, 32, 4, 2, 16), torch.randint(0, 64, (16, 16)), [2, 4, 8, 16])
    f = fit(recs[2], 2, recs[4], 4)
    assert f is not None
    for size in (8, 16):
        got = derive(f, size)
        assert got is not None and same(got, recs[size])
    assert not same(derive(f, 16), recs[8])  # the comparison can fail
    assert sum(derive(f, 16).outputs.values()) == 4 * sum(recs[4].outputs.values())


def test_storages_shared_differently_are_not_fitted() -> None:
    """At size 1 a reshape of a batch dim of one is a view (the node saves storage 1 again),
    at size 2 a copy (another storage): not a linear change, refused; bytes that would not be
    whole are refused too."""
    from fxpipe.tuning._nodes import NodeRecord, Recording

    def rec(b: int, saved: dict) -> Recording:
        return Recording([NodeRecord("a", makes={1: b}), NodeRecord("b", reads={1: b}, saves=saved)], {}, set())

    assert fit(rec(4, {1: 4}), 1, rec(8, {2: 8}), 2) is None
    f = fit(rec(4, {1: 4}), 1, rec(7, {1: 7}), 3)
    assert f is not None and derive(f, 2) is None      # 5.5 bytes
    assert derive(f, 5).nodes[1].saves == {1: 10}
