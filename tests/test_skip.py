"""fxpipe.skip: @skippable inside and outside GPipe, verify_skippables, namespaces, the
function-call form driven through the PipelineRunner, and is_checkpointing/is_recomputing.

Everything runs on CPU with ``devices=['cpu'] * n``; the reference is always the same
skippable modules run as a plain ``nn.Sequential`` (no pipeline).
"""

from __future__ import annotations

import copy
import importlib
import itertools

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from fxpipe import GPipe
from fxpipe.runtime import _microbatch as microbatch
from fxpipe.runtime._pipeline import PipelineRunner
from fxpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from fxpipe import portals as F_skip
from fxpipe.runtime._skip_layout import SkipLayout
from fxpipe.runtime._skip_tracker import current_skip_tracker
from fxpipe.runtime._stage_portals import current_portals

from exact import assert_all_close, assert_close_scaled, assert_grads_equal
from skip_models import DTYPE, IN_WIDTH, crossing_skips, partition_of, skippables, unet

MODES = ["always", "except_last", "never"]

# balance -> what it exercises (layers: enc1 enc2 enc3 bottleneck dec3 dec2 dec1 segment)
BALANCES = {
    "2p-all-cross": [4, 4],               # every skip 0 -> 1
    "2p-3f-same": [5, 3],                 # 3f stashed and popped in partition 0
    "3p-2f3f-same": [1, 5, 2],            # 2f and 3f inside partition 1; 1f 0 -> 2 over 1
    "4p": [2, 2, 2, 2],                   # 1f 0 -> 3, 2f 0 -> 2, 3f 1 -> 2
    "5p-far": [1, 1, 1, 2, 3],            # 1f 0 -> 4 over three partitions, 2f 1 -> 4, 3f 2 -> 3
}


def _loss_weights(shape, seed=123):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=DTYPE)


def _input(batch=7, width=IN_WIDTH, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g, dtype=DTYPE)


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


def assert_same_run(model, pipe_fn, x, reference=None):
    """Runs ``reference`` (default: a deep copy of ``model``) eagerly and ``pipe_fn(model)``;
    compares outputs, input gradients and every parameter's gradient."""
    ref = copy.deepcopy(model) if reference is None else reference
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    w = _loss_weights(y_ref.shape)
    (y_ref * w).sum().backward()

    pipe = pipe_fn(model)
    x_pipe = x.clone().requires_grad_()
    y = pipe(x_pipe)
    (y * w).sum().backward()

    assert_close(y, y_ref)
    assert_close_scaled(x_pipe.grad, x_ref.grad, what="input gradient")
    grads, grads_ref = _grads(model), _grads(ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        assert grads[name] is not None, name
    assert_all_close((f"grad of {name}", grads[name], grads_ref[name]) for name in grads)
    return y


# ------------------------------------------------------------------------ equivalence


def test_balances_cover_same_and_far_partitions():
    # The table above is what it claims: some skips stay in one partition, some cross many.
    assert crossing_skips([5, 3]) == ["1f", "2f"]
    assert crossing_skips([1, 5, 2]) == ["1f"]
    assert crossing_skips([4, 4]) == ["1f", "2f", "3f"]
    assert partition_of([1, 1, 1, 2, 3], 0) == 0 and partition_of([1, 1, 1, 2, 3], 6) == 4


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("balance", list(BALANCES.values()), ids=list(BALANCES))
def test_unet_matches_plain_sequential(balance, chunks, mode):
    model = unet()
    assert_same_run(
        model,
        lambda m: GPipe(m, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=mode),
        _input(),
    )


def test_unet_runs_outside_gpipe_like_hand_written_forward():
    # The skippables outside GPipe are the reference of every test; check them against
    # the U-Net written out by hand once.
    model = unet()
    enc1, enc2, enc3, bott, dec3, dec2, dec1, seg = list(model)
    x = _input()

    def e(layer, h):
        s = torch.tanh(layer.module.lin(h))
        return layer.module.down(s), s

    def d(layer, h, s):
        return layer.module.out(torch.tanh(layer.module.up(h) + s))

    h, s1 = e(enc1, x)
    h, s2 = e(enc2, h)
    h, s3 = e(enc3, h)
    h = bott(h)
    expected = seg(d(dec1, d(dec2, d(dec3, h, s3), s2), s1))
    assert_close(model(x), expected)
    assert current_skip_tracker().tensors == {}


# The docs' "Long Skip Connections" example: Layer1 stashes its *input*, Layer8 pops it.
@skippable(stash=["skip"])
class StashInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, input):
        yield stash("skip", input)
        return torch.tanh(self.lin(input))


