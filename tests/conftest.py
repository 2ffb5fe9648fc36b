"""Shared fixtures: a tiny random checkpoint and its compiled package, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny_checkpoint  # noqa: E402

from aotgen.recipe import Project, load_recipe, parse_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

TINY_RECIPE = {"max_seq_len": 160, "prefill_chunk": 16, "verify_k": 4}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def project(tmp_path_factory) -> Project:
    root = tmp_path_factory.mktemp("project")
    return Project(artifacts_dir=root / "artifacts", cache_dir=root / "cache")


@pytest.fixture(scope="session")
def tiny_package(tiny_checkpoint, project) -> Path:
    from aotgen.package.build import build

    recipe = parse_recipe({"checkpoint": str(tiny_checkpoint), **TINY_RECIPE}, "tiny", Path("."))
    return build(recipe, project).path


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> Path:
    from aotgen.checkpoint.gguf import find_smollm2_gguf, import_gguf

    try:
        gguf = find_smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return import_gguf(gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m")


def build_real_recipe(name: str, checkpoint: Path, root: Path) -> Path:
    """Build recipes/NAME.yaml against `checkpoint` into a private artifacts dir."""
    from aotgen.package.build import build

    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", base_dir=REPO)
    recipe = type(recipe)(**{**recipe.__dict__, "checkpoint": checkpoint})
    project = Project(artifacts_dir=root / "artifacts", cache_dir=REPO / ".aotgen-cache")
    return build(recipe, project).path


@pytest.fixture(scope="session")
def smollm2_package(smollm2_checkpoint, tmp_path_factory) -> Path:
    return build_real_recipe("smollm2-135m", smollm2_checkpoint, tmp_path_factory.mktemp("fp32"))
