"""Memory accounting against hand counts: stage activations from a hand-made recording, the
schedule walk, the static bytes, and the recorder against autograd's own saved tensors."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fxpipe.build import BuildOptions, capture_and_check
from fxpipe.capture._prepare import preserved
from fxpipe.tuning._activations import StageActivations, stage_activations
from fxpipe.tuning._memory import (LOSS_COPIES, TorchRun, activation_peaks, receive_buffers, static_bytes,
                                   torch_run)
from fxpipe.tuning._nodes import NodeRecord, Recording, record_nodes
from fxpipe.tuning._orders import Action, single_process_order
from fxpipe.tuning._simulate import send_bytes


def hand_recording() -> Recording:
    """x (external) -> lin1 -> relu -> lin2 -> output; relu saves its output, lin2 its input
    (the same storage), lin1 its input (external: not counted)."""
    return Recording([
        NodeRecord("lin1", makes={10: 100}, grad_out={10: 100}, grad_params=40),
        NodeRecord("relu", makes={11: 100}, reads={10: 100}, saves={11: 100}, grad_in={10: 100}, grad_out={11: 100}),
        NodeRecord("lin2", makes={12: 50}, reads={11: 100}, saves={11: 100}, grad_in={11: 100}, grad_out={12: 50},
                   grad_params=20),
    ], outputs={12: 50}, external={1})


def test_stage_activations_by_hand() -> None:
    s0, s1 = stage_activations(hand_recording(), {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 0])
    assert s0.held == (0, 0)        # nothing saved; receives only the external input
    assert s1.held == (100, 100)    # relu's output saved once (two savers, one storage); receives lin1's output
    # stage 0 backward: the incoming gradient of lin1's output (100) + its weight-gradient temporary (40)
    assert s0.peak[0] == 140
    # stage 1: saved 100 + output gradient 50; lin2 makes relu's gradient (100, peak with its 20 weight
    # temporary: 270), frees its output's; relu makes lin1's output gradient (100): 300
    assert s1.peak[0] == 300
    # checkpointed: received 100, recompute makes 100 (saved) + 50 (output, dropped after) -> 250 + 50 incoming
    # gradient; then the backward from received + saved: 200 + 50 + 100 (relu grad) + 100 (lin1's) = 400
    assert s1.peak[1] == 400
    assert s1.forward == 0
    assert s1.weight_held == 150    # lin2's saved input and its output gradient
    assert (s0.weight_grads, s1.weight_grads) == (100, 50)  # lin1's, lin2's output gradients (relu has no parameters)
    assert (s0.outputs, s1.outputs) == (0, 50)
    assert s1.received == 100


def test_separate_devices_count_a_shared_storage_on_each() -> None:
    rec = hand_recording()
    rec.nodes[1].saves = {10: 100, 11: 100}  # relu also saves its input (made on stage 0)
    rec.nodes[0].saves = {10: 100}           # and lin1 its output
    one_pool = stage_activations(rec, {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 0])
    two = stage_activations(rec, {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 1])
    assert [s.held[0] for s in one_pool] == [100, 100]   # 10 counted at its first saver only
    assert [s.held[0] for s in two] == [100, 200]        # stage 1 holds its own copy of 10


def acts(held, peak, outputs=0) -> StageActivations:
    return StageActivations(held, peak, 0, 0, 0, outputs)


def test_schedule_walk_by_hand() -> None:
    """Two stages on one device, two micro-batches, fxpipe.pipeline's order:
    F00 F01 F10 F11, then B11 B10 B01 B00 (stage, micro-batch)."""
    stages = [acts((10, 0), (15, 12)), acts((20, 4), (30, 26))]
    order = {0: single_process_order(2, 2)}
    # never: 60 held after forward; B(1,1): 60 - 20 + 30
    assert activation_peaks(order, stages, "never", 2)[0] == 70
    # always: 8 held; B(1,1): 8 - 4 + 26
    assert activation_peaks(order, stages, "always", 2)[0] == 30
    # except_last: micro-batch 0 checkpointed (4), micro-batch 1 not (30); B(1,1): 34 - 20 + 30
    assert activation_peaks(order, stages, "except_last", 2)[0] == 44


def test_merged_output_and_loss_are_counted_once() -> None:
    stages = [acts((10, 0), (15, 12)), acts((20, 4), (30, 26), outputs=5)]
    order = {0: single_process_order(2, 2)}
    # forward leaves 60 + the merged output 10; the loss: + LOSS_COPIES * 10; then its gradient (10)
    # stays while B(1,1) runs: 70 + 10 - 20 + 30 - 5 (the task's own share is in its peak)
    expected = max(70 + LOSS_COPIES * 10, 70 + 10 - 20 + 30 - 5)
    assert activation_peaks(order, stages, "never", 2, merged_output=True)[0] == expected


def test_one_backward_sums_each_stages_weight_gradients_until_its_last_micro_batch_by_hand() -> None:
    """fxpipe.pipeline's one backward over both micro-batches: a parameter's accumulation node
    sums what the micro-batches send in a buffer of the parameters' size (stage 0: 7, stage 1:
    9), from the stage's first backward to its last. Order: B11 B10 B01 B00."""
    stages = [acts((0, 0), (15, 15)), acts((0, 0), (30, 30))]
    order = {0: single_process_order(2, 2)}
    assert activation_peaks(order, stages, "never", 2)[0] == 30
    # B10 runs with B11's sum (9) kept; B01 with stage 1's sum gone into .grad
    assert activation_peaks(order, stages, "never", 2, grad_buffers=[7, 9])[0] == 30 + 9
    tall = [acts((0, 0), (35, 35)), acts((0, 0), (30, 30))]  # stage 0's second backward: + its own sum
    assert activation_peaks(order, tall, "never", 2, grad_buffers=[7, 9])[0] == 35 + 7
    # one micro-batch: the sum is the backward's own temporary, already in its peak
    one = {0: single_process_order(2, 1)}
    assert activation_peaks(one, stages, "never", 1, grad_buffers=[7, 9])[0] == 30


