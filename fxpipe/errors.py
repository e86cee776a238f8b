"""Typed exceptions raised by fxpipe.

They subclass the builtin exception a caller would naturally catch (``RuntimeError``,
``ValueError``) so that code written against plain PyTorch keeps working, while
fxpipe-aware code can catch the precise type.
"""

from __future__ import annotations

from typing import Optional


class FxpipeError(Exception):
    """Base class of every error fxpipe raises on purpose."""


class TraceError(FxpipeError, RuntimeError):
    """The model could not be captured as a graph (neither torch.fx nor torch.export).

    The message names the module being traced, the original source line, the reason and
    what to do about it (usually: pass ``leaf_modules=[...]``). The underlying torch
    exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, *, module: str = "", location: str = "", reason: str = "") -> None:
        super().__init__(message)
        #: qualified name of the module whose forward failed ('' for the root)
        self.module = module
        #: "file:line: code" of the offending source line, '' if unknown
        self.location = location
        #: short human reason ("data-dependent control flow: ...")
        self.reason = reason


class InputMismatchError(FxpipeError, ValueError):
    """A call's arguments do not fit the sample a pipeline (or capture) was built from.

    The graph is specialised on the sample's call structure: which arguments are passed
    positionally or by keyword, the shape of every container, and the value of every
    non-tensor argument. The message names the argument and says what to do.
    """


class PlanError(FxpipeError, ValueError):
    """A saved plan cannot be read: the message names the file and what to do.

    Problems with the file itself also subclass the builtin a caller would catch:
    :class:`PlanFileError` is an ``OSError`` (and :class:`PlanNotFoundError` a
    ``FileNotFoundError``); a path that is not a path at all raises :class:`PlanPathError`,
    a ``TypeError``.
    """

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        #: the file involved, as given (``None`` for JSON text that came from no file)
        self.path = path

    def __str__(self) -> str:  # OSError would print "[Errno ...]" forms; keep our message
        return str(self.args[0]) if self.args else ""


class PlanPathError(PlanError, TypeError):
    """The plan path is not a ``str`` / ``os.PathLike``."""


class PlanFileError(PlanError, OSError):
    """The plan file cannot be opened, read or written (a directory, no permission, ...)."""


class PlanNotFoundError(PlanFileError, FileNotFoundError):
    """There is no file at the plan path."""


class PlanModelError(PlanError):
    """A readable plan that does not fit this model: another stage count than ``n_stages``, or
    another graph (nodes without a stage, or stages for nodes the graph does not have). The
    message names the file (when the plan came from one) and says to make a new plan."""


class MutationError(FxpipeError, ValueError):
    """An in-place update in the model's forward that a pipeline cannot make exact.

    The message names the operation, the tensor and the source line, and says what to do
    (usually: the out-of-place op, a ``.clone()``, or ``leaf_modules=[...]``).
    """

    def __init__(self, message: str, *, node: str = "") -> None:
        super().__init__(message)
        #: the message as written (fx's interpreter appends notes to ``args``)
        self.detail = message
        #: the graph node performing the update
        self.node = node


class MicroBatchError(FxpipeError, ValueError):
    """Splitting the batch into micro-batches and merging the outputs would not give the
    model's result: the batch is not where the split happens, or an output is not per sample.
    The message names the input or output and the option to set (``chunk_dims=``,
    ``output_merge=``)."""


class ArgumentError(FxpipeError, ValueError):
    """An argument of :func:`fxpipe.pipeline` (or of the other front ends) has a value fxpipe
    cannot use, or two arguments contradict each other. The message names the argument, the
    values it takes and what to do; ``argument`` holds its name.

    A ``ValueError``, as these were before they had a type of their own, so existing
    ``except ValueError`` code keeps working.
    """

    def __init__(self, message: str, *, argument: str = "") -> None:
        super().__init__(message)
        #: the argument the message is about (``'n_stages'``, ``'split_points'``, ...)
        self.argument = argument


class ChunksError(ArgumentError):
    """``chunks`` is not a positive integer."""


class StagesError(ArgumentError):
    """``n_stages`` is not a positive integer, or larger than the number of nodes the captured
    graph can be cut into (the message gives the largest count that works)."""


class SplitPointsError(ArgumentError):
    """``split_points`` cannot cut the graph into ``n_stages`` stages: a name that is no module
    of the traced graph, the wrong number of names, names out of order, a cut inside a group
    of nodes that must share a stage, or ``split_points`` given together with ``plan``."""


class DevicesError(FxpipeError, IndexError):
    """Fewer ``devices`` than stages. An ``IndexError``, as before it had a type of its own."""


class PlacementError(FxpipeError, TypeError):
    """A pipeline was asked to move whole to one device."""


class PipelinePicklingError(FxpipeError, TypeError):
    """A pipeline that cannot be pickled exactly was pickled (the message says what to save)."""


class CheckpointBackwardError(FxpipeError, RuntimeError):
    """A checkpointed stage that cannot be recomputed exactly for backward: it modifies its
    input in place, its input or a parameter was modified in place after its forward (the
    message names the parameter), or its recomputation saved other tensors than its forward
    did. The message names the partition and says to make the operation out of place, to
    call backward before changing the weights, or to build with ``checkpoint='never'``."""


class PipelineClosedError(FxpipeError, RuntimeError):
    """A closed pipeline was called (the message names it and says what to do)."""


class CompileError(FxpipeError, RuntimeError):
    """``torch.compile`` was applied to a whole fxpipe pipeline (or to code calling one)."""


class BatchNormConversionError(FxpipeError, ValueError):
    """A BatchNorm layer cannot be converted (the message names it and says what to do)."""


class EmitError(FxpipeError, ValueError):
    """The graph and the stage assignment cannot be turned into stages (for example a
    node uses a value from a later stage)."""


class MetaDeviceError(FxpipeError, RuntimeError):
    """A model built on the meta device (shapes, no values) was asked for something that
    needs values: timing it (``balance_by='time'``) or running its pipeline. Planning it with
    ``balance_by='params'`` or ``'memory'`` works. The message says how to proceed."""


class DistributedError(FxpipeError, RuntimeError):
    """A multi-process pipeline (:mod:`fxpipe.distributed`) cannot be built or run as asked:
    the message names the rank, the stage or the value, and what to do."""


class PeerFailedError(DistributedError):
    """Another rank of a distributed pipeline raised, so this rank cannot go on: the message
    names that rank and its error (``rank R: ErrorType: message``; its traceback is on that
    rank). ``rank`` and ``error`` hold them (``None`` and ``""`` where unknown)."""

    def __init__(self, message: str, rank: Optional[int] = None, error: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error

    def __reduce__(self) -> tuple:  # pickled whole (torch.multiprocessing, all_gather_object)
        return (type(self), (str(self), self.rank, self.error))


class BatchMismatchError(DistributedError):
    """Ranks of one ``fxpipe.distributed`` pipeline were given different batches: only the
    first stage's rank reads the inputs and only the last the targets, so the step would train
    one rank's inputs against another's targets. The message names which ranks agree."""

    def __init__(self, message: str, *, groups: "list[list[int]] | None" = None) -> None:
        super().__init__(message)
        #: the ranks that were given the same batch, one list per batch
        self.groups = [list(g) for g in (groups or [])]


class TiedWeightsError(DistributedError):
    """A parameter used by stages on several ranks (a tied embedding and LM head) holds other
    values on those ranks at the start of a step: its copies were updated differently (a
    gradient clipped by each rank's own norm, weights changed on one rank). ``.parameter``
    names it, ``.ranks`` the ranks holding it."""

    def __init__(self, message: str, *, parameter: str = "", ranks: "tuple[int, ...]" = ()) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.ranks = tuple(ranks)


class ReplicaWeightsError(DistributedError):
    """The data-parallel replicas hold other values of the same stages (what each holds whole:
    every weight under ``'ddp'``, buffers under ``'fsdp'``) at the start of a call: weights
    loaded, changed or stepped on some replicas only.
    ``.parameter`` names the first tensor found to differ (on the ranks holding it; empty on
    the others), ``.ranks`` the ranks holding the copies."""

    def __init__(self, message: str, *, parameter: str = "", ranks: "tuple[int, ...]" = ()) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.ranks = tuple(ranks)


class PlanMismatchError(DistributedError):
    """The ranks of a distributed pipeline do not run the same stage code: their models or
    fxpipe/torch versions differ. The message lists each rank's stage code hashes."""


class MaterialiseError(DistributedError):
    """This rank's part of a model on the meta device cannot be given real values as asked
    (:mod:`fxpipe.distributed._materialise`): a key its stages need is missing from
    ``state_dict`` or has another shape, a non-persistent buffer nothing restores, a tensor
    that is in no checkpoint. The message names the key, buffer or tensor and what to pass."""


class BatchShapeError(FxpipeError, ValueError):
    """A batch given to a distributed pipeline whose batch size is not a multiple of ``chunks``
    (torch's schedules run micro-batches of one size; any length runs), whose tensors differ in
    batch size, or a ``target`` without the batch's samples."""


class ModeError(FxpipeError, RuntimeError):
    """A pipeline called in a training/eval mode its captured graph cannot run in, where no
    capture in that mode could be made: the capture baked the other mode in (torch.export, a
    traced ``self.training`` branch) and capturing it again failed, or ``fxpipe.distributed``
    (``step`` in eval mode, a build in eval mode called in training mode). The message says why
    and to build one pipeline per mode."""


class ModelChangedError(FxpipeError, RuntimeError):
    """The model changed after its pipeline was built in a way the stages cannot see: a
    submodule they call or a parameter they hold was replaced (a LoRA wrapper put in place of
    a layer, ``model.lin.weight = nn.Parameter(...)``), a plain attribute the traced forward
    read has another value (``model.temperature = 0.5``: the graph has the old one baked in),
    or a module whose code was traced got hooks. The message names each change and says to
    rebuild the pipeline; ``changes`` lists them."""

    def __init__(self, message: str, *, changes: "list[str] | None" = None) -> None:
        super().__init__(message)
        #: one line per change, as in the message
        self.changes = list(changes or [])


class SubmoduleAccessError(FxpipeError, AttributeError):
    """A submodule of the model asked of its :class:`fxpipe.Pipeline` (``pipe.get_submodule``,
    as ``torch.func.functional_call(pipe, ...)`` does to swap tensors in for one call): the
    pipeline names the model's tensors as the model does, but its stages run the model's own
    tensors and cannot swap them. The message says what to do."""


class StepError(FxpipeError, RuntimeError):
    """A training step (``Pipeline.step``) that cannot run exactly as asked: no loss to train
    (the model returns none and no ``loss_fn`` is given), a loss that is not a 0-dim float
    requiring grad, a ``'mean'`` ``loss_fn`` over labels holding ``-100``, a step under
    ``torch.no_grad()``; or ``pipe(x)`` with gradients in training mode under
    ``schedule='1f1b'``, whose backward only ``step()`` can run in that order. The message
    says what to do."""


class BalanceWarning(UserWarning):
    """One node fxpipe cannot split makes a stage far slower than the others.

    The message (also in ``print(plan)``) names the node and its module, why it is opaque,
    and what to do.
    """


class MemoryBudgetError(FxpipeError, ValueError):
    """``fxpipe.tune`` found no configuration that fits the memory given per device. The
    message names the configuration that needs the least, how much it needs on which device
    and of what (parameters, gradients and optimizer state; activations), and what to do;
    ``required`` holds that many bytes, ``budget`` the memory given."""

    def __init__(self, message: str, *, required: float = 0.0, budget: float = 0.0) -> None:
        super().__init__(message)
        #: the least peak bytes per device any configuration needs
        self.required = required
        #: the memory per device that was given
        self.budget = budget
