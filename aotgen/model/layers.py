"""Pieces every family shares: norms, RoPE, the cached attention, and `CausalLM`, the
forward that turns positions into RoPE rows and masks and runs the layers.

The KV cache is *not* owned by the model: every forward takes per-layer cache tensors
(`[1, n_kv_heads, cache_len, head_dim]`) and writes the new keys/values in place at
`input_pos` (position overwrite: rejected speculative positions are simply overwritten
later, no rollback). LFM2's convolution layers keep their inputs the same way, by position
(lfm2.py; `_conv_history` says where each row's earlier positions are). This is the contract
every exported graph keeps:

    forward(tokens [1, T], input_pos [T], caches [k0, v0, k1, v1, ...]) -> logits [1, T, V]

The prefill graph is exported under `last_row_logits()` and returns `[1, 1, V]`, the logits of
its last position only: a prompt needs no more, and the head is the largest matmul of a chunk
(a 262k-token vocabulary is about 60 % of Gemma 3 270M's multiply-adds). Every row's logits
(perplexity, speculative verification) come from the fixed-width verify graph.

The tree graph adds `tree_mask [T, T]` (bool) after the caches: its rows are the nodes of a
token tree written at consecutive slots, each attending to the prefix and its ancestors.

The batched graphs serve several sequences at once (runtime/batch_engine.py). Their caches hold
one row per sequence slot (`[slots, n_kv_heads, cache_len, head_dim]`), and `slots [B]` says
which row each of the B sequences uses; positions are per sequence:

    forward(tokens [B, T], input_pos [B, T], caches, None, slots [B]) -> logits [B, T, V]

A slot's row of such a cache is itself a `[1, ...]` cache, so the single-sequence graphs run
one sequence of a batch on a view, with no copy.

Sliding-window layers keep a ring (`_ring`): a cache of `cells` positions (the window plus
the widest call's rows, recipe.py `ring_cells`), position p in cell p % cells, each cell
masked by the position it holds. A call writes its rows before they attend and a rejected
speculative row stays written until overwritten, so the extra cells keep every key a row's
window sees. The runtimes keep the same contract (positions, not cells): only prefix reuse
and the copies of a row (a shared prefix, a tree's accepted path) know about cells
(runtime/cached_tokens.py). A package built with `sliding_cache: full` (and every CUDA or
ONNX package) keeps a full-length cache there instead; such layers attend only from the
first key the window of the call's earliest row sees (`span`, read back with `.item()` like
the length), so their attention costs window + rows keys, not the whole prefix (a graph given
`key_pos` attends over all of it, masked).

How far a graph attends: up to its last position (`input_pos[-1] + 1` keys, read back to the
host with `.item()`), or over the cache positions `key_pos` (`arange(n)`, n past the last
position) that the caller passes, with the positions past `input_pos` masked. The second has
no host read: the length is an input's shape, so the graph can be captured once per length
and replayed as a CUDA graph. CUDA builds export their fixed-width graphs that way
(export/aoti.py), and the runtime attends over the shortest of a few lengths that covers the
position (runtime/cuda_graph.py), not over the whole cache as gpt-fast does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aotgen.kernels import attention
from aotgen.kernels.cache_rows import decode_rows, encode_rows
from aotgen.model.config import ModelConfig
from aotgen.model.rope import query_gain, rope_tables

ACT_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu2": lambda x: F.relu(x).square(),
}


class RMSNorm(nn.Module):
    """RMSNorm; `unit_offset` scales by (1 + w) in float32, as Gemma does."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return xf.to(x.dtype) * self.weight.to(x.dtype)


class PlainLayerNorm(nn.Module):
    """LayerNorm without weight or bias, in float32 (OLMo 1)."""

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def block_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The norm around a Llama-layout block: RMSNorm ((1 + w) for Gemma), or OLMo 1's."""
    if cfg.plain_layer_norms:
        return PlainLayerNorm(cfg.rms_norm_eps)
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.gemma)


