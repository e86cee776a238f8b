"""fxpipe.GPipe against the plain nn.Sequential: outputs and every gradient."""

import copy

import pytest
import torch
from torch import nn

from exact import assert_close_scaled, assert_grads_equal
from fxpipe import GPipe


def make_model(layers: int = 4, width: int = 6) -> nn.Sequential:
    mods = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        mods.append(nn.Tanh())
    return nn.Sequential(*mods)


def even_balance(total: int, n: int):
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def assert_same_training(model, pipe_model, pipe, x):
    ref = model(x)
    ref.pow(2).sum().backward()
    out = pipe(x)
    out.pow(2).sum().backward()
    torch.testing.assert_close(out, ref)
    assert_grads_equal(pipe_model, model)


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_transparency(n, chunks, checkpoint):
    model = make_model()
    pipe_model = copy.deepcopy(model)
    pipe = GPipe(pipe_model, even_balance(len(pipe_model), n), devices=["cpu"] * n, chunks=chunks, checkpoint=checkpoint)
    x = torch.randn(10, 6)  # 10 samples: uneven micro-batches for chunks 3 and 8
    assert_same_training(model, pipe_model, pipe, x)


def test_input_requiring_grad_gets_gradient():
    model = make_model()
    pipe = GPipe(copy.deepcopy(model), [4, 4], devices=["cpu"] * 2, chunks=4)
    x = torch.randn(8, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    pipe(x).sum().backward()
    model(x2).sum().backward()
    assert_close_scaled(x.grad, x2.grad, what="input gradient")


class Split(nn.Module):
    def forward(self, x):
        return x, x * 2


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.b = nn.Linear(5, 5)

    def forward(self, xs):
        x, y = xs
        return self.a(x) + self.b(y), y


class Take(nn.Module):
    def forward(self, xs):
        return xs[0] * xs[1]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_tuple_inputs_and_outputs(checkpoint):
    model = nn.Sequential(Split(), Mix(), Mix(), Take())
    pipe_model = copy.deepcopy(model)
    pipe = GPipe(pipe_model, [1, 1, 2], devices=["cpu"] * 3, chunks=3, checkpoint=checkpoint)
    assert_same_training(model, pipe_model, pipe, torch.randn(7, 5))

    # A tuple output of the whole pipeline stays a tuple.
    pipe2 = GPipe(nn.Sequential(Split(), Mix()), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=checkpoint)
    out = pipe2(torch.randn(4, 5))
    assert isinstance(out, tuple) and len(out) == 2 and out[0].shape == (4, 5)


class MaskOut(nn.Module):
    """Returns an integer mask beside the activations: needs no grad."""

    def forward(self, x):
        return x, (x > 0).long()


class UseMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, xs):
        x, mask = xs
        return self.lin(x) * mask


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_output_without_grad_under_checkpointing(checkpoint):
    # torchgpipe 0.0.7 fails here: "element 1 of tensors does not require grad".
    model = nn.Sequential(nn.Linear(4, 4), MaskOut(), UseMask())
    pipe_model = copy.deepcopy(model)
    pipe = GPipe(pipe_model, [2, 1], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    assert_same_training(model, pipe_model, pipe, torch.randn(8, 4))


def test_tuple_input_to_pipeline():
    model = nn.Sequential(Mix(), Take())
    pipe_model = copy.deepcopy(model)
    pipe = GPipe(pipe_model, [1, 1], devices=["cpu"] * 2, chunks=2)
    x, y = torch.randn(6, 5), torch.randn(6, 5)
    torch.testing.assert_close(pipe((x, y)), model((x, y)))


def test_attributes_and_sequence_protocol():
    model = make_model(3)
    pipe = GPipe(model, [2, 4], devices=["cpu", "cpu"], chunks=5, checkpoint="never")
    assert pipe.balance == [2, 4]
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe.chunks == 5 and pipe.checkpoint == "never"
    assert len(pipe.partitions) == 2 and len(pipe) == 6
    assert list(pipe) == list(model)
    assert pipe[0] is model[0] and pipe[-1] is model[5]


def test_devices_default_to_cpu_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: devices default to CUDA")
    pipe = GPipe(make_model(2), [2, 2], chunks=2)
    assert pipe.devices == [torch.device("cpu")] * 2
    assert pipe(torch.randn(4, 6)).shape == (4, 6)


def test_eval_and_no_grad():
    model = make_model()
    pipe = GPipe(copy.deepcopy(model), [4, 4], devices=["cpu"] * 2, chunks=4)
    pipe.eval()
    x = torch.randn(8, 6)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))
    # In eval with grad enabled, nothing is checkpointed and gradients still flow.
    pipe(x).sum().backward()
    assert all(p.grad is not None for p in pipe.parameters())


