"""Per-graph step times of packages, interleaved in one process: a decode step (1 row), a
verify step (k + 1 rows) and a 128-token prefill chunk, each at position 200; the best of 5
medians. `v` = verify / decode, the cost that bounds speculative speed-ups.

    python scripts/step_times.py artifacts/smollm2-135m artifacts/smollm2-135m-int8
"""

from __future__ import annotations

import argparse

import torch

from aotgen.bench import median_call_ms
from aotgen.cli.common import script_main
from aotgen.runtime.engine import Engine


def main(paths: list[str]) -> None:
    torch.set_num_threads(2)
    runners = {p: Engine.load(p).target for p in paths}
    best: dict[str, dict[str, float]] = {p: {} for p in paths}
    for _ in range(5):
        for path, r in runners.items():
            r.forward(list(range(100, 300)), 0)
            steps = {
                "decode": (lambda r=r: r.decode(5, 200), 30),
                "verify": (lambda r=r: r.forward(list(range(7, 7 + r.verify_len)), 200), 20),
                "prefill": (lambda r=r: r.forward(list(range(300, 428)), 200), 3),
            }
            for name, (fn, calls) in steps.items():
                ms = median_call_ms(fn, calls)
                best[path][name] = min(ms, best[path].get(name, ms))
    for path, ms in best.items():
        rows = runners[path].verify_len
        print(
            f"{path}: decode {ms['decode']:.2f} ms, verify ({rows} rows) {ms['verify']:.2f} ms "
            f"(v = {ms['verify'] / ms['decode']:.2f}), "
            f"prefill 128 {128e3 / ms['prefill']:.0f} tok/s"
        )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("packages", nargs="+", help="package directories (artifacts/NAME)")
    args = ap.parse_args()
    script_main(lambda: main(args.packages))
