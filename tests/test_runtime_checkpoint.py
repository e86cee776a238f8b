"""runtime/checkpoint.py: Checkpoint/Recompute reproduce dropout; is_checkpointing/is_recomputing."""

import pytest
import torch
from torch import nn

from fxpipe import GPipe, is_checkpointing, is_recomputing


def dropout_model():
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8))


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_dropout_bit_exact_between_checkpoint_modes(chunks):
    results = {}
    for mode in ["always", "except_last", "never"]:
        torch.manual_seed(0)
        model = dropout_model()
        pipe = GPipe(model, [2, 1, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
        torch.manual_seed(1234)
        x = torch.randn(9, 8)
        out = pipe(x)
        out.sum().backward()
        results[mode] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    ref_out, ref_grads = results["never"]
    for mode in ["always", "except_last"]:
        out, grads = results[mode]
        assert torch.equal(out, ref_out), mode
        for g, r in zip(grads, ref_grads):
            assert torch.equal(g, r), mode


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.events = []

    def forward(self, x):
        self.events.append((is_checkpointing(), is_recomputing()))
        return torch.tanh(x)  # saves its result: backward needs the recomputation


def test_is_checkpointing_and_is_recomputing():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    # micro-batch 0 checkpointed then recomputed, micro-batch 1 plain.
    assert sorted(probe.events) == sorted([(True, False), (False, False), (False, True)])
    assert not is_checkpointing() and not is_recomputing()


def test_no_checkpointing_in_eval_or_no_grad():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    pipe.eval()
    pipe(torch.randn(4, 2))
    assert probe.events == [(False, False)] * 4
