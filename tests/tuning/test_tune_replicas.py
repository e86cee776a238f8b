"""``fxpipe.tune`` proposing ``dp x pp`` (issue #32): replicas of a shorter pipeline predicted
as that pipeline on its share of the batch, plus the gradients' all-reduce (``'ddp'``) or the
parameters' all-gather and the gradients' reduce-scatter with the stages sharded (``'fsdp'``),
and said why; the ``'fsdp'`` prediction against a measured run on gloo ranks."""

from __future__ import annotations

import pytest

import fxpipe
from fxpipe.cli._gpus import GPUS

LLAMA = {"num_hidden_layers": 4, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
         "num_key_value_heads": 4, "vocab_size": 128}
H100 = GPUS["h100"]
LINK = 25e9


def _meta_llama():
    import torch
    import transformers as T

    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**LLAMA, use_cache=False))
    return model, torch.zeros(8, 32, dtype=torch.long, device="meta")


def _tune(devices: int, batch: int, **more):
    model, x = _meta_llama()
    options = dict(device_flops=H100.device_flops, bandwidth=H100.bandwidth, link=LINK, schedules=("1f1b",),
                   checkpoint=("never",), chunks=[2, 4], batch=batch)
    return fxpipe.tune(model, x, devices, **{**options, **more})


def test_replicas_are_a_shorter_pipeline_on_a_share_of_the_batch_plus_the_allreduce() -> None:
    pytest.importorskip("transformers")
    four = _tune(4, 16)
    two = _tune(2, 8, replicas=())  # one replica's pipeline, alone, on its share
    assert {c.kwargs["data_parallel"] for c in four.choices if c.replicas == 2} == {"ddp", "fsdp"}
    replicated = [c for c in four.choices if c.replicas == 2 and c.kwargs["data_parallel"] == "ddp"]
    assert replicated and all(c.n_stages == 2 for c in replicated)
    assert not any(c.replicas == 4 for c in four.choices)  # a pipeline of one device is not proposed
    alone = {(c.chunks, c.checkpoint): c for c in two.choices if c.distributed}
    for c in replicated:
        base = alone[c.chunks, c.checkpoint]
        assert c.allreduce_s > 0
        assert c.step_s == pytest.approx(base.step_s + c.allreduce_s, rel=1e-9)
        assert c.peak == pytest.approx(base.peak, rel=1e-9)  # 'ddp': each replica holds its stages whole
    text = str(four)
    assert "replicas" in text.splitlines()[[i for i, line in enumerate(text.splitlines())
                                            if line.startswith("rank")][0]]


def test_the_allreduce_is_the_largest_devices_gradients_over_the_link() -> None:
    pytest.importorskip("transformers")
    t = _tune(4, 16)
    c = next(c for c in t.choices if c.replicas == 2 and c.kwargs["data_parallel"] == "ddp")
    # a ring all-reduce over 2 replicas sends each device's gradient bytes once each way
    # (2 * (dp - 1) / dp = 1), no latency given; one stage per device, nothing tied in this Llama
    largest = max(stage.param_bytes for stage in c.plan.stages)
    assert c.allreduce_s == pytest.approx(largest / LINK, rel=1e-9)


def test_no_replicas_when_asked_for_none() -> None:
    pytest.importorskip("transformers")
    assert all(c.replicas == 1 for c in _tune(4, 16, replicas=()).choices)


def test_the_best_with_replicas_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from fxpipe.cli._main import main

    args = ["tune", "hf:llama", *[x for k, v in LLAMA.items() for x in ("--set", f"{k}={v}")], "--devices", "8",
            "--batch", "32x64", "--gpu", "h100", "--link", "50GB/s", "--schedules", "1f1b", "--checkpoint", "never",
            "--no-progress"]
    assert main(args) == 0
    out = capsys.readouterr().out
    best = out.strip().splitlines()[-1]
    assert best.startswith("best: ") and "replicas of 1f1b" in best and "data_parallel='ddp'" in best, best
    assert "the gradients' all-reduce adds" in out and "each device holds its stages whole" in out, out
    assert main([*args, "--replicas"]) == 0  # none
    best = capsys.readouterr().out.strip().splitlines()[-1]
    assert "replicas" not in best, best