def test_weight_pass_keeps_its_share() -> None:
    from fxpipe.tuning._orders import Action

    st = [StageActivations((100, 10), (150, 60), 0, 30, 0, 0)]
    order = {0: [Action("F", 0, 0), Action("F", 0, 1), Action("I", 0, 0), Action("I", 0, 1),
                 Action("W", 0, 0), Action("W", 0, 1)]}
    # after both I: 2 * 30 held; peaks: I(0,0) 200 - 100 + 150 = 250
    assert activation_peaks(order, st, "never", 2)[0] == 250


def test_static_bytes_by_hand() -> None:
    # params + grads + Adam's two moments = 4 copies; stages 0 and 1 share device 'a'
    assert static_bytes([100, 50, 10], ["a", "a", "b"], "adam") == {"a": 600, "b": 40}
    assert static_bytes([100], ["a"], "sgd") == {"a": 200}
    # receive buffers: chunks x one micro-batch's (activations in + gradients of the outputs)
    assert static_bytes([0, 0], [0, 1], "sgd", receive=[8, 8], chunks=4) == {0: 32, 1: 32}
    # frozen parameters and buffers (100 held, 30 trained): no gradient, no optimizer state
    assert static_bytes([100], ["a"], "adam", trained=[30]) == {"a": 100 + 3 * 30}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.relu(self.a(x)))))


