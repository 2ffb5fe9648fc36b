"""GGUF metadata as the config readers use it: values by key, float32 as GGUF stores them,
and the shared readings of RoPE scaling and sliding-window patterns."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.hf import CheckpointError


def meta_value(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def f32(value: Any) -> float:
    """GGUF stores float32; keep its shortest repr (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def require_meta(reader: gguf.GGUFReader, key: str) -> Any:
    value = meta_value(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing required key {key!r}")
    return value


def require_whole_heads(reader: gguf.GGUFReader, arch: str, head_dim: int, who: str) -> None:
    """Refuse a rotated share of each head (`rope.dimension_count`) where `who` rotates whole
    heads."""
    rot = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    if rot != head_dim:
        raise CheckpointError(
            f"GGUF {arch}.rope.dimension_count is {rot}: {who} rotates whole heads ({head_dim})"
        )


def has_tensor(reader: gguf.GGUFReader, suffix: str) -> bool:
    return any(t.name.endswith(f".{suffix}") for t in reader.tensors)


def read_layer_types(reader: gguf.GGUFReader, arch: str, pattern: Any, n_layer: int) -> list[str]:
    """Sliding or full attention per layer from a sliding-window pattern: one flag per layer
    (true where sliding), or a period (every period-th layer full; 0: every layer sliding, as
    llama.cpp's set_swa_pattern reads it)."""
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise CheckpointError(
                f"GGUF {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                f"{n_layer} blocks"
            )
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern)
        sliding = [period == 0 or (i + 1) % period != 0 for i in range(n_layer)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def swa_period(reader: gguf.GGUFReader, arch: str) -> int:
    """llama.cpp's window period for Cohere2 and EXAONE 4: the pattern key read as a number
    only (a per-layer list, which its converter writes for EXAONE 4, leaves the default 4)."""
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern")
    return int(pattern) if isinstance(pattern, int) and pattern > 0 else 4


def read_rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    scaling_type = meta_value(reader, f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    rope_scaling = {
        "rope_type": scaling_type,
        "factor": f32(require_meta(reader, f"{arch}.rope.scaling.factor")),
    }
    orig_ctx = meta_value(reader, f"{arch}.rope.scaling.original_context_length")
    if orig_ctx is not None:
        rope_scaling["original_max_position_embeddings"] = int(orig_ctx)
    return rope_scaling
