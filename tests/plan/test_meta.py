"""Models built on the meta device: planned from shapes, never allocated, never run (issue #10.4).

Each meta plan is compared with the plan of the same model built on the CPU: the same
assignment of every node, for ``balance_by='params'`` and ``'memory'``. Allocation is checked
on the model itself (every parameter and buffer stays ``is_meta``), not by RSS.
"""

from __future__ import annotations


import pytest
import torch

import fxpipe
from fxpipe.cli._main import main
from fxpipe.errors import MetaDeviceError

import zoo

transformers = pytest.importorskip("transformers")

TINY_LLAMA = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64, use_cache=False)
TINY_SET = [a for k, v in TINY_LLAMA.items() if k != "use_cache" for a in ("--set", f"{k}={v}")]


def _all_meta(model: torch.nn.Module) -> bool:
    return all(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _llama(device: str) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("llama", **TINY_LLAMA)
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config)


def _gpt(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return zoo.TinyGPT()


@pytest.mark.parametrize("balance_by", ["params", "memory"])
@pytest.mark.parametrize("build,sample", [
    (_gpt, lambda: torch.randint(0, 64, (4, 16))),
    (_llama, lambda: torch.randint(0, 96, (2, 16))),
], ids=["zoo_gpt_tied", "tiny_llama"])
def test_meta_plan_equals_cpu_plan(build, sample, balance_by):
    x = sample()
    real = fxpipe.pipeline(build("cpu"), x, 3, balance_by=balance_by)
    model = build("meta")
    pipe = fxpipe.pipeline(model, x, 3, balance_by=balance_by)
    assert pipe.plan.assignment == real.plan.assignment
    assert [st.cost for st in pipe.plan.stages] == [st.cost for st in real.plan.stages]
    assert _all_meta(model)  # nothing materialised, by planning or by placement
    for k in range(3):  # the stage code is the real build's (devices included)
        assert pipe.stage_code(k) == real.stage_code(k)


def test_meta_pipeline_refuses_to_run_and_its_plan_runs_once_loaded(tmp_path):
    model = _gpt("meta")
    x = torch.randint(0, 64, (4, 16))
    pipe = fxpipe.pipeline(model, x, 3, balance_by="params", chunks=2)
    with pytest.raises(MetaDeviceError, match=r"meta device.*to_empty.*load_state_dict.*plan="):
        pipe(x)
    path = tmp_path / "plan.json"
    pipe.plan.save(path)
    # the documented way on: weights in, the saved plan reused (no profiling), exact
    weights = _gpt("cpu")
    model.to_empty(device="cpu")
    model.load_state_dict(weights.state_dict())
    loaded = fxpipe.pipeline(model, x, 3, chunks=2, plan=str(path))
    assert loaded.plan.assignment == pipe.plan.assignment
    torch.testing.assert_close(loaded(x), weights(x), rtol=0, atol=0)


def test_balance_by_time_on_meta_is_refused():
    model = _gpt("meta")
    with pytest.raises(MetaDeviceError, match=r"balance_by='time'.*'params'.*'memory'"):
        fxpipe.pipeline(model, torch.randint(0, 64, (4, 16)), 2)  # 'time' is the default
    assert _all_meta(model)


def test_partly_meta_model_is_refused():
    model = _gpt("cpu")
    model.ln_f.to_empty(device="meta")
    with pytest.raises(MetaDeviceError, match=r"partly on the meta device \('ln_f.weight'\)"):
        fxpipe.pipeline(model, torch.randint(0, 64, (4, 16)), 2, balance_by="params")


def test_cli_plans_hf_model_by_name(capsys):
    assert main(["plan", "hf:llama", "--stages", "3", *TINY_SET, "--input", "2x16:int64"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Plan: 3 stages, balanced by params")  # params: the default on meta
    real = fxpipe.pipeline(_llama("cpu"), torch.randint(0, 96, (2, 16)), 3, balance_by="params")
    assert out.splitlines()[:5] == str(real.plan).splitlines()[:5]


def test_cli_code_of_hf_model(capsys):
    assert main(["code", "hf:llama", "--stages", "2", *TINY_SET, "--stage", "1", "--balance-by", "memory"]) == 0
    out = capsys.readouterr().out
    assert "def forward" in out and "lm_head" in out


@pytest.mark.parametrize("argv,message", [
    (["plan", "hf:llamaa", "-n", "2"], "has no model type 'llamaa'; did you mean llama"),
    (["plan", "hf:llama", "-n", "2", "--set", "num_hidden_layer=3"],
     "llama configs have no key 'num_hidden_layer'; did you mean num_hidden_layers"),
    (["plan", "hf:llama", "-n", "2", "--set", "num_hidden_layers=three"], "num_hidden_layers is an integer, default 32"),
    (["plan", "hf:llama", "-n", "2", "--set", "num_hidden_layers"], "expected KEY=VALUE"),
    (["plan", "hf:llama", "-n", "2", *TINY_SET, "--balance-by", "time"], "balance_by='time'"),
    (["plan", "tests/zoo.py:unet", "-n", "2", "--set", "a=1"], "--set configures hf:<model_type> models"),
])
def test_cli_hf_mistakes_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
