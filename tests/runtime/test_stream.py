"""runtime/_stream.py: the device-agnostic stream helpers.

The CPU half: on any device that is not CUDA, every helper answers with the one CPU_STREAM
(which copying and pickling keep, so is_cuda stays false on a copied pipeline) or the CPU
device, and does nothing else: no call reaches torch.cuda (each is made to raise here), and
the context managers run their body and let its exceptions through. The CUDA half checks
that record_stream keeps a block alive while a side stream still uses it.
"""

import copy
import pickle

import pytest
import torch

from fxpipe.runtime import _stream as S

CPU_LIKE = [torch.device("cpu"), torch.device("meta")]


@pytest.fixture
def no_cuda(monkeypatch):
    """Every torch.cuda entry point the helpers could use raises: the CPU path must not call any."""
    def refuse(*args, **kwargs):
        raise AssertionError("the CPU path called into torch.cuda")

    for name in ("Stream", "current_stream", "default_stream", "stream", "device", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, refuse)


@pytest.mark.parametrize("device", CPU_LIKE, ids=str)
def test_every_stream_of_a_cpu_device_is_the_one_cpu_stream(no_cuda, device):
    for make in (S.new_stream, S.current_stream, S.default_stream):
        stream = make(device)
        assert stream is S.CPU_STREAM and isinstance(stream, S.CPUStream), make.__name__
        assert not S.is_cuda(stream)
        assert S.get_device(stream) == torch.device("cpu")


def test_copies_of_the_cpu_stream_are_the_cpu_stream():
    # a copied or unpickled pipeline holds its streams in containers: they must stay CPU streams
    held = {"streams": [S.CPU_STREAM, S.CPU_STREAM]}
    for clone in (copy.copy(S.CPU_STREAM), copy.deepcopy(S.CPU_STREAM), pickle.loads(pickle.dumps(S.CPU_STREAM)),
                  copy.deepcopy(held)["streams"][1], pickle.loads(pickle.dumps(held))["streams"][0]):
        assert clone is S.CPU_STREAM and not S.is_cuda(clone)
    assert repr(S.CPU_STREAM) == "<CPUStream>"


@pytest.mark.parametrize("device", CPU_LIKE, ids=str)
def test_context_managers_run_their_body_and_pass_errors_through(no_cuda, device):
    ran = []
    with S.use_device(device), S.use_stream(S.current_stream(device)):
        ran.append(torch.ones(2).sum().item())
    assert ran == [2.0]
    for manager in (S.use_device(device), S.use_stream(S.CPU_STREAM)):
        with pytest.raises(KeyError, match="inside"):
            with manager:
                raise KeyError("inside")


def test_waiting_recording_and_synchronising_do_nothing_on_the_cpu(no_cuda):
    S.wait_stream(S.CPU_STREAM, S.CPU_STREAM)
    x = torch.arange(6.0)
    storage, before = x.untyped_storage().data_ptr(), x.clone()
    S.record_stream(x, S.CPU_STREAM)
    assert x.untyped_storage().data_ptr() == storage and torch.equal(x, before)
    for device in (None, *CPU_LIKE):
        S.synchronize(device)


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
