"""`aotgen bench`: packages side by side (plain, speculative, tensor-parallel, serving
concurrency), with llama.cpp as a same-run baseline."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from aotgen.cli.common import (
    CliError,
    app,
    at_least,
    check_backend,
    print_json,
    resolve_threads,
    user_errors_exit,
    wide_console,
)

if TYPE_CHECKING:
    from aotgen.bench import BenchResult, SpecBenchRow
    from aotgen.runtime.sampling import SamplingParams


@app.command()
@user_errors_exit
def bench(
    packages: Annotated[list[Path], typer.Argument(help="one or more artifacts/NAME")],
    prompt_len: Annotated[int, typer.Option(help="prompt tokens per generation")] = 128,
    gen_tokens: Annotated[
        int,
        typer.Option(help="new tokens per generation (--speculative: at least 96)"),
    ] = 64,
    runs: Annotated[
        int,
        typer.Option(
            help="timed runs per package, taken round-robin (--speculative: passes over the "
            "prompts, the modes taking turns on each prompt)"
        ),
    ] = 5,
    threads: Annotated[
        int | None, typer.Option(help="intra-op threads, >= 1 (default: aotgen.toml's)")
    ] = None,
    speculative: Annotated[
        bool, typer.Option(help="plain vs n-gram vs draft speculative decode, in one run")
    ] = False,
    k: Annotated[int | None, typer.Option(help="draft length for --speculative")] = None,
    draft_parallel: Annotated[
        int, typer.Option(help="tree rows of --speculative (packages with tree_nodes): N")
    ] = 4,
    p_split: Annotated[float, typer.Option(help="tree rows: the branch threshold")] = 0.1,
    best_first: Annotated[
        bool, typer.Option(help="tree rows: best-first trees (see `run`)")
    ] = False,
    temperature: Annotated[
        float,
        typer.Option(help="--speculative: 0 = greedy; higher samples every mode (seeded)"),
    ] = 0.0,
    top_p: Annotated[float, typer.Option(help="--speculative with --temperature: nucleus")] = 1.0,
    llama_cpp: Annotated[
        list[Path] | None,
        typer.Option(
            help="GGUF file to run through llama.cpp in the same run, as a baseline "
            "(repeatable; needs the optional llama-cpp-python: pip install 'aotgen[llamacpp]'; "
            "with --concurrency, llama.cpp's llama-batched-bench from $LLAMA_CPP_BIN or PATH; "
            "with --turns, its llama-server)"
        ),
    ] = None,
    llama_lookup: Annotated[
        Path | None,
        typer.Option(
            help="with --speculative: a GGUF of the same weights that llama.cpp's llama-lookup "
            "runs on the grounded prompts, as a baseline (binary from $LLAMA_CPP_BIN or PATH)"
        ),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            help="runtime backend per package (repeatable: each package runs with each, side by "
            "side): aoti (default) or onnxruntime (its ONNX graphs; formats: [aoti, onnx])"
        ),
    ] = None,
    concurrency: Annotated[
        str | None,
        typer.Option(
            help="serving: requests at once per level, e.g. 1,4,8,16 (the batch engine; with "
            "--llama-cpp GGUF, llama.cpp's llama-batched-bench beside it)"
        ),
    ] = None,
    shared_prompt: Annotated[
        bool,
        typer.Option(
            help="with --concurrency: every request sends one prompt (a shared system prompt), "
            "found in the cache vs run per request (llama-batched-bench: -pps)"
        ),
    ] = False,
    turns: Annotated[
        int | None,
        typer.Option(
            help="a chat of N turns: time to each turn's first token with the conversation "
            "found in the KV cache (prefix reuse) vs the prompt run whole"
        ),
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option("--json", help="print the results as one JSON object on stdout"),
    ] = False,
) -> None:
    """Prefill/decode tok/s, ms/token, weight and KV-cache bytes/token and roofline ratio, side
    by side."""
    for option, value in (("--prompt-len", prompt_len), ("--gen-tokens", gen_tokens)):
        at_least(option, value)
    at_least("--runs", runs)
    at_least("--k", k)
    at_least("--draft-parallel", draft_parallel)
    if not 0.0 <= p_split <= 1.0:
        raise CliError(f"--p-split must be in 0..1, got {p_split}")
    from aotgen.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    if not sampling.greedy and not speculative:
        raise CliError("--temperature samples the --speculative comparison: add --speculative")
    threads = resolve_threads(threads)
    backends = list(dict.fromkeys(backend or ["aoti"]))
    for b in backends:
        check_backend(b)
    report: dict[str, Any] = {"threads": threads, "isa": _isa()}
    if backends != ["aoti"] and speculative:
        raise CliError("--speculative benchmarks the aoti backend only; drop --backend")
    if llama_lookup and not speculative:
        raise CliError("--llama-lookup compares n-gram speculation: add --speculative")
    if llama_lookup and not llama_lookup.is_file():
        raise CliError(f"--llama-lookup {llama_lookup}: no such GGUF file")
    if shared_prompt and concurrency is None:
        raise CliError("--shared-prompt shapes the --concurrency benchmark: add --concurrency")
    if turns is not None:
        at_least("--turns", turns)
        if llama_cpp and len(llama_cpp) > 1:
            raise CliError("--turns compares one GGUF: give --llama-cpp once")
        gguf = llama_cpp[0] if llama_cpp else None
        report["turns"] = [
            _bench_chat(p, turns, gen_tokens, runs, threads, gguf, as_json) for p in packages
        ]
        if as_json:
            print_json(report)
        return
    if concurrency is not None:
        levels = _levels(concurrency)
        report["concurrency"] = _bench_concurrency(
            packages,
            levels,
            prompt_len,
            gen_tokens,
            runs,
            threads,
            llama_cpp,
            as_json,
            shared_prompt,
        )
        if as_json:
            print_json(report)
        return
    if speculative:
        report["speculative"] = [
            _bench_speculative(
                p,
                gen_tokens,
                k,
                threads,
                runs,
                as_json,
                llama_lookup,
                (draft_parallel, p_split, best_first),
                sampling,
            )
            for p in packages
        ]
        if as_json:
            print_json(report)
        return
    _bench_plain(
        packages, backends, llama_cpp, prompt_len, gen_tokens, runs, threads, as_json, report
    )


def _bench_plain(
    packages: list[Path],
    backends: list[str],
    llama_cpp: list[Path] | None,
    prompt_len: int,
    gen_tokens: int,
    runs: int,
    threads: int,
    as_json: bool,
    report: dict[str, Any],
) -> None:
    """Prefill and decode of each package (and GGUF) side by side, into `report` (--json) or
    a table."""
    from aotgen.bench import LlamaCppRunner, PackageRunner, bench_interleaved, measure_bandwidth
    from aotgen.runtime.distributed import package_world_size

    tp = [p for p in packages if package_world_size(p) > 1]
    if tp and backends != ["aoti"]:
        raise CliError(f"{tp[0]} is tensor-parallel: it runs with the aoti backend only")
    report["tensor_parallel"] = [
        _bench_tp(p, prompt_len, gen_tokens, runs, threads, as_json) for p in tp
    ]
    packages = [p for p in packages if p not in tp]
    results = []
    bandwidth: dict[str, float] = {}
    if packages or llama_cpp:
        runners = [
            PackageRunner(p, prompt_len, gen_tokens, threads, b, label=len(backends) > 1)
            for p in packages
            for b in backends
        ]
        runners += [LlamaCppRunner(g, prompt_len, gen_tokens, threads) for g in llama_cpp or []]
        results = bench_interleaved(runners, runs)
        bandwidth = {d: measure_bandwidth(device=d) for d in sorted({r.device for r in results})}
    if as_json:
        report |= {
            "prompt_len": prompt_len,
            "gen_tokens": gen_tokens,
            "runs": runs,
            "bandwidth_gb_s": bandwidth,
            "results": [
                dataclasses.asdict(r) | {"roofline": r.roofline(bandwidth[r.device])}
                for r in results
            ],
        }
        print_json(report)
    elif results:
        title = (
            f"decode greedy, prompt {prompt_len}, {gen_tokens} new tokens, median of {runs} "
            "(runs interleaved)"
        )
        _print_results(results, bandwidth, title, threads)


def _print_results(
    results: list[BenchResult], bandwidth: dict[str, float], title: str, threads: int
) -> None:
    """The plain benchmark's table, one row per package and backend, and the bandwidth."""
    table = Table(title=title)
    for col in (
        "package",
        "load s",
        "prefill tok/s",
        "decode tok/s",
        "ms/token",
        "weights MB/token",
        "KV MB/token",
        "roofline",
    ):
        table.add_column(col, justify="left" if col == "package" else "right", no_wrap=True)
    for r in results:
        table.add_row(
            r.package,
            f"{r.load_s:.2f}",
            f"{r.prefill_tok_s:.1f}",
            f"{r.decode_tok_s:.1f}",
            f"{r.decode_ms:.2f}",
            f"{r.weight_bytes / 1e6:.0f}",
            f"{r.kv_bytes / 1e6:.1f}",
            f"{r.roofline(bandwidth[r.device]):.0%}",
        )
    wide_console().print(table)
    measured = ", ".join(f"{d} {bw:.1f} GB/s" for d, bw in bandwidth.items())
    Console().print(
        f"measured read bandwidth {measured} (torch sum over 512 MiB, best of 5), "
        + _cpu_line(threads)
    )


