"""The `aotgen` command line: import-gguf, build, run, inspect, bench.

Errors that come from the user's input (recipe, checkpoint, package, prompt) print one
line and exit 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

if TYPE_CHECKING:
    from aotgen.runtime.sampling import SamplingParams

app = typer.Typer(add_completion=False, no_args_is_help=True)
console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")
# torch seeds its generators with an unsigned 64-bit integer (so does the C++ runtime); the
# same bound as runtime/sampling.py's, kept here so that `--help` does not import torch.
SEED_MAX = 2**64 - 1


class CliError(ValueError):
    """A command-line value out of range or unusable, reported like every other user error."""


def _wide_console() -> Console:
    """Stdout at least 150 columns wide, so bench tables do not wrap in narrow terminals."""
    return Console(width=max(Console().width, 150))


def _user_errors() -> tuple[type[Exception], ...]:
    from aotgen.bench import BenchError
    from aotgen.checkpoint.hf import CheckpointError
    from aotgen.package.manifest import PackageError
    from aotgen.recipe import ProjectError, RecipeError
    from aotgen.runtime.distributed import LaunchError
    from aotgen.runtime.engine import GenerationError

    return (
        CliError,
        BenchError,
        ProjectError,
        RecipeError,
        CheckpointError,
        PackageError,
        GenerationError,
        LaunchError,
        FileNotFoundError,
        FileExistsError,
        ValueError,
    )


def _fail(e: Exception) -> NoReturn:
    """`error: MESSAGE` as one line on stderr (a message spanning lines is joined), exit 1."""
    message = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def user_errors_exit(fn: Callable[P, R]) -> Callable[P, R]:
    """Run a command so that bad input prints one `error: ...` line and exits 1; any other
    exception is a bug and keeps its traceback."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except _user_errors() as e:
            _fail(e)

    return wrapper


def _print_json(obj: Any, indent: int | None = None) -> None:
    """One JSON document on stdout; NaN (a row without speculation) becomes null, since
    strict JSON readers refuse NaN."""

    def clean(x: Any) -> Any:
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    print(json.dumps(clean(obj), indent=indent, ensure_ascii=False, allow_nan=False))


def _at_least(option: str, value: int | None, low: int = 1) -> None:
    """Refuse a count below `low` (None: the option was not given)."""
    if value is not None and value < low:
        raise CliError(f"{option} must be >= {low}, got {value}")


BACKEND_HELP = (
    "aoti: the AOTInductor graphs; onnxruntime: the package's ONNX graphs through ONNX Runtime "
    "(a recipe with formats: [aoti, onnx]; pip install 'aotgen[onnx]')"
)


def _check_backend(backend: str) -> None:
    from aotgen.runtime.onnx_backend import BACKENDS

    if backend not in BACKENDS:
        raise CliError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def _threads(threads: int | None) -> int | None:
    """--threads if given (>= 1), else aotgen.toml's `threads` (0 there: torch's default)."""
    from aotgen.recipe import Project

    if threads is not None:
        _at_least("--threads", threads)
        return threads
    return Project.load().threads or None


def _read_prompt_file(path: Path) -> str:
    """The prompt file's text; errors name the file and what is wrong with it."""
    if path.is_dir():
        raise CliError(f"--prompt-file {path}: is a directory; give a UTF-8 text file")
    if not path.is_file():
        raise CliError(f"--prompt-file {path}: no such file")
    try:
        return path.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise CliError(
            f"--prompt-file {path}: not UTF-8 text (invalid byte at offset {e.start}); "
            "save it as UTF-8"
        ) from None


def _version(value: bool) -> None:
    """`--version`: the ISA is printed because packages only load on the ISA they were
    compiled for."""
    if not value:
        return
    import torch

    from aotgen import __version__
    from aotgen.package.manifest import target_info

    target = target_info()
    print(f"aotgen {__version__}")
    print(f"torch {torch.__version__}")
    print(f"CPU ISA {target['isa']} ({target['platform']})")
    raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="print the aotgen and torch versions and the CPU ISA packages built here "
            "target, then exit",
            callback=_version,
            is_eager=True,
        ),
    ] = False,
) -> None:
    """Compile LLM checkpoints ahead of time into self-contained packages (`aotgen build
    recipes/NAME.yaml`) and run them without model code (`aotgen run artifacts/NAME`)."""


