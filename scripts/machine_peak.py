"""The CPU's measured peaks, to judge the kernels' GFLOP/s and GB/s against
(`scripts/gemm_compare.py`, docs/kernels.md): float32 multiply-adds per second from independent
vector chains, and the read bandwidth of a 512 MB buffer, on 1 thread and on `--threads`.

    python scripts/machine_peak.py --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

from aotgen.cli.common import script_main
from aotgen.kernels.packed import library
from aotgen.package.autotune import cpu_model

SOURCE = Path(__file__).with_suffix(".cpp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5, help="best of this many runs each")
    args = parser.parse_args()
    if args.threads < 1 or args.rounds < 1:
        parser.error("--threads and --rounds must be at least 1")
    lib = library(("-march=native",), source=SOURCE, define="AOTGEN_MACHINE_PEAK")
    if lib is None:
        raise SystemExit("error: no C++ compiler (g++ or c++) on PATH; install one")
    lib.fma_gflops.restype = lib.read_gbps.restype = ctypes.c_double
    print(f"{cpu_model()}, {args.threads} threads")
    for threads in sorted({1, args.threads}):
        steps = ctypes.c_int64(100_000_000)
        flops = max(lib.fma_gflops(threads, steps) for _ in range(args.rounds))
        gbps = lib.read_gbps(threads, ctypes.c_int64(512 << 20), args.rounds)
        print(f"{threads} thread(s): float32 FMA {flops:.1f} GFLOP/s, read {gbps:.1f} GB/s")


if __name__ == "__main__":
    script_main(main)
