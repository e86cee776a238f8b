"""Whether a merged 0-dim output (a loss) also has the full batch's *gradient*.

The build-time check (:func:`fxpipe.checks._micro_batches.check_split`) compares values, with a
tolerance made for ordinary float differences between a batch and its micro-batches. A
loss that weighs its items wrongly after merging can still land inside that tolerance: a
token mean over a padding mask merged by ``'mean'`` weighs each micro-batch's tokens by
that micro-batch's count, and with a freshly initialised model every token costs about
``log(vocab)``, so the value moves by 1e-4 while the gradient weight of every token is off
by a factor of two or more. Training on it would silently differ from eager. (A cross
entropy mean over labels that are not ``ignore_index`` is merged weighted by those counts,
:mod:`fxpipe.checks._counted_labels`, and so passes.)

So for every 0-dim floating output with a declared merge, the captured graph runs forward
and backward once on the whole sample and once split and merged, and the two gradients
with respect to the parameters must agree too. The weights are what differs, and they
show in the gradients however similar the per-item values are.

The comparison runs at weights near the model's, not at its own (:func:`nudged`). Freshly
initialised weights are a special point: a router initialised to zeros sends every token to
the experts alike, so a load-balancing loss ``(p.mean((0, 1)) ** 2).sum()`` (a nonlinear
function of a mean over the batch) has the same value and gradient in every micro-batch, and
merged by ``'mean'`` passed; once training moved the router it was silently off (6% in
gradients). An identity that holds for the loss's code holds at any weights; one that held
only at the initial point shows at a nudged one.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator, List, Optional, Sequence

import torch
from torch import Tensor, fx

from ..capture._numerics import tolerance
from ..errors import MicroBatchError
from ._randomness_off import backward_under_modes

__all__ = ["gradient_mismatch", "nudged"]

#: how far :func:`nudged` moves each weight, relative to its tensor's root mean square
NUDGE = 0.1


def _grads(value: Tensor, params: List[Tensor]) -> List[Tensor]:
    """d value / d params as float64, zeros where a parameter does not reach ``value``.

    Taken by ``backward()`` into ``.grad`` (put back afterwards), not ``torch.autograd.grad``:
    a model's own ``torch.utils.checkpoint(use_reentrant=True)`` inside a module kept opaque
    runs a backward of its own that refuses ``.grad()`` (transformers'
    ``gradient_checkpointing_enable`` with ``use_reentrant=True`` and a ``labels=`` loss)."""
    if not value.requires_grad:
        return [torch.zeros_like(p, dtype=torch.float64) for p in params]
    kept = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        backward_under_modes(value)
        return [torch.zeros_like(p, dtype=torch.float64) if p.grad is None else p.grad.double() for p in params]
    finally:
        for p, g in zip(params, kept):
            p.grad = g


def gradient_mismatch(gm: fx.GraphModule, flat: Sequence[Any], micro: Sequence[Sequence[Any]],
                      indices: Sequence[int], merge: Callable[[int, List[Any]], Any]) -> Optional[tuple]:
    """``(output index, parameter name, largest difference, largest |gradient|)`` of the first
    output in ``indices`` whose merged gradient differs from the whole batch's, or None. A 0-dim
    output (a loss) is differentiated as it is, a per-sample output through a fixed random
    weighing of its elements (the same for the whole batch and the merged micro-batches).

    ``merge(i, parts)`` merges output ``i`` of the micro-batches as the pipeline will.
    Runs with gradients enabled, leaving every ``.grad`` as it was; the caller sets the mode
    and seeds and restores the model's state.
    """
    named = [(n, p) for n, p in gm.named_parameters() if p.requires_grad]
    if not named or not indices or any(p.is_meta for _, p in named):  # on meta: no values to compare
        return None
    params = [p for _, p in named]
    try:
        with nudged(gm, buffers=False):
            found = _compare(gm, named, params, flat, micro, indices, merge)
        if found is None or all(math.isfinite(v) for v in found[2:]):
            return found
    except Exception:  # noqa: BLE001 - weights the model cannot run at (a parameter read as an index)
        pass
    return _compare(gm, named, params, flat, micro, indices, merge)  # the nudge broke it: its own weights


def _refuse_not_finite(output: int, named: List[Any], grads: List[Tensor]) -> None:
    """The whole sample's gradient is nan or infinite: nothing can be compared on it."""
    name = next((n for (n, _), g in zip(named, grads) if g.numel() and not bool(torch.isfinite(g).all())), "?")
    raise MicroBatchError(
        f"on the sample, the gradient of output {output} is not finite (in parameter `{name}`), so the build "
        "cannot check that micro-batches give the whole batch's gradients. A loss whose sample counts nothing "
        "(every label ignore_index, an attention mask of zeros) is 0 / 0 = nan. What to do: build from a sample "
        "whose loss and gradients are finite (a batch of your data); the pipeline then takes such batches as "
        "eager does.")


