"""Tests for fxpipe.emit._stages: stage GraphModules, boundaries, portals, shared params, errors."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import traceback
import inspect
import itertools
import re

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.emit._stages import EmitError, StageModule, Stages, emit_stages
from fxpipe.plan._op_graph import build_opgraph
from fxpipe.plan._value import Plan
from fxpipe.plan._routes import portal_name

from exact import assert_all_close

THIS_FILE = __file__


# --------------------------------------------------------------------------- models


class ResidualMLP(nn.Module):
    def __init__(self, d=6, depth=3):
        super().__init__()
        self.fc_in = nn.Linear(d, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.fc_out = nn.Linear(d, 3)

    def forward(self, x):
        h = self.fc_in(x)
        for block in self.blocks:
            h = h + torch.relu(block(h))
        return (self.fc_out(h),)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv1d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv1d(4, 8, 3, padding=1)
        self.conv3 = nn.Conv1d(8, 8, 3, padding=1)


class UNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.mid = nn.Conv1d(8, 8, 3, padding=1)
        self.dec2 = nn.Conv1d(16, 8, 3, padding=1)
        self.dec1 = nn.Conv1d(12, 4, 3, padding=1)
        self.head = nn.Conv1d(6, 2, 1)

    def forward(self, x):
        e1 = torch.relu(self.encoder.conv1(x))
        e2 = torch.relu(self.encoder.conv2(F.avg_pool1d(e1, 2)))
        e3 = torch.relu(self.encoder.conv3(F.avg_pool1d(e2, 2)))
        m = torch.tanh(self.mid(e3))
        d2 = torch.relu(self.dec2(torch.cat([F.interpolate(m, scale_factor=2.0), e2], dim=1)))
        d1 = torch.relu(self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0), e1], dim=1)))
        return (self.head(torch.cat([d1, x], dim=1)),)


class LateInput(nn.Module):
    """``y`` is only used at the very end; ``unused`` is never used."""

    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 5))

    def forward(self, x, unused, y):
        return (self.layers(x) * y,)


class TiedLM(nn.Module):
    """Tied embedding (module call in the first stage, get_attr in the last one) and a
    raw Parameter used at both ends."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Parameter(torch.randn(d, d) * 0.3)
        self.body = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.GELU())

    def forward(self, tokens):
        h = self.emb(tokens) @ self.proj
        h = self.body(h)
        h = h @ self.proj.t()
        return (F.linear(h, self.emb.weight),)


class EarlyOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)
        self.d = nn.Linear(4, 2)

    def forward(self, x, scale):
        h1 = torch.sigmoid(self.a(x))
        h2 = torch.relu(self.b(h1))
        h3 = torch.relu(self.c(h2))
        return (h1, None, self.d(h3) * scale, x, 7)


MODELS = {
    "residual": (ResidualMLP, lambda: (torch.randn(3, 6, requires_grad=True),)),
    "unet": (UNetish, lambda: (torch.randn(2, 2, 8, requires_grad=True),)),
    "late_input": (LateInput, lambda: (torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5, requires_grad=True))),
    "tied": (TiedLM, lambda: (torch.randint(0, 11, (3, 4)),)),
    "early_output": (EarlyOutput, lambda: (torch.randn(3, 4, requires_grad=True), torch.randn(3, 2))),
}


# --------------------------------------------------------------------------- helpers


def trace(model: nn.Module) -> fx.GraphModule:
    tracer = fx.Tracer()
    tracer.record_stack_traces = True
    return fx.GraphModule(model, tracer.trace(model))


def compute_nodes(gm):
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]


def split_assignment(gm, cuts, n_stages):
    """Contiguous split: compute node i goes to the number of cuts <= i. get_attr nodes
    go to the stage of their first consumer, as fxpipe.plan._partition does."""
    assignment = {}
    for i, node in enumerate(compute_nodes(gm)):
        assignment[node.name] = sum(1 for c in cuts if c <= i)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            assignment[node.name] = 0
        elif node.op == "output":
            assignment[node.name] = n_stages - 1
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            first = min(node.users, key=lambda u: list(gm.graph.nodes).index(u))
            assignment[node.name] = assignment[first.name]
    return assignment


