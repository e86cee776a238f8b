"""chain_cut.Chain on its own: the cost table, the exact cut and its tie-break, against brute force.

test_partition.py checks the cut through OpGraphs, where the receive table is whatever the
graph produces. Here the chain is drawn directly (costs, receive rectangles, seconds per byte),
so every shape of receive table is reached, and the answer is compared *exactly* (``==``): the
module promises the minimum of its own computed stage costs, and, among the cuts reaching it,
the one whose last stage starts latest, then the one before it, and so on.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.plan._chain_cut import Chain


def _cost_by_definition(costs, rects, spb, a: int, b: int) -> float:
    """Cost of stage [a, b) written from the Chain docstring, independently of the module:
    compute of its positions, plus spb * w for each rectangle (l, r, s, w) with l <= a <= r
    and b >= s (the stage starts inside the rectangle and reaches the value's consumer)."""
    received = sum(w for (l, r, s, w) in rects if l <= a <= r and b >= s and w > 0)
    return float(sum(costs[a:b])) + spb * received


def _cost(chain: Chain, a: int, b: int) -> float:
    return float(chain.stage_cost(np.array([a]), np.array([b]))[0])


def _all_cuts(m: int, k: int):
    for cuts in itertools.combinations(range(1, m), k - 1):
        yield [0, *cuts]


def _brute_force(chain: Chain, k: int) -> tuple[float, list[int]]:
    """The optimum of the module's own stage costs, and the canonical cut reaching it (among
    the optimal cuts whose every stage holds compute, if any has, else among all: the latest
    last start, then the latest start before it, ...), by trying every cut."""
    m = chain.m
    scored = []
    for starts in _all_cuts(m, k):
        ends = starts[1:] + [m]
        scored.append((max(_cost(chain, a, b) for a, b in zip(starts, ends)), starts))
    best = min(s for s, _ in scored)
    optimal = [starts for s, starts in scored if s == best]
    with_compute = [st_ for st_ in optimal
                    if all(any(c > 0 for c in chain.cost[a:b]) for a, b in zip(st_, st_[1:] + [m]))]
    canonical = max(with_compute or optimal, key=lambda st_: st_[::-1])
    return best, canonical


@st.composite
def chains(draw):
    """Small chains: costs that tie often (small integers) or not (any floats), rectangles
    anywhere a stage may start (s > r: a value's consumer comes after the stages it reaches),
    some of them empty (l > r) or weightless, which must change nothing."""
    m = draw(st.integers(1, 8))
    cost = st.one_of(st.integers(0, 4).map(float), st.floats(0, 100, allow_nan=False))
    costs = draw(st.lists(cost, min_size=m, max_size=m))
    rects = []
    for _ in range(draw(st.integers(0, 6))):
        l = draw(st.integers(0, m - 1))
        r = draw(st.integers(max(l - 1, 0), m - 1))  # r = l - 1: an empty rectangle
        s = draw(st.integers(r + 1, m))
        w = draw(st.integers(0, 20))
        rects.append((l, r, s, w))
    spb = draw(st.sampled_from([0.0, 0.25, 1.0, 3.0, 1e-3]))
    return costs, rects, spb


@settings(max_examples=200, deadline=None)
@given(chains())
def test_stage_cost_is_compute_plus_what_the_stage_receives(chain_spec) -> None:
    costs, rects, spb = chain_spec
    chain = Chain(costs, rects, spb)
    m = len(costs)
    for a in range(m):
        for b in range(a + 1, m + 1):
            want = _cost_by_definition(costs, rects, spb, a, b)
            assert _cost(chain, a, b) == pytest.approx(want, rel=1e-12, abs=1e-12), (a, b)
    # The property the search rests on: for a fixed start, the cost never falls as the end grows.
    for a in range(m):
        row = [_cost(chain, a, b) for b in range(a + 1, m + 1)]
        assert row == sorted(row), a


@settings(max_examples=200, deadline=None)
@given(chains(), st.data())
def test_solve_is_the_exact_optimum_and_the_latest_cut_among_ties_with_compute_in_each(chain_spec, data) -> None:
    costs, rects, spb = chain_spec
    chain = Chain(costs, rects, spb)
    k = data.draw(st.integers(1, chain.m), label="k")
    got = chain.solve(k)
    assert len(got) == k and got[0] == 0 and all(x < y for x, y in zip(got, got[1:])) and got[-1] < chain.m
    best, canonical = _brute_force(chain, k)
    assert chain.bottleneck(got) == best  # exact: the minimum of the computed costs, not close to it
    assert got == canonical
    ends = got[1:] + [chain.m]
    by_definition = max(_cost_by_definition(costs, rects, spb, a, b) for a, b in zip(got, ends))
    assert by_definition == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_receive_cost_moves_the_cut() -> None:
    # A stage starting at 1 or 2 that reaches position 2 (end >= 3) receives 10 bytes. On
    # compute alone [0, 2] is best (2 | 2); with the transfer it costs 2 | 12, and [0, 3]
    # (3 | 1) wins.
    assert Chain([1, 1, 1, 1]).solve(2) == [0, 2]
    chain = Chain([1, 1, 1, 1], [(1, 2, 3, 10)], 1.0)
    assert [_cost(chain, 2, 4), _cost(chain, 1, 2), _cost(chain, 3, 4)] == [12.0, 1.0, 1.0]
    assert chain.solve(2) == [0, 3]
    assert chain.bottleneck([0, 3]) == 3.0
    # Rectangles of the same start add up: two values received by [2, 4) cost both.
    both = Chain([1, 1, 1, 1], [(1, 2, 3, 10), (2, 2, 4, 5)], 1.0)
    assert _cost(both, 2, 4) == 17.0 and _cost(both, 2, 3) == 11.0


def test_receive_cost_breaks_a_compute_tie() -> None:
    # Compute alone ties [0, 2] and [0, 3] at 2 and takes the later; a value received by a
    # stage starting at 3 makes the later cut cost more, so the earlier one is the answer.
    assert Chain([1, 1, 0, 1]).solve(2) == [0, 3]
    assert Chain([1, 1, 0, 1], [(3, 3, 4, 2)], 1.0).solve(2) == [0, 2]


def test_weightless_or_empty_rectangles_and_zero_spb_change_nothing() -> None:
    costs = [3.0, 1.0, 2.0, 5.0, 1.0]
    plain = Chain(costs)
    for chain in (Chain(costs, [(1, 3, 4, 0)], 1.0), Chain(costs, [(3, 2, 4, 9)], 1.0),
                  Chain(costs, [(1, 3, 4, 9)], 0.0)):
        assert not chain.has_transfer
        for k in range(1, 6):
            assert chain.solve(k) == plain.solve(k)


def test_every_position_its_own_stage_when_k_is_m() -> None:
    chain = Chain([5.0, 0.0, 2.0], [(1, 2, 3, 100)], 1.0)
    assert chain.solve(3) == [0, 1, 2]
    assert chain.bottleneck([0, 1, 2]) == 102.0


@pytest.mark.parametrize("k", [0, 4, 10])
def test_solve_refuses_a_k_with_no_cut(k: int) -> None:
    # More stages than positions (or none) has no contiguous cut: a list of starts with a
    # repeated position would be an empty stage, silently.
    with pytest.raises(ValueError, match=rf"k={k}.*3 positions"):
        Chain([1.0, 2.0, 3.0]).solve(k)


def test_empty_chain_refuses_any_k() -> None:
    with pytest.raises(ValueError, match="0 positions"):
        Chain([]).solve(1)


@pytest.mark.parametrize(
    "costs, match",
    [([1.0, float("nan")], r"position 1 is nan"), ([float("inf")], r"position 0 is inf"),
     ([2.0, 1.0, -1e-300], r"position 2"), ([1e308, 1e308], r"sum must be a finite float")],
)
def test_costs_that_cannot_be_cut_exactly_are_refused(costs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Chain(costs)


def test_absurd_transfer_cost_is_an_infinite_stage_and_still_exact() -> None:
    # spb * bytes overflows to inf: a cut that receives it can never win while one that
    # does not exists.
    chain = Chain([1.0, 1.0, 1.0], [(1, 1, 2, 10**18)], 1e300)
    assert _cost(chain, 1, 2) == float("inf")
    assert chain.solve(2) == [0, 2]
    assert chain.bottleneck([0, 2]) == 2.0
