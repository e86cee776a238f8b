"""Where the batch is and how outputs merge (issue #8, items 4 and 5).

A pipeline splits inputs and merges outputs; when the batch is not in dim 0, or an output
is not per sample, that silently changes the result. ``chunk_dims`` / ``output_merge`` say
how, and the build-time check refuses what would differ, naming the input or output.
"""

import copy

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_exact
from fxpipe.errors import MicroBatchError

MODES = ["always", "except_last", "never"]


class SeqFirst(nn.Module):
    """A sequence-first model: input (T, B, D); attention mixes along T, never along B."""

    def __init__(self, d=8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.q(x), self.k(x), self.v(x)                  # (T, B, D)
        scores = torch.einsum("tbd,sbd->bts", q, k).softmax(-1)    # (B, T, T)
        h = torch.einsum("bts,sbd->tbd", scores, v)
        return self.out(torch.tanh(h) + x)


def test_seq_first_split_along_dim_0_is_refused_naming_the_option():
    x = torch.randn(5, 4, 8)
    with pytest.raises(MicroBatchError, match=r"(?s)the output differs.*dim 0 of x.*chunk_dims"):
        fxpipe.pipeline(SeqFirst(), x, 2, chunks=2, devices=["cpu"] * 2)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [2, 4])
def test_seq_first_with_chunk_dims_is_exact(mode, chunks):
    torch.manual_seed(0)
    x = torch.randn(5, 4, 8)
    for n in (2, 3):
        assert_exact(SeqFirst(), (x,), n, chunks=chunks, checkpoint=mode, chunk_dims=1, output_merge=1,
                     balance_by="params")


class SeqFirstLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.lstm = nn.LSTM(8, 8, num_layers=2)
        self.head = nn.Linear(8, 3)

    def forward(self, x, state):
        out, (h, c) = self.lstm(torch.relu(self.embed(x)), state)
        return self.head(out), h


def test_seq_first_lstm_refused_then_exact_with_chunk_dims():
    torch.manual_seed(0)
    x = torch.randn(5, 4, 6)
    state = (torch.randn(2, 4, 8), torch.randn(2, 4, 8))
    with pytest.raises(MicroBatchError, match=r"(?s)x has 5, state has 2.*chunk_dims"):
        fxpipe.pipeline(SeqFirstLSTM(), (x, state), 2, chunks=2, devices=["cpu"] * 2)
    for mode in MODES:
        assert_exact(SeqFirstLSTM(), (x, state), 3, chunks=2, checkpoint=mode, chunk_dims=1, output_merge=1,
                     balance_by="params")


class WithStats(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x)
        return h, h.mean(0), h.sum(), h.shape


def test_output_without_batch_dim_is_refused():
    with pytest.raises(MicroBatchError, match=r"(?s)output '1' has shape \(4,\).*output_merge=\{'1': 'mean'\}"):
        fxpipe.pipeline(WithStats(), torch.randn(6, 4), 2, chunks=2, devices=["cpu"] * 2)


def test_declared_merges_are_exact():
    torch.manual_seed(0)
    merges = {"1": "mean", "2": "sum", "3": lambda parts: torch.Size([sum(p[0] for p in parts), parts[0][1]])}
    for mode in MODES:
        for chunks in (2, 3):  # 3: uneven micro-batches of a batch of 7; 'mean' is size-weighted
            pipe = assert_exact(WithStats(), (torch.randn(7, 4),), 2, chunks=chunks, checkpoint=mode,
                                output_merge=merges)
            assert pipe(torch.randn(7, 4))[3] == torch.Size([7, 4])


def test_non_tensor_output_taken_from_one_micro_batch_is_refused():
    class Shape(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x), x.shape[0]

    with pytest.raises(MicroBatchError, match=r"output '1' is 6 for the whole batch but 3 merged"):
        fxpipe.pipeline(Shape(), torch.randn(6, 4), 2, chunks=2, devices=["cpu"] * 2)
    assert_exact(Shape(), (torch.randn(6, 4),), 2, chunks=2, output_merge={"1": "sum"})


def test_zero_dim_loss_needs_a_declared_merge():
    class WithLoss(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 2)

        def forward(self, x, y):
            out = self.l(x)
            return {"logits": out, "loss": nn.functional.mse_loss(out, y)}

    x, y = torch.randn(8, 4), torch.randn(8, 2)
    with pytest.raises(MicroBatchError, match=r"(?s)output 'loss'.*output_merge=\{'loss': 'mean'\}"):
        fxpipe.pipeline(WithLoss(), (x, y), 2, chunks=2, devices=["cpu"] * 2)
    for mode in MODES:
        assert_exact(WithLoss(), (x, y), 2, chunks=4, checkpoint=mode, output_merge={"loss": "mean"},
                     loss=lambda out: out["loss"])


