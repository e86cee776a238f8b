"""fxpipe.pipeline against the eager model: outputs and every gradient, over the zoo."""

import copy
import dataclasses
import itertools

import pytest
import torch
from torch import nn

import fxpipe
from exact import assert_all_close, assert_exact, assert_grads_equal
from zoo import ZOO

MODES = ["always", "except_last", "never"]
# Models holding BatchNorm: micro-batches are normalised on their own statistics.
BATCHNORM_MODELS = ("resnet_like", "bn_model", "densenet_block")


def leaves(obj):
    """Tensor leaves of tensors, tuples, lists, dicts and dataclasses, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return leaves([getattr(obj, f.name) for f in dataclasses.fields(obj)])
    if isinstance(obj, dict):
        return [x for k in obj for x in leaves(obj[k])]
    if isinstance(obj, (tuple, list)):
        return [x for v in obj for x in leaves(v)]
    return []


def loss_of(out):
    total = 0.0
    for i, t in enumerate(leaves(out)):
        if t.is_floating_point() and t.requires_grad:
            w = torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t) * (i + 1)
            total = total + (t * w).sum()
    return total


def micro_eager(model, args, kwargs, chunks):
    """Eager reference for per-sample-independent models that hold BatchNorm: the model run
    on each micro-batch in turn, which is exactly what a pipeline computes."""
    micro, spec = fxpipe.runtime._microbatch.scatter_tree(args, kwargs, chunks)
    outs = []
    for flat in micro:
        a, k = torch.utils._pytree.tree_unflatten(flat, spec)
        outs.append(model(*a, **k))
    return torch.cat(outs)


def run_both(name, n_stages, chunks, checkpoint, balance_by="params", **kw):
    model, args, kwargs = ZOO[name]()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, n_stages, sample_kwargs=kwargs, chunks=chunks,
                           devices=["cpu"] * n_stages, checkpoint=checkpoint, balance_by=balance_by, **kw)
    out = pipe(*args, **kwargs)
    loss_of(out).backward()
    if name in BATCHNORM_MODELS:
        expected = micro_eager(ref, args, kwargs, chunks)
    else:
        expected = ref(*args, **kwargs)
    loss_of(expected).backward()
    return pipe, model, ref, out, expected


EQUIVALENT = ["resnet_like", "unet", "densenet_block", "inception_block", "gpt_tied",
              "kwargs_dict_model", "bn_model", "dataclass_output_model"]
GRID = list(itertools.product(range(1, 5), range(1, 5)))


@pytest.mark.parametrize("name", EQUIVALENT)
@pytest.mark.parametrize("n_stages,chunks", GRID)
def test_zoo_matches_eager(name, n_stages, chunks):
    checkpoint = MODES[(n_stages + chunks) % 3]  # every mode over the grid, for every model
    pipe, model, ref, out, expected = run_both(name, n_stages, chunks, checkpoint)
    assert type(out) is type(expected)
    for a, b in zip(leaves(out), leaves(expected)):
        torch.testing.assert_close(a, b)
    assert_grads_equal(model, ref)
    assert len(pipe.stages) == n_stages
    if checkpoint == "never":
        # BatchNorm running stats, per micro-batch. (Under checkpointing the recomputation
        # updates them again, as documented; deferred_batch_norm=True avoids that.)
        for a, b in zip(model.buffers(), ref.buffers()):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("name", ["unet", "gpt_tied", "inception_block"])
@pytest.mark.parametrize("checkpoint", MODES)
def test_zoo_balanced_by_time_and_memory(name, checkpoint):
    for balance_by in ["time", "memory"]:
        _, model, ref, out, expected = run_both(name, 3, 2, checkpoint, balance_by=balance_by)
        for a, b in zip(leaves(out), leaves(expected)):
            torch.testing.assert_close(a, b)
        assert_grads_equal(model, ref)


def test_dict_output_and_keyword_tensors_structure():
    model, args, kwargs = ZOO["kwargs_dict_model"]()
    pipe = fxpipe.pipeline(model, args, 2, sample_kwargs=kwargs, chunks=3, devices=["cpu"] * 2, balance_by="params")
    out = pipe(*args, **kwargs)
    assert isinstance(out, dict) and list(out) == ["hidden", "out"]
    # The float argument is passed through, the tensor keyword is split.
    with pytest.raises(ValueError, match="specialised"):
        pipe(*args, mask=kwargs["mask"], scale=2.0)


def test_dataclass_output_structure():
    model, args, kwargs = ZOO["dataclass_output_model"]()
    pipe = fxpipe.pipeline(model, args, 2, chunks=2, devices=["cpu"] * 2, balance_by="params")
    out = pipe(*args)
    assert type(out).__name__ == "DataclassOut" and isinstance(out.extra, tuple)


@pytest.mark.parametrize("chunks", [2, 3])
def test_dropout_bit_exact_between_checkpoint_modes(chunks):
    results = {}
    for mode in MODES:
        model, args, _ = ZOO["dropout_model"]()
        pipe = fxpipe.pipeline(model, args, 2, chunks=chunks, devices=["cpu"] * 2, checkpoint=mode, balance_by="params")
        torch.manual_seed(7)
        out = pipe(*args)
        loss_of(out).backward()
        results[mode] = (out.detach(), [p.grad for p in model.parameters()])
    for mode in ["always", "except_last"]:
        assert torch.equal(results[mode][0], results["never"][0])
        for a, b in zip(results[mode][1], results["never"][1]):
            assert torch.equal(a, b)


def test_dropout_eval_matches_eager():
    model, args, _ = ZOO["dropout_model"]()
    ref = copy.deepcopy(model).eval()
    pipe = fxpipe.pipeline(model, args, 2, chunks=2, devices=["cpu"] * 2, balance_by="params").eval()
    torch.testing.assert_close(pipe(*args), ref(*args))


def test_deferred_batch_norm_running_stats_equal_full_batch():
    model, args, _ = ZOO["bn_model"]()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, 3, chunks=4, devices=["cpu"] * 3, deferred_batch_norm=True, balance_by="params")
    # The first BatchNorm sees the same input in both; later ones see micro-batch-normalised input.
    pipe(*args).sum().backward()
    ref(*args)
    torch.testing.assert_close(model.net[1].running_mean, ref.net[1].running_mean)
    torch.testing.assert_close(model.net[1].running_var, ref.net[1].running_var)
    assert model.net[1].num_batches_tracked.item() == 1
    assert list(pipe.state_dict()) == list(ref.state_dict())


def test_training_trajectory_equals_eager():
    model, args, _ = ZOO["gpt_tied"]()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, balance_by="params")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        idx = torch.randint(0, 64, (4, 16))
        for net, o in ((pipe, opt), (ref, ref_opt)):
            o.zero_grad()
            logits = net(idx)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), idx[:, 1:].reshape(-1))
            loss.backward()
            o.step()
    # gradients summed over micro-batches, then accumulated in the momentum: exact.py's tolerance
    assert_all_close([(f"{name} after 4 SGD steps", p, q) for (name, p), q in zip(model.named_parameters(),
                                                                                  ref.parameters())])


def test_tied_weights_are_one_parameter():
    model, args, _ = ZOO["gpt_tied"]()
    pipe = fxpipe.pipeline(model, args, 4, chunks=2, devices=["cpu"] * 4, balance_by="params")
    params = {id(p) for stage in pipe.stages for p in stage.parameters()}
    assert params <= {id(p) for p in model.parameters()}
    users = [k for k, stage in enumerate(pipe.stages) if any(p is model.tok.weight for p in stage.parameters())]
    assert len(users) >= 2, "the tied weight should be used by the first and the last stage"
    assert model.head.weight is model.tok.weight


def test_state_dict_keys_and_reload():
    model, args, _ = ZOO["unet"]()
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, balance_by="params")
    sd = pipe.state_dict()
    assert list(sd) == list(model.state_dict())
    fresh, _, _ = ZOO["unet"](seed=5)
    fresh.load_state_dict(sd)
    torch.testing.assert_close(fresh(*args), pipe(*args))
    pipe.load_state_dict(fresh.state_dict())


def test_parameters_are_shared_not_copied():
    model, args, _ = ZOO["resnet_like"]()
    pipe = fxpipe.pipeline(model, args, 3, devices=["cpu"] * 3, balance_by="params")
    model_params = {id(p) for p in model.parameters()}
    for stage in pipe.stages:
        for p in stage.parameters():
            assert id(p) in model_params


def test_stage_code_is_readable():
    model, args, _ = ZOO["unet"]()
    pipe = fxpipe.pipeline(model, args, 3, devices=["cpu"] * 3, balance_by="params")
    code = "\n".join(stage.code for stage in pipe.stages)
    assert "submod_" not in code
    assert "self.enc1" in code or "self.down" in code or "enc" in code
    assert "pop" in code and "stash" in code  # the long skips became portals
    assert pipe.plan.portals and all(p.dst > p.src + 1 for p in pipe.plan.portals)


def test_plan_save_and_reuse(tmp_path):
    model, args, _ = ZOO["unet"]()
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, balance_by="params")
    path = tmp_path / "plan.json"
    pipe.plan.save(path)
    again = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, plan=str(path))
    assert again.plan.assignment == pipe.plan.assignment
    assert "stage" in str(pipe.plan).lower()
    with pytest.raises(ValueError, match="n_stages"):
        fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, plan=str(path))
    other, oargs, _ = ZOO["gpt_tied"]()
    with pytest.raises(ValueError, match="does not match"):
        fxpipe.pipeline(other, oargs, 3, devices=["cpu"] * 3, plan=pipe.plan)


def test_split_points_and_leaf_modules():
    model, args, _ = ZOO["gpt_tied"]()
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, args, 3, devices=["cpu"] * 3, split_points=["blocks.1", "ln_f"],
                           leaf_modules=["blocks.0"])
    assert any(n.op == "call_module" and n.target == "blocks.0" for n in pipe.stages[0].graph.nodes)
    code1 = pipe.stages[1].code
    assert "blocks" in code1 and "ln_f" not in code1
    assert "ln_f" in pipe.stages[2].code
    torch.testing.assert_close(pipe(*args), ref(*args))
    with pytest.raises(ValueError, match="split point 'nope'"):
        fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, split_points=["nope"])
    with pytest.raises(ValueError, match="needs 2"):
        fxpipe.pipeline(model, args, 3, devices=["cpu"] * 3, split_points=["ln_f"])


def test_bad_arguments():
    model, args, _ = ZOO["unet"]()
    with pytest.raises(ValueError, match="n_stages"):
        fxpipe.pipeline(model, args, 0, devices=["cpu"])
    with pytest.raises(ValueError, match=r"n_stages=10000 .* partitionable nodes"):
        fxpipe.pipeline(model, args, 10000, devices=["cpu"] * 10000, balance_by="params")
    with pytest.raises(ValueError, match="balance_by"):
        fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, balance_by="flops")
    with pytest.raises(ValueError, match="checkpoint"):
        fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, checkpoint="sometimes")
    with pytest.raises(IndexError, match="too few devices"):
        fxpipe.pipeline(model, args, 3, devices=["cpu"])
    with pytest.raises(TypeError, match="nn.Module"):
        fxpipe.pipeline(lambda x: x, args, 2)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow at the root
            return self.lin(x)
        return -self.lin(x)


def test_untraceable_model_raises_trace_error():
    with pytest.raises(fxpipe.TraceError) as info:
        fxpipe.pipeline(Branchy(), torch.randn(2, 4), 2, devices=["cpu"] * 2)
    msg = str(info.value)
    assert "Branchy" in msg and "x.sum() > 0" in msg and "leaf_modules" in msg
    assert isinstance(info.value, RuntimeError)


class ShapeTrap(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.a(x)
        h = self.b(h)
        return self.c(h) + y  # y's shape is only checked here


def test_stage_errors_point_at_generated_and_original_lines():
    model = ShapeTrap()
    pipe = fxpipe.pipeline(model, (torch.randn(4, 4), torch.randn(4, 4)), 3, devices=["cpu"] * 3, balance_by="params")
    with pytest.raises(RuntimeError) as info:
        pipe(torch.randn(4, 4), torch.randn(4, 5))
    notes = "\n".join(getattr(info.value, "__notes__", [])) + str(info.value)
    assert "stage 2" in notes
    assert "return self.c(h) + y" in notes  # the original source line
    assert "add" in notes  # the generated line
    # The pipeline is still usable.
    assert pipe(torch.randn(4, 4), torch.randn(4, 4)).shape == (4, 4)


def test_non_tensor_and_none_arguments_pass_through():
    class Opt(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

        def forward(self, x, bias=None, *, scale=1.0):
            h = self.b(self.a(x)) * scale
            return h if bias is None else h + bias

    model = Opt()
    ref = copy.deepcopy(model)
    x = torch.randn(6, 3)
    pipe = fxpipe.pipeline(model, (x,), 2, sample_kwargs={"scale": 3.0}, chunks=3, devices=["cpu"] * 2, balance_by="params")
    torch.testing.assert_close(pipe(x, scale=3.0), ref(x, scale=3.0))
    # A tensor keyword argument is split like a positional one.
    bias = torch.randn(6, 3)
    pipe2 = fxpipe.pipeline(copy.deepcopy(ref), (x,), 2, sample_kwargs={"bias": bias, "scale": 3.0}, chunks=3,
                            devices=["cpu"] * 2, balance_by="params")
    torch.testing.assert_close(pipe2(x, bias=bias, scale=3.0), ref(x, bias=bias, scale=3.0))
    with pytest.raises(ValueError, match="inputs split into micro-batches must share one batch size"):
        pipe2(x, bias=torch.randn(5, 3), scale=3.0)


class ReadsTraining(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if self.training:  # baked into the fx graph as a constant
            h = nn.functional.dropout(h, 0.5)
        return self.b(h)


def test_mode_following_graphs_run_in_both_modes():
    model, args, _ = ZOO["dropout_model"]()  # nn.Dropout modules: the graph follows the mode
    pipe = fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, balance_by="params")
    assert pipe.mode_sensitive == ""
    pipe.eval()
    torch.testing.assert_close(pipe(*args), model(*args))


def test_mode_baked_graph_follows_the_other_mode():
    """A traced ``self.training`` branch: eval in the middle of training runs a capture made in
    eval mode, cut where the plan cut the training one; back in training it drops again."""
    model = ReadsTraining()
    pipe = fxpipe.pipeline(model, torch.randn(4, 4), 2, devices=["cpu"] * 2, balance_by="params")
    assert "self.training" in pipe.mode_sensitive
    pipe(torch.randn(4, 4))
    pipe.eval()
    x = torch.randn(4, 4)
    torch.testing.assert_close(pipe(x), model(x))
    pipe.train()
    torch.manual_seed(1)
    dropped = pipe(x)
    assert not torch.allclose(dropped, model.eval()(x))  # the training capture again: dropout on


@pytest.mark.parametrize("cut", [
    ("getitem_5", "blocks_2_attn_qkv"),  # stage 0 sends qkv.split(...)'s tuple to stage 1 whole
    ("getattr_3", "invert"),  # stage 1 only computes the mask: stage 0's outputs reach it as shapes
])
@pytest.mark.parametrize("checkpoint", MODES)
def test_awkward_cuts_keep_every_gradient(cut, checkpoint):
    from fxpipe.capture._tracing import capture
    from fxpipe.plan._partition import partition
    from fxpipe.plan._make import opgraph_for

    model, args, _ = ZOO["gpt_tied"]()
    ref = copy.deepcopy(model)
    graph = opgraph_for(capture(model, args, {}), args, {}, "params")
    plan = fxpipe.Plan.from_assignment(graph, partition(graph, 3, split_before=list(cut)))
    pipe = fxpipe.pipeline(model, args, 3, chunks=2, devices=["cpu"] * 3, checkpoint=checkpoint, plan=plan)
    loss_of(pipe(*args)).backward()
    loss_of(ref(*args)).backward()
    assert_grads_equal(model, ref)


def test_moving_a_placed_pipeline_is_refused():
    model, args, _ = ZOO["unet"]()
    pipe = fxpipe.pipeline(model, args, 2, devices=["cpu"] * 2, balance_by="params")
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"), lambda: pipe.to(device="cpu")):
        with pytest.raises(TypeError, match="denied to move parameters and buffers"):
            move()
    assert pipe.to(torch.float64) is pipe
    assert pipe(*(a.double() for a in args)).dtype == torch.float64


def test_build_inside_inference_mode():
    """The build runs outside inference mode (it profiles backward and tracks in-place updates
    by version counters): a pipeline built inside torch.inference_mode(), from a sample made
    there, is the one built outside it, and trains; the caller's sample is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.BatchNorm1d(16), nn.Linear(16, 4))
    ref = copy.deepcopy(model)
    with torch.inference_mode():
        x = torch.randn(6, 8)
        pipe = fxpipe.pipeline(model, x, 3, chunks=2, devices=["cpu"] * 3)  # balance_by='time': profiles backward
        assert not any(t.is_inference() for t in (*model.parameters(), *model.buffers()))
        torch.testing.assert_close(model.state_dict(), ref.state_dict())  # the build changed nothing
        out = pipe(x)  # calling inside inference mode works too
        assert out.is_inference() and x.is_inference()
    x = x.clone()
    pipe(x).sum().backward()
    ref(x[:3]).sum().backward()
    ref(x[3:]).sum().backward()  # BatchNorm normalises each micro-batch on its own
    assert_grads_equal(model, ref)


