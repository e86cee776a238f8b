"""capture/_call_inputs.py on a Capture directly: which flat slot each call value lands in,
and what a mismatch says. (test_messages.py checks the same errors through pipelines.)"""

import pytest
import torch
from torch import nn

from fxpipe.capture._call_inputs import fixed_dims, flatten_call, same_value
from fxpipe.capture._tracing import capture
from fxpipe.errors import InputMismatchError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=2.0, pair=()):
        return self.l(x * scale) + mask + pair[0] - pair[1]


X, M, A, B = (torch.full((2, 4), float(v)) for v in (1, 2, 3, 4))


@pytest.fixture(scope="module")
def cap():
    return capture(Net(), (X,), {"mask": M, "scale": 2.0, "pair": (A, B)})


def test_keywords_in_another_order_land_in_the_sample_slots(cap):
    flat = flatten_call(cap, (M,), {"pair": (B, A), "scale": 2.0, "mask": X})
    names = [n.name for n in cap.graph_module.graph.nodes if n.op == "placeholder"]
    slots = dict(zip(names, flat))
    assert slots["x"] is M and slots["mask"] is X
    assert slots["pair_0"] is B and slots["pair_1"] is A



def test_the_graph_on_the_flat_call_is_the_model_on_the_call():
    model = Net()
    c = capture(model, (X,), {"mask": M, "scale": 2.0, "pair": (A, B)})
    flat = flatten_call(c, (M,), {"pair": (B, A), "scale": 2.0, "mask": X})
    torch.testing.assert_close(c.graph_module(*flat)[0], model(M, mask=X, scale=2.0, pair=(B, A)))


@pytest.mark.parametrize("args, kwargs, words", [
    ((X,), {"scale": 2.0, "pair": (A, B)}, ["mask= is missing"]),
    ((X,), {"mask": M, "scale": 3.0, "pair": (A, B)}, ["scale", "2.0", "3.0"]),
    ((X,), {"mask": M, "scale": 2.0, "pair": (A,)}, ["pair"]),
    ((X, M), {"scale": 2.0, "pair": (A, B)}, ["mask"]),
    ((X,), {"mask": M, "scale": 2.0, "pair": (A, B), "other": A}, ["other"]),
])
def test_each_mismatch_names_the_argument(cap, args, kwargs, words):
    with pytest.raises(InputMismatchError) as info:
        flatten_call(cap, args, kwargs)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert "TreeSpec" not in message


def test_a_tensor_where_the_sample_had_a_value_is_refused(cap):
    with pytest.raises(InputMismatchError, match="scale"):
        flatten_call(cap, (X,), {"mask": M, "scale": torch.tensor(2.0), "pair": (A, B)})


def test_specialised_values_compare_by_value_and_type():
    assert same_value(2.0, 2.0) and same_value((1, "a"), (1, "a")) and same_value(None, None)
    assert not same_value(2.0, 3.0)
    assert not same_value(True, 1)  # a flag is not a count, though True == 1


def test_fixed_dims_of_an_fx_capture_fix_nothing(cap):
    assert cap.fixed == {}
    flat = flatten_call(cap, (torch.ones(5, 4),), {"mask": torch.ones(5, 4), "scale": 2.0,
                                                    "pair": (torch.ones(5, 4), torch.ones(5, 4))})
    assert flat[0].shape == (5, 4)


def test_an_export_capture_fixes_every_dim_but_the_split_one():
    class LenRoot(nn.Module):  # fx cannot trace len() of a tensor: torch.export captures it
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x) * len(x)

    sample = torch.ones(6, 4)
    c = capture(LenRoot(), (sample,), {})
    assert c.method == "export"
    assert fixed_dims(c.graph_module, [sample], [0]) == c.fixed
    assert c.fixed.get(0, (None, 4))[1] == 4 and c.fixed.get(0, (None, 4))[0] is None
    flatten_call(c, (torch.ones(3, 4),), {})  # another batch size: fine
    with pytest.raises(InputMismatchError, match="x"):
        flatten_call(c, (torch.ones(6, 5),), {})  # another feature size: the graph fixed it
