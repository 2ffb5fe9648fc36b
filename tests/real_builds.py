"""Build the real-model packages for the slow tests, and compile ahead the tiny builds some
test modules make: `python tests/real_builds.py OUT NAME...`.

Run by conftest.py in a process of its own at the start of a session, so the packages compile
on the second core while the other tests run. Writes OUT/NAME.done (holding the package's
path) as each recipe finishes; a failure ends the process with its traceback in the log.
Every build compiles into the session project's cache, so the C++ kernels' objects and
the autotuned tiles are built once for the warmers, the real packages and the tests.
A NAME in WARMERS compiles a test module's recipes into the session project's compile cache
(OUT/project-cache), so that the tests' own builds of them are cache hits (both run one torch
thread: conftest.py; a compile's key holds the graph and the weights' shapes, not their values
or paths); it stops when OUT/NAME.stop appears (the tests started) and leaves them the rest.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1]))  # test modules that import `tests.*`

from conftest import build_real_recipe, bundled_gguf  # noqa: E402

from aotgen.checkpoint.gguf import import_gguf, resolve_gguf  # noqa: E402
from aotgen.package.build import build  # noqa: E402
from aotgen.recipe import Project, parse_recipe  # noqa: E402


def warm(out: Path, name: str, recipes: Iterator[tuple[str, dict]]) -> Path:
    """Build `recipes` (package name, recipe data) into the session project's compile cache
    until the tests that use them start (OUT/NAME.stop)."""
    project = Project(artifacts_dir=out / f"{name}-built", cache_dir=out / "project-cache")
    done = 0
    while not (out / f"{name}.stop").exists() and (item := next(recipes, None)):  # stop_warming
        build(parse_recipe(item[1], item[0], Path(".")), project)
        done += 1
    print(f"compiled {done} {name} packages ahead", flush=True)
    return project.artifacts_dir


def warm_families(out: Path) -> Iterator[tuple[str, dict]]:
    """test_families.py's packages (tests/families.py), AOTInductor only: ONNX has no cache."""
    from families import PACKAGES, family_checkpoints, family_recipe

    checkpoints = family_checkpoints(out / "families")
    for family, extra in PACKAGES:
        yield family_recipe(family, checkpoints, ["aoti"], extra)


def warm_gguf_keep(out: Path) -> Iterator[tuple[str, dict]]:
    """test_gguf_keep.py's packages."""
    from test_gguf_keep import PACKAGES, package_recipe

    for name in PACKAGES:
        yield name, package_recipe(out / "gguf_keep" / name, name)


def warm_kv_dtype(out: Path) -> Iterator[tuple[str, dict]]:
    """test_kv_dtype.py's packages, on checkpoints of the shapes the tests build on."""
    from families import make_family_checkpoint
    from test_kv_dtype import PACKAGES
    from tiny import make_tiny_checkpoint

    root = out / "kv_dtype"
    checkpoints = {
        "tiny": make_tiny_checkpoint(root / "tiny"),
        "tied": make_tiny_checkpoint(root / "tied", tie=True, seed=1),
        "gemma2": make_family_checkpoint(root / "gemma2", "gemma2"),
    }
    for name, (checkpoint, keys) in PACKAGES.items():
        yield name, {"checkpoint": str(checkpoints[checkpoint]), **keys}


def warm_qwen3_5(out: Path) -> Iterator[tuple[str, dict]]:
    """test_qwen3_5.py's packages, on the checkpoint it builds on."""
    from families import make_family_checkpoint
    from test_qwen3_5 import PACKAGES

    checkpoint = make_family_checkpoint(out / "qwen3_5", "qwen3_5")
    for name, keys in PACKAGES.items():
        yield name, {"checkpoint": str(checkpoint), **keys}


WARMERS = {
    "families": warm_families,
    "gguf_keep": warm_gguf_keep,
    "kv_dtype": warm_kv_dtype,
    "qwen3_5": warm_qwen3_5,
}


def main(out: Path, names: list[str]) -> None:
    checkpoints: dict[str, Path] = {}
    start = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        if name in WARMERS:
            path = warm(out, name, WARMERS[name](out))
        else:
            gguf = bundled_gguf(name)
            if gguf not in checkpoints:
                checkpoints[gguf] = import_gguf(resolve_gguf(gguf), out / "checkpoints" / gguf)
            path = build_real_recipe(name, checkpoints[gguf], out / name, out / "project-cache")
        (out / f"{name}.tmp").write_text(str(path))
        (out / f"{name}.tmp").rename(out / f"{name}.done")  # whole, or not there yet
        now = time.monotonic()
        print(f"built {name} in {now - t0:.0f} s, {now - start:.0f} s since start", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
