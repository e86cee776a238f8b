"""The micro-batch check once more where code runs opaque: with one micro-batch's values large.

A module kept opaque (``leaf_modules``, or code torch.fx cannot trace: a Python ``if`` on a
tensor) runs its own code at each call, and may decide something for the whole batch from its
values: ``if h.abs().amax() > 4: h = h * 4 / m``, an expert capacity counted over the batch's
tokens, frequencies picked from the batch's largest position. On the build's sample the
decision may come out alike for the whole batch and each micro-batch, and the check passes;
a later batch with one large sample rescales the whole batch in eager and one micro-batch in
the pipeline (a trial: the other micro-batch's rows 0.051 off, magnitude 0.114, silently).

So where the graph holds such a module, the sample is checked once more with the floating
inputs of its first micro-batch made :data:`SCALE` times larger, and once for each integer
input (positions: Llama's dynamic and Phi-3's long RoPE pick their frequencies from the
batch's largest, a trial: 1.72 off) made so alone: what the batch decides from its values then
differs from what each micro-batch decides. Outputs that are not finite there, or a model
failing on such inputs (token ids past the vocabulary), make no claim. Two forwards of the
sample per variant, paid only by graphs with opaque modules of the model's own (torch.nn's
layers act per sample); a decision crossing a threshold other values would cross is not found
(the docs say so).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

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
    from the whole sample's outputs once the first micro-batch's floating inputs, or one of
    its integer inputs, are made larger (see the module docstring). ``blame(flat, micro)`` names the first module that
    differs. Call inside ``preserved(model)``."""
    total = batching.batch_size(flat)
    if not leaves or chunks < 2 or total < 2:
        return
    with mode(model), torch.no_grad():
        micro, sizes = batching.split(flat, micro_batch_count(total, chunks))
    for what, stressed in _variants(batching, flat, sizes[0]):
        found = _differs(batching, gm, model, stressed, sizes, mode)
        if found is None:
            continue
        diff, scale = found
        blamed = blame(stressed, batching.split(stressed, len(sizes))[0]) if blame is not None else ""
        raise MicroBatchError(
            f"with {what} made {SCALE:g} times larger in the first micro-batch, the outputs merged over {len(sizes)} "
            f"micro-batches differ from the whole batch's by up to {diff:.3g} (largest |value| {scale:.3g}), though "
            f"they agree on the sample. The graph holds modules kept opaque, which run their own code "
            f"({', '.join(map(repr, leaves[:4]))}): one of them computes something over the whole batch from its "
            f"values (a threshold, if h.abs().amax() > t; frequencies picked from the batch's largest position; a "
            f"max subtracted for stability, exp(s - s.max()), exact per sample only until one sample's values "
            f"dwarf the others'), and a pipeline computes it per micro-batch, silently differing from the model on "
            f"such a batch. {blamed + ' ' if blamed else ''}What to do: compute it per sample (amax or max over "
            f"the sample's own dims), or build with chunks=1")


def _differs(batching: Batching, gm: fx.GraphModule, model: nn.Module, stressed: List[Any], sizes: List[int],
             mode: Callable[[nn.Module], Any]) -> Optional[Tuple[float, float]]:
    """(largest difference, largest |value|) of the first output whose merged micro-batches
    differ from the whole batch's on ``stressed``; None where they agree, or no claim can be
    made (the model fails on such inputs, an output is not finite or does not merge)."""
    try:
        with preserved(model), randomness_off(), mode(model), torch.no_grad():
            micro, _ = batching.split(stressed, len(sizes))
            weights = batching.weights(stressed, micro, "the sample")
            torch.manual_seed(SAMPLE_SEED)
            whole = list(gm(*stressed))
            outs = [list(gm(*m)) for m in micro]
    except Exception:  # noqa: BLE001 - a model that does not take such values: no claim
        return None
    for i, (a, column) in enumerate(zip(whole, zip(*outs))):
        if isinstance(a, Tensor) and a.is_floating_point() and not bool(torch.isfinite(a).all()):
            return None
        try:
            b = batching._merge_leaf(i, list(column), sizes, weights.get(i))
        except MicroBatchError:
            return None  # an output that does not merge: the check on the sample said so already
        if isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and not same_value(a, b):
            return (a.double() - b.double()).abs().max().item(), a.double().abs().max().item()
    return None


def _variants(batching: Batching, flat: Sequence[Any], first: int) -> Iterator[Tuple[str, List[Any]]]:
    """(what was made larger, ``flat`` with it): the split floating inputs' first ``first``
    samples, then each split integer input's on its own (positions: frequencies picked from the
    batch's largest; token ids past the vocabulary make the model fail, which claims nothing)."""
    floating = [i for i, (d, x) in enumerate(zip(batching.in_dims, flat)) if _split(x, d) and x.is_floating_point()]
    integer = [i for i, (d, x) in enumerate(zip(batching.in_dims, flat))
               if _split(x, d) and not x.is_floating_point() and x.dtype != torch.bool and not x.is_complex()]
    if floating:
        yield "the floating inputs", _scaled(batching, flat, first, floating)
    for i in integer:
        yield f"{batching.in_names[i]}", _scaled(batching, flat, first, [i])


def _split(x: Any, d: Optional[int]) -> bool:
    return isinstance(x, Tensor) and d is not None and x.dim() > 0


def _scaled(batching: Batching, flat: Sequence[Any], first: int, which: Sequence[int]) -> List[Any]:
    """``flat`` with the first ``first`` samples of the inputs ``which`` multiplied by :data:`SCALE`."""
    out = list(flat)
    for i in which:
        x, d = flat[i], batching.in_dims[i]
        head, tail = x.split([first, x.size(d) - first], dim=d)
        out[i] = torch.cat([head * int(SCALE) if not x.is_floating_point() else head * SCALE, tail], dim=d)
    return out
