"""Each rank materialises only its own stages: a model too big for one host, built on meta.

Every rank builds the model under ``with torch.device('meta'):`` (shapes, no storage) and
calls :func:`fxpipe.distributed.pipeline` with ``state_dict=``. Capture, rank 0's planning
(``balance_by='params'`` or ``'memory'``, from shapes: :mod:`fxpipe.capture._meta`) and emission run
on meta. Then each rank gives real values to exactly the tensors its own stages use
(:func:`local_weights`), and nothing else:

1. **Which tensors.** Those the rank's stage GraphModules hold (emission copies into a stage
   only the submodules and attributes its code reads, the model's own objects). A weight tied
   across ranks (embedding and LM head) is local to both ranks, and both load it.
2. **Materialised in place.** Each is swapped for an uninitialised tensor on the rank's
   device (a GPU, or the CPU) with
   ``torch.utils.swap_tensors``, the mechanism of ``to_empty`` under
   ``torch.__future__.set_swap_module_params_on_conversion(True)``: the Python object stays
   the same, so the model, every stage and a tied weight's other names see the new storage
   (plain ``to_empty`` makes new Parameters, which broke ties, issue 11). Its attributes
   (``__dict__``) are kept (:func:`._weights.swap_in_place`, which also releases the other
   ranks' tensors after a build).
3. **Non-persistent buffers** (a rotary embedding's ``inv_freq``, position ids) are in no
   checkpoint, and ``load_state_dict`` never reads them. They are recomputed by the model's own
   code: ``init_buffers(name, module)`` when given, else, for a transformers model, the
   ``_init_weights(module)`` of the nearest ``PreTrainedModel`` holding the module -- what
   ``from_pretrained`` itself runs to restore them after loading on meta; it recomputes
   rotary ``inv_freq`` with the very function ``__init__`` used, so it is bit-exact (checked
   for every family of tests/hf_families.py). Each such buffer must have been written (its
   version counter moves) or replaced by a tensor of its shape; one that was not is refused
   with :class:`~fxpipe.errors.MaterialiseError` naming it, never left uninitialised.
   Both run under ``torch.no_grad()`` and a forked RNG: the caller's RNG state is unchanged.
4. **Loaded.** Only the local persistent keys are read (:mod:`._sources`), after the buffers
   (an initialiser that also touches parameters cannot overwrite loaded values). As in
   ``load_state_dict``, values are copied in (dtypes cast) and, when several names of one
   tied tensor are present, the last in ``state_dict()`` order wins.

Under ``data_parallel='fsdp'`` the parameters FSDP will shard skip steps 2 and 4 and stay on
meta through the build's fake runs (which need only shapes); after ``fully_shard`` made them
DTensors whose shards are on meta, :meth:`Later.load` gives each shard storage in place and
reads its slice, so a rank never holds its stages' parameters whole (a checkpoint directory
reads only the slice's bytes; an in-memory state dict is cut).

Every rank checks its keys, materialises and loads the in-memory forms before any rank goes
on (:func:`~fxpipe.distributed._agree.on_every_rank`): one rank's missing key is an error on
every rank, not a wait. Tensors no local stage uses stay on meta, so ``pipe.parameters()`` and
the memory are this rank's alone.

A model not on the meta device keeps the earlier behaviour -- rank 0's parameters and
buffers broadcast to every rank, as DDP does -- unless ``state_dict=`` is given, which then
loads the local keys instead (every rank's own initialisation of the rest is never used).
Either way, the tensors of this rank's stages then move to the rank's device in place
(:func:`fxpipe.emit._placement.move_in_place`: the same objects, so the model, the stages and
the optimizer share them); the others stay where they were. Over NCCL the broadcast goes
through a GPU copy of each tensor that stays on the CPU.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Optional, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.emit._placement import move_in_place
from fxpipe.errors import MaterialiseError, MetaDeviceError
from fxpipe.capture._meta import is_meta_model

from ._agree import on_every_rank
from ._sources import StateDictSource, missing_message, open_source
from ._weights import drop_weak_references, swap_in_place

__all__ = ["InitBuffers", "Later", "check_sample", "local_weights", "LocalTensors", "local_tensors"]

#: ``init_buffers(name, module)``: writes the non-persistent buffers of ``module`` (its
#: qualified name in the model), already on the rank's device and uninitialised, in place or by assignment
InitBuffers = Callable[[str, nn.Module], None]


def check_sample(model: nn.Module, args: tuple, kwargs: dict, *, state_dict: Optional[StateDictSource]) -> None:
    """What the distributed build needs beyond fxpipe.build's checks, said on every rank alike
    before any collective: the sample itself must be real (its tensors give the shapes the
    ranks exchange and the first stage's constants), and a model on the meta device needs
    ``state_dict=`` to run. (The build itself captures and plans a meta model on a meta copy
    of the sample and refuses to time it: :func:`fxpipe.build.capture_and_check`.)
    """
    for i, x in enumerate(pytree.tree_leaves((args, kwargs))):
        if isinstance(x, torch.Tensor) and x.is_meta:
            raise MetaDeviceError(
                f"sample tensor {i} (shape {tuple(x.shape)}) is on the meta device: the sample of "
                "fxpipe.distributed.pipeline must be a real batch shaped like the ones step() gets "
                "(a model on meta is captured with a meta copy of it). Make it with torch.zeros(...) or a real batch.")
    if is_meta_model(model) and state_dict is None:  # also refuses a model partly on meta
        raise MetaDeviceError(
            "the model is on the meta device (shapes, no values) and no state_dict= was given, so this rank's "
            "stages would have no weights. Pass state_dict= (a mapping, the path of a torch.save file, the path "
            "of a torch.distributed.checkpoint directory, or a callable keys -> tensors): each rank then "
            "materialises and loads only its own stages' tensors.")


@dataclass
class LocalTensors:
    """The tensors this rank's stages use, and how each gets its value."""

    #: id -> tensor, each once, in the order the stages first use them
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    #: id -> where a stage uses it (``"stage 2: head.weight"``), for messages
    where: dict[int, str] = field(default_factory=dict)
    #: id -> its ``state_dict()`` keys, in that order (several for a tied tensor)
    keys: dict[int, list[str]] = field(default_factory=dict)
    #: id -> the (module name, module, attribute) holding it as a non-persistent buffer
    buffers: dict[int, list[tuple[str, nn.Module, str]]] = field(default_factory=dict)

    def wanted(self) -> list[str]:
        """Every key of every local persistent tensor (what a ``state_dict`` callable is asked for)."""
        return [k for i in self.tensors if i in self.keys for k in self.keys[i]]


def local_tensors(model: nn.Module, stages: Sequence[torch.fx.GraphModule], local: Sequence[int]) -> LocalTensors:
    """What stages ``local`` (indices into ``stages``) use, with their keys in ``model``."""
    found = LocalTensors()
    for k in local:
        st = stages[k]
        for name, t in [*st.named_parameters(remove_duplicate=False), *st.named_buffers(remove_duplicate=False)]:
            if id(t) not in found.tensors:
                found.tensors[id(t)], found.where[id(t)] = t, f"stage {k}: {name}"
    for key, t in model.state_dict(keep_vars=True).items():  # persistent, in load_state_dict's order
        if isinstance(t, torch.Tensor) and id(t) in found.tensors:
            found.keys.setdefault(id(t), []).append(key)
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr in sorted(module._non_persistent_buffers_set):
            b = module._buffers.get(attr)
            if b is not None and id(b) in found.tensors and id(b) not in found.keys:
                found.buffers.setdefault(id(b), []).append((mname, module, attr))
    return found


@dataclass
class Later:
    """The parameters :func:`local_weights` left on meta for FSDP to shard first
    (``data_parallel='fsdp'``): their keys, and the source their values come from."""

    source: Any = None
    keys: list[str] = field(default_factory=list)

    def load(self, model: nn.Module, group: dist.ProcessGroup, device: torch.device) -> None:
        """Each key's parameter (now a DTensor whose shard is on meta) given an uninitialised
        shard on ``device`` in place, then its slice of the source's value: a rank holds and
        reads ``1/dp`` of them, never the whole (a checkpoint directory reads only the slice)."""
        if not self.keys:
            return
        from torch.distributed.tensor import DTensor

        own = model.state_dict(keep_vars=True)
        targets = {key: own[key] for key in self.keys}

        def prepare() -> None:
            drop_weak_references()
            for key, t in targets.items():
                if isinstance(t, DTensor) and t.to_local().is_meta:
                    local = torch.empty_like(t.to_local(), device=device)
                    swap_in_place(t, DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape,
                                                        stride=t.stride(), run_check=False), key)
            if not self.source.collective:
                self.source.read(targets, group)

        on_every_rank(prepare, group, "load the shards of its stages' parameters",
                      "every rank must pass the same state_dict=")
        if self.source.collective:
            self.source.read(targets, group)


