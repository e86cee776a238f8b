"""The build's checks in one pass where they agree: the graph split into micro-batches at
nudged weights, merged, against the eager model on the whole sample at the same weights.

Why: checked one by one, the build runs the sample four times -- the graph whole (at the
build's weights), the graph whole and split at nudged weights (micro-batches give the batch's
result, also behind a gate initialised at zero), and the eager model (the capture is
faithful) -- 1.3 eager training steps of GPT-2 124M's build (issue 31). Where the merged
micro-batches give the eager model's every output at nudged weights, all of it holds at once:
the split graph is the whole graph (a graph that mixed its samples would differ from the
model, which computes the whole batch together) and the graph is the model, at weights where
no zero-initialised gate hides a difference, so at the build's too (the graph was captured
there). Two forwards instead of four.

Anything else runs the checks one by one (:mod:`fxpipe.checks._modes`), which say what
differs: any difference or output that is not finite, a model or graph failing at nudged
weights, draws the check cannot make constant, a capture that returns other leaves than the
model (a transformers cache), a graph holding weights the model does not share (the two
would be nudged apart), a meta model, a structure-only check, a sample of one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import Tensor, nn

from ..capture._prepare import preserved
from ..capture._tracing import Capture
from ..capture._values import same_value
from ..errors import MutationError
from ..runtime._randomness import drew_random
from ..tree import flatten
from ._batching import Batching
from ._counted_labels import CountedLabels
from ._loss import nudged
from ._micro_batches import SAMPLE_SEED, eager_run, micro_batch_count, state_kept
from ._randomness_off import randomness_off

__all__ = ["OnePass", "one_pass"]


@dataclass
class OnePass:
    """What the passed check leaves for the rest: the batching policy decided on the sample,
    the eager model's outputs (at nudged weights: for their structure), the micro-batches and
    their sizes, and the merge's weights at the build's weights (the gradient check's)."""

    batching: Batching
    whole: List[Any]
    micro: List[List[Any]]
    sizes: List[int]
    weights: Dict[int, List[Tensor]]
    #: whether the run drew what :func:`~fxpipe.checks._randomness_off.randomness_off` makes constant
    quieted: bool


def one_pass(captured: Capture, model: nn.Module, args: tuple, kwargs: dict, flat: Sequence[Any],
             mode: Callable[[nn.Module], Any], chunks: int, make_batching: Callable[[List[Any]], Batching],
             record: Optional[Callable[..., Any]] = None) -> Optional[OnePass]:
    """The check in one pass (see the module docstring), or None where it does not pass or
    cannot be made: the checks then run one by one. ``make_batching(leaves)``: the policy
    from the sample's output leaves. A refusal the policy makes on the sample (an
    ``output_merge`` naming no output, labels a mean cannot weigh) is left to the checks one
    by one, which raise it in their order; a parameter's ``.data`` assigned anew in traced
    code is refused here (:func:`~fxpipe.checks._micro_batches.eager_run`). ``record``: called
    in the graph's place on the first micro-batch (the build's plan profiles from that run:
    :mod:`fxpipe.plan._recorded`). Call inside ``preserved(model)``."""
    gm = captured.graph_module
    if not _shares_weights(gm, model):
        return None
    try:
        with preserved(model), randomness_off() as off, nudged(gm):
            with state_kept(model, gm):  # the micro-batches start from the state the whole run found
                eager = eager_run(captured, model, args, kwargs, mode)
            leaves, spec = flatten(eager)
            if drew_random(SAMPLE_SEED) or spec != captured.out_spec:
                return None
            batching = make_batching(leaves)
            total = batching.batch_size(flat)
            if total < 2:
                return None
            batching.counted = CountedLabels.find(gm, leaves, [m == "mean" for m in batching.merges],
                                                  batching.in_dims, flat)
            with mode(model), torch.no_grad():
                micro, sizes = batching.split(flat, micro_batch_count(total, chunks))
                at_nudged = batching.weights(flat, micro, "the sample")  # class weights read from a nudged buffer
                torch.manual_seed(SAMPLE_SEED)
                outs = [list((record if record is not None and i == 0 else gm)(*m)) for i, m in enumerate(micro)]
            if drew_random(SAMPLE_SEED) or not _merged_match(batching, leaves, outs, sizes, at_nudged):
                return None
    except MutationError:
        raise  # a .data assigned anew in traced code: the eager run showed it
    except Exception:  # noqa: BLE001 - a failure at nudged weights, a refusal: the checks one by one say it
        return None
    with mode(model), torch.no_grad():
        weights = batching.weights(flat, micro, "the sample")  # decided as for a call, at the model's weights
    batching.checked_sizes = list(sizes)
    return OnePass(batching, leaves, micro, sizes, weights, off.replaced)


def _shares_weights(gm: nn.Module, model: nn.Module) -> bool:
    """Whether every floating tensor :func:`~fxpipe.checks._loss.nudged` moves in the graph is
    one of the model's own: a copy would be nudged in the graph alone."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    return all(id(t) in own for t in (*gm.parameters(), *gm.buffers()) if t.is_floating_point() and t.numel())


def _merged_match(batching: Batching, whole: List[Any], outs: List[List[Any]], sizes: List[int],
                  weights: Dict[int, List[Tensor]]) -> bool:
    """Whether every output merged over the micro-batches is the eager model's, all finite
    (an overflow there compares nothing)."""
    if any(len(o) != len(whole) for o in outs):
        return False
    for i, (a, column) in enumerate(zip(whole, zip(*outs))):
        if isinstance(a, Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
            return False
        if not same_value(a, batching._merge_leaf(i, list(column), sizes, weights.get(i))):
            return False
    return True
