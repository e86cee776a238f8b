"""The models fxpipe.distributed is tested on, and each case's inputs, targets and loss.

``case(name, chunks)`` gives the same model (seeded), batch and target on every rank and in
the parent process that computes the eager reference (tests/dist_harness.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import zoo


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32),
                                 nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ShapeCross(nn.Module):
    """ints, a float and a torch.Size made in stage 0 and used in stage 2: non-tensor values
    carried across two ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, shape, half = x.size(0), x.shape, x.size(1) / 4
        h = self.b(torch.tanh(self.a(x.view(shape))))
        return self.c(torch.tanh(h)).reshape(n, -1).view(shape) * half


class Scaled(nn.Module):
    """Its generated code holds the constant ``factor``: ranks given different factors emit
    different code from the same plan."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * self.factor)


class DropMLP(nn.Module):
    """Dropout in every stage: checkpointed micro-batches must recompute the same masks."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Dropout(0.5),
                                 nn.GELU(), nn.Linear(32, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class DictModel(nn.Module):
    """A dict in (two features and a mask), a dict out (logits, an auxiliary head, the hidden
    state); ``h0`` is a portal from the first stage to a late one."""

    def __init__(self) -> None:
        super().__init__()
        self.enc_a, self.enc_b = nn.Linear(6, 16), nn.Linear(4, 16)
        self.mid1, self.mid2, self.mid3 = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head, self.aux = nn.Linear(16, 3), nn.Linear(16, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        h0 = torch.tanh(self.enc_a(batch["a"]) + self.enc_b(batch["b"]))
        h = torch.tanh(self.mid1(h0 * batch["mask"]))
        h = torch.tanh(self.mid2(h))
        h = torch.tanh(self.mid3(h)) + h0
        return {"logits": self.head(h), "aux": self.aux(h), "hidden": h}


class ParamPaths(nn.Module):
    """Gradient paths torch's zero-bubble weight pass misses (fxpipe.distributed._split_backward):
    stage 1 receives an input that needs no grad (stage 0 has no parameters), and stage 2 sends
    ``sigmoid(w)``, made from a parameter alone, on to stage 5 (carried through stages 3, 4),
    while ``w`` also meets the input path in stage 2. Split points make the six stages."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Tanh()
        self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 4) for _ in range(5))
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x * 2)
        h = self.a(h)
        h = self.b(h) * self.w
        t = torch.sigmoid(self.w) * 2
        h = self.c(h)
        h = self.d(h)
        return self.e(h) + t


class SharedLayers(nn.Module):
    """ALBERT-style sharing: one Linear and one LayerNorm applied at every depth, so each stage
    uses them more than once (torch's zero-bubble weight pass frees what the next parameter
    group needs: fxpipe.distributed._split_backward.incomplete_parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layer = nn.Linear(16, 16)
        self.ln = nn.LayerNorm(16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(4):
            h = self.ln(torch.tanh(self.layer(h)) + h)
        return self.out(h)


class Counted(nn.Linear):
    """A linear layer counting its forward runs. Kept a leaf (``leaf_modules=[Counted]``), so
    its forward runs in the stage: once per micro-batch, and once more when recomputed."""

    def __init__(self, n: int) -> None:
        super().__init__(n, n)
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        return super().forward(x)


class CountedMLP(nn.Module):
    """Eight counted layers: two per stage of four, hence two parameter groups per stage for
    zero bubble's weight pass (each group an ``autograd.grad`` of its own), and a ``cat``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Counted(8) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            h = torch.tanh(layer(x))
            x = torch.cat([h[:, :4], x[:, 4:]], 1) if i % 2 else h
        return x


class CenterInTraining(nn.Module):
    """Mixes the samples of a batch in training only: the micro-batch check refuses it."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h - h.mean(0, keepdim=True) if self.training else h


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.n, self.b = nn.Linear(8, 16), CenterInTraining(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.n(self.a(x)))


def _gpt_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _dict_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out["logits"], y) + 0.5 * out["aux"].pow(2).mean() + 0.1 * out["hidden"].mean()


def _hf_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def _hf_gpt2() -> nn.Module:
    import transformers as T
    from hf_families import VOCAB, no_dropout

    return T.GPT2LMHeadModel(no_dropout(T.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB,
                                                     n_positions=32, bos_token_id=0, eos_token_id=1)))


def case(name: str, chunks: int = 1) -> tuple[nn.Module, Any, torch.Tensor, Any, dict]:
    """(model, x, y, loss_fn, pipeline options): the same on every rank and in the parent.
    The batch is the smallest multiple of ``chunks`` not below the model's usual size (the
    U-Net's: of two samples per micro-batch at least)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)

    def batch(usual: int) -> int:
        return chunks * -(-usual // chunks)

    kind = name.split("-")[0]
    if kind == "drop":
        n = batch(8)
        return DropMLP(), torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g), F.mse_loss, {}
    if kind == "mlp":
        n = batch(8)
        return MLP(), torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g), F.mse_loss, {}
    if kind == "unet":  # two samples per micro-batch at least: a cat's input gradient is then strided
        n = max(batch(4), 2 * chunks)
        model, (x,), _ = zoo.unet(batch=n)
        return model, x, torch.randn(n, 2, 16, 16, generator=g), F.mse_loss, {}
    if kind == "gpt":
        n = batch(4)
        model, (x,), _ = zoo.gpt_tied(batch=n)
        return model, x, torch.randint(0, 64, (n, 16), generator=g), _gpt_loss, {}
    if kind == "shape":
        n = batch(4)
        return (ShapeCross(), torch.randn(n, 6, generator=g), torch.randn(n, 6, generator=g), F.mse_loss,
                {"split_points": ["b", "c"]})
    if kind == "dict":
        n = batch(8)
        x = {"a": torch.randn(n, 6, generator=g), "b": torch.randn(n, 4, generator=g),
             "mask": (torch.rand(n, 16, generator=g) > 0.2).float()}
        return DictModel(), x, torch.randn(n, 3, generator=g), _dict_loss, {}
    if kind == "paths":
        n = batch(4)
        return (ParamPaths(), torch.randn(n, 4, generator=g), torch.randn(n, 4, generator=g), F.mse_loss,
                {"split_points": ["a", "b", "c", "d", "e"]})
    if kind == "shared":
        n = batch(8)
        return SharedLayers(), torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g), F.mse_loss, {}
    if kind == "counted":
        n = batch(8)
        return (CountedMLP(), torch.randn(n, 8, generator=g), torch.randn(n, 8, generator=g), F.mse_loss,
                {"leaf_modules": [Counted]})
    if kind == "hf":
        from hf_families import SEQ, VOCAB

        n = batch(4)
        model = _hf_gpt2()
        ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        return model, ids, torch.randint(0, VOCAB, (n, SEQ), generator=g), _hf_loss, {}
    raise KeyError(name)

