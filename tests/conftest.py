"""Shared fixtures: a tiny random checkpoint and its compiled package, built once per session."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import make_tiny_checkpoint  # noqa: E402

from aotgen.recipe import Project, kv_cache_len, load_recipe, parse_recipe  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

TINY_RECIPE = {"max_seq_len": 160, "prefill_chunk": 16, "verify_k": 4}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tied_checkpoint(tmp_path_factory) -> Path:
    """A tiny checkpoint whose lm_head is the embedding table."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tied", tie=True, seed=1)


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    """The tiny checkpoint as an eager model: (model, config, cache_len)."""
    import torch

    from aotgen.checkpoint.hf import open_checkpoint
    from aotgen.model.llama import ModelConfig, load_model

    ckpt = open_checkpoint(tiny_checkpoint)
    cfg = ModelConfig.from_hf(ckpt.config)
    cache_len = kv_cache_len(TINY_RECIPE["max_seq_len"], TINY_RECIPE["verify_k"])
    return load_model(cfg, ckpt.load_weights(), cache_len, torch.float32), cfg, cache_len


@pytest.fixture(scope="session")
def project(tmp_path_factory, pytestconfig) -> Project:
    """The session's project; its compile cache is the one the background builder warms."""
    root = tmp_path_factory.mktemp("project")
    builds = pytestconfig.stash.get(BUILDS, None)
    cache = builds.project_cache if builds is not None else root / "cache"
    return Project(artifacts_dir=root / "artifacts", cache_dir=cache)


@pytest.fixture
def compile_exported(project, tmp_path) -> Callable:
    """`compile_exported(ep, args)`: the exported program compiled and packaged by the build's
    own steps (the kernels' C shims linked, the session's compile cache) and loaded back, the
    compiled side of a kernel's eager-against-compiled test."""
    from torch._inductor.package import load_package

    from aotgen.export.aoti import compile_graph, package_graphs

    def compile_and_load(ep, args: tuple) -> Callable:
        files, _ = compile_graph(ep, args, max_autotune=False, cache=project.cache_dir / "graphs")
        package_graphs(tmp_path / "graph.pt2", {"model": files})
        return load_package(str(tmp_path / "graph.pt2"), "model")

    return compile_and_load


@pytest.fixture(scope="session")
def tiny_package(tiny_checkpoint, project) -> Path:
    from aotgen.package.build import build

    recipe = parse_recipe({"checkpoint": str(tiny_checkpoint), **TINY_RECIPE}, "tiny", Path("."))
    return build(recipe, project).path


def _bundled_checkpoint(tmp_path_factory, gguf_name: str, checkpoint_name: str) -> Path:
    """A bundled GGUF (`aotgen import-gguf` short name) imported once; skips if not installed."""
    from aotgen.checkpoint.gguf import import_gguf, resolve_gguf

    try:
        gguf = resolve_gguf(gguf_name)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return import_gguf(gguf, tmp_path_factory.mktemp(gguf_name) / checkpoint_name)


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory) -> Path:
    return _bundled_checkpoint(tmp_path_factory, "smollm2", "smollm2-135m")


PPL = ": perplexity on "  # a build report's perplexity note (aotgen/package/perplexity.py)


def build_real_recipe(name: str, checkpoint: Path, root: Path, cache_dir: Path) -> Path:
    """Build recipes/NAME.yaml against `checkpoint` into a private artifacts dir, compiling
    into the session's cache: the kernels' objects and autotuned tiles are built once."""
    from aotgen.package.build import build

    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml", base_dir=REPO)
    recipe = type(recipe)(**{**recipe.__dict__, "checkpoint": checkpoint})
    project = Project(artifacts_dir=root / "artifacts", cache_dir=cache_dir)
    report = build(recipe, project)
    for note in report.notes:  # the builder's log (the session's summary) shows what it measured
        if PPL in note:
            print(f"{name}: {note}", flush=True)
    return report.path


# ---- real-model packages, built in the background -------------------------------------------
# Each takes 5-6 minutes to compile on 2 cores, mostly single-threaded (Inductor, then gcc).
# When the collected tests need them, a separate process builds them from the start of the
# session, so the second core compiles them while the other tests run.
# Recipe -> the fixtures that need its package (tests/test_cpp_runtime.py's `real_package` asks for
# smollm2_package at run time).
REAL_PACKAGE_USERS = {
    "smollm2-135m": {"smollm2_package", "real_package"},
    # Its single-sequence graphs are smollm2-135m's: only the batched graphs compile.
    "smollm2-135m-serve": {"smollm2_serve_package"},
    # After smollm2-135m: its AOTInductor graphs are the same, taken from the compile cache.
    "smollm2-135m-onnx": {"smollm2_onnx_package"},
    "smollm2-135m-int8": {"smollm2_int8_package"},
    "smollm2-135m-int4-g64": {"smollm2_int4_g64_package"},
    "gemma3-270m": {"gemma_package"},
    # Last: its tests take ~15 s, the shortest wait at the end of the run (Gemma 3's: ~90 s).
    "smollm2-135m-q4_1": {"smollm2_q4_1_package"},
}
# Compile-cache warmers (tests/real_builds.py WARMERS) -> the fixtures whose builds they compile
# ahead, into the session project's cache, while the tests before them run.
# In the order the tests ask for them; the busiest modules late in the run that the builder has
# time for before the real packages are needed.
WARM_USERS = {
    "families": {"family_engines"},
    "gguf_keep": {"kept", "integer"},
    "kv_dtype": {"kv_build"},
    "qwen3_5": {"qwen3_5_build"},
}
# Recipe -> the bundled GGUF (`aotgen import-gguf` short name) its checkpoint comes from.
REAL_PACKAGE_GGUF = {"gemma3-270m": "gemma3-270m"}


