"""Every schedule of fxpipe.distributed on world size 1, in this process: every stage on rank 0.

torch's pipelining passes values between stages of one rank by a call, so these runs need no
second process; they cover each schedule's order of forward, input- and weight-gradient
passes and checkpointing, exact against eager (tests/dist_harness.py: 3 SGD steps, the first
accumulated over two ``step()`` calls). The sending between ranks is covered by the spawned
tests of test_distributed.py.
"""

from __future__ import annotations

import pytest

from dist_harness import CHECKPOINT_MODES, check, in_process

#: schedule -> (schedule, stages_per_rank, chunks) on one rank: one stage (gpipe, 1f1b) or two
SCHEDULES_1 = {
    "gpipe": ("gpipe", 1, 4),
    "1f1b": ("1f1b", 1, 4),
    "gpipe-x2": ("gpipe", 2, 4),  # torch's LoopedBFS
    "interleaved1f1b-x2": ("interleaved1f1b", 2, 4),
    "interleavedzb-x2": ("interleavedzb", 2, 4),
    "zbv-x2": ("zbv", 2, 4),
}


@pytest.mark.parametrize("schedule", SCHEDULES_1)
def test_each_layer_runs_once_per_micro_batch_and_once_per_recomputation(
        schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpointed micro-batch's stage is recomputed once, whatever the number of backward
    passes the schedule runs on it (zero bubble: the input pass, then one autograd call per
    parameter group in the weight pass), in every checkpoint mode; exact against eager."""
    cases = {f"counted-{schedule}-{mode}": SCHEDULES_1[schedule] for mode in CHECKPOINT_MODES}
    check(in_process(cases, monkeypatch), cases)


def test_unet_with_multi_sample_micro_batches_under_every_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The U-Net (``cat`` of skip connections: strided input gradients), two samples per
    micro-batch, exact against eager under each schedule."""
    cases = {f"unet-{schedule}": spec for schedule, spec in SCHEDULES_1.items()}
    check(in_process(cases, monkeypatch), cases)


def test_layers_applied_at_every_depth_under_every_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    """ALBERT-style sharing, each stage using one Linear and one LayerNorm several times: under
    zero bubble torch's weight pass alone stopped at the first step ("backward through the graph
    a second time"); fxpipe completes those stages' weight gradients after their input pass.
    Exact against eager under each schedule."""
    cases = {f"shared-{schedule}": spec for schedule, spec in SCHEDULES_1.items()}
    check(in_process(cases, monkeypatch), cases)
