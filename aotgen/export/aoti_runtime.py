"""AOTInductor's runtime code, compiled once and linked into every CPU graph.

Every AOTInductor wrapper holds the same runtime: the C interface the loaders call (its
`interface.cpp`, pasted in whole) and the members of `AOTInductorModelBase` (a `std::regex`
among them), instantiated again for each graph. That code was most of a wrapper's compile: a
tiny graph's wrapper took 6.8 s with it and 2.1 s without, on one core (AMD EPYC Zen 3). Here
it is compiled once into an object beside the kernel objects (`shims.py`), from the same
headers with the wrapper's flags (at -O1, AOTInductor's default for wrappers); each CPU
wrapper then holds its graph only, declares the base class's instantiation `extern` (so it
does not emit it again) and links the object. The graph's `.so` exports the same interface.
The graphs aotgen compiles keep their weights out of the `.so`, so no memory-mapping macro
(`USE_MMAP_SELF`, `USE_MMAP_EXTERNAL`) changes the runtime between graphs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

from aotgen.export.shims import KernelObject

# The wrapper's first line for a CPU graph (CppWrapperCpu.add_device_include).
_DEVICE_HEADER = "#include <torch/csrc/inductor/aoti_include/cpu.h>\n"
_BASE = "AOTInductorModelBase<AOTInductorModel>"
# In each wrapper, in place of interface.cpp: what the graph's code needs of it.
_DECLARATIONS = f"""
#include <torch/csrc/inductor/aoti_runtime/interface.h>
#include <torch/csrc/inductor/aoti_runtime/model_container.h>
namespace torch::aot_inductor {{ extern template class {_BASE}; }}
"""


def _interface_source() -> Path:
    import torch._inductor.codegen as codegen

    return Path(codegen.__file__).parent / "aoti_runtime" / "interface.cpp"


def runtime_object(directory: Path) -> KernelObject:
    """The runtime's object in `directory`, keyed by its text (torch's sources), flags and
    compiler like the kernel objects; built when a compile links it (`shims.linking`)."""
    text = (
        _DEVICE_HEADER
        + _interface_source().read_text()
        + f"\nnamespace torch::aot_inductor {{ template class {_BASE}; }}\n"
    )
    return KernelObject.from_text("aoti-runtime", text, directory)


@contextlib.contextmanager
def graph_only() -> Iterator[None]:
    """While AOTInductor compiles a CPU graph: its wrapper declares the runtime in place of
    pasting it in (`CppWrapperCpu._write_aoti_interface_header`)."""
    from torch._inductor import config
    from torch._inductor.codegen.cpp_wrapper_cpu import CppWrapperCpu

    paste = CppWrapperCpu._write_aoti_interface_header

    def declare(wrapper: CppWrapperCpu) -> None:
        # A standalone build (its own header) or a GPU wrapper: as AOTInductor writes it.
        if not config.aot_inductor.dynamic_linkage or wrapper.device != "cpu":
            paste(wrapper)
            return
        wrapper.header.splice(_DECLARATIONS)

    with mock.patch.object(CppWrapperCpu, "_write_aoti_interface_header", declare):
        yield
