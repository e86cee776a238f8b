"""Capture fallbacks never silently produce a lopsided plan (issue #8, item 10).

* GPT-2 with its default config (``use_cache=True``) returns a ``DynamicCache``: torch.fx
  cannot trace it and torch.export refused the cache in the output, so the whole
  ``transformer`` became one opaque leaf and stage 0 held every block. Export now takes the
  cache apart into its key/value tensors and the output spec rebuilds it: the plan splits
  exactly as with ``use_cache=False``, and the pipeline returns the same cache as eager.
* A child fx cannot trace but torch.export can is split finely (same per-stage parameter
  bytes as a traceable twin).
* Where one opaque node still makes a stage far slower than the mean, a
  :class:`~fxpipe.errors.BalanceWarning` (and a line in ``print(plan)``) names it, says why
  it is opaque and what to do.
* Outputs that cannot be returned faithfully (caches holding other tensors, objects holding
  tensors) are refused with a :class:`~fxpipe.TraceError` saying to pass ``use_cache=False``.

Every pipeline is compared with the eager model: outputs and every parameter gradient.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from fxpipe.errors import BalanceWarning

from exact import assert_grads_equal

TOL = dict(rtol=1e-4, atol=1e-5)  # outputs: kernels run at the micro-batch size; gradients: exact.py
MODES_CHUNKS = [("always", 3), ("except_last", 2), ("never", 3)]


def weighted(t: torch.Tensor, k: float = 1.0) -> torch.Tensor:
    return (t * torch.linspace(-1, 1, t.numel()).view_as(t) * k).sum()


def stage_param_bytes(pipe: fxpipe.Pipeline) -> list[int]:
    return [st.param_bytes for st in pipe.plan.stages]


def build(model: nn.Module, sample, n_stages: int, **options) -> tuple[fxpipe.Pipeline, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = fxpipe.pipeline(model, sample, n_stages, devices=["cpu"] * n_stages, balance_by="params", **options)
    return pipe, [w for w in caught if issubclass(w.category, BalanceWarning)]


# -- GPT-2, default config -------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def gpt2(**overrides) -> nn.Module:
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=32, **overrides)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()  # eval: the default dropout off, for exactness


def gpt2_ids(batch: int = 6, seq: int = 8) -> torch.Tensor:
    return torch.randint(0, 100, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def no_cache_split() -> list[int]:
    pipe, _ = build(gpt2(use_cache=False), gpt2_ids(), 3)
    return stage_param_bytes(pipe)


def assert_same_cache(got, expected) -> None:
    assert type(got) is type(expected)
    assert [type(x) for x in got.layers] == [type(x) for x in expected.layers]
    for a, b in zip(got.layers, expected.layers):
        assert sorted(vars(a)) == sorted(vars(b))
        for key in vars(b):
            if key in ("keys", "values"):
                torch.testing.assert_close(getattr(a, key), getattr(b, key), **TOL)
            else:
                assert getattr(a, key) == getattr(b, key), key
    assert got.get_seq_length() == expected.get_seq_length()


@pytest.mark.parametrize("checkpoint,chunks", MODES_CHUNKS)
def test_gpt2_default_config_splits_evenly_and_matches_eager(checkpoint, chunks, no_cache_split):
    model = gpt2()
    assert model.config.use_cache  # the default
    ref = copy.deepcopy(model)
    ids = gpt2_ids()
    pipe, balance = build(model, ids, 3, chunks=chunks, checkpoint=checkpoint)

    assert pipe.capture.method == "export"
    assert stage_param_bytes(pipe) == no_cache_split  # as even as with use_cache=False
    assert max(stage_param_bytes(pipe)) < 0.5 * sum(stage_param_bytes(pipe))
    assert not balance and "warning:" not in str(pipe.plan)

    out = pipe(ids)
    expected = ref(ids)
    assert type(out) is type(expected) and list(out.keys()) == list(expected.keys())
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    assert_same_cache(out.past_key_values, expected.past_key_values)

    def loss(o):  # LM loss, plus every logit and every cached key/value tensor with its own weight
        logits = o.logits
        lm = F.cross_entropy(logits[:, :-1].reshape(-1, 100), ids[:, 1:].reshape(-1))
        cached = sum(weighted(layer.keys, 0.3) + weighted(layer.values.sin()) for layer in o.past_key_values.layers)
        return lm + 1e-2 * (weighted(logits) + cached)

    loss(out).backward()
    loss(expected).backward()
    assert_grads_equal(model, ref)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied, one gradient

    # The cache works for the next step as eager's does.
    nxt = torch.randint(0, 100, (ids.shape[0], 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        step = ref(nxt, past_key_values=out.past_key_values)
        step_ref = ref(nxt, past_key_values=expected.past_key_values)
    torch.testing.assert_close(step.logits, step_ref.logits, **TOL)


def test_gpt2_kept_whole_by_leaf_modules_warns_and_says_what_to_do():
    model = gpt2(use_cache=False)
    ref = copy.deepcopy(model)
    ids = gpt2_ids()
    pipe, balance = build(model, ids, 3, chunks=2, leaf_modules=["transformer"])
    assert len(balance) == 1
    msg = str(balance[0].message)
    assert "stage 0" in msg and "'transformer'" in msg and "GPT2Model" in msg
    assert "leaf_modules" in msg and "Remove 'transformer'" in msg
    assert f"warning: {msg.removeprefix('fxpipe: ')}" in str(pipe.plan).splitlines()
    # coarse, but still exact
    out, expected = pipe(ids), ref(ids)
    torch.testing.assert_close(out.logits, expected.logits, **TOL)
    weighted(out.logits).backward()
    weighted(expected.logits).backward()
    assert_grads_equal(model, ref)


# -- transformers caches built by the model itself -------------------------------------------------
class CachingAttention(nn.Module):
    """A toy decoder layer stack that fills a transformers cache like HF models do."""

    def __init__(self, layers: int = 3, d: int = 8, sliding: int | None = None) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d) for _ in range(layers))
        self.sliding = sliding

    def forward(self, x: torch.Tensor):
        cu = transformers.cache_utils
        if self.sliding is None:
            cache = cu.DynamicCache()
        else:
            cache = cu.Cache(layers=[cu.DynamicSlidingWindowLayer(sliding_window=self.sliding) for _ in self.qkv])
        for i, proj in enumerate(self.qkv):
            q, k, v = proj(x).chunk(3, dim=-1)
            k, v = cache.update(k.unsqueeze(1), v.unsqueeze(1), i)
            att = torch.softmax(q.unsqueeze(1) @ k.transpose(-1, -2), dim=-1)
            x = x + (att @ v).squeeze(1)
        return {"hidden": x, "cache": cache}


@pytest.mark.parametrize("checkpoint,chunks", MODES_CHUNKS)
def test_model_returning_a_dynamic_cache_matches_eager(checkpoint, chunks):
    torch.manual_seed(0)
    model = CachingAttention()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 5, 8)
    pipe, _ = build(model, x, 3, chunks=chunks, checkpoint=checkpoint)
    assert pipe.capture.method == "export"
    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out["hidden"], expected["hidden"], **TOL)
    assert_same_cache(out["cache"], expected["cache"])

    def loss(o):  # the hidden states and every cached key/value tensor
        return weighted(o["hidden"]) + sum(weighted(layer.keys, 0.3) + weighted(layer.values, 0.5)
                                           for layer in o["cache"].layers)

    loss(out).backward()
    loss(expected).backward()
    assert_grads_equal(model, ref)


def test_cache_holding_other_tensors_is_refused_with_use_cache_advice():
    model = CachingAttention(sliding=4)  # sliding-window layers hold a window-size tensor
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.pipeline(model, torch.randn(4, 5, 8), 2, devices=["cpu"] * 2, balance_by="params")
    msg = str(info.value)
    assert "DynamicSlidingWindowLayer" in msg and "_sliding_window_tensor holds tensors" in msg
    assert "use_cache=False" in msg
    assert isinstance(info.value, fxpipe.FxpipeError)


class Holder:
    def __init__(self, y: torch.Tensor) -> None:
        self.y = y


class ReturnsHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Holder:
        return Holder(self.lin(x))


def test_object_holding_tensors_in_the_output_is_refused():
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.pipeline(ReturnsHolder(), torch.randn(4, 4), 2, devices=["cpu"] * 2, balance_by="params")
    msg = str(info.value)
    assert "Holder holding tensors" in msg and "return tensors" in msg and "use_cache" not in msg


# -- a child torch.fx cannot trace ----------------------------------------------------------------
class Body(nn.Module):
    """Six blocks; ``strict`` adds a shape check torch.fx cannot trace (export can)."""

    def __init__(self, d: int = 16, strict: bool = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(6))
        self.strict = strict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.strict and x.dim() != 2:  # a Proxy's dim() as a Python bool: fx fails here
            raise ValueError("expected a 2-d input")
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return x


class WithBody(nn.Module):
    def __init__(self, strict: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.body = Body(strict=strict)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


@pytest.mark.parametrize("checkpoint,chunks", MODES_CHUNKS)
def test_untraceable_child_is_split_finely(checkpoint, chunks):
    torch.manual_seed(0)
    model = WithBody(strict=True)
    twin = WithBody(strict=False)
    twin.load_state_dict(model.state_dict())
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe, balance = build(model, x, 4, chunks=chunks, checkpoint=checkpoint)
    traceable, _ = build(twin, x, 4)
    assert traceable.capture.method == "fx"
    assert stage_param_bytes(pipe) == stage_param_bytes(traceable)  # body cut like its traceable twin
    assert not balance
    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out, expected, **TOL)
    weighted(out).backward()
    weighted(expected).backward()
    assert_grads_equal(model, ref)


class Gated(nn.Module):
    """Control flow on a parameter's value: neither torch.fx nor torch.export can trace it
    (and, unlike a branch on the input, every micro-batch takes the same branch)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x)) if block.bias.sum() > 0 else -torch.tanh(block(x))
        return x


