"""Losses that count the data, in a distributed step: read from ``loss_fn``, not trusted.

torch's schedules backward each micro-batch's loss on its own, so each is scaled by its
weight in the whole batch's loss (:mod:`fxpipe.distributed._loss`): -100 labels in unequal
numbers per micro-batch, counted after the loss's own causal shift over left padding, a sum,
a pad id that is not -100 are all eager's; an in-batch-negatives loss is refused before
anything is sent, and the pipeline still runs. World size 1, in this process (two stages on
the rank, zero-bubble V: the loss runs on the rank that also holds stage 0).
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zoo
from dist_models import _gpt_loss
from exact import assert_close_scaled, largest
from fxpipe.distributed._launch import free_port
from fxpipe.errors import StepError


def _shifted(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, :-1].flatten(0, 1), y[:, 1:].flatten())


def _summed(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")


def _pad_id(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=0)


def _negatives(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    emb = out.mean(1)
    return F.cross_entropy(emb @ emb.T, torch.arange(emb.size(0)))


def _assert_exact(loss: torch.Tensor, want: torch.Tensor, model: torch.nn.Module, eager: torch.nn.Module) -> None:
    """The step's loss against eager's ``want`` (backwarded here), and every gradient."""
    want.backward()
    assert_close_scaled(loss, want.detach(), None, what="loss")
    top = max(largest(p.grad) for p in eager.parameters())
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_close_scaled(p.grad, q.grad, None, what=f"grad {n}", floor_of=top)


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _labels() -> torch.Tensor:
    y = torch.randint(1, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    for row, pad in enumerate([9, 0, 3, 1]):  # left padding: micro-batch 0 counts far fewer labels
        y[row, :pad] = -100
    return y


@pytest.mark.parametrize("loss_fn", [_gpt_loss, _shifted, _summed, _pad_id])
def test_counted_losses_are_exact(one_rank, loss_fn) -> None:
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = zoo.TinyGPT()
    eager.load_state_dict(model.state_dict())
    y = _labels() if loss_fn is not _pad_id else _labels().clamp(min=0)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, schedule="zbv", stages_per_rank=2, timeout=60)
    for _ in range(2):  # the reading is cached; the weights are this step's
        model.zero_grad()
        eager.zero_grad()
        loss = pipe.step(x, target=y)
        want = loss_fn(eager(x), y)
        _assert_exact(loss, want, model, eager)
        y = y.roll(1, 0)
    pipe.close()


def test_a_loss_that_mixes_the_samples_is_refused_before_anything_is_sent(one_rank) -> None:
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    y = _labels()
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=_negatives, schedule="1f1b", timeout=60)
    with pytest.raises(StepError, match=r"mm at .*test_distributed_labels.py:\d+ in _negatives.*mixes the samples"):
        pipe.step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    pipe.close()


def test_the_models_own_labels_loss_is_weighed_as_in_one_process(one_rank) -> None:
    """transformers' labels= loss with loss_fn=None: its counted labels (after the shift, left
    padding) weigh each micro-batch, as fxpipe.pipeline merges it; exact over two steps."""
    import copy

    T = pytest.importorskip("transformers")
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = T.GPT2LMHeadModel(config)
    eager = copy.deepcopy(model)
    ids = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    labels = _labels()
    pipe = fpd.pipeline(model, (), sample_kwargs={"input_ids": ids, "labels": labels}, chunks=2, loss_fn=None,
                        schedule="zbv", stages_per_rank=2, timeout=60)
    for _ in range(2):
        model.zero_grad()
        eager.zero_grad()
        _assert_exact(pipe.step(input_ids=ids, labels=labels), eager(input_ids=ids, labels=labels).loss, model, eager)
        labels = labels.roll(1, 0)
    # the step's kept outputs merge the loss as it counts too (their 'loss' was the plain mean of the micro-batches')
    loss, out = pipe.step(input_ids=ids, labels=labels, return_outputs=True)
    assert_close_scaled(out.loss, loss, what="step(return_outputs=True)'s merged loss")
    with pytest.raises(Exception, match="target= is given"):
        pipe.step(input_ids=ids, labels=labels, target=labels)
    # validation: the model's own loss merged as it counts (torch's merge failed on the 0-dim loss)
    loss, out = pipe.eval_step(input_ids=ids, labels=labels, return_outputs=True)  # the loss on every rank
    assert torch.equal(loss, out.loss)
    with torch.no_grad():
        want = eager(input_ids=ids, labels=labels)
    assert_close_scaled(out.loss, want.loss, what="eval loss")
    assert_close_scaled(out.logits, want.logits, what="eval logits")
    pipe.close()


def test_loss_fn_none_without_a_loss_output_is_refused(one_rank) -> None:
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    with pytest.raises(StepError, match="returns no output named 'loss'"):
        fpd.pipeline(model, x, chunks=2, timeout=60)


def test_a_structured_target(one_rank) -> None:
    """{'labels': ..., 'mask': ...}: split like the batch by fxpipe, weighed by the mask's sum."""
    import fxpipe.distributed as fpd

    def masked(out: torch.Tensor, target: dict) -> torch.Tensor:
        per_token = F.cross_entropy(out.flatten(0, 1), target["labels"].flatten(), reduction="none")
        return (per_token * target["mask"].flatten()).sum() / target["mask"].sum()

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = zoo.TinyGPT()
    eager.load_state_dict(model.state_dict())
    y = _labels().clamp(min=0)
    target = {"labels": y, "mask": (_labels() != -100).float()}
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=masked, schedule="zbv", stages_per_rank=2, timeout=60)
    _assert_exact(pipe.step(x, target=target), masked(eager(x), target), model, eager)
    pipe.close()


