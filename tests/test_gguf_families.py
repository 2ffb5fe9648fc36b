"""GGUF import of the non-Llama families: a tiny `transformers` checkpoint is written as a GGUF
the way llama.cpp's converter writes it (its tensor names, Gemma's norms stored as 1 + w,
Nemotron's LayerNorm1P weights as w + 1, GPT-NeoX's fused qkv regrouped as [q; k; v],
Granite's, SmolLM3's and Arcee's q/k permuted, Phi-3's LongRoPE factors and Llama 3.1's
divisors as tensors, GLM-4's and ERNIE 4.5's q/k as they are, OLMo 3 as olmo2 with a
sliding-window pattern, a mixture of experts' experts stacked per block (Mixtral as llama),
StableLM's per-head q/k norms stacked, Phi-2's q/k/v apart or fused, Command R, Cohere2,
EXAONE 4, Nemotron and Seed-OSS with their q/k rows as HF has them, Ministral 3's permuted
with its YaRN and attention temperature, Hunyuan's q/k norms and stretched base, Apertus's
xIELU parameters as metadata, gpt-oss's interleaved gate/up experts split and their biases
apart, float or MXFP4, some weights quantized, DeepSeek's kv_b_proj split into attn_k_b /
attn_v_b or whole in older files, GLM-4.5's, Solar Open's, dots.llm1's and K-EXAONE's
expert bias as exp_probs_b, ERNIE 4.5 MoE's shared width as its converter computes it,
Qwen3-Next's in_proj_qkvz split into attn_qkv / attn_gate or whole), imported back, and the
imported checkpoint must compute what the original computes in `transformers`, in
`transformers` and in aotgen's model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from families import FAMILIES, load_reference, randomize, reference_logits
from gguf_latent import LATENT_NAMES, latent_meta, latent_tensors, minicpm3_meta
from reference import EagerModel
from safetensors import safe_open
from tiny import CHATML, CORPUS, make_tokenizer
from tokenizers import Regex, decoders, models, pre_tokenizers, processors, trainers

from aotgen.checkpoint.gguf import import_gguf, open_gguf, permute_qk
from aotgen.checkpoint.gguf_config import read_config
from aotgen.checkpoint.hf import CheckpointError
from aotgen.kernels import gguf_blocks
from aotgen.runtime.tokenizer import Tokenizer

pytest.importorskip("transformers")

BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=256
)
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": True,  # HF's gpt-oss configs say false; llama.cpp truncates
    "original_max_position_embeddings": 4096,
}
GPT_OSS: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=48,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=7.0,
    rope_parameters=GPT_OSS_YARN,
    max_position_embeddings=32 * 4096,  # YaRN's context, as its factor says
)
DEEPSEEK_V3 = {
    **FAMILIES["deepseek-v3"][1],
    "rope_parameters": {**FAMILIES["deepseek-v3"][1]["rope_parameters"], "mscale": 0.8},
    "norm_topk_prob": True,
}
# llama.cpp's MiniCPM3 reads no value width: a head's is hidden / heads, as MiniCPM3-4B's.
MINICPM3 = {
    **FAMILIES["minicpm3"][1],
    "scale_emb": 12.0,
    "dim_model_base": 256,
    "v_head_dim": BASE["hidden_size"] // BASE["num_attention_heads"],
    "tie_word_embeddings": False,  # a head of its own: a tied one repeats the last token here
}
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", dict(num_hidden_layers=2, num_key_value_heads=2)),
    "qwen3": (
        "Qwen3Config",
        dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    # llama.cpp's Gemma 3: every 6th layer global, local RoPE base 10000, scale head_dim ** -0.5.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
        ),
    ),
    "gptneox": (
        "GPTNeoXConfig",
        dict(num_hidden_layers=2, rotary_pct=0.5, use_parallel_residual=True),
    ),
    # Gemma 2: sliding and global layers in turn, softcapped attention scores and logits.
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=1,
            head_dim=32,
            sliding_window=4,
            query_pre_attn_scalar=32,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
        ),
    ),
    # Phi-3.5-mini's kind: fused qkv and gate-up, RoPE on half of each head, LongRoPE (its
    # factors stored as tensors), a sliding window.
    "phi3": (
        "Phi3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=8,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.0, 3.5],
                "long_factor": [1.5, 4.0, 9.0, 20.0],
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "olmo2": FAMILIES["olmo2"],
    # q/k stored as HF has them: llama.cpp rotates adjacent pairs for both
    "ernie4_5": FAMILIES["ernie4_5"],
    "glm4": FAMILIES["glm4"],
    # Written by llama.cpp as olmo2 with a window and one sliding flag per layer.
    "olmo3": ("Olmo3Config", dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=4)),
    # llama.cpp's SmolLM3: NoPE on every fourth layer.
    "smollm3": ("SmolLM3Config", dict(num_hidden_layers=4, num_key_value_heads=2)),
    "granite": FAMILIES["granite"],
    # Mixtures of experts as llama.cpp runs them: every block MoE, the chosen experts'
    # weights renormalised for Qwen3-MoE and Mixtral (a `llama` GGUF with experts) only.
    "qwen3moe": ("Qwen3MoeConfig", {**FAMILIES["qwen3-moe"][1], "mlp_only_layers": []}),
    "qwen2moe": ("Qwen2MoeConfig", {**FAMILIES["qwen2-moe"][1], "decoder_sparse_step": 1}),
    "olmoe": FAMILIES["olmoe"],
    "mixtral": FAMILIES["mixtral"],
    "granitemoe": FAMILIES["granite-moe"],
    "lfm2": FAMILIES["lfm2"],
    # llama.cpp's converter does not store routed_scaling_factor: 1 here.
    "lfm2moe": ("Lfm2MoeConfig", {**FAMILIES["lfm2-moe"][1], "routed_scaling_factor": 1.0}),
    # Gemma (1): no RoPE base stored (llama.cpp's 10000), no output tensor (a tied head).
    "gemma": FAMILIES["gemma"],
    # llama.cpp's converter writes Phi's MLP as 4 x hidden wide (Phi-1/1.5/2's own), KV heads
    # as heads, no RoPE base; its phi2 has no q/k norms, so FAMILIES["phi-qk"] does not convert.
    "phi2": ("PhiConfig", {**FAMILIES["phi"][1], "intermediate_size": 256}),
    "phi2-qkv": ("PhiConfig", {**FAMILIES["phi"][1], "intermediate_size": 256}),  # fused qkv
    "stablelm": FAMILIES["stablelm"],  # parallel residual: no ffn_norm
    "stablelm-sequential": ("StableLmConfig", dict(num_hidden_layers=2, num_key_value_heads=2)),
    # llama.cpp neither stores nor applies StarCoder2's sliding window.
    "starcoder2": (
        "Starcoder2Config",
        {
            **FAMILIES["starcoder2"][1],
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e5},
        },
    ),
    # Command R: q/k norms [heads, head_dim] (llama.cpp loads them at 64 layers or more only),
    # q/k/v/o biases, logits x 0.25, a tied head.
    "command-r": FAMILIES["cohere"],
    # Cohere2: llama.cpp's three sliding-window layers in four, only they rotated.
    "cohere2": FAMILIES["cohere2"],
    # EXAONE 4: llama.cpp windows its 64-layer model only; any other depth attends globally.
    "exaone4": FAMILIES["exaone4-global"],
    "exaone4-swa": ("Exaone4Config", {**FAMILIES["exaone4"][1], "num_hidden_layers": 64}),
    # Llama 3.1's RoPE scaling (its slow dims divided by 8 from an original context of 32):
    # llama.cpp's converter stores each pair's divisor as `rope_freqs`.
    "llama3": (
        "LlamaConfig",
        dict(num_hidden_layers=2, num_key_value_heads=2, rope_parameters=LLAMA3),
    ),
    # Nemotron: LayerNorm1P weights stored plus one, half of each head rotated, an untied head.
    "nemotron": FAMILIES["nemotron"],
    # Arcee: q/k permuted (its converter is LlamaModel's), Llama 3.1's rope_freqs read too.
    "arcee": FAMILIES["arcee"],
    "arcee-llama3": ("ArceeConfig", {**FAMILIES["arcee"][1], "rope_parameters": LLAMA3}),
    # gpt-oss: sinks, biased q/k/v/o, router and experts, its window on layers 0 and 2, YaRN
    # with the ramp's ends floored and ceiled (`truncate`) as ggml does, llama.cpp's fixed
    # clamp of 7 (its experts scaled up in _checkpoint so that the clamp cuts).
    "gpt-oss": ("GptOssConfig", GPT_OSS),
    "gpt-oss-qkv": ("GptOssConfig", GPT_OSS),  # q/k/v fused (the converter's --fuse-qkv)
    # Seed-OSS: q/k/v and o biased, the MLP's norm stored as a norm after attention.
    "seed_oss": FAMILIES["seed-oss"],
    # Ministral 3: q/k permuted (LlamaModel's converter), YaRN with its log multiplier, and
    # q's growth past each original context as the attention temperature.
    "mistral3": FAMILIES["ministral3"],
    # ... without a temperature (0 stored): imported as Mistral with YaRN.
    "mistral3-untempered": (
        "Ministral3Config",
        {
            **FAMILIES["ministral3"][1],
            "rope_parameters": {
                **FAMILIES["ministral3"][1]["rope_parameters"],
                "llama_4_scaling_beta": 0.0,
            },
        },
    ),
    # Hunyuan (dense): its q/k norms (after RoPE) as attn_q_norm / attn_k_norm, the base its
    # alpha stretches stored as the base, no scaling (conversion/hunyuan.py).
    "hunyuan-dense": FAMILIES["hunyuan"],
    # Apertus: its norms' own names, q/k as HF has them, Llama 3.1's rope_freqs, and xIELU's
    # parameters as one metadata array each (conversion/llama.py ApertusModel).
    "apertus": FAMILIES["apertus"],
    # Qwen3.5: linear attention (2 key heads, 4 value heads: reordered by the converter) beside
    # gated attention; (1 + w) norms stored as 1 + w, A_log as -exp, dt_bias as ssm_dt.bias
    # (conversion/qwen.py Qwen3_5TextModel).
    "qwen35": FAMILIES["qwen3_5"],
    # 3 value heads a key head: the reorder is not its own inverse
    "qwen35-r3": (FAMILIES["qwen3_5"][0], {**FAMILIES["qwen3_5"][1], "linear_num_value_heads": 6}),
    # Qwen3.5-MoE: its experts stacked, the shared expert's gate as ffn_gate_inp_shexp.
    "qwen35moe": FAMILIES["qwen3_5-moe"],
    # Qwen3-Next: value heads grouped by key head (not reordered), in_proj_qkvz split into
    # attn_qkv / attn_gate, in_proj_ba whole; experts on every layer (llama.cpp's only layout);
    # "-ssm_in": in_proj_qkvz whole, as files from before that split hold it.
    "qwen3next": ("Qwen3NextConfig", {**FAMILIES["qwen3-next"][1], "mlp_only_layers": []}),
    "qwen3next-ssm_in": ("Qwen3NextConfig", {**FAMILIES["qwen3-next"][1], "mlp_only_layers": []}),
    # DeepSeek-V3 as deepseek2: kv_b_proj split in attn_k_b / attn_v_b, sigmoid routing in 4
    # groups (2 kept) with exp_probs_b, YaRN by its log multiplier alone (llama.cpp's:
    # mscale equal to mscale_all_dim, as DeepSeek's configs have them).
    "deepseek2": ("DeepseekV3Config", DEEPSEEK_V3),
    "deepseek2-kv_b": ("DeepseekV3Config", DEEPSEEK_V3),  # attn_kv_b whole, an older file
    # DeepSeek-V2-Lite: q without a bottleneck, softmax routing, two shared experts.
    "deepseek2-lite": FAMILIES["deepseek-v2-lite"],
    # Youtu-LLM: dense; llama.cpp rotates adjacent pairs (rope_interleave).
    "deepseek2-youtu": (
        "YoutuConfig",
        {**FAMILIES["youtu"][1], "rope_interleave": True, "tie_word_embeddings": False},
    ),
    # MiniCPM3: llama.cpp's fixed scales (MiniCPM3-4B's), RoPE on halves, kv_b_proj whole;
    # with LongRoPE's factors as tensors.
    # GLM-4.5 as glm4moe: q/k/v biased, q/k norms (the 355B's), half of each head rotated,
    # layer 0 dense, 8 experts in 2 groups (1 kept) with exp_probs_b, a shared expert.
    "glm4moe": ("Glm4MoeConfig", {**FAMILIES["glm4-moe"][1], "use_qk_norm": True}),
    # Solar Open, which the converter writes as glm4moe: every block sparse (no dense width or
    # leading dense count stored), unbiased, the whole head rotated, weights not renormalised.
    "glm4moe-solar": (
        "SolarOpenConfig",
        {
            **FAMILIES["solar-open"][1],
            "attention_bias": False,
            "norm_topk_prob": False,
            "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    ),
    # dots.llm1: Qwen3's q/k norms, layer 0 dense, 8 experts in 2 groups (1 kept), two shared;
    # as many KV heads as heads and no window (llama.cpp's dots1 runs no other).
    "dots1": (
        "Dots1Config",
        {
            **FAMILIES["dots1"][1],
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
        },
    ),
    # K-EXAONE: EXAONE 4's windows (three layers in four, only they rotated), layer 0 dense,
    # DeepSeek-V3's routing and a shared expert after it (no other layout in llama.cpp).
    "exaone-moe": (
        "ExaoneMoeConfig",
        {**FAMILIES["exaone-moe"][1], "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
    ),
    # ERNIE 4.5 MoE: layer 0 dense, softmax + bias routing, two shared experts (the converter
    # writes their width as intermediate_size / KV heads: 64 here, as in the released 21B).
    "ernie4_5-moe": FAMILIES["ernie4_5-moe"],
    # Mellum: Qwen3-MoE's blocks, windowed (8) on layers 0 and 2 at the full layers' base (which
    # llama.cpp uses for both), YaRN on the others with llama.cpp's gain; experts everywhere.
    "mellum": (
        "MellumConfig",
        {
            **FAMILIES["mellum"][1],
            "mlp_layer_types": ["sparse"] * 4,
            "rope_parameters": {
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 500000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "attention_factor": 1 + 0.1 * math.log(4.0),
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": True,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            },
        },
    ),
    # Hunyuan-A13B: q/k norms after RoPE, NTK-alpha base, a shared MLP on every layer.
    "hunyuan-moe": FAMILIES["hunyuan-moe"],
    "minicpm3": ("MiniCPM3Config", MINICPM3),
    "minicpm3-longrope": (
        "MiniCPM3Config",
        {
            **MINICPM3,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0, 1.1, 1.3, 1.7, 2.2, 3.0, 4.1, 5.5],
                "long_factor": [1.2, 1.6, 2.3, 3.4, 5.0, 7.2, 10.5, 15.0],
                "original_max_position_embeddings": 256,
            },
        },
    ),
}
LATENT_CASES = ("deepseek2", "deepseek2-kv_b", "deepseek2-lite", "deepseek2-youtu")
MINICPM3_CASES = ("minicpm3", "minicpm3-longrope")
SPLIT_LATENT = ("deepseek2", "deepseek2-lite", "deepseek2-youtu")  # kv_b_proj as k_b / v_b
# The GGUF architecture of the test cases named otherwise.
GGUF_ARCH = {
    **{case: "deepseek2" for case in LATENT_CASES},
    "minicpm3-longrope": "minicpm3",
    "glm4moe-solar": "glm4moe",
    "olmo3": "olmo2",
    "mixtral": "llama",
    "phi2-qkv": "phi2",
    "stablelm-sequential": "stablelm",
    "exaone4-swa": "exaone4",
    "llama3": "llama",
    "arcee-llama3": "arcee",
    "gpt-oss-qkv": "gpt-oss",
    "mistral3-untempered": "mistral3",
    "qwen35-r3": "qwen35",
    "qwen3next-ssm_in": "qwen3next",
}
MOE_NAMES = {
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "block_sparse_moe.router.layer": "ffn_gate_inp",
    "block_sparse_moe.output_linear": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "feed_forward.gate": "ffn_gate_inp",  # LFM2-MoE
    "mlp.router": "ffn_gate_inp",  # gpt-oss
}
# One expert's projection in an HF checkpoint, and the stacked GGUF tensor it goes into.
EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward)\.experts\.(\d+)\.(\w+)\.weight$"
)
STACKED = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down"}
# StableLM's per-head q/k norm (stacked [heads, head_dim] per block) and Phi-2's q/k/v (fused).
HEAD_NORM = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qk])_layernorm\.norms\.(\d+)\.weight$")
QKV = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)$")
# HF module name → llama.cpp's (gguf-py tensor_mapping.py), per architecture.
LAYER_NAMES = {
    "llama": {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    },
    "gptneox": {
        "input_layernorm": "attn_norm",
        "attention.query_key_value": "attn_qkv",
        "attention.dense": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.dense_h_to_4h": "ffn_up",
        "mlp.dense_4h_to_h": "ffn_down",
    },
    "lfm2": {
        "operator_norm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_output",
        "self_attn.q_layernorm": "attn_q_norm",
        "self_attn.k_layernorm": "attn_k_norm",
        "conv.conv": "shortconv.conv",
        "conv.in_proj": "shortconv.in_proj",
        "conv.out_proj": "shortconv.out_proj",
        "ffn_norm": "ffn_norm",
        "feed_forward.w1": "ffn_gate",
        "feed_forward.w3": "ffn_up",
        "feed_forward.w2": "ffn_down",
    },
}
OLMO2_NAMES = {
    **LAYER_NAMES["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
PHI3_NAMES = {
    **LAYER_NAMES["llama"],
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
GLM4_NAMES = {
    **LAYER_NAMES["llama"],
    "post_self_attn_layernorm": "post_attention_norm",
    "post_attention_layernorm": "ffn_norm",
    "post_mlp_layernorm": "post_ffw_norm",
    "mlp.gate_up_proj": "ffn_up",
}
DOTS1_NAMES = {  # conversion/dots1.py (Qwen2MoeModel's names)
    **LAYER_NAMES["llama"],
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
GROUPED_MOE_NAMES = {  # conversion/glm.py Glm4MoeModel (and SolarOpenModel)
    **DOTS1_NAMES,
    "post_attention_layernorm": "post_attention_norm",
}
GEMMA_NAMES = {
    **LAYER_NAMES["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
PHI2_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.dense": "attn_output",
    "mlp.fc1": "ffn_up",
    "mlp.fc2": "ffn_down",
}
GPT_OSS_NAMES = {**LAYER_NAMES["llama"], "post_attention_layernorm": "post_attention_norm"}
APERTUS_NAMES = {
    **LAYER_NAMES["llama"],
    "attention_layernorm": "attn_norm",
    "feedforward_layernorm": "ffn_norm",
}
HUNYUAN_NAMES = {
    **LAYER_NAMES["llama"],
    "self_attn.query_layernorm": "attn_q_norm",
    "self_attn.key_layernorm": "attn_k_norm",
}
HUNYUAN_MOE_NAMES = {
    **HUNYUAN_NAMES,
    "mlp.gate.wg": "ffn_gate_inp",
    "mlp.shared_mlp.gate_proj": "ffn_gate_shexp",
    "mlp.shared_mlp.up_proj": "ffn_up_shexp",
    "mlp.shared_mlp.down_proj": "ffn_down_shexp",
}
STARCODER2_NAMES = {**LAYER_NAMES["llama"], "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
QWEN35_NAMES = {
    **LAYER_NAMES["llama"],
    "post_attention_layernorm": "post_attention_norm",
    "linear_attn.in_proj_qkv": "attn_qkv",
    "linear_attn.in_proj_z": "attn_gate",
    "linear_attn.in_proj_b": "ssm_beta",
    "linear_attn.in_proj_a": "ssm_alpha",
    "linear_attn.conv1d": "ssm_conv1d",
    "linear_attn.norm": "ssm_norm",
    "linear_attn.out_proj": "ssm_out",
}
QWEN3NEXT_NAMES = {
    **QWEN35_NAMES,
    "linear_attn.in_proj_qkvz": "ssm_in",  # whole, as older converters wrote it
    "linear_attn.in_proj_ba": "ssm_ba",
}
GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.final_layernorm": "output_norm",  # Phi's
    "model.norm": "output_norm",
    "lm_head": "output",
    "gpt_neox.embed_in": "token_embd",
    "gpt_neox.final_layer_norm": "output_norm",
    "embed_out": "output",
    "model.embedding_norm": "token_embd_norm",  # LFM2's final norm
}
TEXTS = ["Hello world, the capital of France is Paris.", "  two  spaces\nand 12345 digits ✓"]
# OpenAI's harmony format: gpt-oss's special tokens, its end-of-generation ones <|return|> and
# <|call|> (<|end|> ends a message).
HARMONY = [
    "<|startoftext|>",
    "<|endoftext|>",
    "<|return|>",
    "<|constrain|>",
    "<|channel|>",
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|call|>",
]
# o200k's split as its tokenizer.json holds it (llama.cpp's `gpt-4o` rewrites the case classes).
O200K = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Contractions stay on their word in o200k (llama3's split cuts them off): learnt as merges.
HARMONY_CORPUS = CORPUS + ["Don't say it's what we'd do; they'll see/CamelCase.\n"] * 20
HARMONY_TEXTS = [
    "CamelCase HELLOworld it'S we'd don't a/b/c 1234567 Ünïcode",
    "<|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
]
# E2M1, the 4-bit floats of an MXFP4 block (code 8 is -0).
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _harmony_tokenizer(out: Path) -> Any:
    """A tiny BPE with gpt-oss's pre-tokenizer and harmony special tokens (<|return|> the eos,
    as in its GGUFs)."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(O200K), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=HARMONY, initial_alphabet=alphabet)
    tok.train_from_iterator(HARMONY_CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHATML, "bos_token": "<|startoftext|>", "eos_token": "<|return|>"}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return tok