@app.command("import-gguf")
@user_errors_exit
def import_gguf_cmd(
    gguf_file: Annotated[
        Path,
        typer.Argument(help="a .gguf file, or 'smollm2' / 'gemma3-270m' for a bundled one"),
    ],
    out_dir: Annotated[Path, typer.Argument(help="HF-layout checkpoint dir to write")],
    overwrite: Annotated[
        bool, typer.Option(help="replace OUT_DIR if it already exists and is not empty")
    ] = False,
) -> None:
    """GGUF → Hugging Face-layout checkpoint dir (dequantized fp32 safetensors + tokenizer)."""
    from aotgen.checkpoint.gguf import import_gguf, resolve_gguf

    src = resolve_gguf(gguf_file)
    with console.status(f"importing {src.name}"):
        import_gguf(src, out_dir, overwrite=overwrite)
    console.print(f"wrote {out_dir}")


class _RichProgress:
    def __init__(self, progress: Progress):
        self.progress, self.tasks = progress, {}

    def stage(self, name: str, total: int) -> None:
        self.tasks[name] = self.progress.add_task(name, total=total)

    def advance(self, name: str, detail: str = "") -> None:
        self.progress.update(self.tasks[name], advance=1, description=f"{name} {detail}")


@app.command()
@user_errors_exit
def build(
    recipe: Annotated[Path, typer.Argument(help="recipes/NAME.yaml")],
    force: Annotated[bool, typer.Option(help="rebuild even if up to date")] = False,
    artifacts_dir: Annotated[
        Path | None, typer.Option(help="where to write the package (overrides aotgen.toml)")
    ] = None,
) -> None:
    """Compile a recipe into artifacts/NAME (prefill/decode/verify graphs + weights)."""
    from aotgen.package.build import build as run_build
    from aotgen.recipe import Project, load_recipe

    project = Project.load()
    if artifacts_dir:
        project = dataclasses.replace(project, artifacts_dir=artifacts_dir)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    r = load_recipe(recipe)
    # transient: on an error, the one `error:` line is all that stays on screen.
    with Progress(*columns, console=console, transient=True) as progress:
        report = run_build(r, project, _RichProgress(progress), force=force)
    if report.up_to_date:
        console.print(
            f"{report.path} is up to date (same checkpoint, recipe and toolchain): "
            "nothing to do. Use --force to rebuild."
        )
        return
    table = Table(title=f"built {report.path}")
    for col in ("model", "graph", "export s", "compile s", ".so bytes"):
        table.add_column(col, justify="right" if "s" in col.split()[-1] else "left")
    for g in report.graphs:
        table.add_row(
            g.model,
            g.graph,
            f"{g.export_s:.1f}",
            "cached" if g.cached else f"{g.compile_s:.1f}",
            f"{g.so_bytes:,}",
        )
    console.print(table)
    console.print(
        f"weights {report.weight_bytes:,} B, package {report.package_bytes:,} B "
        f"({report.package_bytes / max(report.weight_bytes, 1):.2f}× weights), "
        f"{report.seconds:.0f} s"
    )
    for note in report.notes:
        console.print(f"note: {note}")


