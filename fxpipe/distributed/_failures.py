"""One rank's failure, named by every rank: ``rank R: ErrorType: message``.

Without this, when one rank raised, its peers printed only gloo's "Connection closed by peer"
and only torchrun's summary said which rank had failed. A rank fails in one of two places,
and its peers hear of it in one of two ways:

* **Before anything is sent** (the checks of a batch in ``step``/``eval_step``, the capture
  of the sample at build): every rank runs its checks, then the ranks agree on the outcome
  (:meth:`Failures.agreed`) -- one all-reduce of a flag per rank (a few bytes per call), and
  only when a flag is set, the failed ranks' one-line errors gathered. The failed rank
  re-raises its own error, every other rank raises :class:`~fxpipe.errors.PeerFailedError`
  naming it. Nothing was sent and no rank is left waiting, so the pipeline can still be used
  (a batch refused on rank 0 alone refuses that step everywhere).
* **In the middle of a step** (an error in ``loss_fn``, in a stage, on one rank): its peers
  are waiting inside torch's transfers for it and cannot be told through them. The failing
  rank writes its line into the store of the default process group (the first line written
  stays) and re-raises (:meth:`Failures.reported`). When its process ends, its connections
  close and its peers' transfers fail within moments; each reads the line and raises
  ``PeerFailedError`` with it, ending in turn the ranks waiting on it, which read the same
  line. The exit stays bounded as before (gloo fails a closed connection at once, a stuck
  rank after ``timeout``).

A rank can also fail **between steps**, in the user's own code (its data loader): its peers are
then waiting in the next step's agreement, and only gloo's "Connection closed by peer" reached
them. While a pipeline is open, an uncaught exception that ends the process writes its line to
the store first (:func:`sys.excepthook`, chained to the one installed before): the peers raise
``PeerFailedError`` naming the rank and its error, as for a failure inside a step.

The store is the rendezvous's. Under torchrun its agent holds it, and it outlives any rank.
Under ``init_process_group(init_method='tcp://...')`` (or ``env://`` outside torchrun) rank 0
holds it, and it ends with rank 0's process: when rank 0 fails in the middle of a step, a peer
reads its line if the store still answers (it did in the tests: the connections close first)
and otherwise raises ``PeerFailedError`` saying that the store went with its host, rank 0.
The failures before anything is sent need no store.
"""

from __future__ import annotations

import re
import sys
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from fxpipe.errors import DistributedError, PeerFailedError, StepError

from ._copies import Copies, refuse_different_copies
from ._batch_prints import PRINT, fingerprint, refuse_different_batches, refuse_same_batches
from ._loss_shapes import refuse_unshared_ratios, refuse_unshared_shapes
from ._flags import FLAG_COUNT, refuse_different_flags

__all__ = ["Failures", "Agreement", "failure_line", "joining"]

#: the longest error message carried to the other ranks (one line of a terminal log)
_MAX_CHARS = 2000
#: what torch's transfers raise when a peer is gone or late (gloo raises plain RuntimeErrors)
_TRANSPORT = re.compile(r"gloo|nccl|connection (closed|reset)|timed out|broken pipe", re.IGNORECASE)


#: torch's PipelineStage wraps an error of a stage's forward in a RuntimeError that says only
#: which stage failed ("[Stage 0] failed to run forward: args: ... kwargs: ..."); the error
#: itself, with fxpipe's note naming the generated line and the model's source, is its cause
_STAGE_WRAPPER = re.compile(r"^\s*\[Stage \d+\] failed to run (forward|backward)")


def _own_error(error: BaseException) -> BaseException:
    """The error to name: past torch's stage wrappers, the one raised in the stage's code."""
    while error.__cause__ is not None and _STAGE_WRAPPER.match(str(error)):
        error = error.__cause__
    return error


def failure_line(rank: int, error: BaseException) -> str:
    """``rank R: ErrorType: message (notes)``, the message's lines joined into one; for an
    error that torch's stage wrapped, the stage code's own error (its notes name the line)."""
    error = _own_error(error)
    notes = [str(n) for n in getattr(error, "__notes__", ())]
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    if notes:
        text = f"{text} ({'; '.join(' '.join(n.split()) for n in notes)})" if text else "; ".join(notes)
    if len(text) > _MAX_CHARS:
        text = text[:_MAX_CHARS] + " ..."
    return f"rank {rank}: {type(error).__name__}: {text}" if text else f"rank {rank}: {type(error).__name__}"