@skippable(pop=["skip"])
class PopAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, input):
        skip = yield pop("skip")
        return self.lin(input) + skip


def long_skip_model():
    torch.manual_seed(1)
    layers = [StashInput()] + [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(6)] + [PopAdd()]
    return nn.Sequential(*layers).to(DTYPE)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]])
def test_long_skip_of_the_input_itself(balance, mode):
    # The skip is the pipeline's input: its gradient reaches x only through the portal.
    assert_same_run(
        long_skip_model(),
        lambda m: GPipe(m, balance, devices=["cpu"] * len(balance), chunks=3, checkpoint=mode),
        _input(width=5),
    )


# ------------------------------------------------------------------------ conditional (None) skips


@skippable(stash=["skip"])
class MaybeStash(nn.Module):
    def __init__(self, condition):
        super().__init__()
        self.condition = condition
        self.lin = nn.Linear(4, 4)

    def forward(self, input):
        h = torch.tanh(self.lin(input))
        skip = h if self.condition(input) else None
        yield stash("skip", skip)
        return h * 2


@skippable(pop=["skip"])
class MaybePop(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, input):
        output = self.lin(input)
        skip = yield pop("skip")
        self.seen.append(skip is None)
        if skip is not None:
            output = output + skip
        return output


def maybe_model(condition):
    torch.manual_seed(2)
    return nn.Sequential(
        MaybeStash(condition), nn.Linear(4, 4), nn.Tanh(), MaybePop(),
    ).to(DTYPE)


CONDITIONS = {
    "always": lambda x: True,
    "never": lambda x: False,
    "even-microbatch": lambda x: x.size(0) % 2 == 0,   # 7 rows in 4 chunks: 2, 2, 2, 1
}


class ChunkedReference(nn.Module):
    """The plain model run micro-batch by micro-batch (conditions depend on the micro-batch)."""

    def __init__(self, model, chunks):
        super().__init__()
        self.model = model
        self.chunks = chunks

    def forward(self, x):
        return torch.cat([self.model(c) for c in x.chunk(self.chunks)])


def test_none_skip_outside_gpipe():
    x = _input(width=4)
    on = maybe_model(CONDITIONS["always"])
    off = maybe_model(CONDITIONS["never"])
    stash_layer, lin, tanh, pop_layer = list(off)
    h = torch.tanh(stash_layer.module.lin(x)) * 2
    assert_close(off(x), pop_layer.module.lin(tanh(lin(h))))
    assert_close(on(x), pop_layer.module.lin(tanh(lin(h))) + h / 2)
    assert pop_layer.module.seen == [True]
    assert current_skip_tracker().tensors == {}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[1, 3], [2, 2], [1, 2, 1], [4]])
@pytest.mark.parametrize("cond", list(CONDITIONS))
def test_none_skip_in_gpipe(cond, balance, mode):
    chunks = 4
    model = maybe_model(CONDITIONS[cond])
    ref_model = copy.deepcopy(model)
    assert_same_run(
        model,
        lambda m: GPipe(m, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=mode),
        _input(width=4),
        reference=_Grads(ChunkedReference(ref_model, chunks), ref_model),
    )
    # The first four calls of the pop layer are the forward passes, in micro-batch order.
    seen = model[3].module.seen
    expected = {"always": [False] * 4, "never": [True] * 4, "even-microbatch": [False, False, False, True]}[cond]
    assert seen[:4] == expected


class _Grads(nn.Module):
    """A reference whose named_parameters are those of ``params_of`` (for _grads)."""

    def __init__(self, fn, params_of):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)

    def named_parameters(self, *args, **kwargs):
        return self.fn.model.named_parameters(*args, **kwargs)


# ------------------------------------------------------------------------ verify_skippables


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def forward(self, input):
        yield stash("1to3", input)
        return input * 2


class Layer2(nn.Module):
    def forward(self, input):
        return input + 1


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def forward(self, input):
        skip = yield pop("1to3")
        return input + skip


@skippable(stash=["foo"], pop=["foo"])
class StashPopFoo(nn.Module):
    def forward(self, input):
        yield stash("foo", input)
        foo = yield pop("foo")
        return foo


HEADER = "one or more pairs of stash and pop do not match:\n\n"