def test_step_returns_the_outputs_on_the_last_stages_rank(one_rank) -> None:
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = zoo.TinyGPT()
    eager.load_state_dict(model.state_dict())
    y = _labels()
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=_gpt_loss, schedule="zbv", stages_per_rank=2, timeout=60)
    loss, out = pipe.step(x, target=y, return_outputs=True)
    want = eager(x)
    assert_close_scaled(out, want.detach(), None, what="outputs")
    assert_close_scaled(loss, _gpt_loss(want, y).detach(), None, what="loss")
    _, preds = pipe.step(x, target=y, return_outputs=lambda o: o.argmax(-1))
    assert len(preds) == 2 and preds[0].shape == (2, 16)
    # validation: the loss of the whole batch's outputs (ignored labels and all), as step() gives it
    with torch.no_grad():
        want = eager(x)
    assert_close_scaled(pipe.eval_step(x, target=y), _gpt_loss(want, y), None, what="eval loss")
    loss, out = pipe.eval_step(x, target=y, return_outputs=True)
    assert_close_scaled(out, want, None, what="eval outputs")
    assert_close_scaled(pipe.eval_step(x), want, None, what="outputs, no target")
    pipe.close()


def test_compiled_stages_step_as_eager(one_rank) -> None:
    """fxpipe.distributed(compile=...): this rank's stages compiled (aot_eager: the graphs and
    the backward torch.compile makes, no code generation), steps exact against eager."""
    import copy

    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = copy.deepcopy(model)
    y = _labels()
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=_gpt_loss, schedule="zbv", stages_per_rank=2, timeout=60,
                        compile={"backend": "aot_eager"})
    assert all(getattr(pipe.stages[k], "_compiled_call_impl", None) is not None for k in pipe.local)
    for _ in range(2):
        model.zero_grad()
        eager.zero_grad()
        _assert_exact(pipe.step(x, target=y), _gpt_loss(eager(x), y), model, eager)
    pipe.close()


def _written_target(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    y.add_(1).remainder_(64)  # not idempotent: a second write of one piece, or none, would show
    return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="sum")  # saves y for its backward


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_loss_fn_writing_its_target_in_place(one_rank, schedule: str) -> None:
    """Each micro-batch's target is a view of the caller's, sharing its version counter: a
    write into it made GPipe's backward fail in autograd. The loss gets copies; the caller's
    target is left as it was (only the last stage's rank runs loss_fn: targets stay alike)."""
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = zoo.TinyGPT()
    eager.load_state_dict(model.state_dict())
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=_written_target, schedule=schedule, timeout=60)
    y, y_eager = _labels().clamp(min=0), _labels().clamp(min=0)
    loss = pipe.step(x, target=y)
    _assert_exact(loss, _written_target(eager(x), y_eager), model, eager)
    assert torch.equal(y, _labels().clamp(min=0))  # left as it was: alike on every rank
    pipe.close()


