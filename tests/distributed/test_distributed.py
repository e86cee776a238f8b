"""fxpipe.distributed against eager: gloo ranks on 127.0.0.1, spawned by torch.multiprocessing.

The case tables and the tests; the models are in tests/dist_models.py, the spawned ranks and
the comparison with eager (3 SGD steps, the first accumulated over two ``step()`` calls) in
tests/dist_harness.py.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from dist_harness import SLOW_SPAWN_SECONDS, check, check_dropout_acted, check_same, free_port, spawn
from dist_models import case
from exact import assert_close_scaled
from fxpipe.distributed._schedules import check_schedule, rank_of_stage, stages_of_rank
from fxpipe.errors import ArgumentError

#: name -> (schedule, stages_per_rank, chunks). A name ending in a checkpoint mode builds
#: with it, others with the default ('except_last'); '-bf16' trains under bf16 CPU autocast;
#: "drop" cases (dropout) are compared with each other, not with eager
CASES = {
    "mlp-gpipe": ("gpipe", 1, 2),
    "mlp-1f1b": ("1f1b", 1, 4),
    "unet-gpipe": ("gpipe", 1, 2),
    "gpt-1f1b": ("1f1b", 1, 4),
    "shape-gpipe": ("gpipe", 1, 2),
    "dict-1f1b": ("1f1b", 1, 4),
    "paths-zbv": ("zbv", 2, 6),
    "unet-zbv-always": ("zbv", 2, 6),
    "mlp-1f1b-always": ("1f1b", 1, 4),
    "unet-gpipe-always": ("gpipe", 1, 2),
    "unet-gpipe-never": ("gpipe", 1, 2),
    "mlp-gpipe-bf16-always": ("gpipe", 1, 2),
    "mlp-gpipe-bf16-never": ("gpipe", 1, 2),
    "drop-1f1b-except_last": ("1f1b", 1, 4),
    "drop-1f1b-always": ("1f1b", 1, 4),
    "drop-1f1b-never": ("1f1b", 1, 4),
}
#: the matrix of issue 11 on 3 ranks: one stage per rank, and zbv (a V of 6 stages)
MATRIX_MODELS = ("gpt", "unet", "dict", "hf")
SLOW_CASES_3 = {
    **{f"{m}-{s}": spec for m in MATRIX_MODELS
       for s, spec in (("gpipe", ("gpipe", 1, 2)), ("1f1b", ("1f1b", 1, 4)), ("zbv", ("zbv", 2, 6)))},
    "unet-zbv-never": ("zbv", 2, 6),
    "paths-interleavedzb": ("interleavedzb", 2, 6),
    "drop-zbv-except_last": ("zbv", 2, 6),
    "drop-zbv-always": ("zbv", 2, 6),
    "drop-zbv-never": ("zbv", 2, 6),
    "mlp-zbv-bf16-always": ("zbv", 2, 6),
    "mlp-zbv-bf16-never": ("zbv", 2, 6),
}
#: on 2 ranks: two stages per rank (4 stages); a V of 4 stages
SLOW_CASES_2 = {
    **{f"{m}-{s}-x2": spec for m in MATRIX_MODELS
       for s, spec in (("interleaved1f1b", ("interleaved1f1b", 2, 4)), ("zbv", ("zbv", 2, 4)),
                       ("interleavedzb", ("interleavedzb", 2, 4)))},
    "unet-gpipe-x2": ("gpipe", 2, 2),
    "unet-gpipe": ("gpipe", 1, 2),
    "unet-1f1b": ("1f1b", 1, 2),
    "unet-1f1b-always": ("1f1b", 1, 2),
    "gpt-zbv-x2-always": ("zbv", 2, 4),
    "mlp-gpipe-x2-always": ("gpipe", 2, 2),
    "drop-gpipe-x2-always": ("gpipe", 2, 2),
    "drop-gpipe-x2-never": ("gpipe", 2, 2),
}


#: on 2 ranks in CI: the U-Net (two-sample micro-batches: strided input gradients) under the
#: zero-bubble schedules; recomputation counted across ranks; fewer micro-batches than stages
#: (torch's rules: zbv any number, the interleaved ones a multiple of their rounds)
TWO_RANK_CASES = {
    "unet-zbv-x2": ("zbv", 2, 4),
    "unet-interleavedzb-x2": ("interleavedzb", 2, 4),
    "counted-zbv-x2-always": ("zbv", 2, 4),
    "mlp-zbv-x2-c2": ("zbv", 2, 2),
    "gpt-interleaved1f1b-x2-c3": ("interleaved1f1b", 2, 3),
    "dict-interleavedzb-x2-c3": ("interleavedzb", 2, 3),
}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(2, TWO_RANK_CASES, tmp_path_factory.mktemp("dist2"))


@pytest.mark.parametrize("name", TWO_RANK_CASES)
def test_exact_against_eager_on_two_ranks(two_ranks: list[dict], name: str) -> None:
    check(two_ranks, {name: TWO_RANK_CASES[name]})


@pytest.fixture(scope="module")
def three_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return spawn(3, CASES, tmp_path_factory.mktemp("dist3"), {"misc": True, "bn": ("gpipe", 1, 2)})


EXACT_CASES = [n for n in CASES if not n.startswith("drop")]


@pytest.mark.parametrize("name", EXACT_CASES)
def test_exact_against_eager_on_three_ranks(three_ranks: list[dict], name: str) -> None:
    """Losses, every rank's gradients before and parameters after each of 3 SGD steps (the
    first accumulated over two steps), eval outputs; a batch of another shape refused on
    every rank with BatchShapeError."""
    check(three_ranks, {name: CASES[name]})


def test_dropout_is_the_same_in_every_checkpoint_mode(three_ranks: list[dict]) -> None:
    names = [n for n in CASES if n.startswith("drop")]
    check_same(three_ranks, names)
    check_dropout_acted(three_ranks, names[0], CASES[names[0]][2])


def test_bf16_autocast_is_the_same_checkpointed_or_not(three_ranks: list[dict]) -> None:
    """Under bf16 CPU autocast, checkpoint='always' recomputes in bf16 as the forward ran:
    bit-identical to 'never' (and both close to eager under autocast: the exact cases)."""
    check_same(three_ranks, ["mlp-gpipe-bf16-always", "mlp-gpipe-bf16-never"])


def test_tied_embedding_gradient_is_summed_over_its_ranks(three_ranks: list[dict]) -> None:
    holders = [r for r, res in enumerate(three_ranks) if "tok.weight" in res["gpt-1f1b"]["names"]]
    assert holders == [0, 2]  # the embedding on the first stage, the LM head on the last


def test_building_leaves_buffers_as_they_were(three_ranks: list[dict]) -> None:
    """The fake run finding the stage metadata must not bump BatchNorm's num_batches_tracked."""
    assert [res["build_keeps_state"] for res in three_ranks] == [True] * 3
    assert [res["released"] for res in three_ranks] == [True] * 3  # the other ranks' stages, on meta