FAILURES = {
    # name: (layers, exact message)
    "missing-pop": (lambda: [Layer1(), Layer2()],
                    HEADER + "* no module declared '1to3' as poppable but stashed"),
    "missing-stash": (lambda: [Layer2(), Layer3()],
                      HEADER + "* '1' declared '1to3' as poppable but it was not stashed"),
    "double-pop": (lambda: [Layer1(), Layer2(), Layer3(), Layer3()],
                   HEADER + "* '3' redeclared '1to3' as poppable but not isolated by namespace"),
    "double-stash": (lambda: [Layer1(), Layer1(), Layer2(), Layer3()],
                     HEADER + "* '1' redeclared '1to3' as stashable but not isolated by namespace"),
    "stash-and-pop": (lambda: [StashPopFoo()],
                      HEADER + "* '0' declared 'foo' both as stashable and as poppable"),
    "pop-before-stash": (lambda: [Layer3(), Layer2(), Layer1()],
                         HEADER + "* '0' declared '1to3' as poppable but it was not stashed\n"
                                  "* no module declared '1to3' as poppable but stashed"),
}


@pytest.mark.parametrize("case", list(FAILURES))
def test_verify_skippables_messages(case):
    layers, message = FAILURES[case]
    with pytest.raises(TypeError) as exc_info:
        verify_skippables(nn.Sequential(*layers()))
    assert str(exc_info.value) == message


@pytest.mark.parametrize("case", list(FAILURES))
def test_gpipe_raises_the_same_type_error(case):
    layers, message = FAILURES[case]
    model = nn.Sequential(*layers())
    with pytest.raises(TypeError) as exc_info:
        GPipe(model, [len(model)], devices=["cpu"], chunks=2)
    assert str(exc_info.value) == message
    if len(model) > 1:
        with pytest.raises(TypeError) as exc_info:
            GPipe(model, [1] * len(model), devices=["cpu"] * len(model), chunks=2)
        assert str(exc_info.value) == message


def test_verify_skippables_accepts_valid_models():
    verify_skippables(nn.Sequential(Layer1(), Layer2(), Layer3()))
    verify_skippables(nn.Sequential(Layer1(), Layer3()))
    verify_skippables(unet())
    verify_skippables(nn.Sequential(nn.Linear(2, 2), Layer2()))  # no skippables at all


def test_namespaces_fix_double_stash_and_pop():
    ns1, ns2 = Namespace(), Namespace()
    # The docs' example: two interleaved pairs, isolated.
    model = nn.Sequential(
        Layer1().isolate(ns1), Layer1().isolate(ns2), Layer2(), Layer3().isolate(ns2), Layer3().isolate(ns1),
    )
    verify_skippables(model)
    x = _input(width=3)
    # x -> 2x (ns1 stashes x) -> 4x (ns2 stashes 2x) -> 4x+1 -> +2x -> +x
    assert_close(model(x), 7 * x + 1)
    assert_same_run(
        model, lambda m: GPipe(m, [2, 1, 2], devices=["cpu"] * 3, chunks=3, checkpoint="always"), x,
    )
    # Same namespace twice is still a double stash.
    ns = Namespace()
    with pytest.raises(TypeError, match="'1' redeclared '1to3' as stashable but not isolated by namespace"):
        verify_skippables(nn.Sequential(Layer1().isolate(ns), Layer1().isolate(ns), Layer3().isolate(ns)))
    # Stash and pop in different namespaces do not pair.
    with pytest.raises(TypeError) as exc_info:
        verify_skippables(nn.Sequential(Layer1().isolate(ns1), Layer3().isolate(ns2)))
    assert str(exc_info.value) == (
        HEADER + "* '1' declared '1to3' as poppable but it was not stashed\n"
                 "* no module declared '1to3' as poppable but stashed"
    )


@skippable(stash=["alice", "bob"], pop=["carol"])
class StashStashPop(nn.Module):
    def forward(self, input):
        yield stash("alice", input * 2)
        yield stash("bob", input * 3)
        carol = yield pop("carol")
        return input + carol


@skippable(stash=["carol"])
class StashCarol(nn.Module):
    def forward(self, input):
        yield stash("carol", input * 5)
        return input


@skippable(pop=["alice", "bob"])
class PopAliceBob(nn.Module):
    def forward(self, input):
        alice = yield pop("alice")
        bob = yield pop("bob")
        return input + alice + 10 * bob


