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


# -- the CPU half: every helper on a CPU device is the CPU placeholder or a no-op ---------------
def test_cpu_devices_get_the_one_cpu_placeholder_stream():
    import copy
    import pickle

    from fxpipe.runtime._stream import (CPU_STREAM, current_stream, default_stream, get_device, is_cuda,
                                        new_stream)

    cpu = torch.device("cpu")
    streams = [new_stream(cpu), current_stream(cpu), default_stream(cpu), new_stream(torch.device("meta"))]
    assert all(s is CPU_STREAM for s in streams)
    assert not is_cuda(CPU_STREAM)
    assert get_device(CPU_STREAM) == cpu
    # copies of a pipeline (deepcopy, pickle) keep the placeholder itself, so `is` checks hold
    assert copy.deepcopy(CPU_STREAM) is CPU_STREAM and pickle.loads(pickle.dumps(CPU_STREAM)) is CPU_STREAM
    assert repr(CPU_STREAM) == "<CPUStream>"


def test_cpu_contexts_run_their_block_and_change_nothing():
    from fxpipe.runtime._stream import CPU_STREAM, use_device, use_stream

    ran = []
    with use_device(torch.device("cpu")):
        ran.append("device")
    with use_stream(CPU_STREAM):
        ran.append("stream")
    assert ran == ["device", "stream"]
    with pytest.raises(KeyError):  # an exception inside still propagates (the contexts swallow nothing)
        with use_stream(CPU_STREAM):
            raise KeyError("inside")


def test_cpu_waits_records_and_synchronize_are_no_ops():
    from fxpipe.runtime._stream import CPU_STREAM, record_stream, synchronize, wait_stream

    x = torch.arange(4.0)
    before = x.clone()
    wait_stream(CPU_STREAM, CPU_STREAM)
    record_stream(x, CPU_STREAM)
    synchronize(torch.device("cpu"))
    synchronize(None)
    assert torch.equal(x, before) and x.device.type == "cpu"


def test_the_runtime_copies_between_cpu_placeholders_do_no_work():
    """Copy/Wait between CPU 'devices' leave the batch's tensors as they are (the same objects:
    no autograd node, no copy)."""
    from fxpipe.runtime._copy import copy as copy_batch
    from fxpipe.runtime._copy import wait
    from fxpipe.runtime._microbatch import Batch
    from fxpipe.runtime._stream import CPU_STREAM

    x = torch.randn(3, requires_grad=True)
    batch = Batch((x,), atomic=False)
    copy_batch(batch, CPU_STREAM, CPU_STREAM)
    wait(batch, CPU_STREAM, CPU_STREAM)
    assert batch.tensors()[0] is x
