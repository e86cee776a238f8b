"""``Pipeline.step`` in both orders: eager's loss and every gradient, or a typed refusal.

The 1F1B order (``schedule='1f1b'``) backwards each micro-batch as soon as its forward is
done; GPipe's (the default) after all of them. Either step must give what the eager model
gives on the whole batch: the loss, every ``.grad``, the buffers; and the two orders must
draw the same dropout masks, whatever the checkpoint mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import ArgumentError, InputMismatchError, MicroBatchError, StepError

from exact import assert_all_close, assert_close_scaled, assert_grads_equal
from zoo import MaskedMeanLM, bn_model, dropout_model, gpt_tied, unet

MODES = ("never", "except_last", "always")
SCHEDULES = ("gpipe", "1f1b")


def _build(model, sample, n, **options):
    options.setdefault("devices", ["cpu"] * n)
    options.setdefault("progress", False)
    options.setdefault("balance_by", "params")
    return fxpipe.pipeline(model, sample, n, **options)


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 5))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("n_stages, chunks, batch", [(1, 3, 9), (2, 4, 10), (3, 5, 11), (4, 8, 8)])
def test_step_matches_eager(schedule, checkpoint, n_stages, chunks, batch):
    """Uneven micro-batches too (10 in 4: 3, 3, 3, 1): the mean is weighted by sizes."""
    model = _mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(batch, 8), torch.randint(0, 5, (batch,))
    pipe = _build(model, x, n_stages, chunks=chunks, checkpoint=checkpoint, schedule=schedule)
    with pipe:
        loss = pipe.step(x, loss_fn=F.cross_entropy, target=y)
    want = F.cross_entropy(ref(x), y)
    want.backward()
    assert not loss.requires_grad
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_step_with_portals_and_no_target(schedule, checkpoint):
    model, (x,), _ = unet(batch=6)
    ref = copy.deepcopy(model)
    pipe = _build(model, x, 3, chunks=3, checkpoint=checkpoint, schedule=schedule)
    with pipe:
        assert pipe.plan.portals
        loss = pipe.step(x, loss_fn=lambda out: out.pow(2).mean())
    want = ref(x).pow(2).mean()
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_with_tied_weights(schedule):
    model, (ids,), _ = gpt_tied(batch=4)
    ref = copy.deepcopy(model)
    pipe = _build(model, ids, 3, chunks=4, checkpoint="except_last", schedule=schedule)

    def lm_loss(logits, targets):
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with pipe:
        loss = pipe.step(ids, loss_fn=lm_loss, target=ids)
    want = lm_loss(ref(ids), ids)
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("checkpoint", MODES)
def test_buffers_the_same_in_both_orders(deferred, checkpoint):
    """BatchNorm normalises per micro-batch in a pipeline, so the orders are compared with each
    other: gradients and running statistics (deferred: the whole batch's, as eager's)."""
    results = []
    for schedule in SCHEDULES:
        model, (x,), _ = bn_model(batch=12)
        pipe = _build(model, x, 3, chunks=4, checkpoint=checkpoint, schedule=schedule, deferred_batch_norm=deferred)
        with pipe:
            pipe.step(x, loss_fn=lambda out: out.pow(2).mean())
            pipe.step(x * 2, loss_fn=lambda out: out.pow(2).mean())  # a second step accumulates
        results.append(model)
    a, b = results
    assert_grads_equal(b, a)
    assert_all_close([(name, q, p) for (name, p), (_, q) in zip(a.named_buffers(), b.named_buffers())])
    if deferred:  # the first BatchNorm sees the whole batch's inputs: its statistics are eager's
        ref, (x,), _ = bn_model(batch=12)
        ref(x), ref(x * 2)
        assert_all_close([(name, p, q) for (name, p), (_, q) in zip(a.named_buffers(), ref.named_buffers())
                          if name.startswith("net.1.")])


def test_dropout_masks_the_same_across_orders_and_checkpoint_modes():
    runs = {}
    for schedule in SCHEDULES:
        for checkpoint in MODES:
            model, (x,), _ = dropout_model(batch=12)
            pipe = _build(model, x, 2, chunks=4, checkpoint=checkpoint, schedule=schedule)
            with pipe:
                torch.manual_seed(7)
                loss = pipe.step(x, loss_fn=lambda out: out.pow(2).mean())
            runs[schedule, checkpoint] = (loss, model)
    loss0, model0 = runs["gpipe", "never"]
    for key, (loss, model) in runs.items():
        assert_close_scaled(loss, loss0, what=f"loss of {key}")
        assert_grads_equal(model, model0)
    model, (x,), _ = dropout_model(batch=12)
    eval_loss = model.eval()(x).pow(2).mean()
    assert not torch.allclose(loss0, eval_loss), "dropout drew nothing: the test could not fail"


class CountedLoss(nn.Module):
    """A token mean over labels that are not -100, computed in the model (transformers' way)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 20)

    def forward(self, ids, labels):
        logits = self.head(self.body(self.emb(ids)))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def _tokens(seed, shape=(8, 6)):
    return torch.randint(0, 20, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_model_loss_over_counted_labels(schedule, checkpoint):
    """The model's own loss, weighted per micro-batch by its count of labels, with -100 padding
    in some micro-batches only (and one micro-batch with none counted)."""
    torch.manual_seed(0)
    model = CountedLoss()
    ref = copy.deepcopy(model)
    ids, labels = _tokens(0), _tokens(1)
    pipe = _build(model, (ids, labels), 3, chunks=4, checkpoint=checkpoint, schedule=schedule,
                  output_merge={"loss": "mean"})
    labels = labels.clone()
    labels[0, 3:], labels[1, 1:] = -100, -100
    labels[6:] = -100  # the last micro-batch counts no label
    with pipe:
        loss = pipe.step(ids, labels)
    want = ref(ids, labels)["loss"]
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


def test_loss_fn_sum_normalised_by_the_whole_batch():
    """A sum divided by the whole batch's count, and the plain token mean over labels holding
    -100: both read from loss_fn and exact (the mean is weighed by each micro-batch's count)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 20))
    ref = copy.deepcopy(model)
    ids, labels = _tokens(0), _tokens(1)
    labels[0, 2:], labels[5, :] = -100, -100
    count = (labels != -100).sum()

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / count

    want = F.cross_entropy(ref(ids).flatten(0, 1), labels.flatten(), ignore_index=-100)
    want.backward()
    pipe = _build(model, ids, 2, chunks=4, schedule="1f1b")
    with pipe:
        for fn, reduction in ((loss_fn, "sum"), (loss_fn, None),
                              (lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()), None)):
            model.zero_grad()
            loss = pipe.step(ids, loss_fn=fn, target=labels, loss_reduction=reduction)
            assert_close_scaled(loss, want.detach(), what="loss")
            assert_grads_equal(model, ref)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_transformers_labels_loss_and_model_output(schedule):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, use_cache=False,
                                     attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 50, (4, 8), generator=torch.Generator().manual_seed(0))
    pipe = _build(model, (), 2, sample_kwargs={"input_ids": ids, "labels": ids}, chunks=4, schedule=schedule,
                  output_merge={"loss": "mean"})
    labels = ids.clone()
    labels[0, 4:], labels[3, 2:] = -100, -100
    seen = []
    with pipe:
        loss = pipe.step(input_ids=ids, labels=labels)  # the model's labels= loss, -100 labels weighed
        want = ref(input_ids=ids, labels=labels).loss
        want.backward()
        assert_close_scaled(loss, want.detach(), what="loss")
        assert_grads_equal(model, ref)
        model.zero_grad(), ref.zero_grad()
        # a loss_fn gets each micro-batch's ModelOutput
        other = pipe.step(input_ids=ids, labels=ids,
                          loss_fn=lambda out: seen.append(type(out).__name__) or out.logits.float().pow(2).mean())
    want_other = ref(input_ids=ids, labels=ids).logits.float().pow(2).mean()
    want_other.backward()
    assert_close_scaled(other, want_other.detach(), what="loss_fn loss")
    assert_grads_equal(model, ref)
    assert set(seen) == {"CausalLMOutputWithCrossAttentions"}


@pytest.mark.parametrize("checkpoint", MODES)
def test_gpipe_step_is_pipe_then_backward(checkpoint):
    model = _mlp()
    other = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randint(0, 5, (10,))
    with _build(model, x, 3, chunks=4, checkpoint=checkpoint) as pipe, \
            _build(other, x, 3, chunks=4, checkpoint=checkpoint) as by_hand:
        loss = pipe.step(x, loss_fn=F.cross_entropy, target=y)
        want = F.cross_entropy(by_hand(x), y)
        want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, other)


# -- refusals ------------------------------------------------------------------------------

def test_one_f_one_b_refuses_forward_with_gradients_in_training():
    model = _mlp()
    x = torch.randn(8, 8)
    with _build(model, x, 2, chunks=4, schedule="1f1b") as pipe:
        with pytest.raises(StepError, match=r"pipe\.step"):
            pipe(x)
        with torch.no_grad():
            torch.testing.assert_close(pipe(x), model(x))
        model.eval()
        torch.testing.assert_close(pipe(x), model(x))  # eval mode: outputs, exact


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("hook", ["forward_pre", "forward"])
def test_step_refuses_hooks_on_the_pipeline(schedule, hook):
    # a trial: hooks on the pipeline (where a root hook belongs) ran for pipe(x) and were silently
    # skipped by step(): the loss 1.345 against 1.329, gradients 0.12 off
    model = _mlp()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    with _build(model, x, 2, chunks=4, schedule=schedule) as pipe:
        handle = getattr(pipe, f"register_{hook}_hook")(lambda *a: None)
        with pytest.raises(StepError, match="hooks"):
            pipe.step(x, loss_fn=F.cross_entropy, target=y)
        assert all(p.grad is None for p in model.parameters())
        handle.remove()
        pipe.step(x, loss_fn=F.cross_entropy, target=y)


def test_step_refusals():
    model = _mlp()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    with pytest.raises(ArgumentError, match="schedule must be one of"):
        _build(model, x, 2, schedule="interleaved")
    with _build(model, x, 2, chunks=4, schedule="1f1b") as pipe:
        with torch.no_grad(), pytest.raises(StepError, match="gradients are disabled"):
            pipe.step(x, loss_fn=F.cross_entropy, target=y)
        with pytest.raises(StepError, match="no output"):
            pipe.step(x)
        with pytest.raises(StepError, match="0-dim floating"):
            pipe.step(x, loss_fn=lambda out: out)
        with pytest.raises(ArgumentError, match="8 samples along dim 0 but the batch has 8|has 4 samples"):
            pipe.step(x, loss_fn=F.cross_entropy, target=y[:4])
        with pytest.raises(ArgumentError, match="loss_reduction"):
            pipe.step(x, loss_fn=F.cross_entropy, target=y, loss_reduction="none")
        with pytest.raises(ArgumentError, match="without loss_fn"):
            pipe.step(x, target=y)
        assert all(p.grad is None for p in model.parameters())


class TakesTarget(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, target=None):
        out = self.lin(x)
        return out if target is None else F.mse_loss(out, target)


def test_a_step_keyword_the_model_also_takes_is_refused():
    torch.manual_seed(0)
    model = TakesTarget()
    x, t = torch.randn(4, 4), torch.randn(4, 4)
    with _build(model, (x, t), 1, chunks=2, schedule="1f1b", output_merge="mean") as pipe:
        with pytest.raises(ArgumentError, match="pass the model's argument positionally"):
            pipe.step(x, target=t)
        ref = copy.deepcopy(model)
        loss = pipe.step(x, t)  # positionally: the model's own loss
        ref(x, t).backward()
        assert_grads_equal(model, ref)
        assert loss.shape == ()
    with pytest.raises(InputMismatchError):
        with _build(model, (x, t), 1, chunks=2, output_merge="mean") as pipe:
            pipe.step(x)  # the model's loss needs the target: flatten_inputs names it


@pytest.mark.parametrize("before", ["none", "accumulated"])
def test_a_failing_one_f_one_b_step_leaves_no_partial_gradient_it_can_avoid(before):
    """Eager fails before any backward; 1F1B had run two micro-batches' backward. Where every
    .grad was None before the step (zero_grad's default) they are None again, so a loop that
    skips the bad batch trains as eager does (a trial: 2.8e-2 off); an accumulation in
    progress cannot be put back, and the note says so."""
    model = _mlp()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    calls = []

    def loss_fn(out, target):
        if isinstance(out, torch._subclasses.FakeTensor):  # fxpipe reading the loss (no data)
            return F.cross_entropy(out, target)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("boom in the loss")
        return F.cross_entropy(out, target)

    if before == "accumulated":
        F.cross_entropy(model(x), y).backward()
    kept = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    with _build(model, x, 2, chunks=4, schedule="1f1b") as pipe:
        with pytest.raises(RuntimeError, match="boom") as info:
            pipe.step(x, loss_fn=loss_fn, target=y)
    notes = " ".join(info.value.__notes__)
    assert "2 of 4 micro-batches had run their backward" in notes
    if before == "none":
        assert "dropped" in notes and all(p.grad is None for p in model.parameters())
    else:
        assert "holds part of its gradients" in notes
        assert any(not torch.equal(p.grad, k) for p, k in zip(model.parameters(), kept))  # what the note says


@pytest.mark.cuda
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", MODES)
def test_step_on_one_gpu(schedule, checkpoint):
    """Stages on cuda:0 run on worker threads with copy streams; backward per micro-batch in 1F1B."""
    model, (x,), _ = unet(batch=8)
    model, x = model.cuda(), x.cuda()
    ref = copy.deepcopy(model)
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        pipe = _build(model, x, 3, chunks=4, checkpoint=checkpoint, schedule=schedule, devices=["cuda:0"] * 3)
        with pipe:
            loss = pipe.step(x, loss_fn=lambda out: out.pow(2).mean())
        want = ref(x).pow(2).mean()
        want.backward()
        torch.cuda.synchronize()
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    assert_close_scaled(loss, want.detach(), what="loss", rtol=1e-3, atol=5e-5)
    assert_grads_equal(model, ref, rtol=1e-3, atol=5e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_returns_the_outputs_when_asked(schedule):
    """return_outputs=True: the merged outputs, detached, as pipe(x) gives them; a callable:
    its result per micro-batch (an accuracy count), without keeping the logits."""
    model = _mlp()
    ref = copy.deepcopy(model)
    x, y = torch.randn(10, 8), torch.randint(0, 5, (10,))
    with _build(model, x, 2, chunks=4, schedule=schedule) as pipe:
        loss, out = pipe.step(x, loss_fn=F.cross_entropy, target=y, return_outputs=True)
        assert not out.requires_grad
        assert_close_scaled(out, ref(x).detach(), what="outputs")
        model.zero_grad()
        ref.zero_grad()
        loss, correct = pipe.step(x, loss_fn=F.cross_entropy, target=y,
                                  return_outputs=lambda out: out.argmax(-1))
        assert torch.equal(torch.cat(correct), ref(x).argmax(-1))
        with pytest.raises(ArgumentError, match="return_outputs must be"):
            pipe.step(x, loss_fn=F.cross_entropy, target=y, return_outputs="yes")
    want = F.cross_entropy(ref(x), y)
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)


def _own_loss_step(model, ref, how, sample, batch):
    """The model's own loss (a dict's 'loss') on ``batch`` through a pipeline built from
    ``sample``, run ``how``: ``pipe.step`` under 'gpipe' or '1f1b', or a call and ``backward()``;
    eager's on ``ref`` beside it, backward run too. Returns (pipeline's loss, eager's)."""
    pipe = fxpipe.pipeline(model, sample, 2, chunks=2, devices=["cpu"] * 2, progress=False,
                           output_merge={"loss": "mean", "logits": 0}, **({} if how == "call" else {"schedule": how}))
    if how == "call":
        got = pipe(*batch)["loss"]
        got.backward()
    else:
        got = pipe.step(*batch)
    want = ref(*batch)["loss"]
    want.backward()
    return got, want


@pytest.mark.parametrize("how", ["gpipe", "1f1b", "call"])
def test_a_micro_batch_counting_nothing_gives_no_nan_gradient(how):
    """Micro-batch 1 of 2 is all masked out (a mean over what it counts, counting nothing): its
    loss is 0 / 0, and a zero gradient through that division was nan in every parameter. Its
    backward is not run; eager's whole-batch gradients."""
    torch.manual_seed(0)
    model = MaskedMeanLM()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 20, (4, 5))
    mask = torch.ones(4, 5)
    mask[2:] = 0  # the second micro-batch counts nothing
    got, want = _own_loss_step(model, ref, how, (ids, mask), (ids, mask))
    assert_close_scaled(got.detach(), want.detach(), what="loss")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p.grad).all(), name
        assert_close_scaled(p.grad, q.grad, what=f"grad of {name}")


