"""fxpipe.tune end to end on small models: the ranked result, building its best, the
refusal naming the smallest requirement, argument errors, meta models, the command line."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fxpipe
from fxpipe.errors import ArgumentError, MemoryBudgetError
from fxpipe.tuning import Tuning
from fxpipe.tuning._units import parse_bytes, parse_rate, parse_seconds


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)])
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def test_tune_ranks_and_builds_its_best_leaving_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    t = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe",), chunks=[1, 2, 4], optimizer="sgd")
    # 3 chunk counts x 3 modes, less chunks=1 'except_last' (it checkpoints nothing: the 'never' run)
    assert isinstance(t, Tuning) and len(t.choices) == 8 and all(c.fits for c in t.choices)
    assert not any(c.chunks == 1 and c.checkpoint == "except_last" for c in t.choices)
    steps = [c.step_s for c in t.choices]
    assert steps == sorted(steps) and t.best is t.choices[0]
    text = str(t)
    assert "rank" in text and "checkpoint" in text and "gpipe" in text
    shown = repr(t.best)  # one line, the plan named, not its every node
    assert shown.startswith("Choice(schedule='gpipe', ") and "<Plan: 2 stages>" in shown, shown
    assert "\n" not in shown and "assignment" not in shown and len(shown) < 400, shown
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    pipe = t.best.pipeline(progress=False)
    try:
        assert pipe.chunks == t.best.chunks and pipe.checkpoint == t.best.checkpoint
        assert pipe.plan is t.best.plan
        torch.testing.assert_close(pipe(x), model(x))
    finally:
        pipe.close()


def test_one_process_1f1b_is_proposed_and_its_choice_steps_exactly() -> None:
    """``schedules=('1f1b',)`` on devices that repeat (no ranks possible): fxpipe.pipeline's own
    1F1B, never 'no configuration can run'; its activations peak lower than GPipe's, and the
    pipeline it builds steps as eager does."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 32)
    t = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("1f1b",), chunks=[2, 4], optimizer="sgd")
    assert t.choices and all(c.one_process and not c.distributed and c.schedule == "1f1b" for c in t.choices)
    assert "1f1b (1 process)" in str(t) and "not considered: 1f1b on ranks" in str(t)
    assert "receive buffers" not in str(t)
    both = fxpipe.tune(model, x, ["cpu"] * 2, schedules=("gpipe", "1f1b"), chunks=[1, 4], checkpoint=("never",),
                       optimizer="sgd")
    by = {(c.schedule, c.chunks): c for c in both.choices}
    assert ("1f1b", 1) not in by  # one micro-batch: GPipe's run, listed once
    one, gpipe = by[("1f1b", 4)], by[("gpipe", 4)]
    assert sum(one.activation_bytes.values()) < sum(gpipe.activation_bytes.values())
    pipe = one.pipeline(progress=False)
    try:
        assert pipe.schedule == "1f1b" and pipe.chunks == 4
        ref = copy.deepcopy(model)
        loss = pipe.step(x, loss_fn=lambda out: out.pow(2).mean())
        want = ref(x).pow(2).mean()
        want.backward()
        torch.testing.assert_close(loss, want.detach())
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    finally:
        pipe.close()


def test_nothing_fits_names_the_smallest_requirement() -> None:
    # on meta: the plan and every size come from shapes, so the three tunings below predict the
    # same (a real model's plan is balanced by profiled time, which may cut it elsewhere each time)
    with torch.device("meta"):
        model = MLP()
    x = torch.randn(8, 32)
    options = dict(schedules=("gpipe",), chunks=[1, 2, 4], optimizer="adam", device_flops=1e12, bandwidth=1e11)
    free = fxpipe.tune(model, x, 2, **options)
    least = min(c.peak for c in free.choices)
    with pytest.raises(MemoryBudgetError, match="smallest requirement") as info:
        fxpipe.tune(model, x, 2, "1KiB", **options)
    assert info.value.required == pytest.approx(least)
    assert info.value.budget == 1024
    assert isinstance(info.value, ValueError)
    # just enough memory for the smallest: that one fits, and is the only one if it is unique
    t = fxpipe.tune(model, x, 2, least, **options)
    assert t.best.peak <= least and all(c.peak > least for c in t.choices if not c.fits)


