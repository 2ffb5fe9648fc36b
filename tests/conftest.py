"""Shared fixtures: a tiny random checkpoint and its compiled package, built once per session."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny_checkpoint  # noqa: E402

from aotgen.recipe import Project, parse_recipe  # noqa: E402

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
