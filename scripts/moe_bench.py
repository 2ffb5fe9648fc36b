"""Mixture-of-experts speed on CPU: aotgen with its grouped expert kernel, aotgen with the
fixed-shape formulation the kernel replaces, and llama.cpp, on one random-weight Qwen3-MoE
checkpoint (no MoE checkpoint ships offline; speed does not depend on the weights' values).

    python scripts/moe_bench.py [--work DIR] [--llamacpp BIN_DIR]
                                [--family gpt-oss | --keep | --rows]

Shape: 8 layers, hidden 1024, 16 heads / 4 KV heads, 32 experts of 512, 4 a token, SmolLM2's
49,152-token vocabulary and tokenizer (llama.cpp's converter knows it): 478 M parameters,
125 M of them read per decoded token. Prints `aotgen bench` for the fp32 package, the same without
the kernel, the int8 package (experts int8 per channel) and the bfloat16 one, and `llama-bench`
on the same weights in F32, Q8_0 and BF16 (converted with llama.cpp's convert_hf_to_gguf.py,
then llama-quantize).

`--family gpt-oss`: the same shape as gpt-oss (q/k/v/o, router and expert biases, attention
sinks, a 128-position window on every other layer, its clamped SwiGLU, an untied head): the
fp32 and int8 packages against llama.cpp's F32 and Q8_0.

`--rows`: the fp32, int8 and bf16 packages with their experts on packed panels (the default for
CPU packages; bf16 where the build measured the panels faster than the CPU's bfloat16 matmul)
and in rows (the gather and the rows' kernel), against llama.cpp's F32, Q8_0 and BF16.

`--keep`: llama.cpp's own Q4_K_M and Q8_0 files of the Qwen3-MoE weights (llama-quantize),
imported and built with `quantize: {gguf: keep}` (experts and linears on the files' blocks;
float activations, and int8 ones: llama.cpp's numerics), against `llama-bench` on the same
files.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMACPP = Path.home() / ".cache/aotgen-llamacpp"
SHAPE = dict(
    num_hidden_layers=8,
    hidden_size=1024,
    intermediate_size=2048,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    norm_topk_prob=True,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def patched_build(patch: str) -> list[str]:
    """python arguments running `aotgen build` after `patch` (one statement)."""
    build = "from aotgen.cli import main; sys.argv = ['aotgen', 'build', *sys.argv[1:]]; main()"
    return ["-c", f"import sys; {patch}; {build}"]


# The fixed-shape build: the op's kernel switched off for the whole build.
WITHOUT_KERNEL = patched_build("import aotgen.kernels.moe as m; m.applies = lambda x: False")
# The experts in rows: packing them in panels switched off for the whole build.
IN_ROWS = patched_build("import aotgen.passes.pack_experts as p; p.packable = lambda *_: False")


def random_checkpoint(out: Path, config_class: str, shape: dict) -> Path:
    """A random-weight transformers checkpoint with SmolLM2's tokenizer (49,152 tokens)."""
    import torch
    import transformers

    if (out / "model.safetensors").exists():
        return out
    tokenizer = REPO / "checkpoints/smollm2-135m"
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    config_cls = getattr(transformers, config_class)
    config = config_cls(**shape, vocab_size=49152, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def build_and_bench(work: Path, ckpt: Path, builds: list[tuple[str, list[str], str]]) -> None:
    """Build each (name, python arguments, recipe lines) of `ckpt` and `aotgen bench` them
    interleaved (recipe lines with a `checkpoint:` of their own build that one). `--force`: the
    packed tiles measured again (run it on a quiet machine)."""
    packages = []
    for name, build, extra in builds:
        path = work / f"{name}.yaml"
        lines = extra if "checkpoint:" in extra else f"checkpoint: {ckpt}\n{extra}"
        path.write_text(f"name: {name}\n{lines}max_seq_len: 512\nprefill_chunk: 128\n")
        subprocess.run([sys.executable, *build, str(path), "--force"], cwd=work, check=True)
        packages.append(str(work / "artifacts" / name))
    bench = [sys.executable, "-m", "aotgen", "bench", *packages, "--prompt-len", "128"]
    subprocess.run([*bench, "--gen-tokens", "64", "--runs", "3"], cwd=work, check=True)


def llama_files(
    work: Path,
    ckpt: Path,
    stem: str,
    bin_dir: Path,
    kinds: tuple[str, ...],
    convert_args: tuple[str, ...] = (),
) -> list[Path]:
    """The checkpoint converted by llama.cpp (F32, with `convert_args`), and quantized to
    `kinds`."""
    gguf = work / f"{stem}-f32.gguf"
    converter = LLAMACPP / "src/vendor/llama.cpp/convert_hf_to_gguf.py"
    if not gguf.exists():
        convert = [sys.executable, str(converter), str(ckpt), "--outtype", "f32", *convert_args]
        subprocess.run([*convert, "--outfile", str(gguf)], check=True)
    quantized = {kind: work / f"{stem}-{kind.lower()}.gguf" for kind in kinds}
    for kind, path in quantized.items():
        if not path.exists():
            quantize = [str(bin_dir / "llama-quantize"), str(gguf), str(path), kind]
            subprocess.run(quantize, check=True, capture_output=True)
    return [gguf, *quantized.values()]


def llama_bench(
    work: Path,
    ckpt: Path,
    stem: str,
    bin_dir: Path,
    kinds: tuple[str, ...],
    convert_args: tuple[str, ...] = (),
    depths: str = "0",
) -> None:
    """llama-bench on `llama_files`, after `depths` tokens in the cache."""
    for model in llama_files(work, ckpt, stem, bin_dir, kinds, convert_args):
        command = [str(bin_dir / "llama-bench"), "-m", str(model), "-t", "2"]
        subprocess.run([*command, "-p", "128", "-n", "64", "-r", "3", "-d", depths], check=True)


def arguments(default_work: str, families: tuple[str, ...] = ()) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=REPO / default_work)
    parser.add_argument("--llamacpp", type=Path, default=LLAMACPP / "build/bin")
    parser.add_argument("--keep", action="store_true", help="GGUF blocks kept, against llama.cpp")
    parser.add_argument("--rows", action="store_true", help="experts on panels and in rows")
    if families:
        parser.add_argument("--family", choices=families, default=families[0])
    return parser.parse_args()


