"""What ``fxpipe.tune`` returns: every configuration it considered, ranked, and how to build
the first.

A :class:`Choice` is one configuration with its prediction: step time, bubble, peak memory
per device (and what it is made of), whether it fits and, if not, why. :class:`Tuning`
holds them ranked -- fitting ones first, fastest first -- prints as a table, and builds the
best with the front door its schedule runs on: ``fxpipe.pipeline`` for ``'gpipe'`` (one
process, the runtime's clock cycles), ``fxpipe.distributed.pipeline`` for torch's schedules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ..plan._value import Plan
from ._units import format_bytes

__all__ = ["Choice", "Tuning"]


@dataclass
class Choice:
    """One configuration and its prediction."""

    schedule: str
    n_stages: int
    chunks: int
    checkpoint: str
    #: predicted seconds of one training step, and the idle share of the devices' time
    step_s: float = 0.0
    bubble: float = 0.0
    #: per device: predicted peak bytes (static + activations), and the two parts
    peak_bytes: Dict[str, float] = field(default_factory=dict)
    static_bytes: Dict[str, float] = field(default_factory=dict)
    activation_bytes: Dict[str, float] = field(default_factory=dict)
    fits: bool = True
    #: why it does not fit or cannot run ('' when it fits)
    why: str = ""
    #: the arguments of the front door that builds it
    kwargs: Dict[str, Any] = field(default_factory=dict)
    plan: Optional[Plan] = None
    #: run by fxpipe.pipeline in one process ('gpipe', and '1f1b' through Pipeline.step)
    one_process: bool = False
    #: data-parallel replicas of the pipeline (fxpipe.distributed on a ('dp', 'pp') mesh,
    #: ``kwargs['data_parallel']`` 'ddp' or 'fsdp'), and the seconds their collectives add to
    #: each step: the gradients' all-reduce, or FSDP's all-gather and reduce-scatter
    #: (tuning/_data_parallel.py)
    replicas: int = 1
    allreduce_s: float = 0.0
    _tuning: Any = field(default=None, repr=False)

    @property
    def distributed(self) -> bool:
        """Runs on fxpipe.distributed (one process per rank), not fxpipe.pipeline."""
        return not self.one_process

    @property
    def label(self) -> str:
        """The schedule as the table shows it: ``1f1b`` on ranks, ``1f1b (1 process)`` in one."""
        return f"{self.schedule} (1 process)" if self.one_process and self.schedule != "gpipe" else self.schedule

    @property
    def replica_label(self) -> str:
        """The replicas as the table shows them: ``2 ddp``, ``2 fsdp``; ``1`` without."""
        mode = self.kwargs.get("data_parallel")
        return f"{self.replicas} {mode}" if self.replicas > 1 and mode else str(self.replicas)

    @property
    def peak(self) -> float:
        """The largest predicted peak over the devices."""
        return max(self.peak_bytes.values(), default=0.0)

    def pipeline(self, **more: Any) -> Any:
        """Builds this configuration: ``fxpipe.pipeline(model, sample, **kwargs)``, or for a
        torch schedule ``fxpipe.distributed.pipeline(model, sample, **kwargs, **more)`` (which
        needs ``loss_fn=`` and an initialised process group, on every rank)."""
        tuning = self._tuning
        if tuning is None:
            raise RuntimeError("this Choice belongs to no Tuning: pass its kwargs to fxpipe.pipeline yourself")
        kwargs = {**self.kwargs, **more}
        if tuning.sample_kwargs:
            kwargs.setdefault("sample_kwargs", tuning.sample_kwargs)
        if self.distributed:
            import fxpipe.distributed as fpd

            if self.replicas > 1 and "mesh" not in kwargs:  # every rank of the job: replicas x pipeline ranks
                import torch.distributed as dist
                from torch.distributed.device_mesh import init_device_mesh

                ranks = dist.get_world_size() // self.replicas
                kind = "cuda" if dist.get_backend() == "nccl" else "cpu"
                kwargs["mesh"] = init_device_mesh(kind, (self.replicas, ranks), mesh_dim_names=("dp", "pp"))
            return fpd.pipeline(tuning.model, tuning.sample, **kwargs)
        from ..api import pipeline

        return pipeline(tuning.model, tuning.sample, **kwargs)

    def __repr__(self) -> str:
        """One line: the dataclass's own repr printed the plan's every node twice (27 KB for a
        4-layer GPT-2; a Llama's would be megabytes in a REPL)."""
        kwargs = {k: (f"<Plan: {v.n_stages} stages>" if isinstance(v, Plan) else v) for k, v in self.kwargs.items()}
        return (f"Choice(schedule={self.schedule!r}, one_process={self.one_process}, n_stages={self.n_stages}, "
                f"chunks={self.chunks}, replicas={self.replicas}, "
                f"checkpoint={self.checkpoint!r}, step_s={self.step_s:.3g}, bubble={self.bubble:.3f}, "
                f"peak={format_bytes(self.peak)!r}, fits={self.fits}, why={self.why!r}, kwargs={kwargs})")

    def row(self, replicas: bool = False) -> List[str]:
        """The table's cells; ``replicas``: with a column of them."""
        head = [self.label, *([self.replica_label] if replicas else []), str(self.n_stages)]
        return [*head, str(self.chunks), self.checkpoint, f"{self.step_s * 1e3:.2f} ms", f"{self.bubble:.1%}",
                format_bytes(self.peak)]


@dataclass
class Tuning:
    """Every configuration considered, ranked (``choices[0]`` is the best), and the model and
    sample they are for. ``print(tuning)`` shows the table."""

    choices: List[Choice]
    memory: Optional[float]
    model: Any = field(repr=False, default=None)
    sample: Any = field(repr=False, default=None)
    sample_kwargs: Optional[dict] = field(repr=False, default=None)
    #: where the costs came from ('profile' or 'roofline') and other notes for the table's head
    notes: List[str] = field(default_factory=list)
    #: schedules that cannot run here at all, and why
    skipped: Dict[str, str] = field(default_factory=dict)

    @property
    def fitting(self) -> List[Choice]:
        return [c for c in self.choices if c.fits]

    @property
    def best(self) -> Choice:
        """The first-ranked configuration that fits."""
        if not self.fitting:  # tune() refuses first; reachable only for a hand-made Tuning
            raise LookupError("no configuration fits")
        return self.fitting[0]

    def __str__(self) -> str:
        replicas = any(c.replicas > 1 for c in self.choices)  # a column only where some have replicas
        head = ["rank", "schedule", *(["replicas"] if replicas else []), "stages", "chunks", "checkpoint", "step",
                "bubble", "peak/device"]
        rows = [[str(i + 1), *c.row(replicas)] for i, c in enumerate(self.fitting)]
        limit = "no limit" if self.memory is None else format_bytes(self.memory)
        lines = [f"fxpipe.tune: {len(self.fitting)} of {len(self.choices)} configurations fit ({limit} per device)"]
        lines += [f"  {n}" for n in self.notes]
        lines += _table(head, rows[:15])
        if len(rows) > 15:
            lines.append(f"  ... and {len(rows) - 15} more that fit")
        misfits = [c for c in self.choices if not c.fits]
        if misfits:
            lines.append(f"do not fit or cannot run ({len(misfits)}), e.g.:")
            shown = sorted(misfits, key=lambda c: c.peak or float("inf"))[:6]
            lines += [f"  {c.label}{f' replicas={c.replica_label}' if c.replicas > 1 else ''} stages={c.n_stages} "
                      f"chunks={c.chunks} {c.checkpoint}: {c.why}" for c in shown]
        for name, why in self.skipped.items():
            lines.append(f"not considered: {name}{' on ranks' if name == '1f1b' else ''}: {why}")
        return "\n".join(lines)


def _table(head: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    left = {i for i, h in enumerate(head) if h in ("schedule", "checkpoint")}

    def line(r: List[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return [line(head), *[line(r) for r in rows]]
