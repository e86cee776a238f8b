"""A submodule switched to train or eval after the build: followed where the graph follows
the flags, refused (ModelChangedError naming it) where the graph baked them in.

torch.export bakes every traced module's mode into the graph; so does a torch.fx forward that
reads ``self.training``. Freezing BatchNorm for fine-tuning, or turning dropout off, after such
a build was silently ignored.
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
def test_a_submodule_switched_where_the_graph_baked_its_mode_is_refused(cls, method):
    model = cls().train()
    x = torch.randn(8, 8)
    pipe = _pipe(model, x)
    assert pipe.capture.method == method
    pipe(x)
    switched = "bn" if cls is NetExport else "mid"
    getattr(model, switched).eval()  # frozen for fine-tuning
    with pytest.raises(ModelChangedError, match=rf"'{switched}' is in eval mode now, was in training mode"):
        pipe(x)
    getattr(model, switched).train()  # as built: runs again
    pipe(x)
    model.eval()
    pipe_eval = _pipe(model, x)  # built with dropout off
    pipe_eval(x)
    model.drop.train()  # turned back on: the graph would never drop
    with pytest.raises(ModelChangedError, match="'drop' is in training mode now, was in eval mode"):
        pipe_eval(x)


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


def test_distributed_eval_step_in_another_mode_than_the_export_build_is_refused():
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
        model.eval()  # validation in the middle of training: dropout would silently stay on
        with pytest.raises(ModeError, match="built in training mode"):
            pipe.eval_step(x)
        model.train()
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
