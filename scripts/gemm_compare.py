"""Per linear shape: aotgen's packed-panel kernel (kernels/packed.py, best tile from the build's
autotune), Inductor's C++ GEMM template (`max-autotune`, weight frozen and prepacked by
Inductor) and plain `F.linear` (oneDNN/MKL), float32, in µs per call and GFLOP/s.

A comparison of kernels, not packages: the template adds prepacked weight constants that a
package with its weights outside the `.so` does not carry (docs/benchmarks.md). The template's
kernel is timed through the generated module's `call` (what AOTInductor would run, without
Dynamo's guards); the whole `torch.compile` call is shown beside it. Every candidate allocates
its output per call, as in a graph. Candidates are interleaved per shape, in rotating order;
the median of the rounds counts. Inductor's cache makes a second run compile nothing.

    python scripts/gemm_compare.py            # both models, M = 1, 7, 32, 128
    python scripts/gemm_compare.py --quick    # SmolLM2-135M, M = 1, 7
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch import nn
from torch._inductor.codecache import PyCodeCache

from aotgen.kernels import packed as pk
from aotgen.model.config import ModelConfig
from aotgen.package.autotune import Autotune, cpu_model

# The fields of the checkpoints' config.json that set the linear shapes; read from
# checkpoints/<dir>/config.json instead where it exists.
MODELS = {
    "SmolLM2-135M": (
        "smollm2-135m", dict(hidden=576, inter=1536, heads=9, kv=3, hd=64, vocab=49152)
    ),
    "Gemma 3 270M": (
        "gemma3-270m", dict(hidden=640, inter=2048, heads=4, kv=1, hd=256, vocab=262144)
    ),
}  # fmt: skip
ROWS = (1, 7, 32, 128)


def model_dims(checkpoint: str, fallback: dict[str, int]) -> dict[str, int]:
    path = Path("checkpoints") / checkpoint / "config.json"
    if not path.exists():
        return fallback
    c = ModelConfig.from_hf(json.loads(path.read_text()))
    return dict(
        hidden=c.hidden_size, inter=c.intermediate_size, heads=c.num_attention_heads,
        kv=c.num_key_value_heads, hd=c.head_dim, vocab=c.vocab_size,
    )  # fmt: skip


def linear_shapes(d: dict[str, int]) -> list[tuple[str, int, int]]:
    """(name, N, K) of a layer's linears after fuse_linears (q/k/v and gate/up) and the head."""
    q = d["heads"] * d["hd"]
    return [
        ("qkv", q + 2 * d["kv"] * d["hd"], d["hidden"]),
        ("o_proj", d["hidden"], q),
        ("gate_up", 2 * d["inter"], d["hidden"]),
        ("down", d["hidden"], d["inter"]),
        ("head", d["vocab"], d["hidden"]),
    ]


