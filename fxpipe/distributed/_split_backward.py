"""The zero-bubble backward split, made exact for every parameter.

torch's zero-bubble schedules (``ScheduleZBVZeroBubble``, ``ScheduleInterleavedZeroBubble``)
split a stage's backward in two. The input-gradient pass (B) runs autograd from the stage's
outputs to its inputs and records the gradient at each node where a parameter's path meets
the inputs' path; the weight-gradient pass (W), run later to fill the bubble, goes from those
nodes to the parameters. A parameter with a path to the outputs that meets no input needing
grad gets nothing from W along that path: every parameter of a stage whose inputs need no
grad, or a value made from parameters alone and sent on (``tanh(self.w)`` carried to a later
stage). Measured on torch 2.13: no error, the gradient silently missing or partial.

:func:`input_pass` finds such parameters on the stage's autograd graph before torch's B pass
runs; when there is one, it computes all of that stage's weight gradients right after B (one
more backward over the retained graph), leaving W nothing to do for this micro-batch. Stages
without one keep torch's split unchanged. The first stage is not concerned: torch runs its
whole backward in W.

The same completion serves a parameter the stage uses more than once (ALBERT's one layer
applied at every depth, a LayerNorm shared between blocks). torch's W runs one
``autograd.grad`` per parameter group without retaining the graph; the group of a weight used
twice reaches its first use through the nodes between, other groups' nodes among them, and
frees their saved tensors on the way: the next group fails with "Trying to backward through
the graph a second time" (torch 2.13, a Linear and a LayerNorm each applied twice). Measured:
``fxpipe.distributed`` under ``zbv`` stopped at its first step.

:func:`backward_pass` runs every backward pass of a stage (full, input, weight) and makes the
input gradients it returns contiguous: torch sends them as they come, and the input-gradient
pass returns ``autograd.grad``'s raw results -- the gradient of an input read by ``torch.cat``
is a strided slice of the ``cat`` gradient, which gloo refuses ("input tensor has to be
contiguous"; the U-Net with multi-sample micro-batches under ``zbv``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.autograd.graph import Node, get_gradient_edge
from torch.distributed.pipelining._backward import (_get_grad_fn_or_grad_acc, construct_reverse_graph,
                                                    reverse_closure)

__all__ = ["backward_pass", "input_pass", "incomplete_parameters"]


def incomplete_parameters(outputs: Sequence[torch.Tensor], inputs: Sequence[Any],
                          params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters needing grad whose gradient torch's weight pass would not complete: one
    with a path to ``outputs`` that avoids every node depending on an input needing grad (the
    weight pass would miss part of it), or one that more than one node of the graph reads (the
    weight pass would run into nodes another group frees: module docstring). One reverse
    graph serves both questions: this runs on every micro-batch's input pass."""
    out_nodes: list[Node] = [n for n in map(_get_grad_fn_or_grad_acc, outputs) if n is not None]
    reverse = construct_reverse_graph(out_nodes)  # node -> the nodes whose next_functions hold it
    in_nodes = [_get_grad_fn_or_grad_acc(x) for x in inputs if isinstance(x, torch.Tensor)]
    from_inputs, _ = reverse_closure([n for n in in_nodes if n is not None], set(), reverse)
    ends = set(out_nodes)
    found = []
    for p in params:
        if not p.requires_grad:
            continue
        node = _get_grad_fn_or_grad_acc(p)
        if len(set(reverse.get(node, ()))) > 1:  # reused
            found.append(p)
            continue
        reached, _ = reverse_closure([node], from_inputs, reverse)
        if reached & ends:  # missed
            found.append(p)
    return found


def input_pass(bwd_kwargs: dict, params: Sequence[nn.Parameter],
               run: Callable[[], tuple[tuple[Optional[torch.Tensor], ...], Any]]) -> tuple[Any, Any]:
    """torch's input-gradient pass ``run()`` (returning input grads and parameter groups),
    followed, when :func:`incomplete_parameters` finds any, by the stage's whole weight
    gradient; the parameter groups returned are then empty, so the weight pass adds nothing
    twice.

    ``bwd_kwargs``: torch's ``stage_output`` (outputs, or the loss on the last stage),
    ``output_grads`` (``None`` on the last stage: ones) and ``input_values``."""
    stage_output = bwd_kwargs["stage_output"]
    given = bwd_kwargs["output_grads"]
    outputs, grads = [], []
    for i, t in enumerate(stage_output):  # as torch's stage_backward_input chooses them
        if isinstance(t, torch.Tensor) and (t.requires_grad or t.grad_fn is not None):
            g = torch.ones_like(t) if given is None else given[i]
            if g is not None:  # no gradient came back for it: it adds nothing
                outputs.append(t)
                grads.append(g)
    missed = incomplete_parameters(outputs, bwd_kwargs["input_values"], params) if outputs else []
    edges = [get_gradient_edge(t) for t in outputs]  # kept: the B pass detach_()es the outputs
    grads_input, groups = run()
    if not missed:
        return grads_input, groups
    wanted = [p for p in params if p.requires_grad]
    for p, g in zip(wanted, torch.autograd.grad(edges, wanted, grads, allow_unused=True)):
        if g is None:
            continue
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g
    return grads_input, []


def backward_pass(backward_type: str, bwd_kwargs: dict, params: Sequence[nn.Parameter],
                  run: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
    """torch's backward pass ``run()`` of type ``backward_type`` ('full', 'input' or 'weight'),
    the input pass made exact (:func:`input_pass`), and the input gradients of 'full' and
    'input' (those sent to the previous stage) contiguous."""
    if backward_type == "weight":
        return run()
    grads, groups = input_pass(bwd_kwargs, params, run) if backward_type == "input" else run()
    return tuple(g.contiguous() if isinstance(g, torch.Tensor) else g for g in grads), groups
