"""Qwen3.5 GGUFs (`qwen35`, llama.cpp's src/models/qwen35.cpp) as the HF checkpoint of the same
model, undoing what llama.cpp's converter (conversion/qwen.py: Qwen3_5TextModel) changed:

- its (1 + w) RMSNorms are stored as 1 + w (all but the delta rule's output norm);
- A_log is stored as A = -exp(A_log) (`ssm_a`), dt_bias as `ssm_dt.bias`, the convolution's
  weight squeezed to [channels, kernel];
- where there are fewer key heads than value heads, the value heads are reordered from
  grouped by key head to tiled (its `_LinearAttentionVReorderBase`): every tensor indexed by
  value head (v's rows of in_proj_qkv and of the convolution, in_proj_z, in_proj_b/a, A_log,
  dt_bias, out_proj's columns) is put back. out_proj's kept blocks hold its inputs in the
  file's order: `qwen35_block_orders` names the input behind each, and a `gguf: keep` package
  gathers the activations in that order (as for act-order GPTQ);
- the multi-token-prediction block, if converted, is the last `nextn_predict_layers` blocks:
  left out, as transformers leaves out `mtp.*`.

Text positions are equal on every axis of its multimodal RoPE (`rope.dimension_sections`), so
the rotation is plain RoPE on `rope.dimension_count` dims of each head.

Qwen3-Next (`qwen3next`, src/models/qwen3next.cpp; conversion/qwen.py Qwen3NextModel) is
stored the same way but for its value heads, which stay grouped by key head, and its fused
projections: transformers' `in_proj_qkvz` (each key head's q, k, then its value heads' v and
z rows) as `attn_qkv` (all q, all k, all v) and `attn_gate` (z), or whole as `ssm_in` in
files from before that split; `in_proj_ba` as `ssm_ba`. Experts on every block, chosen by
softmax and renormalised (llama.cpp's fixed choice), a gated shared expert.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import gguf
import numpy as np

from aotgen.checkpoint.gguf_meta import f32, meta_value, require_meta
from aotgen.checkpoint.hf import CheckpointError

QWEN35_LAYER = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # each head's query, then its gate
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
QWEN3NEXT_LAYER = {
    **QWEN35_LAYER,
    "ssm_in": "linear_attn.in_proj_qkvz",  # files from before attn_qkv / attn_gate
    "ssm_ba": "linear_attn.in_proj_ba",
}
# Parameters stored without a `.weight` suffix, or under another module: GGUF → HF leaf.
QWEN35_PARAMS = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias"}


def qwen35_config(reader: gguf.GGUFReader, arch: str, config: dict[str, Any]) -> dict[str, Any]:
    """The linear-attention sizes (`ssm.*`: the converter's names), which blocks recur, the
    partial RoPE."""
    n_layer = config["num_hidden_layers"]
    recurrent = meta_value(reader, f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(meta_value(reader, f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]
    if not isinstance(recurrent, list) or len(recurrent) < n_layer:
        raise CheckpointError(
            f"GGUF {arch}.attention.recurrent_layers must list each of the {n_layer} blocks"
        )
    value_heads = int(require_meta(reader, f"{arch}.ssm.time_step_rank"))
    inner = int(require_meta(reader, f"{arch}.ssm.inner_size"))
    if inner % value_heads:
        raise CheckpointError(
            f"GGUF {arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
            f"{value_heads}"
        )
    head_dim = config["head_dim"]
    rotary = int(meta_value(reader, f"{arch}.rope.dimension_count", head_dim // 4))
    return config | {
        "num_hidden_layers": n_layer,
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n_layer]],
        "linear_conv_kernel_dim": int(require_meta(reader, f"{arch}.ssm.conv_kernel")),
        "linear_key_head_dim": int(require_meta(reader, f"{arch}.ssm.state_size")),
        "linear_num_key_heads": int(require_meta(reader, f"{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "rms_norm_eps": f32(require_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": f32(meta_value(reader, f"{arch}.rope.freq_base", 10000.0)),
            "partial_rotary_factor": rotary / head_dim,
        },
    }


def qwen35_tensor(
    name: str, w: np.ndarray, config: dict[str, Any], tiled: bool = True
) -> np.ndarray:
    """One tensor (HF `name`) as the HF checkpoint holds it; value heads regrouped where the
    file holds them `tiled` (Qwen3.5's, not Qwen3-Next's)."""
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        w = w - np.float32(1.0)
    elif name.endswith("linear_attn.A_log"):
        w = np.log(-w)
    elif name.endswith("linear_attn.conv1d.weight"):
        w = w[:, None]  # HF's depthwise Conv1d weight [channels, 1, kernel]
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if tiled and key_heads != value_heads and ".linear_attn." in name:
        w = _grouped_value_heads(name, w, config)
    return np.ascontiguousarray(w, np.float32)


def _value_head_order(c: dict[str, Any], width: int) -> np.ndarray:
    """For each index of value heads grouped by key head ([key head][r], `width` entries a
    head), the index llama.cpp's tiled order ([r][key head]) holds it at."""
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    return np.arange(hv * width).reshape(hv // hk, hk, width).swapaxes(0, 1).reshape(-1)


def _grouped_value_heads(name: str, w: np.ndarray, c: dict[str, Any]) -> np.ndarray:
    """Value heads back from llama.cpp's tiled order to grouped by key head, on the axis (and
    part of it) each tensor indexes them by."""
    dv = c["linear_value_head_dim"]
    keys = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"]
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # only the v rows
        return np.concatenate([w[:keys], w[keys:][_value_head_order(c, dv)]])
    if name.endswith("in_proj_z.weight"):
        return w[_value_head_order(c, dv)]
    if name.endswith("out_proj.weight"):
        return w[:, _value_head_order(c, dv)]
    if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        return w[_value_head_order(c, 1)]
    return w


def qwen35_block_orders(names: Iterable[str], config: dict[str, Any]) -> dict[str, np.ndarray]:
    """For each kept out_proj among `names` whose inputs the import moved: the imported
    weight's input behind each of its blocks' inputs."""
    if config["linear_num_key_heads"] == config["linear_num_value_heads"]:
        return {}
    order = np.argsort(_value_head_order(config, config["linear_value_head_dim"]))
    return {name: order for name in names if name.endswith("linear_attn.out_proj.weight")}


def qwen3next_tensors(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> dict[str, Any]:
    """transformers' `in_proj_qkvz` from `attn_qkv` and `attn_gate`: for each key head its q
    and k rows, then the v and z rows of its value heads."""
    dk, hk = config["linear_key_head_dim"], config["linear_num_key_heads"]
    out: dict[str, np.ndarray] = {}
    for name, w in tensors.items():
        if name.endswith(".linear_attn.in_proj_qkv.weight"):
            stem = name.removesuffix(".in_proj_qkv.weight")
            z = tensors.get(f"{stem}.in_proj_z.weight")
            if z is None:
                raise CheckpointError(
                    f"GGUF block {stem.split('.')[2]} has attn_qkv without attn_gate"
                )
            q, k, v = np.split(w, [hk * dk, 2 * hk * dk])
            parts = [x.reshape(hk, -1, w.shape[1]) for x in (q, k, v, z)]
            out[f"{stem}.in_proj_qkvz.weight"] = np.concatenate(parts, axis=1).reshape(
                -1, w.shape[1]
            )
        elif not name.endswith(".linear_attn.in_proj_z.weight"):
            out[name] = w
    return out
