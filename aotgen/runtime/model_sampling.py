"""A model's own sampling values: those of the package's generation_config.json, which
`aotgen run` and `aotgen serve` use where a request leaves a value out (transformers'
`generate`, llama.cpp's `general.sampling.*` and vLLM's `--generation-config auto` do the
same)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aotgen.runtime.rules import Penalties
from aotgen.runtime.sampling import SamplingParams

# The generation_config.json keys that pick tokens, and with the answer's length the keys a
# request may leave to the model (vLLM's set).
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")
MODEL_SAMPLING_KEYS = (*SAMPLING_KEYS, "max_new_tokens")


def read_generation_config(tokenizer_dir: Path) -> dict[str, Any]:
    """The package's generation_config.json; {} where it has none (or not a JSON object)."""
    path = tokenizer_dir / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return config if isinstance(config, dict) else {}


def model_values(config: dict[str, Any]) -> dict[str, Any]:
    """The values of MODEL_SAMPLING_KEYS `config` gives (vLLM reads these and no others)."""
    return {key: config[key] for key in MODEL_SAMPLING_KEYS if config.get(key) is not None}


def generation_defaults(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The sampling values one generation takes from `config`, read as transformers reads
    them: `do_sample: false` decodes greedily whatever the temperature says, `do_sample: true`
    without a temperature samples at 1. The answer's length stays the caller's (a model's
    max_new_tokens may pass what the context leaves a prompt). A value the runtime refuses is
    left out, and listed as `key=value (why)`."""
    values = {k: v for k, v in model_values(config).items() if k in SAMPLING_KEYS}
    if config.get("do_sample") is False:
        values.pop("temperature", None)
    elif config.get("do_sample") is True:
        values.setdefault("temperature", 1.0)
    defaults: dict[str, Any] = {}
    refused: list[str] = []
    for key in (key for key in SAMPLING_KEYS if key in values):
        value = values[key]
        try:
            _check(key, value)
        except ValueError as e:
            refused.append(f"{key}={value!r} ({e})")
        else:
            defaults[key] = value
    return defaults, refused


def _check(key: str, value: Any) -> None:
    """Raises ValueError for a value the runtime refuses from a request too."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError("not a number")
    if key == "repetition_penalty":
        Penalties(repetition=float(value))
    elif key == "top_k":
        SamplingParams(top_k=value)
    else:
        SamplingParams(**{key: float(value)})