def plan_for(gm, assignment, n_stages):
    """The Plan of a hand-made assignment: model inputs default to stage 0, the output to the
    last stage and each get_attr to its first user's stage (as fxpipe.plan._partition does)."""
    full = dict(assignment)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            full.setdefault(node.name, 0 if node.op == "placeholder" else n_stages - 1)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name not in full:
            full[node.name] = min(full[u.name] for u in node.users)
    return Plan.from_assignment(build_opgraph(gm), full)


def emit(gm, assignment, n_stages):
    plan = plan_for(gm, assignment, n_stages)
    assert plan.n_stages == n_stages
    return emit_stages(gm, plan)


def portal_routes(stages: Stages):
    """``{portal name: (src, dst)}`` of the emitted stages."""
    return {p.name: (p.src, p.dst) for p in stages.portals}


def run_stages(stages: Stages, *inputs):
    values = inputs
    for k, mod in enumerate(stages.modules):
        assert len(values) == len(stages.input_names[k])
        values = mod(*values)
        assert isinstance(values, tuple)
        assert len(values) == len(stages.output_names[k])
    return values


def loss_of(outputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    for out in outputs:
        if isinstance(out, torch.Tensor) and out.is_floating_point():
            total = total + (out * torch.randn(out.shape, generator=g)).sum()
    return total


def grads(model, inputs):
    gs = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    for i, x in enumerate(inputs):
        if isinstance(x, torch.Tensor) and x.grad is not None:
            gs[f"input{i}"] = x.grad.clone()
    return gs


def check_equivalence(model, inputs, stages):
    def fresh(xs):
        return tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in xs)

    model.zero_grad()
    eager_inputs = fresh(inputs)
    eager_out = model(*eager_inputs)
    loss_of(eager_out).backward()
    eager_grads = grads(model, eager_inputs)

    model.zero_grad()
    stage_inputs = fresh(inputs)
    out = run_stages(stages, *stage_inputs)
    assert len(out) == len(eager_out)
    for a, b in zip(out, eager_out):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b)
        else:
            assert a == b
    loss_of(out).backward()
    got = grads(model, stage_inputs)
    assert got.keys() == eager_grads.keys()
    assert_all_close((f"grad of {name}", got[name], eager_grads[name]) for name in eager_grads)


def expected_routes(gm, assignment, n_stages):
    """Boundary values and portal routes computed independently from the contract."""
    stage = {n: assignment[n.name] for n in gm.graph.nodes if n.op != "get_attr"}
    boundary = [set() for _ in range(n_stages)]
    routes = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            continue
        for u in n.users:
            if stage[u] == stage[n] + 1:
                boundary[stage[n]].add(n.name)
            elif stage[u] > stage[n] + 1:
                routes[portal_name(n.name, stage[u])] = (stage[n], stage[u])
    return boundary, routes


# --------------------------------------------------------------------------- equivalence


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_even_split_matches_eager(name, n_stages):
    torch.manual_seed(0)
    cls, make_inputs = MODELS[name]
    model = cls()
    gm = trace(model)
    n = len(compute_nodes(gm))
    cuts = [round(n * k / n_stages) for k in range(1, n_stages)]
    assignment = split_assignment(gm, cuts, n_stages)
    stages = emit(gm, assignment, n_stages)
    assert len(stages.modules) == n_stages
    check_equivalence(model, make_inputs(), stages)
    boundary, routes = expected_routes(gm, assignment, n_stages)
    assert portal_routes(stages) == routes
    for k in range(n_stages - 1):
        assert set(stages.output_names[k]) == boundary[k]
        assert stages.input_names[k + 1] == stages.output_names[k]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_contiguous_splits_match_eager(data):
    name = data.draw(st.sampled_from(sorted(MODELS)))
    n_stages = data.draw(st.integers(1, 4))
    torch.manual_seed(1)
    cls, make_inputs = MODELS[name]
    model = cls()
    gm = trace(model)
    n = len(compute_nodes(gm))
    # cuts may coincide (empty stages) and may sit at either end
    cuts = sorted(data.draw(st.lists(st.integers(0, n), min_size=n_stages - 1, max_size=n_stages - 1)))
    assignment = split_assignment(gm, cuts, n_stages)
    stages = emit(gm, assignment, n_stages)
    check_equivalence(model, make_inputs(), stages)
    _, routes = expected_routes(gm, assignment, n_stages)
    assert portal_routes(stages) == routes


