"""The Llama-layout decoders: Llama, Mistral, Qwen2, Qwen3, Gemma (1, 2, 3 text), Phi-3,
SmolLM3, Granite, OLMo 2, GLM-4, ERNIE 4.5, EXAONE 4, Arcee, Seed-OSS, Helium, Ministral,
Ministral 3, Hunyuan and the mixtures of experts (gpt-oss among them), driven by an HF config
through a few switches (`ModelConfig`); GPT-NeoX lives in gptneox.py, the LayerNorm decoders
(Phi, StableLM, StarCoder2, Cohere, Nemotron) in layernorm_decoders.py.

One flat file in the spirit of gpt-fast. Module names follow the HF checkpoint
(`model.layers.0.self_attn.q_proj`, ...) so weights load without a name map and
quantization/TP plans can match HF parameter names. The switches:

- `attention_bias`: q/k/v biases (Qwen2).
- `qk_norm`: per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
- `cfg.gemma`: (1 + w) RMSNorms, embeddings × √hidden; Gemma 2 and 3 add a norm after
  attention and around the MLP (four a layer) and scale attention by
  `query_pre_attn_scalar`; Gemma 2's `attn_logit_softcapping` caps the attention scores.
- `layer_types` / `sliding_window`: local layers attend to the last `sliding_window`
  positions with their own RoPE base (`rope_local_theta`); see layers.py for the cache.
- `rotary_dim`: RoPE on the first dims of a head (Phi-4-mini); `rope_layers`: the layers
  that rotate at all (SmolLM3 leaves every fourth without).
- Granite's multipliers on the embeddings, each block's output and the attention scale, and
  its logits divisor; Granite 4's fused `shared_mlp` is split at load (`split_fused`).
- OLMo 2: q/k norms across all heads, and the norms after attention and the MLP, not before;
  EXAONE 4 the same norms with q/k norms per head.
- Phi-3's fused `qkv_proj` / `gate_up_proj` checkpoint tensors (GLM-4's `gate_up_proj`)
  are split at load into the layout above (`split_fused`).
- GLM-4: Gemma's four norms a layer, plain RMSNorms (`cfg.four_norms`), q/k/v biases, half
  of each head rotated.
- GLM-4 and ERNIE 4.5 rotate adjacent pairs of dims: their q/k rows are reordered at load
  (`rotate_half_rows`), so the model's one RoPE serves them.
- Arcee: the MLP without a gate (`up_proj`, relu², `down_proj`).
- Seed-OSS: q/k/v biases and, by its own switch, an o_proj bias; Helium: adjacent-pair RoPE
  (reordered at load, as GLM-4's); Ministral: sliding and full layers by `layer_types`.
- Apertus: the MLP without a gate, its xIELU activation with parameters of its own
  (layers.py), per-head q/k norms.
- Hunyuan (dense): per-head q/k norms on the rotated q and k (`qk_norm_after_rope`), its
  RoPE base stretched by `alpha` (hf_config.py).
- Ministral 3: q grows with the position (`query_gain`): its RoPE rows, scaled, travel beside
  k's in the tables (layers.py), so no layer reads positions.
- Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE, gpt-oss): a sparse
  MLP (moe.py) on the layers `moe_layers` marks.
- gpt-oss: q/k/v/o biases, a learned sink logit per head in each attention softmax
  (`attention_sinks`, layers.py), sliding and full layers alternating.

The forward contract and the runtime-owned KV cache are described in layers.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aotgen.kernels.cache_rows import row_width
from aotgen.model.config import (
    APERTUS,
    DEEPSEEK_V3,
    GLM4_MOE,
    GLM4_MOE_LITE,
    GRANITE_SHARED_MLP,
    HUNYUANS,
    INTERLEAVED_ROPE,
    LAYERNORM_LAYOUT,
    LFM2,
    OLMO_HYBRID,
    QWEN3_5,
    QWEN3_NEXT,
    SUPPORTED_ARCHITECTURES,
    VAULTGEMMA,
    ModelConfig,
)
from aotgen.model.layernorm_decoders import LayerNormDecoder, stack_head_norms
from aotgen.model.layers import (
    CausalLM,
    GatedMLP,
    RMSNorm,
    UpDownMLP,
    apply_rope,
    block_norm,
    cached_attention,
    softcap,
)
from aotgen.model.mla import LatentAttention
from aotgen.model.mla import rotate_half_rows as rotate_latent_rows
from aotgen.model.moe import SparseMoE, stack_experts
from aotgen.model.rope import rope_inv_freq, rope_tables

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "Transformer",
    "load_model",
    "new_kv_cache",
    "rope_inv_freq",
    "rope_tables",
]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotates: bool = True):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_multiplier or (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.rotates = rotates
        self.query_gain = bool(cfg.query_gain_beta)  # q's RoPE rows follow k's (layers.py)
        self.cap = cfg.attn_logit_softcapping
        d, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=cfg.attention_out_bias)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(heads))
        self.qk_norm, self.across_heads = cfg.qk_norm, cfg.qk_norm_across_heads
        self.after_rope = cfg.qk_norm_after_rope
        self.clip = cfg.clip_qkv
        if cfg.qk_norm:
            q_dim, k_dim = (heads, kv_heads) if self.across_heads else (1, 1)
            self.q_norm = RMSNorm(q_dim * self.head_dim, cfg.rms_norm_eps, cfg.gemma)
            self.k_norm = RMSNorm(k_dim * self.head_dim, cfg.rms_norm_eps, cfg.gemma)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        # Heads are sized from the weights, not the config, so a tensor-parallel shard
        # (fewer heads per rank) runs through the same code.
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.across_heads:  # OLMo 2: over the whole projection
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip is not None:  # OLMo 1, OLMoE
            q, k, v = (proj.clamp(-self.clip, self.clip) for proj in (q, k, v))
        q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, t, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm and not self.across_heads and not self.after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotates and self.query_gain:
            (cos, cos_q), (sin, sin_q) = cos.chunk(2, -1), sin.chunk(2, -1)
            q, k = apply_rope(q, cos_q, sin_q), apply_rope(k, cos, sin)
        elif self.rotates:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.after_rope:  # Hunyuan
            q, k = self.q_norm(q), self.k_norm(k)
        sinks = getattr(self, "sinks", None)
        y = cached_attention(
            q, k, v, write_at, mask, k_cache, v_cache, span, self.scale, self.cap, sinks
        )
        return self.o_proj(y)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d = cfg.hidden_size
        if cfg.latent_attention:  # DeepSeek-V2 / V3 (mla.py)
            self.self_attn: nn.Module = LatentAttention(cfg)
        else:
            self.self_attn = Attention(cfg, cfg.rope_layers is None or cfg.rope_layers[index])
        self.residual_multiplier = cfg.residual_multiplier
        dense = (cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        if cfg.is_moe(index):
            self.mlp = SparseMoE(cfg)
        elif cfg.architecture in ("ArceeForCausalLM", APERTUS):  # no gate: down(act(up(x)))
            self.mlp = UpDownMLP(*dense, ("up_proj", "down_proj"))
        else:
            self.mlp = GatedMLP(*dense)
        self.norm_after = cfg.norm_after
        if not cfg.norm_after:
            self.input_layernorm = block_norm(cfg, d)
        self.post_attention_layernorm = block_norm(cfg, d)
        self.four_norms = cfg.four_norms
        if cfg.four_norms:
            self.pre_feedforward_layernorm = block_norm(cfg, d)
        if cfg.four_norms or cfg.norm_after:
            self.post_feedforward_layernorm = block_norm(cfg, d)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        if self.norm_after:  # OLMo 2: each block's output normalised, its input not
            a = self.self_attn(x, cos, sin, write_at, mask, k_cache, v_cache, span)
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(h))
        a = self.self_attn(
            self.input_layernorm(x), cos, sin, write_at, mask, k_cache, v_cache, span
        )
        if self.four_norms:  # norms on both sides of attention and of the MLP
            h = x + self.post_attention_layernorm(a)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        m = self.residual_multiplier
        if m != 1.0:  # Granite
            h = x + a * m
            return h + self.mlp(self.post_attention_layernorm(h)) * m
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = block_norm(cfg, cfg.hidden_size)


class Transformer(CausalLM):
    """A Llama-layout `*ForCausalLM` with an external, position-overwrite KV cache."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_buffers()

    def init_buffers(self) -> None:
        super().init_buffers()
        # Gemma: × √hidden, rounded to the weights' dtype as transformers does.
        dtype = self.model.embed_tokens.weight.dtype
        self.embed_scale = float(
            torch.tensor(self.config.hidden_size**0.5, dtype=dtype, device="cpu")
        )

    def embed(self, tokens: Tensor) -> Tensor:
        x = self.model.embed_tokens(tokens)
        if self.config.gemma:
            return x * self.embed_scale
        m = self.config.embedding_multiplier
        return x * m if m != 1.0 else x

    def logits(self, x: Tensor) -> Tensor:
        cfg = self.config
        logits = self.lm_head(self.model.norm(x))
        logits = logits / cfg.logits_scaling if cfg.logits_scaling != 1.0 else logits
        return softcap(logits, cfg.final_logit_softcapping)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if cfg.architecture == "GPTNeoXForCausalLM":
        from aotgen.model.gptneox import GPTNeoXForCausalLM

        return GPTNeoXForCausalLM
    if cfg.architecture in LFM2:
        from aotgen.model.lfm2 import Lfm2ForCausalLM

        return Lfm2ForCausalLM
    if cfg.architecture in QWEN3_5:
        from aotgen.model.qwen3_5 import Qwen3_5ForCausalLM

        return Qwen3_5ForCausalLM
    if cfg.architecture in LAYERNORM_LAYOUT:
        return LayerNormDecoder
    return Transformer


