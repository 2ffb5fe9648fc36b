"""examples/embed against an installed C++ runtime: `cmake --install` of runtime/cpp into a
temporary prefix, then the example configured with only that prefix and torch's CMake config
on CMAKE_PREFIX_PATH (find_package(aotgen CONFIG), aotgen::runtime), built, and run on the
real SmolLM2 package. Reuses the session's C++ build (tests/cpp_build.py); skipped like
tests/test_cpp_runtime.py when cmake, a compiler or torch's CMake config is missing.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from cpp_build import BUILD_JOBS, REPO_ROOT, cmake_cache_value, require_cpp_build
from test_cpp_runtime import real_package  # noqa: F401 (a fixture)

from aotgen.package.manifest import PackageError
from aotgen.runtime.engine import Engine

pytestmark = pytest.mark.cpp

EXAMPLE_DIR = REPO_ROOT / "examples" / "embed"
QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."


def cmake(*args: str | Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        ["cmake", *map(str, args)], capture_output=True, text=True, check=False, timeout=900
    )
    assert proc.returncode == 0, f"cmake {args} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="session")
def aotgen_prefix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The runtime installed from the session's build (the configuration the other C++ tests
    use), into a prefix of its own."""
    build_dir = require_cpp_build(tmp_path_factory, [])  # configure only
    if (cmake_cache_value(build_dir, "AOTGEN_WITH_TORCH") or "").upper() not in {"1", "ON", "TRUE"}:
        pytest.skip("CMake did not find torch's CMake config: aotgen_runtime is not configured")
    # Everything install() copies.
    require_cpp_build(tmp_path_factory, ["aotgen-run", "aotgen-tokenize"])
    prefix = tmp_path_factory.mktemp("aotgen-prefix")
    cmake("--install", build_dir, "--prefix", prefix)
    return prefix


@pytest.fixture(scope="session")
def embed_bin(aotgen_prefix: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch.utils

    build_dir = tmp_path_factory.mktemp("embed-build")
    cmake(
        "-S", EXAMPLE_DIR, "-B", build_dir,
        f"-DCMAKE_PREFIX_PATH={aotgen_prefix};{torch.utils.cmake_prefix_path}",
        "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
    )  # fmt: skip
    cmake("--build", build_dir, "-j", str(BUILD_JOBS))
    # The example compiled against the installed headers, not the source tree's.
    commands = json.loads((build_dir / "compile_commands.json").read_text())
    assert commands and all(str(REPO_ROOT / "runtime") not in c["command"] for c in commands)
    assert f"-I{aotgen_prefix}/include" in commands[0]["command"].replace("-isystem ", "-I")
    return build_dir / "aotgen-embed"


def test_install_layout(aotgen_prefix):
    assert (aotgen_prefix / "include" / "aotgen" / "aotgen.h").is_file()
    assert (aotgen_prefix / "include" / "aotgen" / "tokenizer.h").is_file()
    assert not (aotgen_prefix / "include" / "aotgen" / "detail.h").exists()  # internal
    for name in ("aotgenConfig.cmake", "aotgenConfigVersion.cmake", "aotgenTargets.cmake"):
        assert (aotgen_prefix / "lib" / "cmake" / "aotgen" / name).is_file()
    for tool in ("aotgen-run", "aotgen-tokenize"):
        assert (aotgen_prefix / "bin" / tool).is_file()
    # Torch comes from find_dependency(Torch), not from paths written into the export.
    targets = (aotgen_prefix / "lib" / "cmake" / "aotgen" / "aotgenTargets.cmake").read_text()
    assert "libc10" not in targets and "site-packages" not in targets


def test_installed_run_tool_finds_libtorch(aotgen_prefix):
    proc = subprocess.run(
        [str(aotgen_prefix / "bin" / "aotgen-run"), "--help"],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr  # e.g. "error while loading shared libraries"
    assert "--chat" in proc.stdout


def test_embed_answers_france(embed_bin, real_package):  # noqa: F811
    try:
        Engine.load(real_package)
    except PackageError as e:
        pytest.skip(f"{real_package} cannot be loaded here: {e}")
    proc = subprocess.run(
        [str(embed_bin), str(real_package), QUESTION],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ANSWER + "\n"
    assert "finish: eos" in proc.stderr
