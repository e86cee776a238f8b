"""runtime/_microbatch.py: Batch, and scatter/gather over tensors, tuples and pytrees."""

import pytest
import torch

from fxpipe.runtime import _microbatch as microbatch
from fxpipe.runtime._microbatch import Batch


def test_scatter_like_torch_chunk():
    x = torch.arange(10)
    parts = microbatch.scatter(x, 4)
    assert [b.value.tolist() for b in parts] == [t.tolist() for t in x.chunk(4)]
    torch.testing.assert_close(microbatch.gather(parts), x)
    assert len(microbatch.scatter(torch.zeros(3, 2), 8)) == 3  # fewer samples than chunks


def test_scatter_tuple_rejects_mismatched_batch_sizes():
    with pytest.raises(ValueError, match=r"input\[0\] has 4, input\[1\] has 5"):
        microbatch.scatter((torch.zeros(4), torch.zeros(5)), 2)


def test_scatter_tree_pytrees():
    args = (torch.arange(6).view(6, 1), {"mask": torch.ones(6), "scale": 2.0})
    kwargs = {"flag": True, "none": None, "t": torch.tensor(3.0)}
    micro, spec = microbatch.scatter_tree(args, kwargs, 4)
    assert len(micro) == 3  # chunk size 2
    for leaves in micro:
        a, k = torch.utils._pytree.tree_unflatten(leaves, spec)
        assert a[0].shape == (2, 1) and a[1]["mask"].shape == (2,)
        assert a[1]["scale"] == 2.0 and k["flag"] is True and k["none"] is None
        assert k["t"].item() == 3.0  # 0-dim tensors go to every micro-batch
    outs = [[m[0] * 2, "label", m[1]] for m in micro]
    gathered = microbatch.gather_tree(outs)
    torch.testing.assert_close(gathered[0], args[0] * 2)
    assert gathered[1] == "label"


def test_scatter_tree_names_mismatched_leaves():
    with pytest.raises(ValueError) as info:
        microbatch.scatter_tree((torch.zeros(4, 2),), {"mask": torch.zeros(3)}, 2)
    assert "[0][0] has 4" in str(info.value) and "['mask'] has 3" in str(info.value)


def test_gather_tree_refuses_scalars():
    with pytest.raises(ValueError, match="0-dim tensor"):
        microbatch.gather_tree([[torch.tensor(1.0)], [torch.tensor(2.0)]], names=["loss"])


def test_batch_call_spread():
    b = Batch((torch.ones(2), 3))
    assert b.call(lambda x, k: (x * k, k), spread=True).values[1] == 3
    assert b.anchor() == 0
    assert Batch((1, torch.zeros(2, dtype=torch.long))).anchor() is None