# -- data_parallel='fsdp' ---------------------------------------------------------------------
#: a Llama whose parameters (and Adam's state over them) outweigh its activations
WIDE = {**LLAMA, "hidden_size": 256, "intermediate_size": 512, "vocab_size": 512}
FAST_LINK = 900e9


def _tune_wide(**more):
    import torch
    import transformers as T

    with torch.device("meta"):
        model = T.LlamaForCausalLM(T.LlamaConfig(**WIDE, use_cache=False))
    x = torch.zeros(8, 8, dtype=torch.long, device="meta")
    options = dict(device_flops=H100.device_flops, bandwidth=H100.bandwidth, link=FAST_LINK, schedules=("1f1b",),
                   checkpoint=("never",), chunks=[2, 4], batch=32, replicas=[2])
    return fxpipe.tune(model, x, 4, **{**options, **more})


def _twins(tuning):
    """(the 'ddp' choice, its 'fsdp' twin) for each replicated configuration."""
    by = {(c.schedule, c.chunks, c.checkpoint, c.kwargs.get("data_parallel")): c for c in tuning.choices
          if c.replicas > 1}
    return [(c, by[key[:3] + ("fsdp",)]) for key, c in by.items() if key[3] == "ddp" and key[:3] + ("fsdp",) in by]


def _stage_bytes(c):
    """Per device label: the bytes of its stage's parameters (one stage per rank; all trained;
    and the rotary embedding's small buffer)."""
    return {str(s): float(stage.param_bytes) for s, stage in enumerate(c.plan.stages)}


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_fsdp_is_proposed_beside_ddp_and_holds_less_where_the_optimizer_state_dominates(optimizer: str) -> None:
    pytest.importorskip("transformers")
    t = _tune_wide(optimizer=optimizer)
    twins = _twins(t)
    assert len(twins) == 2  # chunks 2 and 4, each as 'ddp' and as 'fsdp'
    for ddp, fsdp in twins:
        assert fsdp.replicas == 2 and fsdp.n_stages == 2 and fsdp.plan is ddp.plan
        params = _stage_bytes(fsdp)
        for device, p in params.items():
            # between steps 1/dp of the parameters and of Adam's two copies; the whole parameters
            # and gradients during the step, as 'ddp' holds them
            state = {"adam": 2, "sgd": 0}[optimizer] * p
            # (the plan's bytes also count the rotary embedding's buffer, which FSDP does not shard: 256 B)
            assert fsdp.static_bytes[device] == pytest.approx(ddp.static_bytes[device] + p / 2 - state / 2, abs=1024)
        if optimizer == "adam":  # the optimizer's state outweighs a shard of the parameters
            assert fsdp.peak < ddp.peak
        else:  # nothing to shard but the parameters, whose shard comes on top of the whole ones
            assert fsdp.peak > max(ddp.static_bytes.values())
        # one all-gather per stage on the pipeline's fill, one reduce-scatter at the end
        p = list(params.values())
        assert fsdp.allreduce_s == pytest.approx((sum(p) + max(p)) / 2 / FAST_LINK, rel=1e-4)
        assert fsdp.step_s - fsdp.allreduce_s == pytest.approx(ddp.step_s - ddp.allreduce_s, rel=1e-9)
    assert "2 fsdp" in str(t) and "2 ddp" in str(t)


def test_fsdp_is_chosen_when_ddp_does_not_fit_and_the_note_says_why() -> None:
    pytest.importorskip("transformers")
    free = _tune_wide()
    assert free.best.kwargs["data_parallel"] == "ddp"  # no limit: as fast, and no gathers on the fill
    assert "data_parallel='fsdp' instead:" in " ".join(free.notes)
    ddp, fsdp = min(_twins(free), key=lambda pair: pair[1].step_s)
    assert fsdp.peak < min(c.peak for c in free.choices if c.kwargs.get("data_parallel") == "ddp")
    t = _tune_wide(memory=fsdp.peak)
    best = t.best
    assert best.kwargs["data_parallel"] == "fsdp" and (best.chunks, best.replicas) == (fsdp.chunks, 2)
    assert best.peak == pytest.approx(fsdp.peak, rel=1e-9)
    unfit = [c for c in t.choices if c.kwargs.get("data_parallel") == "ddp"]
    assert unfit and not any(c.fits for c in unfit)
    assert all("data_parallel='ddp'" in c.why and c.why.startswith("needs ") for c in unfit)
    note = next(n for n in t.notes if n.startswith("2 replicas"))
    assert "data_parallel='fsdp'" in note and "all-gather" in note and "1/2 of its stages' parameters" in note
    assert "data_parallel='ddp' instead: needs" in note and "more than the memory given" in note, note


