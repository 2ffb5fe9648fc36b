"""Tiny random-weight checkpoints of every supported family, written by `transformers`
itself (its config class, `save_pretrained`), so the files are what a user downloads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tiny import make_tokenizer

# name → (transformers config class, its arguments); the tokenizer sets the vocabulary.
BASE = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=512
)
MOE = dict(num_experts=8, num_local_experts=8, num_experts_per_tok=2)
MULTIPLIERS = dict(
    embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=2.0
)
GRANITE4 = dict(
    num_hidden_layers=2,
    num_key_value_heads=2,
    shared_intermediate_size=96,
    layer_types=["attention"] * 2,
    mamba_n_heads=4,
    mamba_d_head=32,
)
FAMILIES_QWEN3_5 = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=32,
    layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
)
# Latent attention (DeepSeek-V2 / V3): a 32-dim latent and a 16-dim shared rotated key (the
# cache's 48-dim rows), heads of 16 unrotated key dims and 24 value dims, q through a rank-24
# bottleneck.
LATENT = dict(
    num_key_value_heads=4,
    q_lora_rank=24,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=24,
)
LATENT_MOE = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1)
# Hunyuan's "dynamic" RoPE with a fixed alpha: a static base, stretched.
HUNYUAN_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "alpha": 50.0, "factor": 1.0}
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, num_key_value_heads=2)),
    "qwen2-tied": (
        "Qwen2Config",
        dict(num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True),
    ),
    # head_dim 32 with hidden 64 and 4 heads: explicit, not hidden / heads.
    "qwen3": ("Qwen3Config", dict(num_hidden_layers=3, num_key_value_heads=2, head_dim=32)),
    "qwen3-draft": (
        "Qwen3Config",
        dict(num_hidden_layers=1, num_key_value_heads=1, head_dim=16, hidden_size=32),
    ),
    # Window 8 on layers 0-2, global layer 3 with linear RoPE scaling; softcapped logits.
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
            },
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 2: sliding (window 8) and global layers in turn, attention scores softcapped at 5
    # (so that the cap changes them), softcapped logits, a tied head.
    "gemma2": (
        "Gemma2Config",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
        ),
    ),
    # VaultGemma: Gemma 2's layers with the norms before attention and the MLP only.
    "vaultgemma": (
        "VaultGemmaConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
        ),
    ),
    # Pythia: rotary on a quarter of each head, parallel residual, untied embed_out.
    "gptneox-parallel": (
        "GPTNeoXConfig",
        dict(num_hidden_layers=2, rotary_pct=0.25, use_parallel_residual=True),
    ),
    "gptneox-sequential": (
        "GPTNeoXConfig",
        dict(num_hidden_layers=3, rotary_pct=0.5, use_parallel_residual=False),
    ),
    # Phi-4-mini's shape: fused qkv / gate-up tensors, RoPE on half of each head (3/4 there),
    # a tied head; a window of 8 as Phi-3-mini's 2047.
    "phi3": (
        "Phi3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=8,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Phi-3.5-mini / Phi-4-mini's LongRoPE, with an original context of 16 positions.
    "phi3-longrope": (
        "Phi3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            original_max_position_embeddings=16,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.3, 2.0, 3.5],
                "long_factor": [1.5, 4.0, 9.0, 20.0],
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # YaRN (Qwen2.5 / Qwen3 past 32k), factor 4 over an original context of 16.
    "qwen3-yarn": (
        "Qwen3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=32,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    # OLMo 2: q/k norms across heads, norms after attention and the MLP.
    "olmo2": ("Olmo2Config", dict(num_hidden_layers=2, num_key_value_heads=2)),
    # Mixtures of experts: 8 experts, 2 a token; Qwen3-MoE with a dense MLP on layer 1.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            **MOE,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, num_key_value_heads=2, **MOE)),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            **MOE,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            decoder_sparse_step=2,
        ),
    ),
    "olmoe": ("OlmoeConfig", dict(num_hidden_layers=2, num_key_value_heads=2, **MOE)),
    # Granite SWA: Granite's multipliers, a sink logit per head; layer 0 full without RoPE,
    # layers 1-3 sliding (window 8) at base 100, layer 4 full at base 10000.
    "granite-swa": (
        "GraniteSWAConfig",
        dict(
            num_hidden_layers=5,
            num_key_value_heads=2,
            sliding_window=8,
            layer_types=["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
            layer_rope_theta=[0, 100.0, 100.0, 100.0, 10000.0],
            **MULTIPLIERS,
        ),
    ),
    # OLMo 1: LayerNorms without weight or bias, q/k/v clamped to +-0.5.
    "olmo": ("OlmoConfig", dict(num_hidden_layers=2, num_key_value_heads=2, clip_qkv=0.5)),
    # OLMoE with q/k/v clamped after its q/k norms.
    "olmoe-clip": (
        "OlmoeConfig",
        dict(num_hidden_layers=2, num_key_value_heads=2, clip_qkv=0.5, **MOE),
    ),
    # FlexOlmo: OLMo 2's norms (after each block, q/k across heads) with OLMoE's experts.
    "flex-olmo": ("FlexOlmoConfig", dict(num_hidden_layers=2, num_key_value_heads=2, **MOE)),
    # gpt-oss: sinks, a window of 8 on layers 0 and 2, YaRN on every layer, biased router and
    # experts; the clamp at 1.0 (7.0 in the released models) cuts these small activations.
    "gpt-oss": (
        "GptOssConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=48,
            sliding_window=8,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 128,
            },
            **MOE,
        ),
    ),
    # MXFP4's blocks of 32 inputs: hidden and intermediate sizes a multiple of 32.
    "gpt-oss-mxfp4": (
        "GptOssConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=64,
            sliding_window=8,
            **MOE,
        ),
    ),
    # Granite MoE: its experts stored stacked, its multipliers.
    "granite-moe": (
        "GraniteMoeConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            **MOE,
            **MULTIPLIERS,
        ),
    ),
    # Granite 4.0 with attention layers only: dense (its MLP `shared_mlp`, gate and up fused),
    # and with experts beside an ungated shared MLP and no positions at all.
    "granite4": (
        "GraniteMoeHybridConfig",
        dict(GRANITE4, num_local_experts=0, position_embedding_type="rope", **MULTIPLIERS),
    ),
    "granite4-moe": (
        "GraniteMoeHybridConfig",
        dict(GRANITE4, **MOE, position_embedding_type=None, **MULTIPLIERS),
    ),
    # OLMo 3: OLMo 2 with a window of 8 on three layers in four; YaRN on the global ones.
    "olmo3": (
        "Olmo3Config",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            sliding_window=8,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            },
        ),
    ),
    # GLM-4: four norms a layer, q/k/v biases, half of each head rotated by adjacent pairs.
    "glm4": (
        "Glm4Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # ERNIE 4.5: the Llama layout, whole heads rotated by adjacent pairs, a tied head.
    "ernie4_5": (
        "Ernie4_5Config",
        dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    ),
    # Phi: one LayerNorm feeding attention and the MLP side by side, biases on every linear
    # and the head, half of each head rotated.
    "phi": (
        "PhiConfig",
        dict(
            num_hidden_layers=2,
            hidden_act="gelu_new",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Phi with its q/k LayerNorms (one over every head's dims).
    "phi-qk": (
        "PhiConfig",
        dict(
            num_hidden_layers=2,
            qk_layernorm=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.4,
            },
        ),
    ),
    # StableLM: the parallel residual with one LayerNorm, q/k/v biases, a LayerNorm per head
    # on q and k, a quarter of each head rotated, grouped KV heads.
    "stablelm": (
        "StableLmConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            use_qkv_bias=True,
            qk_layernorm=True,
            use_parallel_residual=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
    ),
    # StarCoder2: biases everywhere, a plain GELU MLP, a window of 8 on every layer, tied head.
    "starcoder2": (
        "Starcoder2Config",
        dict(num_hidden_layers=2, num_key_value_heads=2, sliding_window=8),
    ),
    # Cohere: one bias-free LayerNorm feeding attention and the MLP side by side, adjacent
    # pairs rotated, a LayerNorm weight per head on q and k, q/k/v/o biases, logits x 0.25.
    "cohere": (
        "CohereConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            use_qk_norm=True,
            attention_bias=True,
            logit_scale=0.25,
        ),
    ),
    # Cohere2: three sliding-window layers (8) in four, only they rotated.
    "cohere2": (
        "Cohere2Config",
        dict(num_hidden_layers=4, num_key_value_heads=2, sliding_window=8, logit_scale=0.5),
    ),
    # EXAONE 4: norms after attention and the MLP, q/k norms per head, three sliding-window
    # layers (8) in four and only they rotated.
    "exaone4": (
        "Exaone4Config",
        dict(
            num_hidden_layers=4, num_key_value_heads=2, sliding_window=8, sliding_window_pattern=4
        ),
    ),
    # EXAONE 4 without a window (the 1.2B's kind): every layer global and rotated, a tied head.
    "exaone4-global": (
        "Exaone4Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            sliding_window=None,
            layer_types=["full_attention"] * 2,
            tie_word_embeddings=True,
        ),
    ),
    # Nemotron: LayerNorms stored minus one, relu² MLP without a gate, half of each head
    # rotated.
    "nemotron": (
        "NemotronConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
    ),
    # Arcee (AFM): the Llama layout with a relu² MLP without a gate.
    "arcee": ("ArceeConfig", dict(num_hidden_layers=2, num_key_value_heads=2)),
    # Seed-OSS: q/k/v biases and an o_proj bias.
    "seed-oss": (
        "SeedOssConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            attention_out_bias=True,
        ),
    ),
    # Helium: RoPE on adjacent pairs, q/k/v biases.
    "helium": (
        "HeliumConfig",
        dict(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, attention_bias=True),
    ),
    # Ministral: sliding-window (8) and full layers in turn.
    "ministral": (
        "MinistralConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    # Hunyuan dense: q/k norms after RoPE, whose base "dynamic" alpha stretches; a tied head.
    "hunyuan": (
        "HunYuanDenseV1Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters=HUNYUAN_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    # Hunyuan MoE: Hunyuan's attention (q/k norms after RoPE, alpha-stretched base); 8 experts
    # of intermediate_size, 2 a token, and an ungated shared MLP on every layer.
    "hunyuan-moe": (
        "HunYuanMoEV1Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_experts=8,
            moe_topk=2,
            rope_parameters=HUNYUAN_ROPE,
        ),
    ),
    # Apertus: per-head q/k norms, up-xIELU-down (its learned parameters), Llama 3's RoPE.
    "apertus": (
        "ApertusConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    ),
    # Ministral 3: YaRN, and q scaled up with the position past every 8 (the original context
    # here), so that the history crosses four such periods.
    "ministral3": (
        "Ministral3Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 1e6,
                "factor": 4.0,
                "original_max_position_embeddings": 8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.5,
            },
        ),
    ),
    # Gemma (1): (1 + w) norms, two a layer, embeddings x sqrt(hidden), one KV head.
    "gemma": ("GemmaConfig", dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=32)),
    # Layers 1 and 3 without RoPE (NoPE), a tied head.
    "smollm3": (
        "SmolLM3Config",
        dict(num_hidden_layers=4, num_key_value_heads=2, no_rope_layer_interval=2),
    ),
    # Granite's multipliers, away from 1 so that a missing one changes the logits.
    "granite": (
        "GraniteConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=2.5,
        ),
    ),
    # LFM2: gated short convolutions (kernel 3) on layers 0, 2 and 3, attention on layer 1;
    # the MLP width derived from intermediate_size as LFM2 does (2/3, rounded up to 32).
    "lfm2": (
        "Lfm2Config",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv", "conv"],
            block_multiple_of=32,
        ),
    ),
    # LFM2-MoE: layer 0 dense, then 8 experts, 2 a token, picked by sigmoid score + bias.
    "lfm2-moe": (
        "Lfm2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            layer_types=["conv", "full_attention", "conv"],
            num_dense_layers=1,
            moe_intermediate_size=48,
            routed_scaling_factor=1.5,
            **MOE,
        ),
    ),
    # Qwen3.5: linear attention (the gated delta rule; 2 key heads, 4 value heads, kernel 4)
    # on layers 0, 1 and 3, gated full attention rotating a quarter of each head on layer 2.
    "qwen3_5": ("Qwen3_5TextConfig", FAMILIES_QWEN3_5),
    # Qwen3.5-MoE: the same layers with 8 experts (2 a token) and a gated shared expert.
    "qwen3_5-moe": (
        "Qwen3_5MoeTextConfig",
        dict(
            FAMILIES_QWEN3_5,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
        ),
    ),
    # Qwen3-Next: Qwen3.5-MoE's layers, q/k/v/z and b/a fused per key head in the checkpoint,
    # layer 1's MLP dense (`mlp_only_layers`).
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            FAMILIES_QWEN3_5,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
        ),
    ),
    # GLM-4.5: DeepSeek-V3's routing (8 experts in 2 groups, the best group kept, 2 experts a
    # token, sigmoid + bias, x 2.5) and a shared expert after a dense layer 0; q/k/v biased,
    # half of each head rotated.
    "glm4-moe": (
        "Glm4MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            head_dim=32,
            attention_bias=True,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=1,
        ),
    ),
    # dots.llm1: the same routing in one group, two shared experts, Qwen3's q/k norms.
    "dots1": (
        "Dots1Config",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            norm_topk_prob=True,
        ),
    ),
    # Solar Open: the same routing on every layer (8 experts in 4 groups, 2 kept, 3 experts a
    # token), q/k/v biased, the whole head rotated.
    "solar-open": (
        "SolarOpenConfig",
        dict(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.0,
        ),
    ),
    # K-EXAONE: EXAONE 4's windowed layers (window 8, three in four, only they rotated) with
    # the norms before each block; DeepSeek-V3's routing after a dense layer 0, and a dense
    # layer 2 by `mlp_layer_types`.
    "exaone-moe": (
        "ExaoneMoeConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            sliding_window=8,
            sliding_window_pattern=4,
            mlp_layer_types=["dense", "sparse", "dense", "sparse"],
            moe_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            num_shared_experts=1,
            routed_scaling_factor=2.5,
        ),
    ),
    # Mellum: Qwen3-MoE's layers, sliding (window 8) on layers 0 and 2 with their own RoPE base,
    # layer 1's MLP dense (`mlp_layer_types`).
    "mellum": (
        "MellumConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            mlp_layer_types=["sparse", "dense", "sparse", "sparse"],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            },
            moe_intermediate_size=32,
            **MOE,
        ),
    ),
    # ERNIE 4.5 MoE: layer 0 dense, then 8 experts (2 a token) picked by softmax + bias, two
    # shared experts; RoPE on adjacent pairs, a tied head.
    "ernie4_5-moe": (
        "Ernie4_5_MoeConfig",
        dict(
            num_hidden_layers=3,
            num_key_value_heads=2,
            moe_intermediate_size=32,
            moe_num_experts=8,
            moe_k=2,
            moe_num_shared_experts=2,
            moe_layer_start_index=1,
        ),
    ),
    # OLMo Hybrid: Qwen3.5's linear-attention layers (as many value heads as key heads, beta
    # doubled, projections apart in the checkpoint) beside OLMo 3's attention on layer 2.
    "olmo-hybrid": (
        "OlmoHybridConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            layer_types=["linear_attention"] * 2 + ["full_attention", "linear_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=32,
        ),
    ),
    # DeepSeek-V2-Lite: q without a bottleneck, layer 0 dense, 8 experts (2 a token) picked
    # by softmax probability, weighted by it x 1.5 (not renormalised), two shared experts.
    "deepseek-v2-lite": (
        "DeepseekV2Config",
        dict(
            LATENT,
            num_hidden_layers=3,
            q_lora_rank=None,
            first_k_dense_replace=1,
            num_experts_per_tok=2,
            routed_scaling_factor=1.5,
            **{**LATENT_MOE, "n_shared_experts": 2},
        ),
    ),
    # DeepSeek-V2: q/kv down-projections and o biased, experts within the 2 of 4 groups whose
    # best probability is highest (group_limited_greedy), 3 a token.
    "deepseek-v2": (
        "DeepseekV2Config",
        dict(
            LATENT,
            num_hidden_layers=2,
            attention_bias=True,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            **LATENT_MOE,
        ),
    ),
    # DeepSeek-V3: YaRN (x4; mscale_all_dim scales the softmax too), its routing in 4 groups
    # (2 kept), layer 0 dense; its multi-token-prediction layer after the last, not run.
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            LATENT,
            num_hidden_layers=3,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=2,
            routed_scaling_factor=2.5,
            **LATENT_MOE,
        ),
    ),
    # GLM-4.7-Flash: DeepSeek-V3's attention and routing in one group, layer 0 dense.
    "glm4-moe-lite": (
        "Glm4MoeLiteConfig",
        dict(LATENT, num_hidden_layers=3, num_experts_per_tok=2, **LATENT_MOE),
    ),
    # Youtu-LLM: dense, the latent attention; its RoPE here on halves, not adjacent pairs.
    "youtu": ("YoutuConfig", dict(LATENT, num_hidden_layers=2, rope_interleave=False)),
    # MiniCPM3: dense latent attention (RoPE on halves), embeddings x 3, each block's output
    # x 1.4 / sqrt(2), the logits / (64 / 32).
    "minicpm3": (
        "MiniCPM3Config",
        dict(LATENT, num_hidden_layers=2, scale_emb=3.0, scale_depth=1.4, dim_model_base=32),
    ),
    "gptneox-draft": (
        "GPTNeoXConfig",
        dict(
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            rotary_pct=0.5,
            use_parallel_residual=False,
        ),
    ),
}


def make_family_checkpoint(out: Path, family: str, seed: int = 0) -> Path:
    """Save a random `family` model with the shared test tokenizer into `out`."""
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(
        **{**BASE, **kwargs},
        vocab_size=tok.get_vocab_size(),
        bos_token_id=tok.token_to_id("<|im_start|>"),
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, gemma=cls_name.startswith(("Gemma", "VaultGemma")))
    if family == "youtu":  # its padding token's embedding is zero, as transformers loads it
        with torch.no_grad():
            model.model.embed_tokens.weight[config.pad_token_id] = 0
    model.save_pretrained(out)
    if family in ("glm4-moe", "deepseek-v3"):  # a multi-token-prediction layer after the last
        _add_tensors(out, {f"model.layers.{config.num_hidden_layers}.eh_proj.weight": (64, 128)})
    if family == "ernie4_5-moe":  # its multi-token-prediction modules, not run
        _add_tensors(out, {"model.mtp_linear_proj.0.weight": (64, 128)})
    assert json.loads((out / "config.json").read_text())["architectures"]
    return out


def _add_tensors(out: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Random tensors of `shapes` added to the checkpoint's one safetensors file."""
    from safetensors.torch import load_file, save_file

    path = out / "model.safetensors"
    tensors = load_file(path) | {name: torch.randn(shape) for name, shape in shapes.items()}
    save_file(tensors, path, metadata={"format": "pt"})


