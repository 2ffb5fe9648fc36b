"""Bad packages, through both runtimes: each row damages a copy of the tiny package the way a
careless copy or an attacker would, and both `aotgen run` (Python) and `aotgen-run` (C++)
must refuse it before loading native code: exit status 1, one line naming the problem, no
traceback. A package is a closed set of hashed files under its directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

Mutation = Callable[[Path, Path], None]  # (package copy, a directory outside it)


def _edit(fn: Callable[[dict], None]) -> Mutation:
    def mutate(pkg: Path, outside: Path) -> None:
        manifest = json.loads((pkg / "manifest.json").read_text())
        fn(manifest)
        (pkg / "manifest.json").write_text(json.dumps(manifest))

    return mutate


def _flip_byte(rel: str) -> Mutation:
    def mutate(pkg: Path, outside: Path) -> None:
        data = bytearray((pkg / rel).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (pkg / rel).write_bytes(bytes(data))

    return mutate


def _moved_out(rel: str, key: Callable[[dict, str], None]) -> Mutation:
    """Move a file out of the package and point the manifest at it there: a manifest that
    names a path outside must not load it, hashed or not."""

    def mutate(pkg: Path, outside: Path) -> None:
        target = outside / Path(rel).name
        shutil.move(pkg / rel, target)
        _edit(lambda m: key(m, os.path.relpath(target, pkg)))(pkg, outside)

    return mutate


def _absolute(rel: str, key: Callable[[dict, str], None]) -> Mutation:
    def mutate(pkg: Path, outside: Path) -> None:
        target = outside / Path(rel).name
        shutil.move(pkg / rel, target)
        _edit(lambda m: key(m, str(target)))(pkg, outside)

    return mutate


def _listed_as(rel: str, new_rel: Callable[[Path], str]) -> Mutation:
    """Move a tokenizer file out and list it, and the tokenizer dir, under a path that
    escapes the package (`../x` or absolute), with its true hash."""

    def mutate(pkg: Path, outside: Path) -> None:
        target = outside / Path(rel).name
        shutil.move(pkg / rel, target)
        name = new_rel(target)

        def fn(m: dict) -> None:
            m["files"][name] = m["files"].pop(rel)
            m["tokenizer"]["dir"] = str(Path(name).parent)

        _edit(fn)(pkg, outside)

    return mutate


def _symlink_out(rel: str) -> Mutation:
    """The listed file replaced by a link to an identical copy outside: hashes still match."""

    def mutate(pkg: Path, outside: Path) -> None:
        target = outside / Path(rel).name
        shutil.move(pkg / rel, target)
        (pkg / rel).symlink_to(target)

    return mutate


def _symlink_dir_out(pkg: Path, outside: Path) -> None:
    shutil.move(pkg / "tokenizer", outside / "tokenizer")
    (pkg / "tokenizer").symlink_to(outside / "tokenizer", target_is_directory=True)


def _set_weights(m: dict, path: str) -> None:
    m["models"]["target"]["weights"]["file"] = path


def _set_package(m: dict, path: str) -> None:
    m["package"] = path


def _remove(rel: str) -> Mutation:
    return lambda pkg, outside: (pkg / rel).unlink()


def _write(rel: str, data: bytes) -> Mutation:
    return lambda pkg, outside: (pkg / rel).write_bytes(data)


WEIGHTS = "rank0/target.safetensors"
PT2 = "rank0/model.pt2"
TOKENIZER = "tokenizer/tokenizer.json"

# (id, mutation, phrase both runtimes' message contains)
ROWS: list[tuple[str, Mutation, str]] = [
    # Refused before the hardening, and still.
    ("tampered-weights", _flip_byte(WEIGHTS), "does not match its sha256"),
    ("tampered-pt2", _flip_byte(PT2), "does not match its sha256"),
    ("unlisted-file", _write("rank0/extra.so", b"\x7fELF"), "not in the manifest"),
    ("missing-file", _remove(WEIGHTS), "is missing"),
    ("other-torch", _edit(lambda m: m.update(torch_version="2.0.0+cpu")), "built with torch"),
    ("other-isa", _edit(lambda m: m["target"].update(isa="AMX_FP16")), "compiled for AMX_FP16"),
    ("other-platform", _edit(lambda m: m["target"].update(platform="plan9-mips")), "plan9-mips"),
    ("other-format", _edit(lambda m: m.update(format_version=99)), "package format 99"),
    ("manifest-not-json", _write("manifest.json", b"{ not json"), "is corrupt"),
    ("no-manifest", _remove("manifest.json"), "is not an aotgen package"),
    # Each of these loaded native code or data from outside the package, or crashed.
    ("package-outside", _moved_out(PT2, _set_package), "not a listed, hashed file"),
    ("package-absolute", _absolute(PT2, _set_package), "not a listed, hashed file"),
    ("weights-outside", _moved_out(WEIGHTS, _set_weights), "not a listed, hashed file"),
    ("weights-absolute", _absolute(WEIGHTS, _set_weights), "not a listed, hashed file"),
    (
        "files-dotdot",
        _listed_as(TOKENIZER, lambda t: f"../{t.parent.name}/{t.name}"),
        "outside the package",
    ),
    ("files-absolute", _listed_as(TOKENIZER, lambda t: str(t)), "outside the package"),
    ("symlink-file", _symlink_out(TOKENIZER), "symbolic link"),
    ("symlink-dir", _symlink_dir_out, "symbolic link"),
    ("manifest-no-target", _edit(lambda m: m.pop("target")), "malformed"),
    ("manifest-files-list", _edit(lambda m: m.update(files=[])), "malformed"),
    (
        "manifest-kv-dtype",
        _edit(lambda m: m["models"]["target"]["kv_cache"].update(dtype="float8")),
        "dtype float8",
    ),
    (
        "manifest-kv-shape",  # a width of 0 is a latent layer's values; below it, nothing
        _edit(lambda m: m["models"]["target"]["kv_cache"]["shapes"][1].__setitem__(3, -1)),
        "4-D `shapes`",
    ),
    (
        "manifest-kv-ring",  # no layer of the ring's length
        _edit(lambda m: m["models"]["target"]["kv_cache"].update(ring={"cells": 7, "window": 4})),
        "needs positive",
    ),
    (
        "manifest-files-no-sha",
        _edit(lambda m: m["files"][WEIGHTS].pop("sha256")),
        "malformed",
    ),
]


@pytest.fixture
def damaged(request, tiny_package: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the tiny package with the row's damage, and the directory beside it."""
    pkg = Path(shutil.copytree(tiny_package, tmp_path / "pkg"))
    outside = tmp_path / "outside"
    outside.mkdir()
    request.param(pkg, outside)
    return pkg, outside


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        p.relative_to(root).as_posix(): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in root.rglob("*")
    }