def _mxfp4_blocks(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OpenAI's MXFP4 of float rows [E, R, C]: blocks uint8 [E, R, C / 32, 16] (two E2M1 codes a
    byte, the first in the low nibble) and scales uint8 [E, R, C / 32] (exponent + 127), each
    32 values the nearest codes times a power of two that puts the largest near 6."""
    groups = rows.reshape(*rows.shape[:-1], -1, 32)
    top = np.abs(groups).max(-1)
    exp = np.where(top > 0, np.floor(np.log2(np.maximum(top, 1e-30))) - 2, -127).astype(np.int32)
    grid = FP4 * np.ldexp(np.float32(1), exp)[..., None, None]  # [E, R, G, 1, 16]
    codes = np.abs(grid - groups[..., None]).argmin(-1).astype(np.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (exp + 127).astype(np.uint8)


def _mxfp4_values(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float rows [E, R, C] OpenAI's MXFP4 blocks and scales stand for."""
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = FP4[codes] * np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return values.reshape(*values.shape[:-2], -1)


def _repack_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """conversion/gpt_oss.py GptOssModel.repack_mxfp4 and transform_nibble_layout, as written:
    each block's bytes rearranged for ggml's block_mxfp4 (byte j: values j and j + 16) after
    its scale byte, [E, R, C / 32 * 17]."""
    tensor = torch.from_numpy(np.ascontiguousarray(blocks))
    tensor = ((tensor & 0x0F) << 4) | ((tensor & 0xF0) >> 4)
    blk_a, blk_b = tensor.chunk(2, dim=-1)
    blk_a0, blk_a1 = (blk_a & 0xF0).view(-1, 1), (blk_a << 4).view(-1, 1)
    blk_a = torch.stack((blk_a0, blk_a1), dim=2).view(tensor.shape)
    blk_b0, blk_b1 = (blk_b >> 4).view(-1, 1), (blk_b & 0x0F).view(-1, 1)
    blk_b = torch.stack((blk_b0, blk_b1), dim=2).view(tensor.shape)
    out = blk_a | blk_b
    out = ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)
    new = torch.concat((torch.from_numpy(np.ascontiguousarray(scales)).unsqueeze(-1), out), -1)
    return new.view(new.shape[0], new.shape[1], -1).numpy()