def test_a_loss_fn_reading_a_parameter_no_stage_holds_is_refused(one_rank) -> None:
    """A learnable temperature registered on the model but read by loss_fn alone: only the last
    stage's rank trained it, outside pipe.parameters(), pipe.clip_grad_norm_ and the other ranks'
    state_dict, and replicas never summed its gradient (a trial: all silent). Refused before
    anything is sent; a parameter a stage holds (the tied embedding) is exact."""
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model, (x,), _ = zoo.gpt_tied(batch=4)
    model.temp = torch.nn.Parameter(torch.tensor(0.7))
    y = _labels().clamp(min=0)

    def tempered(out, y):
        return F.cross_entropy(out.flatten(0, 1) / model.temp, y.flatten(), reduction="sum")

    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=tempered, schedule="zbv", stages_per_rank=2, timeout=60)
    with pytest.raises(StepError, match=r"reads the model's parameter 'temp'.*no stage of this pipeline uses it"):
        pipe.step(x, target=y)
    assert all(p.grad is None for p in model.parameters())
    pipe.close()

    own = torch.nn.Parameter(torch.tensor(0.7))  # the loss's own temperature, not the model's: the caller's

    def tempered_own(out, y):
        return F.cross_entropy(out.flatten(0, 1) / own, y.flatten(), reduction="sum")

    model, (x,), _ = zoo.gpt_tied(batch=4)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=tempered_own, schedule="gpipe", stages_per_rank=2, timeout=60)
    pipe.step(x, target=y)
    assert own.grad is not None
    pipe.close()
    model, (x,), _ = zoo.gpt_tied(batch=4)  # zero bubble: the weight pass covers the stages' weights alone
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=tempered_own, schedule="zbv", stages_per_rank=2, timeout=60)
    with pytest.raises(StepError, match=r"not the model's.*zero bubble"):
        pipe.step(x, target=y)
    pipe.close()

    def penalised(out, y):  # a weight a stage holds: trained there, exact (a mean plus a constant)
        return F.cross_entropy(out.flatten(0, 1), y.flatten()) + 1e-2 * model.tok.weight.pow(2).sum()

    model, (x,), _ = zoo.gpt_tied(batch=4)
    eager = zoo.TinyGPT()
    eager.load_state_dict(model.state_dict())
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=penalised, schedule="zbv", stages_per_rank=2, timeout=60)
    loss = pipe.step(x, target=y)
    want = F.cross_entropy(eager(x).flatten(0, 1), y.flatten()) + 1e-2 * eager.tok.weight.pow(2).sum()
    _assert_exact(loss, want, model, eager)
    pipe.close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_input_computed_with_grad_gets_its_gradient_once(one_rank, schedule) -> None:
    """A soft prompt (the input is ``prompt * 1.0``, computed with grad): each micro-batch is a
    piece of it, and the first one's backward freed the graph that made it, so the second's
    failed in torch ('backward through the graph a second time', a trial). The schedule now
    starts from a leaf, and the prompt gets the gradient eager gives it."""
    import fxpipe.distributed as fpd

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))
    eager = copy.deepcopy(model)
    prompt = torch.nn.Parameter(torch.randn(8, 16))
    y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(3))
    pipe = fpd.pipeline(model, prompt.detach(), chunks=2, loss_fn=F.cross_entropy, schedule=schedule, timeout=60)
    loss = pipe.step(prompt * 1.0, target=y)
    want_prompt = prompt.detach().clone().requires_grad_()
    want = F.cross_entropy(eager(want_prompt * 1.0), y)
    _assert_exact(loss, want, model, eager)
    assert_close_scaled(prompt.grad, want_prompt.grad, None, what="the prompt's gradient")
    pipe.close()