def test_recomputation_does_not_update_buffers_twice(three_ranks: list[dict]) -> None:
    assert [res["bn_buffers_same"] for res in three_ranks] == [True] * 3


def test_ranks_with_different_code_all_raise(three_ranks: list[dict]) -> None:
    assert [res["mismatch"] for res in three_ranks] == ["PlanMismatchError"] * 3


def test_training_mode_batch_mixing_is_refused_on_every_rank(three_ranks: list[dict]) -> None:
    for res in three_ranks:
        assert res["train_refused"].startswith("MicroBatchError"), res["train_refused"]
        assert "'n'" in res["train_refused"] and "training mode" in res["train_refused"]


def test_a_step_under_another_autocast_state_is_refused(three_ranks: list[dict]) -> None:
    for res in three_ranks:
        assert res["autocast_refused"].startswith("DistributedError"), res["autocast_refused"]
        assert "bfloat16" in res["autocast_refused"] and "no autocast" in res["autocast_refused"]
    assert len({res["after_refusal"] for res in three_ranks}) == 1


@pytest.mark.slow
def test_matrix_on_three_ranks(tmp_path: Path) -> None:
    """Tied GPT, U-Net, dict model, HF GPT-2 under gpipe, 1f1b and zbv (a V of 6 stages);
    checkpoint modes and bf16 autocast under zbv; BatchNorm recomputed twice per backward."""
    results = spawn(3, SLOW_CASES_3, tmp_path, {"bn": ("zbv", 2, 6)}, SLOW_SPAWN_SECONDS)
    check(results, SLOW_CASES_3)
    check_same(results, [n for n in SLOW_CASES_3 if n.startswith("drop")])
    check_same(results, ["mlp-zbv-bf16-always", "mlp-zbv-bf16-never"])
    assert [res["bn_buffers_same"] for res in results] == [True] * 3
    holders = [r for r, res in enumerate(results) if "tok.weight" in res["gpt-zbv"]["names"]]
    assert holders == [0]  # V: the first and the last stage on rank 0, no all-reduce needed