def test_fsdp_is_proposed_for_every_schedule_and_a_refused_one_listed_once() -> None:
    """fxpipe.distributed shards one stage per rank and two (interleaved, zbv): a twin of each."""
    pytest.importorskip("transformers")
    t = _tune(4, 16, schedules=("1f1b", "zbv", "interleaved1f1b"), chunks=[4])
    for c in t.choices:
        if c.replicas > 1 and c.kwargs["data_parallel"] == "ddp" and c.peak_bytes:
            twin = [o for o in t.choices if o.replicas > 1 and o.kwargs["data_parallel"] == "fsdp"
                    and (o.schedule, o.chunks, o.checkpoint) == (c.schedule, c.chunks, c.checkpoint)]
            assert len(twin) == 1, c.schedule
    assert {c.schedule for c in t.choices if c.kwargs.get("data_parallel") == "fsdp"} >= {"zbv", "interleaved1f1b"}
    # one refused before it was predicted (1f1b's chunks < stages) is listed once, not as a twin
    refused = [c for c in _tune(4, 16, chunks=[1]).choices if c.replicas > 1]
    assert len(refused) == 1 and not refused[0].fits and "refuses" in refused[0].why


# -- against a measured run ---------------------------------------------------------------------
MLP_WIDTH, MLP_BATCH = 512, 16


def _mlp(tied: bool = False):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.Tanh())])
    if tied:  # the first and the last layer share their weight: one rank's two stages under zbv
        model[6].weight = model[0].weight
    return model


def _held_bytes(skip: list) -> int:
    """Every CPU tensor storage alive in this process, once each (``skip``: the batches)."""
    import gc
    import warnings

    import torch

    gc.collect()
    seen, left_out = {}, {t.untyped_storage().data_ptr() for t in skip}
    with warnings.catch_warnings():  # isinstance on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for o in found:
        if not o.is_meta:
            try:
                storage = o.untyped_storage()
                ptr = storage.data_ptr()
            except (RuntimeError, NotImplementedError):  # a DTensor: its local shard is found on its own
                continue
            if ptr not in left_out:
                seen[ptr] = storage.nbytes()
    return sum(seen.values())


def _rise(fn) -> int:
    """The most bytes ``fn()`` had allocated at once, above what existed before (the CPU
    allocator's records under the profiler, as tests/tuning/test_peak_measured.py reads them)."""
    from fxpipe.tuning._loss_memory import cpu_rise

    return cpu_rise(fn)


