"""What every command shares: the Typer app, option checks, and bad input reported as one
`error:` line (exit 1) while anything else, a bug, keeps its traceback."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

app = typer.Typer(add_completion=False, no_args_is_help=True)
console = Console(stderr=True)

P = ParamSpec("P")
R = TypeVar("R")
# torch seeds its generators with an unsigned 64-bit integer (so does the C++ runtime); the
# same bound as runtime/sampling.py's, kept here so that `--help` does not import torch.
SEED_MAX = 2**64 - 1


class CliError(ValueError):
    """A command-line value out of range or unusable, reported like every other user error."""


def wide_console() -> Console:
    """Stdout at least 150 columns wide, so bench tables do not wrap in narrow terminals."""
    return Console(width=max(Console().width, 150))


# Errors from the user's input, by the module that defines them. An exception of a module not
# yet imported cannot have been raised, so classifying one never imports torch: a mistyped
# option is refused in a fraction of a second.
_USER_ERRORS = (
    ("aotgen.bench", "BenchError"),
    ("aotgen.checkpoint.hf", "CheckpointError"),
    ("aotgen.package.manifest", "PackageError"),
    ("aotgen.recipe", "ProjectError"),
    ("aotgen.recipe", "RecipeError"),
    ("aotgen.runtime.distributed", "LaunchError"),
    ("aotgen.runtime.model_runner", "GenerationError"),
)


def _is_user_error(e: Exception) -> bool:
    if isinstance(e, (ValueError, FileNotFoundError, FileExistsError)):  # CliError included
        return True
    return any(
        (module := sys.modules.get(name)) is not None and isinstance(e, getattr(module, cls))
        for name, cls in _USER_ERRORS
    )


def fail(e: Exception) -> NoReturn:
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
        except Exception as e:
            if not _is_user_error(e):
                raise
            fail(e)

    return wrapper


def script_main(main: Callable[[], R]) -> R:
    """Run a `scripts/` entry point as the commands run: bad input (a missing package, a
    recipe error) prints one `error: ...` line and exits 1; a bug keeps its traceback."""
    try:
        return user_errors_exit(main)()
    except typer.Exit as done:  # outside Typer, its exit is a plain one
        raise SystemExit(done.exit_code) from None


def print_json(obj: Any, indent: int | None = None) -> None:
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


def at_least(option: str, value: int | None, low: int = 1) -> None:
    """Refuse a count below `low` (None: the option was not given)."""
    if value is not None and value < low:
        raise CliError(f"{option} must be >= {low}, got {value}")


REASONING_BUDGET_HELP = (
    "at most N tokens of reasoning (<think>, gpt-oss's analysis channel), then its close is "
    "forced and the model answers; 0: no reasoning"
)
REASONING_MESSAGE_HELP = "with --reasoning-budget: text forced before the close"


def check_reasoning_budget(budget: int | None, message: str | None) -> None:
    if budget is not None and budget < 0:
        raise CliError(f"--reasoning-budget must be >= 0 (tokens of reasoning), got {budget}")
    if message is not None and budget is None:
        raise CliError("--reasoning-budget-message goes with --reasoning-budget N")


BACKEND_HELP = (
    "aoti: the AOTInductor graphs; onnxruntime: the package's ONNX graphs through ONNX Runtime "
    "(a recipe with formats: [aoti, onnx]; pip install 'aotgen[onnx]')"
)


def check_generation_config(value: str) -> None:
    if value not in ("auto", "none"):
        raise CliError(f"--generation-config {value!r}: give 'auto' or 'none'")


def check_backend(backend: str) -> None:
    from aotgen.runtime.onnx_backend import BACKENDS

    if backend not in BACKENDS:
        raise CliError(f"--backend {backend!r}: expected one of {', '.join(BACKENDS)}")


def resolve_threads(threads: int | None) -> int | None:
    """--threads if given (>= 1), else aotgen.toml's `threads` (0 there: torch's default);
    a warning on stderr when they outnumber the CPUs this process may use."""
    from aotgen.recipe import Project

    if threads is not None:
        at_least("--threads", threads)
        source = "--threads"
    else:
        threads, source = Project.load().threads or None, "aotgen.toml's threads"
    import torch

    count = threads or torch.get_num_threads()
    cpus = usable_cpus()
    if count > cpus:
        given = f"{source} {count}" if threads else f"torch's default of {count} threads"
        console.print(
            f"[yellow]warning:[/] {given} on {cpus} usable CPU{'s' * (cpus > 1)}: the threads "
            f"wait on each other and decode slows severalfold; use --threads {cpus} or fewer",
            highlight=False,
            soft_wrap=True,
        )
    return threads


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # "max 100000", or "200000 100000": 2 CPUs


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a
    container's `--cpus`), which the mask does not show."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            return max(1, min(cpus or 1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus or 1


def read_prompt_file(path: Path) -> str:
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


LOOKUP_CACHE_HELP = (
    "with --lookup ngram: a file of n-gram counts from earlier requests to draft from "
    "(llama.cpp's lookup-cache format), read if it exists; every request's text is added and "
    "the file written back at exit (by serve also every --lookup-cache-every seconds)"
)


def check_lookup_cache(path: Path | None, lookup: str | None) -> None:
    """--lookup-cache goes with --lookup ngram and names a writable file (checked before the
    package loads, so a typo costs no generation)."""
    if path is None:
        return
    if lookup is None:
        raise CliError("--lookup-cache holds what --lookup ngram drafts from: add --lookup ngram")
    if path.is_dir() or not path.parent.is_dir() or not os.access(path.parent, os.W_OK):
        raise CliError(
            f"--lookup-cache {path}: give a file in an existing, writable directory (it is "
            "written back at exit)"
        )


def check_lookup_cache_every(seconds: float | None, path: Path | None) -> None:
    """--lookup-cache-every: a finite number of seconds >= 0, for a --lookup-cache file."""
    if seconds is None:
        return
    if path is None:
        raise CliError("--lookup-cache-every sets how often --lookup-cache is written: add it")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise CliError(f"--lookup-cache-every must be a number of seconds >= 0, got {seconds}")


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+", re.IGNORECASE)


def check_origin(origin: str) -> str:
    """--allowed-origin: '*' or an origin as a browser sends it (no path, no trailing `/`:
    one that has them would never match)."""
    if origin != "*" and not _ORIGIN.fullmatch(origin):
        raise CliError(
            f"--allowed-origin {origin!r}: give an origin as browsers send it, "
            "scheme://host[:port] with no path (e.g. http://localhost:3000), or '*' for any"
        )
    return origin


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
