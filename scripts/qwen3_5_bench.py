"""Qwen3.5 speed on CPU: aotgen against llama.cpp on one random-weight checkpoint of
Qwen3.5-0.8B's layer shape (no Qwen3.5 checkpoint ships offline; speed does not depend on the
weights' values).

    python scripts/qwen3_5_bench.py [--work DIR] [--llamacpp BIN_DIR]

Shape: 24 layers, three of every four linear attention (16 key and 16 value heads of 128, a
4-wide convolution) and the fourth gated full attention (8 heads / 2 KV heads of 256, a
quarter rotated), hidden 1024, MLP 3,584, with SmolLM2's 49,152-token vocabulary and tokenizer
(llama.cpp's converter knows it; Qwen3.5's own has 248,320): 547 M parameters. Prints `aotgen
bench` for the fp32 and int8 packages, and `llama-bench` on the same weights in F32 and Q8_0
(converted with llama.cpp's convert_hf_to_gguf.py `--no-mtp`, then llama-quantize).
"""

from __future__ import annotations

from moe_bench import arguments, build_and_bench, llama_bench, random_checkpoint

SHAPE = dict(
    num_hidden_layers=24,
    hidden_size=1024,
    intermediate_size=3584,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def main() -> None:
    args = arguments("artifacts/qwen3_5-bench")
    work = args.work.resolve()
    ckpt = random_checkpoint(work / "checkpoint", "Qwen3_5TextConfig", SHAPE)
    builds = [
        ("qwen3_5-fp32", ["-m", "aotgen", "build"], ""),
        ("qwen3_5-int8", ["-m", "aotgen", "build"], "quantize: {linear: int8}\n"),
    ]
    build_and_bench(work, ckpt, builds)
    # The checkpoint has no multi-token-prediction layer, which the converter otherwise expects.
    llama_bench(work, ckpt, "qwen3_5", args.llamacpp, ("Q8_0",), ("--no-mtp",))


if __name__ == "__main__":
    main()
