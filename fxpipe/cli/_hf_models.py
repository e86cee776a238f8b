"""``hf:<model_type>`` on the command line: a transformers architecture by name, on meta.

A user wants to see how a 7B model splits before renting the GPUs, without downloading
it: ``fxpipe plan hf:llama --stages 8 --set num_hidden_layers=32``. The model is built from
the architecture's default config (``AutoConfig.for_model``, no network) with the ``--set``
overrides, by the Auto class for its head, under ``torch.device('meta')``: shapes only,
nothing allocated, so it is planned by sizes (``--balance-by params`` or ``memory``) and
cannot be run (:mod:`fxpipe.capture._meta`). Mistakes are :class:`UsageError`: one line naming what
is allowed.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Dict, List, Sequence, Tuple

from ._model_loader import UsageError, make_inputs

__all__ = ["PREFIX", "HEADS", "parse_overrides", "load_hf"]

PREFIX = "hf:"
#: the Auto classes tried, in order, with the name of the mapping saying which types they build
HEADS = (("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
         ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
         ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
         ("AutoModelForImageClassification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"))
#: the sample when no --input is given: one sequence of this many tokens (or one image)
SEQ_LEN = 128
_EXAMPLES = "llama, mistral, qwen2, gemma, phi, gpt2, gpt_neox, opt, bloom, t5, bart, bert, roberta, vit"


def _one_line(e: BaseException) -> str:
    text = "; ".join(ln.strip() for ln in str(e).strip().splitlines() if ln.strip())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _parse_value(text: str) -> Any:
    """``32`` -> 32, ``0.1`` -> 0.1, ``true``/``false``/``none``, JSON lists; else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_overrides(items: Sequence[str], defaults: Any, model_type: str) -> Dict[str, Any]:
    """``['num_hidden_layers=32']`` -> ``{'num_hidden_layers': 32}``, checked against the
    default config: the key must exist and the value must have the default's type."""
    out: Dict[str, Any] = {}
    known = sorted(k for k in defaults.to_dict() if not k.startswith("_"))
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=VALUE, e.g. --set num_hidden_layers=32")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise UsageError(f"--set {key}: {model_type} configs have no key {key!r}; {hint}"
                             f"keys: {', '.join(known)}")
        value, default = _parse_value(raw), getattr(defaults, key)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise UsageError(f"--set {key}={raw}: {key} is a bool (true or false), default {default}")
        if isinstance(default, int) and not isinstance(default, bool) and (
                not isinstance(value, int) or isinstance(value, bool)):
            raise UsageError(f"--set {key}={raw}: {key} is an integer, default {default}")
        if isinstance(default, float) and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise UsageError(f"--set {key}={raw}: {key} is a number, default {default}")
        out[key] = float(value) if isinstance(default, float) else value
    return out


def _head(config: Any) -> Any:
    """The Auto class that builds this config's type (the first of :data:`HEADS`)."""
    import transformers
    from transformers.models.auto import modeling_auto

    for auto_name, mapping in HEADS:
        if config.model_type in getattr(modeling_auto, mapping, {}):
            return getattr(transformers, auto_name)
    raise UsageError(f"hf:{config.model_type}: fxpipe builds types with a causal-LM, seq-to-seq-LM, masked-LM or "
                     "image-classification head, and this one has none; write a factory "
                     "(MODEL = path/to/file.py:factory) that builds the model you want")


def _supported() -> List[str]:
    from transformers.models.auto import modeling_auto

    return sorted({t for _, mapping in HEADS for t in getattr(modeling_auto, mapping, {})})


def _sample(config: Any, auto: Any, inputs: Sequence[str], vocab: int) -> Tuple[tuple, dict]:
    if inputs:
        return make_inputs(inputs, vocab), {}
    import torch

    if auto.__name__ == "AutoModelForImageClassification":
        size = getattr(config, "image_size", 224)
        size = size if isinstance(size, int) else int(size[0])
        return (torch.zeros(1, getattr(config, "num_channels", 3), size, size),), {}
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)
    if auto.__name__ == "AutoModelForSeq2SeqLM":
        return (), {"input_ids": ids, "decoder_input_ids": ids.clone()}
    return (ids,), {}


def load_hf(spec: str, inputs: Sequence[str], overrides: Sequence[str], vocab: int | None) -> Tuple[Any, tuple, dict]:
    """``hf:llama`` -> ``(model on meta, args, kwargs)``: default config plus ``overrides``,
    ``use_cache=False`` unless overridden; the sample is 1 x 128 token ids (one image for
    vision types, ``decoder_input_ids`` too for seq-to-seq), or ``inputs``."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise UsageError(f"MODEL {spec}: hf: models need the transformers package ({_one_line(e)}); "
                         "pip install transformers") from e
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    model_type = spec[len(PREFIX):].strip()
    supported = _supported()
    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, supported, n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(f"MODEL {spec}: transformers {transformers.__version__} has no model type "
                         f"{model_type!r}; {hint}fxpipe builds the {len(supported)} types with a causal-LM, "
                         f"seq-to-seq-LM, masked-LM or image-classification head, e.g. {_EXAMPLES}")
    defaults = transformers.AutoConfig.for_model(model_type)
    settings = {"use_cache": False} if hasattr(defaults, "use_cache") else {}
    settings.update(parse_overrides(overrides, defaults, model_type))
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings)
    except Exception as e:  # noqa: BLE001 - transformers validates combinations
        raise UsageError(f"MODEL {spec}: the config with --set {settings} is refused by transformers: "
                         f"{_one_line(e)}") from e
    auto = _head(config)
    try:
        with torch.device("meta"):
            model = auto.from_config(config)
    except Exception as e:  # noqa: BLE001 - e.g. hidden_size not divisible by the heads
        raise UsageError(f"MODEL {spec}: transformers cannot build {auto.__name__} from this config "
                         f"({_one_line(e)}); check the --set values") from e
    args, kwargs = _sample(config, auto, inputs, vocab or int(getattr(config, "vocab_size", 100) or 100))
    return model.train(), args, kwargs
