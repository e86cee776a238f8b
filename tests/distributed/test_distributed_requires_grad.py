"""fxpipe.distributed hands a stage a value that needs no gradient needing none, as eager
does (issue 33): the input carried to the head over two stages (``carry`` nodes), a value
made from buffers alone, and a tuple mixing both kinds, on two gloo ranks.

torch's ``PipelineStage`` makes its receive buffers require grad from the static metadata
(``fxpipe.distributed._values.meta_of`` gives each the value's own ``requires_grad``); a
stage that received a no-grad value needing one would compute its gradient and send it back
for nothing. The probes (tests/no_grad_models.py) record what each stage received; the
gradients of one step are compared with eager's.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, List, Tuple

import torch
import torch.nn.functional as F

from dist_harness import run_ranks
from exact import assert_close_scaled, largest
from no_grad_models import SPLITS, Probe, SkipNet, flags_of

DTYPE = torch.float64
BATCH, CHUNKS = 6, 3
#: name: (schedule, stages per rank, checkpoint); 4 stages carry the input over stages 1 and 2
CASES = {"gpipe-always": ("gpipe", 2, "always"), "zbv-except_last": ("zbv", 2, "except_last"),
         "1f1b-never": ("1f1b", 1, "never")}


def _data() -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(BATCH, 4, generator=g, dtype=DTYPE), torch.randn(BATCH, 3, generator=g, dtype=DTYPE)


def _model(log: List[Tuple[str, bool]]) -> SkipNet:
    torch.manual_seed(0)
    return SkipNet(log).to(DTYPE)


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    x, y = _data()
    for name, (schedule, per_rank, checkpoint) in CASES.items():
        log: List[Tuple[str, bool]] = []
        pipe = fpd.pipeline(_model(log), x, chunks=CHUNKS, loss_fn=F.mse_loss, schedule=schedule,
                            stages_per_rank=per_rank, checkpoint=checkpoint, split_points=SPLITS[world * per_rank],
                            leaf_modules=[Probe], progress=False, timeout=60)
        log.clear()  # the build's runs
        pipe.step(x, target=y)
        results[name] = {"log": list(log),
                         "grads": {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}}
        pipe.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_no_grad_values_cross_ranks_as_in_eager(tmp_path: Path) -> None:
    results = run_ranks(_worker, 2, (), tmp_path)
    x, y = _data()
    log: List[Tuple[str, bool]] = []
    ref = _model(log)
    F.mse_loss(ref(x), y).backward()
    want = flags_of(log)
    assert want["input at the head"] == {False} and want["activation at the head"] == {True}
    expected = {n: p.grad for n, p in ref.named_parameters()}
    top = max(largest(g) for g in expected.values())
    for name in CASES:
        assert flags_of([e for r in results for e in r[name]["log"]]) == want, name
        seen: set[str] = set()
        for rank, r in enumerate(results):
            for n, g in r[name]["grads"].items():
                assert_close_scaled(g, expected[n], what=f"{name} rank {rank} grad {n}", floor_of=top)
            seen |= set(r[name]["grads"])
        assert seen == set(expected), f"{name}: no rank holds {sorted(set(expected) - seen)}"
