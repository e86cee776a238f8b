"""Memory per device: the parameters, gradients and optimizer state of its stages, the
receive buffers, and the activations in flight under the schedule and checkpoint mode.

Activations are walked along each device's action list (:mod:`fxpipe.tuning._orders`). After
``F(s, i)`` micro-batch ``i`` holds stage ``s``'s ``held`` bytes (checkpointed or not,
:mod:`fxpipe.tuning._activations`) until its backward; while ``B(s, i)`` runs, the device
holds everything else in flight plus that task's ``peak`` (which includes its own held
bytes). A zero-bubble input pass ``I`` keeps ``weight_held`` bytes for the weight pass ``W``.
The gradients a backward makes for what an earlier stage of the same device sent it
(``grads_back``) stay until that stage's backward of the micro-batch, which counts them in its
peak: a skip connection's gradient from the last stage to the first waits through every
backward in between.
For ``fxpipe.distributed`` the walk follows torch's ``PipelineStage`` and schedule runtime
instead (:func:`_torch_stage_peak`, :class:`TorchRun`): outputs kept until the backward,
sends kept to the step's end by the multi-stage runtime, zero bubble's clones and kept
input gradients. The peak is the largest of those moments. Which micro-batches are checkpointed follows
``checkpoint_stop``: ``'always'`` all, ``'except_last'`` all but the last, ``'never'`` none.

In one process (``fxpipe.pipeline``) the model's output is merged over all micro-batches,
held until the loss's forward (through the backward where the loss keeps it, measured per
``loss_fn``: :mod:`._loss_memory`), and the loss's gradient for all of it arrives at once,
when the backward begins: both are counted, ``chunks`` micro-batches' worth. A value a
stage sends is alive from its forward to the forward of the stage that holds it
(``StageActivations.in_flight``): one-process 1F1B's first backward runs while later
micro-batches' are on their way. And one
autograd call runs every micro-batch's backward: each parameter's gradient is summed in a
buffer of its size from the stage's first backward to its last (``grad_buffers``), extra
memory where ``.grad`` is kept through the backward; ``fxpipe.distributed``'s one call per
micro-batch adds straight into ``.grad``.

Under ``zero_grad='set_to_none'`` (torch's default, tune's) no ``.grad`` exists when the step
starts: a stage's gradients appear during its first backward, node by node, and stay to the
step's end (``grads_made``); at the activations' peak, the backward's start, most are not
there yet.

Static bytes per device (:func:`static_bytes`): its stages' parameters and buffers, each tensor
once (a weight tied between two of its stages too: :mod:`._tensors`), the gradients of those it
trains once, their optimizer state (``'sgd'``: none; ``'momentum'``:
one copy; ``'adam'``: two copies, in the parameters' dtype), and, for ``fxpipe.distributed``, torch's receive
buffers: a ``PipelineStage`` allocates one activation buffer and one gradient buffer per
micro-batch up front (torch 2.x ``_prepare_forward_infra`` / ``_prepare_backward_infra``), for
every input of the stage and every output that needs a gradient. The stages are those of the
carried graph (:mod:`fxpipe.distributed._carry`): a skip crosses every stage between its
producer and its reader, so a stage's inputs are all values crossing its boundary
(:func:`receive_buffers`, from ``StageActivations.boundary_*``), not only those it reads.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Dict, Hashable, List, Mapping, Optional, Sequence

from ._activations import StageActivations
from ._loss_memory import DEFAULT as DEFAULT_LOSS
from ._loss_memory import LossMemory
from ._orders import DISTRIBUTED_SCHEDULES, Action

__all__ = ["LOSS_COPIES", "OPTIMIZER_STATES", "TorchRun", "torch_run", "checkpointed", "activation_peaks", "receive_buffers",
           "static_bytes", "ZERO_GRAD"]

#: the loss's peak above the output, in copies of it, where it is not measured (no ``loss_fn``,
#: or on meta): its gradient and temporaries (:mod:`._loss_memory` measures it per loss)
LOSS_COPIES = DEFAULT_LOSS.copies

#: how ``.grad`` is cleared between steps (``tune(zero_grad=)``): to None, torch's default, or
#: zeroed in place (also: gradients accumulated over several backwards)
ZERO_GRAD = ("set_to_none", "in_place")

#: copies of the parameters each optimizer keeps
OPTIMIZER_STATES = {"none": 0, "sgd": 0, "momentum": 1, "adam": 2, "adamw": 2}


def checkpointed(mode: str, chunks: int) -> int:
    """How many leading micro-batches are checkpointed (``runtime._frontend.checkpoint_stop``)."""
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def activation_peaks(orders: Mapping[Hashable, Sequence[Action]], stages: Sequence[StageActivations],
                     mode: str, chunks: int, *, merged_output: bool = False,
                     torch_stages: bool | TorchRun = False,
                     grad_buffers: Optional[Sequence[int]] = None,
                     grads_made: Optional[Sequence[int]] = None, step_loss: bool = False,
                     loss: LossMemory = DEFAULT_LOSS) -> Dict[Hashable, int]:
    """Peak activation bytes per device along its actions (see the module docstring).

    ``merged_output``: the single-process pipeline, whose output all micro-batches share
    one device with the last stage: count the merged output, the loss's backward over it
    (:data:`LOSS_COPIES`) and the gradient it leaves. ``grad_buffers``: per stage, the bytes of
    its trained parameters' gradients, when one autograd call runs every micro-batch's backward
    (``fxpipe.pipeline``) and ``.grad`` exists through it (zeroed in place, or accumulated
    over several backwards): a parameter used by several micro-batches has one accumulation
    node, which sums what they send in a buffer of its size from the first micro-batch's
    backward of the stage to the last, and only then adds it into ``.grad`` (measured: TinyGPT,
    32 micro-batches, every layer's weight gradient alive at the step's peak as such a sum).
    With ``.grad`` None (``zero_grad(set_to_none=True)``) the sum becomes ``.grad``
    (``grads_made``). Either way summing the first two micro-batches' gradient is out of place,
    three copies at once: the second backward of a stage adds its ``largest_grad``
    (``merged_output`` only). Not read for ``torch_stages``, whose one autograd call per
    micro-batch adds straight into ``.grad``. ``torch_stages``: ``fxpipe.distributed``, whose
    stages are torch ``PipelineStage`` objects (:func:`_torch_stage_peak`; a
    :class:`TorchRun` says how torch's schedule keeps sends and gradients). ``grads_made``:
    per stage, the bytes of the gradients its backward brings into existence
    (``zero_grad='set_to_none'``: ``.grad`` is None when the step starts), from the stage's
    first backward that computes weight gradients (``B``, or ``W`` under zero bubble) to the
    step's end: during that ``B`` node by node (``StageActivations.grads_peak``), all of them
    during a ``W`` (an upper bound); without it they are static bytes, there before the step.
    Measured on one process (``tests/tuning/test_peak_measured.py``): counting them all at
    the activations' peak over-predicted the total by up to 27%. ``step_loss``: one-process
    1F1B (``Pipeline.step``), whose loss runs on each micro-batch's output as it leaves the
    last stage, its backward just before that stage's: the output itself (no saved tensor of
    the stage holds it) and :data:`LOSS_COPIES` of it then (measured on a tiny Qwen3, cross
    entropy over 1-4 MiB of logits per micro-batch: 0.77-0.85 of the measured peak without
    them, 0.98-1.0 with them). ``loss``: the loss's peak above the output in copies of it, and
    (:mod:`._loss_memory`, measured on one micro-batch; the merged output's loss scaled by
    ``chunks``). Under GPipe the merged output is counted through the loss's backward, as a
    caller holding ``out = pipe(x)`` (the guide's loop, transformers' ``outputs``) keeps it; a
    caller writing ``loss_fn(pipe(x), y).backward()`` with a loss that does not save it (a
    cross entropy keeps its ``log_softmax``) frees it at the loss's forward, one copy of the
    output less than predicted: on the safe side."""
    stop = checkpointed(mode, chunks)
    copies = loss.copies
    last = len(stages) - 1
    peaks: Dict[Hashable, int] = {}
    if torch_stages:
        run = torch_stages if isinstance(torch_stages, TorchRun) else None
        return {device: _torch_stage_peak(actions, stages, stop, run, grads_made)
                for device, actions in orders.items()}
    for device, actions in orders.items():
        held = peak = 0
        own: Dict[tuple[int, int], int] = {}
        waiting: Dict[tuple[int, int], int] = {}  # gradients made for (stage, micro-batch), not yet used
        last_backwards = sum(1 for a in actions if a.stage == last and a.kind in "BI")
        seen_last = 0
        backwards = Counter(a.stage for a in actions if a.kind in "BI")  # per stage
        done: Counter = Counter()  # backwards run so far, per stage
        made: set = set()  # stages whose parameter gradients exist (grads_made)
        flying: Counter = Counter()  # (stage, micro-batch): bytes alive until that forward
        for a in actions:
            st = stages[a.stage]
            ck = 1 if a.mb < stop else 0
            if a.kind == "F":
                held += st.held[ck] - flying.pop((a.stage, a.mb), 0)
                own[(a.stage, a.mb)] = st.held[ck]
                peak = max(peak, held + st.forward)
                for t, nbytes in st.in_flight[ck]:  # sent on, held by no stage until t's forward
                    flying[(t, a.mb)] += nbytes
                    held += nbytes
                if merged_output and a.stage == last:
                    held += st.outputs
                    if a.mb == chunks - 1:
                        peak = max(peak, held)
                continue
            first = _makes_gradients(a, made, grads_made)
            if a.kind == "W":
                mine = own.pop((a.stage, a.mb), 0)
                new = grads_made[a.stage] if first else 0  # conservative: all of them at its peak
                peak = max(peak, held + new + (st.peak[ck] - st.held[ck] if ck else 0))
                held += new - mine
                done[a.stage] += 1
                continue
            mine = own.get((a.stage, a.mb), 0)
            extra = 0
            if merged_output and a.stage == last:
                if seen_last == 0:  # the loss's backward over the whole merged output, the caller's `out`
                    peak = max(peak, held + int(copies * chunks * st.outputs))
                    held += chunks * st.outputs  # its gradient, until every micro-batch took its share
                extra = -st.outputs  # the task's own share of it is in its peak already
                seen_last += 1
            if step_loss and a.stage == last:  # the micro-batch's loss and its backward, first
                peak = max(peak, held + int((1 + copies) * st.outputs))
            if first:  # its gradients come to exist node by node, and stay
                extra += st.grads_peak[ck]
            if merged_output and done[a.stage] == 1:  # autograd sums two micro-batches' out of place
                extra += st.largest_grad
            arrived = waiting.pop((a.stage, a.mb), 0)  # its peak counts them as incoming
            held -= arrived
            peak = max(peak, held - mine + st.peak[ck] + extra)
            for p, nbytes in st.grads_back:
                waiting[(p, a.mb)] = waiting.get((p, a.mb), 0) + nbytes
                held += nbytes
            if a.kind == "I":
                keep = min(mine, st.weight_held)
                own[(a.stage, a.mb)] = keep
                held -= mine - keep
            else:
                own.pop((a.stage, a.mb), None)
                held -= mine
                if first:
                    held += grads_made[a.stage]
            if merged_output and a.stage == last and seen_last == last_backwards:
                held -= chunks * st.outputs
            done[a.stage] += 1
            if grad_buffers is not None:  # the first backward's weight gradients stay, as the sum
                if done[a.stage] == 1:
                    held += grad_buffers[a.stage]
                if done[a.stage] == backwards[a.stage]:  # the sum goes into .grad
                    held -= grad_buffers[a.stage]
        peaks[device] = peak
    return peaks


@dataclass(frozen=True)
class TorchRun:
    """How torch runs ``fxpipe.distributed``'s stages, for the walk of one rank.

    ``device_of[s]``: the rank of stage ``s`` (which neighbours are local). ``held_sends``:
    the schedule runs torch's ``_PipelineScheduleRuntime`` (interleaved and V schedules),
    which keeps every send's ``Work`` -- and with it the tensor sent, activations and
    gradients alike -- until the step ends (``send_ops``, waited after the last action);
    ``Schedule1F1B`` / ``ScheduleGPipe`` wait each send in turn. ``split``: a zero-bubble
    schedule, whose stages return clones of their outputs (a carried view included,
    ``fxpipe.distributed._values._own``) and whose input pass leaves each input gradient in
    the ``.grad`` of the stage's receive buffer until the next step (``stage_backward_input``;
    ``clear_runtime_states`` drops it). ``one_f_one_b``: ``Schedule1F1B``'s loop
    (``_step_microbatches``), whose variables keep two things alive: ``send_work``, the
    ``Work`` of the last forward send fired in the warm-up (micro-batch ``warmup - 2``), until
    the loop's last backward-forward pair is done; and ``bwd_sends``, each backward's gradient
    sends, until the next backward has run."""

    device_of: Sequence[Hashable]
    held_sends: bool = False
    split: bool = False
    one_f_one_b: bool = False


def torch_run(schedule: str, stage_devices: Sequence[Hashable]) -> TorchRun:
    """How torch runs ``schedule``'s stages: its multi-stage classes are
    ``_PipelineScheduleRuntime`` (sends kept to the step's end), the zero-bubble ones split
    the backward (``fxpipe.distributed._schedules``)."""
    from fxpipe.distributed._schedules import SCHEDULES

    return TorchRun(list(stage_devices), held_sends=DISTRIBUTED_SCHEDULES[schedule] > 1,
                    split=SCHEDULES[schedule].split_backward, one_f_one_b=schedule == "1f1b")


def _torch_stage_peak(actions: Sequence[Action], stages: Sequence[StageActivations], stop: int,
                      run: Optional[TorchRun] = None, grads_made: Optional[Sequence[int]] = None) -> int:
    """One rank's peak under torch's ``PipelineStage`` (torch 2.13 ``stage.py``), which keeps
    more than autograd saves: each micro-batch's outputs until its backward (``fwd_cache``;
    the last stage's until the step ends, ``output_chunks``); between a zero-bubble input pass
    and its weight pass the retained graph (everything the stage saved, recomputed ones
    included: fxpipe recomputes once per micro-batch), its outputs, the gradients that
    arrived (``backward_state``) and the gradients of the parameters' nodes' outputs
    (``stage_backward_input``'s ``param_groups``); a weight pass runs the parameter groups in
    order, freeing each one's kept gradients as it goes (``weight_peak``); and the first stage
    runs its whole backward in ``W``. What a stage receives, values and gradients, is in receive
    buffers (static bytes), as the activations were made (``received_static``).

    With ``run`` (:class:`TorchRun`): what is sent to another rank stays until the step ends
    under ``held_sends``; an output handed to the next stage on the same rank (the V's turn)
    takes the place of the one the previous step left in that stage's receive buffer (a
    static receive buffer, nothing more), and so does a gradient handed back; under
    ``split`` the outputs are clones (every value crossing, carried ones too) and the input
    gradients stay to the end of the step."""
    last = len(stages) - 1
    run = run or TorchRun(device_of=())
    local = run.device_of

    def same(a: int, b: int) -> bool:
        return bool(local) and 0 <= b <= last and local[a] == local[b]

    held = peak = 0
    made: set = set()  # stages whose gradients exist (grads_made)
    own: Dict[tuple[int, int], int] = {}
    warmup_send: Optional[tuple[int, int]] = None
    loop_end, grads_pending, warmup_kept = -1, 0, 0
    if run.one_f_one_b:  # Schedule1F1B: which forward's send outlives its backward, and until when
        forwards = [a for a in actions if a.kind == "F"]
        warmup = next((i for i, a in enumerate(actions) if a.kind != "F"), len(actions))
        if warmup >= 2 and forwards[warmup - 2].stage != last:
            warmup_send = (forwards[warmup - 2].stage, forwards[warmup - 2].mb)
        last_f = max((i for i, a in enumerate(actions) if a.kind == "F"), default=-1)
        loop_end = next((i for i, a in enumerate(actions) if i > last_f and a.kind != "F"), -1)
    for i, a in enumerate(actions):
        st, key = stages[a.stage], (a.stage, a.mb)
        ck = 1 if a.mb < stop else 0
        sent = st.sent[ck]
        if a.stage != last and run.split:
            sent = st.boundary_out  # clones, kept past the stage's own saved tensors
        if a.stage != last and same(a.stage, a.stage + 1):
            sent = 0  # takes the place of last step's output in the next stage's buffer
        stays = st.sent[ck] if a.stage == last else 0
        if a.stage != last and run.held_sends and not same(a.stage, a.stage + 1):
            stays = st.boundary_out if run.split else st.boundary_out - st.boundary_carried
        # its own held bytes are in its peak; recomputed storages stay to the backward's end
        backward = (st.peak_shared or st.peak[1] if ck else st.peak[0]) + sent
        made_grads = _input_grads(st, run.split, remote=not same(a.stage, a.stage - 1))
        grads_kept = 0
        if a.stage > 0 and not same(a.stage, a.stage - 1) and (run.held_sends or run.split):
            grads_kept = made_grads  # in a send's Work, or the receive buffer's .grad
        elif a.stage > 0 and run.split:  # handed on the rank: the copies replace last step's
            grads_kept = st.boundary_grads_storage
        held += int(grads_made[a.stage]) if grads_made is not None and _makes_gradients(a, made, grads_made) else 0
        if a.kind == "F":
            own[key] = st.held[ck] + sent
            held += own[key]
            peak = max(peak, held + st.forward)
            continue
        mine = own.pop(key, 0)
        if a.kind == "I":
            if a.stage == 0:  # nothing runs: W does the whole backward
                own[key] = mine + st.grads_in
            else:  # the retained graph, the gradients that arrived and those kept for W
                own[key] = max(st.held[0], st.held[ck]) + sent + st.grads_in + st.weight_grads
                peak = max(peak, held - mine + backward, held - mine + own[key] + made_grads)
                held += grads_kept
            held += own[key] - mine
            continue
        if a.kind == "B" or (a.kind == "W" and a.stage == 0):
            peak = max(peak, held - mine + backward)
            if a.kind == "B":
                held += grads_kept
        elif a.kind == "W":  # the weight gradients, from what the input pass kept
            peak = max(peak, held + st.weight_peak)
        if run.one_f_one_b and a.kind == "B":
            held += made_grads - grads_pending  # the last backward's gradient sends go, this one's stay
            grads_pending = made_grads
            if warmup_send == key and i < loop_end:  # its output stays in send_work to the loop's end
                warmup_kept = st.boundary_out - st.boundary_carried
                held += warmup_kept
            if i == loop_end:
                held -= warmup_kept
        held -= mine - stays
    return peak


def _makes_gradients(a: Action, made: set, grads_made: Optional[Sequence[int]]) -> bool:
    """Whether ``a`` is the first action to make stage ``a.stage``'s ``.grad`` under
    ``grads_made`` (a ``B``, or the ``W`` of zero bubble: an ``I`` makes input gradients only);
    then remembered in ``made``. Those gradients count from that action's peak to the step's end."""
    if grads_made is None or a.kind not in "BW" or a.stage in made:
        return False
    made.add(a.stage)
    return True


def _input_grads(st: StageActivations, split: bool, remote: bool) -> int:
    """The bytes of one micro-batch's input gradients a stage's backward leaves (measured on
    gloo ranks): a carried value's gradient is passed on in the buffer it arrived in (fxpipe
    makes every input gradient contiguous where it is made: nothing to copy further on); zero
    bubble keeps each input's ``.grad`` (a slice's whole storage) and the contiguous copy it
    sends another rank."""
    return st.boundary_grads_kept if split and remote else st.grads_made


def receive_buffers(stages: Sequence[StageActivations], run: Optional[TorchRun] = None) -> List[int]:
    """Per stage, the bytes of one micro-batch's receive buffers in torch's ``PipelineStage``:
    an activation buffer for each value crossing into it (none on the first stage, which takes
    the model's inputs) and a gradient buffer for each value crossing out of it that gets a
    gradient (none on the last). Sized from the carried graph's boundaries, where a skip is an
    input and an output of every stage it crosses. A same-rank hand-over (the V's, ``run``)
    replaces the buffer with the previous stage's output, which then stays until the next
    step's: the same bytes, still counted; the gradient handed back stays in that output's
    ``.grad``: only what the later stage's backward made (a value it only carries passes its
    gradient on, measured). Left out, as in the boundaries: the model's inputs carried to a
    later stage, and parameters."""
    n = len(stages)
    local = run.device_of if run is not None else ()

    def grads(s: int) -> int:
        nxt = stages[s + 1]
        return nxt.grads_made if local and local[s] == local[s + 1] else nxt.boundary_grads

    return [(stages[s - 1].boundary_out if s > 0 else 0) + (grads(s) if s + 1 < n else 0) for s in range(n)]


def static_bytes(param_bytes: Sequence[int], stage_devices: Sequence[Hashable], optimizer: str,
                 receive: Sequence[int] = (), chunks: int = 1,
                 trained: Optional[Sequence[int]] = None) -> Dict[Hashable, int]:
    """Parameters (and buffers: ``param_bytes``) + gradients + optimizer state of each device's
    stages, the last two for the ``trained`` bytes (needing grad; default: every parameter),
    and (distributed) ``chunks`` times ``receive[s]``, one micro-batch's receive buffers of
    stage ``s`` (:func:`receive_buffers`)."""
    copies = 1 + OPTIMIZER_STATES[optimizer]  # the gradient, and the optimizer's state
    trained = param_bytes if trained is None else trained
    out: Dict[Hashable, int] = {}
    for s, d in enumerate(stage_devices):
        extra = chunks * receive[s] if receive else 0
        out[d] = out.get(d, 0) + int(param_bytes[s]) + copies * int(trained[s]) + extra
    return out

