"""The build's autotune with another build measuring beside it: two processes time the same
SmolLM2 shapes at the same moment, with the contention check (`settled_us`) or without it
(each candidate's fastest call only), and each shape's timing and tile are compared with one
process timing it alone.

    python scripts/autotune_contention.py --kind gguf-Q4_1 --rows 5 --pairs 3
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from aotgen.cli.common import script_main
from aotgen.package import autotune

# N x K of SmolLM2-135M's packed linears: qkv, o, gate/up, down, the tied head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
SLOW = 3.0  # a timing this many times the lone process's counts as corrupted


def measure(kind: str, rows: int, check: bool) -> dict[str, tuple[list[int], float]]:
    """Each shape's tile and its time (µs), in this process."""
    if not check:
        autotune.settled_us = lambda runs, lib, checked: (autotune.fastest_us(runs), False)
    tuner = autotune.Autotune(None)
    out = {}
    for n, k in SHAPES:
        tile = tuner._measure(kind, n, k, rows)
        out[f"{n}x{k}"] = ([tile.tile_rows, tile.tile_panels], tile.us)
    return out


def pair(kind: str, rows: int, check: bool) -> list[dict]:
    """Two processes measuring at once."""
    cmd = [sys.executable, __file__, "--kind", kind, "--rows", str(rows), "--child"]
    cmd += [] if check else ["--no-check"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    return [json.loads(p.communicate()[0]) for p in procs]


def main(kind: str, rows: int, pairs: int) -> None:
    alone = measure(kind, rows, check=True)
    print(f"{autotune.cpu_model()}, {kind} at {rows} rows; alone: {alone}")
    for _ in range(pairs):
        for check in (False, True):
            for result in pair(kind, rows, check):
                slow = [s for s, (_, us) in result.items() if us > SLOW * alone[s][1]]
                other = [s for s, (tile, _) in result.items() if tile != alone[s][0]]
                print(
                    f"{'check' if check else 'plain'}: {len(slow)}/{len(SHAPES)} timed over "
                    f"{SLOW:.0f}x ({', '.join(f'{s} {result[s][1]:.0f} µs' for s in slow)}); "
                    f"other tiles: {', '.join(f'{s} {result[s][0]}' for s in other) or 'none'}"
                )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="gguf-Q4_1", help="weight kind, as in the tile cache")
    ap.add_argument("--rows", type=int, default=5, help="activation rows per call")
    ap.add_argument("--pairs", type=int, default=3, help="pairs of processes per mode")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-check", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.kind, args.rows, not args.no_check)))
    else:
        script_main(lambda: main(args.kind, args.rows, args.pairs))