class WithGated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.gated = Gated()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gated(self.inp(x)))


@pytest.mark.parametrize("checkpoint,chunks", MODES_CHUNKS)
def test_unsplittable_opaque_child_warns_naming_it_and_stays_exact(checkpoint, chunks):
    torch.manual_seed(0)
    model = WithGated()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 8)
    pipe, balance = build(model, x, 3, chunks=chunks, checkpoint=checkpoint)
    assert pipe.capture.method == "fx" and pipe.capture.leaves == ["gated"]
    assert len(balance) == 1
    msg = str(balance[0].message)
    assert "'gated'" in msg and "Gated" in msg and "torch.fx could not trace it" in msg
    assert "data-dependent control flow" in msg and "submodule of their own" in msg
    assert "x the mean stage" in msg
    plan_text = str(pipe.plan)
    assert any(line.startswith("warning: ") and "'gated'" in line for line in plan_text.splitlines())
    # saved and loaded plans keep the warning
    assert "'gated'" in str(fxpipe.Plan.from_json(pipe.plan.to_json()))

    out, expected = pipe(x), ref(x)
    torch.testing.assert_close(out, expected, **TOL)
    weighted(out).backward()
    weighted(expected).backward()
    assert_grads_equal(model, ref)


def test_balanced_plans_carry_no_warning():
    torch.manual_seed(0)
    pipe, balance = build(WithBody(strict=False), torch.randn(6, 8), 3)
    assert not balance and "warning" not in str(pipe.plan)