def test_recorder_matches_autograds_saved_tensors() -> None:
    """The saved bytes the recorder sees, summed over stages of one pool, are the distinct
    storages eager's forward saves (parameters and the input left out)."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(6, 16)
    with preserved(model):
        checked = capture_and_check(model, (x,), {}, BuildOptions(2, balance_by="params"))
        gm = checked.capture.graph_module
        rec = record_nodes(gm, checked.capture.flatten_inputs((x,), {}))
    names = [r.name for r in rec.nodes]
    assignment = {n: (0 if i < len(names) // 2 else 1) for i, n in enumerate(names)}
    total = sum(s.held[0] for s in stage_activations(rec, assignment, 2, pool=[0, 0]))
    external = {p.untyped_storage().data_ptr() for p in model.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in external:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    assert total == sum(seen.values()) > 0
    assert sum(rec.outputs.values()) == out.numel() * 4


def test_torch_stages_keep_outputs_and_the_retained_graph_by_hand() -> None:
    """fxpipe.distributed's walk: a PipelineStage keeps its outputs until the backward (the
    last stage's to the end), a zero-bubble I keeps the graph, its outputs and the gradients
    that came until W, and the first stage's whole backward runs in W."""
    from fxpipe.tuning._orders import Action

    first = StageActivations((10, 2), (15, 12), 0, 0, 0, 0, sent=(3, 3), grads_in=4)
    last = StageActivations((20, 4), (30, 26), 0, 0, 0, 5, sent=(5, 5), grads_in=7)
    stages = [first, last]
    one_f_one_b = {0: [Action("F", 0, 0), Action("F", 0, 1), Action("B", 0, 0), Action("B", 0, 1)]}
    # F, F: 2 x (10 + 3) held; B(0,0): 26 - 13 + 15 + 3
    assert activation_peaks(one_f_one_b, stages, "never", 2, torch_stages=True)[0] == 31
    # checkpointed: 2 x (2 + 3); B(0,0): 10 - 5 + 12 + 3
    assert activation_peaks(one_f_one_b, stages, "always", 2, torch_stages=True)[0] == 20
    zero_bubble = {0: [Action("F", 0, 0), Action("I", 0, 0), Action("W", 0, 0)],
                   1: [Action("F", 1, 0), Action("I", 1, 0), Action("W", 1, 0), Action("F", 1, 1)]}
    peaks = activation_peaks(zero_bubble, stages, "never", 2, torch_stages=True)
    # stage 0: I keeps 13 + 4; W runs the whole backward: 17 - 17 + 15 + 3
    assert peaks[0] == 18
    # stage 1: I at 25 - 25 + 30 + 5 = 35, keeps 20 + 5 + 7 = 32 until W, which leaves the
    # output (5, the last stage's stays); F(1,1): 5 + 25
    assert peaks[1] == 35


def test_boundaries_of_the_carried_graph_by_hand() -> None:
    """A value made on stage 0 and read on stage 2 crosses both boundaries (carried through
    stage 1); its gradient goes back over both."""
    rec = Recording([
        NodeRecord("a", makes={10: 100}, grad_out={10: 100}),
        NodeRecord("b", makes={11: 30}, reads={10: 100}, grad_in={10: 100}, grad_out={11: 30}),
        NodeRecord("c", makes={12: 20}, reads={11: 30, 10: 100}, grad_in={11: 30, 10: 100}, grad_out={12: 20}),
    ], outputs={12: 20}, external={1})
    s0, s1, s2 = stage_activations(rec, {"a": 0, "b": 1, "c": 2}, 3)
    assert (s0.boundary_out, s0.boundary_carried, s0.boundary_grads) == (100, 0, 0)
    # 11 made here, 10 carried on; gradients back: 10's
    assert (s1.boundary_out, s1.boundary_carried, s1.boundary_grads) == (130, 100, 100)
    assert (s2.boundary_out, s2.boundary_carried, s2.boundary_grads) == (0, 0, 130)
    assert s1.sent == (30, 30)  # what it makes: the carried view is the received buffer's storage


def test_sends_carry_a_skip_through_the_stage_between_by_hand() -> None:
    """10 is made on stage 0 and read on stage 2 only. The simulator's sends:
    fxpipe.distributed carries it through stage 1, forward and its gradient back;
    fxpipe.pipeline's portals send it once, to stage 2."""
    rec = Recording([
        NodeRecord("a", makes={10: 100}, grad_out={10: 100}),
        NodeRecord("b", makes={11: 30}, reads={1: 8}, grad_out={11: 30}),
        NodeRecord("c", makes={12: 20}, reads={11: 30, 10: 100}, grad_in={11: 30, 10: 100}, grad_out={12: 20}),
    ], outputs={12: 20}, external={1})
    stages = stage_activations(rec, {"a": 0, "b": 1, "c": 2}, 3)
    assert [s.boundary_grads_passed for s in stages] == [0, 100, 0]  # stage 1 carries 10 unread
    assert [s.boundary_grads_kept for s in stages] == [0, 0, 130]
    assert [send_bytes(Action("F", s, 0), stages, carried=True) for s in (1, 2)] == [100, 130]
    assert [send_bytes(Action("B", s, 0), stages, carried=True) for s in (0, 1)] == [100, 130]
    assert [send_bytes(Action("F", s, 0), stages, carried=False) for s in (1, 2)] == [0, 130]