def _levels(concurrency: str) -> list[int]:
    try:
        levels = [int(x) for x in concurrency.split(",")]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise CliError(f"--concurrency takes whole numbers >= 1 like 1,4,8,16, got {concurrency!r}")
    return levels


def _bench_concurrency(
    packages: list[Path],
    levels: list[int],
    prompt_len: int,
    gen_tokens: int,
    runs: int,
    threads: int | None,
    llama_cpp: list[Path] | None,
    as_json: bool,
    shared: bool,
) -> list[dict[str, Any]]:
    import torch

    from aotgen.bench_serving import bench_concurrency, llama_batched_bench

    sizes = (prompt_len, gen_tokens, runs)
    rows = [r for p in packages for r in bench_concurrency(p, levels, *sizes, shared=shared)]
    for gguf in llama_cpp or []:
        threads_used = threads or torch.get_num_threads()
        rows += llama_batched_bench(gguf, levels, prompt_len, gen_tokens, threads_used, shared)
    if not as_json:
        table = Table(
            title=f"many requests at once: {'one shared ' if shared else ''}prompt {prompt_len}, "
            f"{gen_tokens} new tokens each, median of {runs}"
        )
        columns = ("runtime", "requests", "aggregate decode tok/s", "TTFT p50 ms", "TTFT p99 ms")
        for col in (*columns, "per-request tok/s", "all first tokens ms"):
            table.add_column(col, justify="left" if col == "runtime" else "right", no_wrap=True)
        for r in rows:
            cells = (r.ttft_p50_ms, r.ttft_p99_ms, r.request_tok_s, r.all_first_ms)
            table.add_row(
                r.name,
                str(r.concurrency),
                f"{r.aggregate_tok_s:.1f}",
                *("-" if c != c else f"{c:.0f}" if c > 100 else f"{c:.1f}" for c in cells),
            )
        wide_console().print(table)
        Console().print(_cpu_line(threads))
    return [dataclasses.asdict(r) for r in rows]


