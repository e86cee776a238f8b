"""runtime/_stream.py: the device-agnostic stream helpers (CUDA only: no-ops on CPU)."""

import pytest
import torch


@pytest.mark.cuda
def test_cuda_record_stream_keeps_memory_alive():
    from fxpipe.runtime._stream import new_stream, record_stream, use_stream

    device = torch.device("cuda", 0)
    side = new_stream(device)
    size = 1 << 20
    # Control: without record_stream the caching allocator hands a freed block out again at
    # once (else this test could not fail and says nothing).
    x = torch.ones(size, device=device)
    ptr = x.data_ptr()
    del x
    if torch.empty(size, device=device).data_ptr() != ptr:
        pytest.skip("the caching allocator did not reuse a freed block; nothing to compare")
    torch.cuda.synchronize(device)
    # A block used on a busy side stream must not be reused while that stream runs.
    x = torch.ones(size, device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    with use_stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time
        x.add_(1)
    record_stream(x, side)
    ptr = x.data_ptr()
    del x
    y = torch.empty(size, device=device)
    assert y.data_ptr() != ptr, "freed while the side stream still used it"
    torch.cuda.synchronize(device)
