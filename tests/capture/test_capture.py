"""capture(): contract of the flat GraphModule, fallbacks and error messages."""

from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

import fxpipe
from fxpipe.capture._tracing import Capture, TraceError, capture, flatten_output, retarget_devices
try:
    import zoo  # tests/ on sys.path (pytest rootdir-less layout)
    from exact import assert_all_close
except ImportError:  # pragma: no cover - tests imported as a package
    from tests import zoo
    from tests.exact import assert_all_close


def _float_leaves(out: object) -> list[torch.Tensor]:
    return [t for t in flatten_output(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _loss(out: object) -> torch.Tensor:
    return sum((t.double() ** 2).mean() for t in _float_leaves(out))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_matches_eager(model: nn.Module, args: tuple, kwargs: dict, c: Capture, seed: int = 0) -> None:
    """Captured graph == eager model: outputs (via out_spec), grads, buffers."""
    ref_model = copy.deepcopy(model)
    flat = c.flatten_inputs(args, kwargs)
    torch.manual_seed(seed)
    out = c.unflatten_output(c.graph_module(*flat))
    torch.manual_seed(seed)
    ref = ref_model(*args, **kwargs)
    assert type(out) is type(ref)
    got_leaves, got_spec = flatten_output(out)
    ref_leaves, ref_spec = flatten_output(ref)
    assert got_spec == ref_spec
    for a, b in zip(got_leaves, ref_leaves):
        torch.testing.assert_close(a, b)
    _loss(out).backward()
    _loss(ref).backward()
    got, want = _grads(model), _grads(ref_model)
    assert got.keys() == want.keys() and got, "no gradient reached the model's parameters"
    assert_all_close((f"grad of {name}", got[name], want[name]) for name in want)
    for (name, a), (_, b) in zip(model.named_buffers(), ref_model.named_buffers()):
        torch.testing.assert_close(a, b, msg=name)


def check_shares_state(model: nn.Module, c: Capture) -> None:
    gm = c.graph_module
    for node in gm.graph.nodes:
        if node.op == "call_module":
            assert gm.get_submodule(node.target) is model.get_submodule(node.target)
        elif node.op == "get_attr":
            try:
                want = model.get_parameter(node.target)
            except AttributeError:
                want = model.get_buffer(node.target)
            assert getattr_path(gm, node.target) is want
    assert {id(p) for p in gm.parameters()} <= {id(p) for p in model.parameters()}


def getattr_path(obj: object, target: str) -> object:
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def check_meta(c: Capture) -> None:
    nodes = list(c.graph_module.graph.nodes)
    assert all("fxpipe_module" in n.meta for n in nodes)
    compute = [n for n in nodes if n.op in ("call_module", "call_function", "call_method")]
    assert compute and all(n.meta.get("stack_trace") for n in compute)
    out = nodes[-1]
    assert out.op == "output" and isinstance(out.args[0], tuple)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_zoo_captures_with_fx_and_matches_eager(name: str) -> None:
    model, args, kwargs = zoo.ZOO[name](seed=1)
    model.train()
    c = capture(model, args, kwargs)
    assert c.method == "fx" and c.leaves == []
    phs = [n for n in c.graph_module.graph.nodes if n.op == "placeholder"]
    assert len(phs) == len(pytree.tree_flatten((args, kwargs))[0])
    check_shares_state(model, c)
    check_meta(c)
    check_matches_eager(model, args, kwargs, c)


def test_parameter_identity_and_tied_weights() -> None:
    model, args, _ = zoo.gpt_tied()
    gm = capture(model, args).graph_module
    assert model.head.weight is model.tok.weight
    assert gm.get_submodule("head").weight is gm.get_submodule("tok").weight is model.tok.weight
    assert {id(p) for p in gm.parameters()} == {id(p) for p in model.parameters()}


def test_placeholders_names_and_specialisation() -> None:
    model, args, kwargs = zoo.kwargs_dict_model()
    c = capture(model, args, kwargs)
    assert [n.name for n in c.graph_module.graph.nodes if n.op == "placeholder"] == ["x", "mask", "scale"]
    assert c.specialized == {2: 0.5}
    with pytest.raises(ValueError, match="specialised"):
        c.flatten_inputs(args, {**kwargs, "scale": 2.0})
    out = c.unflatten_output(c.graph_module(*c.flatten_inputs(args, kwargs)))
    assert set(out) == {"hidden", "out"}


def test_dataclass_output_round_trips() -> None:
    model, args, _ = zoo.dataclass_output_model()
    c = capture(model, args)
    out = c.unflatten_output(c.graph_module(*args))
    assert isinstance(out, zoo.DataclassOut) and isinstance(out.extra, tuple)
    torch.testing.assert_close(out.logits, model(*args).logits)
    # nothing registered globally: the user's dataclass is still a pytree leaf
    assert len(pytree.tree_flatten(out)[0]) == 1


def test_leaf_policy_and_module_meta() -> None:
    model, args, _ = zoo.resnet_like()
    gm = capture(model, args).graph_module
    calls = {n.target for n in gm.graph.nodes if n.op == "call_module"}
    assert {"stem.0", "layer1.0.conv1", "layer1.0.bn1", "layer2.0.down.0", "fc"} <= calls
    assert not any(isinstance(model.get_submodule(t), zoo.BasicBlock) for t in calls)
    add = next(n for n in gm.graph.nodes if n.target is operator.add and n.meta["fxpipe_module"] == "layer1.1")
    assert "zoo.py" in add.meta["stack_trace"] and "out + identity" in add.meta["stack_trace"]
    assert next(n for n in gm.graph.nodes if n.target == "layer1.0.conv1").meta["fxpipe_module"] == "layer1.0.conv1"


def test_user_leaf_modules_by_class_and_name() -> None:
    model, args, _ = zoo.gpt_tied()
    c = capture(model, args, leaf_modules=[zoo.GPTBlock])
    assert c.leaves == ["blocks.0", "blocks.1", "blocks.2"]
    calls = [n.target for n in c.graph_module.graph.nodes if n.op == "call_module"]
    assert "blocks.1" in calls and "blocks.1.attn.qkv" not in calls
    with pytest.raises(ValueError, match="blocks.9"):
        capture(model, args, leaf_modules=["blocks.9"])
    c = capture(model, args, leaf_modules=["blocks.1.attn"])
    assert c.leaves == ["blocks.1.attn"]
    calls = [n.target for n in c.graph_module.graph.nodes if n.op == "call_module"]
    assert "blocks.1.attn" in calls and "blocks.0.attn.qkv" in calls
    check_matches_eager(model, args, {}, c)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: fx cannot trace this
            return self.lin(x)
        return -self.lin(x)


class WithGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 4))
        self.inner = nn.Sequential(nn.Linear(4, 4), Gate())
        self.post = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.inner(self.pre(x)))


