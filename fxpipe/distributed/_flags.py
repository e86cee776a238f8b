"""What every rank's model must agree on besides the batch: its modes and its frozen weights.

Each rank holds the whole module tree (other ranks' stages released to meta), and the user's
loop runs on every rank. A flag switched on some ranks only was silently followed there:
``model.eval()`` on one rank, ``dropout.eval()`` on one rank (its stages computed another
mode), a weight frozen on one data-parallel replica (its copy still took the other replica's
gradient share and moved: parameters 0.19 off eager after 3 steps; frozen before the build on
one replica, gloo aborted the process on mismatched sizes), a tied weight frozen on one rank.
Each step's agreement (:meth:`fxpipe.distributed._failures.Failures.agreed`) carries two
numbers per rank, the modes' and the ``requires_grad`` flags' fingerprints over the whole
model; ranks that differ are refused on every rank before anything is sent.

A ``model.load_state_dict(checkpoint)`` on some ranks only (rank 0 loading for everyone, as
one process would) loads that rank's own stages and copies nothing into the weights it released
to meta (torch warns, once, "a no-op"): the other ranks kept their weights and the step silently
ran a mix of the two. Each rank counts the loads into its released weights (their version
counters: a copy into a meta tensor still counts one), and the counts must be equal on every
rank; a load on every rank alike (each taking its own stages) is followed, as is
``pipe.load_state_dict`` (this rank's keys only).

A weight frozen at the build and trained later is refused too, on every rank alike: the
stages' metadata (which boundary values carry a gradient) and the replicas' gradient
synchronisation were made without it (a stage frozen whole then unfrozen failed inside
torch's stage backward; under ``'ddp'`` the first step's gradients were 1.05x off). Freezing
after the build is followed exactly.
"""

from __future__ import annotations

from typing import Tuple

from torch import nn

from fxpipe.errors import DistributedError

__all__ = ["ModelFlags", "refuse_different_flags", "FLAG_COUNT"]

#: numbers per rank in each step's agreement: :meth:`ModelFlags.fingerprints`
FLAG_COUNT = 3


class ModelFlags:
    """The flags of ``model`` a step depends on, read on each call."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        # the weights this rank released to meta, with their version counters now
        self.released = [(t, t._version) for t in (*model.parameters(), *model.buffers()) if t.is_meta]

    def fingerprints(self) -> Tuple[int, int, int]:
        """(modes, requires_grad, loads): Python's hash of the flags in the model's order (a
        tuple of bools hashes alike in every process, whatever PYTHONHASHSEED), and how many
        times something was copied into the weights this rank released since the build."""
        modes = hash(tuple(m.training for m in self.model.modules()))
        grads = hash(tuple(p.requires_grad for p in self.model.parameters()))
        # -1: this rank released nothing (it holds every weight), so no load can miss on it
        loads = max((t._version - version for t, version in self.released), default=-1)
        return modes, grads, loads

    def refuse_unfrozen(self) -> None:
        if not self.frozen:
            return
        params = dict(self.model.named_parameters())
        trained = [n for n in self.frozen if n in params and params[n].requires_grad]
        if trained:
            more = f" and {len(trained) - 1} more" if len(trained) > 1 else ""
            raise DistributedError(
                f"parameter {trained[0]!r}{more} did not require grad when this pipeline was built and does now: "
                "the stages' metadata (which values crossing ranks carry a gradient) and the replicas' gradient "
                "synchronisation were made without it. Nothing was sent. What to do: build the pipeline again "
                "after unfreezing (fxpipe.distributed.pipeline(model, ...): it shares the trained weights), or "
                "build it with every weight you will train unfrozen and freeze after the build, which is followed.")


def refuse_different_flags(flags: list[Tuple[int, ...]]) -> None:
    """Every rank's :meth:`ModelFlags.fingerprints` must be the same (see the module)."""
    for k, what, todo in ((0, "training modes (model.train()/.eval(), or a submodule's)",
                           "switch modes on every rank alike"),
                          (1, "requires_grad flags (a weight frozen or unfrozen)", "freeze weights on every rank alike"),
                          (2, "loads of a state dict (model.load_state_dict on some ranks only: each rank's model holds "
                              "its own stages' weights, and a load copies nothing into the others', released to meta)",
                           "load on every rank (model.load_state_dict(sd) or pipe.load_state_dict(sd): each rank takes "
                           "its own stages' weights)")):
        values = [f[k] for f in flags]
        if len({v for v in values if k != 2 or v >= 0}) > 1:
            groups: dict = {}
            for rank, v in enumerate(values):
                if k != 2 or v >= 0:
                    groups.setdefault(v, []).append(rank)
            said = " against ".join(f"ranks {ranks}" for ranks in groups.values())
            raise DistributedError(
                f"the ranks' models differ in their {what}: {said}. Each rank would "
                f"run its stages as its own model says, and the step would silently mix them. Nothing was sent. "
                f"What to do: {todo} (the training loop runs on every rank).")
