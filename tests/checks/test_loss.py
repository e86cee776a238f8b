"""checks/_loss.py: a merged loss must have the whole batch's gradient, not only a close value.

Unit level, on a traced graph and hand-made micro-batches, so each case isolates one reason
a merge is right or wrong (the end-to-end refusals are in test_batching / test_ignored_labels).
"""

import pytest
import torch
from torch import fx, nn

from fxpipe.checks._loss import gradient_mismatch


class SampleMean(nn.Module):
    """A mean over samples: merged by micro-batch size it is exactly the batch's loss."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, mask):
        return (self.lin(x).squeeze(-1).pow(2).mean(),)  # a captured graph returns a flat tuple


class MaskedMean(nn.Module):
    """A token mean over a mask: merged by micro-batch size it weighs tokens wrongly when the
    micro-batches count other numbers of tokens."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, mask):
        per = self.lin(x).squeeze(-1).pow(2)
        return ((per * mask).sum() / mask.sum(),)


def _sized_mean(sizes):
    def merge(i, parts):
        return sum(p * n for p, n in zip(parts, sizes)) / sum(sizes)
    return merge


def _case(model, mask):
    torch.manual_seed(0)
    gm = fx.symbolic_trace(model)
    x = torch.randn(6, 4)
    micro = [(x[:3], mask[:3]), (x[3:], mask[3:])]
    return gm, (x, mask), micro


def test_a_mean_over_samples_merged_by_size_has_the_batch_gradient():
    gm, flat, micro = _case(SampleMean(), torch.ones(6))
    assert gradient_mismatch(gm, flat, micro, [0], _sized_mean([3, 3])) is None


def test_a_token_mean_with_uneven_counts_is_found_naming_a_parameter():
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # 3 tokens, then 1
    gm, flat, micro = _case(MaskedMean(), mask)
    bad = gradient_mismatch(gm, flat, micro, [0], _sized_mean([3, 3]))
    assert bad is not None
    index, name, diff, scale = bad
    assert index == 0 and name in ("lin.weight", "lin.bias") and diff > 1e-3 * scale > 0


def test_the_same_token_mean_merged_by_its_counts_passes():
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    gm, flat, micro = _case(MaskedMean(), mask)
    counts = [3, 1]
    assert gradient_mismatch(gm, flat, micro, [0], _sized_mean(counts)) is None


@pytest.mark.parametrize("weights", [[1.01, 0.99], [2.0, 0.0]])
def test_a_misweighted_merge_of_a_sample_mean_is_found(weights):
    gm, flat, micro = _case(SampleMean(), torch.ones(6))

    def merge(i, parts):
        return sum(p * w for p, w in zip(parts, weights)) / 2
    assert gradient_mismatch(gm, flat, micro, [0], merge) is not None


def test_nothing_to_compare_without_trainable_parameters_or_indices():
    gm, flat, micro = _case(SampleMean(), torch.ones(6))
    assert gradient_mismatch(gm, flat, micro, [], _sized_mean([3, 3])) is None
    for p in gm.parameters():
        p.requires_grad_(False)
    assert gradient_mismatch(gm, flat, micro, [0], _sized_mean([3, 3])) is None


def test_nothing_accumulates_into_the_parameters():
    gm, flat, micro = _case(MaskedMean(), torch.ones(6))
    gradient_mismatch(gm, flat, micro, [0], _sized_mean([3, 3]))
    assert all(p.grad is None for p in gm.parameters())