# --------------------------------------------------------------------------- signatures and portals


def residual_hand_assignment(gm):
    # fc_in | blocks_0, relu, add | blocks_1, relu_1, add_1 | blocks_2, relu_2, add_2, fc_out
    names = [n.name for n in compute_nodes(gm)]
    assert names == ["fc_in", "blocks_0", "relu", "add", "blocks_1", "relu_1", "add_1",
                     "blocks_2", "relu_2", "add_2", "fc_out"]
    stage_of = [0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assignment = dict(zip(names, stage_of))
    assignment.update(x=0, output=3)
    return assignment


def placeholder_names(gm):
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def test_signatures_carry_only_what_next_stage_needs():
    model = ResidualMLP()
    gm = trace(model)
    stages = emit(gm, residual_hand_assignment(gm), 4)
    assert stages.input_names == [["x"], ["fc_in"], ["add"], ["add_1"]]
    assert stages.output_names == [["fc_in"], ["add"], ["add_1"], ["fc_out"]]
    for k, mod in enumerate(stages.modules):
        assert placeholder_names(mod) == stages.input_names[k]
    assert portal_routes(stages) == {}
    check_equivalence(model, (torch.randn(2, 6, requires_grad=True),), stages)


def test_unet_long_skips_become_portals():
    model = UNetish()
    gm = trace(model)
    names = [n.name for n in compute_nodes(gm)]
    # stage 0: encoder, stage 1: mid, stage 2: dec2, stage 3: dec1 + head
    stage_of = {}
    k = 0
    for name in names:
        if name == "mid":
            k = 1
        elif name == "interpolate":
            k = 2
        elif name == "interpolate_1":
            k = 3
        stage_of[name] = k
    stage_of.update(x=0, output=3)
    stages = emit(gm, stage_of, 4)
    assert portal_routes(stages) == {
        "x__to3": (0, 3),
        "relu__to3": (0, 3),
        "relu_1__to2": (0, 2),
    }
    assert stages.input_names == [["x"], ["relu_2"], ["tanh"], ["relu_3"]]
    assert stages.output_names[:3] == [["relu_2"], ["tanh"], ["relu_3"]]
    # route order: by destination stage, then position in the graph
    assert [p.name for p in stages.stashes(0)] == ["relu_1__to2", "x__to3", "relu__to3"]
    assert [p.name for p in stages.pops(3)] == ["x__to3", "relu__to3"]
    # the stash calls follow the values they stash, in graph order
    assert re.findall(r"stash\('(\w+)'", stages.modules[0].code) == ["x__to3", "relu__to3", "relu_1__to2"]
    # pops come right after the placeholders and are named after the value
    code3 = stages.modules[3].code
    assert re.search(r"x = fxpipe_portals_pop\('x__to3'\)", code3)
    assert re.search(r"relu = fxpipe_portals_pop\('relu__to3'\)", code3)
    first_ops = [n.op for n in stages.modules[3].graph.nodes][:3]
    assert first_ops == ["placeholder", "call_function", "call_function"]
    # the stash of a placeholder comes right after the placeholders
    nodes0 = list(stages.modules[0].graph.nodes)
    assert nodes0[1].target.__name__ == "stash" and nodes0[1].args == ("x__to3", nodes0[0])
    # the stash of a computed value comes right after it
    relu = next(n for n in nodes0 if n.name == "relu")
    assert relu.next.target.__name__ == "stash" and relu.next.args == ("relu__to3", relu)
    check_equivalence(model, (torch.randn(2, 2, 8, requires_grad=True),), stages)


def test_late_input_travels_by_portal_from_stage_0():
    model = LateInput()
    gm = trace(model)
    assert placeholder_names(gm) == ["x", "unused", "y"]
    names = [n.name for n in compute_nodes(gm)]
    assignment = dict(zip(names, [0, 0, 1, 1, 2, 2]))
    assignment.update(x=0, unused=0, y=0, output=2)
    stages = emit(gm, assignment, 3)
    # stage 0 takes every model input, even those it does not use itself
    assert placeholder_names(stages.modules[0]) == ["x", "unused", "y"]
    assert portal_routes(stages) == {"y__to2": (0, 2)}
    assert stages.input_names[1:] == [["layers_1"], ["layers_3"]]
    check_equivalence(model, (torch.randn(4, 5), torch.randn(4, 5), torch.randn(4, 5, requires_grad=True)), stages)

    # with two stages y is an ordinary boundary value
    assignment2 = {k: min(v, 1) for k, v in assignment.items()}
    stages2 = emit(gm, assignment2, 2)
    assert portal_routes(stages2) == {}
    assert stages2.output_names[0] == ["y", "layers_1"]
    assert placeholder_names(stages2.modules[1]) == ["y", "layers_1"]


def test_tied_weights_are_rematerialised_not_transferred():
    model = TiedLM()
    gm = trace(model)
    n = len(compute_nodes(gm))
    assignment = split_assignment(gm, [2, 4, n - 3], 4)
    stages = emit(gm, assignment, 4)
    first, last = stages.modules[0], stages.modules[-1]
    # the same Parameter objects, reached by the model's qualified names
    assert first.emb is model.emb
    assert first.proj is model.proj and last.proj is model.proj
    assert last.get_parameter("emb.weight") is model.emb.weight
    # parameters never cross a stage boundary
    for names in stages.input_names + stages.output_names:
        assert not any(name.startswith(("proj", "emb_weight")) for name in names)
    assert all(not name.startswith(("proj", "emb_weight")) for name in portal_routes(stages))
    # stages that do not use a parameter do not hold it
    middle_attrs = {n.target for m in stages.modules[1:3] for n in m.graph.nodes if n.op == "get_attr"}
    assert middle_attrs == set()
    # gradients of both uses sum into the one Parameter, exactly like eager
    check_equivalence(model, (torch.randint(0, 11, (3, 4)),), stages)


def test_outputs_produced_early_constants_and_passthrough_inputs():
    model = EarlyOutput()
    gm = trace(model)
    names = [n.name for n in compute_nodes(gm)]
    assert names == ["a", "sigmoid", "b", "relu", "c", "relu_1", "d", "mul"]
    assignment = dict(zip(names, [0, 0, 1, 1, 2, 2, 3, 3]))
    assignment.update(x=0, scale=0, output=3)
    stages = emit(gm, assignment, 4)
    assert portal_routes(stages) == {"x__to3": (0, 3), "scale__to3": (0, 3), "sigmoid__to3": (0, 3)}
    assert stages.output_names[-1] == ["sigmoid", "None", "mul", "x", "7"]
    x, scale = torch.randn(3, 4, requires_grad=True), torch.randn(3, 2)
    out = run_stages(stages, x, scale)
    assert out[1] is None and out[3] is x and out[4] == 7
    check_equivalence(model, (x, scale), stages)

    # produced in stage last-1: an ordinary boundary value
    assignment3 = {k: min(v, 2) for k, v in assignment.items()}
    assignment3.update({"a": 0, "sigmoid": 1, "b": 1, "relu": 1})
    stages3 = emit(gm, assignment3, 3)
    assert stages3.output_names[1] == ["sigmoid", "relu"]
    assert portal_routes(stages3) == {"x__to2": (0, 2), "scale__to2": (0, 2)}
    check_equivalence(model, (x, scale), stages3)


def test_single_stage_is_the_whole_model():
    model = UNetish()
    gm = trace(model)
    stages = emit(gm, split_assignment(gm, [], 1), 1)
    assert portal_routes(stages) == {}
    assert stages.input_names == [["x"]]
    assert stages.output_names == [["head"]]
    check_equivalence(model, (torch.randn(1, 2, 8, requires_grad=True),), stages)


# --------------------------------------------------------------------------- modules and code


def test_parameters_and_submodules_are_the_models_own():
    model = UNetish()
    gm = trace(model)
    n = len(compute_nodes(gm))
    stages = emit(gm, split_assignment(gm, [n // 3, 2 * n // 3], 3), 3)
    seen = set()
    for mod in stages.modules:
        assert isinstance(mod, fx.GraphModule)
        for name, p in mod.named_parameters():
            assert p is model.get_parameter(name)
            seen.add(name)
        for name, sub in mod.named_modules():
            if name and not list(sub.children()):
                assert sub is model.get_submodule(name)
        assert set(mod.state_dict()) <= set(model.state_dict())
    assert seen == {name for name, _ in model.named_parameters()}
    assert stages.modules[0].encoder.conv1 is model.encoder.conv1


def test_code_is_readable_and_keeps_source_links():
    model = UNetish()
    gm = trace(model)
    n = len(compute_nodes(gm))
    stages = emit(gm, split_assignment(gm, [n // 2], 2), 2)
    code0 = stages.modules[0].code
    assert "self.encoder.conv1(x)" in code0
    assert "submod" not in code0 and "submod" not in stages.modules[1].code
    assert type(stages.modules[1]).__name__ == "Stage1"
    # meta (stack traces) travel with the nodes
    for node in stages.modules[0].graph.nodes:
        if node.op == "call_module":
            assert THIS_FILE in node.meta["stack_trace"]
    text = stages.stage_code(0)
    line = inspect.getsourcelines(UNetish.forward)[1] + 1
    assert f'# File "{THIS_FILE}", line {line}, in forward: e1 = torch.relu(self.encoder.conv1(x))' in text
    assert stages.stage_code(0, source=False).strip() == code0.strip()
    whole = str(stages)
    assert "# ---- stage 0 ----" in whole and "# ---- stage 1 ----" in whole

    model2 = ResidualMLP()
    gm2 = trace(model2)
    code = emit(gm2, residual_hand_assignment(gm2), 4).modules[2].code
    assert 'getattr(self.blocks, "1")(add)' in code


def test_dead_code_elimination_keeps_stashes():
    model = UNetish()
    gm = trace(model)
    n = len(compute_nodes(gm))
    stages = emit(gm, split_assignment(gm, [n // 4, n // 2, 3 * n // 4], 4), 4)
    assert portal_routes(stages)
    for mod in stages.modules:
        before = [n.name for n in mod.graph.nodes]
        mod.graph.eliminate_dead_code()
        assert [n.name for n in mod.graph.nodes] == before
        mod.recompile()
    check_equivalence(model, (torch.randn(2, 2, 8, requires_grad=True),), stages)


def test_deepcopy_keeps_stage_identity():
    model = ResidualMLP()
    gm = trace(model)
    stages = emit(gm, residual_hand_assignment(gm), 4)
    clone = copy.deepcopy(stages.modules[2])
    assert type(clone).__name__ == "Stage2"
    assert clone.stage_index == 2
    assert clone.get_parameter("blocks.1.weight") is not model.blocks[1].weight
    h = torch.randn(2, 6)
    torch.testing.assert_close(clone(h)[0], stages.modules[2](h)[0])
    with pytest.raises(RuntimeError) as info:
        clone(torch.randn(2, 5))
    assert "in fxpipe stage 2 (Stage2)" in "\n".join(info.value.__notes__)


def test_pickle_keeps_stage_identity():
    model = ResidualMLP()
    gm = trace(model)
    stages = emit(gm, residual_hand_assignment(gm), 4)
    clone = pickle.loads(pickle.dumps(stages.modules[1]))
    assert isinstance(clone, StageModule)
    assert type(clone).__name__ == "Stage1" and clone.stage_index == 1
    h = torch.randn(2, 6)
    torch.testing.assert_close(clone(h)[0], stages.modules[1](h)[0])
    with pytest.raises(RuntimeError) as info:
        clone(torch.randn(2, 5))
    assert "in fxpipe stage 1 (Stage1), generated line" in note_of(info.value)


# --------------------------------------------------------------------------- errors


def bad_assignment_cases(gm):
    good = residual_hand_assignment(gm)
    yield {**good, "relu": 2}, "later stage"
    yield {**good, "x": 1}, "stage 0"
    yield {**good, "output": 2}, "last stage"
    yield {k: v for k, v in good.items() if k != "add"}, "no stage"
    yield {**good, "nope": 0}, "not in the graph"
    yield {**good, "fc_out": 7}, "outside"


def test_bad_assignments_raise_emit_error():
    """A plan whose assignment does not fit the graph (edited by hand, or made for another
    model) is refused before any stage is emitted."""
    gm = trace(ResidualMLP())
    good = plan_for(gm, residual_hand_assignment(gm), 4)
    for assignment, message in bad_assignment_cases(gm):
        with pytest.raises(EmitError, match=message):
            emit_stages(gm, dataclasses.replace(good, assignment=assignment))
    assert issubclass(EmitError, ValueError)


def test_plan_routes_that_disagree_with_its_assignment_are_refused():
    gm = trace(UNetish())
    n = len(compute_nodes(gm))
    good = plan_for(gm, split_assignment(gm, [2, n // 2, n - 3], 4), 4)
    assert good.portals
    for routes, missing in ((good.routes[1:], True), (good.routes + [dataclasses.replace(good.routes[0], dst=3)], False)):
        with pytest.raises(EmitError, match="routes are not the ones its assignment implies") as info:
            emit_stages(gm, dataclasses.replace(good, routes=routes))
        assert ("missing: -" in str(info.value)) is not missing


def note_of(exc):
    notes = [n for n in getattr(exc, "__notes__", []) if "in fxpipe stage" in n]
    assert len(notes) == 1, notes
    return notes[0]


def check_note(note, stage, stage_mod, source_line):
    m = re.match(rf"in fxpipe stage {stage} \(Stage{stage}\), generated line (\d+): `(.+?)`; original source: (.*)$", note)
    assert m, note
    lineno, text, source = int(m.group(1)), m.group(2), m.group(3)
    assert stage_mod.code.splitlines()[lineno - 1].strip().startswith(text)
    assert source.startswith(f'File "{THIS_FILE}", line {source_line}, in forward: ')
    return text, source


def test_shape_error_points_at_stage_generated_line_and_source():
    model = UNetish()
    gm = trace(model)
    names = [n.name for n in compute_nodes(gm)]
    cut = names.index("mid")
    stages = emit(gm, split_assignment(gm, [cut], 2), 2)
    run_stages(stages, torch.randn(1, 2, 8))  # a good call first
    values = list(stages.modules[0](torch.randn(1, 2, 8)))
    values[stages.input_names[1].index("relu_2")] = torch.randn(1, 5, 2)  # wrong channels for self.mid
    with pytest.raises(RuntimeError) as info:
        stages.modules[1](*values)
    assert type(info.value) is RuntimeError
    src_line = inspect.getsourcelines(UNetish.forward)[1] + 4
    text, source = check_note(note_of(info.value), 1, stages.modules[1], src_line)
    assert text == "mid = self.mid(relu_2)"
    assert source.endswith("m = torch.tanh(self.mid(e3))")
    # the original traceback is kept, down to the generated line and the conv itself
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(info.value.__traceback__)]
    assert any("eval_with_key" in f for f in frames)
    assert any(f.endswith("conv.py") for f in frames)


def test_error_raised_by_the_generated_line_itself_keeps_traceback():
    """torch.cat fails in C++ right in the generated frame: fx's own wrapper would drop
    the traceback there; ours keeps it and adds the note."""
    model = UNetish()
    gm = trace(model)
    names = [n.name for n in compute_nodes(gm)]
    cut = names.index("interpolate")
    assignment = split_assignment(gm, [cut], 2)
    stages = emit(gm, assignment, 2)
    with pytest.raises(RuntimeError, match="Sizes of tensors must match") as info:
        run_stages(stages, torch.randn(1, 2, 7))  # odd length: skip and upsampled path differ
    note = note_of(info.value)
    src_line = inspect.getsourcelines(UNetish.forward)[1] + 5
    text, _ = check_note(note, 1, stages.modules[1], src_line)
    assert text.startswith("cat = torch.cat([interpolate, relu_1]")
    tb = info.value.__traceback__
    frames = [f.f_code.co_filename for f, _ in traceback.walk_tb(tb)]
    assert any("eval_with_key" in f for f in frames)


class Boom(Exception):
    pass


class Picky(nn.Module):
    def forward(self, x):
        if x.shape[-1] != 4:
            raise Boom(f"bad width {x.shape[-1]}")
        return x * 2


class WithPicky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.picky = Picky()

    def forward(self, x):
        h = self.lin(x)
        return (self.picky(h),)


class LeafTracer(fx.Tracer):
    record_stack_traces = True

    def is_leaf_module(self, m, qualname):
        return isinstance(m, Picky) or super().is_leaf_module(m, qualname)


def test_custom_exception_type_is_preserved():
    model = WithPicky()
    gm = fx.GraphModule(model, LeafTracer().trace(model))
    stages = emit(gm, {"x": 0, "lin": 0, "picky": 1, "output": 1}, 2)
    with pytest.raises(Boom) as info:
        run_stages(stages, torch.randn(2, 3))
    assert type(info.value) is Boom
    assert info.value.args == ("bad width 3",)
    src_line = inspect.getsourcelines(WithPicky.forward)[1] + 2
    text, source = check_note(note_of(info.value), 1, stages.modules[1], src_line)
    assert text == "picky = self.picky(lin)"
    assert source.endswith("return (self.picky(h),)")


def test_missing_portal_value_is_annotated_as_portal():
    model = LateInput()
    gm = trace(model)
    names = [n.name for n in compute_nodes(gm)]
    assignment = dict(zip(names, [0, 0, 1, 1, 2, 2]))
    assignment.update(x=0, unused=0, y=0, output=2)
    stages = emit(gm, assignment, 3)
    with pytest.raises(RuntimeError, match="y__to2") as info:  # stage 0 never ran: nothing stashed
        stages.modules[2](torch.randn(4, 5))
    note = note_of(info.value)
    assert note.startswith("in fxpipe stage 2 (Stage2), generated line")
    assert "`y = fxpipe_portals_pop('y__to2')`; portal 'y__to2' (pop)" in note


def test_stage_names_and_emit_are_deterministic():
    model = UNetish()
    gm = trace(model)
    n = len(compute_nodes(gm))
    assignment = split_assignment(gm, [2, n // 2, n - 3], 4)
    a = emit(gm, assignment, 4)
    b = emit(gm, dict(reversed(list(assignment.items()))), 4)
    assert [m.code for m in a.modules] == [m.code for m in b.modules]
    assert a.portals == b.portals
    # every original node name survives somewhere, unchanged
    emitted = {n.name for m in a.modules for n in m.graph.nodes}
    assert {n.name for n in gm.graph.nodes if n.op != "output"} <= emitted


def test_every_node_in_exactly_one_stage_for_all_small_splits():
    model = EarlyOutput()
    gm = trace(model)
    n = len(compute_nodes(gm))
    for n_stages in (2, 3):
        for cuts in itertools.combinations(range(n + 1), n_stages - 1):
            stages = emit(gm, split_assignment(gm, list(cuts), n_stages), n_stages)
            computed = [n.name for m in stages.modules for n in m.graph.nodes
                        if n.op == "call_module" or (n.op == "call_function" and "fxpipe_portal" not in n.meta)]
            assert sorted(computed) == sorted(c.name for c in compute_nodes(gm))