def test_isolate_only_subset():
    ns_alice, ns_bob = Namespace(), Namespace()
    ssp = StashStashPop().isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"])
    assert ssp.namespaced("alice") == (ns_alice, "alice")
    assert ssp.namespaced("bob") == (ns_bob, "bob")
    assert ssp.namespaced("carol") == (None, "carol")   # not isolated
    assert ssp.isolate(ns_alice, only=[]) is ssp       # returns the module itself

    # The pops must live in the same namespaces, name by name.
    good = PopAliceBob().isolate(ns_alice, only=["alice"]).isolate(ns_bob, only=["bob"])
    model = nn.Sequential(StashCarol(), ssp, Layer2(), good)
    verify_skippables(model)
    x = _input(width=3)
    # carol = 5x; ssp: x + 5x = 6x, stashes alice=2x, bob=3x; +1; + 2x + 30x
    assert_close(model(x), 38 * x + 1)
    assert_same_run(model, lambda m: GPipe(m, [1, 1, 2], devices=["cpu"] * 3, chunks=2, checkpoint="always"), x)

    bad = PopAliceBob().isolate(ns_alice)   # bob in ns_alice, but stashed in ns_bob
    with pytest.raises(TypeError) as exc_info:
        verify_skippables(nn.Sequential(StashCarol(), ssp, bad))
    assert str(exc_info.value) == (
        HEADER + "* '2' declared 'bob' as poppable but it was not stashed\n"
                 "* no module declared 'bob' as poppable but stashed"
    )

    with pytest.raises(ValueError, match="StashStashPop declares no skip named 'dave'"):
        StashStashPop().isolate(ns_alice, only=["dave"])


# ------------------------------------------------------------------------ skippable runtime errors


def test_undeclared_stash_or_pop_raise():
    @skippable(stash=["a"])
    class StashesB(nn.Module):
        def forward(self, input):
            yield stash("b", input)
            return input

    @skippable(stash=["a"])
    class StashesNothing(nn.Module):
        def forward(self, input):
            return input
            yield  # pragma: no cover - makes forward a generator

    with pytest.raises(RuntimeError, match="'b' has not been declared as stashable by StashesB"):
        StashesB()(torch.ones(1))
    with pytest.raises(RuntimeError, match="StashesNothing did not stash 'a'"):
        StashesNothing()(torch.ones(1))
    with pytest.raises(RuntimeError, match=r"'1to3' has not been stashed \(popped by Layer3\)"):
        Layer3()(torch.ones(1))


# ------------------------------------------------------------------------ function-call form


class FStash(nn.Module):
    def __init__(self, name, cin, cskip, cout):
        super().__init__()
        self.name = name
        self.lin = nn.Linear(cin, cskip)
        self.down = nn.Linear(cskip, cout)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        F_skip.stash(self.name, h)
        return self.down(h)


class FPop(nn.Module):
    def __init__(self, name, cin, cskip, cout):
        super().__init__()
        self.name = name
        self.up = nn.Linear(cin, cskip)
        self.out = nn.Linear(cskip, cout)

    def forward(self, x):
        u = self.up(x)
        return self.out(torch.tanh(u + F_skip.pop(self.name)))


def functional_unet():
    torch.manual_seed(3)
    return nn.Sequential(
        FStash("a", 8, 16, 12), FStash("b", 12, 20, 10), FStash("c", 10, 24, 6),
        nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
        FPop("c", 6, 24, 10), FPop("b", 10, 20, 12), FPop("a", 12, 16, 8), nn.Linear(8, 3),
    ).to(DTYPE)


def test_functional_outside_pipeline():
    model = functional_unet()
    x = _input()
    y = model(x)
    assert current_portals().values == {}
    # Same as the @skippable U-Net with the same weights.
    reference = unet()
    reference.load_state_dict({_skippable_key(k): v for k, v in model.state_dict().items()})
    assert_close(y, reference(x))
    with pytest.raises(RuntimeError, match="portal 'zzz' has not been stashed"):
        F_skip.pop("zzz")


def _skippable_key(key):
    # FStash/FPop 'i.lin.weight' -> '@skippable' nesting 'i.module.lin.weight'; the
    # bottleneck's '3.0.weight' -> '3.lin.weight'.
    index, rest = key.split(".", 1)
    if index == "3":
        return "3.lin." + rest.split(".", 1)[1]
    return f"{index}.module.{rest}" if index in {"0", "1", "2", "4", "5", "6"} else key


