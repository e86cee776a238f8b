"""runtime/_batchnorm.py: deferred BatchNorm tracks the running statistics of the mini-batch."""

import copy

import pytest
import torch
from torch import nn

from exact import assert_all_close
from fxpipe import GPipe


def bn_models():
    # Each BatchNorm sees the same input in the pipeline and in the full-batch model
    # (normalisation itself uses micro-batch statistics, so a BN after a BN would not).
    yield nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    yield nn.Sequential(nn.Flatten(), nn.Linear(48, 5), nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 5))
    yield nn.Sequential(nn.Conv3d(3, 2, 1), nn.BatchNorm3d(2, momentum=0.3), nn.Flatten())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_deferred_batch_norm_matches_full_batch(chunks, checkpoint):
    for model in bn_models():
        ref = copy.deepcopy(model)
        pipe = GPipe(model, [2, len(model) - 2], devices=["cpu"] * 2, chunks=chunks,
                     checkpoint=checkpoint, deferred_batch_norm=True)
        for step in range(3):
            x = torch.randn(12, 3, 4, 4) + step
            if isinstance(model[0], nn.Conv3d):
                x = x.unsqueeze(-1)
            pipe(x).sum().backward()
            ref(x)
        # sums over micro-batches, rounded otherwise than the batch's: tests/exact.py's tolerance
        assert_all_close((name, b, a) for (name, a), b in zip(ref.named_buffers(), model.buffers()))
        assert list(model.state_dict()) == list(ref.state_dict())  # keys unchanged


def test_deferred_batch_norm_eval_uses_running_stats():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ref = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    x = torch.randn(6, 3)
    pipe(x)
    ref(x)
    pipe.eval()
    ref.eval()
    torch.testing.assert_close(pipe(x), ref(x))


class _ExportedBN(nn.Module):
    """Linear, BatchNorm, Linear, captured by torch.export (the shape check stops torch.fx)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            raise ValueError("expected a 2-d input")
        return self.b(self.bn(self.a(x)))


def test_deferred_batch_norm_under_torch_export_is_refused_where_it_would_do_nothing():
    """The export graph calls aten's batch norm, not the modules the option converts: running
    statistics would move once per micro-batch. Refused in training with several micro-batches;
    eval mode (frozen statistics) and one micro-batch build as before."""
    import fxpipe
    from fxpipe.errors import BatchNormConversionError

    x = torch.randn(8, 4)
    model = _ExportedBN()
    with pytest.raises(BatchNormConversionError, match="torch.export.*once per micro-batch"):
        fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True, progress=False)
    assert type(model.bn) is nn.BatchNorm1d  # nothing converted
    fxpipe.pipeline(model, x, 2, chunks=1, devices=["cpu"] * 2, deferred_batch_norm=True, progress=False).close()
    fxpipe.pipeline(model.eval(), x, 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True,
                    progress=False).close()


class _ExportedConvBN(nn.Module):
    """Conv, BatchNorm, ReLU twice, captured by torch.export (the shape check stops torch.fx):
    its stages read the running statistics through get_attr paths of their own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.b, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) != 3:
            raise ValueError("expected RGB images")
        h = torch.relu(self.bn2(self.b(torch.relu(self.bn1(self.a(x))))))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("how", ["step", "backward"])