def test_batch_smaller_than_chunks():
    model = make_model()
    pipe_model = copy.deepcopy(model)
    pipe = GPipe(pipe_model, [4, 4], devices=["cpu"] * 2, chunks=8)
    assert_same_training(model, pipe_model, pipe, torch.randn(3, 6))


# -- documented errors -------------------------------------------------------------------

def test_not_sequential():
    with pytest.raises(TypeError, match="module must be nn.Sequential to be partitioned"):
        GPipe(nn.Linear(2, 2), [1], devices=["cpu"])


def test_balance_mismatch_hints_auto_balance():
    with pytest.raises(ValueError) as info:
        GPipe(make_model(2), [1, 1], devices=["cpu"] * 2)
    msg = str(info.value)
    assert "module and sum of balance have different length (module: 4, sum of balance: 2)" in msg
    assert "balance_by_time" in msg


def test_balance_required_and_positive():
    with pytest.raises(ValueError, match="balance is required"):
        GPipe(make_model(2), devices=["cpu"])
    with pytest.raises(ValueError, match="all balance numbers must be positive integer"):
        GPipe(make_model(2), [4, 0], devices=["cpu"] * 2)


def test_too_few_devices():
    with pytest.raises(IndexError, match="too few devices to hold given partitions \\(devices: 1, partitions: 2\\)"):
        GPipe(make_model(2), [2, 2], devices=["cpu"])


def test_bad_chunks_and_checkpoint():
    with pytest.raises(ValueError, match="number of chunks must be positive integer"):
        GPipe(make_model(2), [4], devices=["cpu"], chunks=0)
    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', or 'never'"):
        GPipe(make_model(2), [4], devices=["cpu"], checkpoint="sometimes")


def test_duplicate_parameters_refused():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    a.weight = b.weight
    with pytest.raises(ValueError, match="module with duplicate parameters in distinct children is not supported"):
        GPipe(nn.Sequential(a, b), [1, 1], devices=["cpu"] * 2)


def test_duplicate_children_refused():
    a = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="module with duplicate children is not supported"):
        GPipe(nn.Sequential(a, a), [1, 1], devices=["cpu"] * 2)


def test_moving_denied():
    pipe = GPipe(make_model(2), [4], devices=["cpu"])
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"),
                 lambda: pipe.to(torch.device("cpu")), lambda: pipe.to(device="cpu"),
                 lambda: pipe.to(torch.zeros(1))):
        with pytest.raises(TypeError, match="denied to move parameters and buffers"):
            move()
    assert pipe.to(torch.float64) is pipe  # dtype changes stay allowed
    assert next(pipe.parameters()).dtype == torch.float64


def test_input_type_checked():
    pipe = GPipe(make_model(2), [4], devices=["cpu"])
    with pytest.raises(TypeError, match="expected Tensor or Tuple\\[Tensor, ...\\], but got str"):
        pipe("hello")
    with pytest.raises(TypeError, match="but got list"):
        pipe([torch.zeros(1, 6)])
