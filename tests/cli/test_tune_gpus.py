"""``fxpipe tune --gpu KIND``: a named GPU's data-sheet figures stand in for the numbers a meta
model's roofline needs (issue #32), and an explicit figure still wins."""

from __future__ import annotations

import pytest

from fxpipe.cli._gpus import GPUS

LLAMA = ["tune", "hf:llama", "--set", "num_hidden_layers=2", "--set", "hidden_size=64", "--set",
         "intermediate_size=128", "--set", "num_attention_heads=4", "--set", "num_key_value_heads=4", "--set",
         "vocab_size=128", "--devices", "2", "--batch", "4x16", "--chunks", "2", "--schedules", "gpipe", "1f1b",
         "--checkpoint", "never", "--no-progress"]


def test_a_named_gpu_tunes_a_meta_model_without_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    from fxpipe.cli._main import main

    assert main([*LLAMA, "--gpu", "MI300X"]) == 0
    out = capsys.readouterr().out
    assert "(178.8 GiB per device)" in out and "bytes / 64 GB/s" in out and "best:" in out, out
    # the user's own figures win over the kind's
    assert main([*LLAMA, "--gpu", "h100", "--memory", "40GiB", "--link", "900GB/s"]) == 0
    out = capsys.readouterr().out
    assert "(40.0 GiB per device)" in out and "bytes / 900 GB/s" in out, out


def test_every_kind_is_a_complete_roofline() -> None:
    from fxpipe.tuning._units import parse_bytes, parse_rate

    for name, kind in GPUS.items():
        assert parse_rate(kind.device_flops, "device_flops", "") > 1e14, name
        assert parse_rate(kind.bandwidth, "bandwidth", "") > 1e12, name
        assert parse_bytes(kind.memory, "memory") >= 80e9, name
        assert parse_rate(kind.link, "link", "") >= 64e9, name


def test_an_unknown_kind_is_refused_naming_the_kinds(capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe.cli._main import main

    assert main([*LLAMA, "--gpu", "v100"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'v100'" in err and "'a100', 'b200', 'h100', 'h200', 'mi300x'" in err, err
