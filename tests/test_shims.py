"""The custom kernels' C shims (export/shims.py): declared only for the ops a graph calls,
compiled once per source, and linked into each graph's `.so` as hidden symbols. Where the
compiler's files live: the project cache, or the user's private temp dir."""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from torch._inductor.exc import CppCompileError

from aotgen.export import aoti, shims
from aotgen.kernels import gguf_blocks as gb
from aotgen.kernels import gguf_dot as gd
from aotgen.kernels import packed as pk
from aotgen.recipe import ProjectError
from aotgen.tempdirs import private_dir


def _gguf_dot_graph() -> torch.fx.Graph:
    class OneOp(torch.nn.Module):
        def forward(self, x, codes, groups):
            return torch.ops.aotgen.gguf_dot(x, codes, groups, 1, 1, 1)

    codes, groups, _ = gb.pack(
        gb.decode(gb.random_blocks(gb.QTYPES["Q4_1"], 16, 64), "Q4_1", (16, 64))
    )
    return torch.export.export(OneOp(), (torch.randn(2, 64), codes, groups)).graph


def test_only_the_called_ops_are_declared(tmp_path):
    options, objects = shims.link_options(_gguf_dot_graph(), tmp_path)
    assert list(options[shims.C_SHIMS]) == [torch.ops.aotgen.gguf_dot.default]
    (decl,) = options[shims.C_SHIMS][torch.ops.aotgen.gguf_dot.default]
    assert decl.startswith('"C++" AOTITorchError aoti_torch_cpu_gguf_dot(AtenTensorHandle x,')
    (obj,) = objects
    assert obj.path.parent == tmp_path and obj.path.name.startswith("aotgen-gguf_dot-")
    assert shims.LIBS not in options  # library_options: one linker script for any objects
    assert not obj.path.exists()  # named only: built when a compile links it


def test_a_kernel_links_the_kernels_it_runs(tmp_path):
    """moe.cpp's experts call gguf_blocks.cpp's and gguf_dot.cpp's kernels (GGUF blocks) and
    packed.cpp's (panels): a graph calling them links all four objects, each once."""
    from aotgen.kernels import moe_gguf

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(moe_gguf.OPS[0], (x,))
    _, objects = shims.link_options(graph, tmp_path)
    stems = sorted(obj.path.name.split("-")[1] for obj in objects)
    assert stems == ["gguf_blocks", "gguf_dot", "moe", "packed"]


def test_every_kernel_declares_its_ops():
    for source, ops in shims.KERNELS:
        assert sorted(shims.declarations(source)) == sorted(
            f"aoti_torch_cpu_{op._opname}" for op in ops
        )


def test_object_key_follows_the_source(tmp_path):
    a = shims.KernelObject.of(gd.SOURCE, tmp_path)
    assert shims.KernelObject.of(gd.SOURCE, tmp_path) == a
    edited = tmp_path / gd.SOURCE.name
    edited.write_text(gd.SOURCE.read_text() + "\n// edited\n")
    assert shims.KernelObject.of(edited, tmp_path).path != a.path


def test_objects_build_under_a_relative_cache_dir(tmp_path, monkeypatch):
    """The default cache dir is relative (`.aotgen-cache`, no aotgen.toml); the compiler runs
    elsewhere, so the kernel directory must not be."""
    monkeypatch.chdir(tmp_path)
    with shims.kernel_dir(Path(".aotgen-cache") / "graphs") as directory:
        assert directory.is_absolute()
        obj = shims.KernelObject.of(gd.SOURCE, directory)
        obj.build()
        assert obj.path.is_file()


def decode_so(package: Path, tmp_path: Path) -> Path:
    """The target's decode graph's `.so`, copied out of the package into tmp_path."""
    with zipfile.ZipFile(package / "rank0" / "model.pt2") as pt2:
        names = [n for n in pt2.namelist() if n.endswith(".so") and "/target_decode/" in n]
        assert len(names) == 1, pt2.namelist()
        so = tmp_path / "decode.so"
        so.write_bytes(pt2.read(names[0]))
    return so


