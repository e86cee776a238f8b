"""runtime/_pipeline.py: the clock-cycle schedule of GPipe's tasks."""

import pytest

from fxpipe.runtime._pipeline import clock_cycles


@pytest.mark.parametrize("m,n", [(1, 1), (3, 3), (4, 2), (2, 5), (8, 4)])
def test_clock_cycles_cover_every_task_once_in_dependency_order(m, n):
    seen = {}
    for k, schedule in enumerate(clock_cycles(m, n)):
        for i, j in schedule:
            assert i + j == k
            seen[(i, j)] = k
    assert sorted(seen) == [(i, j) for i in range(m) for j in range(n)]
    for (i, j), k in seen.items():
        if j:
            assert seen[(i, j - 1)] < k  # a micro-batch reaches partition j after j-1
        if i:
            assert seen[(i - 1, j)] < k  # a partition takes micro-batches in order


def test_clock_cycles_example():
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)],
    ]
