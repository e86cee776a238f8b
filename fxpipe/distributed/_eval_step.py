"""``DistributedPipeline.eval_step``: forward only on every rank, the outputs merged as
``fxpipe.pipeline`` merges them, and the loss on every rank.

Split from :mod:`._pipe` (the pipeline and its training step) to keep each small: a mixin
whose methods read the pipeline's state (every attribute used here is set by
``DistributedPipeline.__init__``), and the two broadcasts a step's and an evaluation's
results take from the last stage's rank to every rank.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxpipe.errors import BatchShapeError

__all__ = ["EvalStep"]

#: the float dtypes a broadcast loss can have, by index (:meth:`EvalStep._broadcast_loss`)
_FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


class EvalStep:
    """The evaluation half of :class:`~fxpipe.distributed._pipe.DistributedPipeline` (a mixin)."""

    capture: Any
    chunks: int
    device: torch.device
    module: Any
    _batching: Any
    _captured_training: bool
    _copies: Any
    _evaluation: Any
    _failures: Any
    _flags: Any
    _group: Any
    _last_rank: int
    _run: Any
    _runs: Any
    _step_loss: Any

    def _broadcast_loss(self, loss: Optional[torch.Tensor]) -> torch.Tensor:
        """The last stage's loss on every rank: float64 carries any float dtype exactly, the
        dtype travels as its index in ``_FLOATS``."""
        box = torch.zeros(2, dtype=torch.float64, device=self.device)
        if loss is not None:
            box[0], box[1] = loss.double(), float(_FLOATS.index(loss.dtype))
        dist.broadcast(box, src=self._last_rank, group=self._group)
        return loss if loss is not None else box[0].to(_FLOATS[int(box[1].item())])

    @torch.no_grad()
    def eval_step(self, *args: Any, target: Any = None, return_outputs: bool = False, **kwargs: Any) -> Optional[Any]:
        """Forward only, on every rank at once, the outputs merged over micro-batches as
        ``fxpipe.pipeline`` merges them (along dim 0; a loss as ``output_merge`` says, weighed by
        its counted labels).

        With a loss -- ``target`` given to a pipeline built with ``loss_fn`` (the loss of the
        merged outputs: the whole batch's, exact for any loss), or the model's own loss
        (``loss_fn=None``) -- returns the loss on every rank, as ``step`` does;
        ``return_outputs=True``: ``(loss, outputs)``, the outputs on every rank (sent from the
        last stage's rank, on the CPU). Without a loss: the outputs on the last stage's rank,
        ``None`` on the others (``return_outputs=True``: on every rank)."""
        self._check_open()
        with self._failures.agreed("check its batch", call="eval_step()") as agreement:
            agreement.flags = self._flags.fingerprints()  # modes: alike on every rank
            agreement.copies = self._copies
            run = self._evaluation if self._in_eval_capture() else None  # the build's eval-mode capture
            flat, micro_flat = self._inputs(args, kwargs, run)
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            agreement.batch = (tensors, target)
            if target is not None and (self._step_loss is None or self._step_loss.own is not None):
                raise BatchShapeError("target= is given, but this pipeline has no loss_fn to compute a loss with (built "
                                      "with loss_fn=None: the model's own loss, which eval_step returns): leave "
                                      "target out, or build with loss_fn=")
            capture, batching = ((self.capture, self._batching) if run is None
                                 else (run.variant.capture, run.variant.batching))
            micro, sizes = batching.split(flat, self.chunks)
            weights = batching.weights(flat, micro)  # a loss over counted labels: each micro-batch's count
            if run is None:
                train = self._run = self._runs.get(micro_flat)
                schedule, output = train.forward_only, train.output
            else:
                schedule, output = run.runs.get(micro_flat)
        with self._exchanging():
            chunks = schedule.step(*self._sent(tensors))
        outputs, loss = None, None
        if chunks is not None:  # the last stage's rank
            leaves = [output.flat(c if isinstance(c, (tuple, list)) else (c,)) for c in chunks]
            merged = batching.merge(leaves, sizes, weights)
            outputs = capture.unflatten_output(merged)
            if self._step_loss is not None and self._step_loss.own is not None:
                loss = merged[self._step_loss.own]
            elif target is not None and self._step_loss is not None:
                on = pytree.tree_map(lambda t: t.to(self.device) if isinstance(t, torch.Tensor) else t, target)
                loss = self._step_loss.loss_fn(outputs, on)
        asked = target is not None or (self._step_loss is not None and self._step_loss.own is not None)
        with self._exchanging():
            if asked:
                loss = self._broadcast_loss(loss.detach() if loss is not None else None)
            if return_outputs:
                outputs = self._everywhere(outputs)
        if not asked:
            return outputs
        return (loss, outputs) if return_outputs else loss

    def _everywhere(self, value: Any) -> Any:
        """``value`` of the last stage's rank on every rank (its tensors through the CPU)."""
        box = [pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, value)
               if value is not None else None]
        dist.broadcast_object_list(box, src=self._last_rank, group=self._group)
        return box[0]

    def _in_eval_capture(self) -> bool:
        """Every module in eval mode, a graph with training baked in, and the build's eval
        capture there to run (:mod:`._eval_mode`)."""
        return (self._evaluation is not None and self.module.training != self._captured_training
                and all(not m.training for m in self.module.modules()))
