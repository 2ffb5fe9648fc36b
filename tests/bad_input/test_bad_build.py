"""Builds that are killed, and a compile cache that is damaged: a killed build leaves nothing
a later build does not clean up, a terminated one leaves nothing at all, and a damaged cache
entry is recompiled (with a warning), never packaged or loaded."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import TINY_RECIPE

from aotgen.runtime.engine import Engine, GenerationConfig


def _project(tmp_path: Path, checkpoint: Path, cache: Path) -> Path:
    """A project dir (aotgen.toml + recipes/tiny.yaml) building into tmp_path/artifacts, at
    the session's thread count (a compile's key holds it) to find the session's compiles."""
    root = tmp_path / "project"
    (root / "recipes").mkdir(parents=True)
    (root / "aotgen.toml").write_text(
        f'artifacts_dir = "{tmp_path / "artifacts"}"\ncache_dir = "{cache}"\n'
        f"threads = {torch.get_num_threads()}\n"
    )
    recipe = {"checkpoint": str(checkpoint), **TINY_RECIPE}
    (root / "recipes" / "tiny.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    return root


def _build(root: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "aotgen", "build", "recipes/tiny.yaml", *args],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _partials(artifacts: Path) -> list[Path]:
    return sorted(artifacts.glob(".tiny.*-*")) if artifacts.is_dir() else []


def _wait_for_partial(proc: subprocess.Popen, artifacts: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not _partials(artifacts):
        assert proc.poll() is None, f"build ended before writing: {proc.communicate()}"
        assert time.monotonic() < deadline, "the build never started writing its package"
        time.sleep(0.05)


@pytest.fixture
def cache_copy(project, tiny_package: Path, tmp_path: Path) -> Path:
    """The session's compile cache (it holds the tiny graphs), the tiles they were compiled
    with (a re-measured tile would make other graphs) and the kernel objects a compile links
    (built once a session), copied: damage stays here."""
    cache = tmp_path / "cache"
    for part in ("graphs", "autotune", "kernels"):
        shutil.copytree(project.cache_dir / part, cache / part)
    return cache


def _build_interrupted(tmp_path: Path, checkpoint: Path, cache: Path, sig: int) -> Path:
    """Start a build, send `sig` once it is writing its package; returns the project dir."""
    root = _project(tmp_path, checkpoint, cache)
    proc = _build(root)
    _wait_for_partial(proc, tmp_path / "artifacts")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "Traceback" not in err, err
    return root


def test_killed_build_is_cleaned_up_by_the_next(tiny_checkpoint, cache_copy, tmp_path):
    root = _build_interrupted(tmp_path, tiny_checkpoint, cache_copy, signal.SIGKILL)
    artifacts = tmp_path / "artifacts"
    assert _partials(artifacts), "SIGKILL leaves the partial package behind"
    proc = _build(root)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert _partials(artifacts) == []
    assert (artifacts / "tiny" / "manifest.json").is_file()


def test_terminated_build_leaves_nothing(tiny_checkpoint, cache_copy, tmp_path):
    _build_interrupted(tmp_path, tiny_checkpoint, cache_copy, signal.SIGTERM)
    artifacts = tmp_path / "artifacts"
    assert _partials(artifacts) == [] and not (artifacts / "tiny").exists()


def _damage_one_so(cache: Path, how: str, package: Path) -> None:
    """Damage one of `package`'s compiled graphs in the cache: the build must notice and
    compile that graph again (the others still come from the cache)."""
    with zipfile.ZipFile(package / "rank0" / "model.pt2") as pt2:
        used = {Path(name).name for name in pt2.namelist() if name.endswith(".so")}
    so = sorted(so for so in (cache / "graphs").rglob("*.so") if so.name in used)[0]
    data = bytearray(so.read_bytes())
    if how == "truncated":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
    so.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["corrupted", "truncated"])
def test_damaged_cache_entry_is_recompiled(
    tiny_checkpoint, tiny_package, cache_copy, tmp_path, how
):
    _damage_one_so(cache_copy, how, tiny_package)
    root = _project(tmp_path, tiny_checkpoint, cache_copy)
    proc = _build(root)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err
    assert "is damaged" in err and "compiling again" in err, err
    built = Engine.load(tmp_path / "artifacts" / "tiny")
    reference = Engine.load(tiny_package)
    ids = reference.tokenizer.encode("The quick brown fox")
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    assert built.generate(ids, config).token_ids == reference.generate(ids, config).token_ids