def _measure_worker(rank: int, world: int, port: int, kwargs: dict, zero_grad: str, tied: bool, out: str) -> None:
    """One rank of 2 replicas x 2 stages: per data_parallel, the bytes held when a step starts
    (counted) plus the most that step adds (profiled), after two Adam steps."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    torch.manual_seed(1)
    x, y = torch.randn(MLP_BATCH, MLP_WIDTH), torch.randn(MLP_BATCH, MLP_WIDTH)
    half = MLP_BATCH // 2
    xs, ys = x[rank // 2 * half:][:half].clone(), y[rank // 2 * half:][:half].clone()
    found = {}
    for mode, options in kwargs.items():
        pipe = fpd.pipeline(_mlp(tied), xs, loss_fn=F.mse_loss, mesh=mesh, progress=False, timeout=120, **options)
        opt = torch.optim.Adam(pipe.parameters(), lr=1e-4)
        for _ in range(2):
            pipe.step(xs, target=ys)
            opt.step()
            opt.zero_grad(set_to_none=zero_grad == "set_to_none")
        dist.barrier()
        start = _held_bytes([x, y, xs, ys])
        found[mode] = start + _rise(lambda: pipe.step(xs, target=ys))
        pipe.close()
    torch.save(found, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("zero_grad", ["set_to_none", "in_place"])
def test_the_fsdp_peak_is_the_measured_one(tmp_path, zero_grad: str) -> None:
    """4 gloo ranks, 2 replicas x 2 stages of four Linear(512) under Adam: each rank's peak over
    one step, 'ddp' and 'fsdp', against tune's prediction for its device (measured: within
    0.4%; 'fsdp' about 80% of 'ddp')."""
    import torch
    from dist_harness import run_ranks

    t = fxpipe.tune(_mlp(), torch.randn(MLP_BATCH, MLP_WIDTH), 4, schedules=("1f1b",), checkpoint=("never",),
                    chunks=[2], replicas=[2], optimizer="adam", balance_by="params", zero_grad=zero_grad,
                    device_flops=H100.device_flops, bandwidth=H100.bandwidth)
    chosen = {c.kwargs["data_parallel"]: c for c in t.choices if c.replicas == 2}
    assert chosen.keys() == {"ddp", "fsdp"}
    ranks = run_ranks(_measure_worker, 4, ({m: c.kwargs for m, c in chosen.items()}, zero_grad, False), tmp_path)
    for rank, found in enumerate(ranks):
        for mode, c in chosen.items():
            predicted = c.peak_bytes[str(rank % 2)]  # rank = dp_rank * 2 + pp_rank
            assert predicted == pytest.approx(found[mode], rel=0.02), (rank, mode, predicted, found[mode])
        assert found["fsdp"] < 0.85 * found["ddp"], found


def _tune_tied_zbv(**more):
    import torch

    return fxpipe.tune(_mlp(tied=True), torch.randn(MLP_BATCH, MLP_WIDTH), 4, schedules=("zbv",),
                       checkpoint=("never",), chunks=[2], replicas=[2], optimizer="adam", balance_by="params",
                       device_flops=H100.device_flops, bandwidth=H100.bandwidth, **more)


def test_a_weight_two_stages_of_a_rank_share_is_predicted_whole_under_fsdp() -> None:
    """zbv puts the first and the last stage on rank 0, which share the tied weight: fxpipe.distributed
    leaves it whole there (and on every replica), with Adam's state over it; tune predicted it
    sharded, (dp - 1) / dp of it and of its state too few on that rank."""
    t = _tune_tied_zbv()
    chosen = {c.kwargs["data_parallel"]: c for c in t.choices if c.replicas == 2}
    ddp, fsdp = chosen["ddp"], chosen["fsdp"]
    weight = MLP_WIDTH * MLP_WIDTH * 4
    bias = MLP_WIDTH * 4
    # zbv: rank 0 holds stages 0 and 3 (the tied weight once, two biases), rank 1 stages 1 and 2
    for device, sharded in {"0": 2 * bias, "1": 2 * (weight + bias)}.items():  # rank 0's tied weight stays whole
        want = ddp.static_bytes[device] + sharded / 2 - 2 * sharded / 2
        assert fsdp.static_bytes[device] == pytest.approx(want, abs=1024), (device, fsdp.static_bytes[device], want)


@pytest.mark.slow
def test_the_fsdp_peak_with_a_weight_shared_on_a_rank_is_the_measured_one(tmp_path) -> None:
    """The same measured on 4 gloo ranks (2 replicas x 2 ranks of zbv's two stages each)."""
    from dist_harness import run_ranks

    t = _tune_tied_zbv()
    chosen = {c.kwargs["data_parallel"]: c for c in t.choices if c.replicas == 2}
    ranks = run_ranks(_measure_worker, 4, ({m: c.kwargs for m, c in chosen.items()}, "set_to_none", True), tmp_path)
    for rank, found in enumerate(ranks):
        for mode, c in chosen.items():
            predicted = c.peak_bytes[str(rank % 2)]
            assert predicted == pytest.approx(found[mode], rel=0.02), (rank, mode, predicted, found[mode])