def cache_shapes(
    cfg: ModelConfig,
    cache_len: int,
    batch: int = 1,
    dtype: torch.dtype = torch.float32,
    ring_cells: int | None = None,
) -> list[list[int]]:
    """The shape of each tensor of the per-layer `[k0, v0, k1, v1, ...]` cache: keys and
    values `[batch, kv_heads, cache_len, head_dim]`, a sliding layer's `ring_cells` long when
    it keeps a ring (position p in cell p % ring_cells, model/layers.py); a convolution
    layer's (LFM2) its inputs' two halves of channels, `[batch, 1, cache_len, hidden / 2]`
    each; a linear-attention layer's (Qwen3.5) rings of `ring_cells` convolution inputs
    `[batch, 1, cells, conv_dim]` and recurrent states `[batch, Hv, cells, Dk * Dv]`
    (qwen3_5.py); a latent-attention layer's (mla.py) latent rows `[batch, 1, cache_len,
    head_dim]` as its keys, no values (width 0). An int8 cache's rows are 4 elements wider
    (kernels/cache_rows.py)."""
    width = row_width(cfg.head_dim, dtype)
    attention = [batch, cfg.num_key_value_heads, cache_len, width]
    ring = [batch, cfg.num_key_value_heads, ring_cells or cache_len, width]
    conv = [batch, 1, cache_len, row_width(cfg.hidden_size // 2, dtype)]

    def shape(layer: int, values: bool) -> list[int]:
        if cfg.is_conv(layer):
            return conv
        if cfg.is_linear(layer):
            return linear[values]
        if cfg.latent_attention and values:
            return [batch, 1, cache_len, 0]
        return ring if cfg.is_sliding(layer) else attention

    cells = ring_cells or cache_len
    keys = cfg.linear_key_heads * cfg.linear_key_dim
    linear = (
        [batch, 1, cells, 2 * keys + cfg.linear_value_heads * cfg.linear_value_dim],
        [batch, cfg.linear_value_heads, cells, cfg.linear_key_dim * cfg.linear_value_dim],
    )
    return [shape(i // 2, bool(i % 2)) for i in range(2 * cfg.num_hidden_layers)]


def cache_dtypes(cfg: ModelConfig, dtype: torch.dtype) -> list[torch.dtype]:
    """The dtype of each tensor of the cache: `dtype`, but a linear-attention layer's states
    are float32 whatever the cache's dtype (a state sums the whole sequence, and its kernel
    is a float32 kernel), as llama.cpp and vLLM keep them."""
    return [
        torch.float32 if i % 2 and cfg.is_linear(i // 2) else dtype
        for i in range(2 * cfg.num_hidden_layers)
    ]


def new_kv_cache(
    cfg: ModelConfig,
    cache_len: int,
    dtype=torch.float32,
    device: str = "cpu",
    batch: int = 1,
    ring_cells: int | None = None,
) -> list[Tensor]:
    """The cache every graph takes, zeroed (batch 1; more rows only for eager batched runs,
    such as distillation)."""
    shapes = cache_shapes(cfg, cache_len, batch, dtype, ring_cells)
    return [
        torch.zeros(shape, dtype=d, device=device)
        for shape, d in zip(shapes, cache_dtypes(cfg, dtype), strict=True)
    ]


# Modules under other names than the Llama layout's: GLM-4's norms after attention, before and
# after the MLP; Hunyuan's q/k norms; VaultGemma's norm before the MLP; Apertus's two norms a
# layer and its activation.
MODULE_NAMES = {
    "Glm4ForCausalLM": {
        "post_self_attn_layernorm": "post_attention_layernorm",
        "post_attention_layernorm": "pre_feedforward_layernorm",
        "post_mlp_layernorm": "post_feedforward_layernorm",
    },
    **{arch: {"query_layernorm": "q_norm", "key_layernorm": "k_norm"} for arch in HUNYUANS},
    VAULTGEMMA: {"pre_feedforward_layernorm": "post_attention_layernorm"},
    APERTUS: {
        "attention_layernorm": "input_layernorm",
        "feedforward_layernorm": "post_attention_layernorm",
        "act_fn": "act",  # its xIELU's parameters
    },
}


def rename_modules(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """A family's checkpoint names of MODULE_NAMES as the Llama layout's; others unchanged."""
    names = MODULE_NAMES.get(cfg.architecture)
    if names is None:
        return weights
    out = {}
    for name, tensor in weights.items():
        stem, _, leaf = name.rpartition(".")
        stem, _, module = stem.rpartition(".")
        out[f"{stem}.{names[module]}.{leaf}" if module in names else name] = tensor
    return out


def split_fused(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Phi-3's and GLM-4's fused projections as the Llama layout's: `qkv_proj` rows are q,
    then k, then v; `gate_up_proj` rows are gate, then up. Granite 4's `shared_mlp`
    (input_linear: gate rows, then up) is the MLP, or with experts the shared expert.
    Qwen3-Next's `in_proj_qkvz` / `in_proj_ba` as Qwen3.5's four projections, OLMo Hybrid's
    apart ones joined. Other families: unchanged."""
    if cfg.architecture in GRANITE_SHARED_MLP:
        return _granite_shared_mlp(cfg, weights)
    if cfg.architecture == QWEN3_NEXT:
        from aotgen.model.qwen3_5 import split_qkvz

        return split_qkvz(cfg, weights)
    if cfg.architecture == OLMO_HYBRID:
        from aotgen.model.qwen3_5 import olmo_hybrid_names

        return olmo_hybrid_names(weights)
    if cfg.architecture not in ("Phi3ForCausalLM", "Glm4ForCausalLM"):
        return weights
    q_rows = cfg.num_attention_heads * cfg.head_dim
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    out = {}
    for name, tensor in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
            stem = name.removesuffix("qkv_proj.weight")
            out |= {f"{stem}q_proj.weight": q, f"{stem}k_proj.weight": k, f"{stem}v_proj.weight": v}
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = tensor.chunk(2)
            stem = name.removesuffix("gate_up_proj.weight")
            out |= {f"{stem}gate_proj.weight": gate, f"{stem}up_proj.weight": up}
        else:
            out[name] = tensor
    return out


def rotate_half_rows(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """q/k projections (weights and biases) of a checkpoint whose RoPE rotates adjacent pairs
    of dims (GLM-4, ERNIE 4.5, Cohere) with each head's rotated dims reordered, evens then odds: the
    model's rotate-half RoPE then turns the same pairs by the same angles, and q·k is the
    same sum in another order."""
    if cfg.architecture not in INTERLEAVED_ROPE:
        return weights
    rot = cfg.rotary_dim or cfg.head_dim
    head = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2)])
    head = torch.cat([head, torch.arange(rot, cfg.head_dim)])
    out = dict(weights)
    for name, t in weights.items():
        if name.rpartition(".")[0].endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = t.shape[0] // cfg.head_dim
            rows = (head + cfg.head_dim * torch.arange(heads)[:, None]).flatten()
            out[name] = t[rows]
        elif name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
            out[name] = t[..., head]  # Cohere's per-head norm weights follow their dims
    return out


def _granite_shared_mlp(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    mlp = "mlp.shared_expert." if cfg.num_experts else "mlp."
    out = {}
    for name, tensor in weights.items():
        stem, sep, proj = name.partition("shared_mlp.")
        if proj == "input_linear.weight":
            gate, up = tensor.chunk(2)
            out |= {f"{stem}{mlp}gate_proj.weight": gate, f"{stem}{mlp}up_proj.weight": up}
        elif proj == "output_linear.weight":
            out[f"{stem}{mlp}down_proj.weight"] = tensor
        else:
            out[name] = tensor
    return out


# Non-parameters some checkpoints carry: RoPE and causal-mask buffers (old GPT-NeoX).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")
# Modules the model does not run: Qwen3.5's and ERNIE 4.5's multi-token-prediction layers
# (transformers skips them too).
IGNORED_PREFIXES = ("mtp.", "model.mtp_")


def _is_mtp_layer(cfg: ModelConfig, name: str) -> bool:
    """GLM-4.5's, GLM-4.7-Flash's and DeepSeek-V3's multi-token-prediction layers, numbered
    after the last layer (`model.layers.{num_hidden_layers + i}`): not run, as transformers
    does not run them."""
    mtp = (GLM4_MOE, GLM4_MOE_LITE, DEEPSEEK_V3)
    if cfg.architecture not in mtp or not name.startswith("model.layers."):
        return False
    return int(name.split(".")[2]) >= cfg.num_hidden_layers


def load_model(
    cfg: ModelConfig, weights: dict[str, Tensor], cache_len: int, dtype: torch.dtype
) -> CausalLM:
    """Instantiate on the meta device and adopt the checkpoint tensors (no random init)."""
    cls = model_class(cfg)
    weights = {
        k: v
        for k, v in weights.items()
        if not k.endswith(IGNORED_SUFFIXES)
        and not k.startswith(IGNORED_PREFIXES)
        and not _is_mtp_layer(cfg, k)
    }
    weights = rotate_half_rows(cfg, split_fused(cfg, rename_modules(cfg, weights)))
    weights = rotate_latent_rows(cfg, weights)
    weights = stack_experts(cfg, stack_head_norms(cfg, weights))
    tied = cfg.tie_word_embeddings
    if tied:
        weights.pop(cls.HEAD, None)
    with torch.device("meta"):
        model = cls(cfg, cache_len)
    expected = {k for k in model.state_dict() if not (tied and k == cls.HEAD)}
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the {cfg.architecture} config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    for name, tensor in weights.items():
        want = model.get_parameter(name).shape
        if tensor.shape != want:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(want)}"
            )
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(
                f"checkpoint tensor {name} holds NaN or infinite values: the checkpoint is "
                "damaged (or was saved from a diverged run); get it again"
            )
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False, assign=True)
    model.tie_weights()
    model.init_buffers()
    return model.eval().requires_grad_(False)
