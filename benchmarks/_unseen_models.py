"""Three models ``fxpipe.tune`` was not built on (issue 33), each with its loss and data.

* ``vit``: a small ViT written from scratch (patch embedding by a strided convolution, a
  class token, pre-norm blocks of ``nn.MultiheadAttention`` and an MLP, a linear head);
* ``unet``: a U-Net-like net with GroupNorm and a long skip from the input image to the
  head (the image is concatenated to the last features: a value needing no gradient carried
  from the first stage to the last);
* ``qwen3``: a tiny ``transformers`` ``Qwen3ForCausalLM`` with tied input and output
  embeddings (one weight read by the first and the last stage).

Each builder returns ``(model, sample, target, loss_fn, description)``; ``loss_fn(output,
target)`` is the training loss on the model's output (cross entropy).
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

Built = Tuple[nn.Module, torch.Tensor, torch.Tensor, Callable[[Any, torch.Tensor], torch.Tensor], str]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int = 32, patch: int = 4, d: int = 64, depth: int = 4, heads: int = 4,
                 classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, d, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.02)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.blocks(x))[:, 0])


def _conv(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(4, o), nn.SiLU())


class SkipUNet(nn.Module):
    """Two levels down and up, GroupNorm, and the input image concatenated to the head."""

    def __init__(self, c: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.d1, self.d2 = _conv(3, c), _conv(c, 2 * c)
        self.mid = _conv(2 * c, 2 * c)
        self.u2, self.u1 = _conv(4 * c, c), _conv(2 * c, c)
        self.head = nn.Conv2d(c + 3, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.d1(x)
        b = self.d2(F.avg_pool2d(a, 2))
        m = self.mid(F.avg_pool2d(b, 2))
        u = self.u2(torch.cat([F.interpolate(m, scale_factor=2.0), b], 1))
        u = self.u1(torch.cat([F.interpolate(u, scale_factor=2.0), a], 1))
        return self.head(torch.cat([u, x], 1))


def vit() -> Built:
    torch.manual_seed(0)
    return (ViT(), torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,)), F.cross_entropy,
            "ViT from scratch (32x32 images, patch 4, d=64, 4 blocks, 4 heads), batch 16")


def unet() -> Built:
    torch.manual_seed(0)
    x = torch.randn(16, 3, 32, 32)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.float(), y)

    return (SkipUNet(), x, torch.randint(0, 4, (16, 32, 32)), loss,
            "U-Net-like (c=16, GroupNorm, the input image concatenated to the head), 16x3x32x32")


def qwen3() -> Built:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=True, use_cache=False)
    model = Qwen3ForCausalLM(config)
    model.config.use_cache = False
    tokens = torch.randint(0, 2048, (16, 32))

    def loss(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())

    return (model, tokens, torch.randint(0, 2048, (16, 32)), loss,
            "Qwen3ForCausalLM (vocab 2048, d=64, 4 layers, tied embeddings), 16x32 tokens")


MODELS = {"vit": vit, "unet": unet, "qwen3": qwen3}