@pytest.mark.parametrize("how", ["gpipe", "1f1b", "call"])
@pytest.mark.parametrize("loss", ["cross entropy", "masked mean"])
def test_a_batch_counting_nothing_backpropagates_as_eager(how, loss):
    """Every label -100 (or every mask 0): eager's loss is 0 / 0 and still backpropagates, zeros
    through a cross entropy (nan through a masked mean). The pipeline gave None gradients,
    and AdamW's momentum and weight decay then moved eager's weights alone (a trial)."""
    torch.manual_seed(0)
    model = CountedLoss() if loss == "cross entropy" else MaskedMeanLM()
    ref = copy.deepcopy(model)
    ids = _tokens(0, (4, 5))
    counted = _tokens(1, (4, 5)) if loss == "cross entropy" else torch.ones(4, 5)
    nothing = torch.full_like(counted, -100) if loss == "cross entropy" else torch.zeros(4, 5)
    got, want = _own_loss_step(model, ref, how, (ids, counted), (ids, nothing))
    assert got.isnan() and want.isnan()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, equal_nan=True, msg=f"grad of {name}")


def test_a_sample_counting_nothing_is_refused_at_the_build():
    """Its loss is 0 / 0 and every gradient nan: the checks met a nan tolerance and the build
    failed with torch's bare 'atol must be greater than or equal to zero' (a review)."""
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 20, (4, 5)), torch.zeros(4, 5)
    with pytest.raises(MicroBatchError, match=r"gradient of output 0 is not finite .*counts nothing.*finite"):
        fxpipe.pipeline(MaskedMeanLM(), (ids, mask), 2, chunks=2, devices=["cpu"] * 2, progress=False,
                        output_merge={"loss": "mean", "logits": 0})


