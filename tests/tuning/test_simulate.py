"""The schedule simulator on hand-made cost tables with known answers."""

from __future__ import annotations

import pytest

from fxpipe.tuning._orders import (Action, check_complete, placement, single_process_1f1b, single_process_order,
                                   torch_orders)
from fxpipe.tuning._simulate import simulate


def uniform(f: float, b: float, w: float = 0.0):
    def duration(a: Action) -> float:
        return {"F": f, "B": b + w, "I": b, "W": w}[a.kind]
    return duration


@pytest.mark.parametrize("k,m", [(2, 1), (2, 4), (4, 4), (4, 8), (8, 3), (3, 16)])
def test_gpipe_uniform_bubble_is_the_papers_formula(k: int, m: int) -> None:
    """K equal stages on K devices, M micro-batches: bubble (K-1)/(M+K-1), step (M+K-1)(f+b),
    for the single-process order and for torch's ScheduleGPipe table alike."""
    f, b = 1.0, 2.0
    orders = {d: [a for a in single_process_order(k, m) if a.stage == d] for d in range(k)}
    single = simulate(orders, uniform(f, b), list(range(k)))
    table = simulate(torch_orders("gpipe", k, m), uniform(f, b), list(range(k)))
    for t in (single, table):
        assert t.step_s == pytest.approx((m + k - 1) * (f + b))
        assert t.bubble == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("k,m", [(2, 4), (4, 4), (4, 8)])
def test_1f1b_uniform_has_gpipes_step(k: int, m: int) -> None:
    """1F1B reorders, it does not shorten: the same (M+K-1)(f+b) for equal stages."""
    t = simulate(torch_orders("1f1b", k, m), uniform(1.0, 2.0), list(range(k)))
    assert t.step_s == pytest.approx((m + k - 1) * 3.0)
    assert t.bubble == pytest.approx((k - 1) / (m + k - 1))


@pytest.mark.parametrize("k,m", [(2, 2), (3, 4), (4, 8)])
def test_one_process_1f1b_waits_between_ticks_and_backwards(k: int, m: int) -> None:
    """fxpipe.pipeline's 1F1B on K devices: each tick's forwards run together (f), then the
    finished micro-batch's backward through every stage alone (K * b), since the caller waits
    for each: (M + K - 1) ticks of f plus M backwards of K * b. Without the waits the next
    tick's forwards would overlap that backward."""
    f, b = 1.0, 2.0
    order, after = single_process_1f1b(k, m)
    check_complete({0: order}, k, m)
    orders = {d: [a for a in order if a.stage == d] for d in range(k)}
    t = simulate(orders, uniform(f, b), list(range(k)), after=after)
    assert t.step_s == pytest.approx((m + k - 1) * f + m * k * b)
    assert simulate(orders, uniform(f, b), list(range(k))).step_s < t.step_s


def test_one_device_runs_everything_in_turn() -> None:
    """All stages on one device (fxpipe.pipeline on ['cpu'] * K): the step is the sum, no bubble."""
    k, m = 4, 8
    t = simulate({"cpu": single_process_order(k, m)}, uniform(1.0, 2.0), ["cpu"] * k)
    assert t.step_s == pytest.approx(k * m * 3.0)
    assert t.bubble == pytest.approx(0.0)