@contextmanager
def nudged(gm: fx.GraphModule, buffers: bool = True) -> Iterator[None]:
    """Every floating parameter of ``gm`` moved by ``NUDGE`` times its root mean square in a
    random direction (a tensor of zeros by ``NUDGE`` times the model's typical one), and every
    floating buffer each element by ``NUDGE`` of itself (its sign kept: a variance stays
    positive, a mask's ``-inf`` stays) or, where it is 0, of the typical size -- a mixing gate
    the training loop ramps up from 0 in a buffer (a warm-up schedule) hid behind it, 0.025 off
    (a trial); all put back exactly afterwards. Seeded by a generator of its own: torch's global
    RNG is untouched. ``buffers=False``: parameters only (the merged-loss gradient check, whose
    merge weights -- class weights a loss reads from a buffer -- are counted at the model's own).

    The direction is one block of :data:`_PERIOD` normal draws repeated, each tensor starting
    at another place in it (two zero gates nudged alike could cancel): drawing a normal
    number for every parameter cost 4.6 s for GPT-2 124M on one thread, 2.4 of its forwards,
    at every build. A nudged tensor is a new one, swapped in through ``.data`` and the
    original swapped back after (exact, no copy back): a clone, the block repeated and an
    in-place add cost 0.41 s for GPT-2 124M, a sixth of its training step (issue 31).

    Under autocast (a build inside ``torch.autocast``) the cache of weights cast to the lower
    precision is emptied on entry and exit: autocast keys it by the tensor, which a nudge
    keeps, so a cast made before would hide the nudge, and one made during it would stand for
    the model's weights in the calls that follow (the pipeline computed at nudged weights)."""
    params = [p for p in gm.parameters() if p.is_floating_point() and p.numel()]
    buffers = [b for b in gm.buffers() if b.is_floating_point() and b.numel()] if buffers else []
    rms = [float(torch.linalg.vector_norm(p.detach(), dtype=torch.float32)) / math.sqrt(p.numel()) for p in params]
    nonzero = sorted(r for r in rms if r > 0)
    typical = nonzero[len(nonzero) // 2] if nonzero else 0.02
    block = _BLOCK

    def noise(k: int, t: Tensor) -> Tensor:
        start, n = (k * _STRIDE) % _PERIOD, t.numel()
        return block.repeat(-(-(start + n) // _PERIOD))[start:start + n].view(t.shape).to(t.device, t.dtype)

    # through .data: the tensors' version counters stay as they were, so a graph the user
    # recorded before the build (weights saved for its backward) still backpropagates
    kept: List[Tensor] = []
    torch.clear_autocast_cache()  # casts of the weights autocast made before: not of the nudged ones
    try:
        with torch.no_grad():
            for k, (p, r) in enumerate(zip(params, rms)):
                new = _plus_noise(p.data, block, (k * _STRIDE) % _PERIOD, NUDGE * (r if r > 0 else typical))
                kept.append(p.data)
                p.data = new
            for k, b in enumerate(buffers, start=len(params)):
                d = noise(k, b) * NUDGE
                new = torch.where(b == 0, d * typical, b * (1 + d))
                kept.append(b.data)
                b.data = new
        yield
    finally:
        for t, original in zip((*params, *buffers), kept):
            t.data = original
        torch.clear_autocast_cache()  # nor, after, of the nudged weights (the pipeline's calls would use them)


def _plus_noise(t: Tensor, block: Tensor, start: int, alpha: float) -> Tensor:
    """A new tensor: ``t`` plus ``alpha`` times the block repeated from ``start`` (element ``j``
    gets ``block[(start + j) % len(block)]``), added a block-wide row at a time, broadcast:
    no repeated copy of the block the size of ``t``."""
    period = block.numel()
    rolled = torch.roll(block, -start).to(t.device, t.dtype)
    flat = t.reshape(-1)
    out = torch.empty(flat.shape, dtype=t.dtype, device=t.device)
    whole = flat.numel() // period * period
    if whole:
        torch.add(flat[:whole].view(-1, period), rolled, alpha=alpha, out=out[:whole].view(-1, period))
    if whole < flat.numel():
        torch.add(flat[whole:], rolled[:flat.numel() - whole], alpha=alpha, out=out[whole:])
    return out.view(t.shape)


#: the length of the nudge's block of draws (a prime: its repeats line up with no layer's width)
_PERIOD = 10007
#: how far each next tensor's noise starts into the block
_STRIDE = 3001
#: the nudge's draws, made once at import: drawn inside the checks, they met
#: :func:`~fxpipe.checks._randomness_off.randomness_off`, which makes ``randn`` 0, and every
#: model with dropout was checked at its own weights instead (a gate at zero hid its mixing)
_BLOCK = torch.randn(_PERIOD, generator=torch.Generator(device="cpu").manual_seed(0), dtype=torch.float32)


def _compare(gm: fx.GraphModule, named: List[Any], params: List[Tensor], flat: Sequence[Any],
             micro: Sequence[Sequence[Any]], indices: Sequence[int],
             merge: Callable[[int, List[Any]], Any]) -> Optional[tuple]:
    # detached: a sample with autograd history (a trainable projection or soft prompt before the
    # model, inputs_embeds, a leaf with requires_grad) would take .grad from these backwards into
    # tensors outside the model, and the user's next step would add them (measured: 2x a step's)
    flat = [x.detach() if isinstance(x, Tensor) else x for x in flat]
    micro = [[x.detach() if isinstance(x, Tensor) else x for x in m] for m in micro]
    with torch.enable_grad():
        whole = list(gm(*flat))
        outs = [list(gm(*m)) for m in micro]
        for i in indices:
            merged = merge(i, [o[i] for o in outs])
            if not isinstance(merged, Tensor) or not (merged.requires_grad or whole[i].requires_grad):
                continue
            w, m = whole[i], merged
            if w.dim() > 0:  # a per-sample output: the gradient of a fixed random weighing of it
                g = torch.Generator(device="cpu").manual_seed(i)
                r = torch.randn(w.shape, generator=g, dtype=torch.float32).to(device=w.device, dtype=w.dtype)
                w, m = (w * r).sum(), (m * r).sum()
            a, b = _grads(w, params), _grads(m, params)
            scale = max((float(g.abs().max()) for g in a if g.numel()), default=0.0)
            if not math.isfinite(scale):
                _refuse_not_finite(i, named, a)
            for (name, p), ga, gb in zip(named, a, b):
                rtol, atol = tolerance(p.dtype)  # follows the precision in effect (fxpipe.capture._numerics)
                if not torch.allclose(ga, gb, rtol=rtol, atol=atol * scale):
                    return i, name, float((ga - gb).abs().max()), scale
    return None
