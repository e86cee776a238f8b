"""``eval_step`` after ``model.eval()`` for a pipeline built in training mode whose graph bakes the
modes in (torch.export: every transformers model; a traced ``self.training``).

Validation in the middle of training is universal, and such a graph keeps dropout on in eval
(GPT-2's logits 0.19-0.27 off, differently at each call) -- refused until now. One process
captures the model again when its flags change (:mod:`fxpipe._mode_variants`); ranks cannot: each
holds only its own stages' weights after the build (:mod:`._weights`), and a capture runs the whole
model. So the build captures the eval mode too, while every rank still has the whole model
(:func:`capture_eval`, the same steps as the build's capture, the plan's cut carried over), agrees
on its stage code, and makes this rank's stages of it a forward-only schedule of their own
(:func:`eval_run`). ``eval_step`` runs it whenever every module is in eval mode; ``step`` in eval
mode, and any other mix of flags, stay refused.

The eval capture costs the build about one more capture and check, for mode-sensitive graphs
only. A capture that fails, or a cut that does not carry over, on any rank leaves every rank
without it: ``eval_step`` in eval mode then raises ``ModeError`` saying why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from fxpipe._mode_variants import Variant
from fxpipe.build import BuildOptions, Checked, capture_flipped
from fxpipe.capture._tracing import retarget_devices
from fxpipe.emit._placement import move_in_place, stage_tensors
from fxpipe.emit._stages import Stages, emit_stages
from fxpipe.errors import FxpipeError
from fxpipe.plan._value import Plan
from torch.distributed.pipelining import PipelineStage

from ._agree import agree_on_stages
from ._carry import carried_plan
from ._failures import Failures
from ._symbolic_meta import ShapeMetas
from ._schedules import forward_schedule
from ._shape_runs import ShapeRuns
from ._values import StageRunner, stage_runners

__all__ = ["EvalRun", "capture_eval", "eval_run"]

#: what the build's eval capture found: the flags, the capture checked, its stages and their plan
Found = tuple[tuple[bool, ...], Checked, Stages, Plan]


@dataclass
class EvalRun:
    """What ``eval_step`` runs in eval mode: the capture with its batching, stages and checks of
    what they hold (a :class:`~fxpipe._mode_variants.Variant`, as one process keeps per set of
    flags), this rank's forward-only schedule over the stages and the last stage's runner
    where this rank holds it, per micro-batch shape (:mod:`._shape_runs`), and the flags it
    is for."""

    flags: tuple[bool, ...]
    variant: Variant
    runs: ShapeRuns[tuple[Any, Optional[StageRunner]]]


def capture_eval(model: nn.Module, checked: Checked, plan: Plan, options: BuildOptions, group: dist.ProcessGroup,
                 device: torch.device, n_stages: int) -> tuple[Optional[Found], str]:
    """The model captured in eval mode with ``plan``'s cut, its stages emitted and agreed on
    every rank: ``((flags, checked, stages, their plan), '')``, or ``(None, why)`` on every rank alike.
    Collective; call inside ``preserved(model)``, before the weights are made local."""
    found: list[Any] = []
    try:
        with Failures(group, device).agreed("capture the model in eval mode"):
            flags, other, carried = capture_flipped(model, checked, plan, options)
            if isinstance(other, BaseException):
                raise other
            found.append((flags, other, carried))
    except FxpipeError as e:  # raised on every rank (the failing one's error, PeerFailedError elsewhere)
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    flags, other, carried = found[0]
    built: list[tuple[Stages, Plan]] = []

    def build() -> list[str]:
        gm = other.capture.graph_module
        portals_carried = carried_plan(gm, carried)
        built.append((emit_stages(gm, portals_carried), portals_carried))
        return [built[0][0].stage_code(k, source=False) for k in range(n_stages)]

    try:
        agree_on_stages(build, group)
    except FxpipeError as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return (flags, other, *built[0]), ""


def eval_run(found: Found, model: nn.Module, flat: Sequence[Any], local: Sequence[int], placement: Sequence[int],
             chunks: int, group: dist.ProcessGroup, device: torch.device,
             stage_class: type = PipelineStage) -> EvalRun:
    """This rank's stages of the eval capture as a forward-only schedule on ``device`` (the
    weights already local, :mod:`._materialise`), made per micro-batch shape."""
    flags, checked, stages, plan = found
    captured, n_stages = checked.capture, len(stages)
    if captured.method == "export":
        for stage in stages.modules:
            retarget_devices(stage, device)
    for k in local:
        for t in stage_tensors(stages[k]):
            move_in_place(t, device)

    metas_at = ShapeMetas(stages.modules, stages.input_names, device)

    def make(micro_flat: Sequence[Any]) -> tuple[Any, Optional[StageRunner]]:
        metas = metas_at(micro_flat)
        pipe_stages, runners = stage_runners(stages, metas, flat, local, captured.out_spec, device, group,
                                             stage_class, training_of=model)
        return forward_schedule(pipe_stages, chunks, placement), runners.get(n_stages - 1)

    return EvalRun(flags, Variant.of(model, captured, checked.batching, plan, stages), ShapeRuns(make))
