"""A submodule switched to train or eval after the build: followed exactly, in both kinds of graph.

torch.fx calls BatchNorm and Dropout as modules, which follow their flags. torch.export bakes
every traced module's mode into the graph, and so does a torch.fx forward that reads
``self.training``: freezing BatchNorm for fine-tuning, or turning dropout off, after such a
build was silently ignored. The pipeline now captures the model again in the modes it has
(fxpipe._mode_variants), cut where the plan cut it; with stages on several devices, where the
model cannot run whole after the build, only the root's mode flipped is followed and any
other switch is refused (ModelChangedError naming the module).
"""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import ModeError, ModelChangedError

from exact import assert_close_scaled, assert_grads_equal


class Net(nn.Module):
    """Linear, BatchNorm, dropout, Linear: a torch.fx capture calls BatchNorm and Dropout as
    modules, which follow their own flags."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.bn(self.inp(x)))))


class NetExport(Net):
    """The same, captured by torch.export (the shape check stops torch.fx)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        return super().forward(x)


class ReadsTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.5, training=self.training)  # a constant in a torch.fx graph


class NetReadsTraining(Net):
    def __init__(self) -> None:
        super().__init__()
        self.mid = ReadsTraining()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mid(torch.relu(self.inp(x))))


def _pipe(model, x, **options):
    return fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False, **options)


@pytest.mark.parametrize("cls, method", [(NetExport, "export"), (NetReadsTraining, "fx")])
def test_a_submodule_switched_where_the_graph_baked_its_mode_is_followed(cls, method):
    """Freezing BatchNorm (or the module with a traced ``self.training``) after the build:
    outputs, every gradient and the running statistics as eager; switched back, as built."""
    model = cls().train()
    model.drop.p = 0.0  # deterministic in training mode: compared with eager value for value
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    assert pipe.capture.method == method and pipe.mode_sensitive
    torch.manual_seed(1)  # the same dropout masks below
    built, before = pipe.stages, pipe(x).detach()  # BatchNorm in training: per micro-batch statistics
    switched = "bn" if cls is NetExport else "mid"
    getattr(model, switched).eval()  # frozen for fine-tuning
    for _ in range(2):  # the second call runs the capture kept for these modes
        ref = copy.deepcopy(model)
        out, want = pipe(x), ref(x)
        assert_close_scaled(out, want, what="output")
        out.pow(2).mean().backward()
        want.pow(2).mean().backward()
        assert_grads_equal(model, ref)
        assert torch.equal(model.bn.running_mean, ref.bn.running_mean)
        model.zero_grad()
    assert pipe.stages is not built
    getattr(model, switched).train()  # as built: the build's stages again
    torch.manual_seed(1)
    torch.testing.assert_close(pipe(x), before)
    assert pipe.stages is built


def test_dropout_turned_back_on_after_an_eval_build_drops_as_a_pipeline_built_so():
    """Built in eval mode (dropout off), then dropout turned on: the pipeline drops, as one built
    in those modes does from the same seed (same plan), and eval mode is exact again after."""
    model = NetExport().eval()
    x = torch.randn(8, 8)
    pipe = _pipe(model, x, balance_by="params")
    torch.testing.assert_close(pipe(x), model(x))
    model.drop.train()
    fresh = _pipe(model, x, balance_by="params")
    torch.manual_seed(3)
    dropped = pipe(x)
    torch.manual_seed(3)
    torch.testing.assert_close(dropped, fresh(x))
    assert not torch.allclose(dropped, model.eval()(x))
    torch.testing.assert_close(pipe(x), model(x))


def test_with_stages_on_several_devices_the_root_mode_flip_is_followed_and_a_submodule_switch_refused(
        monkeypatch):
    """Placed on several devices the model cannot run whole after the build: the build captures
    the root's other mode before placing (so eval during training works), and a submodule
    switched alone is refused naming it. Several devices are what the build sees here."""
    import fxpipe.api as api

    real = api.build
    monkeypatch.setattr(api, "build", lambda *a, **k: real(*a, **{**k, "flipped": True}))
    monkeypatch.setattr(api, "_kept_sample", lambda *a: None)
    model = NetExport().train()
    model.drop.p = 0.0
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    model.eval()  # validation in the middle of training
    torch.testing.assert_close(pipe(x), model(x))
    model.train()
    model.bn.eval()
    with pytest.raises(ModelChangedError, match=r"several devices.*\n  - 'bn' is in eval mode now, was in training"):
        pipe(x)
    model.bn.train()
    pipe(x)


def test_a_graph_that_follows_the_flags_follows_a_frozen_batch_norm():
    """torch.fx calls BatchNorm and Dropout as modules: freezing BatchNorm after the build is
    exact against eager (outputs and every gradient)."""
    model = Net().train()
    model.drop.p = 0.0
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    assert pipe.capture.method == "fx" and not pipe.mode_sensitive
    model.bn.eval()
    ref = copy.deepcopy(model)
    out = pipe(x)
    want = ref(x)
    assert_close_scaled(out, want, what="output")
    out.pow(2).mean().backward()
    want.pow(2).mean().backward()
    assert_grads_equal(model, ref)
    assert torch.equal(model.bn.running_mean, ref.bn.running_mean)  # eval: statistics untouched


