"""The count a ``'mean'`` loss divides by, as a program of its own, run on each micro-batch.

A loss read as a ratio (:mod:`fxpipe.checks._loss_form`) merges by ``sum_i D_i L_i / sum_i D_i``,
``D_i`` its count on micro-batch ``i``: a mask's sum, a cross entropy's total weight. That count
is copied out of the loss's graph (:func:`den_program`) and run on each micro-batch's inputs. A
cross entropy's total weight is computed from its target and class weights alone
(:func:`nll_total_weight`), never through the logits: the micro-batches' outputs are not needed.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor, fx

from ._loss_values import NLL, VIEWS, Den, ancestors, in_place, op_name

__all__ = ["den_program", "nll_total_weight"]


def nll_total_weight(target: Tensor, weight: Optional[Tensor], ignore_index: int) -> Tensor:
    """What a cross entropy / nll_loss with ``reduction='mean'`` divides by: the class weights
    of the targets that are not ``ignore_index`` (their count without weights). A cross
    entropy with class probabilities as targets (a floating target shaped as the logits, class
    dim 1) divides by its rows whatever the class weights: ``numel / classes``."""
    if target.is_floating_point():
        rows = target.numel() // target.shape[1] if target.dim() > 1 else 1
        return torch.tensor(float(rows), dtype=torch.float64, device=target.device)
    counted = target != ignore_index
    if weight is None:
        return counted.sum().to(torch.float64)
    safe = torch.where(counted, target, torch.zeros_like(target))
    outside = counted & ((safe < 0) | (safe >= weight.numel()))
    if bool(outside.any()):  # torch's own error for it, not an IndexError from this count (a trial)
        raise IndexError(f"Target {int(target[outside][0])} is out of bounds.")
    return (weight.to(torch.float64)[safe] * counted).sum()


def _with_writes(gm: fx.GraphModule, root: fx.Node, needed: Set[fx.Node],
                 inputs_of: Callable[[fx.Node], List[fx.Node]]) -> Set[fx.Node]:
    """``needed`` and the in-place writes before ``root`` into any of them, through views too,
    with what those are computed from: ``y = y.clone(); y[:, :2] = -100`` (a prompt masked)
    writes into a slice of the clone the count reads, and a count replayed without the write
    counted the masked labels (a review: 0.033 off, silently, in both schedules)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    grown = True
    while grown:
        grown = False
        for n in gm.graph.nodes:
            if order[n] >= order[root] or n in needed or not in_place(n) or not n.args:
                continue
            target = n.args[0]
            while isinstance(target, fx.Node) and target not in needed and target.op == "call_function" \
                    and op_name(target) in VIEWS and target.args:
                target = target.args[0]
            if isinstance(target, fx.Node) and target in needed:
                needed |= ancestors(n, inputs_of)
                grown = True
    return needed


def den_program(gm: fx.GraphModule, den: Den) -> Tuple[Callable[..., Tensor], List[int]]:
    """The graph's code for ``den`` (a ``'data'`` den) as a function of its own, and the
    placeholder indices it takes; a cross entropy's total weight is computed from its target
    and class weights only (:func:`nll_total_weight`), never from the logits."""
    assert den.kind == "data" and den.node is not None
    root = den.node
    nll = lambda n: isinstance(n, fx.Node) and n.op == "call_function" and op_name(n) in NLL  # noqa: E731

    def inputs_of(n: fx.Node) -> List[fx.Node]:
        if nll(n):
            return [a for a in n.args[1:3] if isinstance(a, fx.Node)]
        if n.target is operator.getitem and nll(n.args[0]) and n.args[1] == 1:
            return [n.args[0]]
        return list(n.all_input_nodes)

    needed = _with_writes(gm, root, ancestors(root, inputs_of), inputs_of)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    used: List[int] = []
    for n in gm.graph.nodes:
        if n not in needed:
            continue
        if nll(n):
            args = n.args
            weight = env[args[2]] if len(args) > 2 and isinstance(args[2], fx.Node) else None
            ignore = args[4] if len(args) > 4 else -100
            env[n] = graph.call_function(nll_total_weight, (env[args[1]], weight, ignore))
        elif n.target is operator.getitem and nll(n.args[0]) and n.args[1] == 1:
            env[n] = env[n.args[0]]
        else:
            env[n] = graph.node_copy(n, lambda a: env[a])
            if n.op == "placeholder":
                used.append(placeholders.index(n))
    graph.output(env[root])
    module = fx.GraphModule(gm, graph)
    # its inputs as the fakes it was traced on, contiguous (the next-token target y[:, 1:] failed a
    # replayed view with torch's bare error), and copies where it replays a write into one (the
    # loss's own call then writes the caller's tensor, once)
    writes = any(n.op == "call_function" and in_place(n) for n in needed)

    def run(*inputs: Any) -> Tensor:
        return module(*[(x.clone() if writes else x.contiguous()) if isinstance(x, Tensor) else x for x in inputs])

    return run, used