def test_checkpoint_and_schedule_set_after_the_build_are_checked():
    # a trial: pipe.checkpoint = 'bogus' was a bare KeyError at the next call, 'zbv' taken silently
    model = _mlp()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    with _build(model, x, 2, chunks=4) as pipe:
        with pytest.raises(ArgumentError, match="checkpoint must be one of"):
            pipe.checkpoint = "bogus"
        with pytest.raises(ArgumentError, match="schedule must be one of"):
            pipe.schedule = "zbv"
        assert (pipe.checkpoint, pipe.schedule) == ("except_last", "gpipe")
        pipe.checkpoint, pipe.schedule = "never", "1f1b"
        pipe.step(x, loss_fn=F.cross_entropy, target=y)


def _written_target(out, y):
    y.add_(1)  # not idempotent: a piece written twice, or not at all, would show
    m = y > 0.5  # a count read from the written target
    return ((out - y) * y * m).sum() / m.sum()  # y saved for the backward


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_loss_fn_writing_its_target_in_place(schedule):
    """The micro-batch targets are views of the caller's and share its version counter: a write
    into one made GPipe's backward fail in autograd. loss_fn gets copies, and the caller's
    target gets the writes after the step, as after eager's one call."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 3)
    pipe = _build(model, x, 2, chunks=4, schedule=schedule)
    for _ in range(2):
        target, target_eager = y.clone(), y.clone()
        model.zero_grad()
        ref.zero_grad()
        loss = pipe.step(x, loss_fn=_written_target, target=target)
        want = _written_target(ref(x), target_eager)
        want.backward()
        assert_close_scaled(loss, want.detach(), what="loss")
        assert_grads_equal(model, ref)
        assert torch.equal(target, target_eager)
    pipe.close()
