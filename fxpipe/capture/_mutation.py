"""In-place ops in a captured graph, found on the sample and made safe to cut.

An fx graph records ``g.add_(h)`` as a node whose *result* later code ignores: later uses
still name ``g``. The graph's edges therefore miss the fact that those uses must see the
mutated value, and any cut between the mutation and a use loses it (gradients through the
stage boundary or portal belong to the value before the mutation). Two kinds of mutation,
two treatments:

* **Values** (activations): rewritten out of place. The op runs on a copy
  (``g_copy = torch.clone(g); g_copy.add_(h)``) and every later use of ``g`` reads the
  op's result (or the copy, when the op returns something else: ``operator.setitem``, a
  leaf module that mutates its input), so the graph's edges carry the dependency and every
  cut is exact. The copy and the op are kept in one stage.
* **State** (buffers updated in forward: BatchNorm running statistics, a step counter, an
  exponential average): left in place, applied once per micro-batch. Every node that reads
  or writes such a buffer is kept in one stage, so micro-batches update it in order, and
  the recomputation of a checkpointed stage runs on a snapshot (see ``StageState``), so
  it neither sees later updates nor applies its own.

Which nodes mutate what is measured, not guessed: the graph runs once on the sample and
tensor version counters say which inputs each node changed -- including mutations inside
opaque leaf modules. Views share their base's counter and storage, so a mutation through a
view is attributed to everything it aliases. What cannot be made exact is refused with a
:class:`~fxpipe.errors.MutationError` naming the node, the tensor and the source line:
a mutation of a model input, or of a value another live view still reads.
"""

from __future__ import annotations

import operator

from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx, nn

from ..errors import MutationError
from ._node_kinds import COMPUTE_OPS
from ._other_mode import flipped_modes, opaque_with_buffers
from ._op_writes import writes_nothing
from ._user_code import source_location
from ..tree import flatten

__all__ = ["StateMutation", "Mutations", "find_and_fix_mutations", "KEEP_WITH", "KEEP_REASON"]

#: ``node.meta`` key: names of nodes this node must share a stage with.
KEEP_WITH = "fxpipe_keep_with"
#: ``node.meta`` key: why a node has ``KEEP_WITH`` partners, when not for a mutation (for errors).
KEEP_REASON = "fxpipe_keep_reason"
#: ``node.meta`` key on nodes that mutate model state: qualified buffer names.
MUTATES_STATE = "fxpipe_mutates_state"


@dataclass
class StateMutation:
    """A buffer the forward updates in place, and the nodes that touch it."""

    name: str                       # qualified buffer name, e.g. "encoder.bn.running_mean"
    writers: List[str]              # nodes that change it
    readers: List[str]              # every node that reads or writes it (one stage)
    where: str = ""                 # source line of the first writer


@dataclass
class Mutations:
    """What :func:`find_and_fix_mutations` found and did."""

    rewritten: List[str] = field(default_factory=list)   # nodes now running on a copy
    state: List[StateMutation] = field(default_factory=list)
    #: the graph's outputs on the sample, from the watching run: :func:`fxpipe.capture._prepare.prepare`
    #: reads the output structure from them instead of running the graph again, then drops them
    sample_outputs: Any = None

    def state_names(self) -> List[str]:
        return [s.name for s in self.state]


def _storage(t: torch.Tensor) -> Optional[int]:
    try:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return None
        # Meta storages all have address 0; their StorageImpl identifies them (views share it).
        return storage._cdata if t.is_meta else storage.data_ptr()
    except Exception:  # noqa: BLE001 - sparse, meta or other storage-less tensors
        return None


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if value is None or isinstance(value, (int, float, bool, str)):
        return []
    return [x for x in flatten(value)[0] if isinstance(x, torch.Tensor)]


def _arg_slots(node: fx.Node) -> Iterator[Tuple[Tuple[str, Any], fx.Node]]:
    """``(('args', i) | ('kwargs', k), node)`` for each direct Node argument."""
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            yield ("args", i), a
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            yield ("kwargs", k), a


