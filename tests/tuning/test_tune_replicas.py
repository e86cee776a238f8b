"""``fxpipe.tune`` proposing ``dp x pp`` (issue #32): replicas of a shorter pipeline predicted
as that pipeline on its share of the batch, plus the gradients' all-reduce, and said why."""

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
    replicated = [c for c in four.choices if c.replicas == 2]
    assert replicated and all(c.n_stages == 2 and c.kwargs["data_parallel"] == "ddp" for c in replicated)
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
    c = next(c for c in t.choices if c.replicas == 2)
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
