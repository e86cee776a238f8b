"""runtime/_dependency.py: Fork/Join make backward visit micro-batches in reverse order."""

import pytest
import torch
from torch import nn

from fxpipe import GPipe
from fxpipe.runtime._pipeline import PipelineRunner


class Recorder(nn.Module):
    def __init__(self, log, name):
        super().__init__()
        self.log, self.name = log, name
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        mb = int(x[0, 0].item() // 1000)  # the micro-batch id travels in the data
        if y.requires_grad:  # not in the activation-free checkpoint pass
            y.register_hook(lambda g, mb=mb: self.log.append((self.name, mb)))
        return y * 0 + x  # keep the id in the data


@pytest.mark.parametrize("order", [None, True, False])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_backward_visits_micro_batches_in_reverse_order(monkeypatch, checkpoint, order):
    """Also without the Fork/Join (``order_backward`` False, as by default on CPU pipelines
    running on the caller's thread): autograd runs latest-created nodes first."""
    monkeypatch.setattr(PipelineRunner, "order_backward", order)
    log = []
    model = nn.Sequential(Recorder(log, "a"), Recorder(log, "b"))
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    x = torch.zeros(4, 4)
    for i in range(4):
        x[i] = 1000 * i
    pipe(x).sum().backward()
    for name in "ab":
        order = [mb for n, mb in log if n == name]
        assert order == [3, 2, 1, 0], (name, log)