def _gpt_oss_tensors(hf: str, x: np.ndarray, mxfp4: bool) -> list[tuple[str, Any]] | None:
    """What conversion/gpt_oss.py writes for a GptOss sink or expert tensor (None for the
    others): the sinks as attn_sinks.weight; gate_up_proj's columns (or its MXFP4 blocks'
    rows) split evens to gate, odds to up, [E, out, in]; down_proj as [E, d, f]; the biases
    split alike. MXFP4 tensors come as (bytes, quantization type)."""
    match = re.match(r"^model\.layers\.(\d+)\.(self_attn\.sinks|mlp\.experts\.\w+)$", hf)
    if match is None:
        return None
    blk, rest = f"blk.{match[1]}", match[2].rsplit(".", 1)[-1]
    if rest == "sinks":
        return [(f"{blk}.attn_sinks.weight", x)]
    if rest == "gate_up_proj_bias":
        return [
            (f"{blk}.ffn_gate_exps.bias", x[..., ::2]),
            (f"{blk}.ffn_up_exps.bias", x[..., 1::2]),
        ]
    if rest == "down_proj_bias":
        return [(f"{blk}.ffn_down_exps.bias", x)]
    rows = np.ascontiguousarray(x.transpose(0, 2, 1))  # [E, out, in]
    # gate_up_proj: its rows (blocks) split evens to gate, odds to up; down_proj whole
    parts = {"gate": slice(0, None, 2), "up": slice(1, None, 2)}
    parts = parts if rest == "gate_up_proj" else {"down": slice(None)}
    blocks, scales = _mxfp4_blocks(rows) if mxfp4 else (None, None)
    out: list[tuple[str, Any]] = []
    for proj, cut in parts.items():
        if blocks is None:
            out.append((f"{blk}.ffn_{proj}_exps.weight", np.ascontiguousarray(rows[:, cut])))
        else:
            packed = _repack_mxfp4(blocks[:, cut], scales[:, cut])
            out.append((f"{blk}.ffn_{proj}_exps.weight", (packed, gguf.GGMLQuantizationType.MXFP4)))
    return out


def _gpt_oss_meta(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What llama.cpp's converter writes of gpt-oss beyond base.py's keys (conversion/gpt_oss.py:
    the window, the experts' width) and of its YaRN (base.py: type, factor, original context,
    beta_fast / beta_slow as given; no window pattern)."""
    w.add_sliding_window(cfg["sliding_window"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    rope = cfg["rope_parameters"]
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(rope["attention_factor"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])


class _Writer(gguf.GGUFWriter):
    """gguf's writer, leaving out the tensors named in `drop` (a damaged file)."""

    def __init__(self, path: str, arch: str, drop: tuple[str, ...] = ()) -> None:
        super().__init__(path, arch)
        self.drop = drop

    def add_tensor(self, name: str, *args: Any, **kwargs: Any) -> None:
        if name not in self.drop:
            super().add_tensor(name, *args, **kwargs)


def _checkpoint(out: Path, arch: str, mxfp4: bool = False, **sizes: Any) -> Path:
    """The family's tiny checkpoint; gpt-oss's with `mxfp4` has experts MXFP4 can hold
    exactly (their values rounded to it, as OpenAI ships them)."""
    import transformers

    out.mkdir(parents=True)
    gpt_oss = arch.startswith("gpt-oss")
    tok = _harmony_tokenizer(out) if gpt_oss else make_tokenizer(out)
    bos, eos = ("<|startoftext|>", "<|return|>") if gpt_oss else ("<|im_start|>", "<|im_end|>")
    cls_name, kwargs = CONFIGS[arch]
    config = getattr(transformers, cls_name)(
        **{**BASE, **kwargs, **sizes},
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id(bos),
        eos_token_id=tok.token_to_id(eos),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, gemma=arch.startswith("gemma"))
    with torch.no_grad():
        for name, p in model.named_parameters() if gpt_oss else ():
            if name.endswith(".sinks"):  # as large as the scores, so that they matter
                p.normal_(0, 1.0)
            elif name.endswith("experts.gate_up_proj"):  # |gate|, |up| past 7 for some
                p.normal_(0, 0.6)
            if mxfp4 and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                rows = p.detach().numpy().transpose(0, 2, 1)  # [E, out, in], as stored
                held = _mxfp4_values(*_mxfp4_blocks(rows)).transpose(0, 2, 1)
                p.copy_(torch.from_numpy(np.ascontiguousarray(held)))
        if arch.startswith("minicpm3"):  # embeddings as large after llama.cpp's × 12 as others
            model.model.embed_tokens.weight /= 12
        if arch == "deepseek2-youtu":  # its padding row zero, as transformers loads it
            model.model.embed_tokens.weight[config.pad_token_id] = 0
    model.save_pretrained(out)
    return out


def _gguf_name(arch: str, hf: str) -> str:
    if arch.startswith("qwen3") and hf.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
        leaf = "ssm_a" if hf.endswith("A_log") else "ssm_dt.bias"
        return f"blk.{hf.split('.')[2]}.{leaf}"
    if hf.endswith(("feed_forward.expert_bias", "e_score_correction_bias")):
        return f"blk.{hf.split('.')[2]}.exp_probs_b.bias"  # LFM2-MoE's, GLM-4.5's, ERNIE's
    module, kind = hf.rsplit(".", 1)
    if module in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[module]}.{kind}"
    parts = module.split(".")  # model.layers.I.rest or gpt_neox.layers.I.rest
    i, rest = parts[2], ".".join(parts[3:])
    if arch in LATENT_CASES + MINICPM3_CASES and rest in LATENT_NAMES:
        return f"blk.{i}.{LATENT_NAMES[rest]}.{kind}"
    if rest in MOE_NAMES:
        return f"blk.{i}.{MOE_NAMES[rest]}.{kind}"
    names = {
        "olmo2": OLMO2_NAMES,
        "olmo3": OLMO2_NAMES,
        "gemma2": GEMMA_NAMES,
        "gemma3": GEMMA_NAMES,
        "gptneox": LAYER_NAMES["gptneox"],
        "phi3": PHI3_NAMES,
        "glm4": GLM4_NAMES,
        "lfm2": LAYER_NAMES["lfm2"],
        "lfm2moe": LAYER_NAMES["lfm2"],
        "phi2": PHI2_NAMES,
        "phi2-qkv": PHI2_NAMES,
        "starcoder2": STARCODER2_NAMES,
        "exaone4": OLMO2_NAMES,
        "exaone4-swa": OLMO2_NAMES,
        "gpt-oss": GPT_OSS_NAMES,
        "gpt-oss-qkv": GPT_OSS_NAMES,
        "seed_oss": GPT_OSS_NAMES,
        "hunyuan-dense": HUNYUAN_NAMES,
        "apertus": APERTUS_NAMES,
        "qwen35": QWEN35_NAMES,
        "qwen35moe": QWEN35_NAMES,
        "qwen35-r3": QWEN35_NAMES,
        "qwen3next": QWEN3NEXT_NAMES,
        "qwen3next-ssm_in": QWEN3NEXT_NAMES,
        "glm4moe": GROUPED_MOE_NAMES,
        "glm4moe-solar": GROUPED_MOE_NAMES,
        "dots1": DOTS1_NAMES,
        "exaone-moe": DOTS1_NAMES,
        "ernie4_5-moe": DOTS1_NAMES,
        "hunyuan-moe": HUNYUAN_MOE_NAMES,
        "mellum": LAYER_NAMES["llama"],
    }.get(arch, LAYER_NAMES["llama"])
    return f"blk.{i}.{names[rest]}.{kind}"


