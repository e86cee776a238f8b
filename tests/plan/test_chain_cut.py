"""plan/_chain_cut.py: the exact cut of a chain *with receive costs*, against brute force.

test_partition.py checks split_chain (compute only) and the partitioner end to end; here the
Chain itself: its stage cost formula against a direct reading of the rectangles, and solve()
against every possible cut, with the receive term that makes a stage's cost non-additive.
"""

from itertools import combinations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fxpipe.plan._chain_cut import Chain


def direct_cost(costs, rects, spb, a, b):
    """Stage [a, b): its compute plus spb times the bytes of every rectangle it receives."""
    received = sum(w for (l, r, s, w) in rects if l <= a <= r and b >= s and w > 0 and l <= r)
    return sum(costs[a:b]) + spb * received


def brute_force(costs, rects, spb, k):
    m = len(costs)
    best = None
    for cuts in combinations(range(1, m), k - 1):
        starts = [0, *cuts]
        ends = [*cuts, m]
        cost = max(direct_cost(costs, rects, spb, a, b) for a, b in zip(starts, ends))
        best = cost if best is None else min(best, cost)
    return best


@st.composite
def chains(draw):
    m = draw(st.integers(2, 8))
    costs = draw(st.lists(st.integers(0, 9).map(float), min_size=m, max_size=m))
    rects = []
    for _ in range(draw(st.integers(0, 5))):
        l = draw(st.integers(1, m - 1))
        r = draw(st.integers(l, m - 1))
        s = draw(st.integers(r + 1, m))
        rects.append((l, r, s, draw(st.integers(1, 9))))
    k = draw(st.integers(1, m))
    return costs, rects, k


@settings(max_examples=150, deadline=None)
@given(chains(), st.sampled_from([0.5, 1.0, 3.0]))
def test_solve_is_the_brute_force_optimum_with_receive_costs(case, spb):
    costs, rects, k = case
    chain = Chain(costs, rects, spb)
    starts = chain.solve(k)
    assert len(starts) == k and starts[0] == 0 and starts == sorted(set(starts))
    ends = [*starts[1:], len(costs)]
    got = max(direct_cost(costs, rects, spb, a, b) for a, b in zip(starts, ends))
    assert got == pytest.approx(brute_force(costs, rects, spb, k), rel=1e-12, abs=1e-12)
    assert chain.bottleneck(starts) == pytest.approx(got, rel=1e-12, abs=1e-12)


@settings(max_examples=100, deadline=None)
@given(chains(), st.sampled_from([0.5, 2.0]))
def test_stage_cost_is_compute_plus_what_the_stage_receives(case, spb):
    costs, rects, _ = case
    chain = Chain(costs, rects, spb)
    m = len(costs)
    a, b = np.array([(i, j) for i in range(m) for j in range(i + 1, m + 1)]).T
    want = [direct_cost(costs, rects, spb, int(i), int(j)) for i, j in zip(a, b)]
    np.testing.assert_allclose(chain.stage_cost(a, b), want, rtol=1e-12, atol=1e-12)


def test_a_receive_cost_moves_the_cut():
    """Compute alone splits [4, 4 | 4, 4]; a value produced at 0 and needed at 3 makes any stage
    starting at 1..2 and reaching 3 receive it, so the receiver is better started at 3 or later."""
    costs = [4.0, 4.0, 4.0, 4.0]
    assert Chain(costs).solve(2) == [0, 2]
    heavy = Chain(costs, [(1, 2, 4, 10)], spb=1.0)  # starts 1..2 ending at 4 receive 10
    starts = heavy.solve(2)
    assert starts == [0, 3] and heavy.bottleneck(starts) == 12.0


def test_bad_costs_are_refused_naming_the_position():
    with pytest.raises(ValueError, match="position 1"):
        Chain([1.0, -1.0, 2.0])
    with pytest.raises(ValueError, match="position 0"):
        Chain([float("nan"), 1.0])