def _split(model, balance):
    layers, out, start = list(model), [], 0
    for size in balance:
        out.append(nn.Sequential(*layers[start:start + size]))
        start += size
    return out


# Every route crosses partitions, as every portal of generated code does.
FUNCTIONAL_BALANCES = [[4, 4], [3, 1, 4], [1, 1, 1, 2, 3]]


def _functional_routes(balance):
    return {
        name: (partition_of(balance, s), partition_of(balance, p))
        for name, s, p in [("a", 0, 6), ("b", 1, 5), ("c", 2, 4)]
    }


@pytest.mark.parametrize("checkpoint", ["all", "except_last", "none"])
@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("balance", FUNCTIONAL_BALANCES, ids=str)
def test_functional_in_pipeline(balance, chunks, checkpoint):
    model = functional_unet()
    ref = copy.deepcopy(model)
    x = _input()
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    w = _loss_weights(y_ref.shape)
    (y_ref * w).sum().backward()

    n = len(balance)
    layout = SkipLayout.from_names(n, _functional_routes(balance))
    pipeline = PipelineRunner(_split(model, balance), [torch.device("cpu")] * n, skip_layout=layout, stage_portals=True, spread=False)
    x_pipe = x.clone().requires_grad_()
    batches = microbatch.scatter(x_pipe, chunks)
    m = len(batches)
    stop = {"all": m, "except_last": m - 1, "none": 0}[checkpoint]
    pipeline.run(batches, stop)
    y = microbatch.gather(batches)
    (y * w).sum().backward()

    assert_close(y, y_ref)
    assert_close_scaled(x_pipe.grad, x_ref.grad, what="input gradient")
    assert_grads_equal(model, ref)
    assert current_portals().values == {}
    pipeline.close()


def test_functional_in_pipeline_spread_and_no_grad():
    # spread=True: each partition gets its values as positional arguments.
    torch.manual_seed(4)
    lin_a, lin_b = nn.Linear(4, 4).to(DTYPE), nn.Linear(4, 4).to(DTYPE)

    def p0(x):
        F_skip.stash("s", x * 3)
        return lin_a(x), x.sum(dim=1, keepdim=True)

    def p1(a, b):
        return torch.tanh(a) * b, b

    def p2(a, b):
        return lin_b(a) + F_skip.pop("s") + b

    def eager(x):
        F_skip.stash("s", x * 3)
        a, b = lin_a(x), x.sum(dim=1, keepdim=True)
        a, b = torch.tanh(a) * b, b
        return lin_b(a) + F_skip.pop("s") + b

    x = _input(width=4)
    pipeline = PipelineRunner([p0, p1, p2], [torch.device("cpu")] * 3,
                        skip_layout=SkipLayout.from_names(3, {"s": (0, 2)}), stage_portals=True,
                              spread=True)
    with torch.no_grad():
        batches = microbatch.scatter(x, 3)
        pipeline.run(batches, 0)
        assert_close(microbatch.gather(batches), eager(x))

    x_pipe, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    batches = microbatch.scatter(x_pipe, 3)
    pipeline.run(batches, 3)
    microbatch.gather(batches).pow(2).sum().backward()
    eager(x_ref).pow(2).sum().backward()
    assert_close_scaled(x_pipe.grad, x_ref.grad, what="input gradient")
    pipeline.close()


def test_functional_pop_without_stash_in_pipeline_raises():
    pipeline = PipelineRunner([nn.Identity(), FPop("a", 4, 4, 4).to(DTYPE)], [torch.device("cpu")] * 2,
                        skip_layout=SkipLayout.from_names(2, {"a": (0, 1)}), stage_portals=True)
    with pytest.raises(RuntimeError, match="portal 'a' has not been stashed"):
        pipeline.run(microbatch.scatter(_input(width=4), 2), 0)
    pipeline.close()


def test_skip_layout_rejects_backward_routes():
    with pytest.raises(ValueError, match="skip 'a' goes from partition 2 to 1"):
        SkipLayout.from_names(3, {"a": (2, 1)})
    layout = SkipLayout.from_names(3, {"a": (0, 2), "b": (1, 1)})
    assert list(layout.copy_policy(2)) == [(0, None, "a")]
    assert list(layout.copy_policy(1)) == []
    assert layout.requires_copy(None, "a") and not layout.requires_copy(None, "b")


