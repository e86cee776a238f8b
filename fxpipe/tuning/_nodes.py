"""One recorded forward of the captured graph: per node, which storages it makes, reads and
saves for backward, and its forward FLOPs.

Why storages and not tensors: memory is storages. A view (``x[:, :4]``, ``transpose``) costs
nothing; two nodes saving the same tensor hold it once; a node's output saved by its
consumer is the same bytes as that output. Identity is the storage object (``_cdata``),
which also works on the meta device, so a model with no weights (``hf:llama`` on meta) is
recorded exactly as a real one: the bytes are the shapes' bytes.

What is recorded, per compute node, in graph order (:class:`NodeRecord`):

* ``makes``: storages first seen as this node's output (new memory the node returns);
* ``reads``: storages of its tensor inputs (to know when a value's last use is);
* ``saves``: storages autograd packed while it ran (``saved_tensors_hooks``): inputs, its
  output, or *internal* storages made inside an opaque module and kept for backward only;
* ``grad_in``: bytes of inputs that require grad (the gradients its backward makes);
* ``grad_params``: bytes of the parameters it uses that require grad;
* ``flops``: forward FLOPs (``torch.utils.flop_counter``), for the roofline;
* ``scratch_forward`` / ``scratch_backward``: what the node's forward / its backward allocates
  and frees inside itself (:mod:`fxpipe.tuning._scratch`), measured on CPU and CUDA in one
  backward of the recorded graph (gradients of ones; nothing is written to any ``.grad``);
  0 on meta;
* ``grad_storage``: from the same backward, the storage each input gradient keeps alive
  where it is larger than the input (a slice of a concatenation's gradient keeps all of it
  while it waits for the stage that sent the input); none on meta;
* ``grad_shared``: from the same backward, the inputs whose gradients are one storage (the
  slices of a concatenation's gradient, the one gradient an addition hands both inputs),
  each mapped to the first of them: they wait for the stages that sent them as one.

Storages that exist before the step (parameters, buffers, the sample) are ``external``:
they are not activation memory. Every output is kept alive during the run, so no storage is
freed and reused under another node's name.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Set

import torch
from torch import fx
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from ..capture._node_kinds import COMPUTE_OPS
from ._scratch import ScratchMeter, available

__all__ = ["NodeRecord", "Recording", "record_nodes"]


@dataclass
class NodeRecord:
    """What one compute node makes, reads and saves (storage key -> bytes)."""

    name: str
    makes: Dict[int, int] = field(default_factory=dict)
    reads: Dict[int, int] = field(default_factory=dict)
    saves: Dict[int, int] = field(default_factory=dict)
    #: storages (of ``reads``) that require grad: their gradients come out of this node's backward
    grad_in: Dict[int, int] = field(default_factory=dict)
    #: storages of ``makes`` that require grad (a gradient arrives for them)
    grad_out: Dict[int, int] = field(default_factory=dict)
    grad_params: int = 0
    param_bytes: int = 0
    flops: float = 0.0
    #: bytes read and written by the forward (inputs, outputs, parameters): the roofline's memory side
    moved: int = 0
    #: most bytes allocated and freed inside the node's forward / inside one of its autograd functions
    scratch_forward: int = 0
    scratch_backward: int = 0
    #: storages of ``grad_in`` whose gradient, as this node's backward makes it, keeps a larger
    #: storage alive (a view: a concatenation's input gradient is a slice of its output's)
    grad_storage: Dict[int, int] = field(default_factory=dict)
    #: storages of ``grad_in`` whose gradients share one storage, each -> the first of them
    grad_shared: Dict[int, int] = field(default_factory=dict)


@dataclass
class Recording:
    """All compute nodes' records in graph order, the graph outputs' storages and the
    storages that existed before the step."""

    nodes: List[NodeRecord]
    outputs: Dict[int, int]
    external: Set[int]

    def index(self) -> Dict[str, int]:
        return {r.name: i for i, r in enumerate(self.nodes)}


def _storages(value: Any) -> Dict[int, tuple[int, bool]]:
    """storage key -> (bytes, requires grad) of every tensor in ``value``."""
    found: Dict[int, tuple[int, bool]] = {}
    for t in pytree.tree_leaves(value):
        if isinstance(t, torch.Tensor):
            key, nbytes = _key(t)
            grad = t.requires_grad and (t.is_floating_point() or t.is_complex())
            old = found.get(key)
            found[key] = (max(nbytes, old[0] if old else 0), grad or bool(old and old[1]))
    return found


def _key(t: torch.Tensor) -> tuple[int, int]:
    try:
        storage = t.untyped_storage()
        return int(storage._cdata), int(storage.nbytes())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested): by identity
        return id(t), int(t.numel()) * t.element_size()


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, external: Set[int], backward: bool = False,
                 meter: ScratchMeter | None = None) -> None:
        super().__init__(gm)
        self.backward = backward
        self.meter = meter
        #: (autograd function, output number) of each recorded value -> its storage key
        self.values: Dict[tuple[int, int], int] = {}
        #: per recorded node, the autograd functions its forward created (for its backward windows)
        self.functions: List[List[Any]] = []
        self._owned: Set[int] = set()
        self.leaves: List[torch.Tensor] = []  # the inputs (gradients to them, if they require grad)
        self.external = external
        self.seen: Set[int] = set(external)
        self.records: List[NodeRecord] = []
        self.current: NodeRecord | None = None
        self.keep: List[Any] = []  # every value alive to the end: storage keys stay unique

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.current is not None:
            key, nbytes = _key(t)
            if key not in self.external:
                self.current.saves[key] = max(nbytes, self.current.saves.get(key, 0))
        return t

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in COMPUTE_OPS:
            out = super().run_node(n)
            self.keep.append(out)
            return out
        rec = NodeRecord(n.name)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        for key, (nbytes, grad) in _storages((args, kwargs)).items():
            rec.moved += nbytes
            if key not in self.external:
                rec.reads[key] = nbytes
                if grad:
                    rec.grad_in[key] = nbytes
        params: Sequence[torch.Tensor] = ()
        if n.op == "call_module":
            module = self.module.get_submodule(str(n.target))
            params = [*module.parameters(), *module.buffers()]
        else:  # a functional weight read through get_attr: an external input that requires grad
            params = [t for t in pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and _key(t)[0] in self.external]
        rec.param_bytes = sum(int(p.numel()) * p.element_size() for p in params)
        rec.grad_params = sum(int(p.numel()) * p.element_size() for p in params if p.requires_grad)
        if n.op == "call_module":
            rec.moved += rec.param_bytes
        self.current = rec
        counter = FlopCounterMode(display=False)
        index = len(self.records)
        try:
            with counter:
                if self.meter is not None:
                    self.meter.begin(("forward", index))
                out = super().run_node(n)
                if self.meter is not None:
                    self.meter.end()
        finally:
            self.current = None
        if self.backward:
            self.functions.append(self._new_functions(out))
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    self.values.setdefault((id(t.grad_fn), t.output_nr), _key(t)[0])
        rec.flops = float(counter.get_total_flops())
        for key, (nbytes, grad) in _storages(out).items():
            rec.moved += nbytes
            if key in self.seen:
                continue
            self.seen.add(key)
            rec.makes[key] = nbytes
            if grad:
                rec.grad_out[key] = nbytes
        for key in rec.saves:  # internal storages (made and saved inside the node): its own
            self.seen.add(key)
        self.keep.append(out)
        self.records.append(rec)
        return out

    def _new_functions(self, out: Any) -> List[Any]:
        """The autograd functions reachable from ``out`` that no earlier node created."""
        found: List[Any] = []
        stack = [t.grad_fn for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in self._owned or type(fn).__name__ == "AccumulateGrad":
                continue
            self._owned.add(id(fn))
            found.append(fn)
            stack.extend(f for f, _ in fn.next_functions)
        return found

    def _grads_made(self, index: int, fn: Any, grads: Sequence[Any]) -> None:
        """``fn`` (of node ``index``) made ``grads`` for its inputs: note those that keep a
        storage larger than the input they are for, and those that share one storage."""
        rec = self.records[index]
        by_storage: Dict[int, List[int]] = {}
        for (nf, nr), g in zip(fn.next_functions, grads):
            key = self.values.get((id(nf), nr)) if nf is not None else None
            if key is None or key not in rec.grad_in or not isinstance(g, torch.Tensor):
                continue
            storage, nbytes = _key(g)
            if nbytes > rec.grad_in[key]:
                rec.grad_storage[key] = max(nbytes, rec.grad_storage.get(key, 0))
            by_storage.setdefault(storage, []).append(key)
        for keys in by_storage.values():
            if len(set(keys)) > 1:
                for key in keys:
                    rec.grad_shared.setdefault(key, keys[0])

    def run_backward(self, out: Any) -> None:
        """One backward of the recorded graph from gradients of ones, each autograd function
        in a scratch window of the node that created it (with a meter), the gradients it makes
        noted (:meth:`_grads_made`). ``torch.autograd.grad`` to the parameters and inputs: no
        ``.grad`` is written."""
        meter = self.meter
        roots = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        leaves = [t for t in (*self.module.parameters(), *self.leaves) if t.requires_grad]
        if not roots or not leaves:
            return
        handles = []
        for index, functions in enumerate(self.functions):
            for fn in functions:
                def post(grads_in: Any, grads_out: Any, i: int = index, fn: Any = fn) -> None:
                    if meter is not None:
                        meter.end()
                    self._grads_made(i, fn, grads_in)

                if meter is not None:
                    handles.append(fn.register_prehook(lambda grads, i=index: meter.begin(("backward", i))))
                handles.append(fn.register_hook(post))
        try:
            grads = torch.autograd.grad(roots, leaves, [torch.ones_like(t) for t in roots], allow_unused=True)
            del grads
        finally:
            for h in handles:
                h.remove()


def record_nodes(gm: fx.GraphModule, flat_inputs: Sequence[Any]) -> Recording:
    """Runs ``gm`` forward once, with grad, on ``flat_inputs`` (one micro-batch: real or
    meta tensors) and records every compute node (:class:`NodeRecord`). Nothing runs
    backward; the caller restores buffers and RNG state (``preserved(model)``)."""
    external: Set[int] = set()
    for t in (*gm.parameters(), *gm.buffers(), *pytree.tree_leaves(list(flat_inputs))):
        if isinstance(t, torch.Tensor):
            external.add(_key(t)[0])
    tensors = [t for t in (*gm.parameters(), *pytree.tree_leaves(list(flat_inputs))) if isinstance(t, torch.Tensor)]
    kinds = {t.device.type for t in tensors}
    real = bool(kinds) and kinds <= {"cpu", "cuda"}
    meter = ScratchMeter() if real and available(kinds) else None
    rec = _Recorder(gm, external, real, meter)
    rec.leaves = [t for t in pytree.tree_leaves(list(flat_inputs)) if isinstance(t, torch.Tensor)]
    with contextlib.ExitStack() as stack:
        if meter is not None:
            stack.enter_context(meter.recording())
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            out = rec.run(*flat_inputs)
        if real:
            with torch.enable_grad():
                rec.run_backward(out)
    if meter is not None:
        for (phase, index), nbytes in meter.result.items():
            setattr(rec.records[index], f"scratch_{phase}", int(nbytes))
    outputs = {k: b for k, (b, _) in _storages(out).items() if k not in external}
    rec.keep.clear()
    rec.functions.clear()
    return Recording(rec.records, outputs, external)
