"""Batched-graph step times of serving packages, interleaved in one process: `batch_decode`
and `batch_verify` for 8 sequences at a few positions (each sequence in its own cache slot,
every row at the same position), the median of 20 calls, the best of 3 rounds.

    python scripts/batch_step_times.py artifacts/smollm2-135m-serve [OTHER ...]
"""

from __future__ import annotations

import argparse

import torch

from aotgen.bench import median_call_ms
from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine

SEQUENCES, POSITIONS = 8, (200, 1000)


def main(paths: list[str]) -> None:
    torch.set_num_threads(2)
    runners = {p: Engine.load(p, slots=0).target for p in paths}
    slots = torch.arange(SEQUENCES)
    best: dict[str, dict[str, float]] = {p: {} for p in paths}
    for _ in range(3):
        for path, r in runners.items():
            for pos in POSITIONS:
                for s in range(SEQUENCES):  # a filled prefix in every slot
                    r.forward(list(range(100, 100 + pos)), 0, slot=s)
                for graph, rows in (("batch_decode", 1), ("batch_verify", r.verify_len)):
                    tokens = torch.full((SEQUENCES, rows), 7)
                    positions = torch.arange(pos, pos + rows).repeat(SEQUENCES, 1)
                    ms = median_call_ms(
                        lambda r=r, g=graph, t=tokens, p=positions: r.batch(g, t, p, slots), 20
                    )
                    key = f"{graph} @ {pos}"
                    best[path][key] = min(ms, best[path].get(key, ms))
    for path, steps in best.items():
        shown = ", ".join(f"{key} {ms:.1f} ms" for key, ms in steps.items())
        print(f"{path} ({SEQUENCES} sequences): {shown}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", help="serving package directories (artifacts/NAME)")
    args = ap.parse_args()
    script_main(lambda: main(args.packages))