def bundled_gguf(recipe: str) -> str:
    return REAL_PACKAGE_GGUF.get(recipe, "smollm2")


def gguf_installed(name: str) -> bool:
    from aotgen.checkpoint.gguf import BUNDLED_GGUFS

    try:
        BUNDLED_GGUFS[name]()
    except FileNotFoundError:
        return False
    return True


def have_onnx() -> bool:
    """Whether the aotgen[onnx] extra is installed (formats: [aoti, onnx] recipes build)."""
    return all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime"))


BUILD_TIMEOUT_S = 40 * 60


class BackgroundBuilds:
    """`python tests/real_builds.py OUT NAME...` running; wait(name) returns a package."""

    def __init__(self, names: list[str]):
        import subprocess
        import tempfile

        self.names = names
        self.waits: list[str] = []
        self.out = Path(tempfile.mkdtemp(prefix="aotgen-real-builds-"))
        self.project_cache = self.out / "project-cache"
        self.log = self.out / "build.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).parent / "real_builds.py"), str(self.out)]
                + names,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                # One thread, as the tests while it runs (THREADS): a second OpenMP thread on a
                # shared core spins at barriers (a build's perplexity run took 18 min, not 3).
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )

    def wait(self, name: str) -> Path:
        import time

        done = self.out / f"{name}.done"
        start = time.monotonic()
        deadline = start + BUILD_TIMEOUT_S
        while not done.exists():
            failed = self.proc.poll() is not None and not done.exists()
            if failed or time.monotonic() > deadline:
                tail = self.log.read_text()[-3000:]
                how = "failed" if failed else f"took over {BUILD_TIMEOUT_S} s"
                pytest.fail(f"background build of {name} {how}:\n{tail}", pytrace=False)
            time.sleep(1)
        if (waited := time.monotonic() - start) >= 1:
            self.waits.append(f"a test waited {waited:.0f} s for {name}")
        return Path(done.read_text())

    def report(self) -> list[str]:
        """How long each build took and what the tests waited (CI's critical path), and the
        held-out perplexities the quantized builds measured."""
        lines = self.log.read_text().splitlines()
        built = [ln for ln in lines if ln.startswith(("built ", "compiled ")) or PPL in ln]
        return built + self.waits

    def close(self) -> None:
        import shutil

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.out, ignore_errors=True)


BUILDS = pytest.StashKey[BackgroundBuilds]()
THREADS = pytest.StashKey[int]()


def pytest_configure(config) -> None:
    import torch

    config.stash[THREADS] = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _session_threads(request) -> Iterator[None]:
    """Every test, and the session fixtures set up between tests, run at the session's torch
    thread count (some tests set their own): one while the background builder compiles on the
    other core, else torch's default. A compile's key holds it: builds must keep it to find
    the session's compiles."""
    import torch

    torch.set_num_threads(request.config.stash[THREADS])
    yield
    torch.set_num_threads(request.config.stash[THREADS])


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: only the tests that will run
def pytest_collection_modifyitems(config, items) -> None:
    """Start the background builds if a collected test needs them, and run those tests last,
    when the packages are most likely ready."""
    needed = {
        item: [name for name, users in REAL_PACKAGE_USERS.items() if users & set(item.fixturenames)]
        for item in items
    }
    # Each in the order the builder finishes its packages: a test runs while the later ones build.
    built = list(REAL_PACKAGE_USERS)
    users = [item for item in items if needed[item]]
    users.sort(key=lambda item: max(built.index(name) for name in needed[item]))
    items[:] = [item for item in items if not needed[item]] + users
    if config.option.collectonly:
        return
    requested = {fixture for item in items for fixture in item.fixturenames}
    warm = [w for w, fixtures in WARM_USERS.items() if fixtures & requested]
    warm = [w for w in warm if importlib.util.find_spec("transformers")]  # writes the checkpoints
    names = [name for name in REAL_PACKAGE_USERS if any(name in needed[i] for i in users)]
    names = [name for name in names if gguf_installed(bundled_gguf(name))]  # others skip
    names = [name for name in names if have_onnx() or not name.endswith("-onnx")]
    if warm or names:
        # The tests' thread count while the builder holds the other core: two would spin at
        # OpenMP barriers. The builder's is one too, so the warmers' compiles key as the tests'.
        import torch

        config.stash[THREADS] = 1
        torch.set_num_threads(1)
        config.stash[BUILDS] = BackgroundBuilds(warm + names)