def _bench_chat(
    package: Path,
    turns: int,
    gen_tokens: int,
    runs: int,
    threads: int | None,
    gguf: Path | None,
    as_json: bool,
) -> dict[str, Any]:
    from aotgen.bench_chat import bench_chat

    rows = bench_chat(package, turns, gen_tokens, runs, threads, gguf)
    if not as_json:
        table = Table(
            title=f"{package.name}: a chat of {turns} turns, up to {gen_tokens} new tokens each, "
            f"time to first token, median of {runs} conversations"
        )
        cols = ["turn", "prompt tokens", "cached", "whole ms", "reused ms", "speed-up"]
        cols += ["llama.cpp ms", "llama.cpp cached"] if gguf else []
        for col in cols:
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("same text")
        for r in rows:
            llama = [f"{r.llama_cpp_ms:.1f}", str(r.llama_cpp_cached)] if gguf else []
            table.add_row(
                str(r.turn),
                str(r.prompt_tokens),
                str(r.cached_tokens),
                f"{r.ttft_whole_ms:.1f}",
                f"{r.ttft_reused_ms:.1f}",
                f"{r.ttft_whole_ms / r.ttft_reused_ms:.2f}×",
                *llama,
                "yes" if r.same_text else "no (near-tie)",
            )
        wide_console().print(table)
        Console().print(_cpu_line(threads))
    return {"package": package.name, "rows": [dataclasses.asdict(r) for r in rows]}


def _isa() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


def _cpu_line(threads: int | None) -> str:
    """The CPU's vector ISA decides which kernels are fast (int4 and int8 differ most between
    AVX2 and AVX-512), so every benchmark says which one it ran on."""
    return f"threads {threads or 'torch default'}, CPU kernels {_isa()}"


