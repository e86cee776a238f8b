"""Small models that exercise what real networks do to a pipeline.

Each factory returns ``(model, sample_args, sample_kwargs)`` and is deterministic for a
given ``seed``. They are tiny (CPU, batch 4-8) so every test suite can afford all of them:
skip connections over many layers, concat fan-in, tuple/dict/dataclass outputs, tied
weights, BatchNorm state and dropout randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

Sample = tuple[nn.Module, tuple, dict]


def _seeded(seed: int) -> torch.Generator:
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed + 1)


# -- convolutional ---------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class ResNetLike(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(8, 8), BasicBlock(8, 8))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2), BasicBlock(16, 16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def resnet_like(seed: int = 0, batch: int = 8) -> Sample:
    g = _seeded(seed)
    return ResNetLike(), (torch.randn(batch, 3, 16, 16, generator=g),), {}


def _conv_block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class UNet(nn.Module):
    """Encoder/decoder whose long skips (enc1 -> dec1) cross most of the network."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.enc1, self.enc2, self.enc3 = _conv_block(3, c), _conv_block(c, 2 * c), _conv_block(2 * c, 4 * c)
        self.pool = nn.MaxPool2d(2)
        self.mid = _conv_block(4 * c, 4 * c)
        self.up3 = nn.ConvTranspose2d(4 * c, 4 * c, 2, stride=2)
        self.dec3 = _conv_block(8 * c, 2 * c)
        self.up2 = nn.ConvTranspose2d(2 * c, 2 * c, 2, stride=2)
        self.dec2 = _conv_block(4 * c, c)
        self.up1 = nn.ConvTranspose2d(c, c, 2, stride=2)
        self.dec1 = _conv_block(2 * c, c)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        e3 = self.enc3(self.pool(e2))
        m = self.mid(self.pool(e3))
        d3 = self.dec3(torch.cat([self.up3(m), e3], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1)


def unet(seed: int = 0, batch: int = 4) -> Sample:
    g = _seeded(seed)
    return UNet(), (torch.randn(batch, 3, 16, 16, generator=g),), {}


class DenseBlock(nn.Module):
    """Every layer reads the concatenation of all earlier outputs (maximal fan-in)."""

    def __init__(self, cin: int = 4, growth: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.BatchNorm2d(cin + i * growth), nn.ReLU(), nn.Conv2d(cin + i * growth, growth, 3, padding=1))
            for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [x]
        for layer in self.layers:
            feats.append(layer(torch.cat(feats, 1)))
        return torch.cat(feats, 1)


def densenet_block(seed: int = 0, batch: int = 4) -> Sample:
    g = _seeded(seed)
    return DenseBlock(), (torch.randn(batch, 4, 8, 8, generator=g),), {}


class InceptionBlock(nn.Module):
    """Parallel branches concatenated; returns a tuple (features, auxiliary logits)."""

    def __init__(self, cin: int = 4) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(cin, 2, 1), nn.ReLU(), nn.Conv2d(2, 4, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, 4, 1))
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = F.relu(torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1))
        return y, self.aux(y.mean(dim=(2, 3)))


def inception_block(seed: int = 0, batch: int = 4) -> Sample:
    g = _seeded(seed)
    return InceptionBlock(), (torch.randn(batch, 4, 8, 8, generator=g),), {}


# -- transformer -----------------------------------------------------------------------------
class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        r = torch.arange(t, device=x.device)
        causal = r[None, :] <= r[:, None]  # key position <= query position
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT-style LM whose head weight IS the token embedding weight (tied)."""

    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 2, layers: int = 3, ctx: int = 16) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt_tied(seed: int = 0, batch: int = 4) -> Sample:
    g = _seeded(seed)
    return TinyGPT(), (torch.randint(0, 64, (batch, 16), generator=g),), {}


# -- structured inputs/outputs, state, randomness --------------------------------------------
class KwargsDictModel(nn.Module):
    """Keyword-only tensor + float inputs; dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.dec = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None = None, scale: float = 1.0) -> dict[str, Any]:
        h = torch.tanh(self.enc(x)) * scale
        if mask is not None:
            h = h * mask
        return {"hidden": h, "out": self.dec(h)}


def kwargs_dict_model(seed: int = 0, batch: int = 6) -> Sample:
    g = _seeded(seed)
    x = torch.randn(batch, 8, generator=g)
    mask = (torch.rand(batch, 16, generator=g) > 0.3).float()
    return KwargsDictModel(), (x,), {"mask": mask, "scale": 0.5}


class BNModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16),
                                 nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def bn_model(seed: int = 0, batch: int = 8) -> Sample:
    g = _seeded(seed)
    return BNModel(), (torch.randn(batch, 8, generator=g),), {}


class DropoutModel(nn.Module):
    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 4)
        # modules, not F.dropout(..., self.training): a traced graph then follows .train()/.eval()
        self.drop, self.drop2 = nn.Dropout(p), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.drop2(self.drop(F.relu(self.fc1(x)))))


def dropout_model(seed: int = 0, batch: int = 8) -> Sample:
    g = _seeded(seed)
    return DropoutModel(), (torch.randn(batch, 8, generator=g),), {}


@dataclass
class DataclassOut:
    logits: torch.Tensor
    features: torch.Tensor
    extra: tuple[torch.Tensor, ...] = ()


class DataclassOutputModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> DataclassOut:
        f = self.body(x)
        return DataclassOut(logits=self.cls(f), features=f, extra=(f.sum(1),))


def dataclass_output_model(seed: int = 0, batch: int = 4) -> Sample:
    g = _seeded(seed)
    return DataclassOutputModel(), (torch.randn(batch, 8, generator=g),), {}


ZOO: dict[str, Callable[..., Sample]] = {
    "resnet_like": resnet_like,
    "unet": unet,
    "densenet_block": densenet_block,
    "inception_block": inception_block,
    "gpt_tied": gpt_tied,
    "kwargs_dict_model": kwargs_dict_model,
    "bn_model": bn_model,
    "dropout_model": dropout_model,
    "dataclass_output_model": dataclass_output_model,
}


class MaskedMeanLM(nn.Module):
    """Its own loss, a masked mean ``(l * mask).sum() / mask.sum()``, beside its logits: a
    micro-batch all masked out counts nothing (``sum / 0``)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 20)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> dict:
        logits = self.head(torch.tanh(self.body(self.embed(ids))))
        per_token = F.cross_entropy(logits.flatten(0, 1), ids.flatten(), reduction="none").view_as(mask)
        return {"loss": (per_token * mask).sum() / mask.sum(), "logits": logits}
