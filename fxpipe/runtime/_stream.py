"""Device-agnostic stream helpers.

CUDA work in the pipeline runs on explicit streams so that copies overlap computation; on
CPU every stream operation is a no-op. These helpers let the rest of the runtime speak of
"streams" without branching on the device type everywhere.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Generator, Optional, Union

import torch

__all__ = [
    "CPUStream", "AbstractStream", "new_stream", "current_stream", "default_stream",
    "use_device", "use_stream", "get_device", "wait_stream", "record_stream", "is_cuda", "synchronize",
]


class CPUStream:
    """A placeholder for a stream on the CPU, where work is synchronous.

    There is one, ``CPU_STREAM``, and ``is_cuda`` tests identity with it: copies and
    unpickled instances are that same object, or a copied pipeline would take its CPU
    streams for CUDA ones.
    """

    def __repr__(self) -> str:
        return "<CPUStream>"

    def __reduce__(self) -> str:
        return "CPU_STREAM"  # pickle and copy return the module-level instance


CPU_STREAM = CPUStream()

AbstractStream = Union[torch.cuda.Stream, CPUStream]


def is_cuda(stream: AbstractStream) -> bool:
    return stream is not CPU_STREAM


def new_stream(device: torch.device) -> AbstractStream:
    """A new stream for the device (CUDA), or the CPU placeholder."""
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.Stream(device)


def current_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    if device.type != "cuda":
        return CPU_STREAM
    return torch.cuda.default_stream(device)


@contextmanager
def use_device(device: torch.device) -> Generator[None, None, None]:
    """Makes the CUDA device current; does nothing for CPU devices."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


@contextmanager
def use_stream(stream: AbstractStream) -> Generator[None, None, None]:
    if not is_cuda(stream):
        yield
        return
    with torch.cuda.stream(stream):  # type: ignore[arg-type]
        yield


def get_device(stream: AbstractStream) -> torch.device:
    if is_cuda(stream):
        return stream.device  # type: ignore[union-attr]
    return torch.device("cpu")


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """``source`` waits for the work queued so far on ``target``."""
    if is_cuda(target):
        if is_cuda(source):
            source.wait_stream(target)  # type: ignore[union-attr]
        else:
            target.synchronize()  # type: ignore[union-attr]


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Tells the caching allocator that ``tensor`` is in use on ``stream``.

    Without this, memory freed on one stream could be handed out again while another
    stream still reads it.
    """
    if not is_cuda(stream) or not tensor.is_cuda:
        return
    # record_stream needs the storage's own stream type.
    tensor = tensor.new_empty([0]).set_(tensor.untyped_storage())
    tensor.record_stream(stream)  # type: ignore[arg-type]


def synchronize(device: Optional[torch.device]) -> None:
    """Waits until the device has run all work queued on it (CUDA); nothing on the CPU,
    where work is synchronous, or for no device. What a timing needs around it."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
