"""Planning a model built on the meta device: every size from shapes, no weight allocated.

A user wants to see how a 7B model splits before renting the GPUs. Built under
``with torch.device('meta')``, the model's parameters have shapes and dtypes but no
storage, so capture, the untimed sizing run (``balance_by='params'`` / ``'memory'``),
partitioning and emission all work by meta propagation, at the cost of the shapes alone.
What needs values cannot: timing nodes, and running the pipeline. Both are refused here with
a :class:`~fxpipe.errors.MetaDeviceError` that says what to do, rather than failing deep in
torch ("Cannot copy out of meta tensor", "Tensor on device meta is not on the expected
device cpu").

The sample is moved to the meta device too: a meta weight and a CPU input cannot meet in
one op. Checks that compare values (split-and-merge, capture against eager) then compare
structure, shapes and dtypes only; the real build, from the saved plan once the weights are
loaded, runs them in full.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, List, Sequence, Tuple

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import MetaDeviceError

__all__ = ["is_meta_model", "has_meta_tensors", "to_meta", "exported_as_cpu", "refuse_timing", "refuse_running"]


def is_meta_model(model: nn.Module) -> bool:
    """Whether ``model``'s parameters and buffers are on the meta device.

    A model with some tensors on the meta device and others on a real one can neither run
    (ops refuse to mix them) nor be sized consistently: refused, naming one of each.
    """
    meta = real = None
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t.is_meta:
            meta = meta or name
        else:
            real = real or (name, t.device)
    if meta is None:
        return False
    if real is not None:
        raise MetaDeviceError(
            f"the model is partly on the meta device ('{meta}') and partly on {real[1]} ('{real[0]}'): "
            "fxpipe plans a model that is wholly on the meta device (shapes only) or wholly on real devices. "
            "Build it all under `with torch.device('meta'):`, or materialise every tensor "
            "(model.to_empty(device=...) then load_state_dict).")
    return True


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (no refusal)."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


@contextmanager
def exported_as_cpu(model: nn.Module, flat: Sequence[Any]) -> Iterator[List[Any]]:
    """While torch.export traces, a meta ``model`` looks like the same model on the CPU.

    Why: export traces with fake tensors, which take their shapes from meta kernels but
    dispatch by their (fake) device. Given meta weights, export dispatches as for the meta
    device, and some ops then record another graph than on the CPU: meta SDPA returns
    another memory layout, so export adds ``contiguous`` nodes the CPU graph lacks. A plan
    made from that graph would not fit the real model's (``plan=`` is checked node by node).
    So, for the export only, each meta parameter and buffer is replaced by a fake tensor
    whose device is the CPU (in one fake mode, which export adopts from the tracing
    context), and meta inputs by zero CPU tensors of their shapes (the sample only, never a
    weight): the graph is then the one a CPU build records. Afterwards the model holds its
    own meta tensors again; the caller retargets the graph's device constants to meta.
    Yields the inputs to export with (``flat`` itself for a model not on the meta device).
    """
    if not has_meta_tensors(model):
        yield list(flat)
        return
    # torch internals, all used by torch.export itself; kept to this one function.
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.nn.utils.stateless import _reparametrize_module

    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True)
    cpu = torch.device("cpu")
    made: dict = {}  # id(tensor) -> its fake: a tied weight stays one tensor
    fakes: dict = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if id(t) not in made:
            fake = FakeTensor(mode, t.detach(), cpu) if t.is_meta else t
            if isinstance(t, nn.Parameter) and t.is_meta:
                fake = nn.Parameter(fake, requires_grad=t.requires_grad)
            made[id(t)] = fake
        fakes[name] = made[id(t)]
    inputs = [torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, torch.Tensor) and x.is_meta else x for x in flat]
    with tracing(TracingContext(mode)), _reparametrize_module(model, fakes):
        yield inputs


def to_meta(args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The sample with every tensor on the meta device (same shapes and dtypes)."""
    def move(x: Any) -> Any:
        return x.to("meta") if isinstance(x, torch.Tensor) else x

    a, k = pytree.tree_map(move, (tuple(args), dict(kwargs)))
    return tuple(a), dict(k)


def refuse_timing() -> None:
    """``balance_by='time'`` on a meta model: there is nothing to time."""
    raise MetaDeviceError(
        "balance_by='time' times every node on real data, and a model on the meta device has no data "
        "(its parameters are shapes only). Balance by sizes, which come from the shapes: "
        "balance_by='params' or balance_by='memory' (on the command line, --balance-by params or memory); "
        "or load the weights first to balance by time.")


def refuse_running(n_stages: int) -> MetaDeviceError:
    """The error a pipeline planned from a meta model raises when called."""
    return MetaDeviceError(
        "this pipeline was built from a model on the meta device: its plan (pipe.plan) and stage code "
        "(pipe.stage_code(k)) are real, but its parameters have no values, so it cannot run. To run it: "
        "save the plan (pipe.plan.save('plan.json')); give the model weights, e.g. "
        "model.to_empty(device='cpu') then model.load_state_dict(state_dict) (buffers outside the "
        "state_dict, such as a rotary embedding's inv_freq, must be recomputed; with transformers, "
        "from_pretrained does both); then build it again with "
        f"fxpipe.pipeline(model, sample, {n_stages}, plan='plan.json') -- no profiling, the same stages.")
