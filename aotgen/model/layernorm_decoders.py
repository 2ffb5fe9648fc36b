"""Decoders with LayerNorms: Phi-1 / 1.5 / 2 (`PhiForCausalLM`), StableLM
(`StableLmForCausalLM`), StarCoder2 (`Starcoder2ForCausalLM`), Cohere's Command R
(`CohereForCausalLM`, `Cohere2ForCausalLM`) and Nemotron (`NemotronForCausalLM`).

Module names follow the HF checkpoints, so weights load without a name map:
- Phi: one LayerNorm a layer feeding attention and the MLP side by side, biases on every
  linear (`self_attn.dense`, `mlp.fc1` / `fc2`, `lm_head`), `model.final_layernorm`; with
  `qk_layernorm`, one LayerNorm over each head's q (and k).
- StableLM: the Llama layout with LayerNorms (one shared by attention and the MLP when
  `use_parallel_residual`), optional q/k/v biases, a gated MLP, with `qk_layernorm` a
  LayerNorm of its own per head (`q_layernorm.norms.{h}`, stacked at load).
- StarCoder2: two LayerNorms a layer, biases on every linear (`use_bias`),
  `mlp.c_fc` / `c_proj`, a sliding window on every layer (`sliding_window`).
- Cohere: one LayerNorm without a bias feeding attention and a gated MLP side by side, the
  logits x `logit_scale`, with `use_qk_norm` a LayerNorm weight per head (`q_norm.weight`
  `[heads, head_dim]`); it rotates adjacent pairs of dims (q/k rows reordered at load:
  llama.py `rotate_half_rows`). Cohere2: three sliding-window layers in four, and only they
  rotate.
- Nemotron: two LayerNorms a layer whose weights are stored minus one, an MLP without a gate
  (`up_proj`, relu², `down_proj`).

All rotate the first `rotary_dim` dims of each head in the rotate-half layout; the shared
forward and the runtime-owned KV cache are layers.py's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aotgen.model.config import COHERE, COHERE2, NEMOTRON, PHI, STABLELM, STARCODER2, ModelConfig
from aotgen.model.layers import CausalLM, GatedMLP, UpDownMLP, apply_rope, cached_attention


class HeadNorm(nn.Module):
    """Cohere's and StableLM's q or k LayerNorm: a weight per head (`[heads, dim]`), no bias.
    StableLM's checkpoints hold one LayerNorm per head (`norms.{h}`): `stack_head_norms`."""

    def __init__(self, heads: int, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(heads, dim))

    def forward(self, x: Tensor) -> Tensor:  # [b, heads, t, d]
        return F.layer_norm(x, x.shape[-1:], eps=self.eps) * self.weight.unsqueeze(1)


def _head_norm(cfg: ModelConfig, heads: int, dim: int) -> nn.Module:
    """The q or k norm: Cohere's and StableLM's with a weight per head, Phi's one for all."""
    if cfg.architecture in (COHERE, STABLELM):
        return HeadNorm(heads, dim, cfg.rms_norm_eps)
    return nn.LayerNorm(dim, eps=cfg.rms_norm_eps)


def stack_head_norms(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """StableLM's per-head q/k LayerNorms (`q_layernorm.norms.{h}.weight`) as one `[heads,
    dim]` weight each, read at once by `HeadNorm`; other checkpoints unchanged."""
    if cfg.architecture != STABLELM:
        return weights
    out, heads = {}, {}
    for name, t in weights.items():
        stem, sep, rest = name.partition(".norms.")
        if sep and stem.endswith(("q_layernorm", "k_layernorm")):
            heads.setdefault(f"{stem}.weight", {})[int(rest.split(".")[0])] = t
        else:
            out[name] = t
    return out | {name: torch.stack([h[i] for i in sorted(h)]) for name, h in heads.items()}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotates: bool):
        super().__init__()
        self.rotates = rotates
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
        if cfg.qk_norm:
            cohere = cfg.architecture == COHERE
            self.norm_names = ("q_norm", "k_norm") if cohere else ("q_layernorm", "k_layernorm")
            for name, n in zip(self.norm_names, (heads, kv_heads), strict=True):
                self.add_module(name, _head_norm(cfg, n, self.head_dim))

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        # Heads are sized from the weights, so a tensor-parallel shard runs unchanged.
        q = self.q_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.qk_norm:
            q_norm, k_norm = (getattr(self, name) for name in self.norm_names)
            q, k = q_norm(q), k_norm(k)
        if self.rotates:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, write_at, mask, k_cache, v_cache, span, self.scale)
        return getattr(self, self.out_name)(y)


def _mlp(cfg: ModelConfig) -> nn.Module:
    d, f, act = cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act
    if cfg.architecture in (STABLELM, COHERE, COHERE2):
        return GatedMLP(d, f, act)
    names = {PHI: ("fc1", "fc2"), STARCODER2: ("c_fc", "c_proj")}
    return UpDownMLP(
        d, f, act, names.get(cfg.architecture, ("up_proj", "down_proj")), cfg.linear_bias
    )


class LayerNorm1P(nn.LayerNorm):
    """Nemotron's LayerNorm, whose weight is stored minus one."""

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


def _norm(cfg: ModelConfig) -> nn.LayerNorm:
    d, eps = cfg.hidden_size, cfg.rms_norm_eps
    if cfg.architecture == NEMOTRON:
        return LayerNorm1P(d, eps=eps)
    return nn.LayerNorm(d, eps=eps, bias=cfg.architecture not in (COHERE, COHERE2))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        self.parallel = cfg.use_parallel_residual
        self.input_layernorm = _norm(cfg)
        if not self.parallel:
            self.post_attention_layernorm = _norm(cfg)
        self.self_attn = Attention(cfg, cfg.rope_layers is None or cfg.rope_layers[index])
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
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm_name = "final_layernorm" if cfg.architecture == PHI else "norm"
        self.add_module(self.norm_name, _norm(cfg))


class LayerNormDecoder(CausalLM):
    """A LayerNorm decoder with an external, position-overwrite KV cache."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.model = Model(cfg)
        bias = cfg.architecture == PHI
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=bias)
        self.tie_weights()
        self.init_buffers()

    def logits(self, x: Tensor) -> Tensor:
        logits = self.lm_head(getattr(self.model, self.model.norm_name)(x))
        scaling = self.config.logits_scaling  # Cohere: x logit_scale
        return logits / scaling if scaling != 1.0 else logits
