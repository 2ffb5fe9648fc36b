"""`Qwen3_5ForCausalLM` (Qwen3.5): three of every four layers are linear attention (the gated
delta rule), the fourth full attention; every layer has a SwiGLU MLP, norms before each block,
and every RMSNorm but the delta rule's output norm scales by (1 + w).

A linear-attention layer (`GatedDeltaNet`) projects each position to q, k and v, mixes each
with the `linear_conv_kernel - 1` positions before it (a depthwise convolution, then SiLU),
and runs the gated delta rule over them (kernels/gated_delta.py): a `[Dk, Dv]` state per value
head, decayed, corrected towards v and read by q at every token. Its output is normed, gated
by SiLU of a fourth projection z, and projected back.

What such a layer remembers is the convolution's last inputs and the state. Both are kept in
rings of `cells` positions, position p in cell p % cells, as sliding-window layers keep their
keys: the layer's cache pair is the convolution inputs `[slots, 1, cells, conv_dim]` and the
states `[slots, Hv, cells, Dk * Dv]`. A call at p0 reads the inputs of p0 - 3 .. p0 - 1 and the
state after p0 - 1, then writes its own rows' (the last `cells` of them); a rejected
speculative row is overwritten later, like a key. The runtimes' record of which position each
cell holds (`kv_cache.ring`, window = the convolution's width) then decides which prefixes
can be reused, as for a ring of sliding keys.

The attention layers are Qwen3's with a gate: q_proj gives each head's query and, beside it,
a gate; the attention output is multiplied by its sigmoid before o_proj. Text positions are
the same on all three of Qwen3.5's multimodal RoPE axes, which makes it plain RoPE on the
first quarter of each head.

`Qwen3_5MoeForCausalLM` (Qwen3.5-MoE) is the same with sparse MLPs (moe.py: the top-k of the
router's softmax renormalised, a shared expert behind a sigmoid gate) on every layer.
`Qwen3NextForCausalLM` (Qwen3-Next) is Qwen3.5-MoE whose checkpoint fuses each key head's
projections (`split_qkvz` unfuses them at load), with dense MLPs on its `mlp_only_layers`.

`OlmoHybridForCausalLM` (OLMo Hybrid) has the same linear-attention layers, their beta doubled
and their projections and convolutions apart in the checkpoint (`olmo_hybrid_names` joins
them), beside OLMo 3's attention layers (llama.py's: q/k norms across heads, each block's norm
after it); its RMSNorms scale by w.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aotgen.kernels import gated_delta  # noqa: F401  (registers aotgen::gated_delta_rule)
from aotgen.model.config import ModelConfig
from aotgen.model.layers import (
    CacheIndex,
    CausalLM,
    GatedMLP,
    RMSNorm,
    apply_rope,
    cached_attention,
)
from aotgen.model.llama import Attention
from aotgen.model.moe import SparseMoE


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d, heads, kv_heads = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(d, 2 * heads * self.head_dim, bias=False)  # query, gate
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, unit_offset=True)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        q, gate = self.q_proj(x).view(b, t, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, write_at, mask, k_cache, v_cache, span, self.scale)
        return self.o_proj(y * torch.sigmoid(gate.reshape(b, t, -1)))


class GatedRMSNorm(nn.Module):
    """RMSNorm (weight w, not 1 + w) of each head's output, times SiLU of the gate."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * xf.to(x.dtype)
        return (y * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d = cfg.hidden_size
        self.key_heads, self.value_heads = cfg.linear_key_heads, cfg.linear_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_dim = 2 * keys + values
        kernel = cfg.linear_conv_kernel
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, values, bias=False)
        self.in_proj_b = nn.Linear(d, self.value_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.value_heads, bias=False)
        # transformers' depthwise Conv1d: weight [conv_dim, 1, kernel]; only its weight is used.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, kernel, groups=self.conv_dim,
                                bias=False, padding=kernel - 1)  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, cfg.linear_norm_eps)
        self.out_proj = nn.Linear(values, d, bias=False)
        self.beta_scale = cfg.linear_beta_scale

    def forward(self, x, cos, sin, write_at, mask, conv_cache, state, span) -> Tensor:
        """`conv_cache [slots, 1, cells, conv_dim]` and `state [slots, Hv, cells, Dk * Dv]`:
        the rings this layer reads and writes at the positions of `write_at`."""
        b, t, _ = x.shape
        slots, positions = _rows(write_at, b)
        mixed = F.silu(self._convolve(self.in_proj_qkv(x), conv_cache, slots, positions))
        keys = self.key_heads * self.key_dim
        q, k, v = mixed.float().split([keys, keys, self.value_heads * self.value_dim], dim=-1)
        q = _l2norm(q.view(b, t, self.key_heads, self.key_dim)) * self.key_dim**-0.5
        k = _l2norm(k.view(b, t, self.key_heads, self.key_dim))
        v = v.view(b, t, self.value_heads, self.value_dim)
        beta = torch.sigmoid(self.in_proj_b(x).float())
        if self.beta_scale != 1.0:  # OLMo Hybrid
            beta = beta * self.beta_scale
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        y = torch.ops.aotgen.gated_delta_rule(q, k, v, g, beta, state, slots, positions)
        z = self.in_proj_z(x).view(b, t, self.value_heads, self.value_dim)
        y = self.norm(y.to(x.dtype), z).reshape(b, t, -1)
        return self.out_proj(y)

    def _convolve(self, rows: Tensor, cache: Tensor, slots: Tensor, positions: Tensor) -> Tensor:
        """The depthwise causal convolution of `rows [b, t, conv_dim]`, the positions before
        each sequence's first row read from the ring (zero before position 0); then the rows
        written to it (the last `cells` of a longer call)."""
        weight = self.conv1d.weight[:, 0].to(rows.dtype)  # [conv_dim, kernel]
        lags = weight.shape[1] - 1
        cells = cache.shape[2]
        before = positions[:, :1] - torch.arange(lags, 0, -1, device=rows.device)  # [b, lags]
        held = cache[slots.unsqueeze(1), 0, before % cells].to(rows.dtype)  # [b, lags, conv_dim]
        held = held * (before >= 0).unsqueeze(-1).to(rows.dtype)
        window = torch.cat([held, rows], dim=1)
        t = rows.shape[1]
        out = sum(window[:, j : j + t] * weight[:, j] for j in range(lags + 1))
        # Each cell takes the last row of its residue, if the call has one: a gather, not a
        # scatter of the last `cells` rows, whose count would depend on t.
        cell = torch.arange(cells, device=rows.device)
        source = (t - 1) - (positions[:, -1:] - cell) % cells  # [b, cells]
        taken = rows.gather(1, source.clamp(min=0).unsqueeze(-1).expand(-1, -1, rows.shape[-1]))
        kept = cache[slots, 0]
        cache[slots, 0] = torch.where((source >= 0).unsqueeze(-1), taken.to(cache.dtype), kept)
        return out