def test_graph_so_holds_its_shims_hidden(tiny_package, tmp_path):
    """The decode graph's `.so` defines the shims it calls (packed linears, attention) and
    neither imports nor exports them: the package runs them without any other library."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    so = decode_so(tiny_package, tmp_path)

    def symbols(*flags: str) -> str:
        return subprocess.run([nm, "-C", *flags, str(so)], capture_output=True, text=True).stdout

    for shim in ("aoti_torch_cpu_packed_linear(", "aoti_torch_cpu_attend_cache("):
        assert any(shim in ln and " t " in ln for ln in symbols().splitlines()), shim
        assert shim not in symbols("-D")


def test_objects_link_from_a_directory_whose_path_holds_a_colon(tmp_path):
    """LIBRARY_PATH splits at `:`; the linker script names each object by its quoted path."""
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    directory = tmp_path / "a:b"
    directory.mkdir()
    obj = shims.KernelObject.from_text(
        "one", 'extern "C" int aotgen_one() { return 1; }', directory
    )
    with shims.linking([obj]):
        out = tmp_path / "one.so"
        subprocess.run([cc, "-shared", "-o", str(out), f"-l:{shims.LINK_SCRIPT}"], check=True)
    assert (
        "aotgen_one"
        in subprocess.run(["nm", "-D", str(out)], capture_output=True, text=True).stdout
    )


ONE = 'extern "C" int one() { return 1; }'


@pytest.mark.parametrize("name", ["My Projects", "it's"])
def test_objects_compile_in_a_cache_whose_path_holds_a_space_or_quote(tmp_path, monkeypatch, name):
    """torch's C++ builder splits its command line as a shell would: the compiler is given
    the cache through a link whose path it can take, and the object lands in the cache."""
    if shutil.which("g++") is None:
        pytest.skip("no g++")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))  # the link's dir
    cache = tmp_path / name / ".aotgen-cache" / "graphs"
    with pytest.raises((CppCompileError, ValueError)):  # what the link is for: g++ or shlex fails
        cache.parent.mkdir(parents=True)
        with shims.kernel_dir(cache) as directory:
            shims.KernelObject.from_text("one", ONE, directory).build()
    root = aoti.compiler_path(cache.parent)
    assert root.parent == private_dir() == tmp_path / "tmp" / f"aotgen-{os.getuid()}"
    assert root.resolve() == cache.parent.resolve()
    assert aoti.compiler_path(cache.parent) == root  # one link per cache, kept
    with shims.kernel_dir(root / "graphs") as directory:
        obj = shims.KernelObject.from_text("one", ONE, directory)
        obj.build()
    assert (cache.parent / "kernels" / obj.path.name).is_file()
    assert aoti.compiler_path(tmp_path) == tmp_path  # a path the compiler can take is kept


def test_a_cache_the_compiler_cannot_reach_is_one_clear_error(tmp_path, monkeypatch):
    """With the temporary directory's path unusable too, the build stops before compiling,
    naming the cache dir and how to set another."""
    from aotgen.recipe import ProjectError

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp dir"))
    with pytest.raises(ProjectError, match=r"holds a space or a quote.*set cache_dir = "):
        aoti.compiler_path(tmp_path / "My Projects" / ".aotgen-cache")
    assert not (tmp_path / "My Projects").exists()  # nothing written


def test_torch_under_a_path_the_compiler_cannot_take_is_one_clear_error(tmp_path, monkeypatch):
    from aotgen.recipe import ProjectError

    monkeypatch.setattr(torch, "__file__", str(tmp_path / "My Env" / "torch" / "__init__.py"))
    with pytest.raises(ProjectError, match=r"torch is installed under .*My Env/torch"):
        aoti.compiler_path(tmp_path / "cache")


@pytest.mark.parametrize("planted", ["open to all", "a link", "a file"])
def test_a_private_dir_another_could_plant_in_is_refused(tmp_path, monkeypatch, planted):
    """The kernel libraries a build loads and the links to a cache live in `aotgen-UID` in the
    temp dir: one another user could write into, or swap, is refused with one clear line."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    path = tmp_path / f"aotgen-{os.getuid()}"
    if planted == "open to all":
        path.mkdir(mode=0o700)
        path.chmod(0o777)
    elif planted == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        path.symlink_to(tmp_path / "elsewhere")
    else:
        path.write_text("")
    with pytest.raises(ProjectError, match=r"not a directory of this user's alone.*set TMPDIR"):
        private_dir()
    with pytest.raises(ProjectError):
        aoti.compiler_path(tmp_path / "My Projects" / ".aotgen-cache")


def test_kernel_libraries_live_in_the_private_dir():
    """The standalone kernel library (shared by the session's tests) is built in the private
    dir, which is mode 700."""
    lib = pk.library()
    if lib is None:
        pytest.skip("no C++ compiler")
    assert Path(lib._name).parent == private_dir()
    assert private_dir().stat().st_mode & 0o777 == 0o700


def test_inductor_works_in_the_project_cache(tiny_package, project, tmp_path, monkeypatch):
    """Importing Inductor points TORCHINDUCTOR_CACHE_DIR at torch's shared default in the
    temp dir: a build moves it into the project cache (the session's builds compiled there),
    and keeps a directory the user chose."""
    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert any((project.cache_dir / "inductor").rglob("*.wrapper.cpp"))
    assert Path(codecache._HEADER_DIR) == private_dir() / "precompiled_headers"
    # what torch reads the headers' dir from, at each call (a rename would leave ours unused)
    assert "_HEADER_DIR" in codecache._precompile_header.__wrapped__.__code__.co_names
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    aoti.use_cache_dir(tmp_path / "cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    aoti.use_cache_dir(tmp_path / "cache")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
