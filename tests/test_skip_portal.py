"""Portals under the microscope: how often a skip tensor is copied, where it travels, how long
the portal keeps it, and that nothing keeps it alive afterwards.

Instrumentation (all CPU, ``devices=['cpu'] * n``): ``fxpipe.runtime._portal.move`` is the only
way a portal moves a tensor, ``PortalCopy.forward``/``backward`` are wrapped to count copies
per (skip, micro-batch), and forward (pre-)hooks on each partition record what crosses
partition boundaries.
"""

from __future__ import annotations

import collections
import copy
import gc

import pytest
import torch

import fxpipe.runtime._portal as portal_mod
from fxpipe import GPipe, is_recomputing
from fxpipe.runtime._pipeline import PipelineRunner
from fxpipe.runtime._portal import Portal, PortalCopy

from exact import assert_close_scaled, assert_grads_equal
from skip_models import (
    DTYPE, IN_WIDTH, SKIP_WIDTHS, Decoder, Encoder, WeakRecorder, crossing_skips, skippables, unet,
)

MODES = ["always", "except_last", "never"]
# Same-partition skips, neighbours, and a skip over three intermediate partitions.
BALANCES = [[5, 3], [2, 2, 2, 2], [1, 1, 1, 2, 3]]
BATCH = 7


def _input(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, IN_WIDTH, generator=g, dtype=DTYPE)


def _gpipe(model, balance, chunks, mode):
    return GPipe(model, balance, devices=["cpu"] * len(balance), chunks=chunks, checkpoint=mode)


class StashLog:
    """Strong references to the stashed skip tensors of the first forward pass, by
    (label, micro-batch). Recomputations stash new tensors; those are not recorded."""

    def __init__(self, model):
        self.by_id = {}
        self.recomputed = []
        self.count = collections.Counter()
        for module in skippables(model):
            if isinstance(module, Encoder.module_cls):
                module.on_stash = self

    def __call__(self, label, tensor):
        if is_recomputing():
            self.recomputed.append(tensor)
            return
        key = (label, self.count[label])
        self.count[label] += 1
        self.by_id[id(tensor)] = (key, tensor)

    def key_of(self, tensor):
        """The key of a stashed tensor, or of a view of it with the same data (portals keep
        their values detached)."""
        entry = self.by_id.get(id(tensor))
        if entry is None:
            entry = next((e for e in self.by_id.values() if e[1].data_ptr() == tensor.data_ptr()
                          and e[1].shape == tensor.shape), None)
        return None if entry is None else entry[0]

    def storages(self, recomputed=False):
        tensors = [t for _, t in self.by_id.values()] + (self.recomputed if recomputed else [])
        return {t.untyped_storage().data_ptr() for t in tensors}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", BALANCES, ids=str)
def test_each_skip_is_copied_once_per_microbatch(monkeypatch, balance, mode):
    chunks = 3
    model = unet()
    log = StashLog(model)
    moves = {"forward": [], "backward": []}
    phase = ["forward"]
    copied = collections.Counter()       # PortalCopy.forward per (label, micro-batch)
    grads_back = collections.Counter()   # PortalCopy.backward per (label, micro-batch)
    portal_key = {}

    real_move = portal_mod.move

    def spy_move(tensors, from_stream, to_stream):
        moves[phase[0]].append(list(tensors))
        return real_move(tensors, from_stream, to_stream)

    real_forward, real_backward = PortalCopy.forward, PortalCopy.backward

    def forward(ctx, portal, prev_stream, next_stream, phony):
        key = log.key_of(portal.tensor)
        assert key is not None, "PortalCopy moved a tensor that was never stashed"
        portal_key[id(portal)] = key
        copied[key] += 1
        return real_forward(ctx, portal, prev_stream, next_stream, phony)

    def backward(ctx, grad_phony):
        grads_back[portal_key[id(ctx.portal)]] += 1
        phase[0] = "backward"
        try:
            return real_backward(ctx, grad_phony)
        finally:
            phase[0] = "forward"

    monkeypatch.setattr(portal_mod, "move", spy_move)
    monkeypatch.setattr(PortalCopy, "forward", staticmethod(forward))
    monkeypatch.setattr(PortalCopy, "backward", staticmethod(backward))

    pipe = _gpipe(model, balance, chunks, mode)
    y = pipe(_input())
    crossing = crossing_skips(balance)
    expected = {(label, i): 1 for label in crossing for i in range(chunks)}
    assert dict(copied) == expected
    # Every forward move is one stashed tensor of a crossing skip, moved once.
    moved = collections.Counter()
    for tensors in moves["forward"]:
        assert len(tensors) == 1
        key = log.key_of(tensors[0])
        assert key is not None and key[0] in crossing
        moved[key] += 1
    assert dict(moved) == expected
    assert moves["backward"] == []

    y.sum().backward()
    assert dict(grads_back) == expected        # the gradient goes back once per copy
    assert len(moves["backward"]) == len(expected)
    assert dict(copied) == expected            # recomputation copies nothing again




