"""Build the C++ runtime (runtime/cpp) with CMake once per test session.

Test modules that need a C++ binary ask for it through a session fixture::

    from cpp_build import require_cpp_build

    @pytest.fixture(scope="session")
    def cpp_bin(tmp_path_factory):
        return require_cpp_build(tmp_path_factory, ["aotgen-tokenize"])

``require_cpp_build`` configures the project once per session (and per distinct set of
``cmake_args``), builds the requested targets (each at most once) and returns the build
directory (an empty ``targets`` only configures). It skips the calling test when cmake / a C++
compiler are missing or when CMake configuration fails (typically missing packages: see
runtime/cpp/install_deps.sh); a failing *compile* is a real error and fails the test. The
torch-linked targets (aotgen-run) exist only where CMake found torch: check
``cmake_cache_value(build_dir, "AOTGEN_WITH_TORCH")`` first (tests/test_cpp_runtime.py).

Set ``AOTGEN_CPP_BUILD_DIR`` to build in a persistent directory instead of the session's
temporary one, so that later sessions rebuild incrementally.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CPP_SOURCE_DIR = REPO_ROOT / "runtime" / "cpp"
BUILD_JOBS = 2  # the CI and dev machines are small and shared

_lock = threading.Lock()
_configured: set[Path] = set()
_built: set[tuple[Path, str]] = set()


def missing_build_tools() -> str | None:
    """Why the C++ project cannot be built here, or None if the tools are present."""
    if shutil.which("cmake") is None:
        return "cmake is not installed"
    if not any(shutil.which(cxx) for cxx in (os.environ.get("CXX", ""), "c++", "g++", "clang++")):
        return "no C++ compiler (c++/g++/clang++) is installed"
    return None


def _run(cmd: Sequence[str | os.PathLike[str]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, check=False, cwd=REPO_ROOT
    )


def configure_cpp(
    build_dir: Path, cmake_args: Sequence[str] = (), build_type: str = "Release"
) -> Path:
    """Run CMake configuration in ``build_dir``; raises RuntimeError with CMake's output."""
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = ["cmake", "-S", CPP_SOURCE_DIR, "-B", build_dir, f"-DCMAKE_BUILD_TYPE={build_type}"]
    # The torch-linked targets find torch through this interpreter (the one running the tests).
    cmd.append(f"-DAOTGEN_PYTHON={sys.executable}")
    result = _run([*cmd, *cmake_args])
    if result.returncode != 0:
        raise RuntimeError(f"CMake configuration failed:\n{result.stdout}\n{result.stderr}")
    return build_dir


def build_targets(build_dir: Path, targets: Iterable[str]) -> Path:
    """Build ``targets`` in a configured ``build_dir``; raises RuntimeError on failure."""
    cmd = ["cmake", "--build", build_dir, "-j", str(BUILD_JOBS), "--target", *targets]
    result = _run(cmd)
    if result.returncode != 0:
        raise RuntimeError(f"C++ build failed:\n{result.stdout}\n{result.stderr}")
    return build_dir


def cmake_cache_value(build_dir: Path, name: str) -> str | None:
    """The value of a CMake cache variable in a configured ``build_dir`` (None if unset)."""
    cache = build_dir / "CMakeCache.txt"
    if not cache.is_file():
        return None
    for line in cache.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and key.split(":", 1)[0] == name:
            return value
    return None


def require_cpp_build(
    tmp_path_factory: pytest.TempPathFactory,
    targets: Iterable[str],
    cmake_args: Sequence[str] = (),
) -> Path:
    """Session-cached build of ``targets``; skips the test if the project cannot be built."""
    reason = missing_build_tools()
    if reason:
        pytest.skip(f"C++ runtime not buildable: {reason}")
    key_args = tuple(cmake_args)
    with _lock:
        root = os.environ.get("AOTGEN_CPP_BUILD_DIR")
        base = Path(root) if root else tmp_path_factory.getbasetemp() / "cpp-build"
        # One build directory per distinct set of CMake arguments.
        digest = hashlib.sha1("\0".join(key_args).encode()).hexdigest()[:10]
        build_dir = base / ("default" if not key_args else f"cfg-{digest}")
        if build_dir not in _configured:
            try:
                configure_cpp(build_dir, key_args)
            except RuntimeError as exc:
                log = str(exc)
                error = log[log.find("CMake Error") :] if "CMake Error" in log else log[-800:]
                pytest.skip(
                    "C++ runtime not buildable (missing packages? run "
                    f"runtime/cpp/install_deps.sh): {' '.join(error.split())[:800]}"
                )
            _configured.add(build_dir)
        todo = [t for t in targets if (build_dir, t) not in _built]
        if todo:
            build_targets(build_dir, todo)
            _built.update((build_dir, t) for t in todo)
    return build_dir