def test_replicated_argument_is_not_split():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x, table):  # table: (4, 4), the same for every sample
            return self.l(x) @ table

    x, table = torch.randn(4, 4), torch.randn(4, 4)
    with pytest.raises(MicroBatchError):  # split along dim 0, the table breaks
        fxpipe.pipeline(Scaled(), (x, table), 2, chunks=2, devices=["cpu"] * 2)
    assert_exact(Scaled(), (x, table.requires_grad_()), 2, chunks=2, chunk_dims={"table": None})


def test_batchnorm_model_is_not_refused():
    """BatchNorm normalises micro-batches on their own statistics by design: the check runs
    in eval mode, and the model's mode and statistics are left as they were."""
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    stats = copy.deepcopy(model[1].state_dict())
    fxpipe.pipeline(model, torch.randn(8, 4), 2, chunks=4, devices=["cpu"] * 2)
    assert model.training and model[1].training
    for k, v in stats.items():
        assert torch.equal(model[1].state_dict()[k], v)


def test_bad_options_are_refused():
    with pytest.raises(MicroBatchError, match="not arguments"):
        fxpipe.pipeline(nn.Linear(4, 4), torch.randn(4, 4), 1, devices=["cpu"], chunk_dims={"y": 1})
    with pytest.raises(MicroBatchError, match="not outputs"):
        fxpipe.pipeline(nn.Linear(4, 4), torch.randn(4, 4), 1, devices=["cpu"], output_merge={"loss": "mean"})
    with pytest.raises(MicroBatchError, match="must be a dim"):
        fxpipe.pipeline(nn.Linear(4, 4), torch.randn(4, 4), 1, devices=["cpu"], output_merge="median")