def _converted(arch: str, hf: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py stores for an HF tensor (of config `cfg`)."""
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    if arch.startswith("qwen35"):
        return _qwen35_converted(hf, w, cfg)
    if arch.startswith("qwen3next"):
        return _qwen35_converted(hf, w, cfg, tiled=False)
    if arch in ("gemma", "gemma2", "gemma3", "nemotron") and hf.endswith("norm.weight"):
        return w + np.float32(1.0)
    # its LlamaModel kin
    permuted = ("smollm3", "granite", "mixtral", "granitemoe", "llama3", "arcee", "arcee-llama3")
    permuted += ("mistral3", "mistral3-untempered")
    if arch in permuted and hf.endswith(("q_proj.weight", "k_proj.weight")):
        return permute_qk(w, heads if "q_proj" in hf else kv_heads)
    if arch.startswith("lfm2") and hf.endswith("conv.conv.weight"):  # [d, 1, kernel] -> [d, kernel]
        return np.ascontiguousarray(w[:, 0])
    if arch == "gptneox" and "query_key_value" in hf:
        rest = w.shape[1:]
        return np.ascontiguousarray(
            w.reshape(heads, 3, -1, *rest).swapaxes(0, 1).reshape(w.shape[0], *rest)
        )
    return w


def _qwen35_converted(
    hf: str, w: np.ndarray, cfg: dict[str, Any], tiled: bool = True
) -> np.ndarray:
    """conversion/qwen.py: value heads from grouped by key head to `tiled`
    (_LinearAttentionVReorderBase, Qwen3.5's), then Qwen3NextModel's changes."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]

    def retile(x: np.ndarray, axis: int, width: int) -> np.ndarray:
        if not tiled:
            return x
        shape = list(x.shape)
        x = x.reshape(*shape[:axis], hk, hv // hk, width, *shape[axis + 1 :])
        return np.swapaxes(x, axis, axis + 1).reshape(shape)

    if "conv1d" in hf:
        w = w[:, 0]
    if ".in_proj_qkv." in hf or "conv1d" in hf:
        w = np.concatenate([w[: 2 * hk * dk], retile(w[2 * hk * dk :], 0, dv)])
    elif ".in_proj_z." in hf:
        w = retile(w, 0, dv)
    elif ".out_proj." in hf:
        w = retile(w, 1, dv)
    elif hf.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
        w = retile(w, 0, 1)
    if hf.endswith("A_log"):
        return -np.exp(w)
    if hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
        return w + np.float32(1.0)
    return np.ascontiguousarray(w)


def _qwen3next_qkvz(hf: str, x: np.ndarray, cfg: dict[str, Any]) -> list[tuple[str, Any]]:
    """conversion/qwen.py Qwen3NextModel: in_proj_qkvz, each key head's [q, k, v, z], as
    attn_qkv (all q, all k, all v) and attn_gate (all z)."""
    dk, hk = cfg["linear_key_head_dim"], cfg["linear_num_key_heads"]
    dv = cfg["linear_num_value_heads"] // hk * cfg["linear_value_head_dim"]
    q, k, v, z = np.split(x.reshape(hk, -1, x.shape[1]), [dk, 2 * dk, 2 * dk + dv], axis=1)
    rows = [np.ascontiguousarray(p.reshape(-1, x.shape[1])) for p in (q, k, v, z)]
    blk = f"blk.{hf.split('.')[2]}"
    return [
        (f"{blk}.attn_qkv.weight", np.concatenate(rows[:3])),
        (f"{blk}.attn_gate.weight", rows[3]),
    ]


def _qwen35_meta(w: gguf.GGUFWriter, kind: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What conversion/qwen.py writes of Qwen3.5 past the common keys (Qwen3NextModel's
    ssm.* sizes, the recurrent blocks, a quarter of each head rotated, mrope sections)."""
    w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    w.add_ssm_state_size(cfg["linear_key_head_dim"])
    w.add_ssm_group_count(cfg["linear_num_key_heads"])
    w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    w.add_array(f"{kind}.attention.recurrent_layers", [
        t == "linear_attention" for t in cfg["layer_types"]])  # fmt: skip
    w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(head_dim * cfg["rope_parameters"]["partial_rotary_factor"]))
    if kind.startswith("qwen35"):  # Qwen3-Next: no multimodal RoPE
        w.add_rope_dimension_sections([11, 11, 10, 0])


def _llama3_divisors(cfg: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama 3.1 scaling (LlamaModel.generate_extra_tensors)."""
    rope = cfg["rope_parameters"]
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            divisors.append(1.0)
        elif wavelen > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, np.float32)


def _llama_variant_meta(w: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of Phi-3's, Granite's and Arcee's own keys
    (conversion/phi.py, granite.py, arcee.py); LongRoPE's factors and Llama 3.1's divisors
    (LlamaModel.generate_extra_tensors, Arcee's too) as tensors."""
    if (cfg.get("rope_parameters") or {}).get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_divisors(cfg, head_dim))
    if arch.startswith(("arcee", "mistral3")) or arch == "apertus":  # LlamaModel's keys
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if arch.startswith("mistral3"):  # base.py's YaRN keys, conversion/mistral3.py's two
        rope = cfg["rope_parameters"]
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
        w.add_attn_temperature_scale(rope["llama_4_scaling_beta"])
    if arch == "olmo3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch.startswith("exaone4"):  # conversion/exaone.py: a window only where one is set
        w.add_vocab_size(cfg["vocab_size"])
        if cfg.get("sliding_window") is not None:
            w.add_sliding_window(cfg["sliding_window"])
            w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
    if arch in ("granite", "granitemoe"):
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "glm4":
        rope = cfg["rope_parameters"]
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    if arch != "phi3":
        return
    rope = cfg["rope_parameters"]
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    scale = cfg["max_position_embeddings"] / rope["original_max_position_embeddings"]
    gain = math.sqrt(1 + math.log(scale) / math.log(rope["original_max_position_embeddings"]))
    w.add_rope_scaling_attn_factors(gain if scale > 1 else 1.0)
    w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def _layernorm_meta(w: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of Phi-2 and StableLM (conversion/phi.py,
    stablelm.py: no RoPE base) and of StarCoder2 (base.py's TextModel keys: no rotated dims,
    no window)."""
    rope = cfg["rope_parameters"]
    if arch == "starcoder2":
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_layer_norm_eps(cfg["norm_epsilon"])
        return
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    if arch == "phi2":
        heads = cfg["num_attention_heads"]
        w.add_feed_forward_length(4 * cfg["hidden_size"])
        w.add_head_count_kv(heads)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * cfg["hidden_size"]) // heads)
        return
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    w.add_parallel_residual(cfg["use_parallel_residual"])


def _nemotron_meta(w: gguf.GGUFWriter, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of Nemotron (conversion/nemotron.py NemotronModel on
    base.py's keys): norm_eps as both epsilons, the vocabulary size, hidden_size x the rotary
    factor / heads rotated dims, no RoPE scaling."""
    rope = cfg["rope_parameters"]
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_layer_norm_eps(cfg["norm_eps"])
    rot = int(rope["partial_rotary_factor"] * cfg["hidden_size"]) // cfg["num_attention_heads"]
    w.add_rope_dimension_count(rot)
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _cohere_meta(w: gguf.GGUFWriter, kind: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of Command R and Cohere2 (conversion/command_r.py):
    base.py's keys, the logit scale, no RoPE scaling; Cohere2's window, rotated dims and
    vocabulary size (no window pattern: llama.cpp's is fixed)."""
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_eps(cfg["layer_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if cfg.get("head_dim"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_logit_scale(cfg["logit_scale"])
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    if kind == "cohere2":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(int(cfg.get("rotary_pct", 1.0) * head_dim))


def _moe_meta(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What llama.cpp's converter writes of a mixture of experts (conversion/base.py, qwen.py)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if cfg.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])


def _grouped_moe_meta(w: gguf.GGUFWriter, kind: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of GLM-4.5 and Solar Open (conversion/glm.py
    Glm4MoeModel on base.py's keys: half of each head rotated unless the config says
    otherwise), of dots.llm1 (conversion/dots1.py, on Qwen2MoeModel's) and K-EXAONE
    (conversion/exaone.py ExaoneMoEModel: EXAONE 4's window, a flag per layer, the shared
    MLP's width): the groups, the experts, sigmoid gating (dots1, K-EXAONE: their
    config.json's scoring_func), the keys the config has."""
    shared = cfg.get("n_shared_experts", cfg.get("num_shared_experts"))
    if kind == "glm4moe":
        rotary = (cfg.get("rope_parameters") or {}).get("partial_rotary_factor", 0.5)
        w.add_rope_dimension_count(int(head_dim * rotary))
    if kind == "exaone-moe":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_expert_shared_feed_forward_length(cfg["moe_intermediate_size"] * shared)
        w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_expert_count(cfg.get("n_routed_experts") or cfg["num_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(shared)
    if cfg.get("first_k_dense_replace") is not None:
        w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])


def _softmax_moe_meta(w: gguf.GGUFWriter, kind: str, cfg: dict[str, Any], head_dim: int) -> None:
    """What llama.cpp's converter writes of ERNIE 4.5 MoE (conversion/ernie.py: the shared
    MLP's width as intermediate_size / KV heads) and Hunyuan MoE (conversion/hunyuan.py: every
    width intermediate_size's, the NTK-alpha base stretched, no scaling)."""
    if kind == "ernie4_5-moe":
        w.add_expert_count(cfg["moe_num_experts"])
        w.add_expert_used_count(cfg["moe_k"])
        w.add_interleave_moe_layer_step(cfg["moe_layer_interval"])
        w.add_leading_dense_block_count(cfg["moe_layer_start_index"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_shared_count(cfg["moe_num_shared_experts"])
        shared = cfg["intermediate_size"] // cfg["num_key_value_heads"]
        w.add_expert_shared_feed_forward_length(shared)
        return
    w.add_expert_count(cfg["num_experts"])
    w.add_expert_used_count(cfg["moe_topk"])
    w.add_expert_shared_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_shared_count(1)


def _mellum_meta(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What conversion/mellum.py writes past base.py's keys (and _moe_meta's): the full
    layers' YaRN (base.py's keys from rope_parameters.full_attention), the sliding layers'
    base, the window and a flag per layer."""
    full = cfg["rope_parameters"]["full_attention"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(full["factor"])
    w.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_attn_factor(full["attention_factor"])
    w.add_rope_scaling_yarn_beta_fast(full["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(full["beta_slow"])
    w.add_rope_freq_base_swa(cfg["rope_parameters"]["sliding_attention"]["rope_theta"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])


def _lfm2_meta(w: gguf.GGUFWriter, cfg: dict[str, Any]) -> None:
    """What llama.cpp's converter writes of LFM2 (conversion/lfm2.py): KV heads per block (0
    on the convolutions), the kernel, the MLP width LFM2 derives from block_ff_dim; LFM2-MoE's
    experts (sigmoid gating)."""
    w.add_head_count_kv(
        [cfg["num_key_value_heads"] if t != "conv" else 0 for t in cfg["layer_types"]]
    )
    w.add_shortconv_l_cache(cfg["conv_L_cache"])
    w.add_layer_norm_rms_eps(cfg["norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    if "num_experts" in cfg:  # LFM2-MoE: its MLP width as it is, the experts (lfm2.py)
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_leading_dense_block_count(cfg["num_dense_layers"])
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        return
    width, step = int(2 * cfg["intermediate_size"] / 3), cfg["block_multiple_of"]
    width = int(cfg["block_ffn_dim_multiplier"] * width)
    w.add_feed_forward_length(step * ((width + step - 1) // step))


def _blocks(stored: np.ndarray, qtype: str, seed: int) -> np.ndarray:
    """gguf's quantizer where it has one for `qtype`; else (k-quants) random blocks scaled
    to weights of about the checkpoint's size."""
    t = gguf.GGMLQuantizationType[qtype]
    try:
        return gguf.quants.quantize(stored, t)
    except NotImplementedError:
        q = gguf_blocks.QTYPES[qtype]
        return gguf_blocks.random_blocks(q, *stored.shape, seed=seed, scale=3e-4)


def _write_gguf(
    ckpt: Path,
    path: Path,
    arch: str,
    quantize: bool = True,
    qtypes: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    mxfp4: bool = False,
    drop: tuple[str, ...] = (),
    keys: Callable[[gguf.GGUFWriter], None] | None = None,
) -> dict[str, Any]:
    """The checkpoint as llama.cpp would convert it, with `extra` tensors as given, those in
    `drop` left out and metadata `keys` adds; returns the HF tensors written. Half the
    matrices are Q8_0, or with `qtypes` every matrix takes the next of them its rows fit;
    gpt-oss's experts are MXFP4 with `mxfp4`."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    kind = GGUF_ARCH.get(arch, arch)
    w = _Writer(str(path), kind, drop)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    if kind not in ("lfm2", "phi2") and "intermediate_size" in cfg:  # (Solar Open: none)
        w.add_feed_forward_length(cfg["intermediate_size"])  # (LFM2's, Phi-2's: their own)
    w.add_head_count(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if arch == "gptneox":
        w.add_layer_norm_eps(cfg["layer_norm_eps"])
        rope = cfg.get("rope_parameters") or {}
        pct = cfg.get("rotary_pct") or rope["partial_rotary_factor"]
        w.add_rope_dimension_count(int(pct * head_dim))
        w.add_rope_freq_base(cfg.get("rotary_emb_base") or rope.get("rope_theta", 10000.0))
        w.add_parallel_residual(cfg["use_parallel_residual"])
    elif arch.startswith("lfm2"):
        _lfm2_meta(w, cfg)
    elif kind in ("phi2", "stablelm", "starcoder2"):
        _layernorm_meta(w, kind, cfg, head_dim)
    elif kind in ("command-r", "cohere2"):
        _cohere_meta(w, kind, cfg, head_dim)
    elif kind == "nemotron":
        _nemotron_meta(w, cfg, head_dim)
    elif kind == "minicpm3":
        minicpm3_meta(w, cfg)
    elif kind == "deepseek2":
        sigmoid = cfg["architectures"] == ["DeepseekV3ForCausalLM"]
        latent_meta(w, cfg, split=arch != "deepseek2-kv_b", sigmoid=sigmoid)
    else:
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("full_attention", rope).get("rope_theta")
        if arch == "gemma3":
            w.add_sliding_window(cfg["sliding_window"])
        if arch == "gemma2":
            w.add_sliding_window(cfg["sliding_window"])
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        if arch.startswith("hunyuan"):  # the base alpha stretches, unscaled
            alpha = rope["alpha"]
            w.add_rope_freq_base(theta * alpha ** (head_dim / (head_dim - 2)))
            w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
            w.add_rope_scaling_factor(1)
        elif arch != "gemma":  # Gemma (1): none stored
            w.add_rope_freq_base(theta)
        _llama_variant_meta(w, arch, cfg, head_dim)
        if kind == "mellum":
            _mellum_meta(w, cfg)
        if kind in ("ernie4_5-moe", "hunyuan-moe"):
            _softmax_moe_meta(w, kind, cfg, head_dim)
        elif kind in ("glm4moe", "dots1", "exaone-moe"):
            _grouped_moe_meta(w, kind, cfg, head_dim)
        else:
            _moe_meta(w, cfg)
        if kind.startswith(("qwen35", "qwen3next")):
            _qwen35_meta(w, kind, cfg, head_dim)
        if kind == "gpt-oss":
            _gpt_oss_meta(w, cfg)
    if keys is not None:
        keys(w)
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {t["id"]: t["content"] for t in tok["added_tokens"]}
    tokens = [added.get(i, t) for t, i in vocab]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o" if kind == "gpt-oss" else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in added else gguf.TokenType.NORMAL for _, i in vocab]
    )
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    written: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str], dict[int, tuple[str, np.ndarray]]] = {}
    xielu: dict[str, dict[int, float]] = {}  # Apertus: metadata, one value per block
    head_norms: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    fused: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    with safe_open(ckpt / "model.safetensors", "np") as f:
        for n, hf in enumerate(sorted(f.keys())):
            x = f.get_tensor(hf).astype(np.float32)
            written[hf] = x
            if kind == "gpt-oss" and (pairs := _gpt_oss_tensors(hf, x, mxfp4)) is not None:
                for name, t in pairs:
                    if isinstance(t, tuple):  # MXFP4 bytes
                        w.add_tensor(name, t[0], raw_dtype=t[1])
                    else:
                        w.add_tensor(name, np.ascontiguousarray(t))
                continue
            if kind in ("deepseek2", "minicpm3") and (
                pairs := latent_tensors(hf, x, cfg, split=arch in SPLIT_LATENT)
            ):
                for name, t in pairs:
                    w.add_tensor(name, t)
                continue
            if arch == "qwen3next" and hf.endswith("in_proj_qkvz.weight"):
                for name, t in _qwen3next_qkvz(hf, x, cfg):
                    w.add_tensor(name, t)
                continue
            if ".mlp.act_fn." in hf:
                xielu.setdefault(hf.rsplit(".", 1)[1], {})[int(hf.split(".")[2])] = x.item()
                continue
            if match := EXPERT.match(hf):  # stacked per block and projection, as llama.cpp does
                layer, e, proj = match.groups()
                experts.setdefault((layer, STACKED.get(proj, "down")), {})[int(e)] = (hf, x)
                continue
            if match := HEAD_NORM.match(hf):
                layer, qk, head = match.groups()
                head_norms.setdefault((layer, qk), {})[int(head)] = x
                continue
            if arch in ("phi2-qkv", "gpt-oss-qkv") and (match := QKV.match(hf)):
                layer, proj, part = match.groups()
                fused.setdefault((layer, part), {})[proj] = x
                continue
            if hf.endswith("block_sparse_moe.input_linear.weight"):  # Granite MoE: split
                layer = hf.split(".")[2]
                for proj, part in zip(("gate", "up"), np.split(x, 2, axis=1), strict=True):
                    w.add_tensor(f"blk.{layer}.ffn_{proj}_exps.weight", np.ascontiguousarray(part))
                continue
            stored = _converted(arch, hf, x, cfg)
            blocks = x.ndim == 2 and x.shape[1]
            fits = [t for t in qtypes if blocks and blocks % gguf_blocks.QTYPES[t].block == 0]
            if not qtypes and quantize and x.ndim == 2 and x.shape[1] % 32 == 0 and n % 2 == 0:
                fits = ["Q8_0"]
            if fits:
                qtype = gguf.GGMLQuantizationType[fits[n % len(fits)]]
                q = _blocks(stored, qtype.name, seed=n)
                back = gguf.quants.dequantize(q, qtype)
                if arch == "gptneox" and "query_key_value" in hf:  # [q; k; v] → per head
                    heads = cfg["num_attention_heads"]
                    back = back.reshape(3, heads, -1, back.shape[1]).swapaxes(0, 1)
                written[hf] = back.reshape(x.shape)  # what the importer must give back
                w.add_tensor(_gguf_name(arch, hf), q, raw_shape=q.shape, raw_dtype=qtype)
            else:
                w.add_tensor(_gguf_name(arch, hf), stored)
    for param, per_layer in xielu.items():
        getattr(w, f"add_xielu_{param}")([per_layer[i] for i in sorted(per_layer)])
    for n, ((layer, proj), per_expert) in enumerate(experts.items()):
        names, mats = zip(*(per_expert[e] for e in sorted(per_expert)), strict=True)
        stacked, name = np.stack(mats), f"blk.{layer}.ffn_{proj}_exps.weight"
        fits = [t for t in qtypes if stacked.shape[2] % gguf_blocks.QTYPES[t].block == 0]
        if not fits:
            w.add_tensor(name, stacked)
            continue
        qtype = fits[n % len(fits)]  # gate and up of a block take one type, as llama.cpp's
        if proj == "up" and (layer, "gate") in experts:
            qtype = fits[list(experts).index((layer, "gate")) % len(fits)]
        q = _blocks(stacked.reshape(-1, stacked.shape[2]), qtype, seed=n)
        back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[qtype]).reshape(stacked.shape)
        written |= {hf: back[e] for e, hf in enumerate(names)}
        q = q.reshape(*stacked.shape[:2], -1)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
    for (layer, qk), per_head in head_norms.items():
        stacked = np.stack([per_head[h] for h in sorted(per_head)])
        w.add_tensor(f"blk.{layer}.attn_{qk}_norm.weight", stacked)
    for (layer, part), qkv in fused.items():
        w.add_tensor(f"blk.{layer}.attn_qkv.{part}", np.concatenate([qkv[p] for p in "qkv"]))
    for name, x in (extra or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _assert_same_tensors(ckpt: Path, out: Path, atol: float) -> None:
    """The imported checkpoint holds the original's tensors, by name, within `atol`."""
    with (
        safe_open(ckpt / "model.safetensors", "np") as f,
        safe_open(out / "model.safetensors", "np") as g,
    ):
        assert set(g.keys()) == set(f.keys())
        for name in f.keys():
            np.testing.assert_allclose(g.get_tensor(name), f.get_tensor(name), atol=atol, rtol=0)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_family_gguf_imports_to_the_same_model(tmp_path: Path, arch: str) -> None:
    ckpt = _checkpoint(tmp_path / "hf", arch)
    _write_gguf(ckpt, tmp_path / "m.gguf", arch, quantize=False)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    _assert_same_tensors(ckpt, out, atol=1e-6)
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0])
    ref = reference_logits(load_reference(ckpt), ids)
    got = reference_logits(load_reference(out), ids)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    new, old = Tokenizer.from_dir(out), Tokenizer.from_dir(ckpt)
    for text in TEXTS + (HARMONY_TEXTS if arch.startswith("gpt-oss") else []):
        assert new.encode(text) == old.encode(text)
    ours = EagerModel(out, 96).forward(ids, 0)  # aotgen's model on the imported checkpoint
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("arch", ["deepseek2", "gpt-oss", "apertus", "qwen3next", "gptneox"])
def test_import_in_shards_is_the_same_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """Weights written a block at a time (shards of one block here, and the embeddings): the
    sharded checkpoint and its index hold the one-file import's tensors, which transformers
    loads; each block's rewriting (halves joined, experts regrouped, zero biases, xIELU's
    metadata) sees that block whole."""
    from aotgen.checkpoint import gguf_room

    ckpt = _checkpoint(tmp_path / "hf", arch)
    _write_gguf(ckpt, tmp_path / "m.gguf", arch, quantize=False)
    whole = import_gguf(tmp_path / "m.gguf", tmp_path / "whole")
    monkeypatch.setattr(gguf_room, "SHARD_BYTES", 1)
    sharded = import_gguf(tmp_path / "m.gguf", tmp_path / "sharded")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    n_layer = json.loads((whole / "config.json").read_text())["num_hidden_layers"]
    assert len(set(index["weight_map"].values())) == n_layer + 1
    assert not (sharded / "model.safetensors").exists()
    with safe_open(whole / "model.safetensors", "np") as f:
        assert set(index["weight_map"]) == set(f.keys())
        for name, file in index["weight_map"].items():
            with safe_open(sharded / file, "np") as g:
                np.testing.assert_array_equal(g.get_tensor(name), f.get_tensor(name))
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0])
    ref = reference_logits(load_reference(whole), ids)
    # transformers loads every tensor (a missing one would be drawn at random); its forward is
    # not bit-reproducible across calls for every family (qwen3next differs by ~3e-8)
    assert _relative(reference_logits(load_reference(sharded), ids), ref) < 1e-6
    assert _relative(EagerModel(sharded, 96).forward(ids, 0), ref) < 1e-5  # aotgen reads it


@pytest.mark.parametrize("arch", ["gemma3", "gptneox", "phi2"])
def test_quantized_blocks_dequantize(tmp_path: Path, arch: str) -> None:
    """Q8_0 blocks on half the matrices; the importer gives back their dequantized values."""
    ckpt = _checkpoint(tmp_path / "hf", arch)
    written = _write_gguf(ckpt, tmp_path / "m.gguf", arch)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    with safe_open(out / "model.safetensors", "np") as g:
        for name, want in written.items():
            np.testing.assert_allclose(g.get_tensor(name), want, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("arch", ["qwen35", "glm4moe"])
def test_multi_token_prediction_block_is_left_out(tmp_path: Path, arch: str) -> None:
    """A GGUF converted with its MTP block (one more block, its nextn.* tensors,
    `nextn_predict_layers` 1) imports as the model without it, as transformers loads the
    checkpoint without its MTP layer."""
    ckpt = _checkpoint(tmp_path / "hf", arch)
    n, d = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"], 64
    mtp = {
        f"blk.{n}.attn_norm.weight": np.ones(d, np.float32),
        f"blk.{n}.nextn.eh_proj.weight": np.zeros((d, 2 * d), np.float32),
        f"blk.{n}.nextn.enorm.weight": np.ones(d, np.float32),
    }

    def one_more_block(w: gguf.GGUFWriter) -> None:
        w.add_block_count(n + 1)
        w.add_nextn_predict_layers(1)

    _write_gguf(ckpt, tmp_path / "m.gguf", arch, quantize=False, extra=mtp, keys=one_more_block)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == n
    _assert_same_tensors(ckpt, out, atol=1e-6)


@pytest.mark.parametrize(
    ("case", "keys", "message"),
    [
        (
            "glm4moe",
            lambda w: w.add_uint32("glm4moe.expert_gating_func", 1),
            r"expert_gating_func 1: only sigmoid routing",
        ),
        ("dots1", lambda w: w.kv_data[0].pop("dots1.expert_gating_func"), r"no expert_gating_fu"),
        (
            "ernie4_5-moe",
            lambda w: w.add_interleave_moe_layer_step(2),
            r"interleave_moe_layer_step 2: llama\.cpp loads experts on every block",
        ),
        (
            "ernie4_5-moe",
            lambda w: w.add_expert_shared_feed_forward_length(48),
            r"shared_feed_forward_length 48 is not a whole number of experts 32 wide",
        ),
        (
            "exaone-moe",
            lambda w: w.add_expert_shared_feed_forward_length(48),
            r"shared_feed_forward_length 48 is not a whole number of experts 32 wide",
        ),
        (
            "exaone-moe",
            lambda w: w.kv_data[0].pop("exaone-moe.attention.sliding_window"),
            r"missing required key 'exaone-moe\.attention\.sliding_window'",
        ),
        (
            "hunyuan-moe",
            lambda w: w.add_expert_shared_feed_forward_length(64),
            r"shared_feed_forward_length 64 differs from feed_forward_length 32",
        ),
        ("hunyuan-moe", lambda w: w.add_expert_weights_scale(2.5), r"expert_weights_scale 2\.5"),
    ],
)
def test_moe_file_the_model_cannot_run_is_one_line(
    tmp_path: Path, case: str, keys: Callable[[gguf.GGUFWriter], None], message: str
) -> None:
    """A routing, layout or width transformers' model of the family cannot express (or that
    llama.cpp itself cannot run): refused, nothing written."""
    ckpt = _checkpoint(tmp_path / "hf", case)
    _write_gguf(ckpt, tmp_path / "m.gguf", case, quantize=False, keys=keys)
    with pytest.raises(CheckpointError, match=message) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("case", ["dots1", "exaone-moe"])
def test_expert_bias_absent_is_zero(tmp_path: Path, case: str) -> None:
    """dots.llm1's and K-EXAONE's exp_probs_b is optional in llama.cpp (experts then chosen
    by their scores alone): a file without it imports with a zero bias, as llama.cpp runs it."""
    ckpt = _checkpoint(tmp_path / "hf", case)
    drop = tuple(f"blk.{i}.exp_probs_b.bias" for i in range(4))
    _write_gguf(ckpt, tmp_path / "m.gguf", case, quantize=False, drop=drop)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    with safe_open(out / "model.safetensors", "np") as g:
        biases = [g.get_tensor(n) for n in g.keys() if n.endswith("e_score_correction_bias")]
    assert len(biases) == (2 if case == "dots1" else 3) and not any(b.any() for b in biases)
    load_reference(out)  # transformers loads it


def test_exaone4_below_64_layers_imports_without_its_window(tmp_path: Path) -> None:
    """llama.cpp windows EXAONE 4 at 64 layers only: a shallower GGUF storing a window and a
    pattern imports with every layer global and rotated, as llama.cpp runs it."""
    ckpt = _checkpoint(tmp_path / "hf", "exaone4-swa", num_hidden_layers=4)
    _write_gguf(ckpt, tmp_path / "m.gguf", "exaone4-swa", quantize=False)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    config = json.loads((out / "config.json").read_text())
    assert config["sliding_window"] is None
    assert config["layer_types"] == ["full_attention"] * 4
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0])
    ref = reference_logits(load_reference(out), ids)
    ours = EagerModel(out, 96).forward(ids, 0)
    assert ((ours - ref).norm() / ref.norm()).item() < 1e-5


def test_tensor_not_matching_metadata_is_one_line(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "hf", "qwen3")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["head_dim"] = 16
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _write_gguf(ckpt, tmp_path / "m.gguf", "qwen3", quantize=False)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.attn_k_norm\.weight'|attn_q"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


def test_rope_freqs_where_llama_cpp_reads_none_is_one_line(tmp_path: Path) -> None:
    """Llama 3.1's divisors on an architecture whose llama.cpp graph does not apply them: the
    model would differ from llama.cpp's either way, so nothing is written."""
    ckpt = _checkpoint(tmp_path / "hf", "gptneox")
    divisors = {"rope_freqs.weight": np.full(4, 2.0, np.float32)}
    _write_gguf(ckpt, tmp_path / "m.gguf", "gptneox", quantize=False, extra=divisors)
    with pytest.raises(CheckpointError, match=r"rope_freqs\.weight on gptneox") as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize("key", ["moe_intermediate_size", "num_local_experts"])
def test_experts_not_matching_metadata_are_one_line(tmp_path: Path, key: str) -> None:
    """Expert tensors whose shape the metadata (expert count, expert width) does not imply."""
    ckpt = _checkpoint(tmp_path / "hf", "qwen3moe")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg[key] += 8
    (ckpt / "config.json").write_text(json.dumps(cfg))
    _write_gguf(ckpt, tmp_path / "m.gguf", "qwen3moe", quantize=False)
    with pytest.raises(CheckpointError, match=r"tensor 'blk\.0\.ffn_\w+\.weight' has shape"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert not (tmp_path / "imported").exists()


@pytest.mark.parametrize(
    "arch",
    [
        "glm4",
        "phi3",
        "phi2",
        "stablelm",
        "starcoder2",
        "command-r",
        "exaone4",
        "gemma",
        "nemotron",
        "arcee",
        "mistral3",
        "seed_oss",
        "apertus",
        "qwen35-r3",
    ],
)
def test_rows_moved_at_load_are_found_in_the_blocks(tmp_path: Path, arch: str) -> None:
    """GLM-4's and Phi-3's fused tensors split at load, GLM-4's and Command R's q/k rows
    reordered for rotate-half RoPE, Arcee's and Ministral 3's unpermuted, Qwen3.5's value
    heads regrouped: whole rows move, so `gguf: keep` (which these recipes pass) finds every
    linear of the loaded model in the file's blocks; Qwen3.5's out_proj, whose inputs moved,
    on its blocks with its activations gathered in the file's order."""
    from aotgen.checkpoint.hf import open_checkpoint
    from aotgen.model.config import ModelConfig
    from aotgen.model.llama import load_model
    from aotgen.package.models import keep_gguf
    from aotgen.passes.gguf_keep import BlockIndex
    from aotgen.recipe import parse_recipe

    ckpt = _checkpoint(tmp_path / "hf", arch)
    _write_gguf(ckpt, tmp_path / "m.gguf", arch, qtypes=("Q8_0",))
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    recipe = parse_recipe({"checkpoint": str(out), "quantize": {"gguf": "keep"}}, "r", tmp_path)
    imported = open_checkpoint(out)
    assert keep_gguf(recipe, recipe.quantize, imported, {}) is not None
    index = BlockIndex(imported.load_gguf_blocks(), imported.block_input_orders())
    cfg = ModelConfig.from_hf(imported.config)
    model = load_model(cfg, imported.load_weights(), 32, torch.float32)
    linears = {n: m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    per_layer = 6 if arch in ("phi2", "starcoder2", "nemotron", "arcee", "apertus") else 7
    # Qwen3.5: 3 linear-attention layers of 5 linears and the MLP's 3, 1 attention layer of 7
    want = 3 * 8 + 7 if arch == "qwen35-r3" else 2 * per_layer
    assert len(linears) == want + 1  # and the head, tied to the embeddings or not
    for name, weight in linears.items():
        segments = index.segments(weight)
        assert segments is not None and [s.qtype for s in segments] == ["Q8_0"], name
        moved = arch == "qwen35-r3" and name.endswith("out_proj")
        assert (segments[0].order is not None) == moved, name


def _relative(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm()).item()


def test_gpt_oss_mxfp4_experts_import_exactly(tmp_path: Path) -> None:
    """gpt-oss's experts as OpenAI ships them (MXFP4 blocks of 32 inputs: hidden and expert
    widths multiples of 32), written as the converter's repack_mxfp4 writes them: the import
    gives back every expert value exactly, and the same logits."""
    sizes = dict(num_hidden_layers=2, intermediate_size=64)
    ckpt = _checkpoint(tmp_path / "hf", "gpt-oss", mxfp4=True, **sizes)
    _write_gguf(ckpt, tmp_path / "m.gguf", "gpt-oss", quantize=False, mxfp4=True)
    reader = open_gguf(tmp_path / "m.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors if "_exps.weight" in t.name}
    assert len(types) == 6 and set(types.values()) == {"MXFP4"}
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    _assert_same_tensors(ckpt, out, atol=0.0)
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0] + TEXTS[1])
    ref = reference_logits(load_reference(ckpt), ids)
    assert _relative(reference_logits(load_reference(out), ids), ref) < 1e-6
    assert _relative(EagerModel(out, 96).forward(ids, 0), ref) < 1e-5


def test_gpt_oss_config_is_what_llama_cpp_runs(tmp_path: Path) -> None:
    """llama.cpp's YaRN whatever the converter stored (ramp ends floored and ceiled, beta_fast
    32 and beta_slow 1: openai-moe reads neither key), its fixed SwiGLU clamp (which cuts here),
    its end-of-generation tokens (<|return|> and <|call|>, not <|end|>)."""
    rope = {**GPT_OSS_YARN, "beta_fast": 16.0, "truncate": False}  # as an HF config may say
    ckpt = _checkpoint(tmp_path / "hf", "gpt-oss", rope_parameters=rope)
    _write_gguf(ckpt, tmp_path / "m.gguf", "gpt-oss", quantize=False)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"] == {
        **GPT_OSS_YARN,
        "attention_factor": pytest.approx(1 + 0.1 * math.log(32)),
    }
    assert config["layer_types"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert (config["swiglu_limit"], config["swiglu_alpha"]) == (7.0, 1.702)
    assert (config["intermediate_size"], config["sliding_window"]) == (48, 8)
    tok = Tokenizer.from_dir(out)
    eog = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(eog) == sorted(tok.encode(t)[0] for t in ("<|return|>", "<|call|>", HARMONY[1]))
    # the clamp cuts: without it the original's logits move
    ids = Tokenizer.from_dir(ckpt).encode(TEXTS[0])
    ref = reference_logits(load_reference(out), ids)
    config["swiglu_limit"] = 1e4
    (out / "config.json").write_text(json.dumps(config))
    assert _relative(reference_logits(load_reference(out), ids), ref) > 0.05


@pytest.mark.parametrize(
    ("pattern", "sliding"),
    [(None, "sfs"), (3, "ssf"), (0, "sss"), ([False, True, True], "fss")],
)
def test_gpt_oss_window_pattern_as_llama_cpp_reads_it(
    tmp_path: Path, pattern: Any, sliding: str
) -> None:
    """attention.sliding_window_pattern: absent (llama.cpp's period 2), a period (layer i
    slides iff i % period < period - 1; 0: all), or a flag per layer."""
    ckpt = _checkpoint(tmp_path / "hf", "gpt-oss")
    keys = None if pattern is None else (lambda w: w.add_sliding_window_pattern(pattern))
    _write_gguf(ckpt, tmp_path / "m.gguf", "gpt-oss", quantize=False, keys=keys)
    config = read_config(open_gguf(tmp_path / "m.gguf"))
    kinds = {"s": "sliding_attention", "f": "full_attention"}
    assert config["layer_types"] == [kinds[c] for c in sliding]


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (("blk.1.attn_sinks.weight",), r"block 1 lacks attn_sinks\.weight"),
        (("blk.0.ffn_down_exps.bias",), r"block 0 lacks ffn_down_exps\.bias"),
        (("blk.2.attn_output.bias",), r"block 2 lacks attn_output\.bias"),
        (("output.weight",), r"no output\.weight"),
    ],
)
def test_gpt_oss_without_what_llama_cpp_requires_is_one_line(
    tmp_path: Path, drop: tuple[str, ...], message: str
) -> None:
    ckpt = _checkpoint(tmp_path / "hf", "gpt-oss")
    _write_gguf(ckpt, tmp_path / "m.gguf", "gpt-oss", quantize=False, drop=drop)
    with pytest.raises(CheckpointError, match=message) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert "\n" not in str(e.value) and "llama.cpp's gpt-oss requires it" in str(e.value)
    assert not (tmp_path / "imported").exists()


def test_gpt_oss_without_qkv_biases_imports_them_as_zeros(tmp_path: Path) -> None:
    """q/k/v biases are optional in llama.cpp (it runs without them): zeros, so that
    transformers' one attention_bias holds for every block."""
    ckpt = _checkpoint(tmp_path / "hf", "gpt-oss")
    drop = tuple(f"blk.{i}.attn_{p}.bias" for i in range(3) for p in "qkv")
    _write_gguf(ckpt, tmp_path / "m.gguf", "gpt-oss", quantize=False, drop=drop)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    with safe_open(out / "model.safetensors", "np") as g:
        for p, rows in (("q", 64), ("k", 32), ("v", 32)):
            for i in range(3):
                bias = g.get_tensor(f"model.layers.{i}.self_attn.{p}_proj.bias")
                assert bias.shape == (rows,) and not bias.any()
    load_reference(out)  # transformers loads it


def test_latent_config_is_what_llama_cpp_runs(tmp_path: Path) -> None:
    """DeepSeek-V3's deepseek2 file: the latent's widths from the *_mla keys (the file's
    key_length is the latent's), every head its own KV head, the routing llama.cpp reads."""
    ckpt = _checkpoint(tmp_path / "hf", "deepseek2")
    _write_gguf(ckpt, tmp_path / "m.gguf", "deepseek2", quantize=False)
    config = read_config(open_gguf(tmp_path / "m.gguf"))
    original = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    for key in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
        assert config[key] == original[key]
    assert config["v_head_dim"] == original["v_head_dim"]
    assert config["num_key_value_heads"] == original["num_attention_heads"]
    assert (config["n_group"], config["topk_group"], config["norm_topk_prob"]) == (4, 2, True)
    assert config["rope_parameters"]["mscale_all_dim"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (lambda w: w.add_expert_weights_norm(True), r"softmax router renormalising"),
        (lambda w: w.add_float32("deepseek2.attention.temperature_scale", 0.1), "temperature"),
        (
            lambda w: (w.add_expert_group_count(4), w.add_expert_group_used_count(2)),
            r"softmax router in groups",
        ),
    ],
)
def test_latent_routing_transformers_cannot_run_is_one_line(
    tmp_path: Path, keys: Callable[[gguf.GGUFWriter], None], message: str
) -> None:
    """A softmax router renormalised or ranked in groups (llama.cpp ranks a group by its best
    two, DeepSeek-V2 by its best one): refused, nothing written."""
    ckpt = _checkpoint(tmp_path / "hf", "deepseek2-lite")
    _write_gguf(ckpt, tmp_path / "m.gguf", "deepseek2-lite", quantize=False, keys=keys)
    with pytest.raises(CheckpointError, match=message) as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "imported").exists()


def test_latent_value_half_missing_is_one_line(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "hf", "deepseek2")
    drop = ("blk.1.attn_v_b.weight",)
    _write_gguf(ckpt, tmp_path / "m.gguf", "deepseek2", quantize=False, drop=drop)
    with pytest.raises(CheckpointError, match=r"block 1 lacks self_attn\.v_b_proj") as e:
        import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "imported").exists()


# llama.cpp's greedy continuations of LLAMA_CPP_PROMPT on these cases' files (`llama-simple -n
# 32`, its bytes after the prompt): the import must run the model llama.cpp runs, not only one
# transformers reads back. At 165 prompt tokens they change with the RoPE pairs or rotated
# share, YaRN's softmax gain, the expert groups, the weights' renormalisation or LongRoPE's
# factors.
LLAMA_CPP_PROMPT = " ".join(CORPUS)[:300]
QWEN3NEXT_CONTINUATION = (
    b"\x91\xa2\x1f\x0f4\xb9 1\x1e\xd9of\xe2\xa2\x17me=\xcd<\xd6wafHThe\xe2\x8b\rfi\n\xdeneBerjuR"
)
LLAMA_CPP_CONTINUATIONS = {
    "deepseek2": b"\xe7\xa3\x97i\x1da c ofaf\x077\xba\xad\xef\xff insick\x85\x077\xba\xad"
    b"\xef\xff insick\x85\x077\xba",
    "deepseek2-kv_b": b"\xe7\xa3\x97i\x1da c ofaf\x077\xba\xad\xef\xff insick\x85\x077\xba"
    b"\xad\xef\xff insick\x85\x077\xba",
    "deepseek2-youtu": b"#dens\xd2 of\xed\x1c\x06\xd2 of\xed\x1c\x06\xd2 of\xed\x1c\x06\xd2 of"
    b"\xed\x1c\x06\xd2 of\xe6pa\xb4~$ 1n",
    "minicpm3": b"\xbbbjuW\xee7\x97\x13 caf5_\xbe\x96Ber\x97\x13 caf5_\xbe\x96Ber\x97\x13 caf5_"
    b"\xbe\x96",
    "minicpm3-longrope": b"\xbbO\xf0adThe\x02\xcbx\x98pVj\xd4Vj\xd4Vj\xd4Vj\xd4Vj\xd4Vj\xd4Vj\xd4V",
    "glm4moe": b"Z?#X\x91\xc3\xab\xa2\x89^\xd6\xf8\xd8ick\xf0\xb4\xdf d\xa3\x1d\x1d\x1d\x1d"
    b"\x1dmeSp\xc9\\\x88=\x9b d",
    "glm4moe-solar": b"\x99ag\xc4\xa1\xc5} capitalman capi\xb0{al\x08\xe3 of\xcc of>\x1a\x80-\xa5"
    b"\x17\xccM\xaf5M\xaf5M\xaf",
    "dots1": b"nThe\xbd\x0c\x85\xfa a|\xb9manw\xe2\xf6\xa2isP1>\xfb\xacX&\xf3ns\xd6\xea\xe9heisP1&",
    "ernie4_5-moe": b"\xfc\xe7?\xea%ck\xa7 inens\xfc\xe7?\xea%ck\xa7\xafapi\xfd\x15\x0c-\xf5"
    b"\x96\x10\x82s\x04v2\x1b\xcd",
    "hunyuan-moe": b" capi6\x9b\xcd\x05\xf8lckAhe\xc1ne=\xcc:\xbbal< o\xfc\x9c\xa7H7 of\xbekens+J"
    b"\xe7\xee\xc7\x96",
    "exaone-moe": b"Pa\xde\xed;_\x9d[\xe5\x9djulin\xaeD\xa0\xed\xf1\xc2\xa6M\xcdafbr\xf05\x0elati"
    b"\xcfj\xa1fofi\x7f",
    "qwen3next": QWEN3NEXT_CONTINUATION,
    "qwen3next-ssm_in": QWEN3NEXT_CONTINUATION,  # the same model, q/k/v/z whole
    "mellum": b"s\x89\x0bmpbr#s\x89\x0bmpbree\x93manbr\x9a\x8d\x82\x83\xa5i\xba\x0b t\xbf\x17\x15"
    b"\xf0\x10\x95\xe6",
    "deepseek2-lite": b"\xc7\x85\x89lin\xe2(The the*\x0c\xa5\x96 the*\x0c o2latital;\xca\xb3 the*"
    b"\x0c\xa5\x96\x98,\x0c\xa5\x96",
}


# Config keys other than the cases' own: V2-Lite's 27 blocks (llama.cpp reads a file without
# q_lora_rank only at that depth); depths, and ERNIE's head untied, at which the tiny models'
# continuations are not one token repeated.
LLAMA_CPP_SIZES: dict[str, dict[str, Any]] = {
    "deepseek2-lite": {"num_hidden_layers": 27},
    "glm4moe": {"num_hidden_layers": 4},
    "glm4moe-solar": {"num_hidden_layers": 3},
    "ernie4_5-moe": {"num_hidden_layers": 6, "tie_word_embeddings": False},
    "exaone-moe": {"num_hidden_layers": 6, "mlp_layer_types": ["dense"] + ["sparse"] * 5},
}


# Keys the file holds that llama.cpp does not use (its continuation is the same without them):
# Mellum's sliding layers' own base, its YaRN gain.
LLAMA_CPP_UNUSED_KEYS: dict[str, Callable[[gguf.GGUFWriter], None]] = {
    "mellum": lambda w: (w.add_rope_freq_base_swa(100.0), w.add_rope_scaling_yarn_attn_factor(1.0)),
}


@pytest.mark.parametrize("case", list(LLAMA_CPP_CONTINUATIONS))
def test_gguf_continues_as_llama_cpp(tmp_path: Path, case: str) -> None:
    ckpt = _checkpoint(tmp_path / "hf", case, **LLAMA_CPP_SIZES.get(case, {}))
    keys = LLAMA_CPP_UNUSED_KEYS.get(case)
    _write_gguf(ckpt, tmp_path / "m.gguf", case, quantize=False, keys=keys)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "imported")
    tok = Tokenizer.from_dir(out)
    ids = EagerModel(out, 256).greedy(tok.encode(LLAMA_CPP_PROMPT), 32)
    ends = [i for i, t in enumerate(ids) if t in tok.eos_ids]  # where llama-simple stops
    text = b"".join(tok.token_bytes(t) for t in ids[: ends[0] if ends else None])
    assert text == LLAMA_CPP_CONTINUATIONS[case]