def test_a_model_is_timed_only_on_the_kind_of_device_named() -> None:
    # a CPU model tuned for GPUs would have its CPU times stand for the GPUs': refused, named
    with pytest.raises(ArgumentError, match="on cpu but devices= names cuda") as info:
        fxpipe.tune(MLP(), torch.randn(4, 32), ["cuda:0", "cuda:1"])
    assert info.value.argument == "devices"


@pytest.mark.parametrize("kwargs,argument", [
    ({"memory": "lots"}, "memory"),
    ({"memory": -1}, "memory"),
    ({"schedules": ("pipedream",)}, "schedules"),
    ({"checkpoint": ("sometimes",)}, "checkpoint"),
    ({"optimizer": "lion"}, "optimizer"),
    ({"device_flops": 1e12}, "device_flops"),
    ({"devices": 0}, "devices"),
    ({"chunks": [0]}, "chunks"),
    ({"balance_by": "flops"}, "balance_by"),
    ({"latency": "soon"}, "latency"),
    ({"zero_grad": "never"}, "zero_grad"),
    ({"latency": -1e-6}, "latency"),
    ({"send_overhead": "1 tick"}, "send_overhead"),
])
def test_bad_arguments_are_named(kwargs: dict, argument: str) -> None:
    with pytest.raises(ArgumentError) as info:
        fxpipe.tune(MLP(), torch.randn(4, 32), **{"devices": ["cpu"] * 2, **kwargs})
    assert info.value.argument == argument


def test_a_meta_model_is_tuned_from_shapes() -> None:
    with torch.device("meta"):
        model = MLP()
    x = torch.randn(16, 32)
    with pytest.raises(ArgumentError, match="device_flops"):
        fxpipe.tune(model, x, 2)
    with pytest.raises(ArgumentError, match="balance_by='params' or 'memory'"):
        fxpipe.tune(model, x, 2, device_flops=1e12, bandwidth=1e11, balance_by="time")
    by_memory = fxpipe.tune(model, x, 2, device_flops=1e12, bandwidth=1e11, chunks=[2], balance_by="memory")
    assert {c.plan.balance_by for c in by_memory.choices if c.plan is not None} == {"memory"}
    t = fxpipe.tune(model, x, 2, "1GiB", device_flops=1e12, bandwidth=1e11, chunks=[2, 4, 8])
    names = {c.schedule for c in t.choices}
    assert names == {"gpipe", "1f1b", "interleaved1f1b", "zbv"}
    assert any(c.distributed for c in t.fitting)
    refused = [c for c in t.choices if "torch's schedule refuses" in c.why]
    assert all(c.schedule != "gpipe" for c in refused)
    d = next(c for c in t.fitting if c.distributed)
    assert d.kwargs["schedule"] == d.schedule and d.kwargs["plan"].n_stages == d.n_stages


def test_units() -> None:
    assert parse_bytes("80GiB", "memory") == 80 * 2 ** 30
    assert parse_bytes("24 GB", "memory") == 24e9
    assert parse_bytes(1024, "memory") == 1024
    assert parse_rate("450GB/s", "link") == 450e9
    assert parse_rate("790e12", "device_flops") == 790e12
    assert parse_bytes(None, "memory") is None
    assert parse_seconds("20us", "latency") == pytest.approx(2e-5)
    assert parse_seconds("0.5 ms", "latency") == pytest.approx(5e-4)
    assert parse_seconds(0, "latency") == 0.0 and parse_seconds("2s", "latency") == 2.0