def test_copy_policy_is_ordered_by_source_partition():
    """As torchgpipe's: whatever order the skips were stashed in (skip/test_inspect_skip_layout.py)."""
    layout = SkipLayout.from_names(4, {"c": (2, 3), "a": (0, 3), "b": (1, 3), "d": (0, 3)})
    assert list(layout.copy_policy(3)) == [(0, None, "a"), (0, None, "d"), (1, None, "b"), (2, None, "c")]


# ------------------------------------------------------------------------ is_checkpointing / is_recomputing


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_is_checkpointing_and_is_recomputing_in_skippables(mode, chunks):
    model = unet()
    calls = []
    for module in skippables(model):
        module.on_call = lambda label, chk, rec, kind=type(module).__name__: calls.append((kind, label, chk, rec))

    # Outside GPipe: neither.
    model(_input())
    assert len(calls) == 6 and all(not chk and not rec for _, _, chk, rec in calls)
    calls.clear()

    pipe = GPipe(model, [2, 2, 2, 2], devices=["cpu"] * 4, chunks=chunks, checkpoint=mode)
    y = pipe(_input())
    m = chunks
    checkpointed = {"always": m, "except_last": m - 1, "never": 0}[mode]
    flags = sorted((chk, rec) for _, _, chk, rec in calls)
    assert flags.count((True, False)) == 6 * checkpointed     # first pass of checkpointed micro-batches
    assert flags.count((False, False)) == 6 * (m - checkpointed)
    assert (False, True) not in flags and (True, True) not in flags
    calls.clear()

    y.sum().backward()
    assert sorted(set((chk, rec) for _, _, chk, rec in calls)) == ([(False, True)] if checkpointed else [])
    assert len(calls) == 6 * checkpointed
    # Each skippable is recomputed once per checkpointed micro-batch.
    for kind, label in itertools.product(["Encoder", "Decoder"], ["1f", "2f", "3f"]):
        assert sum(1 for k, lab, _, _ in calls if (k, lab) == (kind, label)) == checkpointed

    # Under no_grad (and in eval) there is no checkpointing.
    calls.clear()
    with torch.no_grad():
        pipe(_input())
    pipe.eval()
    pipe(_input())
    assert len(calls) == 12 * m and all(not chk and not rec for _, _, chk, rec in calls)


# -- torchgpipe's import paths (issue #18) ------------------------------------------------------

def test_torchgpipe_skip_paths_reexport_the_runtime():
    """``torchgpipe.skip.tracker`` / ``.portal`` / ``.layout`` with torchgpipe renamed to fxpipe:
    the runtime's own objects, torchgpipe's names (its misspelt tracker class included)."""
    from fxpipe.runtime import _portal as portal, _skip_layout as skip_layout, _skip_tracker as skip_tracker
    from fxpipe.skip import layout as t_layout
    from fxpipe.skip import portal as t_portal
    from fxpipe.skip import tracker as t_tracker

    skippable_module = importlib.import_module("fxpipe.skip.skippable")  # fxpipe.skip.skippable is the decorator

    assert t_tracker.SkipTracker is skip_tracker.SkipTracker
    assert t_tracker.SkipTrackerThroughPotals is t_tracker.SkipTrackerThroughPortals \
        is skip_tracker.SkipTrackerThroughPortals
    assert t_tracker.use_skip_tracker is skip_tracker.use_skip_tracker
    assert t_tracker.current_skip_tracker is skip_tracker.current_skip_tracker
    assert isinstance(t_tracker.thread_local, t_tracker.ThreadLocal)
    for name in ("Portal", "PortalBlue", "PortalOrange", "PortalCopy"):
        assert getattr(t_portal, name) is getattr(portal, name)
    assert t_layout.SkipLayout is skip_layout.SkipLayout
    assert t_layout.inspect_skip_layout is skippable_module.inspect_skip_layout
    for module in (t_tracker, t_portal, t_layout):
        assert all(hasattr(module, name) for name in module.__all__)


def test_stash_and_pop_through_a_tracker_of_the_torchgpipe_path():
    from fxpipe.skip.tracker import SkipTracker, current_skip_tracker, use_skip_tracker

    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x * 2

    @skippable(pop=["skip"])
    class Pop(nn.Module):
        def forward(self, x):
            return x + (yield pop("skip"))

    tracker = SkipTracker()
    x = torch.ones(2)
    with use_skip_tracker(tracker):
        assert current_skip_tracker() is tracker
        Stash()(x)
        assert len(tracker.tensors) == 1
        assert_close(Pop()(x), x * 2)
    assert not tracker.tensors