def local_weights(model: nn.Module, stages: Sequence[torch.fx.GraphModule], local: Sequence[int],
                  group: dist.ProcessGroup, *, state_dict: Optional[StateDictSource],
                  init_buffers: Optional[InitBuffers], device: torch.device, later: Collection[int] = ()) -> Later:
    """Gives this rank's stages (``local``) their values on ``device``: loaded from
    ``state_dict`` (the steps of the module docstring), or, without it, rank 0's broadcast to
    every rank. ``later``: ids of meta parameters to leave on meta for FSDP to shard first; the
    returned :class:`Later` loads them once sharded."""
    if state_dict is None:
        for t in local_tensors(model, stages, local).tensors.values():
            move_in_place(t, device)
        for t in [*model.parameters(), *model.buffers()]:  # as DDP: rank 0's values everywhere
            _broadcast(t, dist.get_global_rank(group, 0), group, device)
        return Later()
    meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    pending: list[Any] = []

    def prepare() -> None:
        found = local_tensors(model, stages, local)
        _refuse_unrestorable(model, found)
        source = open_source(state_dict, found.wanted())
        chosen = _choose_keys(found, source)
        deferred = [k for k, t in chosen.items() if id(t) in later and t.is_meta]
        targets = {k: t for k, t in chosen.items() if k not in deferred}
        now = {i: t for i, t in found.tensors.items() if not (i in later and t.is_meta)}
        if meta:
            # The fake runs (capture, stage metadata) left weak references to the meta tensors;
            # swap_tensors refuses a weakly-referenced tensor, so they go first.
            drop_weak_references()
            for i, t in now.items():
                if t.is_meta:
                    swap_in_place(t, torch.empty_like(t, device=device), found.where[i],
                                  " Build the pipeline from a model with real weights instead.")
            _init_buffers(model, found, init_buffers, device)
        for t in now.values():
            move_in_place(t, device)
        if not source.collective:
            source.read(targets, group)
        pending.append((source, targets, deferred))

    on_every_rank(prepare, group, "load the weights of its stages",
                  "every rank must pass the same state_dict= (with every key of the model) and init_buffers=")
    source, targets, deferred = pending[0]
    if source.collective:  # torch.distributed.checkpoint: every rank asks for its own keys together
        source.read(targets, group)
    return Later(source, deferred)


