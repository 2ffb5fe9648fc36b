"""LoRA adapters merged into the checkpoint's weights before the model is built: the package
runs the fine-tuned model at the base model's speed (no adapter matmuls), computing what PEFT's
`merge_and_unload()` gives.

An adapter is the directory PEFT's `save_pretrained` writes: `adapter_config.json` and
`adapter_model.safetensors`. Per adapted module, `W += scale * B @ A` (an embedding adds
`(B @ A).T`; `lora_bias` adds `scale * B.bias` to the bias), with `scale = alpha / r` (rsLoRA:
`alpha / sqrt(r)`), `alpha` from `alpha_pattern` where a pattern names the module; the rank is
read from the tensors, so `rank_pattern` needs no parsing. Whole tensors the adapter saved
(`modules_to_save`, an adapted embedding's `base_layer`) replace the checkpoint's first. A head
tied to the embeddings is untied when the adapter changes either one, as PEFT leaves the other
as it was. Variants that are not a weight delta (DoRA, activated LoRA, trainable tokens, layer
replication, ...) are refused by name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from aotgen.checkpoint.hf import CheckpointError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PEFT's wrapper around the model's own names
# adapter_config keys whose non-default value means the adapter is not a plain weight delta.
NOT_A_DELTA = (
    "use_dora",
    "alora_invocation_tokens",
    "trainable_token_indices",
    "layer_replication",
    "target_parameters",
    "use_qalora",
    "use_bdlora",
    "arrow_config",
)
# Per-module tensor names in the saved state dict -> the part of the update each one is.
PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "bias"}
EMBEDDING_PARTS = {".lora_embedding_A": "A", ".lora_embedding_B": "B"}


@dataclass(frozen=True)
class LoraAdapter:
    path: Path
    config: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        return [self.path / CONFIG_FILE, self.path / WEIGHTS_FILE]

    def scale(self, module: str, rank: int) -> float:
        """PEFT's `scaling` of one module: alpha (its alpha_pattern's, if one matches) over
        the rank, or over its square root with rsLoRA."""
        alpha = self.config.get("lora_alpha", 8)
        for pattern, value in (self.config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                alpha = value
                break
        return alpha / (math.sqrt(rank) if self.config.get("use_rslora") else rank)


def open_adapter(path: str | Path) -> LoraAdapter:
    """Find and check a PEFT LoRA adapter directory without loading its tensors."""
    path = Path(path)
    fix = "point `lora:` at the directory PEFT's save_pretrained wrote"
    if not path.is_dir():
        raise CheckpointError(f"LoRA adapter {path} is not a directory: {fix}")
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"LoRA adapter {path} has no {CONFIG_FILE}: {fix}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise CheckpointError(
            f"{path} is a {kind or 'non-PEFT'} adapter: aotgen merges LoRA adapters only"
        )
    for key in NOT_A_DELTA:
        if config.get(key):
            raise CheckpointError(
                f"LoRA adapter {path} sets {key}: that variant is not a weight update aotgen can "
                "merge; merge it with PEFT (`merge_and_unload()`, then `save_pretrained`) and "
                "build the merged checkpoint"
            )
    alphas = [config.get("lora_alpha", 8), *(config.get("alpha_pattern") or {}).values()]
    if not all(isinstance(a, int | float) and not isinstance(a, bool) and a > 0 for a in alphas):
        raise CheckpointError(
            f"LoRA adapter {path}: lora_alpha and alpha_pattern values must be positive "
            f"numbers, got {alphas}"
        )
    for pattern in config.get("alpha_pattern") or {}:
        try:
            re.compile(pattern)
        except re.error as e:
            raise CheckpointError(f"LoRA adapter {path}: alpha_pattern {pattern!r}: {e}") from None
    if not (path / WEIGHTS_FILE).is_file():
        pickled = (path / "adapter_model.bin").is_file()
        why = "holds adapter_model.bin, a pickle aotgen never loads" if pickled else "has none"
        raise CheckpointError(
            f"LoRA adapter {path} {why}: it needs {WEIGHTS_FILE} (PEFT's save_pretrained "
            "writes it with safe_serialization=True, the default)"
        )
    return LoraAdapter(path, config)


def _read_tensors(adapter: LoraAdapter) -> dict[str, Tensor]:
    try:
        with safe_open(str(adapter.path / WEIGHTS_FILE), framework="pt") as sf:
            return {name: sf.get_tensor(name).float() for name in sf.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"cannot read {adapter.path / WEIGHTS_FILE}: {e}; the file is truncated or corrupt"
        ) from None


@dataclass
class _Parts:
    """An adapter's tensors: whole replacements (checkpoint name -> tensor), and updates
    (module -> {"A", "B", "bias"}), some of them of embeddings."""

    whole: dict[str, Tensor]
    updates: dict[str, dict[str, Tensor]]
    embeddings: set[str]


def _split(adapter: LoraAdapter) -> _Parts:
    whole: dict[str, Tensor] = {}
    updates: dict[str, dict[str, Tensor]] = {}
    embeddings: set[str] = set()
    for name, tensor in _read_tensors(adapter).items():
        if not name.startswith(PREFIX):
            raise CheckpointError(
                f"LoRA adapter {adapter.path}: tensor {name} is not named as PEFT saves a "
                f"model's adapter ({PREFIX}...)"
            )
        name = name.removeprefix(PREFIX)
        suffix = next((s for s in (*PARTS, *EMBEDDING_PARTS) if name.endswith(s)), None)
        if suffix is not None:
            module = name.removesuffix(suffix)
            updates.setdefault(module, {})[{**PARTS, **EMBEDDING_PARTS}[suffix]] = tensor
            if suffix in EMBEDDING_PARTS:
                embeddings.add(module)
        elif ".lora_" in name:
            raise CheckpointError(
                f"LoRA adapter {adapter.path}: tensor {name} is not part of a plain LoRA "
                "update; merge the adapter with PEFT and build the merged checkpoint"
            )
        else:
            whole[name.replace(".base_layer.", ".")] = tensor
    return _Parts(whole, updates, embeddings)


def merge_adapter(
    weights: dict[str, Tensor], adapter: LoraAdapter, embed: str, head: str, tied: bool
) -> bool:
    """Merge `adapter` into `weights` (the checkpoint's float tensors, in place). `embed` and
    `head` name the embedding and head weights, `tied` whether the head is the embedding
    table. Returns whether the head is untied now (it is in `weights` as a tensor of its own)."""
    parts_of = _split(adapter)
    touched = set(parts_of.whole) | {f"{m}.weight" for m in parts_of.updates}
    untie = tied and bool(touched & {embed, head})
    if untie:
        weights[head] = weights[embed].clone()
    for name, tensor in parts_of.whole.items():
        _check_target(weights, name, tensor.shape, adapter)
        weights[name] = tensor.clone()
    for module, parts in sorted(parts_of.updates.items()):
        if "A" not in parts or "B" not in parts:
            raise CheckpointError(
                f"LoRA adapter {adapter.path}: module {module} lacks its lora_A or lora_B tensor"
            )
        a, b = parts["A"], parts["B"]
        scale = adapter.scale(module, a.shape[0])
        delta = b @ a
        name = f"{module}.weight"
        if module in parts_of.embeddings or adapter.config.get("fan_in_fan_out"):
            delta = delta.T  # embeddings store [vocab, dim]; fan_in_fan_out layers [in, out]
        _check_target(weights, name, delta.shape, adapter)
        weights[name] = weights[name] + scale * delta
        if "bias" in parts:
            bias = f"{module}.bias"
            _check_target(weights, bias, parts["bias"].shape, adapter)
            weights[bias] = weights[bias] + scale * parts["bias"]
    return untie


def _check_target(
    weights: dict[str, Tensor], name: str, shape: torch.Size, adapter: LoraAdapter
) -> None:
    base = adapter.config.get("base_model_name_or_path") or "its base model"
    if name not in weights:
        raise CheckpointError(
            f"LoRA adapter {adapter.path} changes {name}, which the checkpoint does not have: "
            f"the adapter was trained on {base}, a different model"
        )
    if weights[name].shape != shape:
        raise CheckpointError(
            f"LoRA adapter {adapter.path} changes {name} with shape {tuple(shape)}, but the "
            f"checkpoint's is {tuple(weights[name].shape)}: the adapter was trained on {base}, "
            "a different model"
        )