def interleaved_us(fns: dict[str, Callable], budget_s: float) -> dict[str, float]:
    """Median µs per call of each fn: rounds of batched calls (about 1 ms a batch), the
    candidates in rotating order within each round, after two warm-up calls; 3 to 25 rounds,
    as many as fit in `budget_s` of wall time."""
    single = {}
    for name, fn in fns.items():
        fn()
        t0 = time.perf_counter()
        fn()
        single[name] = max(time.perf_counter() - t0, 1e-7)
    batch = {name: max(1, min(200, round(1e-3 / t))) for name, t in single.items()}
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    r = 0
    while r < 3 or (r < 25 and time.perf_counter() - start < budget_s):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn, b = fns[name], batch[name]
            t0 = time.perf_counter()
            for _ in range(b):
                fn()
            times[name].append((time.perf_counter() - t0) / b)
        r += 1
    return {n: sorted(t)[len(t) // 2] * 1e6 for n, t in times.items()}


def compile_template(w: torch.Tensor, m: int, backends: str):
    """torch.compile(max-autotune) of a bias-free linear on the frozen `w` at `m` rows ->
    (compiled fn, generated module, what Inductor chose for the GEMM)."""
    lin = nn.Linear(w.shape[1], w.shape[0], bias=False).eval()
    lin.weight.data = w
    inductor_config.max_autotune_gemm_backends = backends
    torch._dynamo.reset()
    before = len(PyCodeCache.modules)
    fn = torch.compile(lin, mode="max-autotune-no-cudagraphs", dynamic=False)
    fn(torch.randn(m, w.shape[1]))
    mods = [mod for mod in PyCodeCache.modules[before:] if hasattr(mod, "call")]
    if len(mods) != 1:
        raise RuntimeError(f"expected one generated module, found {len(mods)}")
    return fn, mods[0], gemm_choice(Path(mods[0].__file__).read_text())


def gemm_choice(code: str) -> str:
    """'CPP Mr x Nr' when the C++ GEMM template with its micro-GEMM was generated, else the
    kernel the generated `call` runs (with ATEN allowed: MKL's prepacked `_mkl_linear`)."""
    if "micro_gemm" in code:
        mr = re.search(r"constexpr int64_t Mr = (\d+);", code)
        nr = re.search(r"constexpr int64_t Nr = (\d+);", code)
        amx = " AMX" if "amx" in code.lower() else ""
        return f"CPP{amx} {mr[1] if mr else '?'}x{nr[1] if nr else '?'}"
    body = code[code.find("def call") :]
    called = re.search(r"= (torch\.ops\.[\w.]+|extern_kernels\.\w+)\(", body)
    return f"not CPP: {called[1] if called else 'unknown'}"


def release(mod) -> None:
    """Drop the generated module's constants (the prepacked weight): PyCodeCache keeps the
    module alive."""
    for name, value in list(vars(mod).items()):
        if isinstance(value, torch.Tensor):
            setattr(mod, name, None)


def measure(n: int, k: int, m: int, tuner: Autotune, backends: str, budget_s: float) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) / k**0.5
    x = torch.randn(m, k, generator=gen)
    lib = pk.library()
    if lib is None:
        raise SystemExit("no C++ compiler: aotgen's packed kernel cannot be built")
    tile = tuner.choose("float32", n, k, m)
    packed = pk.pack(w)
    fn, mod, choice = compile_template(w, m, backends)
    fns = {
        "aotgen": lambda: pk.run_library(lib, x, packed, None, *tile),
        "inductor": lambda: mod.call([x]),
        "compiled": lambda: fn(x),
        "blas": lambda: F.linear(x, w),
    }
    ref = F.linear(x, w)
    for name, f in fns.items():
        out = f()
        out = out[0] if isinstance(out, (list, tuple)) else out
        if not torch.allclose(out[:, :n], ref, rtol=1e-4, atol=1e-4):
            print(f"  warning: {name} differs from F.linear at {n}x{k}, M={m}")
    us = interleaved_us(fns, budget_s)
    release(mod)
    torch._dynamo.reset()
    return dict(us=us, tile=tile, choice=choice)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="SmolLM2-135M, M = 1 and 7 only")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budget", type=float, default=0.4, help="timing seconds per shape")
    p.add_argument(
        "--backends", default="CPP", help="max_autotune_gemm_backends; CPP,ATEN lets it choose"
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    inductor_config.freezing = True  # the weight becomes a constant the template prepacks
    inductor_config.compile_threads = 1  # no compile worker pool for one kernel at a time
    models = dict(list(MODELS.items())[:1]) if args.quick else MODELS
    rows = ROWS[:2] if args.quick else ROWS

    print(
        f"{cpu_model()}, {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads, "
        f"torch {torch.__version__}, float32, backends={args.backends}\n"
    )
    print(
        "| model | linear | N x K | M | aotgen µs (tile) | Inductor CPP µs (choice) "
        "| torch.compile call µs | F.linear µs | GFLOP/s aotgen / CPP / F.linear |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    start = time.perf_counter()
    with torch.no_grad(), tempfile.TemporaryDirectory() as cache:
        tuner = Autotune(Path(cache))
        for model, (checkpoint, fallback) in models.items():
            for name, n, k in linear_shapes(model_dims(checkpoint, fallback)):
                for m in rows:
                    r = measure(n, k, m, tuner, args.backends, args.budget)
                    gc.collect()
                    us, (tr, tp) = r["us"], r["tile"]
                    gflops = " / ".join(
                        f"{2 * m * n * k / us[c] / 1e3:.1f}" for c in ("aotgen", "inductor", "blas")
                    )
                    print(
                        f"| {model} | {name} | {n}x{k} | {m} | {us['aotgen']:.1f} ({tr}x{tp}) "
                        f"| {us['inductor']:.1f} ({r['choice']}) | {us['compiled']:.1f} "
                        f"| {us['blas']:.1f} | {gflops} |",
                        flush=True,
                    )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