def _broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup, device: torch.device) -> None:
    """``t``'s value from rank ``src``, sent from ``device`` (NCCL sends only GPU tensors: a
    tensor elsewhere travels through a copy there)."""
    if t.device == device:
        dist.broadcast(t.data, src=src, group=group)
        return
    carrier = t.data.to(device)
    dist.broadcast(carrier, src=src, group=group)
    t.data.copy_(carrier)


def _refuse_unrestorable(model: nn.Module, found: LocalTensors) -> None:
    """Refuses, before anything changes, what loading cannot give a value."""
    extra = [n for n, m in model.named_modules() if type(m).get_extra_state is not nn.Module.get_extra_state]
    if extra:
        raise MaterialiseError(
            f"module {extra[0]!r} ({type(model.get_submodule(extra[0])).__name__}) keeps extra state "
            "(get_extra_state), which fxpipe.distributed does not load from state_dict=. Build the pipeline "
            "from a model with real weights instead (model.load_state_dict(...) on every rank, no state_dict=).")
    orphans = [found.where[i] for i, t in found.tensors.items()
               if t.is_meta and i not in found.keys and i not in found.buffers]
    if orphans:
        raise MaterialiseError(
            f"{orphans[0]} is on the meta device and is neither a parameter nor a buffer of the model: a constant "
            "the capture computed once from the model's tensors (torch.fx runs code that reads only buffers, "
            "e.g. torch.cat([self.inv_freq, self.inv_freq]), at trace time and keeps the result), so on meta it "
            "has no value and no checkpoint holds it. Keep the module computing it opaque "
            "(leaf_modules=['<module>']: it then runs at every step), or build from a model with real weights.")


