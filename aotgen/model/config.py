"""`ModelConfig`: the few switches the model code reads (its RoPE tables: rope.py), and the
architectures they cover. `ModelConfig.from_hf` maps an HF `config.json` onto them
(hf_config.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from aotgen.model.rope import rope_inv_freq

# gpt-oss: attention sinks, a biased router and biased experts with a clamped SwiGLU.
GPT_OSS = "GptOssForCausalLM"
HUNYUAN = "HunYuanDenseV1ForCausalLM"  # q/k norms after RoPE, its base stretched by `alpha`
HUNYUAN_MOE = "HunYuanMoEV1ForCausalLM"  # its attention; softmax routing, an ungated shared MLP
HUNYUANS = (HUNYUAN, HUNYUAN_MOE)
# Multi-head latent attention (mla.py): keys and values from one cached latent row a position.
# DeepSeek-V2's experts are picked by softmax probability (within the best groups, each
# ranked by its best one, under `group_limited_greedy`); DeepSeek-V3's by its routing below.
DEEPSEEK_V2 = "DeepseekV2ForCausalLM"  # DeepSeek-V2 / V2-Lite / V2.5, DeepSeek-Coder-V2
DEEPSEEK_V3 = "DeepseekV3ForCausalLM"  # DeepSeek-V3 / R1 (Kimi K2's, Moonlight's layout)
GLM4_MOE_LITE = "Glm4MoeLiteForCausalLM"  # GLM-4.7-Flash
YOUTU = "YoutuForCausalLM"  # Youtu-LLM: dense, the latent attention of DeepSeek-V3
MINICPM3 = "MiniCPM3ForCausalLM"  # dense; its RoPE on halves, Granite's three multipliers
LATENT_ATTENTION = (DEEPSEEK_V2, DEEPSEEK_V3, GLM4_MOE_LITE, YOUTU, MINICPM3)
# DeepSeek-V3's mixture of experts (also GLM-4.7-Flash's, and these on standard attention):
# experts picked by sigmoid score plus a per-expert bias within the best groups, an ungated
# shared expert, the first layers dense.
GLM4_MOE = "Glm4MoeForCausalLM"  # GLM-4.5 / 4.6 / 4.7: q/k/v biases, half of each head rotated
DOTS1 = "Dots1ForCausalLM"  # dots.llm1: Qwen3's per-head q/k norms
SOLAR_OPEN = "SolarOpenForCausalLM"  # Solar Open: every layer sparse, q/k/v biased or not
EXAONE_MOE = "ExaoneMoeForCausalLM"  # K-EXAONE: EXAONE 4's attention, the norms before
DEEPSEEK_MOE = (DEEPSEEK_V3, GLM4_MOE_LITE, GLM4_MOE, DOTS1, SOLAR_OPEN, EXAONE_MOE)
# ERNIE 4.5's mixture of experts: softmax routing whose choice a per-expert bias shifts, an
# ungated shared expert, RoPE on adjacent pairs.
ERNIE4_5_MOE = "Ernie4_5_MoeForCausalLM"
MELLUM = "MellumForCausalLM"  # Qwen3-MoE with sliding layers of their own RoPE base
# Mixture-of-experts decoders: the Llama layout with sparse MLPs (moe.py).
MOE_ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
    "FlexOlmoForCausalLM",  # OLMo 2's layers with OLMoE's experts
    "GraniteMoeForCausalLM",
    "GraniteMoeSharedForCausalLM",
    "GraniteMoeHybridForCausalLM",  # Granite 4.0 with attention layers only; dense without experts
    GPT_OSS,
    *DEEPSEEK_MOE,
    ERNIE4_5_MOE,
    HUNYUAN_MOE,
    MELLUM,
    DEEPSEEK_V2,
)
# Granites whose dense MLP (or shared expert) is `shared_mlp`, of shared_intermediate_size.
GRANITE_SHARED_MLP = ("GraniteMoeSharedForCausalLM", "GraniteMoeHybridForCausalLM")
# Granite SWA: Granite with sliding layers, attention sinks and a RoPE base per layer (0: none).
GRANITE_SWA = "GraniteSWAForCausalLM"
GRANITES = ("GraniteForCausalLM", "GraniteMoeForCausalLM", *GRANITE_SHARED_MLP, GRANITE_SWA)
APERTUS = "ApertusForCausalLM"  # q/k norms, an MLP without a gate and its learned xIELU
OLMO = "OlmoForCausalLM"  # OLMo 1: LayerNorms without parameters, q/k/v clipped
VAULTGEMMA = "VaultGemmaForCausalLM"  # Gemma 2 with the norms before attention and the MLP only
LLAMA_LAYOUT = (
    "LlamaForCausalLM",
    "GemmaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "SmolLM3ForCausalLM",
    "GraniteForCausalLM",
    GRANITE_SWA,
    OLMO,
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM",
    "Exaone4ForCausalLM",
    "ArceeForCausalLM",
    "SeedOssForCausalLM",
    "HeliumForCausalLM",
    "MinistralForCausalLM",
    "Ministral3ForCausalLM",
    HUNYUAN,
    APERTUS,
    VAULTGEMMA,
    YOUTU,
    MINICPM3,
    *MOE_ARCHITECTURES,
)
LFM2 = ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM")
# Qwen3.5: gated-delta-rule linear attention beside gated full attention (qwen3_5.py); its
# mixture of experts has Qwen2-MoE's sparse MLPs (a gated shared expert) on every layer.
# Qwen3-Next is Qwen3.5-MoE with q, k, v, z (and b, a) fused per key head in its checkpoint,
# and Qwen2-MoE's dense layers (`mlp_only_layers`, `decoder_sparse_step`).
QWEN3_5_MOE = "Qwen3_5MoeForCausalLM"
QWEN3_NEXT = "Qwen3NextForCausalLM"
# OLMo Hybrid: the same gated-delta-rule layers (q, k, v, a, b and the gate apart in its
# checkpoint, beta doubled) beside OLMo 3's attention layers; plain RMSNorms.
OLMO_HYBRID = "OlmoHybridForCausalLM"
QWEN3_5 = ("Qwen3_5ForCausalLM", QWEN3_5_MOE, QWEN3_NEXT, OLMO_HYBRID)
# LayerNorms, biases, partial rotary (layernorm_decoders.py).
PHI, STABLELM, STARCODER2 = "PhiForCausalLM", "StableLmForCausalLM", "Starcoder2ForCausalLM"
COHERE, COHERE2 = "CohereForCausalLM", "Cohere2ForCausalLM"
NEMOTRON = "NemotronForCausalLM"
LAYERNORM_LAYOUT = (PHI, STABLELM, STARCODER2, COHERE, COHERE2, NEMOTRON)
# q/k norms with a weight of their own per head (no tensor parallelism).
PER_HEAD_QK_NORMS = (STABLELM, COHERE)
SUPPORTED_ARCHITECTURES = (
    *LLAMA_LAYOUT,
    "GPTNeoXForCausalLM",
    *LAYERNORM_LAYOUT,
    *LFM2,
    *QWEN3_5,
)
GEMMAS = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", VAULTGEMMA)
# Gemma 2 and 3 (and VaultGemma): sliding and global layers, softcaps.
LATER_GEMMAS = GEMMAS[1:]
# Checkpoints whose RoPE rotates adjacent pairs of dims (GPT-J's layout): their q/k rows are
# put in rotate-half order at load (llama.py: `rotate_half_rows`).
INTERLEAVED_ROPE = (
    "Glm4ForCausalLM",
    "Ernie4_5ForCausalLM",
    ERNIE4_5_MOE,
    COHERE,
    COHERE2,
    "HeliumForCausalLM",
)
# Configs that carry a sliding_window which `use_sliding_window` (refused when true) turns on.
WINDOW_SWITCHED = (
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "SmolLM3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# hidden_act values → torch; gelu_new is the tanh approximation written out, relu2 relu(x)²,
# xielu Apertus's learned one (layers.py: XIELU; MLPs without a gate only).
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu2", "xielu")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5  # the norms' epsilon (LayerNorm's for GPT-NeoX, Phi, ...)
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    architecture: str = "LlamaForCausalLM"
    hidden_act: str = "silu"
    attention_bias: bool = False  # q/k/v biases (Qwen2); GPT-NeoX: qkv and dense
    attention_out_bias: bool = False  # o_proj's bias (gpt-oss)
    # gpt-oss: one learned logit per head joins each softmax as a key with a zero value
    # (`self_attn.sinks`), so a row can attend to nothing.
    attention_sinks: bool = False
    linear_bias: bool = False  # biases on the output projection and the MLP (Phi, StarCoder2)
    qk_norm: bool = False  # per-head norm of q and k before RoPE (Qwen3, Gemma 3, StableLM)
    qk_norm_after_rope: bool = False  # Hunyuan: the per-head norms on the rotated q and k
    # OLMo 2: q and k normalised across all heads (the whole projection), and each block's
    # norm after it instead of before.
    qk_norm_across_heads: bool = False
    norm_after: bool = False
    # OLMo 1 and OLMoE: q, k and v clamped to +-clip_qkv after their projections (and OLMoE's
    # q/k norms). OLMo 1's norms are LayerNorms without weight or bias (`plain_layer_norms`).
    clip_qkv: float | None = None
    rotary_dim: int | None = None  # partial rotary: the first rotary_dim dims of a head
    use_parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)); Phi: ln1 both
    sliding_window: int | None = None  # keys within this many positions, on sliding layers
    layer_types: tuple[str, ...] | None = None  # "sliding_attention" / "full_attention"
    rope_local_theta: float | None = None  # the sliding layers' RoPE base (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma 3)
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # tanh cap on attention scores (Gemma 2)
    rope_layers: tuple[bool, ...] | None = None  # per layer, whether it rotates (SmolLM3's NoPE)
    # Ministral 3 (Llama 4's attention temperature): q at position p is scaled by
    # 1 + query_gain_beta * ln(1 + floor(p / query_gain_period)), so 1 within the first period.
    query_gain_beta: float = 0.0
    query_gain_period: int = 0
    # LongRoPE (Phi-3.5, Phi-4-mini): the long factors, for a package longer than the original
    # context (`for_context`), else the short ones.
    long_context: bool = False
    # Granite's scalars: embeddings x, each block's output x (before the residual add),
    # the attention scale (instead of head_dim ** -0.5), logits / .
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture of experts: each token through the `num_experts_per_tok` of `num_experts` SwiGLU
    # experts (of `moe_intermediate_size`) its router picks, on the layers `moe_layers` marks
    # (the others have the dense MLP); Qwen2-MoE's gated shared expert.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    router_bias: bool = False  # the router's logits biased (gpt-oss)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = False  # Qwen2-MoE scales it by a sigmoid gate, Granite does not
    moe_layers: tuple[bool, ...] = ()
    # gpt-oss's experts: biases on both projections (`experts.gate_up_proj_bias [E, 2f]`,
    # gate then up, `experts.down_proj_bias [E, d]`), and with `swiglu_limit` > 0 the
    # clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = gate clamped above at the limit,
    # up to +-limit; 0 is the plain SwiGLU silu(gate) * up.
    expert_biases: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    # LFM2-MoE and DeepSeek-V3's routing: experts picked by sigmoid score plus a per-expert
    # bias, weighted by the score (renormalised, then x routed_scaling_factor); DeepSeek-V3's
    # picks only within the `router_top_groups` of `router_groups` groups of experts whose
    # two best scores sum highest. ERNIE 4.5: softmax probabilities plus the bias pick, the
    # probabilities renormalised by their sum, at least `router_norm_min`, weigh.
    router_sigmoid: bool = False
    expert_bias: bool = False
    router_norm_min: float = 0.0
    routed_scaling_factor: float = 1.0
    router_groups: int = 1
    router_top_groups: int = 1
    router_group_rank: int = 2  # a group ranked by its best this many (DeepSeek-V2: 1)
    # LFM2: layers whose `layer_types` entry is "conv" mix the last `conv_kernel` positions
    # with a gated depthwise convolution instead of attending.
    conv_kernel: int = 0
    conv_bias: bool = False
    # Qwen3.5: layers whose `layer_types` entry is "linear_attention" run the gated delta rule
    # (kernels/gated_delta.py) over `linear_value_heads` heads of a recurrent state, their q, k
    # and v through a depthwise convolution of `linear_conv_kernel` positions first; the others
    # attend, their output gated by a sigmoid of q_proj's second half.
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0
    linear_beta_scale: float = 1.0  # OLMo Hybrid: 2, so that the state's eigenvalues can be < 0
    linear_norm_eps: float = 1e-6  # the eps of the gated norm of the rule's output
    attention_output_gate: bool = False
    # Multi-head latent attention (DeepSeek-V2 / V3, mla.py): q through a `q_lora_rank`
    # bottleneck (0: none), keys and values from one latent row of `kv_lora_rank` a position
    # (expanded by `kv_b_proj`: `qk_nope_head_dim` key and `v_head_dim` value dims a head) and
    # a key of `rotary_dim` dims shared by the heads. The cache keeps the latent and the shared
    # key: `head_dim` wide, one "KV head", and no values.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek's RoPE on adjacent pairs of the rotated dims (`rope_interleave`): their rows are
    # put in rotate-half order at load (mla.py).
    interleaved_rope: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    @property
    def gemma(self) -> bool:
        """Gemma's switches: (1 + w) RMSNorm, embeddings × √hidden."""
        return self.architecture in GEMMAS

    @property
    def unit_offset_norms(self) -> bool:
        """Qwen3.5's RMSNorms scale by (1 + w); OLMo Hybrid's by w."""
        return self.architecture in QWEN3_5 and self.architecture != OLMO_HYBRID

    @property
    def plain_layer_norms(self) -> bool:
        """OLMo 1: every norm a LayerNorm without weight or bias."""
        return self.architecture == OLMO

    @property
    def four_norms(self) -> bool:
        """A norm after attention and on both sides of the MLP (Gemma 2 and 3, GLM-4)."""
        return self.architecture in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "Glm4ForCausalLM")

    @property
    def latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.is_sliding(i) for i in range(self.num_hidden_layers))

    def is_conv(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "conv"

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent state (a ring of cells, not every position)."""
        return self.linear_conv_kernel > 0

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Map an HF `config.json` dict; refuse what this model cannot represent."""
        from aotgen.model.hf_config import hf_fields  # it reads this module's lists

        cfg = cls(**hf_fields(hf))
        rope_inv_freq(cfg)  # an unknown rope_scaling type fails here, before any compile
        return cfg
