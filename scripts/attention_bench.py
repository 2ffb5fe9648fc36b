"""One layer's attention over a KV cache prefix, per call: the few-row kernel
(kernels/attention.cpp, as a plain library) against what the graphs ran before it: SDPA on
the prefix slice (one sequence) or on the gathered slots (a batch). SmolLM2's shapes (3 KV
heads, 3 query heads each, head_dim 64); interleaved rounds, the best median. (One-row decode
graphs fused their attention into Inductor's kernels, which cannot be timed alone.)

    python scripts/attention_bench.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from aotgen.kernels import attention as at

HEADS, GROUP, DIM, CACHE = 3, 3, 64, 2056


def median_us(fn, calls: int = 200) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e6


def cases(batch: int, tokens: int, keys: int) -> dict:
    q = torch.randn(batch, HEADS, GROUP * tokens, DIM) * DIM**-0.5
    k, v = (torch.randn(max(batch, 1), HEADS, CACHE, DIM) for _ in range(2))
    lib = at.library()
    if batch == 1:
        mask = torch.ones(tokens, keys, dtype=torch.bool)
        full = mask.repeat(GROUP, 1)
        return {
            "kernel": lambda: at.run_library(lib, q, k, v, mask),
            "sdpa": lambda: F.scaled_dot_product_attention(
                q, k[:, :, :keys], v[:, :, :keys], attn_mask=full, scale=1.0
            ),
        }
    slots = torch.arange(batch).flip(0)
    mask = torch.ones(batch, tokens, keys, dtype=torch.bool)
    full = mask.repeat(1, GROUP, 1).unsqueeze(1)
    return {
        "kernel": lambda: at.run_library(lib, q, k, v, mask, slots),
        "gather + sdpa": lambda: F.scaled_dot_product_attention(
            q, k[slots, :, :keys], v[slots, :, :keys], attn_mask=full, scale=1.0
        ),
    }


def main() -> None:
    torch.set_num_threads(2)
    print("sequences x rows @ keys: median us per call (best of 5 interleaved rounds)")
    for batch, tokens, keys in (
        (1, 1, 205), (1, 5, 205), (1, 7, 205), (1, 7, 1005), (1, 5, 2005),
        (8, 1, 205), (8, 1, 1005), (8, 5, 205),
    ):  # fmt: skip
        runs = cases(batch, tokens, keys)
        for fn in runs.values():  # warm
            for _ in range(20):
                fn()
        best = {name: float("inf") for name in runs}
        for _ in range(5):
            for name, fn in runs.items():
                best[name] = min(best[name], median_us(fn))
        shown = ", ".join(f"{name} {us:.1f}" for name, us in best.items())
        print(f"{batch} x {tokens} @ {keys}: {shown}")


if __name__ == "__main__":
    main()
