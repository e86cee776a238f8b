"""runtime/stream.py: the device-agnostic stream helpers (CUDA only: no-ops on CPU)."""

import pytest
import torch


@pytest.mark.cuda
def test_cuda_record_stream_keeps_memory_alive():
    from fxpipe.runtime.stream import new_stream, record_stream, use_stream

    device = torch.device("cuda")
    stream = new_stream(device)
    with use_stream(stream):
        x = torch.ones(1 << 20, device=device)
    record_stream(x, torch.cuda.current_stream(device))
    ptr = x.data_ptr()
    del x
    y = torch.empty(1 << 20, device=device)
    # The block is still in use on the other stream, so it was not handed out again.
    assert y.data_ptr() != ptr or torch.cuda.current_stream(device).query()
