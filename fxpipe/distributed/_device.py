"""Where a rank runs: its device, its process group's backend, one GPU per rank.

Each rank runs its stages on one device: ``cuda:LOCAL_RANK`` when the job uses NCCL, the CPU
when it uses gloo. torch.distributed.pipelining sends between ranks over the process group,
and each backend sends tensors of one kind: NCCL only CUDA tensors, gloo only CPU tensors
(its point-to-point ops refuse CUDA). So the device follows the backend, and the backend
follows the hardware:

* Under torchrun with no process group yet, :func:`ensure_process_group` starts one as a
  user would: NCCL with ``torch.cuda.set_device(LOCAL_RANK)`` when CUDA is available, gloo
  otherwise (``device='cpu'`` asks for gloo on a GPU machine). It is destroyed at exit.
* A group the user started is used as it is; :func:`rank_device` then picks the device its
  backend can send from (``cuda:LOCAL_RANK`` for NCCL, else the CPU), or checks the one the
  user named.
* NCCL refuses two ranks on one GPU ("Duplicate GPU detected") at its first collective, deep
  inside torch. :func:`check_one_gpu_per_rank` compares the ranks' GPU UUIDs through the
  group's store first and refuses up front, naming the ranks.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
from datetime import timedelta
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from fxpipe.errors import DistributedError

__all__ = ["DeviceOption", "ensure_process_group", "rank_device", "check_one_gpu_per_rank", "shared_gpus",
           "backend_for"]

#: what ``device=`` of :func:`fxpipe.distributed.pipeline` accepts: None (chosen), a device or its name
DeviceOption = Union[None, str, torch.device]

#: the variables torchrun sets, which an ``env://`` process group reads
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: the backend that sends each device type's tensors
_BACKEND = {"cuda": "nccl", "cpu": "gloo"}

_builds = itertools.count()  # the pipelines built by this process: a fresh store key for each


def _local_rank() -> Optional[int]:
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None and value.isdigit() else None


def _wants_cpu(device: DeviceOption) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def ensure_process_group(timeout: timedelta, device: DeviceOption = None) -> None:
    """Starts the default process group when none is started, from torchrun's environment:
    NCCL on ``cuda:LOCAL_RANK`` when CUDA is available (and ``device`` is not the CPU), gloo
    otherwise. A started group is left as it is."""
    if not dist.is_available():
        raise DistributedError("this torch build has no torch.distributed; fxpipe.distributed needs it")
    if dist.is_initialized():
        return
    missing = [v for v in TORCHRUN_ENV if v not in os.environ]
    if missing:
        raise DistributedError(
            "fxpipe.distributed.pipeline runs on every rank of a job, and this process is not part of one: no "
            f"process group is initialised and {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. "
            "Start the script with torchrun (torchrun --nproc-per-node=N script.py), or call "
            "torch.distributed.init_process_group(...) before building the pipeline")
    if torch.cuda.is_available() and not _wants_cpu(device):
        index = _cuda_index(device)
        torch.cuda.set_device(index)
        dist.init_process_group("nccl", timeout=timeout)  # lazy: the GPUs are checked before NCCL starts
    else:
        dist.init_process_group("gloo", timeout=timeout)
    atexit.register(_destroy)


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def backend_for(backend: str, device_type: str) -> Optional[str]:
    """The backend a process group's ``get_backend()`` string uses for ``device_type``
    tensors: ``'nccl'`` for ``('nccl', 'cuda')``, ``'gloo'`` for ``('cpu:gloo,cuda:nccl',
    'cpu')``; None when it names that device type for none."""
    backend = str(backend).lower()
    if ":" not in backend:
        return backend
    pairs = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return pairs.get(device_type)


def _cuda_index(device: DeviceOption) -> int:
    """The GPU of this rank: the index ``device`` names, else ``LOCAL_RANK``, else the current one."""
    count = torch.cuda.device_count()
    named = torch.device(device) if device is not None else None
    index = named.index if named is not None and named.index is not None else _local_rank()
    if index is None:
        index = torch.cuda.current_device()
    if index >= count:
        raise DistributedError(
            f"this rank would run on cuda:{index} (LOCAL_RANK {_local_rank()}), but {count} GPU(s) are visible: run "
            f"at most {count} rank(s) per host (torchrun --nproc-per-node={count}), or set CUDA_VISIBLE_DEVICES")
    return index


def rank_device(device: DeviceOption = None) -> torch.device:
    """The device this rank's stages run on, checked against the default group's backend:
    ``device`` when given (``'cuda'`` means ``cuda:LOCAL_RANK``), else ``cuda:LOCAL_RANK``
    when the group sends CUDA tensors with NCCL, else the CPU. Makes a GPU the current device
    (NCCL and the object collectives use it)."""
    backend = dist.get_backend()
    if device is None:
        wanted = "cuda" if backend_for(backend, "cuda") == "nccl" and torch.cuda.is_available() else "cpu"
    else:
        wanted = torch.device(device).type
    if wanted not in _BACKEND:
        raise DistributedError(f"device={device!r}: fxpipe.distributed runs its stages on 'cuda' (NCCL) or 'cpu' "
                               f"(gloo), not on {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():  # before the backend: no group would help
        raise DistributedError(f"device={device!r}, but CUDA is not available in this process "
                               "(torch.cuda.is_available() is False): pass device='cpu' or leave device=None "
                               "to run this rank on the CPU over gloo")
    need = _BACKEND[wanted]
    if backend_for(backend, wanted) != need:
        hint = ("init_process_group('nccl') with one GPU per rank (or let fxpipe start the group: call "
                "fxpipe.distributed.pipeline under torchrun with no group initialised)" if wanted == "cuda"
                else "init_process_group('gloo') (or 'cpu:gloo,cuda:nccl')")
        raise DistributedError(
            f"this rank would run its stages on {wanted!r}, whose tensors the ranks send over {need}, but the "
            f"default process group uses {backend!r}: call {hint}, or pass device= for the backend you have")
    if wanted == "cpu":
        return torch.device("cpu")
    index = _cuda_index(device)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _gpu_identity(device: torch.device) -> str:
    """This host and the GPU's UUID: two ranks with equal identities share one GPU, whatever
    CUDA_VISIBLE_DEVICES each was given."""
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{socket.gethostname()}|{uuid if uuid is not None else device.index}"


def shared_gpus(identities: Sequence[str]) -> list[list[int]]:
    """The groups of ranks (more than one) whose identities are equal, in rank order."""
    by_gpu: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        by_gpu.setdefault(identity, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def check_one_gpu_per_rank(device: torch.device, timeout: timedelta) -> None:
    """Refuses ranks that share a GPU before NCCL would (:class:`DistributedError` on every
    rank alike): each rank writes its GPU's identity into the default group's store and reads
    the others'. Nothing to check on the CPU or with one rank."""
    if device.type != "cuda" or dist.get_world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    prefix = f"fxpipe/gpu/{next(_builds)}/"
    store.set(prefix + str(dist.get_rank()), _gpu_identity(device))
    keys = [prefix + str(r) for r in range(dist.get_world_size())]
    try:
        store.wait(keys, timeout)
    except Exception as e:  # a rank that never got here
        raise DistributedError(f"not every rank reached fxpipe.distributed.pipeline within {timeout} "
                               f"({type(e).__name__}: {e}); every rank must build the pipeline") from e
    identities = [store.get(k).decode() for k in keys]
    shared = shared_gpus(identities)
    if shared:
        which = "; ".join(f"ranks {', '.join(map(str, r))} on {identities[r[0]].replace('|', ' GPU ')}"
                          for r in shared)
        raise DistributedError(
            f"several ranks run on one GPU ({which}), and NCCL needs one GPU per rank (it stops with 'Duplicate "
            "GPU detected'). Start at most one rank per GPU (torchrun --nproc-per-node=<GPUs per host>), and let "
            "each rank use cuda:LOCAL_RANK (device=None), or give each its own GPU with device=")
