"""Perplexity of aotgen packages and of llama.cpp's `llama-perplexity` with llama.cpp's protocol.

    python scripts/llamacpp_perplexity.py FILE.gguf artifacts/A [artifacts/B ...] [--ctx 512]

The text (default: aotgen/data/heldout.txt) is tokenized once, with BOS where the GGUF asks for
it, and cut into chunks of `--ctx` tokens; each chunk starts from an empty cache with its first
token replaced by BOS, and only the predictions of its second half count (llama-perplexity's
`perplexity()`). The packages run through `Engine` on all positions; llama-perplexity runs from
$LLAMA_CPP_BIN (scripts: ../shared/tools/llamacpp.sh) on the same file. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from pathlib import Path

import gguf
import torch

from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine

HELDOUT = Path(__file__).resolve().parents[1] / "aotgen" / "data" / "heldout.txt"


def add_bos(path: Path) -> bool:
    """llama.cpp's choice: the file's `tokenizer.ggml.add_bos_token`, else SentencePiece
    vocabularies add BOS and GPT-2-style ones do not."""
    reader = gguf.GGUFReader(path)
    field = reader.fields.get("tokenizer.ggml.add_bos_token")
    if field is not None:
        return bool(field.parts[field.data[0]][0])
    model = reader.fields["tokenizer.ggml.model"]
    return bytes(model.parts[model.data[0]]).decode() == "llama"


@torch.no_grad()
def package_perplexity(package: Path, text: str, ctx: int, bos: bool) -> tuple[float, int]:
    engine = Engine.load(package)
    runner, tok = engine.target, engine.tokenizer
    bos_id = tok.bos_id
    ids = ([bos_id] if bos else []) + tok.encode(text)
    nll, count, first = 0.0, 0, ctx // 2
    for start in range(0, len(ids) // ctx * ctx, ctx):
        chunk = ids[start : start + ctx]
        if bos:
            chunk = [bos_id, *chunk[1:]]
        for c in runner.caches:
            c.zero_()
        logits = runner.forward(chunk, 0, all_logits=True).float()
        logp = torch.log_softmax(logits[first : ctx - 1], dim=-1)
        targets = torch.tensor(ids[start + first + 1 : start + ctx])
        nll -= logp.gather(1, targets[:, None]).sum().item()
        count += len(targets)
    return math.exp(nll / count), count


def llamacpp_perplexity(gguf_path: Path, text_path: Path, ctx: int, threads: int) -> float:
    binary = Path(os.environ.get("LLAMA_CPP_BIN", "")) / "llama-perplexity"
    cmd = [str(binary), "-m", str(gguf_path), "-f", str(text_path), "-c", str(ctx)]
    cmd += ["-b", str(ctx), "-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if not found:
        raise SystemExit(f"no final estimate in llama-perplexity's output:\n{out.stderr[-2000:]}")
    return float(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("packages", type=Path, nargs="+")
    parser.add_argument("--text", type=Path, default=HELDOUT)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = args.text.read_text()
    bos = add_bos(args.gguf)
    result = {"text": args.text.name, "ctx": args.ctx, "add_bos": bos, "packages": {}}
    for package in args.packages:
        ppl, tokens = package_perplexity(package, text, args.ctx, bos)
        result["packages"][str(package)] = round(ppl, 4)
        result["tokens_scored"] = tokens
    result["llama_perplexity"] = llamacpp_perplexity(args.gguf, args.text, args.ctx, args.threads)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    script_main(main)
