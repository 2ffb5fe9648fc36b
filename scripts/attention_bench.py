"""One layer's attention over a KV cache prefix, per call: the few-row kernel
(kernels/attention.cpp, as a plain library) against what the graphs ran before it: SDPA on
the prefix slice (one sequence) or on the gathered slots (a batch). SmolLM2's shapes (3 KV
heads, 3 query heads each, head_dim 64); interleaved rounds, the best median. (One-row decode
graphs fused their attention into Inductor's kernels, which cannot be timed alone.) Then a
step's attention over 30 layers' caches, each read from memory as in a package, with float32,
bfloat16 and int8 caches (`kv_cache_dtype`).

    python scripts/attention_bench.py
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from aotgen.kernels import attention as at
from aotgen.kernels.cache_rows import encode_rows

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
    layers()


def layers(count: int = 30) -> None:
    """One step's attention over `count` layers' caches (SmolLM2's 30: 189 MB of float32 at
    4,096 keys, past the CPU's caches): the median of 15 interleaved steps per cache dtype."""
    print(f"rows @ keys: ms per step of {count} layers, float32 / bfloat16 / int8 caches")
    lib = at.library()
    for tokens, keys in ((1, 1024), (5, 1024), (1, 4096), (5, 4096), (1, 8000), (5, 8000)):
        q = torch.randn(1, HEADS, GROUP * tokens, DIM) * DIM**-0.5
        mask = torch.ones(tokens, keys, dtype=torch.bool)
        wide = [[torch.randn(1, HEADS, keys, DIM) for _ in range(2)] for _ in range(count)]
        caches = {
            str(dtype): [[encode_rows(c, dtype) for c in kv] for kv in wide]
            for dtype in (torch.float32, torch.bfloat16, torch.int8)
        }
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(15):
            for name, kvs in caches.items():
                start = time.perf_counter()
                for k, v in kvs:
                    at.run_library(lib, q, k, v, mask)
                times[name].append(time.perf_counter() - start)
        f32, bf16, int8 = (sorted(t)[len(t) // 2] * 1e3 for t in times.values())
        print(f"{tokens} @ {keys}: {f32:.2f} / {bf16:.2f} / {int8:.2f}")


if __name__ == "__main__":
    main()