def test_receive_buffers_are_sized_from_the_carried_boundaries_by_hand() -> None:
    """torch's PipelineStage allocates, per micro-batch, a buffer for every input of a stage
    and a gradient buffer for every output that gets one. A skip (10: made on stage 0, read on
    stage 2) is an input and an output of stage 1 too, which never reads it; a mask (14, no
    gradient) crosses both boundaries with an activation buffer and no gradient buffer."""
    rec = Recording([
        NodeRecord("a", makes={10: 100, 14: 8}, grad_out={10: 100}),
        NodeRecord("b", makes={11: 40}, reads={10: 100}, grad_in={10: 100}, grad_out={11: 40}),
        NodeRecord("c", makes={12: 30}, reads={11: 40}, grad_in={11: 40}, grad_out={12: 30}),
        NodeRecord("d", makes={13: 20}, reads={12: 30, 10: 100, 14: 8}, grad_in={12: 30, 10: 100},
                   grad_out={13: 20}),
    ], outputs={13: 20}, external={1})
    stages = stage_activations(rec, {"a": 0, "b": 0, "c": 1, "d": 2}, 3)
    # crossing 0 -> 1: 11 (40), 10 (100), 14 (8); gradients 11's and 10's
    # crossing 1 -> 2: 12 (30), 10 (100, carried), 14 (8, carried); gradients 12's and 10's
    assert [s.boundary_out for s in stages] == [148, 138, 0]
    assert [s.boundary_grads for s in stages] == [0, 140, 130]
    # stage 0: gradient buffers 140; stage 1: inputs 148 + gradients 130; stage 2: inputs 138
    assert receive_buffers(stages) == [140, 278, 138]
    # uncarried, stage 1 would receive only 11 (40) and get gradients for 12 (30)
    assert stages[1].received == 40
    # 2 micro-batches, stages 0 and 2 on device 0: parameters + gradients, and the buffers
    assert static_bytes([10, 20, 30], [0, 1, 0], "sgd", receive=receive_buffers(stages), chunks=2) == {
        0: 2 * 10 + 2 * 30 + 2 * (140 + 138), 1: 2 * 20 + 2 * 278}


def test_held_sends_stay_to_the_end_of_the_step_by_hand() -> None:
    """torch's _PipelineScheduleRuntime waits its sends after the last action: the outputs
    sent to another rank (made by the stage, not carried) and the input gradients sent back
    stay until the step ends."""
    from fxpipe.tuning._orders import Action

    first = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, sent=(3, 3), boundary_out=5, boundary_carried=1)
    last = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, boundary_grads=4)
    stages = [first, last]
    orders = {0: [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)],
              1: [Action("F", 1, 0), Action("B", 1, 0), Action("F", 1, 1), Action("B", 1, 1)]}
    plain = activation_peaks(orders, stages, "never", 2, torch_stages=TorchRun([0, 1]))
    # F: 10 + 3; B: 15 + 3 = 18, frees all; the same again
    assert plain == {0: 18, 1: 15}
    held = activation_peaks(orders, stages, "never", 2, torch_stages=TorchRun([0, 1], held_sends=True))
    # rank 0: B(0,0) leaves the 5 - 1 bytes it made and sent; B(0,1): 4 + 13 - 13 + 18 = 22
    # rank 1: B(1,0) leaves the 4 bytes of gradient it sent; B(1,1): 4 + 15 = 19
    assert held == {0: 22, 1: 19}
    # 3 of those 4 bytes are the gradient of a value stage 1 only carries: passed on in the
    # buffer it arrived in, nothing kept for it (B(1,1): 1 + 15 = 16); zero bubble keeps what
    # boundary_grads_kept says (the .grad storages and the copies sent): 2 here, 17
    passing = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, boundary_grads=4, boundary_grads_passed=3,
                               boundary_grads_kept=2)
    runs = [TorchRun([0, 1], held_sends=True), TorchRun([0, 1], held_sends=True, split=True)]
    assert [activation_peaks(orders, [first, passing], "never", 2, torch_stages=r)[1] for r in runs] == [16, 17]