def _choose_keys(found: LocalTensors, source: Any) -> dict[str, torch.Tensor]:
    """key -> the local tensor it is loaded into: per tensor, the last of its keys the source
    has (``load_state_dict`` copies every name of a tied weight in turn). Refuses missing keys
    and other shapes, naming them."""
    have = source.keys()
    targets: dict[str, torch.Tensor] = {}
    missing: list[str] = []
    wrong: list[str] = []
    for i, t in found.tensors.items():
        if i not in found.keys:
            continue
        present = [k for k in found.keys[i] if k in have]
        if not present:
            missing.append(" or ".join(map(repr, found.keys[i])) if len(found.keys[i]) > 1 else found.keys[i][0])
            continue
        key = present[-1]
        if tuple(source.shape(key)) != tuple(t.shape):
            wrong.append(f"{key!r} is {tuple(source.shape(key))} there, {tuple(t.shape)} in the model")
        targets[key] = t
    if missing:
        raise MaterialiseError(missing_message(source, missing, have) + ".")
    if wrong:
        raise MaterialiseError(f"{source.where} has other shapes than the model: {'; '.join(wrong[:5])}. "
                               "Build the model with the configuration the checkpoint was saved from.")
    return targets


def _init_buffers(model: nn.Module, found: LocalTensors, init_buffers: Optional[InitBuffers],
                  device: torch.device) -> None:
    """Recomputes the local non-persistent buffers (step 3 of the module docstring)."""
    owners: dict[int, tuple[str, nn.Module, list[str]]] = {}
    for i, holders in found.buffers.items():
        mname, module, attr = holders[0]
        owners.setdefault(id(module), (mname, module, []))[2].append(attr)
    if not owners:
        return
    init = init_buffers if init_buffers is not None else _hf_init(model, owners)
    versions = {i: t._version for i, t in found.tensors.items() if i in found.buffers}
    how = "init_buffers" if init_buffers is not None else "the model's own _init_weights"
    replaced: set[int] = set()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for mname, module, attrs in owners.values():
            kept = {a: module._buffers[a] for a in attrs}
            init(mname, module)
            for a, b in kept.items():
                now = module._buffers.get(a)
                if now is not b:  # assigned anew: its value into the object every stage holds
                    if not isinstance(now, torch.Tensor) or now.shape != b.shape or now.is_meta:
                        got = "None" if now is None else f"{type(now).__name__} {tuple(getattr(now, 'shape', ()))}"
                        raise MaterialiseError(
                            f"{how} replaced buffer '{_qual(mname, a)}' ({tuple(b.shape)}) with {got}: "
                            "give it a real tensor of the same shape, or write it in place (copy_)")
                    b.copy_(now)
                    module._buffers[a] = b
                    replaced.add(id(b))
    stale = [_qual(found.buffers[i][0][0], found.buffers[i][0][2]) for i, v in versions.items()
             if i not in replaced and found.tensors[i]._version == v]
    if stale:
        raise MaterialiseError(
            f"non-persistent buffer(s) {', '.join(map(repr, stale))} of this rank's stages are in no checkpoint and "
            f"{how} did not write them, so they would hold uninitialised memory. Pass "
            "init_buffers=fn, fn(name, module) writing module's non-persistent buffers (e.g. "
            "module.inv_freq.copy_(...)) as its __init__ computes them.")


def _qual(module_name: str, attr: str) -> str:
    return f"{module_name}.{attr}" if module_name else attr


def _hf_init(model: nn.Module, owners: dict[int, tuple[str, nn.Module, list[str]]]) -> InitBuffers:
    """The default initialiser: for each owner module, ``_init_weights`` of the nearest
    transformers ``PreTrainedModel`` holding it; refuses owners outside any."""
    transformers = sys.modules.get("transformers")  # a model of that library has imported it
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    inits: dict[str, Callable[[nn.Module], None]] = {}
    lost: list[str] = []
    for mname, _, attrs in owners.values():
        parts = mname.split(".") if mname else []
        holder = next((h for h in (model.get_submodule(".".join(parts[:n])) for n in range(len(parts), -1, -1))
                       if base is not None and isinstance(h, base)), None)
        if holder is None:
            lost += [_qual(mname, a) for a in attrs]
        else:
            inits[mname] = holder._init_weights
    if lost:
        raise MaterialiseError(
            f"non-persistent buffer(s) {', '.join(map(repr, lost))} of this rank's stages are in no checkpoint, and "
            "a model on the meta device has no values for them. Pass init_buffers=fn: fn(name, module) is called "
            "for each module holding such buffers (on the rank's device, uninitialised) and writes them as its "
            "__init__ computes them, e.g. module.inv_freq.copy_(1.0 / base ** (torch.arange(0, dim, 2) / dim)). "
            "(transformers models need none: their own _init_weights recomputes them.)")
    return lambda name, module: inits[name](module)
