"""fxpipe's one RNG module: states for recomputation, which partitions need them, and
whether a run of the build drew random numbers (the last section).

A checkpointed partition runs twice: once in forward, once when its saved tensors are
needed in backward. A partition that draws random numbers (dropout) must draw the same ones
the second time, so the RNG states are saved before the first run and put back around the
recomputation -- two state copies per task (the CPU generator's state alone is 5 KB), which
a partition that draws nothing does not need.

:func:`may_draw_random` decides that once per partition, from what the partition is made
of, and errs on the side of saving: a ``GraphModule``'s graph names every operation it
runs (aten RNN kernels included: their dropout draws), so a graph without a random
operation draws nothing; torch's own layers are known one by one, and any torch layer with a
positive dropout probability (``nn.LSTM(dropout=0.5)``) may draw; anything else -- a module whose ``forward`` is user code the graph does not
show, a Python function called from the graph, a higher-order op -- may draw, and keeps its
RNG states. A wrong "no" would make dropout differ between forward and recomputation,
hence the conservative rule.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Dict, Generator, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

__all__ = ["RNGStates", "may_draw_random", "save_rng_states", "restored_rng_states", "stage_generators",
           "restored_generators", "generator_states", "set_generator_states", "drew_random"]

#: (CPU generator state, the device's CUDA generator state or None)
RNGStates = Tuple[torch.Tensor, Optional[torch.Tensor]]

# Operations that draw from a generator, by base name: torch functions, Tensor methods,
# torch.nn.functional, torch.nn.init and aten overloads all go by these names.
_RANDOM_OPS = frozenset("""
    dropout dropout_ dropout1d dropout2d dropout3d alpha_dropout alpha_dropout_ feature_dropout
    feature_dropout_ feature_alpha_dropout feature_alpha_dropout_ native_dropout fused_dropout
    rand rand_like randn randn_like randint randint_like randperm bernoulli bernoulli_
    multinomial normal normal_ poisson binomial uniform_ random_ exponential_ geometric_ cauchy_
    log_normal_ rrelu rrelu_ rrelu_with_noise rrelu_with_noise_ gumbel_softmax
    fractional_max_pool2d fractional_max_pool3d fractional_max_pool2d_with_indices
    fractional_max_pool3d_with_indices standard_gamma sample_dirichlet
    scaled_dot_product_attention multi_head_attention_forward
    trunc_normal_ kaiming_uniform_ kaiming_normal_ xavier_uniform_ xavier_normal_
    orthogonal_ sparse_
    lstm gru rnn_tanh rnn_relu cudnn_rnn miopen_rnn mkldnn_rnn mkldnn_rnn_layer
    scaled_dot_product_flash_attention scaled_dot_product_flash_attention_for_cpu
    scaled_dot_product_efficient_attention scaled_dot_product_cudnn_attention
    scaled_dot_product_attention_math scaled_dot_product_fused_attention_overrideable
    flash_attention_forward efficient_attention_forward native_multi_head_attention
    transformer_encoder_layer_fwd
