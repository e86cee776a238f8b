"""Each rank holds only its own stages' weights: released after the build, gathered to build again,
saved and loaded by the model's own keys.

Every rank builds the whole model, but only its stages train. The copies a rank kept of the other
ranks' stages went stale at the first step, and then did harm, silently (issue #30): a second
``fpd.pipeline`` broadcast rank 0's stale copies over the trained weights of every other rank;
``torch.save(model.state_dict())`` or the guide's ``dcp.save`` wrote 24 of 49 untrained tensors of
a tied GPT; and each copy cost a 7B model's memory on every rank. So:

* :func:`release_others`, at the end of the build: every tensor a stage of another rank uses and
  no stage of this rank uses moves to the meta device in place (``torch.utils.swap_tensors``: the
  same Python object, so the model, the stages and a tied weight's other names see it): no value
  left to save, broadcast or train by mistake. A tensor no stage uses (a pooler the forward never
  calls) keeps its value on every rank: it never trains, so it is the same everywhere.
* :func:`restore_released`, at the start of a build from such a model (a second pipeline, another
  schedule or stage count): every tensor on the meta device on some rank is sent from the lowest
  rank holding it (one all-reduce of who holds what, then a broadcast per tensor), so the build
  starts from the trained weights, as one process would; the new build then releases again.
* :func:`local_state_dict` / :func:`load_local_state_dict`: this rank's tensors under the model's
  own keys (a tied weight under each of its names), what ``torch.distributed.checkpoint`` saves
  and loads per rank, whatever the layout on either side.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdRef

from fxpipe.errors import DistributedError, MaterialiseError

from ._eager_guard import own_state_dict
from ._sharding import SHARDED_AWAY, placed_like

__all__ = ["release_others", "restore_released", "local_state_dict", "load_local_state_dict", "partly_released",
           "swap_in_place", "drop_weak_references"]


def _tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer once, by its first name, in the model's order (the same on
    every rank: the same model)."""
    seen: set[int] = set()
    found = []
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in seen:
            seen.add(id(t))
            found.append((name, t))
    return found


def partly_released(model: nn.Module) -> bool:
    """Some tensors on the meta device and others real: a model an earlier pipeline released."""
    kinds = {t.is_meta for _, t in _tensors(model)}
    return kinds == {True, False}


def _forget_conversions(t: torch.Tensor) -> None:
    """Drops ``t`` from torch's weak-id memos (``WeakIdKeyDictionary``: a fake mode's record of
    the real tensors it converted, kept as long as a captured graph's fake values are): entries
    of a conversion already made, whose weak references would stop ``swap_tensors``."""
    for ref in weakref.getweakrefs(t):
        if not isinstance(ref, WeakIdRef):
            continue
        for holder in gc.get_referrers(ref):
            if isinstance(holder, dict) and ref in holder:
                del holder[ref]


#: the attribute a released tensor carries: its name in the model (:func:`refuse_stale_optimizer`)
RELEASED = "_fxpipe_released"
#: the attribute a released tensor carries: a weak reference to its model
OWNER = "_fxpipe_owner"
#: the attribute a tensor carries once a pipeline placed it on this rank (a build kept it here)
WAS_HELD = "_fxpipe_was_held"
#: per model (by weak reference): the ids of the parameters this rank's latest pipeline of it
#: holds (not the tensors: torch cannot swap a tensor something holds a weak reference to)
_HELD: "weakref.WeakKeyDictionary[nn.Module, set[int]]" = weakref.WeakKeyDictionary()


