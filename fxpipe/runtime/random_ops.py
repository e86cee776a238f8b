"""Whether a run drew random numbers from torch: the build's checks skip a second run without.

The micro-batch check (:meth:`fxpipe.checks.batching.Batching.check`) compares values only for a
graph that gives the same result on the sample twice; random ops the mode does not switch
off (functional dropout, noise) make it compare structure only. Finding that out by running
the whole graph a second time, with another seed, costs a forward per checked mode. A run
that drew random numbers from torch's default generators has moved their state: comparing
the state after the seeded run with the state the seed gives says so at no cost (a dispatch
mode watching for random ops would also see it, but breaks ``torch.cond`` inside opaque
modules). Randomness from elsewhere (a ``torch.Generator`` of the model's own, Python's
``random``) is not seen here: the callers run the second run after all before refusing on a
value difference, so a refusal never rests on this shortcut.
"""

from __future__ import annotations

from typing import List

import torch

__all__ = ["generator_states", "set_generator_states", "drew_random"]


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
    (:func:`fxpipe.capture.prepare.preserved`)."""
    after = generator_states()
    torch.manual_seed(seed)
    seeded = generator_states()
    return len(after) != len(seeded) or any(not torch.equal(a, b) for a, b in zip(after, seeded))