@app.command()
@user_errors_exit
def run(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    prompt: Annotated[str | None, typer.Option(help="raw prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option(help="read the raw prompt from a UTF-8 text file")
    ] = None,
    chat: Annotated[
        str | None, typer.Option(help="user message, wrapped in the chat template")
    ] = None,
    system: Annotated[str | None, typer.Option(help="system message for --chat")] = None,
    max_new_tokens: Annotated[
        int, typer.Option(help="stop after this many new tokens (>= 1)")
    ] = 256,
    temperature: Annotated[float, typer.Option(help="0 = greedy; higher = more random")] = 0.0,
    top_k: Annotated[int, typer.Option(help="sample from the K likeliest tokens; 0 = off")] = 0,
    top_p: Annotated[
        float, typer.Option(help="sample from the smallest set with this much probability; 1 = off")
    ] = 1.0,
    seed: Annotated[
        int | None,
        typer.Option(help=f"sampling seed, 0..{SEED_MAX} (default: random)"),
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="keep going past end-of-sequence")] = False,
    lookup: Annotated[
        str | None,
        typer.Option(
            help="'ngram': prompt-lookup speculation; with --speculative, the draft "
            "proposes only when lookup finds no match"
        ),
    ] = None,
    speculative: Annotated[bool, typer.Option(help="use the package's draft model")] = False,
    k: Annotated[
        int | None,
        typer.Option(help="draft length, >= 1 (default and maximum: the package's verify_k)"),
    ] = None,
    adaptive_k: Annotated[
        bool, typer.Option(help="adapt the draft length (+2 after a full accept, else -1)")
    ] = False,
    ngram_min: Annotated[
        int | None,
        typer.Option(help="shortest lookup match (default: 1; 3 with --speculative too)"),
    ] = None,
    ngram_max: Annotated[int, typer.Option(help="longest lookup match tried first")] = 4,
    draft_parallel: Annotated[
        int | None,
        typer.Option(
            help="tree drafting: up to N sequences (llama.cpp's n_parallel), scored in one "
            "tree-graph call; needs a package built with tree_nodes"
        ),
    ] = None,
    p_split: Annotated[
        float, typer.Option(help="tree drafting: branch where an alternative's probability > P")
    ] = 0.1,
    threads: Annotated[
        int | None, typer.Option(help="intra-op threads, >= 1 (default: aotgen.toml's)")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print one JSON object (text, ids, timings, finish reason, speculative "
            "stats) on stdout instead of streaming the text",
        ),
    ] = False,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "aoti",
    nnodes: Annotated[int, typer.Option(help="tensor parallel: nodes taking part")] = 1,
    node_rank: Annotated[int, typer.Option(help="tensor parallel: this node's rank")] = 0,
    master_addr: Annotated[str | None, typer.Option(help="tensor parallel: node 0's host")] = None,
    master_port: Annotated[int | None, typer.Option(help="tensor parallel: node 0's port")] = None,
) -> None:
    """Generate text from a package (streams it, then prints speed and speculation stats).

    A tensor-parallel package starts its ranks through torch.distributed.run (or runs
    under `torchrun --nproc-per-node N -m aotgen run ...`); only rank 0 prints.
    """
    from aotgen.runtime import distributed
    from aotgen.runtime.engine import Engine, GenerationConfig
    from aotgen.runtime.sampling import SamplingParams
    from aotgen.runtime.tree_draft import TreeParams

    given = [x for x in (prompt, prompt_file, chat) if x is not None]
    if len(given) != 1:
        raise CliError("give exactly one of --prompt, --prompt-file, --chat")
    if system is not None and chat is None:
        raise CliError("--system goes with --chat (a system message for the chat template)")
    if lookup not in (None, "ngram"):
        raise CliError(f"--lookup {lookup!r}: the only lookup proposer is 'ngram'")
    _at_least("--max-new-tokens", max_new_tokens)
    _at_least("--k", k)
    _at_least("--ngram-min", ngram_min)
    _at_least("--ngram-max", ngram_max)
    _at_least("--draft-parallel", draft_parallel)
    if not 0.0 <= p_split <= 1.0:
        raise CliError(f"--p-split must be in 0..1, got {p_split}")
    if ngram_min is not None and ngram_min > ngram_max:
        raise CliError(
            f"--ngram-min ({ngram_min}) must be <= --ngram-max ({ngram_max}); the lookup tries "
            "matches from ngram-max tokens down to ngram-min"
        )
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise CliError(f"--seed must be an integer in 0..{SEED_MAX}, got {seed}")
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    text = _read_prompt_file(prompt_file) if prompt_file is not None else prompt
    threads = _threads(threads)
    _check_backend(backend)
    if backend != "aoti":
        if distributed.needs_launch(package):
            raise CliError(
                f"--backend {backend} runs single-process packages; {package} is tensor-parallel "
                "(its recipe cannot have formats onnx): use --backend aoti"
            )
        engine = Engine.load(package, threads=threads, backend=backend)
    elif distributed.needs_launch(package):
        # Re-run this same command as the package's ranks.
        distributed.launch(
            ["aotgen", *sys.argv[1:]],
            distributed.package_world_size(package),
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            threads=threads,
        )
        return
    else:
        engine = distributed.start(package, threads=threads)
    if engine is None:  # a tensor-parallel rank other than 0: it served rank 0's calls
        return
    ids = (
        engine.chat_ids(chat, system=system)
        if chat is not None
        else engine.tokenizer.prompt_ids(text)
    )
    mode = _speculative_mode(speculative, lookup)
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(stop or ()),
        ignore_eos=ignore_eos,
        speculative=mode,
        k=k,
        adaptive_k=adaptive_k,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        tree=TreeParams(draft_parallel, p_split) if draft_parallel else None,
    )
    stream = None if as_json else (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
    result = engine.generate(ids, cfg, on_text=stream)
    if as_json:
        _print_json(_run_json(engine.load_s, ids, result, mode))
        return
    sys.stdout.write("\n")
    console.print(
        f"[dim]load {engine.load_s:.2f} s · prompt {result.prompt_tokens} tok, prefill "
        f"{result.prefill_tok_s:.1f} tok/s · {len(result.token_ids)} tok, decode "
        f"{result.decode_tok_s:.1f} tok/s · finish: {result.finish_reason}[/]",
        highlight=False,
    )
    if result.spec:
        s = result.spec
        by_pos = ", ".join(f"{r:.2f}" for r in s.acceptance_rate_by_position)
        lookups = (
            f", n-gram proposed {s.lookup_steps} of {s.steps}" if mode == "draft+ngram" else ""
        )
        if cfg.tree:
            lookups += f", tree nodes {s.tree_nodes}, a branch won {s.branch_steps} steps"
        console.print(
            f"[dim]speculative ({mode}): drafted {s.drafted}, accepted {s.accepted}, "
            f"acceptance {s.acceptance_rate:.2f}, mean accepted length "
            f"{s.mean_accepted_length:.2f} tok/step, by position [{by_pos}]{lookups}[/]",
            highlight=False,
        )


def _speculative_mode(speculative: bool, lookup: str | None) -> str | None:
    """--speculative (the draft) and --lookup ngram, alone or together."""
    return {(True, True): "draft+ngram", (True, False): "draft", (False, True): "ngram"}.get(
        (speculative, lookup is not None)
    )


def _run_json(load_s: float, prompt_ids: list[int], result: Any, mode: str | None) -> dict:
    """`run --json`: the same fields as the C++ `aotgen-run --json`, plus the rates."""
    s = result.spec
    spec = None
    if s is not None:
        spec = {
            "mode": mode,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "steps": s.steps,
            "lookup_steps": s.lookup_steps,
            "tree_nodes": s.tree_nodes,
            "branch_steps": s.branch_steps,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "acceptance_rate_by_position": s.acceptance_rate_by_position,
        }
    return {
        "prompt_ids": prompt_ids,
        "ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "load_s": load_s,
        "prompt_tokens": result.prompt_tokens,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "prefill_tok_s": result.prefill_tok_s,
        "decode_tok_s": result.decode_tok_s,
        "spec": spec,
    }


@app.command()
@user_errors_exit
def serve(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    lookup: Annotated[
        str | None, typer.Option(help="'ngram': prompt-lookup speculation for every request")
    ] = None,
    speculative: Annotated[
        bool, typer.Option(help="draft-model speculation for every request (with --lookup: both)")
    ] = False,
    slots: Annotated[
        int,
        typer.Option(help="requests decoding at once (default: the package's max_batch, or 4)"),
    ] = 0,
    max_queue: Annotated[int, typer.Option(help="waiting requests before 429s")] = 64,
    prefill_step: Annotated[
        int, typer.Option(help="prompt tokens per step while other requests decode")
    ] = 64,
    threads: Annotated[
        int | None, typer.Option(help="intra-op threads, >= 1 (default: aotgen.toml's)")
    ] = None,
) -> None:
    """Serve a package over an OpenAI-compatible HTTP API, many requests at once."""
    from aotgen.runtime import distributed
    from aotgen.runtime.batch_engine import BatchEngine

    if lookup not in (None, "ngram"):
        raise CliError(f"--lookup {lookup!r}: the only lookup is 'ngram'")
    for option, value in (("--max-queue", max_queue), ("--prefill-step", prefill_step)):
        _at_least(option, value)
    _at_least("--slots", slots, low=0)
    if not 0 < port < 65536:
        raise CliError(f"--port must be in 1..65535, got {port}")
    if distributed.needs_launch(package):
        raise CliError(f"{package} is tensor-parallel: `aotgen serve` runs single-process packages")
    try:
        from aotgen.serve import serve as serve_http
    except ImportError as e:
        raise CliError(
            f"aotgen serve needs the serve extra ({e}): pip install 'aotgen[serve]'"
        ) from None
    engine = BatchEngine.load(package, slots, _threads(threads), max_queue, prefill_step)
    if speculative and engine.engine.draft is None:
        raise CliError(f"{package} has no draft model: drop --speculative, or use --lookup ngram")
    mode = _speculative_mode(speculative, lookup)
    name = package.resolve().name
    Console(stderr=True).print(
        f"serving {name} on http://{host}:{port}/v1 ({engine.slots} slots"
        f"{f', speculative: {mode}' if mode else ''})"
    )
    serve_http(engine, name, host, port, speculative=mode)


@app.command()
@user_errors_exit
def inspect(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    as_json: Annotated[
        bool, typer.Option("--json", help="print the whole manifest as JSON on stdout")
    ] = False,
) -> None:
    """Summarise a package's manifest: model, graphs, files, versions."""
    from aotgen.package.manifest import read_manifest

    m = read_manifest(package)
    if as_json:
        _print_json(m, indent=2)
        return
    out = Console()
    target = m["target"]
    gpu = f" ({target['gpu']}, sm {target['compute_capability']})" if "gpu" in target else ""
    out.print(
        f"[bold]{m['name']}[/]  format {m['format_version']} · aotgen {m['aotgen_version']} · "
        f"torch {m['torch_version']} · {target['device']}{gpu} {target['isa']} "
        f"{target['platform']} · world size {m['world_size']}"
    )
    out.print(
        f"context {m['max_seq_len']} tokens · verify k {m['verify_k']} · built {m['built_at']}"
    )
    for role, entry in m["models"].items():
        c = entry["config"]
        out.print(
            f"[bold]{role}[/]: {c['architecture']} {c['num_hidden_layers']} layers, "
            f"hidden {c['hidden_size']}, heads {c['num_attention_heads']}/"
            f"{c['num_key_value_heads']}, vocab {c['vocab_size']}; kv cache "
            f"{entry['kv_cache']['shape']} × {2 * entry['kv_cache']['layers']} "
            f"{entry['kv_cache']['dtype']}"
            + (" (the target's)" if entry["kv_cache"].get("shared_with") == "target" else "")
        )
        if entry.get("quantization"):
            out.print(f"  quantization: {json.dumps(entry['quantization'])}")
        for name, g in entry["graphs"].items():
            t = g["tokens"]
            out.print(f"  graph {name:8s} tokens {t['min']}..{t['max']}  ({g['package_model']})")
    table = Table("file", "bytes", "sha256 (first chunk)")
    for rel, f in m["files"].items():
        table.add_row(rel, f"{f['bytes']:,}", f["sha256"][0][:16])
    out.print(table)


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
            "with --concurrency, llama.cpp's llama-batched-bench from $LLAMA_CPP_BIN or PATH)"
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
    as_json: Annotated[
        bool,
        typer.Option("--json", help="print the results as one JSON object on stdout"),
    ] = False,
) -> None:
    """Prefill/decode tok/s, ms/token, weight bytes/token and roofline ratio, side by side."""
    from aotgen.bench import LlamaCppRunner, PackageRunner, bench_interleaved, measure_bandwidth
    from aotgen.runtime.distributed import package_world_size

    for option, value in (("--prompt-len", prompt_len), ("--gen-tokens", gen_tokens)):
        _at_least(option, value)
    _at_least("--runs", runs)
    _at_least("--k", k)
    _at_least("--draft-parallel", draft_parallel)
    if not 0.0 <= p_split <= 1.0:
        raise CliError(f"--p-split must be in 0..1, got {p_split}")
    from aotgen.runtime.sampling import SamplingParams

    sampling = SamplingParams(temperature=temperature, top_p=top_p)
    if not sampling.greedy and not speculative:
        raise CliError("--temperature samples the --speculative comparison: add --speculative")
    threads = _threads(threads)
    backends = list(dict.fromkeys(backend or ["aoti"]))
    for b in backends:
        _check_backend(b)
    report: dict[str, Any] = {"threads": threads, "isa": _isa()}
    if backends != ["aoti"] and speculative:
        raise CliError("--speculative benchmarks the aoti backend only; drop --backend")
    if llama_lookup and not speculative:
        raise CliError("--llama-lookup compares n-gram speculation: add --speculative")
    if llama_lookup and not llama_lookup.is_file():
        raise CliError(f"--llama-lookup {llama_lookup}: no such GGUF file")
    if concurrency is not None:
        levels = _levels(concurrency)
        report["concurrency"] = _bench_concurrency(
            packages, levels, prompt_len, gen_tokens, runs, threads, llama_cpp, as_json
        )
        if as_json:
            _print_json(report)
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
                (draft_parallel, p_split),
                sampling,
            )
            for p in packages
        ]
        if as_json:
            _print_json(report)
        return
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
        _print_json(report)
        return
    if not results:
        return
    table = Table(
        title=f"decode greedy, prompt {prompt_len}, {gen_tokens} new tokens, median of {runs} "
        "(runs interleaved)"
    )
    for col in (
        "package",
        "load s",
        "prefill tok/s",
        "decode tok/s",
        "ms/token",
        "weights MB/token",
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
            f"{r.roofline(bandwidth[r.device]):.0%}",
        )
    _wide_console().print(table)
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
) -> list[dict[str, Any]]:
    import torch

    from aotgen.bench_serving import bench_concurrency, llama_batched_bench

    rows = [r for p in packages for r in bench_concurrency(p, levels, prompt_len, gen_tokens, runs)]
    for gguf in llama_cpp or []:
        threads_used = threads or torch.get_num_threads()
        rows += llama_batched_bench(gguf, levels, prompt_len, gen_tokens, threads_used)
    if not as_json:
        table = Table(
            title=f"many requests at once: prompt {prompt_len}, {gen_tokens} new tokens each, "
            f"median of {runs}"
        )
        for col in ("runtime", "requests", "aggregate decode tok/s", "TTFT p50 ms", "TTFT p99 ms"):
            table.add_column(col, justify="left" if col == "runtime" else "right", no_wrap=True)
        table.add_column("per-request tok/s", justify="right", no_wrap=True)
        for r in rows:
            cells = (r.ttft_p50_ms, r.ttft_p99_ms, r.request_tok_s)
            table.add_row(
                r.name,
                str(r.concurrency),
                f"{r.aggregate_tok_s:.1f}",
                *("-" if c != c else f"{c:.0f}" if c > 100 else f"{c:.1f}" for c in cells),
            )
        _wide_console().print(table)
        Console().print(_cpu_line(threads))
    return [dataclasses.asdict(r) for r in rows]


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
    tree: tuple[int, float],
    sampling: SamplingParams,
) -> dict[str, Any]:
    from aotgen.bench import bench_speculative
    from aotgen.runtime.tree_draft import TreeParams

    rows, costs = bench_speculative(
        package, max(gen_tokens, 96), k, threads, rounds, llama_lookup, TreeParams(*tree), sampling
    )
    if as_json:
        return {"package": package.name, "rows": [dataclasses.asdict(r) for r in rows], **costs}
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
    _wide_console().print(table)
    by_mode = {(r.task, r.mode): r for r in rows}
    for (task, mode), r in by_mode.items():
        if mode == "llama-lookup" and (task, "ngram") in by_mode:
            ours = by_mode[(task, "ngram")]
            ratio = ours.decode_tok_s / r.decode_tok_s
            _wide_console().print(
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
    _wide_console().print(line)
    return {"package": package.name, "rows": [dataclasses.asdict(r) for r in rows], **costs}


def main() -> None:
    app()


if __name__ == "__main__":
    main()
