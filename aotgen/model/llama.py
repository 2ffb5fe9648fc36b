"""Decoder-only transformer driven by a Hugging Face config (Llama family).

One flat file in the spirit of gpt-fast. Module names follow the HF checkpoint
(`model.layers.0.self_attn.q_proj`, ...) so weights load without a name map and
quantization/TP plans can match HF parameter names.

The KV cache is *not* owned by the model: every forward takes per-layer cache tensors
(`[1, n_kv_heads, cache_len, head_dim]`) and writes the new keys/values in place at
`input_pos` (position overwrite: rejected speculative positions are simply overwritten
later, no rollback). This is the contract every exported graph keeps:

    forward(tokens [1, T], input_pos [T], caches [k0, v0, k1, v1, ...]) -> logits [1, T, V]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    architecture: str = "LlamaForCausalLM"
    extra: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Map an HF `config.json` dict; refuse what this model cannot represent."""
        archs = hf.get("architectures") or [hf.get("model_type", "?")]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("checkpoints with attention/MLP biases are not supported yet")
        for key in ("rope_theta", "rms_norm_eps"):
            value = hf.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or value <= 0
            ):
                raise ValueError(f"config.json: {key} must be a positive number, got {value!r}")
        heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            architecture=arch,
        )


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse RoPE frequencies, with Llama-3 style scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        is_mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def rope_tables(cfg: ModelConfig, length: int) -> tuple[Tensor, Tensor]:
    """cos/sin tables `[length, head_dim]` in HF's rotate-half layout."""
    freqs = torch.outer(torch.arange(length, dtype=torch.float64), rope_inv_freq(cfg))
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().float(), emb.sin().float()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


# Decode (one query row per head) attends with `attend_one`: Inductor fuses its
# multiply-sums and softmax into the layer's kernel, where SDPA is an extern call per layer
# (dispatch, its own parallel region, sgemm packing for a single row). Measured on SmolLM2
# int8: decode 5.6 -> 5.3 ms at position 64, 11.0 -> 9.9 ms at 1000. The verify graph keeps
# SDPA: with 5 rows the multiply-sums were 12% slower at position 1000.
def attend_one(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Masked softmax attention as broadcast multiply-sums: [b, h, m, d] x [b, h, n, d]."""
    scores = (q.unsqueeze(3) * keys.unsqueeze(2)).sum(-1) * q.shape[-1] ** -0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs.unsqueeze(-1) * values.unsqueeze(2)).sum(3)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        input_pos: Tensor,
        mask: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        attn_len: int,
    ) -> Tensor:
        b, t, _ = x.shape
        # Heads are sized from the weights, not the config, so a tensor-parallel shard
        # (fewer heads per rank) runs through the same code.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k_cache.index_copy_(2, input_pos, k.to(k_cache.dtype))
        v_cache.index_copy_(2, input_pos, v.to(v_cache.dtype))
        # Attend only to the filled prefix of the cache, not all of it.
        keys = k_cache[:, :, :attn_len].to(q.dtype)
        values = v_cache[:, :, :attn_len].to(q.dtype)
        # GQA without repeating K/V: fold each KV head's group of query heads into the
        # query-length axis ([b, kv, group * t, d]), so no expanded K/V copy per layer.
        kv_heads = keys.shape[1]
        group = q.shape[1] // kv_heads
        q = q.reshape(b, kv_heads, group * t, self.head_dim)
        mask = mask.repeat(group, 1)
        if isinstance(t, int) and t == 1:  # static: the decode graph
            y = attend_one(q, keys, values, mask)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        # unflatten+permute, not view(b, -1, t, d): export cannot prove the view's stride
        # guard for a dynamic t (prefill failed to export).
        return self.o_proj(y.unflatten(2, (group, t)).permute(0, 3, 1, 2, 4).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, input_pos, mask, k_cache, v_cache, attn_len):
        h = x + self.self_attn(
            self.input_layernorm(x), cos, sin, input_pos, mask, k_cache, v_cache, attn_len
        )
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """`LlamaForCausalLM` with an external, position-overwrite KV cache."""

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__()
        self.config = cfg
        self.cache_len = cache_len
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_tables(cfg, cache_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("key_positions", torch.arange(cache_len), persistent=False)

    def forward(self, tokens: Tensor, input_pos: Tensor, caches: list[Tensor]) -> Tensor:
        # Positions in one call are consecutive, so the last one bounds what is attended to.
        attn_len = input_pos[-1].item() + 1
        torch._check(attn_len >= 1)
        torch._check(attn_len <= self.cache_len)
        cos = self.rope_cos[input_pos].to(self.lm_head.weight.dtype)
        sin = self.rope_sin[input_pos].to(self.lm_head.weight.dtype)
        mask = self.key_positions[:attn_len].unsqueeze(0) <= input_pos.unsqueeze(1)
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, input_pos, mask, caches[2 * i], caches[2 * i + 1], attn_len)
        return self.lm_head(self.model.norm(x)).float()


def new_kv_cache(
    cfg: ModelConfig, cache_len: int, dtype=torch.float32, device: str = "cpu", batch: int = 1
) -> list[Tensor]:
    """Per-layer `[k0, v0, k1, v1, ...]` cache, the layout every graph takes (batch 1; more
    rows only for eager batched runs, such as distillation)."""
    shape = (batch, cfg.num_key_value_heads, cache_len, cfg.head_dim)
    return [
        torch.zeros(shape, dtype=dtype, device=device) for _ in range(2 * cfg.num_hidden_layers)
    ]


def load_model(
    cfg: ModelConfig, weights: dict[str, Tensor], cache_len: int, dtype: torch.dtype
) -> Transformer:
    """Instantiate on the meta device and adopt the checkpoint tensors (no random init)."""
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    with torch.device("meta"):
        model = Transformer(cfg, cache_len)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
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
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    cos, sin = rope_tables(cfg, cache_len)
    model.rope_cos, model.rope_sin = cos, sin
    model.key_positions = torch.arange(cache_len)
    return model.eval().requires_grad_(False)
