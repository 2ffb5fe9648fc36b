"""The gated delta rule (Qwen3.5's linear attention) over a ring of recurrent states.

A linear-attention layer remembers the past as one `[Dk, Dv]` matrix per value head, updated
token by token. The graphs keep that state like keys and values, by position: the state after
position p sits in cell `p % cells` of the layer's cache (`[slots, Hv, cells, Dk * Dv]`), and a
call starting at p0 reads the state after p0 - 1. A rejected speculative row's state stays
in its cell until a later call overwrites it, so nothing is saved or restored; the ring has
room for the widest call plus the convolution's lags (`recipe.py: state_cells`).

`gated_delta_rule` is a `torch.library` custom op that writes the states in place. Its eager
implementation below defines it; AOTInductor links `gated_delta.cpp` into each graph's `.so`
as its C shim (export/shims.py). A prompt of any length runs through the same recurrence:
on a CPU it costs 4 Dk Dv multiply-adds per token and head, next to the layer's matmuls.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("gated_delta.cpp")


@torch.library.custom_op("aotgen::gated_delta_rule", mutates_args=("state",))
def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    slots: Tensor,
    positions: Tensor,
) -> Tensor:
    """q, k `[B, T, Hk, Dk]` (float32; q l2-normed and scaled, k l2-normed), v `[B, T, Hv,
    Dv]`, the log decay g and the write strength beta `[B, T, Hv]`; sequence b runs in cache
    row `slots[b]` of `state` at `positions[b]` (consecutive). Value head h reads key head
    h // (Hv / Hk). Returns `[B, T, Hv, Dv]`; writes the state after each of the last
    min(T, cells) rows to its position's cell."""
    bsz, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    cells = state.shape[2]
    group = hv // hk
    out = q.new_empty(bsz, t, hv, dv)
    written = min(t, cells)
    for b in range(bsz):
        ring = state[int(slots[b])]  # [Hv, cells, Dk * Dv]
        start = int(positions[b, 0])
        s = (
            ring[:, (start - 1) % cells].view(hv, dk, dv).clone()
            if start > 0
            else q.new_zeros(hv, dk, dv)
        )
        qs = q[b].repeat_interleave(group, dim=1)  # [T, Hv, Dk]
        ks = k[b].repeat_interleave(group, dim=1)
        for i in range(t):
            s = s * g[b, i].exp()[:, None, None]
            kv = (s * ks[i][:, :, None]).sum(1)
            delta = (v[b, i] - kv) * beta[b, i][:, None]
            s = s + ks[i][:, :, None] * delta[:, None, :]
            out[b, i] = (s * qs[i][:, :, None]).sum(1)
            if i >= t - written:
                ring[:, int(positions[b, i]) % cells] = s.reshape(hv, dk * dv)
    return out


@gated_delta_rule.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: object) -> Tensor:
    return v.new_empty(v.shape)


OPS = (torch.ops.aotgen.gated_delta_rule.default,)