""".split())

# torch.nn layers that draw whatever their settings (RReLU in training, FractionalMaxPool
# without fixed samples); any other torch.nn layer draws when it keeps a positive dropout
# probability (RNNBase, Transformer*Layer, ...): see _has_dropout.
_RANDOM_MODULES = (nn.modules.dropout._DropoutNd, nn.RReLU, nn.FractionalMaxPool2d, nn.FractionalMaxPool3d,
                   nn.MultiheadAttention)

# The attributes torch.nn layers keep a dropout probability in.
_DROPOUT_ATTRS = ("dropout", "p", "dropout_p", "dropout_prob")

# Modules whose class lives here run torch's own code; only these are known not to draw.
_TORCH_MODULES = ("torch.nn.modules.", "fxpipe.runtime._batchnorm", "fxpipe.batchnorm")

# Where a graph's Python-function targets are known ops (anything else is user code).
_KNOWN_FUNCTION_MODULES = ("torch", "_operator", "operator", "builtins", "math", "fxpipe")


def _base_name(target: Any) -> str:
    """``torch.ops.aten.native_dropout.default`` -> ``native_dropout``; ``torch.rand`` -> ``rand``."""
    name = target if isinstance(target, str) else getattr(target, "__name__", "") or str(target)
    return name.split(".")[0].lstrip("_")


def _module_may_draw(module: nn.Module) -> bool:
    for sub in module.modules():
        if isinstance(sub, fx.GraphModule):
            if sub is not module and _graph_may_draw(sub):
                return True
            continue
        cls = type(sub)
        if not cls.__module__.startswith(_TORCH_MODULES):
            return True  # user code in forward: it may draw
        if isinstance(sub, _RANDOM_MODULES) or _has_dropout(sub):
            return True
    return False


def _has_dropout(module: nn.Module) -> bool:
    """Whether a torch.nn layer keeps a positive number under a dropout-like name: its torch
    code may then draw (``nn.LSTM(num_layers=2, dropout=0.5)`` draws inside the RNN kernel,
    which no Dropout submodule shows). Errs on the side of "yes": ``nn.PairwiseDistance.p``
    is a norm, and its partition keeps RNG states it does not need (a copy, not a wrong
    result)."""
    attrs = module.__dict__
    for name in _DROPOUT_ATTRS:
        value = attrs.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False


def _function_may_draw(target: Any) -> bool:
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True  # runs subgraphs: not looked into
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return _base_name(target) in _RANDOM_OPS
    if _base_name(target) in _RANDOM_OPS:
        return True
    module = getattr(target, "__module__", None) or ""
    if module.startswith(_KNOWN_FUNCTION_MODULES):
        return False
    # Methods of builtin types (Tensor.add, tuple.__getitem__) have no __module__.
    return not (module == "" and hasattr(target, "__objclass__"))


def _graph_may_draw(gm: fx.GraphModule) -> bool:
    for node in gm.graph.nodes:
        if node.op == "call_function" and _function_may_draw(node.target):
            return True
        if node.op == "call_method" and _base_name(node.target) in _RANDOM_OPS:
            return True
        if node.op == "call_module" and _module_may_draw(gm.get_submodule(node.target)):
            return True
    return False


def may_draw_random(partition: Any) -> bool:
    """Whether running ``partition`` may draw random numbers (``True`` when unsure).

    A ``GraphModule`` is judged by its graph (its ``call_module`` targets by their classes,
    recursively), another ``nn.Module`` by the classes of all its modules, anything else
    (a plain callable) is assumed to draw.
    """
    if isinstance(partition, fx.GraphModule):
        return _graph_may_draw(partition)
    if isinstance(partition, nn.Module):
        return _module_may_draw(partition)
    return True


def save_rng_states(device: torch.device) -> RNGStates:
    """The RNG states a run on ``device`` draws from: the CPU's, and the device's own."""
    gpu_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), gpu_state


@contextmanager
def restored_rng_states(device: torch.device, states: RNGStates) -> Generator[None, None, None]:
    """Runs the block from ``states``, leaving the caller's RNG states as they were.

    ``states`` are read, not consumed: a second backward through the same graph
    (``retain_graph=True``) recomputes again and draws the same numbers again."""
    cpu_state, gpu_state = states
    if gpu_state is None:
        # CPU only: a plain save/set/restore (fork_rng's generality costs ~10 us a task).
        outer = torch.get_rng_state()
        torch.set_rng_state(cpu_state)
        try:
            yield
        finally:
            torch.set_rng_state(outer)
        return
    with torch.random.fork_rng([device]):
        torch.set_rng_state(cpu_state)
        torch.cuda.set_rng_state(gpu_state, device)
        yield


def stage_generators(partition: Any) -> Tuple[torch.Generator, ...]:
    """The ``torch.Generator`` objects ``partition`` draws from besides the default ones:
    constants in its graph's calls (``torch.rand(..., generator=self.g)`` traced by fx) and
    generators its modules keep as attributes (an opaque layer's own). A recomputation must
    draw from them as the first pass did, so their states are saved with the RNG states."""
    found: Dict[int, torch.Generator] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Generator):
            if value is not torch.default_generator:  # saved with the CPU RNG state already
                found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    if isinstance(partition, nn.Module):
        for module in partition.modules():
            for value in module.__dict__.values():
                if isinstance(value, torch.Generator):
                    visit(value)
            if isinstance(module, fx.GraphModule):
                for node in module.graph.nodes:
                    visit(node.args)
                    visit(node.kwargs)
    return tuple(found.values())


@contextmanager
def restored_generators(generators: Sequence[torch.Generator],
                        states: Sequence[torch.Tensor]) -> Generator[None, None, None]:
    """Runs the block with each generator at its saved state, then puts each back where it was
    (where the first pass, and later micro-batches, left it)."""
    outer = [g.get_state() for g in generators]
    for g, s in zip(generators, states):
        g.set_state(s)
    try:
        yield
    finally:
        for g, s in zip(generators, outer):
            g.set_state(s)


# -- the default generators' states: saved and put back, and whether a run drew -----------------
# The build's checks compare a graph's values only when it gives the same result on the
# sample twice; random ops the mode does not switch off (functional dropout, noise) make them
# compare structure only. Running the graph a second time with another seed to find out costs
# a forward per checked mode; a run that drew from torch's default generators has moved their
# state, so comparing the state after the seeded run with the state the seed gives says so at
# no cost (a dispatch mode watching for random ops would also see it, but breaks torch.cond
# inside opaque modules). Randomness from elsewhere (a torch.Generator of the model's own,
# Python's random) is not seen: the callers run the second run after all before refusing on a
# value difference, so a refusal never rests on this shortcut.

def generator_states() -> List[torch.Tensor]:
    """The states of torch's default generators: the CPU's and each initialised CUDA device's."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += torch.cuda.get_rng_state_all()
    return states


def set_generator_states(states: List[torch.Tensor]) -> None:
    """Puts back states taken by :func:`generator_states`."""
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state_all(states[1:])


def drew_random(seed: int) -> bool:
    """Whether anything drew from the default generators since ``torch.manual_seed(seed)``.
    Reseeds them with ``seed``: call it where the RNG is put back afterwards
    (:func:`fxpipe.capture._prepare.preserved`)."""
    after = generator_states()
    torch.manual_seed(seed)
    seeded = generator_states()
    return len(after) != len(seeded) or any(not torch.equal(a, b) for a, b in zip(after, seeded))
