"""LFM2 speed on CPU: aotgen against llama.cpp on one random-weight checkpoint of
LFM2-350M's shape (no LFM2 checkpoint ships offline; speed does not depend on the weights'
values).

    python scripts/lfm2_bench.py [--work DIR] [--llamacpp BIN_DIR]

Shape: LFM2-350M's 16 layers (10 gated short convolutions, 6 attention), hidden 1024, 16 heads /
8 KV heads, MLP 4,608, with SmolLM2's 49,152-token vocabulary and tokenizer (llama.cpp's
converter knows it; LFM2's own has 65,536): 336 M parameters. Prints `aotgen bench` for the fp32
and int8 packages, and `llama-bench` on the same weights in F32 and Q8_0 (converted with
llama.cpp's convert_hf_to_gguf.py, then llama-quantize).
"""

from __future__ import annotations

from moe_bench import arguments, build_and_bench, llama_bench, random_checkpoint

CONV, ATTENTION = "conv", "full_attention"
SHAPE = dict(
    num_hidden_layers=16,
    hidden_size=1024,
    intermediate_size=6656,  # LFM2's block_ff_dim: 4,608 once derived
    num_attention_heads=16,
    num_key_value_heads=8,
    layer_types=[CONV, CONV, ATTENTION] * 3
    + [CONV, ATTENTION, CONV, ATTENTION, CONV, ATTENTION, CONV],
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def main() -> None:
    args = arguments("artifacts/lfm2-bench")
    work = args.work.resolve()
    ckpt = random_checkpoint(work / "checkpoint", "Lfm2Config", SHAPE)
    builds = [
        ("lfm2-fp32", ["-m", "aotgen", "build"], ""),
        ("lfm2-int8", ["-m", "aotgen", "build"], "quantize: {linear: int8}\n"),
    ]
    build_and_bench(work, ckpt, builds)
    llama_bench(work, ckpt, "lfm2", args.llamacpp, ("Q8_0",))


if __name__ == "__main__":
    main()