class GatedMLP(nn.Module):
    """Gated MLP: SwiGLU (silu) for Llama and Qwen (and MoE shared experts), GeGLU (tanh GELU)
    for Gemma."""

    def __init__(self, d: int, f: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.act = ACT_FNS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class XIELU(nn.Module):
    """Apertus's xIELU, with its learned parameters (transformers' `XIELUActivation`): a
    quadratic for x > 0, an exponential below, both plus beta * x."""

    def __init__(self):
        super().__init__()
        for name in ("alpha_p", "alpha_n"):
            self.register_parameter(name, nn.Parameter(torch.zeros(1)))
        for name in ("beta", "eps"):  # buffers in the checkpoint, held as parameters here
            self.register_parameter(name, nn.Parameter(torch.zeros(())))

    def forward(self, x: Tensor) -> Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        negative = (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x, negative) + self.beta * x


class UpDownMLP(nn.Module):
    """Up, activation, down, no gate, under the checkpoint's names (Phi's `fc1` / `fc2`,
    StarCoder2's `c_fc` / `c_proj`, Nemotron's, Arcee's and Apertus's `up_proj` /
    `down_proj`); Apertus's activation has parameters of its own (`act`)."""

    def __init__(self, d: int, f: int, act: str, names: tuple[str, str], bias: bool = False):
        super().__init__()
        self.names = names  # looked up at each call: tensor parallelism replaces the modules
        self.add_module(names[0], nn.Linear(d, f, bias=bias))
        self.add_module(names[1], nn.Linear(f, d, bias=bias))
        self.act = XIELU() if act == "xielu" else ACT_FNS[act]

    def forward(self, x: Tensor) -> Tensor:
        up, down = (getattr(self, name) for name in self.names)
        return down(self.act(up(x)))


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first `cos.shape[-1]` dims of each head (all of them unless partial)."""
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rot * cos + rotate_half(x_rot) * sin, x_pass], dim=-1)


# CPU graphs with a fixed number of rows (decode, verify, tree, batched) attend through
# kernels/attention.py's kernel, which reads the cache in place (q widened to float32; float32,
# bfloat16 or int8 caches; head_dim a multiple of 16). Other decode graphs attend with
# `attend_one`: Inductor fuses its multiply-sums and softmax into the layer's kernel, where
# SDPA is an extern call per layer; measured on SmolLM2 int8 before the kernel: decode 5.6 ->
# 5.3 ms at position 64, 11.0 -> 9.9 ms at 1000. ONNX export keeps SDPA (MatMul + Softmax)
# for decode too: ONNX Runtime does not fuse the broadcast multiply-sum, and materialising its
# products took a quarter of an ORT decode step.
def attend_one(
    q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float, sinks: Tensor | None = None
) -> Tensor:
    """Masked softmax attention as broadcast multiply-sums: [b, h, m, d] x [b, h, n, d]."""
    scores = (q.unsqueeze(3) * keys.unsqueeze(2)).sum(-1) * scale
    probs = attention.softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), sinks)
    return (probs.unsqueeze(-1) * values.unsqueeze(2)).sum(3)


# A few query rows on a GPU (verify, tree, batched steps) attend with `attend_rows`: SDPA's
# memory-efficient kernel runs a few thread blocks over all the keys one tile at a time: 255 us
# a layer of SmolLM2's 5-row verify step over a 2053-key cache on an H100. As two batched
# matmuls and a softmax the compiled verify step went from 9.06 to 3.99 ms (docs/cuda.md).
def rows_as_matmuls(q: Tensor) -> bool:
    """Whether a fixed-width graph's rows attend with `attend_rows`: on a GPU."""
    return q.is_cuda


def attend_rows(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    mask: Tensor,
    scale: float,
    cap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Masked softmax attention as matmuls: [b, h, m, d] x [b, h, n, d]; with `cap`, the
    scores softcapped first (Gemma 2); with `sinks`, `attention.softmax_with_sinks`."""
    b, h = q.shape[:2]

    # bmm on [b * h, ., .], one sequence's heads selected, not reshaped: torch.matmul's own
    # folding reshapes the keys, which on a span of the cache (`key_pos`) guards its length.
    def heads(x: Tensor) -> Tensor:
        return x[0] if b == 1 else x.flatten(0, 1)

    scores = torch.bmm(heads(q), heads(keys).transpose(1, 2)).unflatten(0, (b, h)) * scale
    scores = scores if cap is None else torch.tanh(scores / cap) * cap
    probs = attention.softmax_with_sinks(scores.masked_fill(~mask, float("-inf")), sinks)
    return torch.bmm(heads(probs), heads(values)).unflatten(0, (b, h))


# Where a graph writes its keys and values: the positions `[T]` of its one sequence, or
# (slots [B, 1], positions [B, T]) for a batch of sequences in a slotted cache.
CacheIndex = Tensor | tuple[Tensor, Tensor]
# Which keys (cache slots) each row of a call sees, for a tensor of key slots.
MaskFn = Callable[[Tensor], Tensor]
# A sliding layer's ring cache: where to write, the slot each cell holds, and the call's mask.
Ring = tuple[CacheIndex, Tensor, Tensor]


def write_cache(cache: Tensor, rows: Tensor, write_at: CacheIndex) -> None:
    """Write `rows [b, kv_heads, t, d]` into `cache` at `write_at`, encoded as its dtype."""
    if isinstance(write_at, tuple):
        slots, positions = write_at
        cache[slots, :, positions] = encode_rows(rows.transpose(1, 2), cache.dtype)
    else:
        cache.index_copy_(2, write_at, encode_rows(rows, cache.dtype))


def cached_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    write_at: CacheIndex,
    mask: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    span: slice,
    scale: float,
    cap: float | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Write k/v `[b, kv_heads, t, d]` into the caches at `write_at`, attend q `[b, heads,
    t, d]` to the cache positions `span` (the filled prefix, or a sliding window's part of it)
    under `mask` (`[t, n]`, or `[b, t, n]` for a batch, n the span's length); returns `[b, t,
    heads * d]`. `cap`: Gemma 2's softcap of the scores, `sinks`: gpt-oss's sink logit per
    head `[heads]`; SDPA takes neither: without the cache kernel such layers attend as
    matmuls."""
    b, _, t, head_dim = q.shape
    kv_heads = k.shape[1]
    group = q.shape[1] // kv_heads
    batch = isinstance(write_at, tuple)
    slots = write_at[0][:, 0] if batch else None  # each sequence's cache row
    write_cache(k_cache, k, write_at)
    write_cache(v_cache, v, write_at)
    # GQA without repeating K/V: fold each KV head's group of query heads into the
    # query-length axis ([b, kv, group * t, d]), so no expanded K/V copy per layer.
    q = q.reshape(b, kv_heads, group * t, head_dim)
    fixed_width = isinstance(t, int) and not torch.onnx.is_in_onnx_export()
    # A narrower cache's prefill with a softcap or sinks too: as matmuls on a decoded span,
    # whose length is data-dependent, it fails to compile (Inductor's bmm lowering guards on
    # that length).
    explicit = cap is not None or sinks is not None  # scores SDPA cannot take
    capped_narrow = explicit and k_cache.dtype != q.dtype
    if (fixed_width or capped_narrow) and attention.applies(q, k_cache):  # cache read in place
        c = cap or 0.0
        if span.start is not None:  # the kernel attends from the view's first position
            k_cache, v_cache = k_cache[:, :, span.start :], v_cache[:, :, span.start :]
        scaled = q.float() * scale  # the kernel takes float32 q (a bfloat16 model's widened)
        extra = () if sinks is None else (sinks.float(),)
        if batch:
            y = torch.ops.aotgen.attend_cache_slots(
                scaled, k_cache, v_cache, mask, slots, c, *extra
            )
        else:
            y = torch.ops.aotgen.attend_cache(scaled, k_cache, v_cache, mask, c, *extra)
        y = y.to(q.dtype)
    else:
        # Attend only to the span of the cache, not all of it.
        rows = slots if batch else slice(None)
        keys = decode_rows(k_cache[rows, :, span], q.dtype)
        values = decode_rows(v_cache[rows, :, span], q.dtype)
        mask = mask.repeat(1, group, 1).unsqueeze(1) if batch else mask.repeat(group, 1)
        sink_rows = None if sinks is None else attention.row_sinks(sinks, kv_heads, t)
        if fixed_width and t == 1 and cap is None:  # decode graph
            y = attend_one(q, keys, values, mask, scale, sink_rows)
        elif explicit or (fixed_width and rows_as_matmuls(q)):
            y = attend_rows(q, keys, values, mask, scale, cap, sink_rows)
        else:
            y = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    # unflatten+permute, not view(b, -1, t, d): export cannot prove the view's stride
    # guard for a dynamic t (prefill failed to export).
    return y.unflatten(2, (group, t)).permute(0, 3, 1, 2, 4).reshape(b, t, -1)


class CausalLM(nn.Module):
    """The shared forward. A family provides `logits(x)` (and, where its modules are not under
    `model` as in HF's layout, `decoder_layers` and `embed(tokens)`),
    the names of its embedding and head weights (`EMBED`, `HEAD`);
    each layer is called as `layer(x, cos, sin, write_at, mask, k_cache, v_cache,
    span)` with its own RoPE rows, mask and span of cache positions (sliding or global)."""

    EMBED: str
    HEAD: str

    def __init__(self, cfg: ModelConfig, cache_len: int):
        super().__init__()
        self.config = cfg
        self.cache_len = cache_len
        self.last_row_only = False  # set while exporting the prefill graph

    def last_row_logits(self, enabled: bool = True) -> AbstractContextManager[None]:
        """Forwards traced inside return the logits of the last position only: `[1, 1, V]`."""
        return self._switched("last_row_only", enabled)

    @contextmanager
    def _switched(self, switch: str, enabled: bool) -> Iterator[None]:
        before = getattr(self, switch)
        setattr(self, switch, enabled)
        try:
            yield
        finally:
            setattr(self, switch, before)

    def tie_weights(self) -> None:
        """A tied head is the embedding table (`HEAD` and `EMBED`: each family's names)."""
        if self.config.tie_word_embeddings:
            head = self.get_submodule(self.HEAD.removesuffix(".weight"))
            head.weight = self.get_submodule(self.EMBED.removesuffix(".weight")).weight

    def init_buffers(self) -> None:
        """RoPE tables and key positions (not in the checkpoint; after a meta init too)."""
        cfg = self.config
        cos, sin = rope_tables(cfg, self.cache_len)
        gain = query_gain(cfg, self.cache_len)
        if gain is not None:  # q's rows beside k's: rotating q by them scales it too
            cos, sin = torch.cat([cos, cos * gain], -1), torch.cat([sin, sin * gain], -1)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if cfg.rope_local_theta is not None:  # the sliding layers' base, never scaled
            cos, sin = rope_tables(cfg, self.cache_len, cfg.rope_local_theta, scaled=False)
            self.register_buffer("rope_local_cos", cos, persistent=False)
            self.register_buffer("rope_local_sin", sin, persistent=False)
        self.register_buffer("key_positions", torch.arange(self.cache_len), persistent=False)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The layers; HF's layout keeps them at `model.layers` (GPT-NeoX overrides)."""
        return self.model.layers

    def embed(self, tokens: Tensor) -> Tensor:
        return self.model.embed_tokens(tokens)

    def logits(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(
        self,
        tokens: Tensor,
        input_pos: Tensor,
        caches: list[Tensor],
        tree_mask: Tensor | None = None,
        slots: Tensor | None = None,
        key_pos: Tensor | None = None,
    ) -> Tensor:
        x = self.embed(tokens)
        if slots is not None:
            return self._batch_forward(x, input_pos, caches, slots)
        t = tokens.shape[1]
        start = input_pos[0]
        if key_pos is not None:  # the caller says how far: no host read
            attn_len = key_pos.shape[0]
        elif tree_mask is None:
            # Positions in one call are consecutive, so the last one bounds what is attended to.
            attn_len = input_pos[-1].item() + 1
        else:
            attn_len = start.item() + t
        torch._check(attn_len >= 1)
        torch._check(attn_len <= self.cache_len)
        keys = self.key_positions[:attn_len] if key_pos is None else key_pos
        if tree_mask is None:
            # Each row's keys and values go to the slot of its position.
            write_at = input_pos
            last = input_pos[-1]

            def sees(keys: Tensor) -> Tensor:
                return keys.unsqueeze(0) <= input_pos.unsqueeze(1)

        else:
            # A token tree (runtime/tree.py): row i is written to slot input_pos[0] + i and has
            # RoPE position input_pos[i] (input_pos[0] plus its depth); tree_mask [T, T] says
            # which rows each row sees (its ancestors and itself), next to the whole prefix.
            write_at = start + self.key_positions[:t]
            last = write_at[-1]

            def sees(keys: Tensor) -> Tensor:
                rel = keys - start  # < 0 on the prefix, else the key's tree row
                seen = tree_mask.index_select(1, rel.clamp(0, t - 1))
                if key_pos is not None:  # keys past the tree (rel >= t) are not its rows
                    seen = seen & (rel < t).unsqueeze(0)
                return (rel < 0).unsqueeze(0) | seen

        ring = self._ring(caches, write_at, last, attn_len, sees)
        history = self._conv_history(input_pos, tree_mask)
        last_row, prefix = self.last_row_only, key_pos is None
        return self._layers(
            x,
            input_pos,
            write_at,
            caches,
            keys,
            sees(keys),
            history,
            last_row,
            ring=ring,
            prefix_keys=prefix,
        )

    def _batch_forward(
        self, x: Tensor, input_pos: Tensor, caches: list[Tensor], slots: Tensor
    ) -> Tensor:
        """B sequences, each at its own positions `input_pos [B, T]`, in cache rows `slots`.
        Every row attends up to the furthest position in the batch, masked to its own."""
        attn_len = input_pos.max().item() + 1
        torch._check(attn_len >= 1)
        torch._check(attn_len <= self.cache_len)
        keys = self.key_positions[:attn_len]
        write_at = (slots.unsqueeze(1), input_pos)

        def sees(keys: Tensor) -> Tensor:  # [B, T, keys]
            return keys <= input_pos.unsqueeze(-1)

        # Each sequence's ring cells hold the positions up to its own last one.
        ring = self._ring(caches, write_at, input_pos[:, -1:].unsqueeze(-1), attn_len, sees)
        history = self._conv_history(input_pos)
        return self._layers(
            x, input_pos, write_at, caches, keys, sees(keys), history, heads_dim=True, ring=ring
        )

    def _ring(
        self,
        caches: list[Tensor],
        write_at: CacheIndex,
        last: Tensor,
        attn_len: int,
        sees: MaskFn,
    ) -> Ring | None:
        """Where sliding layers with a ring cache (fewer cells than `cache_len`, position p in
        cell p % cells) write, and which position each cell holds: the latest one up to
        `last`, the call's furthest slot. The recipe sizes the ring so that every key a row's
        window sees is still there (window + the widest call's rows)."""
        cfg = self.config
        layer = next((i for i in range(cfg.num_hidden_layers) if cfg.is_sliding(i)), None)
        cells = None if layer is None else caches[2 * layer].shape[2]
        if cells is None or cells == self.cache_len:
            return None
        # Cells past the furthest position hold nothing yet: attend the first `attn_len`.
        cell = self.key_positions[: torch.sym_min(attn_len, cells)]
        held = last - (last - cell) % cells
        if isinstance(write_at, tuple):
            ring_write: CacheIndex = (write_at[0], write_at[1] % cells)
        else:
            ring_write = write_at % cells
        # held < 0: a cell this sequence has not reached (a shorter one of a batch).
        return ring_write, held, sees(held) & (held >= 0)

    def _conv_history(
        self, input_pos: Tensor, tree_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """For convolution layers (LFM2): where each row's `lag`-th earlier position is in
        its cache, `[lags, *input_pos.shape]` (lag 1 first), and whether it exists (the
        sequence does not start before 0). Rows are consecutive positions written at their
        own positions, except in a token tree, whose rows sit at slot `input_pos[0] + row`:
        there a row's earlier positions inside the tree are its ancestors' slots."""
        lags = self.config.conv_kernel - 1
        if lags < 1:
            return None
        past = torch.stack([input_pos - lag for lag in range(1, lags + 1)])
        at = past.clamp(min=0)
        if tree_mask is not None:
            start = input_pos[0]
            # [lags, T, T]: row r of the tree is row i's ancestor at the lag's position.
            ancestor = tree_mask.unsqueeze(0) & (input_pos == past.unsqueeze(-1))
            row = ancestor.to(torch.int64).argmax(-1)
            at = torch.where(past < start, at, start + row)
        return at, past >= 0

    def _layers(
        self,
        x: Tensor,
        input_pos: Tensor,
        write_at: CacheIndex,
        caches: list[Tensor],
        keys: Tensor,
        mask: Tensor,
        history: tuple[Tensor, Tensor] | None,
        last_row: bool = False,
        heads_dim: bool = False,
        ring: Ring | None = None,
        prefix_keys: bool = True,
    ) -> Tensor:
        """The decoder layers and the head over the cache positions `keys`; each layer gets the
        RoPE rows, where to write, mask and span of keys of its kind (sliding or global), a
        convolution layer no RoPE and, for a mask, where its rows' earlier positions are
        (`history`). `heads_dim`: positions are `[B, T]`, so the RoPE rows get a heads axis to
        broadcast against `[B, heads, T, d]`. `ring`: the sliding layers' ring cells (`_ring`).
        `prefix_keys`: `keys` are the positions from 0 (not a caller's `key_pos`), so sliding
        layers may start at their window."""
        cfg = self.config
        dtype = x.dtype
        attn_len = keys.shape[0]

        def rope(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
            cos, sin = cos[input_pos].to(dtype), sin[input_pos].to(dtype)
            return (cos.unsqueeze(1), sin.unsqueeze(1)) if heads_dim else (cos, sin)

        filled = slice(None, attn_len)  # the filled prefix
        glob = (*rope(self.rope_cos, self.rope_sin), write_at, mask, filled)
        local = glob
        if cfg.sliding_window:
            span = filled
            local_write = write_at
            if ring is not None:  # every cell, masked to the positions it holds
                if not prefix_keys:
                    raise ValueError("a ring cache takes no key_pos: build with a full cache")
                local_write, keys, mask = ring
                span = slice(None, keys.shape[-1])
            elif prefix_keys:
                # No row sees a key before the earliest row's window: attend from there.
                first = (input_pos.min() - cfg.sliding_window + 1).clamp(min=0).item()
                torch._check(first >= 0)
                torch._check(first < attn_len)
                keys, mask, span = keys[first:], mask[..., first:], slice(first, attn_len)
            # Tree rows' slots are never behind their positions, so the window keeps them.
            window = mask & (keys > input_pos.unsqueeze(-1) - cfg.sliding_window)
            cos_sin = glob[:2]
            if cfg.rope_local_theta is not None:
                cos_sin = rope(self.rope_local_cos, self.rope_local_sin)
            local = (*cos_sin, local_write, window, span)
        for i, layer in enumerate(self.decoder_layers):
            c, s, at, m, span = local if cfg.is_sliding(i) else glob
            if cfg.is_conv(i):
                c, s, m = None, None, history
            x = layer(x, c, s, at, m, caches[2 * i], caches[2 * i + 1], span)
        if last_row:
            x = x[:, -1:]
        return self.logits(x).float()


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    return logits if cap is None else torch.tanh(logits / cap) * cap
