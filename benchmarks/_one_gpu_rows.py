"""The models and the rows of ``benchmarks/one_gpu.py`` (issue 21): how each row trains one
step, and how its result is checked against eager's.

A row is named by a key (``--rows``):

* ``eager``: ``model(ids)``, loss outside the model, ``loss.backward()``;
* ``accum``: eager with gradient accumulation over the same ``--chunks`` micro-batches
  (each micro-batch's loss weighted by its share of the batch, one backward each);
* ``hf_ckpt``: eager after ``model.gradient_checkpointing_enable()`` (whole batch);
* ``compiled``: ``torch.compile(model)``; ``compiled_hf_ckpt``: the same with HF checkpointing;
* ``ro_accum``: ``torch.compile(model, mode='reduce-overhead')`` with gradient accumulation
  over the micro-batches (issue 21's CUDA-graphs floor for a pipeline's micro-batches);
  ``ro``: the same, whole batch;
* ``pipe:<chunks>:<checkpoint>[:compile|:ro]``: ``fxpipe.pipeline(model, ids, 4, chunks=...,
  checkpoint=..., devices=[device] * 4, balance_by='params')``, with ``compile=True`` or
  ``compile={'mode': 'reduce-overhead'}``.

The loss is cross entropy of the logits against targets drawn apart from the inputs (no
shift: no copy of the logits), outside the model, in the caller's autocast. Every row
trains its own deep copy of the same weights.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import fxpipe  # noqa: E402
import exact  # noqa: E402

STAGES = 4
#: the rows of issue 21's tables, uncompiled first: compiling takes most of a GPU run's time
UNCOMPILED = {
    "gpt2": ["eager", "accum", "hf_ckpt", "pipe:1:never", "pipe:4:never", "pipe:4:except_last", "pipe:4:always",
             "pipe:8:always", "pipe:1:except_last", "pipe:1:always"],
    "llama1b": ["eager", "accum", "hf_ckpt", "pipe:1:never", "pipe:4:never", "pipe:4:except_last", "pipe:4:always"],
}
#: the CUDA-graph floor and the pipeline's graphs first (§1), then the other compiled rows
COMPILED = ["pipe:4:never:ro", "ro_accum", "compiled", "pipe:4:never:compile", "ro", "pipe:1:never:compile",
            "compiled_hf_ckpt"]


def row_keys(model: str, rows: Optional[List[str]], quick: bool, device: torch.device) -> List[str]:
    """``--rows`` as given (``all``: every default row, ``uncompiled``: those not compiled,
    ``compiled``: the compiled ones); without it GPT-2's table has every row and the Llama's the
    uncompiled ones (issue 21's), and a ``--quick`` run on the CPU leaves the compiled rows out
    (inductor's C++ builds take minutes on a small CPU: ask for them with ``--rows all``)."""
    groups = {"uncompiled": UNCOMPILED[model], "compiled": COMPILED, "all": UNCOMPILED[model] + COMPILED}
    if rows is None:
        rows = ["uncompiled"] if model == "llama1b" or (quick and device.type == "cpu") else ["all"]
    keys = [k for r in rows for k in groups.get(r, [r])]
    for k in keys:
        if k not in _FIXED_ROWS:
            if not k.startswith("pipe:"):
                raise SystemExit(f"unknown row {k!r}: one of {', '.join(_FIXED_ROWS)}, pipe:<chunks>:<checkpoint>"
                                 f"[:compile|:ro], or a group ({', '.join(groups)})")
            parse_pipe(k)
    return ["eager"] + [k for k in dict.fromkeys(keys) if k != "eager"]  # eager first: the reference


@dataclass
class ModelSpec:
    name: str
    make: Callable[[], nn.Module]
    batch: int
    seq: int
    vocab: int


_FIXED_ROWS = ("eager", "accum", "hf_ckpt", "compiled", "compiled_hf_ckpt", "ro_accum", "ro")


def model_spec(name: str, quick: bool) -> ModelSpec:
    """GPT-2 124M (batch 16 x 1024) or a 0.94B Llama (batch 8 x 2048); ``quick``: tiny ones."""
    import transformers as T

    if name == "gpt2":
        size = (dict(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64, bos_token_id=0, eos_token_id=0)
                if quick else {})
        cfg = T.GPT2Config(use_cache=False, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **size)
        return ModelSpec("gpt2", lambda: T.GPT2LMHeadModel(cfg), 8 if quick else 16, cfg.n_positions, cfg.vocab_size)
    if name == "llama1b":
        # 0.94B parameters as issue 21 measured (hidden 2048, 16 layers, vocab 32000)
        size = (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=512, max_position_embeddings=64) if quick else
                dict(hidden_size=2048, intermediate_size=5504, num_hidden_layers=16, num_attention_heads=16,
                     num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048))
        cfg = T.LlamaConfig(use_cache=False, attention_dropout=0.0, **size)
        return ModelSpec("llama1b", lambda: T.LlamaForCausalLM(cfg), 8, cfg.max_position_embeddings,
                         cfg.vocab_size)
    raise SystemExit(f"unknown --model {name!r}: gpt2 or llama1b")


def loss_of(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def logits_of(out: Any) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out


class Runner:
    """One row's way of training a step; ``params`` are the copy's, in the model's order."""

    def __init__(self, model: nn.Module, call: Callable[..., Any], chunks: int = 1,
                 close: Callable[[], None] = lambda: None, graphs: bool = False) -> None:
        self.model, self.call, self.chunks, self.close, self.graphs = model, call, chunks, close, graphs
        self.named = list(model.named_parameters())

    def zero(self) -> None:
        for _, p in self.named:
            p.grad = None

    def step(self, ids: torch.Tensor, targets: torch.Tensor, keep: bool = False) -> Optional[Tuple[Any, Any]]:
        """Forward and backward of the batch (in ``chunks`` micro-batches when > 1);
        ``keep``: returns (loss, logits) detached and cloned, for the exactness check."""
        losses, logits = [], []
        for x, t in zip(ids.chunk(self.chunks), targets.chunk(self.chunks)):
            if self.graphs:
                torch.compiler.cudagraph_mark_step_begin()
            out = self.call(x)
            loss = loss_of(out, t) * (x.shape[0] / ids.shape[0])
            if keep:  # cloned before a graph replay may overwrite them
                losses.append(loss.detach().clone())
                logits.append(logits_of(out).detach().clone())
            loss.backward()
            del out, loss
        if keep:
            return torch.stack(losses).sum(), torch.cat(logits)
        return None

    def grads(self) -> List[Tuple[str, Optional[torch.Tensor]]]:
        return [(n, None if p.grad is None else p.grad.detach().clone()) for n, p in self.named]


def parse_pipe(key: str) -> Tuple[int, str, Any]:
    """``pipe:<chunks>:<checkpoint>[:compile|:ro]`` -> (chunks, checkpoint, compile option)."""
    parts = key.split(":")
    if len(parts) not in (3, 4) or parts[2] not in ("never", "except_last", "always") or not parts[1].isdigit():
        raise SystemExit(f"bad row {key!r}: pipe:<chunks>:<never|except_last|always>[:compile|:ro]")
    option: Any = False
    if len(parts) == 4:
        option = {"compile": True, "ro": {"mode": "reduce-overhead"}}.get(parts[3])
        if option is None:
            raise SystemExit(f"bad row {key!r}: the fourth part is 'compile' or 'ro'")
    return int(parts[1]), parts[2], option


def label(key: str, chunks: int) -> str:
    """The row's name in the tables."""
    fixed = {
        "eager": "eager",
        "accum": f"eager, gradient accumulation over {chunks} micro-batches",
        "hf_ckpt": "eager + HF gradient checkpointing (whole batch)",
        "compiled": "torch.compile(model)",
        "compiled_hf_ckpt": "torch.compile(model) + HF gradient checkpointing",
        "ro_accum": f"torch.compile(model, mode='reduce-overhead'), accumulation over {chunks} micro-batches",
        "ro": "torch.compile(model, mode='reduce-overhead'), whole batch",
    }
    if key in fixed:
        return fixed[key]
    c, mode, option = parse_pipe(key)
    extra = "" if option is False else ", `compile=True`" if option is True else f", `compile={option!r}`"
    return f"fxpipe chunks={c} `'{mode}'`{extra}"


def is_compiled(key: str) -> bool:
    return key in ("compiled", "compiled_hf_ckpt", "ro_accum", "ro") or key.endswith((":compile", ":ro"))


def build(key: str, master: nn.Module, ids: torch.Tensor, chunks: int, device: torch.device) -> Runner:
    """The row's runner on a deep copy of ``master`` (built in the caller's autocast)."""
    model = copy.deepcopy(master).train()
    if key in ("hf_ckpt", "compiled_hf_ckpt"):
        model.gradient_checkpointing_enable()
    if key in ("eager", "hf_ckpt"):
        return Runner(model, model)
    if key == "accum":
        return Runner(model, model, chunks)
    if key in ("compiled", "compiled_hf_ckpt"):
        return Runner(model, torch.compile(model))
    if key in ("ro", "ro_accum"):
        graphs = device.type == "cuda"
        return Runner(model, torch.compile(model, mode="reduce-overhead"), chunks if key == "ro_accum" else 1,
                      graphs=graphs)
    if not key.startswith("pipe:"):
        raise SystemExit(f"unknown row {key!r}")
    c, mode, option = parse_pipe(key)
    pipe = fxpipe.pipeline(model, ids, STAGES, chunks=c, checkpoint=mode, devices=[device] * STAGES,
                           balance_by="params", compile=option, progress=False)
    return Runner(model, pipe, close=pipe.close)


def tolerance(autocast: bool, compiled: bool, grads: bool) -> exact.Tol:
    """bf16 autocast: tests/exact.py's BF16 (without its absolute part for gradients, which
    are far below 1: there the allowance is 2% of the largest gradient, as for float32 it is a
    multiple of float32's rounding); float32: its GPU tolerance (other kernels for a
    micro-batch, inductor's reassociation), or FP32 for uncompiled CPU rows."""
    if autocast:
        return replace(exact.BF16, atol=0.0) if grads else exact.BF16
    return exact.GPU if compiled or torch.cuda.is_available() else exact.FP32


def worst_error(named: List[Tuple[str, Optional[torch.Tensor], Optional[torch.Tensor]]],
                tol: exact.Tol) -> Tuple[float, str]:
    """The largest ``|got - expected| / allowed`` over all elements (tests/exact.py's policy:
    allowed = rtol * |expected| + max(atol, scale * magnitude)); > 1 is a failure. A value
    missing on one side only is infinitely wrong."""
    top = max((_largest(e) for _, _, e in named if e is not None), default=0.0)
    worst, where = 0.0, ""
    for name, got, expected in named:
        if (got is None) != (expected is None):
            return float("inf"), f"{name}: {'no' if got is None else 'a'} gradient where eager has " \
                                 f"{'one' if got is None else 'none'}"
        if expected is None:
            continue
        if got.shape != expected.shape:
            return float("inf"), f"{name}: shape {tuple(got.shape)}, eager's {tuple(expected.shape)}"
        atol = tol.allowed(max(_largest(expected), exact.FLOOR * top))
        for g, e in zip(_pieces(got), _pieces(expected)):
            diff = (g.float() - e.float()).abs()
            allowed = tol.rtol * e.float().abs() + atol
            ratio = float((diff / allowed).max()) if allowed.min() > 0 else (float("inf") if diff.max() > 0 else 0.0)
            if not ratio <= worst:  # also catches nan
                worst, where = ratio, name
    return worst, where


def _pieces(t: torch.Tensor, n: int = 1 << 25) -> List[torch.Tensor]:
    """A tensor's elements in pieces of n: the float32 temporaries of a comparison of GPT-2's
    logits (0.8G elements) stay small."""
    return list(t.detach().reshape(-1).split(n))


def _largest(t: torch.Tensor) -> float:
    """tests/exact.py's ``largest`` (the largest finite |value|), piece by piece."""
    best = 0.0
    for piece in _pieces(t):
        finite = piece[torch.isfinite(piece)]
        if finite.numel():
            best = max(best, float(finite.abs().max()))
    return best


def check(got: Tuple[Any, Any, list], ref: Tuple[Any, Any, list], autocast: bool, compiled: bool) -> Dict[str, Any]:
    """Loss, logits and every gradient against eager's: the worst error over its allowance."""
    (loss, logits, grads), (rloss, rlogits, rgrads) = got, ref
    tol, gtol = tolerance(autocast, compiled, False), tolerance(autocast, compiled, True)
    parts = {"loss": worst_error([("loss", loss.reshape(1), rloss.reshape(1))], tol),
             "logits": worst_error([("logits", logits, rlogits)], tol),
             "grads": worst_error([(n, g, r) for (n, g), (_, r) in zip(grads, rgrads)], gtol)}
    if [n for n, _ in grads] != [n for n, _ in rgrads]:
        parts["grads"] = (float("inf"), "the parameters differ from eager's")
    name, (ratio, where) = max(parts.items(), key=lambda kv: kv[1][0] if kv[1][0] == kv[1][0] else float("inf"))
    return {"worst_over_allowed": ratio, "worst_in": f"{name}: {where}" if name == "grads" else name,
            "by_part": {k: v[0] for k, v in parts.items()}, "tol": vars(tol), "grad_tol": vars(gtol),
            "exact": ratio <= 1.0}