# gpt-oss's layout at SHAPE's size (its experts as wide as moe_intermediate_size).
GPT_OSS_SHAPE = {
    **{k: v for k, v in SHAPE.items() if k not in ("intermediate_size", "norm_topk_prob")},
    "intermediate_size": SHAPE["moe_intermediate_size"],
    "num_local_experts": SHAPE["num_experts"],
    "sliding_window": 128,
    "tie_word_embeddings": False,
}


def main() -> None:
    args = arguments("artifacts/moe-bench", ("qwen3-moe", "gpt-oss"))
    if args.family == "gpt-oss":
        work = args.work.resolve().with_name(args.work.name + "-gpt-oss")
        ckpt = random_checkpoint(work / "checkpoint", "GptOssConfig", GPT_OSS_SHAPE)
        builds = [
            ("gpt-oss-fp32", ["-m", "aotgen", "build"], ""),
            ("gpt-oss-int8", ["-m", "aotgen", "build"], "quantize: {linear: int8}\n"),
        ]
        build_and_bench(work, ckpt, builds)
        llama_bench(work, ckpt, "gpt-oss", args.llamacpp, ("Q8_0",))
        return
    work = args.work.resolve()
    ckpt = random_checkpoint(work / "checkpoint", "Qwen3MoeConfig", SHAPE)
    if args.keep:
        keep_bench(work, ckpt, args.llamacpp)
        return
    if args.rows:
        int8, bf16 = "quantize: {linear: int8}\n", "dtype: bfloat16\n"
        builds = [
            ("moe-panels", ["-m", "aotgen", "build"], ""),
            ("moe-rows", IN_ROWS, ""),
            ("moe-int8-panels", ["-m", "aotgen", "build"], int8),
            ("moe-int8-rows", IN_ROWS, int8),
            ("moe-bf16-panels", ["-m", "aotgen", "build"], bf16),
            ("moe-bf16-rows", IN_ROWS, bf16),
        ]
        build_and_bench(work, ckpt, builds)
        llama_bench(work, ckpt, "moe", args.llamacpp, ("Q8_0", "BF16"))
        return
    builds = [
        ("moe-kernel", ["-m", "aotgen", "build"], ""),
        ("moe-fixed", WITHOUT_KERNEL, ""),
        ("moe-int8", ["-m", "aotgen", "build"], "quantize: {linear: int8}\n"),
        ("moe-bf16", ["-m", "aotgen", "build"], "dtype: bfloat16\n"),
    ]
    build_and_bench(work, ckpt, builds)
    llama_bench(work, ckpt, "moe", args.llamacpp, ("Q8_0", "BF16"))


def keep_bench(work: Path, ckpt: Path, bin_dir: Path) -> None:
    """llama.cpp's Q4_K_M and Q8_0 files imported and built with `gguf: keep` (float and int8
    activations), benched interleaved, then llama-bench on the same files."""
    kinds = ("Q4_K_M", "Q8_0")
    files = llama_files(work, ckpt, "moe", bin_dir, kinds)[1:]
    builds = []
    for kind, gguf in zip(kinds, files, strict=True):
        imported = work / f"imported-{kind.lower()}"
        if not (imported / "config.json").exists():
            command = [sys.executable, "-m", "aotgen", "import-gguf", str(gguf), str(imported)]
            subprocess.run(command, check=True)
        for suffix, activations in (("", "float32"), ("-dot", "int8")):
            recipe = (
                f"checkpoint: {imported}\nquantize: {{gguf: keep, activations: {activations}}}\n"
            )
            builds.append((f"moe-keep-{kind.lower()}{suffix}", ["-m", "aotgen", "build"], recipe))
    build_and_bench(work, ckpt, builds)
    for gguf in files:
        command = [str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", "2"]
        subprocess.run([*command, "-p", "128", "-n", "64", "-r", "3"], check=True)


if __name__ == "__main__":
    main()
