"""What the per-step cost benchmarks share: a GPT-2 at the test sizes with a padded batch, and
contenders timed in a rotating order (``loss_reading.py``, ``batch_fingerprint.py``)."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch


def gpt2_and_batch() -> Tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """transformers' ``GPT2LMHeadModel`` (3 layers, width 64, vocabulary 512, no dropout), a batch
    of 8 x 64 token ids, and its labels with right padding (-100) of 8 lengths."""
    import transformers as T

    torch.manual_seed(0)
    config = T.GPT2Config(n_layer=3, n_embd=64, n_head=4, vocab_size=512, n_positions=128, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = T.GPT2LMHeadModel(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (8, 64), generator=g)
    labels = ids.clone()
    for row, length in enumerate([64, 20, 50, 9, 64, 33, 41, 12]):
        labels[row, length:] = -100
    return model, ids, labels


def timed(run: Callable[[], object], setup: Callable[[], object] = lambda: None) -> Callable[[], float]:
    """A contender: ``setup()`` (untimed: clearing gradients before a step), then the seconds
    ``run()`` takes."""
    def once() -> float:
        setup()
        t = time.perf_counter()
        run()
        return time.perf_counter() - t
    return once


def rotating_medians(contenders: Sequence[Tuple[str, Callable[[], float]]], repeat: int) -> Dict[str, float]:
    """Each contender (a name, a function returning the seconds it timed) run ``repeat`` times,
    starting each round one further along so that a drift hits all alike; their medians."""
    times: Dict[str, List[float]] = {name: [] for name, _ in contenders}
    order = list(contenders)
    for r in range(repeat):
        k = r % len(order)
        for name, fn in order[k:] + order[:k]:
            times[name].append(fn())
    return {name: statistics.median(v) for name, v in times.items()}