def test_zero_bubble_clones_local_turn_and_kept_input_gradients_by_hand() -> None:
    """A V rank (stages 1 and 2 of 4): stage 1 hands its output to stage 2 on the same rank
    (it replaces last step's in the receive buffer: nothing more), stage 2 sends clones of
    everything crossing (carried too) to stage 3 on the other rank, kept to the step's end,
    and stage 1's input gradients stay in its receive buffer's .grad."""
    from fxpipe.tuning._orders import Action

    s0 = StageActivations((1, 0), (1, 0), 0, 0, 0, 0)
    s1 = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, sent=(3, 3), grads_in=2, boundary_out=6,
                          boundary_carried=1, boundary_grads=4, boundary_grads_kept=4)
    s2 = StageActivations((20, 0), (30, 0), 0, 0, 0, 0, sent=(5, 5), grads_in=7, boundary_out=8,
                          boundary_carried=2, boundary_grads=9, boundary_grads_kept=9, weight_grads=3)
    s3 = StageActivations((1, 0), (1, 0), 0, 0, 0, 0)
    one = [Action("F", 1, 0), Action("F", 2, 0), Action("I", 2, 0), Action("W", 2, 0), Action("I", 1, 0),
           Action("W", 1, 0)]
    two = [Action(a.kind, a.stage, 1) for a in one[:3]]
    orders = {1: one + two}
    stages = [s0, s1, s2, s3]
    run = torch_run("zbv", [0, 1, 1, 0])
    assert run == TorchRun([0, 1, 1, 0], held_sends=True, split=True)
    # F1: 10 (its output is the buffer's); F2: + 20 + 8 clones = 38; I2 ends holding its retained
    # graph, clones, the arrived and the weight nodes' gradients (20 + 8 + 7 + 3 = 38) and the
    # input gradients it made (9): 38 - 28 + 38 + 9 = 57; W2 leaves the 8 sent; I1: keeps 10 + 2
    # and the 4 input-gradient bytes; W1 leaves those 4: 12 held. Micro-batch 1: F1 22, F2 50,
    # I2: 50 - 28 + 38 + 9 = 69
    assert activation_peaks(orders, stages, "never", 2, torch_stages=run)[1] == 69
    # stage 2 hands its input gradients to stage 1 on the rank: their copies take the place of
    # last step's, but gradient storages of its own (a concatenation's) stay in .grad: + 5
    owning = [s0, s1, dataclasses.replace(s2, boundary_grads_storage=5), s3]
    assert activation_peaks(orders, owning, "never", 2, torch_stages=run)[1] == 74
    # as 1F1B's single-stage schedules would keep them: the outputs until the backward only
    # (F2: 13 + 25 = 38; I2: 38 - 25 + 35 + 9 = 57; W2 frees all of stage 2's)
    assert activation_peaks(orders, stages, "never", 2, torch_stages=True)[1] == 57


def test_gradients_sent_back_wait_for_their_stage_by_hand() -> None:
    """A backward's gradients for what an earlier stage of the device sent it stay until that
    stage's backward of the micro-batch (whose peak counts them as incoming)."""
    first = StageActivations((10, 0), (15, 12), 0, 0, 0, 0)
    middle = StageActivations((4, 0), (6, 6), 0, 0, 0, 0)
    last = StageActivations((20, 0), (30, 26), 0, 0, 0, 0, grads_back=((0, 7),))  # a skip to stage 0
    order = {0: single_process_order(3, 2)}
    # F: 2 x 34 held. Backwards: B(2,1) 68 - 20 + 30 = 78, leaves 48 + 7; B(2,0): 55 - 20 + 30 = 65,
    # leaves 35 + 7 = 42; B(1,1): 42 - 4 + 6 = 44 ... B(0,1): 42 - 7 - 8 ... every later one lower
    assert activation_peaks(order, [first, middle, last], "never", 2)[0] == 78
    # the skip's gradients make the second backward of the last stage the peak when it is larger
    big = StageActivations((20, 0), (30, 26), 0, 0, 0, 0, grads_back=((0, 25),))
    # B(2,1): 78, leaves 48 + 25 = 73; B(2,0): 73 - 20 + 30 = 83
    assert activation_peaks(order, [first, middle, big], "never", 2)[0] == 83
    # without it, the same walk: B(2,0) 48 - 20 + 30 = 58 < 78
    plain = StageActivations((20, 0), (30, 26), 0, 0, 0, 0)
    assert activation_peaks(order, [first, middle, plain], "never", 2)[0] == 78


