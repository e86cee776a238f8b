"""A sample whose samples are all alike, varied for the build's micro-batch checks.

The checks compare the whole sample with its micro-batches merged. A sample of identical
rows -- ``torch.zeros``, ``torch.ones``, one example repeated, the dummy inputs people build
from -- hides every batch mixing: ``h - h.mean(0)`` is the same per micro-batch as over the
batch when every row is the same (a trial: built, then 0.20 off on real batches). When every
input split along the batch has identical slices there, :func:`varied` gives the checks a
copy whose samples differ: floating inputs get seeded noise of their own scale (1 where they
are constant; else a shift up, or down, where the model rejects the noise), integer ones (token ids, labels) each sample's values permuted, so that every
value stays one the model was given. The capture, the plan and the profile keep the user's
sample; only the checks run on the varied one. A sample that cannot be varied (integer inputs
holding one value throughout: ``torch.zeros`` ids), or on whose varied copy the model fails or
overflows (a BCE target pushed out of [0, 1], a log of a silent spectrogram), is refused with
more than one micro-batch: it cannot show whether the model mixes its samples
(:mod:`fxpipe.checks._modes`).

A mask of all ones beside inputs that do differ hides the mixings that go through the mask: a
model trimming each batch to its longest sequence (``h[:, :mask.sum(1).max()]``) gives each
micro-batch the whole batch's result when every row is full (a trial: built from a tokenizer's
unpadded batch, then 0.067 off on padded ones). :func:`padded` gives the checks a copy whose
masks are padded as a collator pads: trailing zeros, a different length per row. So does a mask
padded alike in every row.

One input alike in every sample beside others that differ hides the mixings through that input
alone (a trial, all silent: per-sample weights normalised over the batch, ``softmax(w, 0)``, from a
sample of ``torch.ones`` weights; timesteps divided by the batch's largest, from a ``torch.full``
sample; class weights from the batch's label counts, from labels all 0). :func:`alike_inputs` names
such inputs and ``varied(..., only=...)`` varies them alone: a floating input as above, an integer
one of several values per sample by a permutation of each sample's, one of a value per sample
(labels, timesteps) by moving the second half's samples but the last by half the value (at
least 1).
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
from torch import Tensor

__all__ = ["varied", "alike", "alike_inputs", "padded"]


def _alike(x: Tensor, dim: int) -> bool:
    rows = x.movedim(dim, 0)
    return rows.shape[0] > 1 and bool((rows == rows[:1]).all())


def alike(flat: Sequence[Any], dims: Sequence[Optional[int]]) -> bool:
    """Whether every input split along the batch has the same values in every sample (on meta
    there are no values: not alike)."""
    split = _split(flat, dims)
    return bool(split) and not any(x.is_meta for _, x, _ in split) and all(_alike(x, d) for _, x, d in split)


def alike_inputs(flat: Sequence[Any], dims: Sequence[Optional[int]]) -> List[int]:
    """The indices of the inputs split along the batch whose samples all hold the same values,
    but for masks of zeros alone (a float mask too): a sample counting nothing, which the checks
    refuse as such, not a value to vary."""
    return [i for i, x, d in _split(flat, dims) if not x.is_meta and _alike(x, d) and not _zero_mask(x)]


def _zero_mask(x: Tensor) -> bool:
    return not x.is_complex() and x.dim() >= 2 and not bool(x.any())


def _split(flat: Sequence[Any], dims: Sequence[Optional[int]]) -> List[Any]:
    return [(i, x, d) for i, (x, d) in enumerate(zip(flat, dims))
            if isinstance(x, Tensor) and d is not None and x.dim() > d and x.numel()]


#: how floating inputs are varied, tried in turn until the model runs on one: seeded noise of the
#: input's scale, then a shift upwards, then downwards (a zeros image into a BCE target stays in
#: [0, 1] shifted up, a ones image shifted down)
ATTEMPTS = 3


def varied(flat: Sequence[Any], dims: Sequence[Optional[int]], attempt: int = 0,
           only: Optional[Sequence[int]] = None) -> Optional[List[Any]]:
    """``flat`` with its samples made to differ (see the module), or None where they already
    differ in some input split along the batch (or none is split), and where they cannot be
    made to (integer inputs holding one value throughout, such as ``torch.zeros`` ids).
    ``only``: the inputs to vary (:func:`alike_inputs`), whatever the others hold; None where
    none of them could be."""
    split = _split(flat, dims)
    if only is None and not alike(flat, dims):
        return None
    if only is not None:
        split = [(i, x, d) for i, x, d in split if i in only]
    g = torch.Generator(device="cpu").manual_seed(0)
    out = list(flat)
    for i, x, d in split:
        if x.is_floating_point():
            scale = float(x.detach().double().abs().max()) or 1.0
            if attempt == 0:
                noise = torch.randn(x.shape, generator=g, dtype=torch.float32) * (0.5 * scale)
            else:
                noise = torch.rand(x.shape, generator=g, dtype=torch.float32) * (scale if attempt == 1 else -scale)
            out[i] = (x.detach() + noise.to(dtype=x.dtype, device=x.device)).requires_grad_(x.requires_grad)
        elif x.dim() > d + 1 and not x.is_complex() and x.dtype is not torch.bool:
            rows = x.movedim(d, 0).reshape(x.shape[d], -1)
            order = torch.stack([torch.randperm(rows.shape[1], generator=g) for _ in range(rows.shape[0])])
            permuted = torch.gather(rows, 1, order.to(rows.device))
            out[i] = permuted.reshape(x.movedim(d, 0).shape).movedim(0, d).contiguous()
        elif x.dim() == d + 1 and only is not None and not x.is_complex():  # a value per sample
            # the second half's samples but the last moved by half the value (at least 1), up, then
            # down: the first micro-batch keeps the sample's value alone (a statistic over the batch,
            # its largest, differs there), a later one starts on a moved sample (t[0] differs), and
            # the two values are uneven in every split (counts of them weigh otherwise)
            step = _second_half(x.shape[d], x.device).view([-1 if k == d else 1 for k in range(x.dim())])
            if x.dtype is torch.bool:
                out[i] = x ^ step
            else:
                delta = max(1, abs(int(x.reshape(-1)[0])) // 2)
                out[i] = (x + step * delta if attempt == 0 else x - step * delta).to(x.dtype)
    if only is not None:
        return None if all(_alike(out[i], d) for i, _, d in split) else out
    return None if alike(out, dims) else out


def _second_half(n: int, device: Any) -> Tensor:
    """Which of ``n`` samples :func:`varied` moves: those of the second half but the last (the
    last too for a batch of two)."""
    r = torch.arange(n, device=device)
    return (r >= n // 2) & ((r != n - 1) | (n <= 2))


def _mask_alike(x: Tensor, dim: int) -> bool:
    """An input of two dims or more, the batch's not the last, of 0s and 1s (of any dtype), with
    ones in it, the same in every sample: an attention mask of a batch without padding, or padded
    alike in every row."""
    return (not x.is_complex() and not x.is_meta and x.dim() >= 2
            and dim < x.dim() - 1 and x.shape[-1] > 1 and bool(((x == 0) | (x == 1)).all())
            and bool((x == 1).any()) and _alike(x, dim))


def padded(flat: Sequence[Any], dims: Sequence[Optional[int]]) -> Optional[tuple[List[Any], List[int]]]:
    """``flat`` with every mask split along the batch alike in every row (all ones, or padded
    alike) padded (see the module): row
    ``r`` keeps its first ``n - 1 - (r - 1) % (n - 1)`` positions of ``n``, row 0 all of them,
    so that micro-batches of neighbouring rows differ in their longest row; and the indices of
    the inputs padded. None where no input is such a mask."""
    found = [(i, x, d) for i, x, d in _split(flat, dims) if _mask_alike(x, d)]
    if not found:
        return None
    out = list(flat)
    for i, x, d in found:
        n, rows = x.shape[-1], x.shape[d]
        keep = torch.tensor([n] + [n - 1 - (r - 1) % (n - 1) for r in range(1, rows)], device=x.device)
        position = torch.arange(n, device=x.device).view([-1 if k == x.dim() - 1 else 1 for k in range(x.dim())])
        mask = position < keep.view([-1 if k == d else 1 for k in range(x.dim())])
        out[i] = mask.expand(x.shape).to(x.dtype).contiguous()
    return out, [i for i, _, _ in found]