def test_seq_first_transformer_encoder_captured_by_export():
    """torch.export keeps the split dim dynamic: the dim chunk_dims names, not dim 0."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2, enable_nested_tensor=False)
    x = torch.randn(5, 4, 16)  # (T, B, D)
    with pytest.raises(MicroBatchError, match="chunk_dims"):
        fxpipe.pipeline(copy.deepcopy(enc), x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    for mode in MODES:
        pipe = assert_exact(enc, (x,), 2, chunks=2, checkpoint=mode, chunk_dims=1, output_merge=1,
                            balance_by="params")
    assert pipe.capture.method == "export"


# -- the training-mode check (fxpipe.checks._modes) ----------------------------------------------

class CenterInTraining(nn.Module):
    """Mixes the samples of the batch in training only (a batch statistic)."""

    def forward(self, h):
        if self.training:
            return h - h.mean(0, keepdim=True)
        return h


class CountingNorm(nn.Module):
    """A custom norm: batch statistics in training, a running mean kept in a buffer. Updating
    the buffer in forward makes fxpipe keep it opaque by itself (no leaf_modules)."""

    def __init__(self, d):
        super().__init__()
        self.register_buffer("running", torch.zeros(d))

    def forward(self, h):
        if self.training:
            mean = h.mean(0)
            with torch.no_grad():
                self.running.mul_(0.9).add_(0.1 * mean)
            return h - mean
        return h - self.running


class Mixer(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.a, self.n, self.b = nn.Linear(8, 16), norm, nn.Linear(16, 4)
        self.drop, self.bn = nn.Dropout(0.5), nn.BatchNorm1d(16)

    def forward(self, x):
        return self.b(self.drop(self.bn(self.n(self.a(x)))))


@pytest.mark.parametrize("norm, leaves", [(CenterInTraining, ["n"]), (lambda: CountingNorm(16), ())])
def test_training_only_batch_mixing_is_refused_naming_the_module(norm, leaves):
    model = Mixer(norm())
    state = copy.deepcopy(model.state_dict())
    with pytest.warns(UserWarning) if not leaves else _no_warning():
        with pytest.raises(MicroBatchError, match=(
                r"(?s)the output differs .* merged in training mode, though they agree in eval mode.*"
                r"nn.Dropout and BatchNorm modules in eval mode.*"
                r"first module whose output differs while its inputs agree is 'n' \(.*\).*What to do:.*outside "
                r"the pipeline.*model.eval\(\)")):
            fxpipe.pipeline(model, torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2, leaf_modules=leaves)
    assert model.training and all(m.training for m in model.modules())
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("mode", MODES)
def test_built_in_eval_mode_is_exact_in_eval_and_refuses_training(mode):
    torch.manual_seed(0)
    model = Mixer(CenterInTraining()).eval()
    x = torch.randn(6, 8)
    pipe = assert_exact(model, (x,), 2, chunks=2, checkpoint=mode, leaf_modules=["n"], balance_by="params")
    assert "'n'" in pipe.batching.train_refusal
    pipe.train()
    with pytest.raises(MicroBatchError, match=r"(?s)built in eval mode, where it is exact, and cannot run in "
                                              r"training mode.*'n' \(CenterInTraining\)"):
        pipe(x)
    pipe.eval()
    torch.testing.assert_close(pipe(x), model(x))


def test_training_branch_mixing_in_traced_code_is_refused():
    class Traced(nn.Module):  # the mixing is traced: the graph has training mode baked in
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.a(x)
            if self.training:
                h = h - h.mean(0)
            return self.b(h)

    with pytest.raises(MicroBatchError, match=r"(?s)merged in training mode\..*already differ where they "
                                              r"enter module 'b' \(Linear\)"):
        fxpipe.pipeline(Traced(), torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2)
    fxpipe.pipeline(Traced().eval(), torch.randn(6, 8), 2, chunks=2, devices=["cpu"] * 2)  # eval: per sample


class PerSampleNoise(nn.Module):
    """Random in training (functional dropout, noise), but per sample: must not be refused."""

    def forward(self, h):
        if self.training:
            h = nn.functional.dropout(h, 0.3, True) + 0.1 * torch.randn_like(h)
        return h


@pytest.mark.parametrize("train", [True, False])
def test_dropout_batchnorm_and_randomness_are_not_refused_in_training(train):
    torch.manual_seed(0)
    model, x = Mixer(PerSampleNoise()).train(train), torch.randn(6, 8)
    rng = torch.get_rng_state()
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, leaf_modules=["n"])
    assert pipe.batching.train_refusal == ""
    assert torch.equal(torch.get_rng_state(), rng)
    pipe.train()
    assert pipe(torch.randn(6, 8)).shape == (6, 4)


def test_export_graph_with_batchnorm_in_training_is_not_refused():
    """torch.export bakes BatchNorm's training into the graph: checked for structure there."""
    class LoopBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.bn = nn.Linear(8, 8), nn.BatchNorm1d(8)

        def forward(self, x):  # (B, T, D); range(x.shape[1]) is not fx-traceable, torch.export takes it
            h = self.a(x)
            for t in range(1, int(x.shape[1])):
                h = h + h[:, t - 1:t]
            return self.bn(h.transpose(1, 2))

    pipe = fxpipe.pipeline(LoopBN(), torch.randn(4, 5, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    assert pipe.capture.method == "export"
    assert pipe(torch.randn(4, 5, 8)).shape == (4, 8, 5)


def test_merge_dim_suggested_from_the_shapes():
    class Cumulative(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 4)

        def forward(self, x):  # (T, B, D): a running sum over time
            h = torch.cumsum(self.a(x), 0)
            return {"h": h, "last": h[-1]}

    x = torch.randn(5, 6, 8)
    with pytest.raises(MicroBatchError, match=r"output 'h' has shape \(5, 6, 4\) for the whole batch but \(10, 3, 4\) "
                                              r"merged.*batch in dim 1.*output_merge=\{'h': 1\}"):
        fxpipe.pipeline(Cumulative(), x, 1, chunks=2, chunk_dims=1, devices=["cpu"])
    for mode in MODES:
        assert_exact(Cumulative(), (x,), 2, chunks=2, checkpoint=mode, chunk_dims=1, output_merge={"h": 1},
                     balance_by="params")


class _Trim(nn.Module):
    def forward(self, ids, mask):
        longest = int(mask.sum(1).max())  # the batch's longest sequence: each micro-batch its own
        return ids[:, :longest], mask[:, :longest]


class _Trimmed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trim, self.emb, self.head = _Trim(), nn.Embedding(20, 8), nn.Linear(8, 4)

    def forward(self, ids, mask):
        ids, mask = self.trim(ids, mask)
        return self.head(self.emb(ids)) * mask[..., None]


def test_outputs_of_other_lengths_per_micro_batch_are_refused_naming_them() -> None:
    """Each micro-batch trimmed to its own longest row: torch.cat raised a bare RuntimeError
    from inside the merge (a trial). (Built from a mask whose micro-batches each hold a full row:
    one alike in every row is padded for the check, which refuses the trim at the build.)"""
    ids, mask = torch.randint(0, 20, (8, 6)), torch.ones(8, 6)
    mask[1, 4:] = 0
    pipe = fxpipe.pipeline(_Trimmed(), (ids, mask), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    short = mask.clone()
    short[:4, 3:] = 0
    with pytest.raises(MicroBatchError, match=r"shapes \[\(4, 3, 4\), \(4, 6, 4\)\].*trims its output"):
        pipe(ids, short)


@pytest.mark.parametrize("export", [False, True])
def test_an_embedding_scaling_its_gradient_by_the_batchs_frequencies_is_refused(export: bool) -> None:
    """Its gradient mixes the samples in backward only, which the forward checks cannot see (a
    trial: the embedding's gradient off by more than its size)."""

    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(20, 8, scale_grad_by_freq=True), nn.Linear(8, 4)

        def forward(self, ids):
            if export and ids.dim() != 2:
                raise ValueError("2-d ids")  # stops torch.fx: captured by torch.export
            return self.head(self.emb(ids))

    with pytest.raises(MicroBatchError, match=r"scale_grad_by_freq=True.*chunks=1"):
        fxpipe.pipeline(Lm(), torch.randint(0, 20, (8, 5)), 2, chunks=2, devices=["cpu"] * 2, progress=False)
    fxpipe.pipeline(Lm(), torch.randint(0, 20, (8, 5)), 2, chunks=1, devices=["cpu"] * 2, progress=False).close()


def test_a_micro_batch_of_one_through_batchnorm_is_a_micro_batch_error() -> None:
    """A last batch of 13 in 4 chunks ends in a micro-batch of 1, which BatchNorm1d on features
    cannot normalise in training: torch's bare ValueError, where eager's whole batch runs (a
    trial). A typed error naming the sizes; the pipeline goes on with a batch that splits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    with fxpipe.pipeline(model, torch.randn(16, 8), 2, chunks=4, devices=["cpu"] * 2, progress=False) as pipe:
        with pytest.raises(MicroBatchError, match=r"micro-batches of \[4, 4, 4, 1\] samples"):
            pipe(torch.randn(13, 8))
        assert pipe(torch.randn(12, 8)).shape == (12, 2)


class _Listwise(nn.Module):
    """A re-ranker scoring each query's 4 candidates, in consecutive rows, against each other."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).squeeze(-1).view(-1, 4).log_softmax(-1).flatten()


def test_micro_batches_that_break_the_models_row_groups_are_named():
    """chunks=8 on 16 rows: refused at the build (the check runs as many micro-batches as the
    pipeline); a smaller last batch cutting the groups: MicroBatchError naming the sizes (torch's
    bare view error before), the model's error as its cause."""
    with pytest.raises(MicroBatchError, match="fails on a micro-batch"):
        fxpipe.pipeline(_Listwise(), torch.randn(16, 8), 2, chunks=8, devices=["cpu"] * 2, progress=False)
    model = _Listwise()
    pipe = fxpipe.pipeline(model, torch.randn(16, 8), 2, chunks=4, devices=["cpu"] * 2, progress=False)
    x = torch.randn(16, 8)
    torch.testing.assert_close(pipe(x), model(x))
    with pytest.raises(MicroBatchError, match=r"micro-batches hold \[2, 2, 2, 2\] samples.*checked micro-batches of "
                                              r"\[4, 4, 4, 4\]") as info:
        pipe(torch.randn(8, 8))
    assert isinstance(info.value.__cause__, RuntimeError)


class _Vocab(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(10, 8), nn.Linear(8, 2)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def test_an_error_in_the_data_on_a_smaller_last_batch_keeps_its_type():
    """An id out of the vocabulary in a smaller last batch is the data's IndexError, as in eager
    (a DataLoader loop catching it), with a note of the micro-batch sizes; not a MicroBatchError."""
    pipe = fxpipe.pipeline(_Vocab(), torch.randint(0, 10, (16, 5)), 2, chunks=4, devices=["cpu"] * 2,
                           balance_by="params", progress=False)
    bad = torch.randint(0, 10, (6, 5))
    bad[0, 0] = 12
    with pytest.raises(IndexError) as info:
        pipe(bad)
    assert any("micro-batches hold [2, 2, 2] samples" in n for n in getattr(info.value, "__notes__", []))