class Finetuned(nn.Module):
    """A frozen layer and a buffer: held, but no gradient and no optimizer state."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.register_buffer("table", torch.zeros(16384))
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.frozen(x)) + self.table[:32])


def test_gradients_and_optimizer_state_only_for_what_is_trained() -> None:
    torch.manual_seed(0)
    model, x = Finetuned(), torch.randn(8, 32)
    t = fxpipe.tune(model, x, ["cpu"], schedules=("gpipe",), chunks=[1], checkpoint=("never",), optimizer="adam")
    held = sum(st.param_bytes for st in t.best.plan.stages)  # parameters and what the graph reads of buffers
    assert held >= sum(p.numel() * 4 for p in model.parameters())
    trained = sum(p.numel() * 4 for p in model.head.parameters())
    assert t.best.static_bytes["cpu"] == held + 3 * trained  # the gradient and Adam's two moments


def test_gradients_kept_through_the_backward_hold_autograds_sums_too() -> None:
    # zero_grad='in_place': .grad exists through fxpipe.pipeline's one backward over every
    # micro-batch, and autograd sums each parameter's gradient over them before adding it in;
    # with 'set_to_none' the sum becomes .grad (tests/tuning/test_peak_measured.py measures both)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(8, 32)
    options = dict(schedules=("gpipe",), chunks=[1, 4], checkpoint=("never",), optimizer="sgd", balance_by="params")
    none = {c.chunks: c for c in fxpipe.tune(model, x, ["cpu"] * 2, **options).choices}
    kept = {c.chunks: c for c in fxpipe.tune(model, x, ["cpu"] * 2, zero_grad="in_place", **options).choices}
    params = sum(p.numel() * 4 for p in model.parameters())
    # one micro-batch: nothing to sum; the gradients are there before the step, not made in it
    assert none[1].static_bytes == kept[1].static_bytes
    assert none[1].peak < kept[1].peak <= none[1].peak + params
    extra = kept[4].activation_bytes["cpu"] - kept[1].activation_bytes["cpu"]
    assert 0 < extra <= 2 * params  # the sums, and the out-of-place sum of the first two


class SeqFirst(nn.Module):
    """Batch in dim 1 (seq-first), and a loss model: what tune's options describe must reach
    the pipeline each choice builds."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).softmax(dim=0)  # mixes along the sequence, dim 0


class LossOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)


def test_the_options_tune_was_given_build_its_choices() -> None:
    torch.manual_seed(0)
    seq, x = SeqFirst(), torch.randn(5, 8, 16)  # (seq, batch, features)
    t = fxpipe.tune(seq, x, 2, chunk_dims=1, output_merge=1, chunks=[2, 4], optimizer="sgd")
    assert t.skipped and all(s.startswith("fxpipe.distributed cuts every input along dim 0") for s in t.skipped.values())
    with t.best.pipeline(progress=False) as pipe:
        torch.testing.assert_close(pipe(x), seq(x))
    loss_model, a, y = LossOut(), torch.randn(8, 8), torch.randint(0, 4, (8,))
    t = fxpipe.tune(loss_model, (a, y), ["cpu"] * 2, output_merge="mean", leaf_modules=[nn.Linear],
                    schedules=("gpipe",), chunks=[2], optimizer="sgd")
    assert t.best.kwargs["leaf_modules"] == [nn.Linear] and t.best.kwargs["output_merge"] == "mean"
    with t.best.pipeline(progress=False) as pipe:
        torch.testing.assert_close(pipe(a, y), loss_model(a, y))
    ranks = fxpipe.tune(loss_model, (a, y), 2, output_merge="mean", leaf_modules=[nn.Linear],
                        schedules=("1f1b",), chunks=[2], optimizer="sgd")
    assert ranks.best.kwargs["leaf_modules"] == [nn.Linear] and "output_merge" not in ranks.best.kwargs


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def test_what_cannot_run_is_listed_with_its_reason_and_the_rest_is_tuned() -> None:
    torch.manual_seed(0)
    # a BatchNorm in training mode refuses a micro-batch of one sample: chunks=4 of a batch of 4
    t = fxpipe.tune(BN().train(), torch.randn(4, 8), ["cpu"] * 2, chunks=[1, 2, 4], optimizer="sgd")
    refused = [c for c in t.choices if c.chunks == 4]
    assert refused and all(not c.fits and "refuses a micro-batch of 1 (chunks=4): ValueError" in c.why
                           for c in refused)
    assert {c.chunks for c in t.fitting} == {1, 2}
    assert "normalises each micro-batch on its own statistics" in str(t)  # chunks=2 differs from eager
    # a graph of two nodes cannot be cut into four stages: the V is listed as not run, 1f1b is tuned
    small = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    t = fxpipe.tune(small, torch.randn(4, 8), 2, schedules=("1f1b", "zbv"), chunks=[2], optimizer="sgd")
    assert {c.schedule for c in t.fitting} == {"1f1b"}
    assert all("cannot be cut into 4 stages: StagesError" in c.why for c in t.choices if c.schedule == "zbv")
    # nothing can run: the reasons, never an empty message
    with pytest.raises(MemoryBudgetError, match="no configuration can run: zbv: fxpipe.distributed cuts"):
        fxpipe.tune(SeqFirst(), torch.randn(5, 8, 16), 2, schedules=("zbv",), chunk_dims=1, output_merge=1)
    # 1F1B with chunk_dims: fxpipe.pipeline's own, in one process (not on ranks)
    t = fxpipe.tune(SeqFirst(), torch.randn(5, 8, 16), 2, schedules=("1f1b",), chunk_dims=1, output_merge=1)
    assert t.fitting and all(c.one_process for c in t.choices) and "not considered: 1f1b on ranks" in str(t)