def test_untraceable_submodule_falls_back_to_leaf() -> None:
    torch.manual_seed(0)
    model = WithGate()
    x = torch.randn(3, 4)
    with pytest.warns(UserWarning, match=r"'inner\.1'.*data-dependent control flow"):
        c = capture(model, (x,))
    assert c.method == "fx" and c.leaves == ["inner.1"]
    assert "inner.1" in [n.target for n in c.graph_module.graph.nodes if n.op == "call_module"]
    for sign in (1.0, -1.0):  # both branches run eagerly inside the leaf
        torch.testing.assert_close(c.graph_module(sign * x)[0], model(sign * x))
    check_matches_eager(model, (x,), {}, c)


class RootBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:
            return y
        return -y


def test_root_data_dependent_control_flow_raises_trace_error() -> None:
    with pytest.raises(TraceError) as info:
        capture(RootBranch(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert isinstance(info.value, RuntimeError) and info.value.__cause__ is not None
    assert "RootBranch" in msg and "data-dependent control flow" in msg
    assert "test_capture.py" in msg and "if y.sum() > 0:" in msg and "leaf_modules" in msg
    assert info.value.module == "" and "if y.sum() > 0" in info.value.location


class IterateGate(nn.Module):
    """Root iterates over the opaque Gate's output: fx fails at the root after leafing."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([row * 2 for row in self.gate(x)])


def test_trace_error_mentions_automatic_leaves() -> None:
    with pytest.raises(TraceError) as info, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        capture(IterateGate(), (torch.randn(2, 4),))
    msg = str(info.value)
    assert "IterateGate" in msg and "['gate']" in msg and "leaf_modules" in msg
    assert "for row in self.gate(x)" in msg


class FactoryRoot(nn.Module):
    """``torch.ones(n, 8)`` with a traced size at the root: torch.fx refuses, export handles it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        h = self.bn(F.relu(self.fc(x))) * scale + torch.ones(x.size(0), 8, device=x.device)
        return {"y": self.out(h), "h": h}


def test_export_fallback_meets_contract() -> None:
    torch.manual_seed(0)
    model = FactoryRoot().train()
    x = torch.randn(6, 4)
    c = capture(model, (x, 2.0))
    assert c.method == "export" and c.specialized == {1: 2.0}
    gm = c.graph_module
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["x", "scale"]
    check_shares_state(model, c)
    check_meta(c)
    assert {n.meta["fxpipe_module"] for n in gm.graph.nodes} >= {"fc", "bn", "out"}
    check_matches_eager(model, (x, 2.0), {}, c)  # includes BN running stats and grads
    # dynamic batch: a micro-batch of a different size runs on the same graph. (Export
    # bakes in the training mode of capture time, so compare in train mode.)
    ref = copy.deepcopy(model)
    torch.testing.assert_close(c.unflatten_output(gm(x[:2], 2.0))["y"], ref(x[:2], 2.0)["y"])
    retarget_devices(gm, "cpu")


# -- HF transformers (tiny random configs, no downloads) -----------------------------------
def _hf_check(model: nn.Module, vocab: int) -> Capture:
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 12), generator=g)
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = capture(model, (ids,), {"attention_mask": mask})
    assert c.method in ("fx", "export")
    check_shares_state(model, c)
    check_meta(c)
    check_matches_eager(model, (ids,), {"attention_mask": mask}, c)
    small = c.unflatten_output(c.graph_module(ids[:2], mask[:2]))  # micro-batch
    torch.testing.assert_close(small[0], model(ids[:2], attention_mask=mask[:2])[0])
    return c