def test_portal_copy_backward_moves_the_skip_gradient(monkeypatch):
    # PortalCopy.backward must move the skip's gradient, which PortalOrange.backward left in
    # the portal: PortalOrange.backward has to come first, for every micro-batch.
    seen = []
    real_backward = PortalCopy.backward

    def backward(ctx, grad_phony):
        grads = ctx.portal.grad  # one gradient per tensor leaf of the skip value
        seen.append(None if grads is None or grads[0] is None else tuple(grads[0].shape))
        return real_backward(ctx, grad_phony)

    monkeypatch.setattr(PortalCopy, "backward", staticmethod(backward))
    chunks = 3
    rows = [len(c) for c in _input().chunk(chunks)]
    for balance in BALANCES:
        for mode in MODES:
            seen.clear()
            model = unet()
            _gpipe(model, balance, chunks, mode)(_input()).sum().backward()
            expected = collections.Counter(
                (rows[i], SKIP_WIDTHS[label]) for label in crossing_skips(balance) for i in range(chunks)
            )
            assert collections.Counter(seen) == expected, f"balance={balance} checkpoint={mode}: {seen}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", BALANCES, ids=str)
def test_partitions_never_receive_or_return_skip_tensors(balance, mode):
    chunks = 3
    model = unet()
    log = StashLog(model)
    popped = []
    for module in skippables(model):
        if isinstance(module, Decoder.module_cls):
            module.on_pop = lambda label, t: popped.append((label, t))

    pipe = _gpipe(model, balance, chunks, mode)
    boundary = []   # (partition, 'in'|'out', tensor)
    for j, partition in enumerate(pipe.partitions):
        partition.register_forward_pre_hook(lambda mod, args, j=j: boundary.extend((j, "in", a) for a in args))
        partition.register_forward_hook(lambda mod, args, out, j=j: boundary.append((j, "out", out)))

    y = pipe(_input())
    y.sum().backward()

    runs = len(balance) * chunks * (2 if mode != "never" else 1)
    assert len(boundary) == 2 * len(balance) * chunks + (
        2 * len(balance) * {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]
    )
    assert runs <= len(boundary)
    skip_storages = log.storages(recomputed=True)
    assert len(log.by_id) == 3 * chunks
    for j, where, t in boundary:
        assert isinstance(t, torch.Tensor)
        assert log.key_of(t) is None, f"partition {j} {where}: a stashed skip tensor"
        assert t.untyped_storage().data_ptr() not in skip_storages, f"partition {j} {where}: skip storage"
        assert t.shape[-1] not in SKIP_WIDTHS.values(), f"partition {j} {where}: skip-shaped {tuple(t.shape)}"

    # The pop side sees the very storage that was stashed (by the first pass, or by the
    # recomputation for skips inside one partition): on CPU the portal hands it over
    # without any copy, and nothing in between touched it.
    assert len(popped) == len(log.by_id) + len(log.recomputed)
    for label, t in popped:
        assert t.shape[-1] == SKIP_WIDTHS[label]
        assert t.untyped_storage().data_ptr() in skip_storages


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 3])
def test_tensor_life_and_recomputation_refill(monkeypatch, mode, chunks):
    balance = [2, 2, 2, 2]       # every skip crosses partitions
    c = len(crossing_skips(balance))
    assert c == 3
    model = unet()
    portals = []
    lives = []
    real_init, real_put = Portal.__init__, Portal.put_tensor

    def init(self, tensor, tensor_life):
        portals.append(self)
        real_init(self, tensor, tensor_life)

    def put_tensor(self, tensor, tensor_life):
        lives.append((tensor_life, is_recomputing()))
        real_put(self, tensor, tensor_life)

    monkeypatch.setattr(Portal, "__init__", init)
    monkeypatch.setattr(Portal, "put_tensor", put_tensor)

    ref = unet()
    x = _input()
    pipe = _gpipe(model, balance, chunks, mode)
    y = pipe(x)
    m = chunks
    k = {"always": m, "except_last": m - 1, "never": 0}[mode]   # checkpointed micro-batches
    assert len(portals) == c * m
    assert sorted(lives) == sorted([(3, False)] * c * k + [(2, False)] * c * (m - k))
    # After the forward: checkpointed portals keep their tensor for the recomputation of the
    # pop side (life 1); the others already handed it over (life 0, no reference kept).
    assert sorted(p.tensor_life for p in portals) == [0] * c * (m - k) + [1] * c * k
    for p in portals:
        assert (p.tensor is None) == (p.tensor_life == 0)

    y.sum().backward()
    # The recomputation of each checkpointed stash partition refills its portal once.
    assert sorted(lives) == sorted(
        [(3, False)] * c * k + [(2, False)] * c * (m - k) + [(1, True)] * c * k
    )
    for p in portals:
        assert p.tensor is None and p.tensor_life == 0 and p.grad is None

    # And the gradients are right.
    x_ref = x.clone()
    ref(x_ref).sum().backward()
    assert_grads_equal(model, ref)


