"""`GPTNeoXForCausalLM` (Pythia): LayerNorms with biases, one fused `query_key_value`
projection, partial rotary, parallel or sequential residual, GELU MLP, untied `embed_out`.

Module names follow the HF checkpoint (`gpt_neox.layers.0.attention.query_key_value`, ...)
so weights load without a name map. The fused projection's rows are per head: head h owns
rows [3·d·h, 3·d·(h+1)) as its q, k and v, so a contiguous slice of rows is a whole set of
heads (a tensor-parallel colwise shard needs nothing special).
"""

from __future__ import annotations

from torch import Tensor, nn

from aotgen.model.config import ModelConfig
from aotgen.model.layers import ACT_FNS, CausalLM, apply_rope, cached_attention


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        d = cfg.hidden_size
        self.query_key_value = nn.Linear(d, 3 * d, bias=cfg.attention_bias)
        self.dense = nn.Linear(d, d, bias=cfg.attention_bias)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        b, t, _ = x.shape
        # Heads are sized from the weights, so a tensor-parallel shard runs unchanged.
        qkv = self.query_key_value(x).view(b, t, -1, 3 * self.head_dim).transpose(1, 2)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = cached_attention(q, k, v, write_at, mask, k_cache, v_cache, span, self.scale)
        return self.dense(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.dense_4h_to_h = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.act = ACT_FNS[cfg.hidden_act]

    def forward(self, x: Tensor) -> Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.parallel = cfg.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, write_at, mask, k_cache, v_cache, span) -> Tensor:
        a = self.attention(
            self.input_layernorm(x), cos, sin, write_at, mask, k_cache, v_cache, span
        )
        if self.parallel:  # x + attn(ln1(x)) + mlp(ln2(x))
            return self.mlp(self.post_attention_layernorm(x)) + a + x
        h = a + x
        return self.mlp(self.post_attention_layernorm(h)) + h


class GPTNeoXModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class GPTNeoXForCausalLM(CausalLM):
    """`GPTNeoXForCausalLM` with an external, position-overwrite KV cache."""

    EMBED, HEAD = "gpt_neox.embed_in.weight", "embed_out.weight"

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__(cfg, cache_len)
        self.gpt_neox = GPTNeoXModel(cfg)
        self.embed_out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.init_buffers()

    @property
    def decoder_layers(self) -> nn.ModuleList:
        return self.gpt_neox.layers

    def embed(self, tokens: Tensor) -> Tensor:
        return self.gpt_neox.embed_in(tokens)

    def logits(self, x: Tensor) -> Tensor:
        return self.embed_out(self.gpt_neox.final_layer_norm(x))
