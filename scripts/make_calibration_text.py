"""Write aotgen/data/calibration.txt: the default calibration text of `method: gptq`.

Data-free calibration (as in LLM-QAT): SmolLM2-135M-Instruct's own samples at temperature 1,
each started from one random token id, so the text covers what the model writes rather
than one domain, and shares nothing with the held-out text the build scores perplexity on.

    python scripts/make_calibration_text.py artifacts/smollm2-135m
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.sampling import SamplingParams

OUT = Path(__file__).resolve().parents[1] / "aotgen" / "data" / "calibration.txt"
SAMPLES, TOKENS = 40, 300


def main(package: str) -> None:
    engine = Engine.load(package)
    starts = torch.randint(200, 5000, (SAMPLES,), generator=torch.Generator().manual_seed(0))
    texts = []
    for i, start in enumerate(starts.tolist()):
        params = SamplingParams(temperature=1.0, seed=i)
        result = engine.generate([start], GenerationConfig(TOKENS, sampling=params))
        ids = [start, *result.token_ids]
        texts.append(engine.tokenizer.decode(ids, skip_special_tokens=True).strip())
    OUT.write_text("\n\n".join(texts) + "\n")
    print(f"wrote {OUT}: {len(engine.tokenizer.encode(OUT.read_text()))} tokens")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("package", help="the SmolLM2 package whose samples make the text")
    script_main(lambda: main(ap.parse_args().package))