def test_portal_use_after_life_raises():
    p = Portal(torch.ones(2), tensor_life=1)
    assert p.use_tensor() is not None
    assert p.tensor is None
    with pytest.raises(RuntimeError, match="tensor in portal has been removed"):
        p.use_tensor()
    p.put_tensor(torch.ones(2), 0)
    assert p.tensor is None


# ------------------------------------------------------------------------ leaks


def _recorded(model):
    rec = WeakRecorder()
    for module in skippables(model):
        if isinstance(module, Encoder.module_cls):
            module.on_stash = rec
    return rec


@pytest.mark.parametrize("ahead", [None, True], ids=["lazy", "ahead"])  # recompute_ahead: as on CPU, as on GPUs
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[5, 3], [1, 1, 1, 2, 3]], ids=str)
def test_no_reference_to_skip_after_backward(monkeypatch, balance, mode, ahead):
    monkeypatch.setattr(PipelineRunner, "recompute_ahead", ahead)
    model = unet()
    rec = _recorded(model)
    pipe = _gpipe(model, balance, 3, mode)
    y = pipe(_input().requires_grad_())
    y.sum().backward()
    recomputed = {"always": 3, "except_last": 2, "never": 0}[mode]   # of 3 micro-batches
    assert len(rec.refs) == 3 * (3 + recomputed)
    # Backward consumed every portal: nothing holds a skip tensor even while the output lives.
    gc.collect()
    assert rec.alive() == 0
    del y
    gc.collect()
    assert rec.alive() == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[5, 3], [1, 1, 1, 2, 3]], ids=str)
def test_no_reference_to_skip_after_no_grad_forward(balance, mode):
    model = unet()
    rec = _recorded(model)
    pipe = _gpipe(model, balance, 3, mode)
    with torch.no_grad():
        y = pipe(_input())
    assert len(rec.refs) == 9
    gc.collect()
    assert rec.alive() == 0          # no graph: the portal dropped it when it was popped
    del y
    gc.collect()
    assert rec.alive() == 0




@pytest.mark.parametrize("ahead", [None, True], ids=["lazy", "ahead"])
def test_no_reference_to_skip_after_forward_without_backward(monkeypatch, ahead):
    monkeypatch.setattr(PipelineRunner, "recompute_ahead", ahead)
    for mode in MODES:
        for train in (True, False):
            model = unet()
            rec = _recorded(model)
            pipe = _gpipe(model, [1, 1, 1, 2, 3], 3, mode).train(train)
            y = pipe(_input())
            assert len(rec.refs) == 9
            del y
            gc.collect()
            assert rec.alive() == 0, f"checkpoint={mode} train={train}: {rec.alive()} skips alive"


def test_stale_worker_reference_is_released_by_the_next_call():
    # The graph is released whatever the worker does next.
    model = unet()
    rec = _recorded(model)
    pipe = _gpipe(model, [1, 1, 1, 2, 3], 3, "never")
    y = pipe(_input())
    del y
    with torch.no_grad():
        pipe(_input()[:1])
    gc.collect()
    assert len(rec.refs) == 9 + 3 and rec.alive() == 0


@pytest.mark.parametrize("mode", MODES)
def test_pop_partition_that_saves_nothing_frees_the_skip_after_forward(monkeypatch, mode):
    """A checkpointed pop partition that saves nothing for backward (``x + skip``) is never
    recomputed: the use its portal kept for the recomputation is given up when its forward
    ends, so the skip tensor is not held until the whole backward is over (torchgpipe's
    tests/skip/test_leak.py checks this from inside the backward)."""
    from torch import nn

    from fxpipe.skip import pop, skippable, stash

    @skippable(stash=["skip"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("skip", x)
            return x

    @skippable(pop=["skip"])
    class Pop(nn.Module):
        def forward(self, x):
            return x + (yield pop("skip"))

    portals = []
    real_init = Portal.__init__

    def init(self, tensor, tensor_life):
        portals.append(self)
        real_init(self, tensor, tensor_life)

    monkeypatch.setattr(Portal, "__init__", init)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Stash(), Pop())
    ref = copy.deepcopy(model[0])
    pipe = GPipe(model, [2, 1], devices=["cpu"] * 2, chunks=3, checkpoint=mode)
    x = torch.randn(6, 4)
    y = pipe(x)
    assert len(portals) == 3
    for p in portals:
        assert p.tensor is None and p.tensor_life == 0
    y.sum().backward()
    h = ref(x)
    (h + h).sum().backward()
    assert_close_scaled(model[0].weight.grad, ref.weight.grad)
    assert_close_scaled(model[0].bias.grad, ref.bias.grad)
