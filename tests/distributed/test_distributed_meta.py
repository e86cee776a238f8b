"""fxpipe.distributed on a model built on the meta device: each rank materialises its own stages.

Every rank builds the model under ``torch.device('meta')`` and loads its stages' keys from
a state_dict file or a torch.distributed.checkpoint directory that the parent saved from the
eager model. The parent checks, per rank: every parameter its stages do not use is still on
meta and the real bytes are those of its stages alone; and, over 3 SGD (momentum) steps, the losses,
the gradients and the updated parameters equal the full (CPU, broadcast) build's and eager's.
Ranks are spawned with gloo on 127.0.0.1 and killed after a deadline (as in test_distributed).
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zoo
from dist_harness import run_ranks
from exact import assert_all_close, assert_close_scaled, largest

STEPS = 3


def _optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum: linear in the gradients, so the pipeline's rounding (micro-batch
    # sums) stays at rounding level. Adam divides by sqrt(v), which turns a 1e-7 difference in
    # a near-zero gradient into a 1e-4 difference of the update: not a pipeline error.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


class LlamaLogits(nn.Module):
    """A tiny HF Llama (rotary ``inv_freq``: a non-persistent buffer) returning its logits.

    The logits alone: a ``ModelOutput`` returned by the last stage of a distributed pipeline
    fails in torch's backward today (its ``PipelineStage`` detaches each output as a tensor),
    which is not what this file tests."""

    def __init__(self) -> None:
        import transformers as T

        from hf_families import _DEC, no_dropout
        super().__init__()
        self.lm = T.LlamaForCausalLM(no_dropout(T.LlamaConfig(**_DEC, num_key_value_heads=2)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits


class LlamaLabels(LlamaLogits):
    """The same Llama trained by its own ``labels=`` loss (``loss_fn=None``): counted labels on
    meta, the counting code retargeted to the rank's device."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Any:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


