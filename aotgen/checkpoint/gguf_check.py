"""A GGUF checked against its own metadata before anything is written: every tensor shaped as
the config read from it implies, every block complete."""

from __future__ import annotations

from typing import Any

import gguf

from aotgen.checkpoint.gguf_arch import arch_spec, hf_name, model_tensors
from aotgen.checkpoint.gguf_arch_deepseek2 import LATENT_ARCHS, deepseek2_shape
from aotgen.checkpoint.gguf_arch_gpt_oss import check_gpt_oss_tensors
from aotgen.checkpoint.hf import CheckpointError

# The expert count's config key, per family.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_SHARED_COUNTS = (
    "n_shared_experts",
    "num_shared_experts",
    "moe_num_shared_experts",
    "num_shared_expert",
)
_DENSE_COUNTS = ("num_dense_layers", "first_k_dense_replace", "moe_layer_start_index")


def _expected_shape(hf: str, c: dict[str, Any]) -> tuple[int, ...] | None:
    """The PyTorch shape the model expects for an HF tensor name; None if not checked."""
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = c.get("head_dim") or d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c.get("num_key_value_heads", 0) * hd
    name, kind = hf.rsplit(".", 1)
    leaf = name.rsplit(".", 1)[-1]
    if c["architectures"][0] in LATENT_ARCHS and name.startswith("model.layers."):
        return deepseek2_shape(name, kind, c)
    across_heads = c["architectures"][0].startswith("Olmo")  # OLMo's q/k norms: whole rows
    experts = next((c[k] for k in _EXPERT_COUNTS if c.get(k)), None)
    dense = name.endswith(("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))  # GLM-4.5's first
    routed = (".mlp." in name and not dense) or ".feed_forward.experts." in name  # LFM2-MoE's
    routed = routed or kind == "e_score_correction_bias"  # K-EXAONE's: mlp.e_score_...
    if experts and (routed or name.endswith(("feed_forward.gate", "expert_bias"))):
        return _moe_shape(name, kind, c, experts)
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens": (v, d),
        "embed_in": (v, d),
        "lm_head": (v, d),
        "embed_out": (v, d),
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (f, d),
        "up_proj": (f, d),
        "down_proj": (d, f),
        "query_key_value": (3 * d, d),
        "qkv_proj": (q + 2 * kv, d),
        "gate_up_proj": (2 * f, d),
        "dense": (d, d),
        "dense_h_to_4h": (f, d),
        "dense_4h_to_h": (d, f),
        "fc1": (f, d),
        "fc2": (d, f),
        "c_fc": (f, d),
        "c_proj": (d, f),
        "q_norm": (q,) if across_heads else (hd,),
        "k_norm": (kv,) if across_heads else (hd,),
        "query_layernorm": (hd,),  # Hunyuan's q/k norms
        "key_layernorm": (hd,),
        "sinks": (c["num_attention_heads"],),  # gpt-oss: a logit per head
    }
    if c["architectures"][0].startswith("Lfm2"):
        out_proj = (d, q) if ".self_attn." in name else (d, d)
        lfm2 = {"in_proj": (3 * d, d), "out_proj": out_proj, "conv": (d, c["conv_L_cache"])}
        lfm2 |= {"w1": (f, d), "w3": (f, d), "w2": (d, f), "q_layernorm": (hd,)}
        shapes |= {**lfm2, "k_layernorm": (hd,)}  # conv as llama.cpp stores it: [d, kernel]
    if c["architectures"][0] in (
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3NextForCausalLM",
    ):
        shapes |= _qwen3_5_shapes(c, d, q)
        if name.endswith("linear_attn.norm"):  # each value head's output
            return (c["linear_value_head_dim"],)
    if c["architectures"][0] == "StableLmForCausalLM":  # a norm per head, stacked
        shapes |= {"q_layernorm": (c["num_attention_heads"], hd)}
        shapes |= {"k_layernorm": (c["num_key_value_heads"], hd)}
    if c["architectures"][0] == "CohereForCausalLM":  # a LayerNorm weight per head
        shapes |= {"q_norm": (c["num_attention_heads"], hd)}
        shapes |= {"k_norm": (c["num_key_value_heads"], hd)}
    shape = shapes.get(leaf, (d,) if "norm" in leaf else None)
    if shape is None or v is None and leaf in ("embed_tokens", "embed_in", "lm_head", "embed_out"):
        return None
    return shape[:1] if kind == "bias" else shape


def _qwen3_5_shapes(c: dict[str, Any], d: int, q: int) -> dict[str, tuple[int, ...]]:
    """Qwen3.5's: q_proj holds each head's gate too; the linear attention's projections and
    its convolution as llama.cpp stores it ([channels, kernel])."""
    keys = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    values = c["linear_num_value_heads"] * c["linear_value_head_dim"]
    heads, conv = c["linear_num_value_heads"], 2 * keys + values
    return {
        "q_proj": (2 * q, d),
        "in_proj_qkv": (conv, d),
        "in_proj_z": (values, d),
        "in_proj_b": (heads, d),
        "in_proj_a": (heads, d),
        "conv1d": (conv, c["linear_conv_kernel_dim"]),
        "out_proj": (d, values),
        "in_proj_qkvz": (2 * keys + 2 * values, d),  # Qwen3-Next's
        "in_proj_ba": (2 * heads, d),
    }


def _moe_shape(name: str, kind: str, c: dict[str, Any], experts: int) -> tuple[int, ...] | None:
    d = c["hidden_size"]
    f = c.get("moe_intermediate_size") or c["intermediate_size"]
    # one shared MLP of its own width, or so many experts' (DeepSeek, ERNIE, Hunyuan)
    count = next((c[k] for k in _SHARED_COUNTS if c.get(k)), 0)
    shared = c.get("shared_expert_intermediate_size") or f * count
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "expert_bias" or kind == "e_score_correction_bias":
        return (1, experts) if leaf == "moe_statics" else (experts,)  # ERNIE's: [1, E]
    if kind == "bias" and name.endswith("mlp.router"):  # gpt-oss's router and experts
        return (experts,)
    if kind == "bias" and ".experts." in name:
        return (experts, d) if leaf == "down_proj" else (experts, f)
    if kind != "weight" or leaf == "shared_expert_gate":  # stored as [d] or [1, d]
        return None
    if name.endswith(("mlp.gate", "feed_forward.gate", "mlp.router", "mlp.gate.wg")):
        return (experts, d)
    if ".shared_" in name:  # Qwen2-MoE's shared_expert, DeepSeek's shared_experts, shared_mlp
        return (d, shared) if leaf == "down_proj" else (shared, d)
    return (experts, d, f) if leaf == "down_proj" else (experts, f, d)


def check_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> None:
    """Every tensor named and shaped as the metadata says, every layer complete."""
    _, spec = arch_spec(reader)
    names: set[str] = set()
    for t in model_tensors(reader):
        hf = hf_name(spec, t.name)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        want = _expected_shape(hf, config)
        if want is not None and shape != want:
            raise CheckpointError(
                f"GGUF tensor {t.name!r} has shape {list(shape)} but the metadata implies "
                f"{list(want)}"
            )
        names.add(hf)
    n_layer = config["num_hidden_layers"]
    if spec.hf_arch == "GptOssForCausalLM":
        check_gpt_oss_tensors({t.name for t in reader.tensors}, n_layer)
    # Blocks of one kind (dense or with experts; LFM2's and Qwen3.5's attention or not) have
    # the same tensors.
    dense = next((config[k] for k in _DENSE_COUNTS if k in config), n_layer)
    by_type = spec.hf_arch.startswith(("Lfm2", "Qwen3_5", "Qwen3Next"))
    types = config.get("layer_types") if by_type else None
    kinds = [f"{t}-{i < dense}" for i, t in enumerate(types or ["block"] * n_layer)]
    per_kind: dict[str, set[str]] = {}
    for n in names:
        if n.startswith(spec.layer_prefix + "."):
            layer, rest = n.removeprefix(spec.layer_prefix + ".").split(".", 1)
            per_kind.setdefault(kinds[int(layer)], set()).add(rest)
    for i in range(n_layer):
        for rest in sorted(per_kind.get(kinds[i], ())):
            if f"{spec.layer_prefix}.{i}.{rest}" not in names:
                raise CheckpointError(
                    f"GGUF has {n_layer} blocks but block {i} lacks {rest} (other blocks of its "
                    "kind have it)"
                )
    embed = f"{spec.globals['token_embd']}.weight"
    if embed not in names:
        raise CheckpointError("GGUF has no token_embd.weight tensor")