def test_hf_gpt2_tiny() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=32,
                                  use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    c = _hf_check(model, 100)
    assert type(c.unflatten_output(c.graph_module(*c.flatten_inputs(*_ids_mask(100))))).__name__.startswith("CausalLM")


def _ids_mask(vocab: int) -> tuple[tuple, dict]:
    ids = torch.randint(0, vocab, (4, 12))
    return (ids,), {"attention_mask": torch.ones(4, 12, dtype=torch.long)}


def test_hf_bert_tiny() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                  intermediate_size=64, vocab_size=100, max_position_embeddings=32)
    torch.manual_seed(0)
    _hf_check(transformers.BertModel(cfg), 100)


class NestedInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor], extra: dict, flag: bool = False) -> torch.Tensor:
        y = self.lin(pair[0]) + pair[1] * extra["w"]
        return y.relu() if flag else y  # Python control flow on a non-tensor input: specialised


def test_nested_inputs_get_one_named_placeholder_per_leaf() -> None:
    model = NestedInputs()
    args = ((torch.randn(2, 4), torch.randn(2, 4)), {"w": torch.randn(4), "n": 3})
    c = capture(model, args, {"flag": True})
    names = [n.name for n in c.graph_module.graph.nodes if n.op == "placeholder"]
    assert names == ["pair_0", "pair_1", "extra_w", "extra_n", "flag"]
    assert c.specialized == {3: 3, 4: True}
    check_matches_eager(model, args, {"flag": True}, c)