class Rotary(nn.Module):
    """A model of the user's own with a non-persistent buffer (no transformers): it needs
    ``init_buffers=`` when built on meta."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, 4)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        half = h.shape[-1] // 2
        angles = torch.cat([h[..., :half] * self.inv_freq, h[..., half:] * self.inv_freq], dim=-1)
        return self.b(h * angles.cos())


def init_rotary(name: str, module: nn.Module) -> None:
    d = module.inv_freq.numel() * 2
    module.inv_freq.copy_(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))


#: name -> (build the model, (sample args, sample kwargs), target, loss_fn, chunks)
def _case(name: str) -> tuple[Callable[[], nn.Module], tuple, dict, torch.Tensor, Any, int]:
    g = torch.Generator().manual_seed(1)
    if name == "gpt":
        _, (x,), _ = zoo.gpt_tied()
        return zoo.TinyGPT, (x,), {}, torch.randint(0, 64, (4, 16), generator=g), _gpt_loss, 2
    if name == "llama":
        from hf_families import ids, padding_mask
        return LlamaLogits, (ids(),), {"attention_mask": padding_mask()}, ids(5), _gpt_loss, 2
    if name == "llamalabels":
        from hf_families import ids, padding_mask
        labels = ids(5)
        labels[:, -2:] = -100  # right padding the loss does not count
        return (LlamaLabels, (ids(),), {"attention_mask": padding_mask(), "labels": labels}, labels,
                lambda out, y: out.loss, 2)
    if name == "rotary":
        return Rotary, (torch.randn(4, 8, generator=g),), {}, torch.randn(4, 4, generator=g), F.mse_loss, 2
    raise KeyError(name)


def _weights(name: str) -> nn.Module:
    """The model every build starts from (seeded): eager trains it, the checkpoints hold it."""
    torch.manual_seed(0)
    return _case(name)[0]()


def _train(step: Callable[[], torch.Tensor], named: Callable[[], Any], opt: torch.optim.Optimizer) -> list[dict]:
    """STEPS optimizer steps: per step the loss, the gradients, the parameters after the update."""
    out = []
    for _ in range(STEPS):
        loss = step()
        grads = {n: p.grad.clone() for n, p in named() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        out.append({"loss": loss.item(), "grads": grads, "params": {n: p.detach().clone() for n, p in named()}})
    return out


def _eager(name: str) -> list[dict]:
    model = _weights(name)
    _, args, kwargs, y, loss_fn, _ = _case(name)
    opt = _optimizer(model.parameters())
    return _train(lambda: _backward(loss_fn(model(*args, **kwargs), y)), model.named_parameters, opt)


def _backward(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


def _bytes(tensors: Any) -> int:
    return sum(t.nbytes for t in {id(t): t for t in tensors}.values())


def _run(name: str, source: Any, schedule: str, init_buffers: bool = False, save: str | None = None,
         stages_per_rank: int = 1) -> dict:
    """One build and its trajectory, with what the rank holds. ``source``: the state_dict= of
    a meta build (``("safetensors", folder)``: read by dcp.HuggingFaceStorageReader), None
    for the full CPU build. ``save``: a directory each rank saves its trained tensors into
    with torch.distributed.checkpoint, as README says."""
    import torch.distributed.checkpoint as dcp

    import fxpipe.distributed as fpd

    build, args, kwargs, y, loss_fn, chunks = _case(name)
    if source is None:
        model = _weights(name)
    else:
        with torch.device("meta"):
            model = build()
    asked: list[str] = []
    if isinstance(source, tuple) and source[0] == "safetensors":
        source = dcp.HuggingFaceStorageReader(source[1])
    elif isinstance(source, tuple):  # a callable reading a file, as a custom format would; one name of the tie
        file = source[1]

        def source(keys: list[str]) -> dict:
            asked.extend(keys)
            return {k: v for k, v in torch.load(file, mmap=True).items() if k in keys and k != "head.weight"}
    own = name == "llamalabels"  # the model's own labels= loss: loss_fn=None, no target
    pipe = fpd.pipeline(model, args, sample_kwargs=kwargs, chunks=chunks * stages_per_rank,
                        loss_fn=None if own else loss_fn,
                        schedule=schedule, stages_per_rank=stages_per_rank, timeout=60, state_dict=source,
                        init_buffers=init_rotary if init_buffers else None)
    local = {n for n, _ in pipe.named_parameters()}
    stage_tensors = [t for k in pipe.local for t in [*pipe.stages[k].parameters(), *pipe.stages[k].buffers()]]
    held = {
        "local": local,
        "meta_elsewhere": all(p.is_meta for n, p in model.named_parameters() if n not in local),
        "real_bytes": _bytes(t for t in [*model.parameters(), *model.buffers()] if not t.is_meta),
        "stage_bytes": _bytes(stage_tensors),
        "all_bytes": sum(t.numel() * t.element_size() for t in {id(t): t for t in
                                                                [*model.parameters(), *model.buffers()]}.values()),
        "stage_meta": [n for k in pipe.local for n, t in pipe.stages[k].named_parameters() if t.is_meta],
        "buffers": {n: b.clone() for n, b in model.named_buffers() if not b.is_meta},
        "asked": asked,
    }
    opt = _optimizer(pipe.parameters())
    traj = _train(lambda: pipe.step(*args, **kwargs) if own else pipe.step(*args, target=y, **kwargs),
                  pipe.named_parameters, opt)
    if save is not None:  # this rank's real tensors; a key held by two ranks (a tie) is written once
        dcp.save({k: v for k, v in model.state_dict().items() if not v.is_meta}, checkpoint_id=save)
    pipe.close()
    return {"held": held, "traj": traj}


def _errors(rank: int, path: str) -> dict:
    """Refusals: each is a typed error on every rank, named."""
    import fxpipe.distributed as fpd
    from fxpipe.errors import DistributedError, MaterialiseError, MetaDeviceError

    build, (x,), _, _, _, _ = _case("gpt")
    seen = {}
    attempts = {
        "no_state_dict": {},
        "time": {"state_dict": path, "balance_by": "time"},
        "missing_key": {"state_dict": {k: v for k, v in torch.load(path).items() if k != "blocks.2.ln2.weight"}},
        "meta_sample": {"state_dict": path},
    }
    for what, options in attempts.items():
        with torch.device("meta"):
            model = build()
        sample = x.to("meta") if what == "meta_sample" else x
        try:
            fpd.pipeline(model, sample, chunks=2, loss_fn=_gpt_loss, timeout=60, **options)
            seen[what] = "built"
        except (MetaDeviceError, MaterialiseError, DistributedError) as e:
            seen[what] = f"{type(e).__name__}: {e}"
    return seen


def _worker(rank: int, world: int, port: int, plan: dict, out: str) -> None:
    import torch.distributed as dist

    from fxpipe.errors import DistributedError

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    results = {}
    for key, (name, source, schedule, options) in plan.items():
        if key == "errors":
            results[key] = _errors(rank, source)
        elif key.endswith("refused"):
            try:
                _run(name, source, schedule, **options)
                results[key] = "built"
            except DistributedError as e:
                results[key] = f"{type(e).__name__}: {e}"
        else:
            results[key] = _run(name, source, schedule, **options)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _save(name: str, tmp: Path, checkpoint_dir: bool = False, wrapped: bool = False) -> str:
    """The eager model's weights as a torch.save file, or as a torch.distributed.checkpoint
    directory (``wrapped``: as the guide's training loop saves, ``{"model": ..., "optim": ...}``)."""
    state = _weights(name).state_dict()
    if not checkpoint_dir:
        torch.save(state, tmp / f"{name}.pt")
        return str(tmp / f"{name}.pt")
    import torch.distributed.checkpoint as dcp

    where = str(tmp / f"{name}-dcp{'-wrapped' if wrapped else ''}")
    dcp.save({"model": state, "optim": {"step": torch.tensor(3.0)}} if wrapped else state, checkpoint_id=where,
             no_dist=True)
    return where


def _check_trajectory(results: list[dict], key: str, name: str, full: str | None = None) -> None:
    """Per rank and step: loss, gradients and updated parameters equal eager's (and the full
    build's, bit for bit, when ``full`` names it); together the ranks cover every parameter."""
    eager = _eager(name)
    covered: set[str] = set()
    for rank, res in enumerate(results):
        traj = res[key]["traj"]
        for s, (got, want) in enumerate(zip(traj, eager)):
            where = f"{key} rank {rank} step {s}"
            # micro-batched sums round otherwise than eager's: tests/exact.py's tolerance, scaled
            # to the largest gradient (parameter) of the whole model, not only of this rank's
            assert_close_scaled(torch.tensor(got["loss"]), torch.tensor(want["loss"]), what=f"{where} loss")
            assert set(got["grads"]) == set(got["params"]) == res[key]["held"]["local"], where
            for kind in ("grads", "params"):
                top = max(largest(t) for t in want[kind].values())
                for n, t in got[kind].items():
                    assert_close_scaled(t, want[kind][n], what=f"{where} {kind[:-1]} {n}", floor_of=top)
            if full is not None:
                other = res[full]["traj"][s]
                assert got["loss"] == other["loss"], where
                for n in got["grads"]:
                    assert torch.equal(got["grads"][n], other["grads"][n]), f"{where} grad {n} differs from {full}"
                    assert torch.equal(got["params"][n], other["params"][n]), f"{where} param {n} differs from {full}"
        covered |= res[key]["held"]["local"]
    assert covered == {n for n, _ in _weights(name).named_parameters()}, key


def _check_saved(folder: str, name: str) -> None:
    """What the ranks saved after training (each its own tensors) is the eager model after
    the same steps, whole: loaded into a CPU model it has every key."""
    import torch.distributed.checkpoint as dcp

    model = _weights(name)
    want = _eager(name)[-1]["params"]
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    assert_all_close((f"saved {n}", state[n], p) for n, p in want.items())


def _check_buffers(results: list[dict], key: str, name: str) -> None:
    """Every buffer a rank materialised (persistent ones loaded, non-persistent ones recomputed)
    equals the eager model's, bit for bit."""
    want = dict(_weights(name).named_buffers())
    for rank, res in enumerate(results):
        for n, b in res[key]["held"]["buffers"].items():
            assert torch.equal(b, want[n]), f"{key} rank {rank}: buffer {n} differs from the model's"


def _check_local_only(results: list[dict], key: str) -> None:
    """Each rank holds real values for its stages' tensors and nothing else."""
    for rank, res in enumerate(results):
        held = res[key]["held"]
        assert held["meta_elsewhere"], f"{key} rank {rank}: a parameter of another rank was materialised"
        assert held["stage_meta"] == [], f"{key} rank {rank}: its stages hold meta tensors {held['stage_meta']}"
        assert held["real_bytes"] == held["stage_bytes"] < held["all_bytes"], (key, rank, held)


# -- default run: the tied GPT on 2 ranks (the tie spans the first and the last rank) ---------
@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("meta2")
    file = _save("gpt", tmp)
    plan = {"gpt-meta": ("gpt", file, "1f1b", {}), "gpt-full": ("gpt", None, "1f1b", {}),
            "errors": ("gpt", file, None, {})}
    return run_ranks(_worker, 2, (plan,), tmp)


def test_meta_build_holds_only_its_stages(two_ranks: list[dict]) -> None:
    _check_local_only(two_ranks, "gpt-meta")
    holders = [r for r, res in enumerate(two_ranks) if "tok.weight" in res["gpt-meta"]["held"]["local"]]
    assert holders == [0, 1]  # the tied embedding / LM head: both ranks loaded it


def test_meta_build_trains_as_the_full_build_and_eager(two_ranks: list[dict]) -> None:
    _check_trajectory(two_ranks, "gpt-full", "gpt")
    _check_trajectory(two_ranks, "gpt-meta", "gpt", full="gpt-full")


def test_meta_build_refusals_are_typed_and_on_every_rank(two_ranks: list[dict]) -> None:
    for rank, res in enumerate(two_ranks):
        seen = res["errors"]
        assert seen["no_state_dict"].startswith("MetaDeviceError") and "state_dict=" in seen["no_state_dict"], seen
        assert seen["time"].startswith("MetaDeviceError") and "balance_by='params'" in seen["time"], seen
        assert "blocks.2.ln2.weight" in seen["missing_key"], seen
        assert seen["meta_sample"].startswith("MetaDeviceError") and "real batch" in seen["meta_sample"], seen
    # the rank whose stage needs the key raises MaterialiseError; the other hears of it
    kinds = sorted(res["errors"]["missing_key"].split(":")[0] for res in two_ranks)
    assert kinds == ["MaterialiseError", "PeerFailedError"], kinds


# -- slow: a tiny HF Llama (rotary inv_freq, non-persistent) from a file and from DCP; DCP for
# the GPT; a model of the user's own with a non-persistent buffer and init_buffers= ---------
@pytest.mark.slow
def test_meta_build_from_every_state_dict_form_and_hf_llama(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    llama_file, llama_dir = _save("llama", tmp_path), _save("llama", tmp_path, checkpoint_dir=True)
    (tmp_path / "llama-st").mkdir()
    save_file(_weights("llama").state_dict(), tmp_path / "llama-st" / "model.safetensors")
    rotary, trained = _save("rotary", tmp_path), str(tmp_path / "gpt-trained")
    plan = {"llama-file": ("llama", llama_file, "1f1b", {}), "llama-dcp": ("llama", llama_dir, "gpipe", {}),
            "llama-full": ("llama", None, "1f1b", {}),
            "llama-labels": ("llamalabels", llama_file, "gpipe", {}),  # the same keys (lm.*)
            "llama-safetensors": ("llama", ("safetensors", str(tmp_path / "llama-st")), "gpipe", {}),
            "gpt-dcp": ("gpt", _save("gpt", tmp_path, checkpoint_dir=True), "gpipe", {"save": trained}),
            "gpt-callable": ("gpt", ("callable", _save("gpt", tmp_path)), "1f1b", {}),
            "gpt-wrapped": ("gpt", _save("gpt", tmp_path, checkpoint_dir=True, wrapped=True), "1f1b", {}),
            "gpt-interleaved": ("gpt", _save("gpt", tmp_path), "interleaved1f1b", {"stages_per_rank": 2}),
            "rotary-meta": ("rotary", rotary, "gpipe", {"init_buffers": True}),
            "rotary-refused": ("rotary", rotary, "gpipe", {})}
    results = run_ranks(_worker, 2, (plan,), tmp_path)
    _check_trajectory(results, "llama-safetensors", "llama")
    _check_trajectory(results, "llama-labels", "llamalabels")  # was a bare .item() on meta at the build
    _check_saved(trained, "gpt")
    _check_trajectory(results, "gpt-callable", "gpt")
    _check_trajectory(results, "gpt-wrapped", "gpt")  # the guide's loop's checkpoint: MaterialiseError before
    for res in results:  # asked for its own keys only: every name of the tied weight, no other rank's
        held = res["gpt-callable"]["held"]
        assert {"tok.weight", "head.weight"} <= set(held["asked"]), held["asked"]
        assert {k.rsplit(".", 1)[0] for k in held["asked"]} == {n.rsplit(".", 1)[0] for n in held["local"]} | {"head"}
    _check_trajectory(results, "gpt-interleaved", "gpt")
    for key in ("llama-file", "llama-dcp", "llama-safetensors", "gpt-dcp", "gpt-callable", "gpt-interleaved",
                "rotary-meta"):
        _check_local_only(results, key)
        _check_buffers(results, key, key.split("-")[0])
    # the rotary buffer: recomputed by transformers' own init on the rank that uses it
    assert sum("lm.model.rotary_emb.inv_freq" in res["llama-file"]["held"]["buffers"] for res in results) == 1
    # a buffer of the user's own model with no init_buffers=: refused by name, on every rank
    refusals = sorted(res["rotary-refused"].split(":")[0] for res in results)
    assert refusals == ["MaterialiseError", "PeerFailedError"], refusals
    assert all("'inv_freq'" in res["rotary-refused"] and "init_buffers=" in res["rotary-refused"] for res in results)
    _check_trajectory(results, "llama-full", "llama")
    _check_trajectory(results, "llama-file", "llama", full="llama-full")
    _check_trajectory(results, "llama-dcp", "llama")
    _check_trajectory(results, "gpt-dcp", "gpt")
    _check_trajectory(results, "rotary-meta", "rotary")