def test_stage_activations_scratch_and_gradient_views_by_hand() -> None:
    """A node's measured scratch rises above what is alive while it runs (its backward, its
    forward and recomputation); a gradient that keeps a larger storage is sent back as that."""
    rec = hand_recording()
    rec.nodes[2].scratch_backward = 1000   # lin2's backward: at its node, 250 + 20 + 1000
    rec.nodes[2].scratch_forward = 2000    # lin2's forward: relu's output (100) and its own (50) alive
    s0, s1 = stage_activations(rec, {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 0])
    assert s1.peak[0] == 150 + 100 + 20 + 1000
    assert s1.forward == 2000                    # 2150 above the 150 left (saved 100, the output 50)
    # checkpointed: the recomputation with the scratch, 100 received + 100 + 50 + 2000, + 50 incoming
    assert s1.peak[1] == 100 + 100 + 50 + 2000 + 50
    assert s1.grads_back == ((0, 100),)          # relu's gradient for lin1's output (stage 0)
    rec.nodes[1].grad_storage = {10: 300}        # as a slice of a 300-byte gradient
    assert stage_activations(rec, {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 0])[1].grads_back == ((0, 300),)
    # stages on different devices: the gradient is not held on the sender's
    assert stage_activations(rec, {"lin1": 0, "relu": 1, "lin2": 1}, 2, pool=[0, 1])[1].grads_back == ()


class Concat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        return self.b(torch.cat([h, h * 2], dim=1))


def test_recorder_measures_scratch_and_gradient_views() -> None:
    """The recording's backward: a concatenation's input gradients keep its output gradient's
    storage (both slices of it), convolution's backward scratch is measured, and no .grad is written."""
    torch.manual_seed(0)
    model, x = Concat(), torch.randn(64, 16)
    with preserved(model):
        checked = capture_and_check(model, (x,), {}, BuildOptions(1, balance_by="params"))
        rec = record_nodes(checked.capture.graph_module, checked.capture.flatten_inputs((x,), {}))
    cat = next(r for r in rec.nodes if r.name == "cat")
    assert sorted(cat.grad_in.values()) == [64 * 16 * 4] * 2
    assert sorted(cat.grad_storage.values()) == [64 * 32 * 4] * 2
    assert all(p.grad is None for p in model.parameters())
    conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))
    y = torch.randn(4, 3, 32, 32)
    with preserved(conv):
        checked = capture_and_check(conv, (y,), {}, BuildOptions(1, balance_by="params"))
        rec = record_nodes(checked.capture.graph_module, checked.capture.flatten_inputs((y,), {}))
    # the second convolution's backward: at least a gradient-sized buffer of its own (CPU kernels
    # unfold the input), never more than a few times its input
    last = rec.nodes[-1]
    assert 0 < last.scratch_backward
    assert last.scratch_backward <= 16 * 9 * 4 * 8 * 32 * 32 * 4
    assert all(p.grad is None for p in conv.parameters())


def test_one_gradient_storage_for_two_earlier_stages_waits_once_by_hand() -> None:
    """A concatenation on stage 2 of a skip from stage 0 and a value from stage 1, all on one
    device: both input gradients are slices of one 200-byte storage, which waits for stage 0's
    backward (the last to run) and is counted there alone, not once per stage."""
    rec = Recording([
        NodeRecord("a", makes={10: 100}, grad_out={10: 100}),
        NodeRecord("b", makes={11: 100}, reads={10: 100}, grad_in={10: 100}, grad_out={11: 100}),
        NodeRecord("cat", makes={12: 200}, reads={10: 100, 11: 100}, grad_in={10: 100, 11: 100},
                   grad_storage={10: 200, 11: 200}, grad_shared={10: 10, 11: 10}, grad_out={12: 200}),
        NodeRecord("d", makes={13: 8}, reads={12: 200}, saves={12: 200}, grad_in={12: 200}, grad_out={13: 8}),
    ], outputs={13: 8}, external={1})
    assignment = {"a": 0, "b": 1, "cat": 2, "d": 2}
    assert stage_activations(rec, assignment, 3, pool=[0, 0, 0])[2].grads_back == ((0, 200),)
    # stage 1 on a device of its own: the storage still waits, for stage 0, once
    assert stage_activations(rec, assignment, 3, pool=[0, 1, 0])[2].grads_back == ((0, 200),)
    rec.nodes[2].grad_shared = {}  # two storages of their own: each waits for its stage
    assert stage_activations(rec, assignment, 3, pool=[0, 0, 0])[2].grads_back == ((0, 200), (1, 200))


