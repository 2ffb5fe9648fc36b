"""CUDA packages, side by side in one process: decode and verify step times with and without
CUDA-graph replay, greedy generation speed against the GPU's measured read bandwidth (the
runtime's loop, which keeps greedy tokens on the GPU, and a host loop that copies each
step's logits back and picks the token on the CPU), the C++ runtime's generation, and a
same-run baseline: the same decode graph compiled by `torch.compile(mode="reduce-overhead")`
(Inductor plus CUDA graphs, gpt-fast's recipe), greedy tokens fed back on the device.

    python scripts/gpu_bench.py recipes/smollm2-135m-cuda.yaml artifacts/smollm2-135m-cuda ...

Arguments come in pairs: a recipe and the package built from it (the baseline is exported
from the recipe's checkpoint with the package's passes). Results also go to `--json FILE`;
`--cpp-run PATH` times the C++ `aotgen-run` on each package too.
`--baseline-only RECIPE ...` runs the baseline alone, e.g. beside the builds, so that its
compile is cached when the full run comes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch

from aotgen.bench import measure_bandwidth, prompt_ids, step_costs, weight_bytes
from aotgen.checkpoint.hf import open_checkpoint
from aotgen.package.compile import export_with_passes
from aotgen.package.models import prepare_models, recipe_kv_cache
from aotgen.recipe import load_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

PROMPT, NEW = 128, 256


def generation(engine: Engine, runs: int = 3) -> tuple[float, float, list[int]]:
    """(decode tok/s, prefill tok/s, ids): median of `runs` greedy generations, eos ignored."""
    prompt = prompt_ids(engine.tokenizer.vocab_size, PROMPT)
    cfg = GenerationConfig(max_new_tokens=NEW, ignore_eos=True)
    engine.generate(prompt, cfg)  # warm-up: captures, autotuned kernels
    results = [engine.generate(prompt, cfg) for _ in range(runs)]
    decode = statistics.median(r.decode_tok_s for r in results)
    prefill = statistics.median(r.prefill_tok_s for r in results)
    return decode, prefill, results[0].token_ids


def compiled_decode_ms(recipe_path: str, steps: int = 512) -> float:
    """ms per greedy decode step of the package's decode graph (exported from the recipe's
    checkpoint with its passes) under torch.compile's CUDA graphs, attending to the whole
    cache; the KV cache is marked static, as transformers' StaticCache does, so the captured
    graph writes it in place."""
    recipe = load_recipe(recipe_path)
    target = prepare_models(recipe, open_checkpoint(recipe.checkpoint))[0]
    cache = recipe_kv_cache(target.config, recipe)
    spec = next(s for s in target.graphs if s.name == "decode")
    module = export_with_passes(target.model, target, spec, cache, False, None).module()
    for c in cache:
        torch._dynamo.mark_static_address(c)

    # Over the whole cache, masked past the position, as gpt-fast attends.
    key_pos = torch.arange(cache[0].shape[2], device=recipe.device)

    def forward(tokens, input_pos, caches):
        return module(tokens, input_pos, caches, None, None, key_pos)

    step = torch.compile(forward, mode="reduce-overhead", fullgraph=True)
    token = torch.zeros(1, 1, dtype=torch.long, device=recipe.device)
    pos = torch.full((1,), PROMPT, dtype=torch.long, device=recipe.device)
    sync = torch.cuda.synchronize if recipe.device == "cuda" else lambda: None

    def run(n: int) -> None:
        for _ in range(n):
            torch.compiler.cudagraph_mark_step_begin()
            logits = step(token, pos, cache)
            token.copy_(logits[:, -1:].argmax(-1))
            pos.add_(1)

    steps = min(steps, recipe.cache_len - PROMPT - 1)
    with torch.no_grad():
        run(8)  # compile, record, capture
        pos.fill_(PROMPT)
        sync()
        t0 = time.perf_counter()
        run(steps)
        sync()
    return (time.perf_counter() - t0) / steps * 1e3


def host_loop_tok_s(engine: Engine) -> float:
    """Greedy decode tok/s of a loop that brings each step's logits to the CPU and picks the
    token there (the round trip that greedy decoding on the GPU avoids)."""
    prompt = prompt_ids(engine.tokenizer.vocab_size, PROMPT)
    target = engine.target

    def run() -> float:
        tok = int(target.forward(prompt, 0).argmax())
        t0 = time.perf_counter()
        for pos in range(PROMPT, PROMPT + NEW - 1):
            tok = int(target.decode(tok, pos).argmax())
        return (NEW - 1) / (time.perf_counter() - t0)

    run()
    return statistics.median(run() for _ in range(3))


def cpp_tok_s(binary: str, package: str) -> float | str:
    """Decode tok/s of the C++ runtime's greedy generation (median of 3 processes), or its
    error."""
    prompt = json.dumps(list(range(100, 100 + PROMPT)))
    args = [binary, package, "--prompt-ids", prompt, "--ids", "--ignore-eos"]
    speeds = []
    for _ in range(3):
        out = subprocess.run(
            [*args, "--max-new-tokens", str(NEW)], capture_output=True, text=True, check=False
        )
        if out.returncode:
            return out.stderr.strip()[-300:]
        speeds.append(json.loads(out.stdout)["decode_tok_s"])
    return statistics.median(speeds)


def bench(recipe: str, package: str, bandwidth: float, cpp_run: str | None) -> dict:
    row: dict = {"package": package}
    engines = {"replayed": Engine.load(package), "direct": Engine.load(package, cuda_graphs=False)}
    wbytes = weight_bytes(engines["replayed"])
    ids = {}
    for name, engine in engines.items():
        costs = step_costs(engine, reps=50)
        decode, prefill, ids[name] = generation(engine)
        row[name] = {
            **costs,
            "v": costs["verify_ms"] / costs["decode_ms"],
            "decode_tok_s": decode,
            "prefill_tok_s": prefill,
            "roofline": wbytes * decode / (bandwidth * 1e9),
            "host_loop_tok_s": host_loop_tok_s(engine),
        }
    row["same_ids"] = ids["replayed"] == ids["direct"]
    row["weight_mb"] = wbytes / 1e6
    del engines
    if cpp_run:
        row["cpp_decode_tok_s"] = cpp_tok_s(cpp_run, package)
    ms = compiled_decode_ms(recipe)
    row["torch_compile"] = {
        "decode_ms": ms,
        "decode_tok_s": 1e3 / ms,
        "roofline": wbytes * 1e3 / ms / (bandwidth * 1e9),
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pairs", nargs="+", help="recipe package [recipe package ...]")
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--cpp-run", default=None, help="the C++ aotgen-run binary to time too")
    parser.add_argument(
        "--baseline-only",
        action="store_true",
        help="only the torch.compile baseline of each recipe (its compile is then cached)",
    )
    args = parser.parse_args()
    if args.baseline_only:
        for recipe in args.pairs:
            print(f"{recipe}: torch.compile decode {compiled_decode_ms(recipe):.3f} ms/step")
        return
    if len(args.pairs) % 2:
        parser.error("give recipe/package pairs")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    bandwidth = measure_bandwidth(device=device)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"{gpu}, torch {torch.__version__}: read bandwidth {bandwidth:.0f} GB/s")
    rows = []
    for recipe, package in zip(args.pairs[::2], args.pairs[1::2], strict=True):
        rows.append(row := bench(recipe, package, bandwidth, args.cpp_run))
        r, d, c = row["replayed"], row["direct"], row["torch_compile"]
        print(
            f"{package}: {row['weight_mb']:.0f} MB of weights\n"
            f"  replayed: decode {r['decode_tok_s']:.1f} tok/s ({r['roofline']:.0%} of roofline), "
            f"step {r['decode_ms']:.3f} ms, verify {r['verify_ms']:.3f} ms (v {r['v']:.2f}), "
            f"prefill {r['prefill_tok_s']:.0f} tok/s; host loop {r['host_loop_tok_s']:.1f} tok/s\n"
            f"  direct:   decode {d['decode_tok_s']:.1f} tok/s ({d['roofline']:.0%}), "
            f"step {d['decode_ms']:.3f} ms, verify {d['verify_ms']:.3f} ms (v {d['v']:.2f}), "
            f"prefill {d['prefill_tok_s']:.0f} tok/s; host loop {d['host_loop_tok_s']:.1f} tok/s\n"
            f"  C++ aotgen-run: decode {row.get('cpp_decode_tok_s')} tok/s\n"
            f"  torch.compile reduce-overhead: decode {c['decode_tok_s']:.1f} tok/s "
            f"({c['roofline']:.0%}), {c['decode_ms']:.3f} ms/step\n"
            f"  replayed ids == direct ids: {row['same_ids']}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"gpu": gpu, "torch": torch.__version__, "bandwidth_gbs": bandwidth, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