def test_fx_capture_fixes_no_size():
    """torch.fx records no sizes (ops take their shapes from their inputs): a pipeline of an fx
    capture runs at other sequence lengths, where a torch.export capture's does not."""
    import fxpipe

    class Tokens(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.mix = nn.Linear(8, 8)
            self.out = nn.Linear(8, 50)

        def forward(self, ids):
            h = self.emb(ids)
            h = h + self.mix(h).cumsum(dim=1) / h.shape[1]
            return self.out(h)

    model = Tokens()
    pipe = fxpipe.pipeline(model, torch.randint(0, 50, (4, 10)), 2, chunks=2, balance_by="params")
    assert pipe.capture.method == "fx" and pipe.capture.fixed == {}
    for shape in [(4, 12), (6, 3)]:
        ids = torch.randint(0, 50, shape)
        torch.testing.assert_close(pipe(ids), model(ids))


class TrainingBranch(nn.Module):
    """A traced forward reading self.training: fx bakes the branch taken into the graph."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        h = self.a(x)
        if self.training:
            h = h * 0.5
        return self.c(self.b(h))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("train", [True, False])
def test_training_branch_builds_in_either_mode_and_follows_the_other(train, checkpoint):
    """Checked (micro-batches; graph against eager) in the mode it was captured in; switched to
    the other, the pipeline captures the model again in it (fxpipe._mode_variants) and is exact
    there too, outputs and every gradient; switched back, it runs the build's stages again."""
    from exact import assert_exact, assert_grads_equal

    torch.manual_seed(0)
    x = torch.randn(6, 8)
    model = TrainingBranch().train(train)
    pipe = assert_exact(model, (x,), 3, chunks=2, checkpoint=checkpoint, balance_by="params")
    assert "self.training" in pipe.mode_sensitive
    built, model = pipe.stages, pipe.module
    pipe.train(not train)
    assert model.training is not train
    model.zero_grad()
    ref = copy.deepcopy(model)
    out, want = pipe(x), ref(x)
    torch.testing.assert_close(out, want)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    assert_grads_equal(model, ref)
    assert pipe.stages is not built
    pipe.train(train)
    torch.testing.assert_close(pipe(x), model(x))
    assert pipe.stages is built


def test_model_eval_alone_switches_the_pipeline_too():
    """``model.eval()`` (not ``pipe.eval()``) puts the stages' modules in eval mode; the
    pipeline follows the model's mode: a graph baked in training mode is captured again in eval."""
    import fxpipe

    model = TrainingBranch().train()
    x = torch.randn(6, 8)
    pipe = fxpipe.pipeline(model, x, 2, devices=["cpu"] * 2, balance_by="params")
    model.eval()
    torch.testing.assert_close(pipe(x), model(x))
    model.train()
    torch.testing.assert_close(pipe(x), model(x))


def test_a_torch_size_output_under_torch_export_is_rebuilt():
    """torch.export returns a ``torch.Size`` output number by number, where the output spec
    holds it whole: the pipeline's build crashed in pytree's unflatten. It is rebuilt."""

    class Sized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor):
            if x.shape[2] == 8:  # torch.fx cannot trace this: torch.export captures the model
                x = x * 2
            return self.a(x), x.shape[1:]

    model = Sized()
    x = torch.randn(4, 3, 8)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    assert pipe.capture.method == "export"
    out, size = pipe(x)
    assert isinstance(size, torch.Size) and size == model(x)[1] == torch.Size([3, 8])
    torch.testing.assert_close(out, model(x)[0])


def test_a_numpy_scalar_in_traced_code_becomes_a_python_number():
    """``scores / np.sqrt(d_k)`` put ``np.float64(4.0)`` into the generated code, which failed
    with a bare NameError: name 'np' is not defined (a trial)."""
    import numpy as np

    import fxpipe

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.o = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

        def forward(self, x):
            scores = self.q(x) @ self.k(x).transpose(1, 2) / np.sqrt(16)
            return self.o(scores.softmax(-1) @ x)

    model, x = Attention(), torch.randn(4, 5, 16)
    pipe = fxpipe.pipeline(model, x, 2, chunks=2, devices=["cpu"] * 2, progress=False)
    torch.testing.assert_close(pipe(x), model(x))