def test_recorder_notes_input_gradients_sharing_one_storage() -> None:
    """A concatenation's input gradients are slices of one storage, an addition hands both
    inputs one gradient: the recording maps each to the first of its group."""
    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, g = self.a(x), self.b(x)
            return torch.cat([h, g], dim=1).sum(1) + (h + g).sum(1)

    torch.manual_seed(0)
    model, x = Both(), torch.randn(8, 16)
    with preserved(model):
        checked = capture_and_check(model, (x,), {}, BuildOptions(1, balance_by="params"))
        rec = record_nodes(checked.capture.graph_module, checked.capture.flatten_inputs((x,), {}))
    by_name = {r.name: r for r in rec.nodes}
    h, g = (next(iter(by_name[n].makes)) for n in ("a", "b"))
    assert by_name["cat"].grad_shared == {h: h, g: h}
    add = next(r for r in rec.nodes if set(r.grad_in) == {h, g} and r.name != "cat")
    assert add.grad_shared == {h: h, g: h}
    assert not by_name["a"].grad_shared


def test_recording_on_meta_measures_nothing() -> None:
    model = Concat().to("meta")
    x = torch.randn(64, 16, device="meta")
    with preserved(model):
        checked = capture_and_check(model, (x,), {}, BuildOptions(1, balance_by="params"))
        rec = record_nodes(checked.capture.graph_module, checked.capture.flatten_inputs((x,), {}))
    assert all(r.scratch_forward == r.scratch_backward == 0 and not r.grad_storage for r in rec.nodes)


def test_received_values_and_arriving_gradients_are_static_for_torch_stages_by_hand() -> None:
    """fxpipe.distributed: what a stage receives (values forward, gradients back) lives in
    torch's receive buffers, allocated before the step: not a micro-batch's activations."""
    rec = hand_recording()
    assignment = {"lin1": 0, "relu": 1, "lin2": 1}
    s0, s1 = stage_activations(rec, assignment, 2, pool=[0, 1])
    t0, t1 = stage_activations(rec, assignment, 2, pool=[0, 1], received_static=True)
    assert (s1.held, t1.held) == ((100, 100), (100, 0))  # checkpointed: lin1's output is the buffer's
    # stage 0's backward: lin1's output gradient arrives in a buffer; its weight temporary remains
    assert (s0.peak[0], t0.peak[0]) == (140, 40) and (s0.grads_in, t0.grads_in) == (100, 0)
    assert t1.grads_in == 50  # the loss's gradient is made on the rank: counted


def test_torch_stages_keep_their_outputs_through_the_backward_by_hand() -> None:
    """torch's PipelineStage holds a micro-batch's outputs (fwd_cache) until its backward has
    run: 10, sent to stage 1 and saved by b, is not freed when b's backward is done. a's
    weight temporary (500) then comes on top of it: 600, not 500."""
    rec = Recording([
        NodeRecord("a", makes={10: 100}, grad_out={10: 100}, grad_params=500),
        NodeRecord("b", makes={11: 10}, reads={10: 100}, saves={10: 100}, grad_in={10: 100}, grad_out={11: 10}),
        NodeRecord("d", makes={12: 5}, reads={10: 100, 11: 10}, grad_in={10: 100, 11: 10}, grad_out={12: 5}),
    ], outputs={12: 5}, external={1})
    s0, _ = stage_activations(rec, {"a": 0, "b": 0, "d": 1}, 2, pool=[0, 1], received_static=True)
    assert s0.held == (100, 0) and s0.peak[0] == 600


def test_shared_recomputation_keeps_every_recomputed_tensor_to_the_backwards_end_by_hand() -> None:
    """fxpipe.distributed recomputes a checkpointed stage once for all its backward passes and
    keeps what it recomputed until the graph is freed (peak_shared); fxpipe.pipeline hands each
    tensor out once (peak[1]). o makes 9 (200, read by p only); p saves its output 11, q its
    output 12, r reads 12 and returns 13."""
    rec = Recording([
        NodeRecord("o", makes={9: 200}, grad_out={9: 200}),
        NodeRecord("p", makes={11: 50}, reads={9: 200}, saves={11: 50}, grad_in={9: 200}, grad_out={11: 50}),
        NodeRecord("q", makes={12: 50}, reads={11: 50}, saves={12: 50}, grad_in={11: 50}, grad_out={12: 50}),
        NodeRecord("r", makes={13: 10}, reads={12: 50}, saves={12: 50}, grad_in={12: 50}, grad_out={13: 10}),
    ], outputs={13: 10}, external={1})
    (st,) = stage_activations(rec, {"o": 0, "p": 0, "q": 0, "r": 0}, 1)
    # backward from 11 + 12 saved and 13's gradient (110): r +50 (160); q +50 (200), frees 12's
    # gradient and 12 (100); p makes 9's gradient: 300 -- or 350 with 12 still kept
    assert (st.peak[1], st.peak_shared) == (300, 350)


