"""A bounded load test of a running `aotgen serve`: N streamed chat requests, C at a time.

    python scripts/load_test.py http://127.0.0.1:8000 --requests 64 --concurrency 8

Loopback by default and bounded in count and time (--timeout per request, --max-seconds for
the whole run). Prints throughput and latency percentiles; --json prints them as one object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Who wrote Romeo and Juliet?",
    "What do bees make?",
]


def one_request(client: httpx.Client, i: int, max_tokens: int) -> dict:
    """One streamed chat request: its time to first token, total time and tokens."""
    body = {
        "messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            elif first is None and event["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
    return {
        "status": 200,
        "ttft": first or 0.0,
        "latency": time.perf_counter() - t0,
        "tokens": tokens,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return (
        ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", nargs="?", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or args.requests > 10_000:
        ap.error("--requests must be in 1..10000 and --concurrency >= 1")
    start = time.perf_counter()
    results = []
    with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
        with ThreadPoolExecutor(args.concurrency) as pool:
            futures = [
                pool.submit(one_request, client, i, args.max_tokens) for i in range(args.requests)
            ]
            for f in futures:
                left = args.max_seconds - (time.perf_counter() - start)
                try:
                    results.append(f.result(timeout=max(left, 0.0)))
                except Exception as e:  # a timeout or a connection error counts as failed
                    results.append({"status": type(e).__name__})
    wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200]
    report = {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        **{
            f"{name}_p{q}_ms": percentile([r[name] * 1e3 for r in ok], q / 100)
            for name in ("ttft", "latency")
            for q in (50, 90, 99)
        },
        "mean_tokens": statistics.fmean(r["tokens"] for r in ok) if ok else 0.0,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{report['ok']}/{args.requests} ok in {wall:.1f} s at concurrency {args.concurrency}: "
            f"{report['requests_per_s']:.2f} req/s, {report['tokens_per_s']:.1f} tok/s; "
            f"TTFT p50/p90/p99 {report['ttft_p50_ms']:.0f}/{report['ttft_p90_ms']:.0f}/"
            f"{report['ttft_p99_ms']:.0f} ms; latency p50/p90/p99 {report['latency_p50_ms']:.0f}/"
            f"{report['latency_p90_ms']:.0f}/{report['latency_p99_ms']:.0f} ms"
        )
    return report


if __name__ == "__main__":
    sys.exit(0 if main()["failed"] == 0 else 1)
