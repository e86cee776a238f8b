"""loss.gradient_mismatch on its own: a merged loss must carry the whole batch's gradient.

test_ignored_labels.py and test_batching.py reach this check through pipelines, where the
value check and the counted-labels merge run first. Here it is called directly on a traced
graph, so its own contract is isolated: a mean over equal micro-batches is accepted (float
rounding included), a token mean whose micro-batches hold uneven token counts, merged by a
plain mean, is refused although its value is close, the report names the output and a
parameter with the sizes of the difference, and outputs or parameters that cannot carry a
gradient are passed over without accumulating anything.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from fxpipe.checks._loss import gradient_mismatch

VOCAB = 50


class Lm(nn.Module):
    """A tiny language-model head returning (sample mean, token mean over a mask, a value no
    parameter reaches)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, x, target, mask):
        logits = self.head(torch.tanh(self.emb(x)))  # (batch, tokens, vocab)
        ce = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")  # (batch, tokens)
        per_sample = ce.mean()
        per_token = (ce * mask).sum() / mask.sum()
        return per_sample, per_token, x.mean()


def _graph() -> fx.GraphModule:
    torch.manual_seed(0)
    return fx.symbolic_trace(Lm())


def _inputs(mask: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    b, t = mask.shape
    return [torch.randn(b, t, 6, generator=g), torch.randint(0, VOCAB, (b, t), generator=g), mask]


def _split(flat: list[torch.Tensor], k: int) -> list[list[torch.Tensor]]:
    return [list(parts) for parts in zip(*(v.chunk(k) for v in flat))]


def _mean(i: int, parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts).mean()


EVEN = torch.ones(8, 5)
UNEVEN = torch.ones(8, 5)
UNEVEN[:4, 1:] = 0  # the first half holds 4 tokens, the second 20


def test_a_mean_over_equal_micro_batches_is_accepted() -> None:
    gm, flat = _graph(), _inputs(EVEN)
    assert gradient_mismatch(gm, flat, _split(flat, 4), [0], _mean) is None
    # the token mean is a sample mean when every micro-batch holds as many tokens
    assert gradient_mismatch(gm, flat, _split(flat, 4), [1], _mean) is None


def test_rounding_differences_are_within_the_tolerance() -> None:
    # the merged gradient is not bitwise the whole batch's (float32 sums in another order),
    # and the check must not mistake that for a wrong weighting
    gm, flat = _graph(), _inputs(EVEN)
    params = list(gm.parameters())
    whole = torch.autograd.grad(gm(*flat)[0], params)
    merged = torch.autograd.grad(torch.stack([gm(*m)[0] for m in _split(flat, 4)]).mean(), params)
    assert not all(torch.equal(a, b) for a, b in zip(whole, merged))
    assert gradient_mismatch(gm, flat, _split(flat, 4), [0], _mean) is None


def test_a_token_mean_with_uneven_counts_is_refused_though_its_value_is_close() -> None:
    gm, flat = _graph(), _inputs(UNEVEN)
    micro = _split(flat, 2)
    with torch.no_grad():
        whole = gm(*flat)[1]
        merged = _mean(1, [gm(*m)[1] for m in micro])
    # freshly initialised: every token costs about log(VOCAB), so the values nearly agree
    assert abs(float(whole - merged)) < 0.05 * float(whole)
    got = gradient_mismatch(gm, flat, micro, [1], _mean)
    assert got is not None
    i, name, diff, scale = got
    assert i == 1 and name in dict(gm.named_parameters())
    assert scale > 0 and diff > 0.1 * scale  # a weighting error, not rounding
    # merged as the pipeline merges a counted mean (weighted by tokens), it is the batch's
    counts = [float(m[2].sum()) for m in micro]

    def weighted(i: int, parts: list[torch.Tensor]) -> torch.Tensor:
        return sum(p * c for p, c in zip(parts, counts)) / sum(counts)

    assert gradient_mismatch(gm, flat, micro, [1], weighted) is None


def test_the_first_mismatching_output_is_reported() -> None:
    gm, flat = _graph(), _inputs(UNEVEN)
    micro = _split(flat, 2)
    assert gradient_mismatch(gm, flat, micro, [0], _mean) is None  # the sample mean is fine
    assert gradient_mismatch(gm, flat, micro, [0, 1], _mean)[0] == 1
    assert gradient_mismatch(gm, flat, micro, [0], lambda i, parts: torch.stack(parts).sum())[0] == 0


def test_what_cannot_carry_a_gradient_is_passed_over() -> None:
    gm, flat = _graph(), _inputs(UNEVEN)
    micro = _split(flat, 2)
    # no parameter reaches output 2; a merge that is not a tensor cannot be compared
    assert gradient_mismatch(gm, flat, micro, [2], lambda i, parts: torch.stack(parts).sum()) is None
    assert gradient_mismatch(gm, flat, micro, [1], lambda i, parts: 0.0) is None
    assert gradient_mismatch(gm, flat, micro, [], _mean) is None
    # frozen parameters are not compared: with all of them frozen there is nothing to check
    for p in gm.parameters():
        p.requires_grad_(False)
    assert gradient_mismatch(gm, flat, micro, [1], _mean) is None


def test_only_trainable_parameters_are_named() -> None:
    gm, flat = _graph(), _inputs(UNEVEN)
    gm.head.weight.requires_grad_(False)
    gm.head.bias.requires_grad_(False)
    _, name, _, _ = gradient_mismatch(gm, flat, _split(flat, 2), [1], _mean)
    assert name.startswith("emb.")


def test_nothing_is_accumulated() -> None:
    gm, flat = _graph(), _inputs(UNEVEN)
    with torch.no_grad():  # the check turns gradients on itself
        assert gradient_mismatch(gm, flat, _split(flat, 2), [1], _mean) is not None
    assert all(p.grad is None for p in gm.parameters())


@pytest.mark.parametrize("k", [2, 4])
def test_sums_of_sums_are_accepted_and_sums_of_means_are_not(k: int) -> None:
    class Total(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 1, bias=False)

        def forward(self, x):
            y = self.lin(x).squeeze(-1)
            return y.sum(), y.mean()

    gm = fx.symbolic_trace(Total())
    flat = [torch.randn(8, 6)]
    micro = _split(flat, k)

    def add(i: int, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(parts).sum()

    assert gradient_mismatch(gm, flat, micro, [0], add) is None
    got = gradient_mismatch(gm, flat, micro, [1], add)
    assert got is not None and got[0] == 1
    assert got[1] == "lin.weight" and got[2] == pytest.approx((k - 1) * got[3], rel=1e-4)  # k times the gradient


class ZeroRouter(nn.Module):
    """A Switch-style load-balancing loss, ``(p.mean((0, 1)) ** 2).sum()``: a nonlinear function
    of a mean over the batch. With the router's weight at zero (a common init) every token is
    routed alike, so the micro-batches agree with the batch in value and gradient at these
    weights, and nowhere else."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.experts = experts
        self.emb = nn.Embedding(20, 16)
        self.router = nn.Linear(16, experts)
        nn.init.zeros_(self.router.weight)
        self.head = nn.Linear(16, 20)

    def forward(self, ids, labels):
        h = self.emb(ids)
        p = torch.softmax(self.router(h), -1)
        logits = self.head(h * p.max(-1, keepdim=True).values)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss + 0.1 * self.experts * (p.mean((0, 1)) ** 2).sum(),)


def test_a_batch_mixing_loss_exact_only_at_its_initial_weights_is_refused() -> None:
    torch.manual_seed(0)
    gm = fx.symbolic_trace(ZeroRouter())
    flat = [torch.randint(0, 20, (8, 6)), torch.randint(0, 20, (8, 6))]
    before = {k: v.clone() for k, v in gm.state_dict().items()}
    rng = torch.get_rng_state()
    got = gradient_mismatch(gm, flat, _split(flat, 2), [0], _mean)
    assert got is not None and got[1].startswith("router."), got
    assert all(torch.equal(before[k], v) for k, v in gm.state_dict().items())  # the nudge is put back exactly
    assert torch.equal(torch.get_rng_state(), rng)  # and draws from a generator of its own


def test_a_pipeline_is_refused_for_it_at_the_build() -> None:
    import fxpipe
    from fxpipe.errors import MicroBatchError

    class Returning(ZeroRouter):
        def forward(self, ids, labels):
            return {"loss": super().forward(ids, labels)[0]}

    torch.manual_seed(0)
    model = Returning()
    sample = (torch.randint(0, 20, (8, 6)), torch.randint(0, 20, (8, 6)))
    with pytest.raises(MicroBatchError, match=r"gradient is not the full batch's at weights near the model's"):
        fxpipe.pipeline(model, sample, 2, chunks=2, devices=["cpu"] * 2, output_merge={"loss": "mean"}, progress=False)


def test_a_model_that_cannot_run_at_nudged_weights_is_checked_at_its_own() -> None:
    """A parameter read as an index (here a learnable-looking table of positions) breaks when
    nudged; the check falls back to the model's own weights instead of failing the build."""

    class Indexed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 4)
            self.where = nn.Parameter(torch.tensor([0.0, 3.0]), requires_grad=False)

        def forward(self, x):
            picked = self.lin(x)[:, self.where.long()]  # nudged, 3.0 may become 3.2 -> 3, or 2.9 -> 2
            if not torch.equal(self.where, self.where.round()):
                raise RuntimeError("positions must be whole numbers")
            return (picked.pow(2).mean(),)

    gm = Indexed()
    flat = [torch.randn(8, 6)]
    assert gradient_mismatch(gm, flat, _split(flat, 2), [0], _mean) is None