def test_distributed_eval_step_after_model_eval_is_exact_and_other_switches_refused():
    """fxpipe.distributed: validation in the middle of training (model.eval(), eval_step) runs
    the eval-mode capture the build made, exact against eager with dropout off (it kept dropout
    on before, then was refused); step() in eval mode and a submodule switched stay refused."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.distributed._launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        model = NetExport().train()
        x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        pipe = fpd.pipeline(model, x, chunks=2, loss_fn=F.cross_entropy, stages_per_rank=2, timeout=60)
        assert pipe.capture.method == "export"
        pipe.step(x, target=y)
        model.eval()  # validation in the middle of training: dropout silently stayed on
        for _ in range(2):
            torch.testing.assert_close(pipe.eval_step(x), model(x))
        with pytest.raises(ModeError, match="step\\(\\) trains in training mode only"):
            pipe.step(x, target=y)
        model.train()
        torch.manual_seed(0)
        first = pipe.step(x, target=y)  # training again: the build's stages, dropout on
        assert torch.isfinite(first)
        model.bn.eval()
        with pytest.raises(ModelChangedError, match="'bn' is in eval mode now"):
            pipe.step(x, target=y)
        model.bn.train()
        pipe.step(x, target=y)
        pipe.close()
    finally:
        dist.destroy_process_group()


def test_another_dtype_after_an_export_build_that_names_one_is_refused():
    """GPT-2's export graph writes float32 into its ops: bfloat16 weights after the build
    crashed with a bare 'mixed dtype'. Refused by name; rebuilt, it runs in bfloat16."""
    T = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32,
                                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 64, (4, 8))
    kwargs = {"input_ids": ids, "labels": ids}
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs=kwargs, chunks=2, devices=["cpu"] * 2, progress=False,
                           output_merge={"loss": "mean"})
    assert pipe.capture.method == "export"
    pipe.to(torch.bfloat16)
    with pytest.raises(ModelChangedError, match=r"'transformer.wte.weight' is torch.bfloat16 now, was torch.float32"):
        pipe(**kwargs)
    again = fxpipe.pipeline(model, (), 2, sample_kwargs=kwargs, chunks=2, devices=["cpu"] * 2, progress=False,
                            output_merge={"loss": "mean"})
    with torch.no_grad():
        torch.testing.assert_close(again(**kwargs)["logits"], model(**kwargs).logits, rtol=0.02, atol=0.02)
        assert again(**kwargs)["logits"].dtype == torch.bfloat16


def test_gpt2_validation_in_the_middle_of_training_is_exact():
    """The issue's loop: GPT-2 (torch.export, dropout baked in) trained, validated under
    ``model.eval()`` and ``no_grad`` (exact against eager: no dropout), trained again (dropout
    back, as a pipeline that never left training mode draws it from the same seed)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 101, (4, 12))
    options = dict(sample_kwargs={"input_ids": ids, "labels": ids}, output_merge={"loss": "mean"},
                   balance_by="params")
    pipe = fxpipe.pipeline(model, (), 2, chunks=2, devices=["cpu"] * 2, progress=False, **options)
    other = fxpipe.pipeline(twin, (), 2, chunks=2, devices=["cpu"] * 2, progress=False, **options)
    assert pipe.capture.method == "export"
    model.eval()
    with torch.no_grad():
        out, want = pipe(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    assert_close_scaled(out.logits, want.logits, what="logits")
    assert_close_scaled(out.loss, want.loss, what="loss")
    model.train()
    torch.manual_seed(5)
    loss = pipe.step(input_ids=ids, labels=ids)
    torch.manual_seed(5)
    assert_close_scaled(loss, other.step(input_ids=ids, labels=ids), what="loss")
    assert_grads_equal(model, twin)


def test_hf_resnet_with_frozen_batch_norm_fine_tunes_exactly():
    """The issue's fine-tuning case: transformers' ResNet (torch.export) built in training mode,
    then every BatchNorm frozen: outputs, every gradient and the running statistics as eager's.
    torch.fx traces this model in eval mode but not in training mode; the capture in the new
    modes keeps torch.export, so the plan's cut carries over (it was refused: 32 of 37 nodes
    new)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                                       num_labels=3, num_channels=3)
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).train()
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 3, (4,))
    pipe = fxpipe.pipeline(model, (), 2, sample_kwargs={"pixel_values": x, "labels": y}, chunks=2,
                           devices=["cpu"] * 2, output_merge={"loss": "mean"}, balance_by="params", progress=False)
    assert pipe.capture.method == "export"
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
    ref = copy.deepcopy(model)
    loss = pipe.step(pixel_values=x, labels=y)
    want = ref(pixel_values=x, labels=y).loss
    want.backward()
    assert_close_scaled(loss, want.detach(), what="loss")
    assert_grads_equal(model, ref)
    for name, buf in model.named_buffers():
        assert torch.equal(buf, dict(ref.named_buffers())[name]), name
    assert pipe.capture.method == "export"


class _Branching(nn.Module):
    """A block whose traced forward reads ``self.training`` (torch.fx bakes the branch in)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.training:
            h = h * 0.5 + 0.1
        return F.gelu(h) + x


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(*[_Branching() for _ in range(4)])
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


def test_a_model_built_with_one_block_in_eval_mode_is_exact():
    """Built with the root training and one block in eval: the graph takes that block's eval
    branch, and the checks run with each module's own flag (the other-mode trace put every
    module back in the root's mode: a false TraceError, 'the graph does not reproduce the
    model'); then switched to all-training, as eager."""
    model = _Blocks().train()
    model.blocks[0].eval()
    x = torch.randn(6, 16)
    pipe = _pipe(model, x)
    assert pipe.capture.method == "fx" and pipe.mode_sensitive
    for switch in (None, "all training"):
        if switch:
            model.train()
        ref = copy.deepcopy(model)
        out, want = pipe(x), ref(x)
        assert_close_scaled(out, want, what="output")
        out.pow(2).sum().backward()
        want.pow(2).sum().backward()
        assert_grads_equal(model, ref)
        model.zero_grad()
    assert model.blocks[0].training