def test_sends_between_devices_delay_the_receiver() -> None:
    """Two stages, one micro-batch, a send of 0.5 each way: f0 + s + f1 + b1 + s + b0."""
    durations = {("F", 0): 1.0, ("F", 1): 2.0, ("B", 1): 4.0, ("B", 0): 3.0}
    orders = {0: [Action("F", 0, 0), Action("B", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    t = simulate(orders, lambda a: durations[(a.kind, a.stage)], [0, 1], send_s=lambda a: 0.5)
    assert t.step_s == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3)
    assert t.start[Action("B", 0, 0)] == pytest.approx(8.0)
    one = [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]
    same = simulate({0: one}, lambda a: durations[(a.kind, a.stage)], [0, 0], send_s=lambda a: 0.5)
    assert same.step_s == pytest.approx(10.0)  # same device: nothing is sent


def test_each_send_costs_both_devices_their_own_time() -> None:
    """The same two stages with a send overhead of 0.25: each of the two sends adds it to the
    action that hands it on and to the one that takes it in, 4 x 0.25 on the critical path; on
    one device nothing is sent and nothing is added. With 1F1B on 2 devices and 4 micro-batches,
    every F and B has one crossing: each device is busy 8 x 0.25 longer."""
    durations = {("F", 0): 1.0, ("F", 1): 2.0, ("B", 1): 4.0, ("B", 0): 3.0}
    orders = {0: [Action("F", 0, 0), Action("B", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    cost = lambda a: durations[(a.kind, a.stage)]  # noqa: E731
    t = simulate(orders, cost, [0, 1], send_s=lambda a: 0.5, overhead_s=0.25)
    assert t.step_s == pytest.approx(1 + 0.5 + 2 + 4 + 0.5 + 3 + 4 * 0.25)
    assert t.end[Action("F", 0, 0)] == pytest.approx(1.25)  # it hands its output on
    assert t.start[Action("B", 0, 0)] == pytest.approx(8.0 + 3 * 0.25)
    one = [Action("F", 0, 0), Action("F", 1, 0), Action("B", 1, 0), Action("B", 0, 0)]
    assert simulate({0: one}, cost, [0, 0], overhead_s=0.25).step_s == pytest.approx(10.0)
    base = simulate(torch_orders("1f1b", 2, 4), uniform(1.0, 2.0), [0, 1])
    loaded = simulate(torch_orders("1f1b", 2, 4), uniform(1.0, 2.0), [0, 1], overhead_s=0.25)
    for d in (0, 1):
        assert loaded.busy_s[d] == pytest.approx(base.busy_s[d] + 8 * 0.25)
    # a V keeps two stages on each device: the hand-over between them is no send
    zbv = torch_orders("zbv", 2, 4)
    where = placement("zbv", 2, 2)
    plain = simulate(zbv, uniform(1.0, 1.0, 1.0), where)
    with_cost = simulate(zbv, uniform(1.0, 1.0, 1.0), where, overhead_s=0.25)
    assert where == [0, 1, 1, 0]
    # per micro-batch, rank 0: F0 hands on to 1, I0 takes in from 1, F3 from 2, I3 hands back to 2;
    # rank 1 the other ends of those four; F1 -> F2 and I2 -> I1 stay on rank 1; W sends nothing
    for d in (0, 1):
        assert with_cost.busy_s[d] == pytest.approx(plain.busy_s[d] + 4 * 4 * 0.25)


def test_unequal_stages_are_bound_by_the_slowest() -> None:
    """GPipe with a stage twice as slow: step = f+b of the others once + M * slowest (its busy
    period) -- (1+2) * 1 ... checked against the hand schedule for K=2, M=3."""
    cost = {0: (1.0, 2.0), 1: (2.0, 4.0)}
    orders = {d: [a for a in single_process_order(2, 3) if a.stage == d] for d in range(2)}
    t = simulate(orders, lambda a: cost[a.stage][0 if a.kind == "F" else 1], [0, 1])
    # stage 1 forwards at 1..3, 3..5, 5..7; backwards 7..11, 11..15, 15..19; stage 0's last backward 19..21
    assert t.step_s == pytest.approx(21.0)
    assert t.end[Action("F", 1, 2)] == pytest.approx(7.0)


def test_a_circular_wait_is_refused() -> None:
    orders = {0: [Action("B", 0, 0), Action("F", 0, 0)], 1: [Action("F", 1, 0), Action("B", 1, 0)]}
    with pytest.raises(ValueError, match="wait on each other"):
        simulate(orders, uniform(1.0, 1.0), [0, 1])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b", "interleavedzb", "zbv"])
def test_torch_tables_are_complete_and_the_simulation_keeps_their_order(schedule: str) -> None:
    world, m = 4, 8
    orders = torch_orders(schedule, world, m)
    spr = 2 if schedule in ("interleaved1f1b", "interleavedzb", "zbv") else 1
    where = placement(schedule, world, spr)
    check_complete(orders, world * spr, m)
    t = simulate(orders, uniform(1.0, 1.0, 1.0), where)
    for rank, actions in orders.items():
        assert all(where[a.stage] == rank for a in actions)
        ran = [a for a in t.order() if where[a.stage] == rank]
        assert ran == list(actions)  # each rank runs torch's order, in torch's order


def test_zero_bubble_v_beats_1f1b_on_equal_passes() -> None:
    """F = I = W: ZB-V fills 1F1B's bubble with weight passes (the schedule's point)."""
    world, m = 4, 8
    one = simulate(torch_orders("1f1b", world, m), uniform(2.0, 2.0, 2.0), placement("1f1b", world, 1))
    # the same model cut in twice as many stages, each half the work
    zbv = simulate(torch_orders("zbv", world, m), uniform(1.0, 1.0, 1.0), placement("zbv", world, 2))
    assert zbv.step_s < one.step_s
    assert zbv.bubble < one.bubble


@pytest.mark.parametrize("schedule,world,chunks", [("1f1b", 4, 3), ("interleaved1f1b", 2, 5), ("interleavedzb", 2, 7)])
def test_no_order_for_what_fxpipe_distributed_refuses(schedule: str, world: int, chunks: int) -> None:
    """torch's tables exist for these, but fxpipe.distributed.pipeline refuses them: the tuner
    predicts no order (its candidate says why) instead of recommending what cannot be built."""
    with pytest.raises(ValueError, match="chunks"):
        torch_orders(schedule, world, chunks)