def _from_transport(error: BaseException) -> bool:
    """True for an error of torch's collectives and transfers (a peer gone, a timeout), False
    for one raised by this rank's own work."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and bool(_TRANSPORT.search(str(error).split("\n", 1)[0]))


@contextmanager
def joining(wait: Any) -> Iterator[None]:
    """The build's first collectives: a rank that builds alone (the others still in an earlier
    pipeline's ``step``) waited out ``timeout`` and raised the store's bare "wait timeout"
    (a trial). Said as :class:`DistributedError`, and written to the store key of each
    pipeline open in this process, so a peer waiting in one of them names this rank's cause."""
    try:
        yield
    except Exception as e:
        if not _from_transport(e):
            raise
        seconds = wait.total_seconds() if isinstance(wait, timedelta) else float(wait)
        error = DistributedError(
            f"the other ranks did not join this build within the timeout ({seconds:g} s): "
            "fxpipe.distributed.pipeline is a collective, every rank calls it at the same point of the program (a "
            "rank still running an earlier pipeline's step(), or a build behind 'if rank == 0:'?)")
        _tell_open_pipelines(error)
        raise error from e


#: how long a rank whose transfer failed waits for the failing peer's line in the store
_GRACE_S = 2.0

#: the calls a rank can be in when the ranks agree (their index travels)
_CALLS = ("", "step()", "eval_step()", "clip_grad_norm_()", "trace.record()")

#: a loss's further means a replica's last rank may report (:attr:`Agreement.ratios`)
_RATIOS = 4


class Agreement:
    """What a rank adds to :meth:`Failures.agreed`, set inside the block: ``batch``, the values
    every rank must have been given alike (the call's inputs and targets); ``copies``, the
    weights several ranks each hold a copy of (:class:`._copies.Copies`: tied parameters, the
    replicas' stages), the same list in the same order on every rank."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.copies: List[Copies] = []
        #: on a data-parallel replica's last rank: the loss's further counts against its first
        #: (:class:`fxpipe.checks._loss_fn.Weights`), which every replica must share (None: no loss here)
        self.ratios: Optional[Sequence[float]] = None
        #: the model's fingerprints (:meth:`._flags.ModelFlags.fingerprints`), the same on every rank
        self.flags: Optional[Tuple[int, ...]] = None
        #: on a replica's last rank whose loss is weighed by samples where its count is not read (a
        #: mean over every position): the shapes that count stands for (:func:`._loss.shape_key`),
        #: which every such replica must share
        self.shape: Optional[int] = None


#: the open pipelines' failure reporting, told of an uncaught exception before the process ends
_OPEN: "weakref.WeakSet[Failures]" = weakref.WeakSet()
_HOOKED: list = []  # the excepthook installed before fxpipe's, once chained


def _uncaught(kind: type, error: BaseException, tb: Any) -> None:
    """``sys.excepthook`` while a pipeline is open: the error's line into each open pipeline's
    store key (peers waiting in a step name it), then the hook installed before."""
    _tell_open_pipelines(error)
    _HOOKED[0](kind, error, tb)


def _tell_open_pipelines(error: BaseException) -> None:
    """``error``'s line into the store key of each pipeline open in this process: its peers,
    waiting in one of them, name this rank's error."""
    for failures in list(_OPEN):
        failures._write(failure_line(failures.rank, error))