def _bench_tp(
    package: Path, prompt_len: int, gen_tokens: int, runs: int, threads: int | None, as_json: bool
) -> dict[str, Any]:
    from aotgen.runtime.distributed import bench_tp

    r = bench_tp(package, prompt_len, gen_tokens, runs, threads)
    if not as_json:
        Console().print(
            f"{package.name}: tensor parallel ×{r.world_size} ({r.threads_per_rank} thread/rank)"
            f" · prefill {r.prefill_tok_s:.1f} tok/s · decode {r.decode_tok_s:.1f} tok/s "
            f"({r.decode_ms:.2f} ms/step) · all_reduce {r.all_reduce_ms:.3f} ms × "
            f"{r.all_reduces_per_step}/step ≈ {r.comm_ms:.2f} ms collective, "
            f"≈ {max(r.decode_ms - r.comm_ms, 0):.2f} ms compute per step"
        )
    return dataclasses.asdict(r)


def _bench_speculative(
    package: Path,
    gen_tokens: int,
    k: int | None,
    threads: int | None,
    rounds: int,
    as_json: bool,
    llama_lookup: Path | None,
    tree: tuple[int, float, bool],
    sampling: SamplingParams,
) -> dict[str, Any]:
    from aotgen.bench import bench_speculative
    from aotgen.runtime.tree_draft import TreeParams

    rows, costs = bench_speculative(
        package, max(gen_tokens, 96), k, threads, rounds, llama_lookup, TreeParams(*tree), sampling
    )
    if not as_json:
        wide_console().print(_speculative_table(package, rows, sampling))
        _print_speculative_costs(rows, costs, threads)
    return {"package": package.name, "rows": [dataclasses.asdict(r) for r in rows], **costs}


def _speculative_table(package: Path, rows: list[SpecBenchRow], sampling: SamplingParams) -> Table:
    """One row per task and mode, speed-ups against the same task's plain row."""
    plain = {r.task: r for r in rows if r.mode == "plain"}
    t, p = sampling.temperature, sampling.top_p
    how = "greedy" if sampling.greedy else f"sampled (temperature {t:g}, top-p {p:g})"
    table = Table(title=f"{package.name}: {how}, plain vs speculative (same run)")
    for col in (
        "task",
        "mode",
        "decode tok/s",
        "speed-up",
        "end-to-end tok/s",
        "speed-up",
        "acceptance",
        "tok/step",
        "by position",
        "branch won",
        "same text",
    ):
        table.add_column(col)
    for r in rows:
        by_pos = " ".join(f"{a:.2f}" for a in r.by_position) if r.by_position else ""
        table.add_row(
            r.task,
            r.mode,
            f"{r.decode_tok_s:.1f}",
            f"{r.decode_tok_s / plain[r.task].decode_tok_s:.2f}×",
            f"{r.tok_s:.1f}",
            f"{r.tok_s / plain[r.task].tok_s:.2f}×",
            "" if r.mode == "plain" else f"{r.acceptance:.3f}",
            "" if r.mode == "plain" else f"{r.mean_accepted_length:.2f}",
            by_pos,
            f"{r.branch_steps}/{r.steps}" if r.mode.endswith(" tree") else "",
            {True: "yes", False: "no (near-tie)", None: ""}[r.same_as_plain],
        )
    return table


def _print_speculative_costs(
    rows: list[SpecBenchRow], costs: dict[str, float], threads: int | None
) -> None:
    """n-gram against llama-lookup where both ran, and the step costs that bound speed-ups."""
    by_mode = {(r.task, r.mode): r for r in rows}
    for (task, mode), r in by_mode.items():
        if mode == "llama-lookup" and (task, "ngram") in by_mode:
            ours = by_mode[(task, "ngram")]
            ratio = ours.decode_tok_s / r.decode_tok_s
            wide_console().print(
                f"{task}: aotgen n-gram / llama-lookup decode {ratio:.2f}×, "
                f"acceptance {ours.acceptance:.3f} vs {r.acceptance:.3f}"
            )
    d = costs["decode_ms"]
    v = costs["verify_ms"]
    line = f"decode step {d:.2f} ms · verify step {v:.2f} ms (v = {v / d:.2f})"
    if "draft_ms" in costs:
        line += f" · draft step {costs['draft_ms']:.2f} ms (c = {costs['draft_ms'] / d:.2f})"
    if "tree_ms" in costs:
        line += f" · tree step {costs['tree_ms']:.2f} ms ({costs['tree_ms'] / d:.2f})"
    line += "\nend to end: prompt prefill included (the same in every mode); " + _cpu_line(threads)
    wide_console().print(line)
