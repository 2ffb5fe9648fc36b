"""Decoders with LayerNorms and biases: Phi-1 / 1.5 / 2 (`PhiForCausalLM`), StableLM
(`StableLmForCausalLM`) and StarCoder2 (`Starcoder2ForCausalLM`).

Module names follow the HF checkpoints, so weights load without a name map:
- Phi: one LayerNorm a layer feeding attention and the MLP side by side, biases on every
  linear (`self_attn.dense`, `mlp.fc1` / `fc2`, `lm_head`), `model.final_layernorm`; with
  `qk_layernorm`, one LayerNorm over each head's q (and k).
- StableLM: the Llama layout with LayerNorms (one shared by attention and the MLP when
  `use_parallel_residual`), optional q/k/v biases, a gated MLP, with `qk_layernorm` a
  LayerNorm of its own per head (`q_layernorm.norms.{h}`).
- StarCoder2: two LayerNorms a layer, biases on every linear (`use_bias`),
  `mlp.c_fc` / `c_proj`, a sliding window on every layer (`sliding_window`).

All rotate the first `rotary_dim` dims of each head in the rotate-half layout; the shared
forward and the runtime-owned KV cache are layers.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aotgen.model.config import PHI, STABLELM, ModelConfig
from aotgen.model.layers import ACT_FNS, CausalLM, GatedMLP, apply_rope, cached_attention


class HeadNorms(nn.Module):
    """StableLM's q or k LayerNorm: its own weight per head, no bias."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps=eps, bias=False) for _ in range(heads))

    def forward(self, x: Tensor) -> Tensor:  # [b, heads, t, d]
        weight = torch.stack([norm.weight for norm in self.norms]).unsqueeze(1)
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * weight


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=bias)
        out = nn.Linear(heads * self.head_dim, d, bias=cfg.linear_bias)
        # Looked up by name at each call: tensor parallelism replaces the module.
        self.out_name = "dense" if cfg.architecture == PHI else "o_proj"
        self.add_module(self.out_name, out)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm and cfg.architecture == STABLELM:
            self.q_layernorm = HeadNorms(heads, self.head_dim, cfg.rms_norm_eps)
            self.k_layernorm = HeadNorms(kv_heads, self.head_dim, cfg.rms_norm_eps)
        elif cfg.qk_norm:
            self.q_layernorm = nn.LayerNorm(self.head_dim, eps=cfg.rms_norm_eps)
            self.k_layernorm = nn.LayerNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        # Heads are sized from the weights, so a tensor-parallel shard runs unchanged.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, write_at, mask, k_cache, v_cache, span, self.scale)
        return getattr(self, self.out_name)(y)


class MLP(nn.Module):
    """Up, activation, down (Phi's `fc1` / `fc2`, StarCoder2's `c_fc` / `c_proj`)."""

    def __init__(self, cfg: ModelConfig, names: tuple[str, str]):
        super().__init__()
        self.names = names
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.linear_bias
        self.add_module(names[0], nn.Linear(d, f, bias=bias))
        self.add_module(names[1], nn.Linear(f, d, bias=bias))
        self.act = ACT_FNS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        up, down = (getattr(self, name) for name in self.names)
        return down(self.act(up(x)))


def _mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.architecture == STABLELM:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    return MLP(cfg, ("fc1", "fc2") if cfg.architecture == PHI else ("c_fc", "c_proj"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel = cfg.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        if not self.parallel:
            self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.mlp = _mlp(cfg)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        h = self.input_layernorm(x)
        a = self.self_attn(h, cos, sin, write_at, mask, k_cache, v_cache, span)
        if self.parallel:  # x + attn(ln(x)) + mlp(ln(x))
            return x + a + self.mlp(h)
        h = x + a
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm_name = "final_layernorm" if cfg.architecture == PHI else "norm"
        self.add_module(self.norm_name, norm)


class LayerNormDecoder(CausalLM):
    """Phi, StableLM or StarCoder2 with an external, position-overwrite KV cache."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.model = Model(cfg)
        bias = cfg.architecture == PHI
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=bias)
        self.tie_weights()
        self.init_buffers()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.model.layers

    def embed(self, tokens: Tensor) -> Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, x: Tensor) -> Tensor:
        return self.lm_head(getattr(self.model, self.model.norm_name)(x))