def swap_in_place(t: torch.Tensor, new: torch.Tensor, name: str, todo: str = "") -> None:
    """``t`` holds ``new``'s storage and device from now on, as the same Python object with the
    same attributes (``torch.utils.swap_tensors``, as ``to_empty`` with swapped module
    parameters): the model, every stage and a tied weight's other names see it. A tensor moved
    to meta is marked released under ``name`` (:func:`refuse_stale_optimizer`). Raises
    :class:`MaterialiseError` naming ``name``, with ``todo``, where torch cannot swap it."""
    new = nn.Parameter(new, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else new
    _forget_conversions(t)
    try:
        new.__class__ = type(t)
        new.__dict__.update(t.__dict__)
        if new.is_meta:
            new.__dict__[RELEASED] = name
        else:
            new.__dict__.pop(RELEASED, None)
        torch.utils.swap_tensors(t, new)
    except (RuntimeError, TypeError) as e:
        raise MaterialiseError(f"{name!r} ({type(t).__name__}) cannot be moved {'to' if new.is_meta else 'off'} the meta "
                               f"device in place ({e}): a tensor subclass, or one something else holds a weak "
                               f"reference to.{todo}") from e


def drop_weak_references() -> None:
    """``swap_tensors`` refuses a tensor something holds a weak reference to: the fake modes of
    the build (cyclic garbage) and, under ``torch.autocast``, its cache of cast weights (and the
    live fake modes' memos: :func:`_forget_conversions`)."""
    gc.collect()
    torch.clear_autocast_cache()


def refuse_stale_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """A global optimizer step pre-hook (installed with the first pipeline): refuses the step of
    an optimizer that holds state for a parameter this rank released. It stepped that parameter
    under an earlier layout, and a pipeline built since moved its stage to another rank: kept
    across that rebuild, the optimizer would silently never update the parameters this rank holds
    now (they are in no optimizer) while its state for the released ones is useless. An optimizer
    made before the build holds released parameters too, but no state for them: it runs.

    Without state, such an optimizer made over the earlier pipeline's parameters
    (``AdamW(pipe.parameters())``, plain SGD, or AdamW before its first step) is refused too
    where it lacks a parameter this rank holds now (a trial: 0.56 off by the next step); one made
    over the whole model holds them all and runs.

    Under ``data_parallel='fsdp'`` the build replaces this rank's parameters by their shards
    (:data:`._sharding.SHARDED_AWAY`): an optimizer made before it holds the originals, which
    get no gradient, and would silently update nothing (measured: LayerNorm weights still 1.0
    after three steps). Refused at its first step, whatever its state."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            away = p.__dict__.get(SHARDED_AWAY)
            if away is not None:
                raise DistributedError(
                    f"this {type(optimizer).__name__} holds {away!r} as it was before a fxpipe.distributed pipeline "
                    "with data_parallel='fsdp' sharded it: the pipeline trains its shard, a new parameter, so this "
                    "optimizer would never update anything. Make the optimizer after the build, over the pipeline's "
                    "parameters: opt = AdamW(pipe.parameters())")
            name = p.__dict__.get(RELEASED)
            if name is not None and p in optimizer.state and optimizer.state[p]:
                raise DistributedError(
                    f"this {type(optimizer).__name__} has state for {name!r}, which this rank no longer holds: a "
                    "fxpipe.distributed pipeline built since placed its stage on another rank and released it here "
                    "(to meta). Kept across that rebuild, the optimizer would never update the parameters this rank "
                    "holds now. Make the optimizer over the new pipeline's parameters and load its state from a "
                    "checkpoint: opt = AdamW(pipe.parameters()); pipe.load_optimizer_state_dict(opt, state) with "
                    "the state saved by pipe.optimizer_state_dict (torch.distributed.checkpoint).")
    # released after an earlier pipeline held it here: the optimizer was made over that pipeline's
    # parameters (one made before the first build, over the model or a part of it, holds none such)
    released = [p for group in optimizer.param_groups for p in group["params"]
                if RELEASED in p.__dict__ and p.__dict__.get(WAS_HELD)]
    if released:  # one check per optimizer step: the first such parameter's model
        missing, name = _missing(optimizer, released[0]), released[0].__dict__[RELEASED]
        if missing:
            raise DistributedError(
                f"this {type(optimizer).__name__} holds {name!r}, which this rank no longer holds, and not "
                f"{', '.join(repr(m) for m in missing[:3])}{' ...' if len(missing) > 3 else ''}, which it holds now: "
                "it was made over an earlier fxpipe.distributed pipeline's parameters, and a pipeline built since "
                "placed the stages otherwise. Kept, it would never update the parameters this rank holds now. "
                "Make the optimizer over the new pipeline's parameters: opt = AdamW(pipe.parameters()) (its "
                "state from a checkpoint: pipe.load_optimizer_state_dict(opt, state), saved by "
                "pipe.optimizer_state_dict), or over the whole model, made before the build.")


def _missing(optimizer: torch.optim.Optimizer, released: torch.Tensor) -> list[str]:
    """The names of the trainable parameters this rank's latest pipeline of ``released``'s model
    holds that ``optimizer`` does not."""
    owner = released.__dict__.get(OWNER)
    model = owner() if owner is not None else None
    held = _HELD.get(model) if model is not None else None
    if not held:
        return []
    given = {id(q) for group in optimizer.param_groups for q in group["params"]}
    return [n for n, q in model.named_parameters() if id(q) in held and id(q) not in given and q.requires_grad]


_HOOKED: list = []


def watch_optimizers() -> None:
    """Installs :func:`refuse_stale_optimizer` for every optimizer of the process, once."""
    if not _HOOKED:
        _HOOKED.append(register_optimizer_step_pre_hook(refuse_stale_optimizer))


def release_others(model: nn.Module, stages: Sequence[torch.fx.GraphModule], local: Sequence[int],
                   also: Sequence[Sequence[torch.fx.GraphModule]] = ()) -> None:
    """Moves to the meta device every tensor a stage not in ``local`` uses and no stage in
    ``local`` uses (see the module docstring). ``also``: other stage sets of the same cut (the
    eval-mode capture, :mod:`._eval_mode`), whose local stages' tensors are kept too."""
    mine: set[int] = set()
    used: set[int] = set()
    for cut in (stages, *also):
        for k, stage in enumerate(cut):
            ids = {id(t) for t in (*stage.parameters(), *stage.buffers())}
            used |= ids
            if k in local:
                mine |= ids
    drop_weak_references()
    watch_optimizers()
    owner = weakref.ref(model)
    for name, t in _tensors(model):
        if id(t) in used and id(t) not in mine and not t.is_meta:
            swap_in_place(t, torch.empty_like(t, device="meta"), name)
            t.__dict__[OWNER] = owner
    _HELD[model] = {id(p) for p in model.parameters() if id(p) in mine}
    for p in model.parameters():
        if id(p) in mine:
            p.__dict__[WAS_HELD] = True


def restore_released(model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
    """Gives every tensor of ``model`` a value on every rank, sent from the lowest rank holding
    one (see the module docstring); collective. Raises :class:`MaterialiseError` on every rank
    naming a tensor no rank holds."""
    tensors = _tensors(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if world > 62:
        raise MaterialiseError("restoring a released model is limited to 62 ranks (one bit per rank)")
    held = torch.tensor([0 if t.is_meta else 1 << rank for _, t in tensors], dtype=torch.int64, device=device)
    dist.all_reduce(held, group=group)
    holders = held.tolist()
    lost = [name for (name, _), h in zip(tensors, holders) if h == 0]
    if lost:
        raise MaterialiseError(
            f"{len(lost)} tensor(s) of the model, e.g. {lost[0]!r}, are on the meta device on every rank: no rank "
            "holds a value to build from. A model an earlier fxpipe.distributed pipeline released keeps each tensor "
            "on the ranks whose stages use it; pass state_dict= (a checkpoint, e.g. what pipe.state_dict() saved) "
            "to build from it, or build the model anew.")
    everyone = (1 << world) - 1
    drop_weak_references()
    for (name, t), h in zip(tensors, holders):
        if h == everyone:
            continue
        src = (h & -h).bit_length() - 1  # the lowest rank holding it
        if t.is_meta:  # on the CPU, as a model is built; the build moves its stages' to the rank's device
            swap_in_place(t, torch.empty_like(t, device="cpu"), name)
        carrier = t.data if t.device == device else t.data.to(device)
        dist.broadcast(carrier, src=dist.get_global_rank(group, src), group=group)
        if carrier is not t.data:
            t.data.copy_(carrier)


def local_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict()`` less what this rank released: its stages' tensors (and
    those no stage uses), under every key the model gives them."""
    with own_state_dict():
        whole = model.state_dict()
    return {k: v for k, v in whole.items() if not (isinstance(v, torch.Tensor) and v.is_meta)}


def load_local_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True) -> list[str]:
    """Copies into this rank's tensors their values in ``state_dict`` (keys of the model; the
    other ranks' keys are ignored). ``strict``: a key this rank holds that ``state_dict`` lacks,
    or a key the model does not have, is an error naming it. Returns the keys loaded."""
    with own_state_dict():
        own = model.state_dict(keep_vars=True)
    unknown = [k for k in state_dict if k not in own]
    targets = {}
    for key, t in own.items():
        if isinstance(t, torch.Tensor) and not t.is_meta:
            targets.setdefault(id(t), (t, []))[1].append(key)
    missing = [keys[0] for t, keys in targets.values() if not any(k in state_dict for k in keys)]
    if strict and (unknown or missing):
        raise KeyError(f"load_state_dict: this rank's keys missing from the state_dict: {missing[:5]}; keys the model "
                       f"does not have: {unknown[:5]}")
    loaded = []
    with torch.no_grad():
        for t, keys in targets.values():
            present = [k for k in keys if k in state_dict]
            if not present:
                continue
            value = state_dict[present[-1]]  # as load_state_dict: the last name of a tied weight wins
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(f"load_state_dict: {present[-1]!r} is {tuple(value.shape)} in the state_dict, "
                                 f"{tuple(t.shape)} in the model")
            t.copy_(placed_like(value, t))
            loaded += present
    return loaded
