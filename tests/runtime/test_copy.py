"""runtime/_copy.py: Copy/Wait move micro-batches between CUDA devices on copy streams."""

import copy

import pytest
import torch
from torch import nn

from exact import GPU, assert_close_scaled, assert_grads_equal
from fxpipe import GPipe


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_cuda_streams_and_copies_between_devices(mode):
    # Two GPUs when there are; otherwise one GPU split into two partitions.
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model).to(devices[0])
    pipe = GPipe(model, [2, 1], devices=devices, chunks=4, checkpoint=mode)
    x = torch.randn(16, 8, device=devices[0])
    out = pipe(x)
    out.sum().backward()
    r = ref(x)
    r.sum().backward()
    # cuBLAS may pick other kernels for a micro-batch than for the batch (tests/exact.py's GPU).
    assert_close_scaled(out, r.to(out.device), GPU, what="output")
    assert_grads_equal(pipe, ref, GPU, check_device=False)  # partitions hold theirs on their device
    assert out.device == torch.device(devices[-1])
    streams = pipe._runtime._copy_streams[0]
    assert len(streams) == 4
    # Copy streams of their own, not the compute stream.
    assert all(isinstance(s, torch.cuda.Stream) and s != torch.cuda.current_stream(s.device) for s in streams)
    pipe.close()
