"""What mixes the samples in backward only: the build's checks compare forward values (and a
merged loss's gradient), so an op whose *gradient* depends on the whole batch passes them.

``nn.Embedding(scale_grad_by_freq=True)`` (``F.embedding(..., scale_grad_by_freq=True)``,
``aten.embedding`` under torch.export) divides each token's gradient by how often the token
occurs in the mini-batch. A pipeline's backward runs per micro-batch, so each micro-batch
divides by its own counts: the embedding's gradient was off by more than its own size (a
trial: 0.037 against an eager largest of 0.033), in ``pipe(x)`` and in ``pipe.step``. Refused
at the build with more than one micro-batch, naming the module.

Backward code of the model's own cannot be read at all: a custom ``autograd.Function``
(``g / g.norm()`` in its backward) or a module kept opaque that registers a tensor hook or
applies such a Function. Where a graph holds either (:func:`unseen_backward`), the build's
micro-batch check (:func:`fxpipe.checks._micro_batches.check_split`) compares the gradients
of each per-sample output too, whole batch against merged micro-batches, through a fixed
random weighing of its elements: a trial's batch-normalised gradient (0.686 off, against an
eager largest of 0.533) is refused, naming the Function or module.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..capture._custom_functions import function_of
from ..capture._hooks import holds_live_hook
from ..errors import MicroBatchError
from ._loss_values import raw_name, recorded_line

__all__ = ["refuse_backward_mixing", "unseen_backward"]


def refuse_backward_mixing(gm: fx.GraphModule, chunks: int) -> None:
    """Raises :class:`MicroBatchError` for an embedding that scales its gradient by the batch's
    token frequencies, where ``chunks`` micro-batches would each use their own."""
    if chunks < 2:
        return
    for node in gm.graph.nodes:
        where = _scaled_embedding(gm, node)
        if where is not None:
            raise MicroBatchError(
                f"{where} scales its gradient by each token's frequency in the batch (scale_grad_by_freq=True): "
                f"a pipeline runs the backward per micro-batch, so each of the {chunks} micro-batches would divide by "
                "its own counts and the gradient would silently differ from the model's. What to do: "
                "scale_grad_by_freq=False, or chunks=1.")


def _scaled_embedding(gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
            return f"embedding '{node.target}'"
        return None
    if node.op != "call_function":
        return None
    if node.target is F.embedding:
        scaled = node.kwargs.get("scale_grad_by_freq", node.args[5] if len(node.args) > 5 else False)
    elif node.target is torch.ops.aten.embedding.default:
        scaled = node.kwargs.get("scale_grad_by_freq", node.args[3] if len(node.args) > 3 else False)
    else:
        return None
    return f"the embedding call {node.name}{recorded_line(node)}" if scaled is True else None


def unseen_backward(gm: fx.GraphModule) -> List[str]:
    """Where ``gm`` runs backward code fxpipe cannot read, said: custom autograd Functions
    (``GradNorm.apply at model.py:12``), modules kept opaque that are not torch's or fxpipe's
    (their forward may register tensor hooks or apply Functions), and a value taken beside its
    own detached copy (its gradient flows where its value does not)."""
    found: List[str] = []
    for node in gm.graph.nodes:
        if _beside_its_detached_self(node):
            found.append(f"a value beside its own detached copy (m - m.detach(): its gradient without its value)"
                         f"{recorded_line(node)}")
            continue
        fn = function_of(node.target) if node.op == "call_function" else None
        if fn is not None:
            found.append(f"the custom autograd.Function {fn.__qualname__}{recorded_line(node)}")
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            owner = type(module).__module__.partition(".")[0]
            if owner not in ("torch", "fxpipe"):
                found.append(f"module '{node.target}' kept opaque")
            elif _backward_hooked(module):  # a torch.nn layer's backward hook: code of the user's too
                found.append(f"module '{node.target}' ({type(module).__name__}) with a backward hook")
    return found


def _detached_of(node: fx.Node) -> Optional[fx.Node]:
    """The node ``node`` detaches (``x.detach()``, ``torch.detach(x)``, aten's), or None."""
    if node.op in ("call_method", "call_function") and raw_name(node) == "detach":
        source = node.args[0] if node.args else None
        return source if isinstance(source, fx.Node) else None
    return None


def _beside_its_detached_self(node: fx.Node) -> bool:
    """Whether ``node`` takes a value and that value detached (``m - m.detach()``): the value
    cancels and the gradient does not, so a mixing there is in the backward only (a trial:
    ``h + (m - m.detach())`` with ``m = h.mean(0)``, outputs exact and gradients 40% off)."""
    inputs = set(node.all_input_nodes)
    return any(_detached_of(x) in inputs for x in inputs)


def _backward_hooked(module: nn.Module) -> bool:
    """Whether ``module`` or a submodule has a backward or backward pre-hook (``register_full_backward_hook``,
    ``register_backward_hook``, ``register_full_backward_pre_hook``): a batch-normalising one
    (``g / g.norm()``) on an ``nn.Linear`` built and trained 0.51 off (a trial)."""
    return any(holds_live_hook(m._backward_hooks) or holds_live_hook(m._backward_pre_hooks) for m in module.modules())