def test_model_made_inside_inference_mode_is_refused():
    from fxpipe.errors import ArgumentError

    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ArgumentError, match=r"0.weight, 0.bias, 2.weight ... are inference tensors.*outside "
                                            r"torch.inference_mode\(\)") as info:
        fxpipe.pipeline(model, torch.randn(2, 4), 2, devices=["cpu"] * 2)
    assert isinstance(info.value, ValueError) and info.value.argument == "model"


def test_a_lazy_module_not_yet_called_is_refused_and_builds_after_one_call():
    from fxpipe.errors import ArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 6)
    with pytest.raises(ArgumentError, match=r"0.weight, 0.bias are not initialised yet.*model\(sample\)"):
        fxpipe.pipeline(model, x, 2, devices=["cpu"] * 2, progress=False)
    model(x)  # initialised, as before creating an optimizer
    assert_exact(model, (x,), 2, chunks=2, progress=False)


@pytest.mark.parametrize("mode", MODES)
def test_torch_func_grad_through_the_pipeline_is_exact_or_refused_naming_checkpoint(mode):
    """torch.func.grad's transform refuses the saved-tensor hooks checkpointing runs on (torch's
    bare RuntimeError before): refused naming checkpoint=; without checkpointing, exact."""
    from fxpipe.errors import ArgumentError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    ref = copy.deepcopy(model)
    pipe = fxpipe.pipeline(model, torch.randn(8, 8), 2, chunks=2, devices=["cpu"] * 2, balance_by="params",
                           progress=False, checkpoint=mode)
    x = torch.randn(8, 8)
    saliency = lambda m: torch.func.grad(lambda z: m(z).pow(2).sum())(x)  # noqa: E731
    if mode == "never":
        torch.testing.assert_close(saliency(pipe), saliency(ref))
    else:
        with pytest.raises(ArgumentError, match="checkpoint='never'"):
            saliency(pipe)
    torch.testing.assert_close(torch.func.vmap(pipe)(x[:, None]), torch.func.vmap(ref)(x[:, None]))


@pytest.mark.parametrize("mode", MODES)
def test_running_stats_updated_once_when_built_in_eval_and_trained(mode):
    """The sample run (which finds buffers updated in forward) saw eval mode, where BatchNorm
    updates nothing; trained afterwards, a checkpointed stage's recomputation must still run on
    a snapshot of the running statistics, not update them a second time."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                        nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(8, 8)
    model = copy.deepcopy(ref).eval()
    pipe = fxpipe.pipeline(model, x, 3, chunks=2, checkpoint=mode, balance_by="params", progress=False,
                           devices=["cpu"] * 3)
    model.train()
    out = pipe(x)
    out.sum().backward()
    expected = torch.cat([ref(c) for c in x.chunk(2)])  # BatchNorm per micro-batch
    expected.sum().backward()
    torch.testing.assert_close(out, expected)
    assert_grads_equal(model, ref)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), b, msg=name)