class Failures:
    """The failure reporting of one pipeline's process group (both ways, see the module)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device = torch.device("cpu"),
                 rows: Optional[List[List[int]]] = None) -> None:
        self.group = group
        #: the ranks (in ``group``) of each replica's pipeline, which must share a batch; replicas
        #: given the same batch in ``step()`` are refused (:mod:`._mesh`)
        self.rows = rows
        self.device = device  # where the flags of :meth:`agreed` live: the group's backend must accept it
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # one key per pipeline: its group's name is unique in the job and the same on every rank
        self.key = f"fxpipe/failure/{group.group_name}"
        #: a transfer with a peer failed (a peer ended or timed out): the transport is gone, so no
        #: later call can run; the pipeline refuses them (PipelineClosedError) instead of gloo's
        #: bare "Application timeout caused pair closure" at the next collective (a trial)
        self.lost: Optional[str] = None

    def watch(self) -> None:
        """Until :meth:`forget`: an uncaught exception ending this process names this rank to
        the peers (see the module docstring)."""
        if not _HOOKED:
            _HOOKED.append(sys.excepthook)
            sys.excepthook = _uncaught
        _OPEN.add(self)

    def forget(self) -> None:
        _OPEN.discard(self)

    @contextmanager
    def agreed(self, doing: str, call: str = "") -> Iterator[Agreement]:
        """Runs the block (this rank's checks, which send nothing), then makes every rank agree
        on its outcome: when the block raised on some ranks, each of those re-raises its own
        error and every other rank raises ``PeerFailedError`` naming the first of them and its
        error. ``doing`` says what failed (``"check its batch"``). ``call`` names what this rank
        is running (``'step()'``): ranks running different calls would run different
        schedules (gloo aborted the process), so every rank refuses them with a
        :class:`DistributedError` naming each rank's call. The block may set the yielded
        :class:`Agreement`'s ``batch``: ranks given different batches are refused on every rank
        with :class:`BatchMismatchError` naming them (their fingerprints travel in the same
        all-reduce: a few more bytes, no extra collective); its ``flags``, the model's modes,
        ``requires_grad`` and loads fingerprints (:mod:`._flags`), must be the same on every rank."""
        failure: Optional[Exception] = None
        agreement = Agreement()
        try:
            yield agreement
        except Exception as e:  # told to every rank below, then re-raised here
            failure = e
        with self.reported():  # a peer gone before it could agree
            world = self.world_size
            copies = len(agreement.copies) * world
            if failure is None and agreement.ratios is not None and len(agreement.ratios) > _RATIOS:
                failure = StepError(f"loss_fn adds {len(agreement.ratios) + 1} means over different counts: with "
                                    f"data-parallel replicas at most {_RATIOS + 1} are weighed. Nothing was sent")
            flags = torch.zeros((2 + PRINT) * world + copies + (1 + _RATIOS) * world + world + FLAG_COUNT * world,
                                dtype=torch.int64, device=self.device)
            flags[self.rank] = failure is not None
            flags[world + self.rank] = _CALLS.index(call) if call in _CALLS else len(_CALLS)
            if failure is None and agreement.batch is not None:
                start = 2 * world + PRINT * self.rank
                try:
                    flags[start:start + PRINT] = fingerprint(agreement.batch, self.device)
                except Exception as e:  # noqa: BLE001 - told to every rank as this rank's failure
                    failure = e
                    flags[self.rank] = 1
            base = (2 + PRINT) * world
            for i, copy in enumerate(agreement.copies):
                if copy.held is not None:
                    flags[base + i * world + self.rank] = copy.bits().to(self.device)
            if failure is None and agreement.ratios is not None:
                at = base + copies + (1 + _RATIOS) * self.rank
                flags[at] = 1 + len(agreement.ratios)
                ratios = torch.tensor(list(agreement.ratios) + [0.0] * (_RATIOS - len(agreement.ratios)),
                                      dtype=torch.float64)
                flags[at + 1:at + 1 + _RATIOS] = ratios.view(torch.int64).to(self.device)  # bits, summed with zeros
            if failure is None and agreement.shape is not None:
                flags[flags.numel() - (1 + FLAG_COUNT) * world + self.rank] = agreement.shape
            if failure is None and agreement.flags is not None:
                end = flags.numel() - FLAG_COUNT * world + FLAG_COUNT * self.rank
                flags[end:end + FLAG_COUNT] = torch.tensor(agreement.flags, dtype=torch.int64)
            dist.all_reduce(flags, group=self.group)
            values = flags.tolist()
        base = (2 + PRINT) * world
        states = values[len(values) - FLAG_COUNT * world:]  # ModelFlags.fingerprints() per rank
        shapes = values[len(values) - (1 + FLAG_COUNT) * world:len(values) - FLAG_COUNT * world]
        values, prints, held = values[:2 * world], values[2 * world:base], values[base:base + copies]
        reported = flags[base + copies:flags.numel() - (1 + FLAG_COUNT) * world].cpu().view(world, 1 + _RATIOS)
        calls = values[world:]
        if len(set(calls)) > 1:  # raised outside reported(): not a failure for the store to keep
            named = ", ".join(f"rank {r}: {_CALLS[c] if c < len(_CALLS) else 'another call'}"
                              for r, c in enumerate(calls))
            raise DistributedError(
                f"the ranks called different methods of this pipeline ({named}): each would run other transfers "
                "and collectives, which would not match (gloo aborts the process). Nothing was sent. Call the same method on every rank, with "
                "the same batch.")
        failed = [r for r, flag in enumerate(values[:world]) if flag]
        if not failed:
            every = [tuple(prints[PRINT * r:PRINT * (r + 1)]) for r in range(world)]
            for row in self.rows or [list(range(world))]:
                refuse_different_batches([every[r] for r in row], call, row)
            if self.rows is not None and len(self.rows) > 1 and call == "step()":
                refuse_same_batches([every[row[0]] for row in self.rows], self.rows)
            if agreement.flags is not None:
                refuse_different_flags([tuple(states[FLAG_COUNT * r:FLAG_COUNT * (r + 1)]) for r in range(world)])
            refuse_different_copies(agreement.copies, held, world)
            refuse_unshared_ratios(reported)
            refuse_unshared_shapes(shapes)
            return
        with self.reported():
            lines: list[Optional[str]] = [None] * self.world_size
            mine = failure_line(self.rank, failure) if failure is not None else None
            dist.all_gather_object(lines, mine, group=self.group)
        if failure is not None:
            raise failure
        rank, line = failed[0], lines[failed[0]] or f"rank {failed[0]}: (no message)"
        raise PeerFailedError(f"rank {rank} could not {doing}, so no rank runs this call: {line}", rank, line)

    @contextmanager
    def reported(self) -> Iterator[None]:
        """The block sends and receives: an error of this rank's own is written to the store
        (the first written stays) and re-raised; an error of a transfer (a peer gone) is
        replaced by ``PeerFailedError`` naming the rank that failed first and its error."""
        try:
            yield
        except PeerFailedError:
            raise
        except Exception as e:
            if _from_transport(e):
                self.lost = failure_line(self.rank, e)
            if not _from_transport(e):
                self._write(failure_line(self.rank, e))
                own = _own_error(e)
                if own is not e:  # torch's "[Stage 0] failed to run forward", whose first line is empty
                    raise own.with_traceback(own.__traceback__) from None
                raise
            try:
                line = self._read_waiting()
            except Exception:  # noqa: BLE001 - the store went away with its host
                raise PeerFailedError(
                    f"rank {self.rank}: a transfer with another rank failed ({failure_line(self.rank, e)}), and the "
                    "store that holds the failing rank's error cannot be reached: its host ended (rank 0, unless "
                    "torchrun holds the store). See rank 0's error.") from e
            if line is None:  # no rank wrote first: a peer ended without a word (killed, out of memory) or is stuck
                said = (f"rank {self.rank}: a transfer with another rank failed ({failure_line(self.rank, e)}) and no "
                        "rank reported an error: a peer process ended (killed, out of memory, an error outside the "
                        "pipeline's calls) or is stuck")
                self._write(said)
                raise PeerFailedError(f"{said}. See the other ranks' logs; a new pipeline needs every rank running.",
                                      None, said) from e
            rank = int(line.split(":", 1)[0].split()[-1])
            raise PeerFailedError(f"stopped because another rank failed: {line}", rank, line) from e

    def _write(self, line: str) -> None:
        """The first line written for this pipeline stays; a store that cannot be reached is
        ignored (the rank's own error is what it raises)."""
        try:
            dist.distributed_c10d._get_default_store().compare_set(self.key, "", line)
        except Exception:  # noqa: BLE001 - never hide the rank's own error behind the store's
            pass

    def _read_waiting(self) -> Optional[str]:
        """The failing rank's line, waited for up to :data:`_GRACE_S`: a peer whose own wait
        timed out at the same moment (a rank building alone, :func:`joining`) writes it a moment
        after this rank's transfer failed."""
        deadline = time.monotonic() + _GRACE_S
        while True:
            line = self._read()
            if line is not None or time.monotonic() >= deadline:
                return line
            time.sleep(0.1)

    def _read(self) -> Optional[str]:
        store = dist.distributed_c10d._get_default_store()
        if not store.check([self.key]):
            return None
        return store.get(self.key).decode("utf-8", "replace")