def _where(node: fx.Node) -> str:
    return source_location(node) or f"node {node.name!r} ({node.op} {node.target})"


@dataclass
class _Found:
    # node, slot, whether it returns the mutated tensor, whether the target is a view of a base
    values: List[Tuple[fx.Node, Tuple[str, Any], bool, bool]] = field(default_factory=list)
    views: Dict[fx.Node, Tuple[str, Any]] = field(default_factory=dict)  # view node -> slot of its base
    state: Dict[str, List[str]] = field(default_factory=dict)   # buffer -> writer nodes
    touch: Dict[str, Set[str]] = field(default_factory=dict)    # buffer -> nodes touching it


class _Watcher(fx.Interpreter):
    """Runs the graph once, comparing version counters around every node. Memory stays near
    one forward's: values are freed after their last use (later readers are still live), and
    each node's parameters are copied just before it runs, kept (``originals``, put back
    afterwards) only if the node changed them."""

    def __init__(self, gm: fx.GraphModule, state: Dict[int, str], buffers: Set[Optional[int]]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.originals: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (state tensor, its value before)
        self.state_by_storage = state          # storage -> qualified buffer/parameter name
        self.buffers = buffers                 # storages of buffers (checked by value too)
        self.found = _Found()
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.last_use: Dict[fx.Node, int] = {}
        for n in gm.graph.nodes:
            for a in n.all_input_nodes:
                self.last_use[a] = max(self.last_use.get(a, -1), self.order[n])
        self.placeholders: Set[Optional[int]] = set()
        self.reassigned: List[Tuple[nn.Module, str, torch.Tensor]] = []  # buffers a module's forward replaced

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            out = super().run_node(n)
            if n.op == "placeholder":
                self.placeholders.update(_storage(t) for t in _tensors(out))
            return out
        watched: List[Tuple[Optional[Tuple[str, Any]], Optional[fx.Node], torch.Tensor]] = []
        for slot, a in _arg_slots(n):
            value = self.env.get(a)
            if isinstance(value, torch.Tensor):
                watched.append((slot, a, value))
            else:
                watched += [(None, a, t) for t in _tensors(value)]
        owned: List[Tuple[nn.Module, str, torch.Tensor]] = []
        if n.op == "call_module":
            module = self.module.get_submodule(n.target)
            watched += [(None, None, t) for t in (*module.parameters(), *module.buffers())]
            owned = [(m, k, b) for m in module.modules() for k, b in m._buffers.items() if b is not None]
        before = [t._version for _, _, t in watched]
        touched = {s for s in (_storage(t) for _, _, t in watched) if s in self.state_by_storage}
        for s in touched:
            self.found.touch.setdefault(self.state_by_storage[s], set()).add(n.name)
        # Kernels such as batch_norm update running statistics without bumping the version
        # counter: compare the values of the buffers a node can reach, too.
        # (A meta tensor has no values: version counters alone, see fxpipe.capture._meta.)
        values = [t.clone() if _storage(t) in self.buffers and not t.is_meta else None for _, _, t in watched]
        kept = [value if value is not None or t.is_meta or _storage(t) not in self.state_by_storage
                else t.detach().clone() for (_, _, t), value in zip(watched, values)]  # to put back
        out = super().run_node(n)
        changed = [(slot, a, t) for (slot, a, t), version, value in zip(watched, before, values)
                   if t._version != version or (value is not None and not torch.equal(value, t))]
        for (_, _, t), copy in zip(watched, kept):
            if copy is not None and id(t) not in self.originals and any(t is c for _, _, c in changed):
                self.originals[id(t)] = (t, copy)
        del values, kept
        for slot, a, t in _written(n, changed, out):
            self._mutated(n, slot, a, t, out)
        for m, key, b in owned:  # self.ema = 0.9 * self.ema + ...: a state write too (it drifted per replica)
            now = m._buffers.get(key)  # a cache made anew at another size (rotary tables) is not state
            if (now is not b and isinstance(now, torch.Tensor) and now.shape == b.shape and now.dtype == b.dtype
                    and _storage(b) in self.state_by_storage):
                self.reassigned.append((m, key, b))
                self._mutated(n, None, None, b, out)
        mutated = bool(changed)
        if not mutated and isinstance(out, torch.Tensor):
            storage = _storage(out)
            bases = [slot for slot, a, t in watched if slot is not None and storage is not None
                     and _storage(t) == storage]
            if len(bases) == 1:
                self.found.views[n] = bases[0]  # a view (slice, select, view, ...) of that argument
        return out

    def _mutated(self, n: fx.Node, slot: Optional[Tuple[str, Any]], a: Optional[fx.Node],
                 t: torch.Tensor, out: Any) -> None:
        storage = _storage(t)
        if storage in self.state_by_storage:
            name = self.state_by_storage[storage]
            writers = self.found.state.setdefault(name, [])
            if n.name not in writers:
                writers.append(n.name)
            return
        if storage is not None and storage in self.placeholders:
            raise MutationError(
                f"{_where(n)}: `{n.format_node()}` changes a model input in place. A pipeline splits "
                "its inputs into micro-batches, so the caller's tensor would not see the change. "
                "What to do: work on a copy (x = x.clone() before the in-place op), or use the "
                "out-of-place op.", node=n.name)
        if slot is None or a is None:
            raise MutationError(
                f"{_where(n)}: `{n.format_node()}` changes a tensor inside a container argument in "
                "place; fxpipe cannot follow that across stages. What to do: use the out-of-place "
                f"op, or keep the module opaque with leaf_modules=['{n.meta.get('fxpipe_module', '')}'].",
                node=n.name)
        here = self.order[n]
        base = _base_of(a, self.found.views)
        for other, value in self.env.items():
            if other is a or other is base or self.last_use.get(other, -1) <= here:
                continue
            if other.op == "output":
                continue
            if any(_storage(x) == storage for x in _tensors(value)):
                raise MutationError(
                    f"{_where(n)}: `{n.format_node()}` changes `{a.name}` in place while "
                    f"`{other.name}`, which shares its memory (a view), is read later. fxpipe cannot "
                    "make that exact across stages. What to do: use the out-of-place op, or keep the "
                    f"module opaque with leaf_modules=['{n.meta.get('fxpipe_module', '') or '<module>'}'].",
                    node=n.name)
        self.found.values.append((n, slot, out is t, base is not a))


def _written(n: fx.Node, changed: List[Tuple[Any, Any, torch.Tensor]], out: Any) -> List[Tuple[Any, Any, torch.Tensor]]:
    """The changed arguments node ``n`` wrote, given those whose version or value changed.

    Views share their base's version counter, so an op writing one argument bumps every
    other argument that aliases it. torch.export records ``h[:, 1:4] += y`` as
    ``s = slice(h); s.add_(y); copy_(slice(h), s)``: the ``copy_`` bumps ``s`` too, although
    it only reads it. Its source is then the very elements it writes (the same view), so
    the copy changes nothing there and reading ``s`` before it is the same: ``s`` does not
    count as changed by the ``copy_``. Every other aliasing change counts (an op may read an
    overlapping alias after writing, and the pipeline could not reproduce that order).
    """
    if n.target is torch.ops.aten.copy_.default:
        return [(slot, a, t) for slot, a, t in changed if t is out or not _same_view(t, out)]
    if n.target is operator.setitem and not _has_node(n.args[1]):
        # torch.fx's ``h[:, 1:4] += y``: getitem, the in-place op on that view, then
        # ``setitem(h, key, view)``, which writes the view back onto itself.
        base = next((t for _, a, t in changed if a is n.args[0]), None)
        if base is not None:
            dest = base[n.args[1]]
            return [(slot, a, t) for slot, a, t in changed if a is n.args[0] or not _same_view(t, dest)]
    return changed


def _has_node(value: Any) -> bool:
    return any(isinstance(x, fx.Node) for x in torch.utils._pytree.tree_leaves(value))


def _same_view(a: torch.Tensor, b: Any) -> bool:
    return (isinstance(b, torch.Tensor) and _storage(a) is not None and _storage(a) == _storage(b)
            and a.storage_offset() == b.storage_offset() and a.shape == b.shape and a.stride() == b.stride())


def _state_tensors(model: nn.Module) -> Dict[int, str]:
    named: Dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t is None:
            continue
        s = _storage(t)
        if s is not None:
            named.setdefault(s, name)
    return named


def _copy_slot(node: fx.Node, slot: Tuple[str, Any], new: fx.Node) -> None:
    kind, key = slot
    if kind == "args":
        args = list(node.args)
        args[key] = new
        node.args = tuple(args)
    else:
        node.kwargs = {**node.kwargs, key: new}


def _base_of(node: fx.Node, views: Dict[fx.Node, Tuple[str, Any]]) -> fx.Node:
    """The value ``node`` is a view of (following view ops up), or ``node`` itself."""
    while node in views:
        kind, key = views[node]
        parent = node.args[key] if kind == "args" else node.kwargs[key]
        assert isinstance(parent, fx.Node)
        node = parent
    return node


def _view_chain(node: fx.Node, views: Dict[fx.Node, Tuple[str, Any]]) -> List[fx.Node]:
    """The view nodes from ``node``'s base (exclusive) down to ``node`` (inclusive)."""
    chain = []
    while node in views:
        chain.append(node)
        kind, key = views[node]
        node = node.args[key] if kind == "args" else node.kwargs[key]  # type: ignore[assignment]
    return chain[::-1]


def updated(value: Any, *writers: Any) -> Any:
    """``value`` once the in-place ops passed as ``writers`` have written into it.

    An identity, emitted right after such an op when it does not return what it changed
    (``setitem``, ``copy_`` into a view): later uses read this node, so the graph's edges
    say they come after the write. Reading the copy itself would let a stage boundary or a
    portal take the value before the op, and its gradient would skip the op.
    """
    return value


def _rewrite(gm: fx.GraphModule, found: _Found) -> List[str]:
    """Runs each value-mutating op on a copy; later uses read the mutated copy.

    A mutation through a view (``z[:, :4] = y``, which export records as ``slice`` then
    ``copy_``) copies the view's base instead and replays the view ops on the copy, so the
    base's later uses read the updated copy.
    """
    rewritten: List[str] = []
    meta_keys = ("stack_trace", "fxpipe_module", "nn_module_stack")
    for n, slot, returns_it, through_view in found.values:
        kind, key = slot
        target = n.args[key] if kind == "args" else n.kwargs[key]
        assert isinstance(target, fx.Node)
        chain = _view_chain(target, found.views) if through_view else []
        base = _base_of(target, found.views) if through_view else target
        group: List[str] = []
        with gm.graph.inserting_before(n):
            copy = gm.graph.call_function(torch.clone, (base,))
            copy.name = gm.graph._graph_namespace.create_name(f"{base.name}_copy", None)
            copy.meta = {k: v for k, v in n.meta.items() if k in meta_keys}
            group.append(copy.name)
            replayed = {base: copy}
            for view in chain:  # the same view ops, on the copy
                new = gm.graph.node_copy(view, lambda x: replayed.get(x, x))
                new.meta = {k: v for k, v in n.meta.items() if k in meta_keys}
                replayed[view] = new
                group.append(new.name)
        _copy_slot(n, slot, replayed[target])
        redirects: Dict[fx.Node, fx.Node] = {}
        if through_view or not returns_it:
            with gm.graph.inserting_after(n):
                done = gm.graph.call_function(updated, (copy, n))
            done.name = gm.graph._graph_namespace.create_name(f"{base.name}_updated", None)
            done.meta = {k: v for k, v in n.meta.items() if k in meta_keys}
            group.append(done.name)
            redirects[base] = done
        if through_view:
            redirects[target] = n if returns_it else replayed[target]
        elif returns_it:
            redirects[target] = n
        made = set(replayed.values()) | {n, *(redirects.values())}
        for old, new in redirects.items():
            for user in list(old.users):
                if user in made or not user > n:  # only uses after the op (fx keeps node order)
                    continue
                user.replace_input_with(old, new)
        # The op must run where its copy is made: a stage input is a leaf in recomputation,
        # and an in-place op on it fails (or, without checkpointing, escapes autograd).
        n.meta.setdefault(KEEP_WITH, []).extend(group)
        rewritten.append(n.name)
    return rewritten


def _restore(originals: Dict[int, Tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for t, copy in originals.values():
            t.data.copy_(copy)  # values back, version counter left alone (see prepare.preserved)


def find_and_fix_mutations(model: nn.Module, gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> Mutations:
    """Runs ``gm`` once on the sample, rewrites value mutations out of place (in ``gm``), and
    returns the state mutations. The model's parameters, buffers and RNG are left as they were.
    A graph whose ops' schemas say they write nothing (:func:`writes_nothing`) is not run: it
    has no mutation to find (a forward of the model saved at every build of such a graph).

    Raises :class:`MutationError` for mutations that cannot be made exact.
    """
    if writes_nothing(gm):
        return Mutations()
    inputs = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat_inputs]
    found, outputs = _watch(model, gm, inputs)
    # a module of the user's kept opaque may write state in the other mode only (an average
    # updated under `if self.training:`, a pipeline built in eval then trained: its recomputation
    # applied the update again, a trial): searched in that mode too, for its state writes
    with flipped_modes(opaque_with_buffers(gm)) as flipped:
        try:
            other = _watch(model, gm, inputs)[0] if flipped else _Found()
        except Exception:  # noqa: BLE001 - a module that does not run in its other mode: searched as built
            other = _Found()
    for name, writers in other.state.items():
        found.state.setdefault(name, []).extend(w for w in writers if w not in found.state[name])
    for name, nodes in other.touch.items():
        found.touch.setdefault(name, set()).update(nodes)
    result = Mutations(sample_outputs=outputs)
    if found.values:
        result.rewritten = _rewrite(gm, found)
        gm.graph.lint()
        gm.recompile()
    by_name = {n.name: n for n in gm.graph.nodes}
    for name, writers in found.state.items():
        readers = sorted(found.touch.get(name, set()) | set(writers), key=list(by_name).index)
        for w in writers:
            by_name[w].meta.setdefault(MUTATES_STATE, []).append(name)
        first = by_name[readers[0]]
        for r in readers[1:]:
            by_name[r].meta.setdefault(KEEP_WITH, []).append(first.name)
        result.state.append(StateMutation(name, list(writers), readers, _where(by_name[writers[0]])))
    return result


def _watch(model: nn.Module, gm: fx.GraphModule, inputs: List[Any]) -> Tuple[_Found, Any]:
    """One run of ``gm`` watched for writes; the model's values, buffers and RNG put back."""
    rng = torch.get_rng_state()
    buffers = {_storage(b) for b in model.buffers() if b is not None} - {None}
    watcher = _Watcher(gm, _state_tensors(model), buffers)
    try:
        with torch.no_grad():
            outputs = watcher.run(*inputs)
    except MutationError as e:  # without the notes the fx interpreter appends
        raise MutationError(e.detail, node=e.node) from None
    finally:
        _restore(watcher.originals)
        for m, key, b in reversed(watcher.reassigned):
            m._buffers[key] = b
        torch.set_rng_state(rng)
    return watcher.found, outputs
