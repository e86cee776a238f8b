"""runtime/copy.py: Copy/Wait move micro-batches between CUDA devices on copy streams."""

import copy

import pytest
import torch
from torch import nn

from fxpipe import GPipe


@pytest.mark.cuda
def test_cuda_streams_and_copies_between_devices():
    n = min(torch.cuda.device_count(), 2)
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model).cuda()
    pipe = GPipe(model, [2, 1], devices=devices, chunks=4)
    x = torch.randn(16, 8, device=devices[0])
    out = pipe(x)
    out.sum().backward()
    r = ref(x.to(ref[0].weight.device))
    r.sum().backward()
    torch.testing.assert_close(out, r.to(out.device))
    assert out.device == torch.device(devices[-1])
    assert len(pipe._runtime._copy_streams[0]) == 4
    assert all(isinstance(s, torch.cuda.Stream) for s in pipe._runtime._copy_streams[0])
    del n