@torch.no_grad()
def randomize(model: torch.nn.Module, gemma: bool, std: float = 0.08) -> None:
    """Weights large enough that greedy choices are not near-ties, norms and biases away
    from their identity init so that a misplaced one changes the logits."""
    for name, p in model.named_parameters():
        if "norm" in name:  # RMSNorm / LayerNorm weights and biases
            base = 0.0 if gemma or name.endswith(".bias") else 1.0
            p.copy_(base + torch.randn_like(p) * 0.1)
        elif "embed" in name and p.dim() == 2:
            p.normal_(0, std * (1.5 if gemma else 10))
        elif name.endswith("lm_head.weight"):
            p.normal_(0, std * 4)
        elif name.endswith("e_score_correction_bias"):  # ERNIE 4.5's: on probabilities
            p.normal_(0, 0.1)
        elif name.endswith(".sinks"):  # gpt-oss: as large as the scores, so that they matter
            p.normal_(0, 1.0)
        else:
            p.normal_(0, std)
    for name, b in model.named_buffers():
        # LFM2-MoE's, DeepSeek-V3's: large enough to change which are picked
        if name.endswith(("expert_bias", "e_score_correction_bias")):
            b.normal_(0, 0.5)
        elif name.endswith("act_fn.beta"):  # Apertus's xIELU: away from its 0.5 init
            b.normal_(0.5, 0.2)


