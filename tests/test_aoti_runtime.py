"""AOTInductor's runtime compiled once (export/aoti_runtime.py): each CPU wrapper holds its
graph only, and its `.so` still defines and exports the interface the loaders call."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from aotgen.export import shims
from aotgen.export.aoti_runtime import runtime_object
from aotgen.kernels import gguf_dot as gd
from tests.test_block_dot_panels import wrapper_sources
from tests.test_shims import decode_so

INTERFACE = ("AOTInductorModelContainerCreateWithDevice", "AOTInductorModelContainerRun")


def test_wrapper_declares_the_runtime_and_so_exports_it(tiny_package, tmp_path):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils)")
    wrapper = wrapper_sources(tiny_package, "target")["decode"]
    so = decode_so(tiny_package, tmp_path)
    assert "extern template class AOTInductorModelBase<AOTInductorModel>;" in wrapper
    for function in INTERFACE:
        assert f"AOTIRuntimeError {function}(" not in wrapper  # not pasted in
    exported = subprocess.run([nm, "-D", "--defined-only", str(so)], capture_output=True, text=True)
    undefined = subprocess.run([nm, "-C", "-u", str(so)], capture_output=True, text=True)
    for function in INTERFACE:
        assert f" T {function}\n" in exported.stdout, function
    # The model's members come from the wrapper or the object, none from elsewhere.
    assert "AOTInductorModel" not in undefined.stdout


def test_runtime_object_builds_and_keys_by_its_text(tmp_path):
    obj = runtime_object(tmp_path)
    assert runtime_object(tmp_path) == obj
    assert obj.path.name.startswith("aotgen-aoti-runtime-")
    assert "template class AOTInductorModelBase<AOTInductorModel>;" in obj.text
    obj.build()
    assert obj.path.is_file()


def test_every_set_of_objects_links_through_one_name(tmp_path):
    """AOTInductor's precompiled headers are keyed by the compile command: one library name
    whatever the objects lets every graph use the same headers."""
    runtime = runtime_object(tmp_path)
    kernel = shims.KernelObject.of(gd.SOURCE, tmp_path)
    assert shims.library_options([runtime]) == shims.library_options([runtime, kernel])
    assert shims.library_options([]) == {}