def stop_warming(request, warmer: str) -> None:
    """The tests that `warmer` compiles ahead start now: the background builder stops warming
    and goes on to the real packages, and the tests compile what it had not (waiting for it
    would leave a core idle)."""
    builds = request.config.stash.get(BUILDS, None)
    if builds is not None and warmer in builds.names:
        (builds.out / f"{warmer}.stop").touch()


MODULE_SECONDS: dict[str, float] = {}  # test module -> seconds, its fixtures' setup included


def pytest_runtest_logreport(report) -> None:
    module = report.nodeid.split("::")[0]
    MODULE_SECONDS[module] = MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config) -> None:
    """Where the test process's time went, by module, and the background builder's steps."""
    if MODULE_SECONDS:
        terminalreporter.section("the busiest test modules, fixtures included (seconds)")
        for module, total in sorted(MODULE_SECONDS.items(), key=lambda kv: -kv[1])[:15]:
            terminalreporter.write_line(f"{total:7.0f}  {module}")
    builds = config.stash.get(BUILDS, None)
    if builds is not None:
        terminalreporter.section("background builds of the real-model packages")
        for line in builds.report():
            terminalreporter.write_line(line)


def pytest_unconfigure(config) -> None:
    builds = config.stash.get(BUILDS, None)
    if builds is not None:
        builds.close()


def _real_package(request, recipe: str, checkpoint_fixture: str = "smollm2_checkpoint") -> Path:
    builds = request.config.stash.get(BUILDS, None)
    if builds is None or recipe not in builds.names:
        # no GGUF (the checkpoint fixture skips), or not seen at collection
        checkpoint = request.getfixturevalue(checkpoint_fixture)
        root = request.getfixturevalue("tmp_path_factory").mktemp(recipe)
        return build_real_recipe(
            recipe, checkpoint, root, request.getfixturevalue("project").cache_dir
        )
    return builds.wait(recipe)


@pytest.fixture(scope="session")
def smollm2_package(request) -> Path:
    return _real_package(request, "smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_onnx_package(request) -> Path:
    return _real_package(request, "smollm2-135m-onnx")


@pytest.fixture(scope="session")
def smollm2_int8_package(request) -> Path:
    return _real_package(request, "smollm2-135m-int8")


@pytest.fixture(scope="session")
def smollm2_int4_g64_package(request) -> Path:
    return _real_package(request, "smollm2-135m-int4-g64")


@pytest.fixture(scope="session")
def smollm2_q4_1_package(request) -> Path:
    return _real_package(request, "smollm2-135m-q4_1")


@pytest.fixture(scope="session")
def smollm2_serve_package(request) -> Path:
    return _real_package(request, "smollm2-135m-serve")


@pytest.fixture(scope="session")
def tiny_batch_package(tiny_checkpoint, project) -> Path:
    """The tiny recipe with batched graphs for 4 sequences and a 1-layer draft (the target's
    first layer, on its KV cache)."""
    from aotgen.package.build import build

    data = {"checkpoint": str(tiny_checkpoint), **TINY_RECIPE, "max_batch": 4}
    data["speculative"] = {"draft": {"layers": 1}}
    return build(parse_recipe(data, "tiny-batch", Path(".")), project).path


@pytest.fixture(scope="session")
def gemma3_checkpoint(tmp_path_factory) -> Path:
    return _bundled_checkpoint(tmp_path_factory, "gemma3-270m", "gemma3-270m")


@pytest.fixture(scope="session")
def gemma_package(request) -> Path:
    return _real_package(request, "gemma3-270m", "gemma3_checkpoint")


@pytest.fixture(scope="session")
def run_bin(tmp_path_factory) -> Path:
    """The C++ `aotgen-run`, built once per session; skips where CMake found no torch."""
    from cpp_build import cmake_cache_value, require_cpp_build

    build_dir = require_cpp_build(tmp_path_factory, [])  # configure only
    if (cmake_cache_value(build_dir, "AOTGEN_WITH_TORCH") or "").upper() not in {"1", "ON", "TRUE"}:
        pytest.skip(
            "CMake did not find torch's CMake config (torch/share/cmake): aotgen-run is not "
            "configured"
        )
    return require_cpp_build(tmp_path_factory, ["aotgen-run"]) / "aotgen-run"


@pytest.fixture(scope="session")
def batch_bin(tmp_path_factory) -> Path:
    """The C++ `aotgen-batch`, built once per session; skips where CMake found no torch."""
    from cpp_build import cmake_cache_value, require_cpp_build

    build_dir = require_cpp_build(tmp_path_factory, [])  # configure only
    if (cmake_cache_value(build_dir, "AOTGEN_WITH_TORCH") or "").upper() not in {"1", "ON", "TRUE"}:
        pytest.skip("CMake did not find torch's CMake config: aotgen-batch is not configured")
    return require_cpp_build(tmp_path_factory, ["aotgen-batch"]) / "aotgen-batch"
