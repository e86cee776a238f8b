"""The micro-batch check once more where code runs opaque: with one micro-batch's values large.

A module kept opaque (``leaf_modules``, or code torch.fx cannot trace: a Python ``if`` on a
tensor) runs its own code at each call, and may decide something for the whole batch from its
values: ``if h.abs().amax() > 4: h = h * 4 / m``, an expert capacity counted over the batch's
tokens, frequencies picked from the batch's largest position. On the build's sample the
decision may come out alike for the whole batch and each micro-batch, and the check passes;
a later batch with one large sample rescales the whole batch in eager and one micro-batch in
the pipeline (a trial: the other micro-batch's rows 0.051 off, magnitude 0.114, silently).

So where the graph holds such a module, the sample is checked once more with the floating
inputs of its first micro-batch made :data:`SCALE` times larger: what the batch decides from
its values then differs from what each micro-batch decides. Outputs that are not finite there,
or a model failing on such inputs, make no claim. Two forwards of the sample, paid only by
graphs with opaque modules of the model's own (torch.nn's layers act per sample); a decision
crossing a threshold other values would cross is not found (the docs say so).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor, fx, nn

from ..capture._prepare import preserved
from ..capture._values import same_value
from ..errors import MicroBatchError
from ._batching import Batching
from ._micro_batches import SAMPLE_SEED, micro_batch_count
from ._randomness_off import randomness_off

__all__ = ["SCALE", "check_stressed"]

#: how much larger the first micro-batch's floating inputs are made
SCALE = 100.0


def check_stressed(batching: Batching, gm: fx.GraphModule, model: nn.Module, flat: Sequence[Any],
                   leaves: Sequence[str], mode: Callable[[nn.Module], Any], chunks: int,
                   blame: Optional[Callable[[List[Any], List[List[Any]]], str]] = None) -> None:
    """Refuses a graph holding opaque modules (``leaves``) whose merged micro-batches differ
    from the whole sample's outputs once the first micro-batch's floating inputs are made
    larger (see the module docstring). ``blame(flat, micro)`` names the first module that
    differs. Call inside ``preserved(model)``."""
    total = batching.batch_size(flat)
    if not leaves or chunks < 2 or total < 2:
        return
    with mode(model), torch.no_grad():
        micro, sizes = batching.split(flat, micro_batch_count(total, chunks))
    stressed = _first_scaled(batching, flat, sizes[0])
    if stressed is None:
        return
    try:
        with preserved(model), randomness_off(), mode(model), torch.no_grad():
            micro, _ = batching.split(stressed, len(sizes))
            weights = batching.weights(stressed, micro, "the sample")
            torch.manual_seed(SAMPLE_SEED)
            whole = list(gm(*stressed))
            outs = [list(gm(*m)) for m in micro]
    except Exception:  # noqa: BLE001 - a model that does not take such values: no claim
        return
    for i, (a, column) in enumerate(zip(whole, zip(*outs))):
        if isinstance(a, Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
            return
        try:
            b = batching._merge_leaf(i, list(column), sizes, weights.get(i))
        except MicroBatchError:
            return  # an output that does not merge: the check on the sample said so already
        if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and not same_value(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            found = blame(stressed, micro) if blame is not None else ""
            raise MicroBatchError(
                f"with the first micro-batch's floating inputs made {SCALE:g} times larger, the outputs merged over "
                f"{len(sizes)} micro-batches differ from the whole batch's by up to {diff:.3g} (largest |value| "
                f"{a.double().abs().max().item():.3g}), though they agree on the sample. The graph holds modules kept "
                f"opaque, which run their own code ({', '.join(map(repr, leaves[:4]))}): one of them decides something "
                f"for the whole batch from its values (if h.abs().amax() > t, a capacity counted over the batch's tokens), "
                f"and a pipeline decides it per micro-batch, silently differing from the model on such a batch. "
                f"{found + ' ' if found else ''}What to do: make that decision per sample (amax over the sample's own "
                f"dims), or build with chunks=1")


def _first_scaled(batching: Batching, flat: Sequence[Any], first: int) -> Optional[List[Any]]:
    """``flat`` with the first ``first`` samples of each split floating input multiplied by
    :data:`SCALE`; None where no input is floating (nothing to make larger)."""
    out, scaled = [], False
    for d, x in zip(batching.in_dims, flat):
        if isinstance(x, Tensor) and x.is_floating_point() and d is not None and x.dim() > 0:
            head, tail = x.split([first, x.size(d) - first], dim=d)
            out.append(torch.cat([head * SCALE, tail], dim=d))
            scaled = True
        else:
            out.append(x)
    return out if scaled else None