def assert_one_line_error(proc: subprocess.CompletedProcess, phrase: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and phrase in lines[0], proc.stderr


@pytest.mark.parametrize(
    ("damaged", "phrase"),
    [pytest.param(fn, phrase, id=name) for name, fn, phrase in ROWS],
    indirect=["damaged"],
)
def test_python_runtime_refuses(damaged: tuple[Path, Path], phrase: str, tmp_path: Path):
    pkg, outside = damaged
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "aotgen", "run", str(pkg), "--prompt", "hi"]
        + ["--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert_one_line_error(proc, phrase)
    assert _snapshot(tmp_path) == before  # loading wrote nothing, inside or out


@pytest.mark.cpp
@pytest.mark.parametrize(
    ("damaged", "phrase"),
    [pytest.param(fn, phrase, id=name) for name, fn, phrase in ROWS],
    indirect=["damaged"],
)
def test_cpp_runtime_refuses(
    run_bin: Path,  # noqa: F811
    damaged: tuple[Path, Path],
    phrase: str,
    tmp_path: Path,
):
    pkg, outside = damaged
    before = _snapshot(tmp_path)
    proc = subprocess.run(
        [str(run_bin), str(pkg), "--prompt", "hi", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(proc, phrase)
    assert _snapshot(tmp_path) == before