def test_every_send_between_devices_pays_the_latency() -> None:
    with torch.device("meta"):
        model = MLP()
    x = torch.randn(16, 32)
    options = dict(device_flops=1e12, bandwidth=1e11, schedules=("1f1b",), chunks=[2], checkpoint=("never",))
    free = fxpipe.tune(model, x, 2, **options).best.step_s
    slow = fxpipe.tune(model, x, 2, latency="1s", **options).best.step_s
    # 2 stages, 2 micro-batches: 4 sends, at least two of them (F of micro-batch 0 to stage 1,
    # B of the last back to stage 0) on the critical path
    assert 2.0 - 1e-9 <= slow - free <= 4.0 + 1e-9


def test_every_send_between_devices_costs_both_devices_the_overhead() -> None:
    """1F1B, 2 stages, 2 micro-batches: each F and B hands on or takes in one send, so each
    device is busy 4 x 1 s longer, and the step at least that much."""
    with torch.device("meta"):
        model = MLP()
    x = torch.randn(16, 32)
    options = dict(device_flops=1e12, bandwidth=1e11, schedules=("1f1b",), chunks=[2], checkpoint=("never",))
    free = fxpipe.tune(model, x, 2, **options).best
    busy = fxpipe.tune(model, x, 2, send_overhead="1s", **options).best
    assert 4.0 - 1e-9 <= busy.step_s - free.step_s <= 8.0 + 1e-9
    assert busy.bubble < free.bubble  # the overhead is the devices' own time, not idle
    noted = str(fxpipe.tune(model, x, 2, latency="5us", send_overhead="0.98ms", link="4GB/s", **options))
    assert "a send between devices: 5 us + bytes / 4 GB/s, costing each of the two devices 0.98 ms" in noted
    # link=None: bytes cost nothing, only the latency
    no_link = fxpipe.tune(model, x, 2, link=None, latency="1s", **options)
    assert "a send between devices: 1 s, costing" in str(no_link)
    assert 2.0 - 1e-6 <= no_link.best.step_s - free.step_s <= 4.0  # less the bytes free paid for


def test_times_are_written_with_their_unit() -> None:
    from fxpipe.tuning._units import format_seconds

    assert [format_seconds(v) for v in (2.5, 9.8e-4, 2e-5, 3e-9, 0.0)] == ["2.5 s", "0.98 ms", "20 us", "3 ns", "0"]


def test_command_line_tunes_an_hf_model_on_meta(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from fxpipe.cli._main import main

    code = main(["tune", "hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set",
                 "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
                 "--set", "vocab_size=128", "--devices", "2", "--memory", "1GiB", "--batch", "4x16",
                 "--device-flops", "1e12", "--bandwidth", "1e11", "--chunks", "2", "4", "--send-overhead", "20us",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "best:" in out and "rank" in out
    assert "costing each of the two devices 20 us of its own time" in out  # --send-overhead reached tune


def test_command_line_refusal_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from fxpipe.cli._main import main

    code = main(["tune", "hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set",
                 "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
                 "--set", "vocab_size=128", "--devices", "2", "--memory", "1KiB", "--batch", "4x16",
                 "--device-flops", "1e12", "--bandwidth", "1e11", "--chunks", "2", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "smallest requirement" in err[0]



def test_command_line_balance_by(capsys: pytest.CaptureFixture[str]) -> None:
    """--balance-by reaches the plans; 'time' on a meta model is one line naming what to use."""
    pytest.importorskip("transformers")
    from fxpipe.cli._main import main

    model = ["tune", "hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set",
             "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4",
             "--set", "vocab_size=128", "--devices", "2", "--batch", "4x16", "--device-flops", "1e12",
             "--bandwidth", "1e11", "--chunks", "2", "--no-progress"]
    assert main([*model, "--balance-by", "memory"]) == 0
    assert "best:" in capsys.readouterr().out
    code = main([*model, "--balance-by", "time"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "balance_by='params' or 'memory'" in err[0], err
