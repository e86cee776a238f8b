"""The exact contiguous cut of a chain with receive costs (no torch: numpy only).

Positions ``0..m-1`` in order, each with a compute cost; a stage ``[a, b)`` costs its compute
plus the time to receive the values it needs from earlier stages (:mod:`fxpipe.plan._partition`
builds that chain from an OpGraph).

The receive term makes the cost of a stage ``[a, b)`` non-additive and non-monotone in its
start ``a`` (starting earlier adds compute but may stop receiving a value), so greedy packing
(or bisection with a greedy check) is not exact, and the exact O(k*m^2) DP is too slow for
20k nodes. What *is* still true: for a fixed start ``a`` the cost is non-decreasing in the
end ``b`` (costs are >= 0). So for a bottleneck ``T`` each start has a furthest feasible end
``R(a)``, and "can the chain be cut into exactly k stages of cost <= T" is a k-layer
reachability DP over starts. We search the smallest feasible ``T``, starting from the band
[compute-only optimum, true cost of that cut]: a feasible probe lowers the upper bound to
the bottleneck of the cut it found, an infeasible probe raises the lower bound to the next
value at which any ``R(a)`` changes. The answer is the exact minimum of the computed stage
costs, not an epsilon-approximation.

Complexity: ``N = sum over cut positions of the values live across that cut`` (about
``m * width`` for m compute nodes). Building the tables is O(N log N); a probe is
O(N_active log m + k*m) numpy work, where segments settled by the current bounds are dropped
as the band narrows; probes number O(log #distinct stage costs), in practice 10-25.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["Chain", "split_chain"]


class Chain:
    """A chain of m positions with a receive-cost table, answering "cut into k, bottleneck <= T".

    ``costs[i]`` is the compute cost at position i. Each *rectangle* ``(l, r, s, w)`` says: a
    stage starting at any ``a`` in ``[l, r]`` and ending at ``b >= s`` receives ``w`` bytes
    (one value's next consumer is at ``s - 1``). Per start ``a`` we store the sorted steps of
    its receive function as *segments* ``[lo, hi]`` of ends with constant received bytes.
    """

    def __init__(self, costs: Sequence[float], rects: Sequence[tuple[int, int, int, int]] = (), spb: float = 0.0):
        cost = np.asarray(costs, dtype=np.float64)
        if cost.size and not (np.all(np.isfinite(cost)) and cost.min() >= 0):
            bad = int(np.flatnonzero(~(np.isfinite(cost) & (cost >= 0)))[0])
            raise ValueError(f"cost at position {bad} is {float(cost[bad])!r}; costs must be finite and >= 0")
        m = self.m = int(cost.size)
        self.cost = cost
        with np.errstate(over="ignore"):
            self.C = np.concatenate(([0.0], np.cumsum(cost)))  # prefix sums, non-decreasing
        if not np.isfinite(self.C[-1]):
            raise ValueError(f"costs add up to {self.C[-1]!r}; their sum must be a finite float")
        self.base = m + 2  # key = a * base + lo orders entries by (start, segment)
        pos = np.arange(m, dtype=np.int64)
        # Segment 0 of each start: ends a+1.. with nothing received yet (a zero-weight step).
        ea, es, ew, real = [pos], [pos + 1], [np.zeros(m, np.int64)], [np.zeros(m, bool)]
        if rects and spb > 0:
            r = np.asarray(rects, dtype=np.int64).reshape(-1, 4)
            r = r[(r[:, 0] <= r[:, 1]) & (r[:, 3] > 0)]
            lens = r[:, 1] - r[:, 0] + 1
            total = int(lens.sum())
            # Expand each rectangle into one entry per start a in [l, r].
            first = np.repeat(np.cumsum(lens) - lens, lens)
            ea.append(np.arange(total, dtype=np.int64) - first + np.repeat(r[:, 0], lens))
            es.append(np.repeat(r[:, 2], lens))
            ew.append(np.repeat(r[:, 3], lens))
            real.append(np.ones(total, bool))
        a, s, w, rl = (np.concatenate(x) for x in (ea, es, ew, real))
        perm = np.lexsort((rl, s, a))  # segment-0 entry first within each start
        a, s, w = a[perm], s[perm], w[perm]
        self.gstart = np.flatnonzero(~rl[perm])  # exactly one segment-0 entry per start
        cum = np.cumsum(w)
        cum -= np.repeat(cum[self.gstart] - w[self.gstart], np.diff(np.append(self.gstart, a.size)))
        hi = np.empty_like(s)
        hi[:-1] = s[1:] - 1
        last = np.append(self.gstart[1:] - 1, a.size - 1) if m else self.gstart
        hi[last] = m
        self.ea, self.elo, self.ehi = a, s, hi
        with np.errstate(over="ignore"):  # an absurd spb * bytes is an inf cost, handled as such
            self.ex = spb * cum.astype(np.float64)  # transfer seconds of the segment
        self.has_transfer = bool(self.ex.any())
        self.keys = a * self.base + s

    # -- costs -----------------------------------------------------------------------------
    def stage_cost(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Cost of stages ``[a, b)`` (vectorised); the one formula every decision uses."""
        idx = np.searchsorted(self.keys, a * self.base + b, side="right") - 1
        return (self.C[b] - self.C[a]) + self.ex[idx]

    def bottleneck(self, starts: Sequence[int]) -> float:
        a = np.asarray(starts, dtype=np.int64)
        return float(self.stage_cost(a, np.append(a[1:], self.m)).max())

    # -- feasibility -----------------------------------------------------------------------
    def narrow(self, lo: float, hi: float) -> None:
        """Drop segments that are settled for every probe T in [lo, hi] still to come.

        A segment too costly at its first end even for ``hi`` can never be used; one cheap
        enough at its last end for ``lo`` always is, so it just raises ``floor[a]``. As the
        bounds close in, only the segments where the boundary can still fall stay active.
        """
        a, l, h, x, Ca = self.active
        ok = l <= h  # empty segments (repeated steps) never hold an end
        full = ok & ((self.C[h] - Ca) + x <= lo)
        np.maximum.at(self.floor, a[full], h[full])
        keep = ok & ~full & ((self.C[l] - Ca) + x <= hi)
        self.active = (a[keep], l[keep], h[keep], x[keep], Ca[keep])

    def reach(self, T: float) -> np.ndarray:
        """``R[a]`` = furthest end b with cost([a, b)) <= T, or ``a`` if none.

        Exact for the float formula of ``stage_cost``: within a segment the cost is
        non-decreasing in b, so the answer is settled by evaluating that formula itself. A
        threshold on ``C[b]`` gives a first guess (one searchsorted); the guess is checked at b
        and b + 1, and only a wrong guess is corrected, by bisection on the index range left
        (at most log2(segment length) steps). Correcting the *threshold* instead, one ulp at a
        time, can take ~2**50 steps when ``C[a]`` is tiny next to ``T`` and ``x`` (zero or
        denormal compute costs before the stage): the solver looked hung.
        """
        R = self.floor.copy()
        a, l, h, x, Ca = self.active
        if a.size == 0:
            return R
        C = self.C

        def fits(i: np.ndarray, b: np.ndarray) -> np.ndarray:
            return (C[b] - Ca[i]) + x[i] <= T  # the same expression as stage_cost

        with np.errstate(invalid="ignore", over="ignore"):
            guess = np.searchsorted(C, Ca + (T - x), side="right") - 1  # NaN/inf guesses are fixed below
        # Invariant: the answer lies in [lo_b, hi_b]; lo_b fits (or is l - 1: nothing in the
        # segment fits) and hi_b + 1 does not fit (or hi_b is the segment's last end h).
        lo_b, hi_b = l - 1, h.copy()
        g = np.clip(guess, l - 1, h)
        idx = np.arange(a.size)
        at = g >= l
        ok = np.ones(a.size, bool)
        ok[at] = fits(idx[at], g[at])
        hi_b[~ok] = g[~ok] - 1  # the guess does not fit: the answer is below it
        lo_b[ok] = g[ok]
        nxt = ok & (g < h)
        up = np.zeros(a.size, bool)
        up[nxt] = fits(idx[nxt], g[nxt] + 1)
        lo_b[up] = g[up] + 1  # the next end fits too: the answer is above the guess
        hi_b[ok & ~up] = g[ok & ~up]  # settled: g fits and g + 1 does not (or g == h)
        open_ = np.flatnonzero(lo_b < hi_b)
        while open_.size:
            lb, hb = lo_b[open_], hi_b[open_]
            mid = hb - (hb - lb) // 2  # in (lb, hb]
            f = fits(open_, mid)
            lo_b[open_] = np.where(f, mid, lb)
            hi_b[open_] = np.where(f, hb, mid - 1)
            open_ = open_[lo_b[open_] < hi_b[open_]]
        b = lo_b
        first = np.flatnonzero(np.r_[True, a[1:] != a[:-1]])  # active entries stay sorted by a
        starts = a[first]
        R[starts] = np.maximum(R[starts], np.maximum.reduceat(np.where(b >= l, b, a), first))
        return R

    def next_event(self, R: np.ndarray) -> float:
        """Smallest bottleneck above the probe at which some ``R[a]`` grows (inf if none)."""
        a = np.flatnonzero(R < self.m)
        if a.size == 0:
            return float("inf")
        return float(self.stage_cost(a, R[a] + 1).min())

    def layers(self, R: np.ndarray, k: int) -> list[np.ndarray] | None:
        """``S[j][x]``: stage j can start at x with stages 0..j-1 all feasible; None if no cut."""
        m = self.m
        pos = np.arange(m)
        cur = pos == 0
        out = [cur]
        for j in range(1, k):
            reach = np.where(cur, R, -1)
            best = np.empty(m, np.int64)  # best[x] = max R[a] over reachable a < x
            best[0] = -1
            best[1:] = np.maximum.accumulate(reach[:-1])
            cur = (best >= pos) & (pos <= m - (k - j))  # leave a node for each later stage
            if not cur.any():
                return None
            out.append(cur)
        return out if (cur & (R == m)).any() else None

    @staticmethod
    def reconstruct(S: list[np.ndarray], R: np.ndarray, m: int) -> list[int]:
        """Walk back from the end taking the *latest* feasible start each time (deterministic)."""
        starts, end = [0] * len(S), m
        for j in range(len(S) - 1, 0, -1):
            a = int(np.flatnonzero(S[j][:end] & (R[:end] >= end))[-1])
            starts[j], end = a, a
        return starts

    #: Probes at the midpoint of the band's values; after that the midpoint of the floats in
    #: the band, which at most halves their number each probe: 64 more probes end any search.
    VALUE_PROBES = 64
    MAX_PROBES = VALUE_PROBES + 66

    @staticmethod
    def _float_midpoint(lo: float, hi: float) -> float:
        """A float T with lo <= T < hi halving the floats in [lo, hi) (for 0 <= lo < hi)."""
        i, j = (max(int(np.float64(v).view(np.int64)), 0) for v in (lo, hi))  # monotone for v >= 0
        return float(np.int64(i + (j - i) // 2).view(np.float64))

    def solve(self, k: int) -> list[int]:
        """Stage start positions of an optimal cut into exactly k stages (1 <= k <= m)."""
        m = self.m
        if not 1 <= k <= m:  # else the starts would repeat a position: an empty stage, silently
            raise ValueError(f"k={k} stages but the chain has {m} positions; need 1 <= k <= {m}")
        if k == m:
            return list(range(m))
        if self.has_transfer:
            # The compute-only optimum is a lower bound (transfer adds >= 0, also in floats)
            # and its cut is a good first feasible answer: the search starts in a narrow band.
            plain = Chain(self.cost)
            best = plain.solve(k)
            lo, hi = plain.bottleneck(best), self.bottleneck(best)
        else:
            # Any valid cut (equal compute shares) bounds from above. Below: the stage holding
            # position i costs at least C[i+1] - C[i] (subtraction is monotone), and the stages
            # add up to the total, shaved by a rounding margin so it stays below their max.
            total = self.C[-1]
            starts = np.searchsorted(self.C, total * np.arange(k) / k, side="left")
            starts[0] = 0
            for j in range(1, k):
                starts[j] = min(max(starts[j], starts[j - 1] + 1), m - (k - j))
            best = [int(s) for s in starts]
            hi = self.bottleneck(best)
            lo = max(total / k * (1 - 1e-9), float(np.diff(self.C).max()), 0.0)
        self.floor = np.arange(m)  # R[a] >= floor[a] for every probe still to come
        self.active = (self.ea, self.elo, self.ehi, self.ex, self.C[self.ea])
        # Invariant: lo <= optimum <= hi = bottleneck(best). Every probe T in [lo, hi) strictly
        # narrows the band: a feasible one finds a cut costing <= T, an infeasible one proves
        # the optimum > T. Stage costs are floats, so the search ends with hi the exact optimum.
        for probe in range(self.MAX_PROBES):
            if not lo < hi:
                break
            self.narrow(lo, hi)
            T = lo + (hi - lo) / 2 if probe < self.VALUE_PROBES else self._float_midpoint(lo, hi)
            if not lo <= T < hi:
                T = lo
            R = self.reach(T)
            S = self.layers(R, k)
            if S is None:
                # Nothing changes below the next event, so the optimum is >= it; it is > T by
                # construction, and in any case the optimum (a float) is >= the float after T.
                event = self.next_event(R)
                lo = event if event > T else float(np.nextafter(T, np.inf))
            else:
                cut = self.reconstruct(S, R, m)
                cost = self.bottleneck(cut)  # <= T: reach uses the same formula
                if not cost <= T:
                    raise RuntimeError(f"partition: probe {T!r} found a cut costing {cost!r} (internal error)")
                best, hi = cut, cost
        else:
            raise RuntimeError(f"partition: no optimum after {self.MAX_PROBES} probes (internal error)")
        # Canonical answer: latest cuts among all partitions with the optimal bottleneck, none
        # without compute where one exists (balanced by parameters, a stage of a GELU alone held
        # no parameter: its rank's optimizer got an empty list, a trial)
        R = self.reach(hi)
        S = self.layers(R, k)
        cut = self.reconstruct(S, R, m) if S is not None else best
        if not all((self.cost[a:b] > 0).any() for a, b in zip(cut, cut[1:] + [m])):
            cut = self.with_compute(R, k) or cut
        return cut

    def with_compute(self, R: np.ndarray, k: int) -> list[int] | None:
        """The latest cut into k stages each ending by ``R`` of its start and each holding
        some compute (a position of cost > 0), or None if there is none."""
        m = self.m
        positive = np.flatnonzero(self.cost > 0)
        if positive.size < k:
            return None
        # P[a]: the least end of a stage starting at a that holds compute (m + 1: none)
        after = np.searchsorted(positive, np.arange(m), side="left")
        P = np.where(after < positive.size, positive[np.minimum(after, positive.size - 1)] + 1, m + 1)
        layers = [np.arange(m) == 0]
        for _ in range(1, k):
            a = np.flatnonzero(layers[-1] & (P <= R))
            diff = np.zeros(m + 2, np.int64)
            np.add.at(diff, P[a], 1)
            np.add.at(diff, R[a] + 1, -1)
            layers.append(np.cumsum(diff)[:m] > 0)
        starts, end = [0] * k, m
        for j in range(k - 1, -1, -1):
            fit = np.flatnonzero(layers[j][:end] & (P[:end] <= end) & (R[:end] >= end))
            if fit.size == 0:
                return None
            starts[j], end = int(fit[-1]), int(fit[-1])
        return starts if end == 0 else None


def split_chain(costs: Sequence[float], n_parts: int) -> list[int]:
    """Optimal contiguous split of a chain minimising the largest block sum; block sizes.

    Exact (unlike torchgpipe's block-partition heuristic), which matters for balance_by_size
    where one huge layer dominates. Among optimal splits (those whose every block holds a cost
    above zero, where any does), the last block starts as late as possible, then the one before
    it, and so on.
    """
    n = len(costs)
    if n_parts < 1 or n_parts > n:
        raise ValueError(f"n_parts={n_parts} but there are {n} costs; need 1 <= n_parts <= {n}")
    starts = Chain(costs).solve(n_parts)
    return [b - a for a, b in zip(starts, starts[1:] + [n])]