@pytest.mark.slow
def test_matrix_with_two_stages_per_rank(tmp_path: Path) -> None:
    """The four models under interleaved1f1b, zbv and interleavedzb on 2 ranks (4 stages),
    and more checkpoint modes with several stages per rank."""
    results = spawn(2, SLOW_CASES_2, tmp_path, None, SLOW_SPAWN_SECONDS)
    check(results, SLOW_CASES_2)
    check_same(results, [n for n in SLOW_CASES_2 if n.startswith("drop")])


def test_placement_is_the_schedules() -> None:
    """rank_of_stage is what torch's own helper computes for the looped and the V styles."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    for world in (1, 2, 3, 4):
        for schedule, per_rank in (("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("interleaved1f1b", 3),
                                   ("interleavedzb", 2), ("zbv", 2)):
            style = "v" if schedule == "zbv" else "loop"
            torch_map = generate_stage_to_rank_mapping(world, world * per_rank, style=style)
            assert rank_of_stage(schedule, world, per_rank) == [torch_map[k] for k in range(world * per_rank)]
            for rank in range(world):
                assert stages_of_rank(schedule, world, per_rank, rank) == [
                    k for k in range(world * per_rank) if torch_map[k] == rank]


def test_schedule_arguments_are_checked() -> None:
    """Refused with ArgumentError (a ValueError) naming the argument and what to use."""
    refusals = [
        (("zbv", 1, 8, 2), "stages_per_rank", r"'zbv' runs exactly 2 stages per rank .*stages_per_rank=1"),
        (("interleavedzb", 1, 8, 2), "schedule", r"'interleavedzb' does not run one stage per rank.*'gpipe', '1f1b'"),
        (("1f1b", 1, 2, 3), "chunks", r"'1f1b' needs chunks >= the number of stages \(3\).*got chunks=2"),
        (("interleavedzb", 2, 7, 3), "chunks",
         r"multiple of its number of rounds, max\(1, chunks // world_size\) = 2.*got chunks=7: use chunks=6 or 8"),
        (("interleaved1f1b", 2, 5, 2), "chunks", r"= 2.*got chunks=5: use chunks=4 or 6, or schedule='gpipe' or 'zbv'"),
        (("zb", 2, 8, 2), "schedule",
         r"schedule must be one of 'gpipe', '1f1b', 'interleaved1f1b', 'interleavedzb', 'zbv', got 'zb'"),
    ]
    for args, argument, message in refusals:
        with pytest.raises(ArgumentError, match=message) as caught:
            check_schedule(*args)
        assert caught.value.argument == argument
    # torch's rules, no stricter: zbv and gpipe with fewer micro-batches than stages, the
    # interleaved schedules with any multiple of their rounds (run exact in TWO_RANK_CASES)
    for args in [("zbv", 2, 1, 2), ("zbv", 2, 3, 2), ("gpipe", 2, 1, 3), ("1f1b", 1, 3, 3),
                 ("interleaved1f1b", 2, 3, 2), ("interleavedzb", 2, 4, 3), ("interleavedzb", 2, 5, 3)]:
        check_schedule(*args)


def test_time_balance_profiles_one_micro_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """balance_by='time' times what every stage runs, one micro-batch (a weight-bound layer
    costs nearly as much on a micro-batch as on the whole batch), and 'params' sizes it;
    'memory' plans on the whole sample (a pipeline holds every micro-batch's activations).
    The one decision is fxpipe.plan._make.profiled_inputs, shared with fxpipe.pipeline. One
    rank, in-process."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    import fxpipe.plan._make as planning

    seen: list[tuple[str, tuple[int, ...]]] = []
    original = planning.profiled_inputs

    def recording(captured: object, args: tuple, kwargs: dict, balance_by: str, *rest: object) -> list:
        flat = original(captured, args, kwargs, balance_by, *rest)  # type: ignore[arg-type]
        seen.append((balance_by, tuple(flat[0].shape)))
        return flat

    monkeypatch.setattr(planning, "profiled_inputs", recording)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model, x, y, loss_fn, _ = case("mlp")
        for balance_by in ("time", "params", "memory"):
            pipe = fpd.pipeline(model, x, chunks=4, loss_fn=loss_fn, balance_by=balance_by, timeout=60)
            assert_close_scaled(pipe.step(x, target=y), loss_fn(model(x), y).detach(), what="loss merged")
            pipe.close()
    finally:
        dist.destroy_process_group()
    assert seen == [("time", (2, 8)), ("params", (2, 8)), ("memory", (8, 8))]
