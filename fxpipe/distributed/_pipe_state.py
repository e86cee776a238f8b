"""What a ``DistributedPipeline`` holds of the model: this rank's parameters, its part of a
checkpoint, and its replica's share of a batch (split from :mod:`._pipe` to keep each file to
one job). The rules live in :mod:`._weights` (this rank's tensors), torch's
``torch.distributed.checkpoint.state_dict`` (optimizer state by parameter name) and
:mod:`._mesh` (the shard)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

import torch
from torch import nn

from fxpipe.errors import PipelineClosedError

from ._mesh import Layout, shard
from ._ties import parameters_of
from ._weights import load_local_state_dict, local_state_dict

__all__ = ["PipelineState"]


class PipelineState:
    """Mixed into :class:`fxpipe.distributed.DistributedPipeline` (which sets these)."""

    module: nn.Module
    stages: Any
    local: list[int]
    layout: Layout

    @property
    def dp_rank(self) -> int:
        """This rank's replica (0 without data parallel)."""
        return self.layout.replica

    @property
    def dp_size(self) -> int:
        """The number of replicas (1 without data parallel)."""
        return self.layout.dp

    def shard(self, batch: Any) -> Any:
        """This replica's share of a global batch: every tensor of ``batch`` (any structure)
        cut along dim 0 into ``dp_size`` equal contiguous parts, part ``dp_rank`` kept; the
        global batch itself without data parallel. Give every rank the same global batch and
        step on ``pipe.shard(batch)``: the replicas' step then equals eager's on the batch."""
        return shard(batch, self.layout)

    @property
    def training(self) -> bool:
        """The model's mode: the pipeline follows it (``step`` and ``eval_step`` read it)."""
        return self.module.training

    def train(self, mode: bool = True) -> "PipelineState":
        """``model.train(mode)``, as ``fxpipe.Pipeline.train`` does; on every rank alike (a mode
        switched on some ranks only is refused at the next step). Returns the pipeline."""
        self.module.train(mode)
        return self

    def eval(self) -> "PipelineState":
        """``model.eval()`` (see :meth:`train`)."""
        return self.train(False)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters (those its stages use), by the model's names and in its order."""
        mine = {id(p) for k in self.local for p in parameters_of(self.stages[k])}
        return ((n, p) for n, p in self.module.named_parameters() if id(p) in mine)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters: give them to this rank's optimizer."""
        return (p for _, p in self.named_parameters())

    def _held(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's parameters and the buffers its stages hold, by the model's names: what
        a ``'ddp'`` replica holds a copy of (:mod:`._copies`)."""
        mine = {id(b) for k in self.local for b in self.stages[k].buffers()}
        buffers = [(n, b) for n, b in self.module.named_buffers() if id(b) in mine]
        return [*self.named_parameters(), *buffers]

    def _refuse_released(self) -> None:
        """A later build from the same model with another layout released weights this rank's
        stages hold (to meta): their next step failed in torch ('Tensor on device meta')."""
        released = [name for name, t in self._held() if t.is_meta]
        if released:
            raise PipelineClosedError(
                f"this rank's weights of this pipeline ({released[0]!r} and {len(released) - 1} more) were released "
                "to meta since its build: another fxpipe.distributed.pipeline built from the same model with another "
                "layout released the stages it places on other ranks. Nothing was sent. What to do: use the newer "
                "pipeline (close this one), or build both with the same layout (schedule, stages_per_rank)")

    # -- checkpoints (fxpipe.distributed._weights) -----------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's tensors under the model's own keys (a tied weight under each name; the
        other ranks' stages are released, so absent): each rank's part of a
        ``torch.distributed.checkpoint`` save, which any layout, or the plain model, loads."""
        return local_state_dict(self.module)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> list[str]:
        """Loads this rank's tensors from ``state_dict`` (the model's keys; other ranks' keys
        are ignored). ``strict``: a key of this rank missing, or a key the model lacks, is a
        ``KeyError``. Returns the keys loaded."""
        return load_local_state_dict(self.module, state_dict, strict)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer``'s state keyed by the model's parameter names (torch's
        ``get_optimizer_state_dict`` conventions): this rank's part of a checkpoint."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        # flattened ('state.<name>.exp_avg', 'param_groups.<name>.lr'): each rank's own keys, which any
        # other layout's ranks find by name (nested param_groups would list each rank's own parameters)
        return get_optimizer_state_dict(self.module, optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """Loads into ``optimizer`` (over this rank's parameters) the state saved by
        :meth:`optimizer_state_dict` under any layout (torch's ``set_optimizer_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(self.module, optimizer, state_dict,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
