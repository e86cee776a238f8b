"""What tune's notes say the memory column holds (issue 33 item 5): receive buffers only
where a configuration of ``fxpipe.distributed`` was predicted, and, for a device given more
than once, that "per device" is all its stages together (the whole process on the CPU)."""

from __future__ import annotations

import torch
from torch import nn

import fxpipe


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def test_repeated_cpu_says_per_device_is_the_whole_process_and_no_receive_buffers() -> None:
    torch.manual_seed(0)
    t = fxpipe.tune(_mlp(), torch.randn(8, 16), ["cpu"] * 2, chunks=[2], checkpoint=("never",))
    assert not any(c.distributed for c in t.choices)  # the ranks' schedules were not considered
    assert set(t.skipped) == {"1f1b", "interleaved1f1b", "zbv"}
    text = str(t)
    assert "receive buffers" not in text
    assert "per device' is all of them together; for the CPU, the whole process" in text, text
    assert all(set(c.peak_bytes) == {"cpu"} for c in t.choices)  # one entry: the process


def test_distinct_devices_name_receive_buffers_only_when_ranks_were_predicted() -> None:
    with torch.device("meta"):
        model = _mlp()
    x = torch.randn(8, 16)
    options = dict(device_flops=1e12, bandwidth=1e11, chunks=[2], checkpoint=("never",))
    ranks = fxpipe.tune(model, x, 2, **options)
    assert any(c.distributed and c.peak_bytes for c in ranks.choices)
    assert "+ receive buffers (distributed)" in str(ranks)
    one = fxpipe.tune(model, x, 2, schedules=("gpipe",), **options)
    assert not any(c.distributed for c in one.choices)
    assert "receive buffers" not in str(one)
    assert "given more than once" not in str(ranks) + str(one)  # two devices, each its own