def load_reference(path: Path) -> torch.nn.Module:
    """The checkpoint in transformers' eager implementation, fp32."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@torch.no_grad()
def reference_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """Logits `[T, V]` of one full-sequence forward (no cache)."""
    return model(torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def reference_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    """n argmax tokens, each from a full forward (no cache, no eos handling)."""
    ids = list(ids)
    out = []
    for _ in range(n):
        out.append(int(reference_logits(model, ids)[-1].argmax()))
        ids.append(out[-1])
    return out


# ---- the packages test_families.py builds ---------------------------------------------------
# The background builder (tests/real_builds.py) compiles the same recipes into the session's
# compile cache while the first tests run, so test_families.py's builds find their graphs there.
# max_seq_len 96: room for a 40-token history and 32 greedy tokens after the prompt.
RECIPE = {"max_seq_len": 96, "prefill_chunk": 16, "verify_k": 4}
PARITY = [
    "llama",
    "qwen2-tied",
    "qwen3",
    "gemma2",
    "gemma3",
    "phi3",
    "gptneox-parallel",
    "gptneox-sequential",
    "gpt-oss",
    "lfm2",
    "phi",
    "deepseek-v3",
]
# Families whose differences from the Llama layout are switches outside the compiled graphs'
# concerns (NoPE layers, scalar multipliers, RoPE tables, norms in other places, the MoE
# families' routing next to gpt-oss's compiled one): checked on the eager model, no package
# built.
EAGER_PARITY = [
    "smollm3", "granite", "qwen3-yarn", "olmo2", "olmo3", "mixtral", "qwen2-moe", "olmoe",
    "granite-moe", "granite4", "granite4-moe", "lfm2-moe", "glm4", "ernie4_5", "phi-qk",
    "stablelm", "starcoder2", "gemma", "cohere", "cohere2", "exaone4", "exaone4-global",
    "nemotron", "arcee", "qwen3-moe", "seed-oss", "helium", "ministral", "ministral3",
    "hunyuan", "apertus", "qwen3_5", "qwen3_5-moe", "qwen3-next", "glm4-moe", "dots1",
    "solar-open", "exaone-moe", "ernie4_5-moe", "vaultgemma",
    "flex-olmo", "hunyuan-moe", "mellum", "olmo", "olmoe-clip", "olmo-hybrid",
    "granite-swa", "deepseek-v2-lite", "deepseek-v2", "deepseek-v3", "glm4-moe-lite", "youtu",
    "minicpm3",
]  # fmt: skip
# Speculative packages: target + a separate, smaller draft checkpoint of the same family.
SPEC_PAIRS = {"gptneox-sequential": "gptneox-draft", "qwen3": "qwen3-draft"}
INT8 = {"quantize": {"linear": "int8"}}
# The biased ones, a mixture of experts (its experts int8, its routers float), LFM2 (its
# convolutions float, their projections int8) and latent attention (kv_b_proj int8 rows).
INT8_FAMILIES = ["qwen2-tied", "gptneox-parallel", "gpt-oss", "lfm2", "phi", "deepseek-v3"]
# Gemma 3's tree and batched graphs (its window shorter than their rows' histories), and a
# draft of its first two layers on its cache: every kind of call on a ring cache (and on
# DeepSeek-V3's latent cache).
WINDOWED = {"max_batch": 2, "tree_nodes": 4, "speculative": {"draft": {"layers": 2}, "k": 4}}
# (family, extra recipe keys) of every package, in the order the tests first ask for them.
PACKAGES: list[tuple[str, dict[str, Any]]] = [
    *((family, {}) for family in PARITY),
    *((family, INT8) for family in INT8_FAMILIES),
    ("gemma3", WINDOWED),
    ("deepseek-v3", WINDOWED),  # the latent cache through trees, batches and drafts
]


def family_checkpoints(root: Path) -> dict[str, Path]:
    """Every checkpoint the packages are built from (the same files on every call)."""
    names = [*PARITY, *SPEC_PAIRS.values(), *EAGER_PARITY]
    return {n: make_family_checkpoint(root / n, n, seed=i) for i, n in enumerate(names)}


def family_recipe(
    family: str, checkpoints: dict[str, Path], formats: list[str], extra: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """(package name, recipe data) of one package; the speculative pairs' plain package
    carries its draft."""
    key = f"{family}-{'-'.join(sorted(extra))}" if extra else family
    if family in SPEC_PAIRS and not extra:
        draft = {"checkpoint": str(checkpoints[SPEC_PAIRS[family]])}
        extra = {"speculative": {"draft": draft, "k": 4}}
    data = {"checkpoint": str(checkpoints[family]), **RECIPE, "formats": formats, **extra}
    return f"fam-{key}", data