def test_running_statistics_under_export_are_updated_once_per_micro_batch(checkpoint, how):
    """A checkpointed stage's recomputation runs on a snapshot of the statistics: under
    torch.export the stage reads them through its own module path, which the snapshot must
    reach (it did not: 3 updates per step for 2 micro-batches, the statistics off by 0.3 on
    an HF ResNet). Against eager run on the same micro-batches one after the other."""
    import fxpipe

    model = _ExportedConvBN().train()
    ref = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 3, (4,))
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, checkpoint=checkpoint, progress=False,
                           balance_by="params")
    assert pipe.capture.method == "export"
    for _ in range(2):
        if how == "step":
            pipe.step(x, loss_fn=nn.functional.cross_entropy, target=y)
        else:
            nn.functional.cross_entropy(pipe(x), y).backward()
        for part in x.split(2):
            ref(part)
    for name, buf in model.named_buffers():
        torch.testing.assert_close(buf, dict(ref.named_buffers())[name], msg=name)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_model_run_eagerly_while_the_pipeline_is_open_updates_its_statistics_at_once(checkpoint):
    """A layer a pipeline borrowed for deferred_batch_norm, called by the model itself (an
    eager warm-up or debug step while the pipeline is open), is the BatchNorm it was: its
    statistics were held back and folded into the pipeline's next commit (a new-user trial)."""
    import fxpipe

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(16, 8), 2, chunks=4, devices=["cpu"] * 2, deferred_batch_norm=True,
                           checkpoint=checkpoint, progress=False)
    for _ in range(3):
        x = torch.randn(16, 8) + 5
        model(x)
        ref(x)
        assert_all_close([(n, a, b) for (n, a), b in zip(model.named_buffers(), ref.buffers())])
    x = torch.randn(16, 8)
    pipe(x).sum().backward()  # backward recomputes the checkpointed stages: no statistics there
    ref(x).sum().backward()
    assert_all_close([(n, a, b) for (n, a), b in zip(model.named_buffers(), ref.buffers())])
    assert model[1].num_batches_tracked.item() == 4
    pipe.close()


class _Looped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for _ in range(2):
            h = h + torch.relu(self.bn(h))
        return h


class _SharedBN(nn.Module):
    """One BatchNorm applied twice (ALBERT-style weight sharing), by the traced code or inside a
    module kept opaque, where the graph cannot see the repeated calls."""

    def __init__(self) -> None:
        super().__init__()
        self.i, self.block, self.o = nn.Linear(4, 8), _Looped(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.block(self.i(x)))


@pytest.mark.parametrize("where", ["graph", "opaque"])
def test_deferred_batch_norm_called_twice_per_forward_is_refused(where):
    """Eager updates the statistics once per call; deferred, both calls pooled into one update
    per mini-batch (0.15-0.25 off, a trial). Refused: at the build where the graph calls the
    layer twice, at the first call (nothing committed) where an opaque module does."""
    import fxpipe
    from fxpipe.errors import BatchNormConversionError

    torch.manual_seed(0)
    model = _SharedBN()
    x = torch.randn(8, 4)
    leaves = [] if where == "graph" else [_Looped]
    build = lambda: fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True,  # noqa: E731
                                    progress=False, balance_by="params", leaf_modules=leaves)
    if where == "graph":
        with pytest.raises(BatchNormConversionError, match="'block.bn' runs more than once per forward"):
            build()
        return
    pipe = build()
    before = model.block.bn.running_mean.clone()
    with pytest.raises(BatchNormConversionError, match="'block.bn' .*4 calls over 2 micro-batches"):
        pipe(x)
    assert torch.equal(model.block.bn.running_mean, before)


def test_deferred_batch_norm_after_a_failed_step_and_a_shared_layer_held_in_eval():
    """A step that raised left its micro-batches' statistics behind: the next commit pooled them
    and counted a layer called twice (a false refusal). A layer shared by two views but held in
    eval mode updates nothing: built, exact."""
    import fxpipe
    from fxpipe.errors import BatchNormConversionError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(8, 4)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True, progress=False,
                           balance_by="params")

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise ValueError("a bad label")

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    with pytest.raises(ValueError, match="a bad label"):
        pipe.step(x, loss_fn=failing, target=torch.randn(8, 2))
    before = model[1].running_mean.clone()
    pipe.step(x, loss_fn=mse, target=torch.randn(8, 2))  # committed once, with this step's statistics
    assert not torch.equal(model[1].running_mean, before)
    pipe.close()

    shared = _SharedBN()
    shared.block.bn.eval()  # frozen statistics
    y = torch.randn(8, 4)
    pipe = fxpipe.pipeline(shared, y, 2, chunks=2, devices=["cpu"] * 2, deferred_batch_norm=True, progress=False,
                           balance_by="params")
    torch.testing.assert_close(pipe(y), shared(y))
    with pytest.raises(BatchNormConversionError, match="4 calls over 2 micro-batches"):  # switched to training
        shared.block.bn.train()
        pipe(y)
