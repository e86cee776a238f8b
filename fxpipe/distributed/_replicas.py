"""Data parallel beside the pipeline: the step's gradients summed over the replicas, once.

With ``mesh=`` and ``data_parallel='ddp'`` every replica of the pipeline holds whole copies of
its stages' parameters and steps on its own shard of the global batch. For the step to be
eager's on the global batch, two things are summed over the replicas holding the same stages
(:attr:`._mesh.Layout.replicas`):

* **the loss's weights** (:mod:`._loss`): each micro-batch's loss is scaled by what it counts
  over what the *global* batch counts (samples, labels that are not ``-100``, a mask's sum),
  so the replicas' losses add up to the global batch's loss, with no division by ``dp``
  (a mean over replicas of per-replica means is wrong when they count different numbers);
* **the gradients**: the sum of the replicas' gradients is then the global batch's gradient.

Why not torch's ``DistributedDataParallel`` or ``replicate``: they all-reduce in backward
hooks, once per micro-batch unless told which backward is the last, and
torch.distributed.pipelining tells only a stage module that *is* the DDP module; fxpipe's
stages run inside their runners (checkpointing, exact zero-bubble passes). One all-reduce of
the step's gradients after the schedule is the same sum, sent once per step, not per
micro-batch, over flat buckets.

Gradient accumulation stays exact as for tied weights (:mod:`._set_aside`): what ``.grad``
held before the step is set aside and added back after the step's own gradient was summed, so
earlier steps are not summed again. A parameter no replica got a gradient for keeps ``None``;
one that some replicas did not use gets theirs as zeros.

Under ``'fsdp'`` the same sum runs over what the replicas hold whole, FSDP reduce-scattering
the rest: a weight two stages of one rank share, which FSDP leaves unsharded
(:mod:`._sharding`); usually nothing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ._set_aside import SetAside

__all__ = ["ReplicaGradients"]

#: the most bytes one all-reduce carries (DDP's default bucket is 25 MiB)
BUCKET_BYTES = 25 * 2 ** 20


class ReplicaGradients:
    """The step's gradients of ``parameters`` summed over ``group`` (the replicas of this
    rank's stages); does nothing without a group."""

    def __init__(self, parameters: Sequence[nn.Parameter], group: Optional[dist.ProcessGroup]) -> None:
        self.parameters = [p for p in parameters if p.requires_grad]
        self.group = group
        self._aside = SetAside()

    def before_step(self) -> None:
        """Sets aside what ``.grad`` holds, so the step's own gradient is what is summed."""
        if self.group is not None and self.parameters:
            self._aside.take(self.parameters)

    def restore(self) -> None:
        """After a failed step: the gradients set aside go back, as they were."""
        self._aside.restore(self.parameters)

    def after_step(self) -> None:
        """Sums the step's gradients over the replicas (one flag all-reduce, then one per
        bucket), then adds back what was set aside."""
        if self.group is None or not self.parameters:  # 'fsdp' shards them all: FSDP reduce-scatters
            return
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        present = torch.tensor([p.grad is not None for p in self.parameters], dtype=torch.int32, device=device)
        dist.all_reduce(present, group=self.group)
        summed = [p for p, n in zip(self.parameters, present.tolist()) if n > 0]
        for p in summed:
            if p.grad is None:  # unused by this replica's batch, used by another's
                p.grad = torch.zeros_like(p)
        for bucket in _buckets([p.grad for p in summed]):
            flat = _flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=self.group)
            for g, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                g.copy_(value)
        for p in self.parameters:
            self._aside.add_back(p)


def _buckets(grads: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Gradients in groups of one dtype and device, each at most :data:`BUCKET_BYTES` (or one
    larger tensor), in order: the same groups on every replica (same parameters, same shapes)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if out and out[-1][0].dtype == g.dtype and out[-1][0].device == g.device and size + nbytes <= BUCKET_BYTES:
            out[-1].append(g)
            size += nbytes
        else:
            out.append([g])
            size = nbytes
    return out