def test_schedule_1f1b_keeps_the_warmup_send_and_the_last_gradients_by_hand() -> None:
    """Schedule1F1B's send_work keeps the last warm-up forward's send (micro-batch 0 with two
    warm-up forwards) until its loop ends, and bwd_sends each backward's gradients until the
    next backward has run."""
    from fxpipe.tuning._orders import one_f_one_b

    first = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, boundary_out=5)
    last = StageActivations((10, 0), (15, 0), 0, 0, 0, 0, boundary_grads=4)
    orders = {r: one_f_one_b(r, 2, 3) for r in range(2)}
    assert [str(a) for a in orders[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]
    plain = activation_peaks(orders, [first, last], "never", 3, torch_stages=TorchRun([0, 1]))
    assert plain == {0: 25, 1: 15}
    run = torch_run("1f1b", [0, 1])
    assert run.one_f_one_b and not run.held_sends
    # rank 0: B0 leaves mb 0's 5 sent bytes; B1: 10 (F2) + 5 + 15 = 30, then the loop ends
    # rank 1: B0 leaves its 4 gradient bytes; B1: 4 + 15 = 19, replacing them
    assert activation_peaks(orders, [first, last], "never", 3, torch_stages=run) == {0: 30, 1: 19}


def test_zero_bubble_keeps_whole_storages_of_sliced_input_gradients_by_hand() -> None:
    """A concatenation on stage 1 of two values from stage 0: their gradients are slices of
    the concatenation's gradient. Zero bubble keeps each input's .grad to the step's end (the
    whole 200 bytes, once) and sends each slice as a contiguous copy (100 + 100)."""
    rec = Recording([
        NodeRecord("a", makes={10: 100}, grad_out={10: 100}),
        NodeRecord("b", makes={11: 100}, grad_out={11: 100}),
        NodeRecord("cat", makes={12: 200}, reads={10: 100, 11: 100}, grad_in={10: 100, 11: 100},
                   grad_storage={10: 200, 11: 200}, grad_out={12: 200}),
        NodeRecord("d", makes={13: 8}, reads={12: 200}, saves={12: 200}, grad_in={12: 200}, grad_out={13: 8}),
    ], outputs={13: 8}, external={1})
    s0, s1 = stage_activations(rec, {"a": 0, "b": 0, "cat": 1, "d": 1}, 2)
    assert (s1.boundary_grads, s1.boundary_grads_kept, s1.boundary_grads_storage) == (200, 400, 200)
    assert s0.boundary_grads_kept == 0
    # the concatenation's output sent on to stage 2: its gradient arrives in a receive buffer,
    # the slices are views of that (nothing of the stage's own), only the copies are made
    _, t1, _ = stage_activations(rec, {"a": 0, "b": 0, "cat": 1, "d": 2}, 3)
    assert (t1.boundary_grads_kept, t1.boundary_grads_storage) == (200, 0)


def test_zero_bubble_weight_pass_frees_each_groups_gradients_as_it_goes_by_hand() -> None:
    """torch's stage_backward_weight runs the parameter groups in the parameters' order and
    frees each one's kept gradients after it: lin2's 300 bytes of scratch come once lin1's
    kept output gradient (100) is gone."""
    rec = Recording([
        NodeRecord("lin1", makes={10: 100}, grad_out={10: 100}, grad_params=40),
        NodeRecord("relu", makes={11: 100}, reads={10: 100}, saves={11: 100}, grad_in={10: 100}, grad_out={11: 100}),
        NodeRecord("lin2", makes={12: 50}, reads={11: 100}, saves={11: 100}, grad_in={11: 100}, grad_out={12: 50},
                   grad_params=20, scratch_backward=300),
    ], outputs={12: 50}, external={1})
    (st,) = stage_activations(rec, {"lin1": 0, "relu": 0, "lin2": 0}, 1)
    assert st.weight_grads == 150
    assert st.weight_peak == 300 + 20 - 100