def split_qkvz(cfg: ModelConfig, weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` as Qwen3.5's `in_proj_qkv`, `in_proj_z`,
    `in_proj_b`, `in_proj_a`. Qwen3-Next groups rows by key head: each key head's q and k rows,
    then the v rows and the z rows of its value heads; b and a likewise. Qwen3.5 lays out all
    q, all k, all v (value heads in the same order: key head h's are h * r .. h * r + r - 1)."""
    dk, dv, hk = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_key_heads
    per_key = cfg.linear_value_heads // hk  # r value heads to a key head
    out = {}
    for name, tensor in weights.items():
        stem, _, leaf = name.rpartition(".in_proj_")
        if leaf == "qkvz.weight":
            grouped = tensor.view(hk, -1, tensor.shape[-1])
            q, k, v, z = grouped.split([dk, dk, per_key * dv, per_key * dv], dim=1)
            rows = [part.reshape(-1, tensor.shape[-1]) for part in (q, k, v, z)]
            out[f"{stem}.in_proj_qkv.weight"] = torch.cat(rows[:3])
            out[f"{stem}.in_proj_z.weight"] = rows[3]
        elif leaf == "ba.weight":
            b, a = tensor.view(hk, 2 * per_key, -1).chunk(2, dim=1)
            out[f"{stem}.in_proj_b.weight"] = b.reshape(-1, tensor.shape[-1])
            out[f"{stem}.in_proj_a.weight"] = a.reshape(-1, tensor.shape[-1])
        else:
            out[name] = tensor
    return out


# OLMo Hybrid's linear-attention modules under Qwen3.5's names; q, k and v (and their
# convolutions) are joined into one projection (one convolution).
_OLMO_HYBRID_NAMES = {
    "g_proj": "in_proj_z",
    "a_proj": "in_proj_a",
    "b_proj": "in_proj_b",
    "o_proj": "out_proj",
    "o_norm": "norm",
}
_OLMO_HYBRID_NORMS = {
    "attention_layer_norm": "input_layernorm",
    "feedforward_layer_norm": "post_attention_layernorm",
}


def olmo_hybrid_names(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """OLMo Hybrid's checkpoint names as Qwen3.5's: `linear_attn.{q,k,v}_proj` joined into
    `in_proj_qkv`, `{q,k,v}_conv1d` into `conv1d` (q, k, v: the order the convolution's
    channels take), the gate `g_proj` as `in_proj_z`; OLMo-core's norm names as the
    Llama layout's."""
    out: dict[str, Tensor] = {}
    joined: dict[str, dict[str, Tensor]] = {}
    for name, tensor in weights.items():
        stem, sep, leaf = name.partition(".linear_attn.")
        module, _, kind = leaf.partition(".")
        if sep and module in ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d"):
            target = "in_proj_qkv" if module.endswith("proj") else "conv1d"
            joined.setdefault(f"{stem}.linear_attn.{target}.{kind}", {})[module[0]] = tensor
        elif sep:
            renamed = ".".join([_OLMO_HYBRID_NAMES.get(module, module), kind]).rstrip(".")
            out[f"{stem}.linear_attn.{renamed}"] = tensor
        else:
            parts = name.split(".")
            out[".".join(_OLMO_HYBRID_NORMS.get(part, part) for part in parts)] = tensor
    for name, parts in joined.items():
        if sorted(parts) != ["k", "q", "v"]:
            raise ValueError(f"checkpoint: {name} needs q, k and v parts, found {sorted(parts)}")
        out[name] = torch.cat([parts["q"], parts["k"], parts["v"]])
    return out


def _rows(write_at: CacheIndex, b: int) -> tuple[Tensor, Tensor]:
    """(slots [b], positions [b, t]) of a call: a batch's in its slots, or sequences at the
    same positions in rows 0.. (one in a graph; several in an eager batch, as distillation
    runs)."""
    if isinstance(write_at, tuple):
        return write_at[0][:, 0], write_at[1]
    rows = torch.arange(b, device=write_at.device)
    return rows, write_at.unsqueeze(0).expand(b, -1)


def _l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.unit_offset_norms
        # OLMo Hybrid's attention layers: OLMo 3's, each block's norm after it
        self.norm_after = not cfg.is_linear(index) and cfg.norm_after
        if cfg.is_linear(index):
            self.linear_attn = GatedDeltaNet(cfg)
        elif cfg.attention_output_gate:
            self.self_attn = GatedAttention(cfg)
        else:
            rotates = cfg.rope_layers is None or cfg.rope_layers[index]
            self.self_attn = Attention(cfg, rotates)
        if not self.norm_after:
            self.input_layernorm = RMSNorm(d, eps, unit_offset=offset)
        self.post_attention_layernorm = RMSNorm(d, eps, unit_offset=offset)
        if self.norm_after:
            self.post_feedforward_layernorm = RMSNorm(d, eps, unit_offset=offset)
        self.mlp = SparseMoE(cfg) if cfg.is_moe(index) else GatedMLP(d, cfg.intermediate_size)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        if self.norm_after:
            h = x + self.post_attention_layernorm(
                mixer(x, cos, sin, write_at, mask, k_cache, v_cache, span)
            )
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = x + mixer(self.input_layernorm(x), cos, sin, write_at, mask, k_cache, v_cache, span)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3_5Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.unit_offset_norms)


class Qwen3_5ForCausalLM(CausalLM):
    """`Qwen3_5ForCausalLM` with external caches: keys and values for the attention layers,
    rings of convolution inputs and recurrent states for the linear ones."""

    EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.model = Qwen3_5Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_buffers()

    def logits(self, x: Tensor) -> Tensor:
        return self.lm_head(self.model.norm(x))
