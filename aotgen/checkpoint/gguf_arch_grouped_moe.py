"""DeepSeek-V3's grouped sigmoid routing behind ordinary attention, as llama.cpp runs it:
`glm4moe` (GLM-4.5 / 4.6 / 4.7, Air; Solar Open, which llama.cpp's converter writes as
glm4moe too), `dots1` (dots.llm1) and `exaone-moe` (K-EXAONE).

llama.cpp's GLM-4.5 graph (src/models/glm4-moe.cpp): q/k/v biased where the file has the
biases, q/k norms per head where it has them, RoPE on `rope.dimension_count` of each head in
halves (NEOX: q/k as HF has them, no permutation), the norm before the MLP stored as
`post_attention_norm`; the first `leading_dense_block_count` blocks dense (none stored: none,
as Solar Open's files have it), the others sigmoid-routed with `exp_probs_b`. A multi-token-
prediction block (`nextn_predict_layers`) follows the others and is left out.

dots.llm1's (src/models/dots1.cpp): Qwen3's attention (q/k norms before RoPE on whole heads),
the norm before the MLP stored as `ffn_norm`, the routing as GLM-4.5's but the gating as
stored (none stored: llama.cpp cannot run the file), no sliding window whatever the original
config said.

K-EXAONE's (src/models/exaone-moe.cpp): dots.llm1's blocks with EXAONE 4's windows (the
window required, the pattern a flag per block or a period, 4 where none is stored), RoPE on
the windowed blocks only, at `rope.freq_base` (a stored `freq_base_swa` is not used); its
shared MLP `expert_shared_feed_forward_length` wide (an expert's where none is stored); the
multi-token-prediction block left out as GLM-4.5's. The expert bias is optional in dots.llm1's
and K-EXAONE's graphs: zeros where the file has none.
"""

from __future__ import annotations

from typing import Any

import gguf

from aotgen.checkpoint.gguf_arch_deepseek2 import DEEPSEEK_MLP, routing_keys
from aotgen.checkpoint.gguf_meta import has_tensor, meta_value, read_layer_types, require_meta
from aotgen.checkpoint.hf import CheckpointError

GROUPED_MOE_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    **DEEPSEEK_MLP,
}
GROUPED_MOE_PARAMS = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias"}
DOTS1_LAYER = {
    **{k: v for k, v in GROUPED_MOE_LAYER.items() if k != "post_attention_norm"},
    "ffn_norm": "post_attention_layernorm",
}
EXAONE_MOE_PARAMS = {"exp_probs_b.bias": "mlp.e_score_correction_bias"}
_SIGMOID = gguf.ExpertGatingFuncType.SIGMOID


def glm4moe_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' GLM-4.5 config of what llama.cpp runs (the common keys, RoPE's base and
    scaling already in `config`)."""
    _require_sigmoid(reader, arch, default=_SIGMOID)
    head_dim = config["head_dim"]
    rotated = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim))
    return _routing(reader, arch) | {
        "partial_rotary_factor": rotated / head_dim,
        "attention_bias": has_tensor(reader, "attn_q.bias"),
        "use_qk_norm": has_tensor(reader, "attn_q_norm.weight"),
    }


def dots1_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' dots.llm1 config of what llama.cpp runs: q/k norms, no window."""
    _require_sigmoid(reader, arch, default=None)
    return _routing(reader, arch) | {"sliding_window": None}


def exaone_moe_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """transformers' K-EXAONE config of what llama.cpp runs."""
    _require_sigmoid(reader, arch, default=None)
    keys = _routing(reader, arch)
    width = keys["moe_intermediate_size"]
    shared = int(meta_value(reader, f"{arch}.expert_shared_feed_forward_length", 0) or width)
    if shared % width:
        raise CheckpointError(
            f"GGUF {arch}.expert_shared_feed_forward_length {shared} is not a whole number of "
            f"experts {width} wide"
        )
    experts = keys.pop("n_routed_experts")
    del keys["n_shared_experts"]  # the shared MLP's width decides, as in llama.cpp
    pattern = meta_value(reader, f"{arch}.attention.sliding_window_pattern", 4)
    return keys | {
        "num_experts": experts,
        "num_shared_experts": shared // width,
        "sliding_window": int(require_meta(reader, f"{arch}.attention.sliding_window")),
        "layer_types": read_layer_types(reader, arch, pattern, config["num_hidden_layers"]),
    }


def _routing(reader: gguf.GGUFReader, arch: str) -> dict[str, Any]:
    """DeepSeek-V3's routing keys after the `leading_dense_block_count` dense blocks (none
    stored: none)."""
    experts = int(require_meta(reader, f"{arch}.expert_count"))
    dense = int(meta_value(reader, f"{arch}.leading_dense_block_count", 0))
    return routing_keys(reader, arch, experts, dense)


def _require_sigmoid(reader: gguf.GGUFReader, arch: str, default: int | None) -> None:
    """Sigmoid gating stored, or `default` where none is (None: llama.cpp cannot run it)."""
    gating = meta_value(reader, f"{arch}.expert_gating_func") or default
    if gating is None:
        raise CheckpointError(
            f"GGUF {arch} stores no expert_gating_func, which llama.cpp needs to run it; "
            "convert the checkpoint again with its scoring_func in config.json"
        )
    if gating != _SIGMOID:
        raise CheckpointError(
            f"GGUF {arch}.expert_gating_func {gating}: only sigmoid routing (2) is supported "
            f"on {arch}"
        )
