"""Latent attention speed on CPU: aotgen's decode over the latent cache (queries absorbed, the
cache read in place), the same package with its decode graphs expanding the cached latents into
every head's keys and values each step (transformers' way), and llama.cpp, on one random-weight
DeepSeek-V2 checkpoint (no such checkpoint ships offline; speed does not depend on the weights'
values).

    python scripts/mla_bench.py [--work DIR] [--llamacpp BIN_DIR]

Shape: DeepSeek-V2's attention at V2-Lite's width (16 heads, q through a rank-1536
bottleneck, a 512-dim latent and a 64-dim shared rotated key, 128 unrotated key and 128 value
dims a head) on 8 dense layers of hidden 2048 and MLP 2816, SmolLM2's 49,152-token vocabulary
and tokenizer (llama.cpp's converter knows it), a tied head: 362 M parameters. Prints `aotgen
bench` for the latent fp32 package, the expanding one, the int8 one, int8 with `kv_b_proj`
float and int4 (g64) at a 128- and a 2,048-token prompt, and `llama-bench` on the same
weights in F32, Q8_0, Q4_0 and Q4_1 at depths 0 and 2,048.
"""

from __future__ import annotations

import subprocess
import sys

from moe_bench import arguments, llama_bench, random_checkpoint

SHAPE = dict(
    num_hidden_layers=8,
    hidden_size=2048,
    intermediate_size=2816,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=1536,  # llama.cpp takes no q without a bottleneck but at V2-Lite's 27 layers
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    first_k_dense_replace=8,  # every layer dense
    n_routed_experts=8,
    num_experts_per_tok=2,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)
# The expanding build: the cache kernel switched off for the whole build, so the decode graphs
# expand the cached latents (model/mla.py) as prefill does.
EXPANDING = (
    "import sys, aotgen.kernels.attention as a; a.applies = lambda *_: False; "
    "from aotgen.cli import main; sys.argv = ['aotgen', 'build', *sys.argv[1:]]; main()"
)
BUILD = ["-m", "aotgen", "build"]
BUILDS = [
    ("mla-latent", BUILD, ""),
    ("mla-expanding", ["-c", EXPANDING], ""),
    ("mla-int8", BUILD, "quantize: {linear: int8}\n"),
    # kv_b_proj kept float32, as the graph pass alone would leave it (passes/quantize_latent.py)
    ("mla-int8-kv_b-float", BUILD, "quantize: {linear: int8, skip: ['*.kv_b_proj']}\n"),
    ("mla-int4", BUILD, "quantize: {linear: int4}\n"),
]


def main() -> None:
    args = arguments("artifacts/mla-bench")
    work = args.work.resolve()
    ckpt = random_checkpoint(work / "checkpoint", "DeepseekV2Config", SHAPE)
    recipe = f"checkpoint: {ckpt}\nmax_seq_len: 2304\nprefill_chunk: 256\n"
    packages = []
    for name, build, extra in BUILDS:
        path = work / f"{name}.yaml"
        path.write_text(f"name: {name}\n{recipe}{extra}")
        subprocess.run([sys.executable, *build, str(path), "--force"], cwd=work, check=True)
        packages.append(str(work / "artifacts" / name))
    for prompt in ("128", "2048"):
        bench = [sys.executable, "-m", "aotgen", "bench", *packages, "--prompt-len", prompt]
        subprocess.run([*bench, "--gen-tokens", "32", "--runs", "3"], cwd=work, check=True)
    llama_bench(work, ckpt, "mla", args.llamacpp, ("Q8_0", "Q4_0", "Q4_1"), depths="0,2048")


if __name__ == "__main__":
    main()
