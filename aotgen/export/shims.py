"""The custom kernels' C shims, compiled once per kernel source and linked into each graph.

AOTInductor calls a custom op through its C shim `aoti_torch_cpu_<op>`: it pastes the
declarations given in `aot_inductor.custom_ops_to_c_shims` into the graph's wrapper and links
the libraries named in `aot_inductor.custom_op_libs`. The kernel sources are large (every
tile shape of every weight format); pasted into each wrapper, they were compiled again for
every graph and took ~35 s of a tiny quantized graph's ~42 s compile. Here each source is
compiled once (per source text, compiler flags and compiler) into an object file kept in a
`kernels/` dir beside the compile cache, and linked statically into every `.so` that calls
it: the graph's `.so` still holds all the code it runs, nothing extra is loaded at run time.

The object is built with the flags AOTInductor gives the wrapper (CPU ISA, floating-point
and OpenMP options), so the kernels are the same machine code as when they were pasted in.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from aotgen.kernels import (
    attention,
    block_dot,
    gated_delta,
    gguf_blocks,
    gguf_dot,
    moe,
    moe_gguf,
    packed,
)
from aotgen.tempdirs import partial_dir, remove_stale

KERNELS = (  # (the kernel source, the ops whose C shims it defines)
    (block_dot.SOURCE, block_dot.OPS),
    (packed.SOURCE, packed.OPS),
    (gguf_blocks.SOURCE, gguf_blocks.OPS),
    (gguf_dot.SOURCE, gguf_dot.OPS),
    (attention.SOURCE, attention.OPS),
    (moe.SOURCE, moe.OPS + moe_gguf.OPS),  # moe_gguf's shims are moe.cpp's too
    (gated_delta.SOURCE, gated_delta.OPS),
)
# Kernel sources that call into others' code, linked with them (moe.cpp's experts on GGUF
# blocks run gguf_blocks.cpp's and gguf_dot.cpp's kernels, on panels packed.cpp's).
NEEDS = {moe.SOURCE: (gguf_blocks.SOURCE, gguf_dot.SOURCE, packed.SOURCE)}
C_SHIMS = "aot_inductor.custom_ops_to_c_shims"
LIBS = "aot_inductor.custom_op_libs"
LINK_SCRIPT = "aotgen-objects.ld"
HEADER = "#include <torch/csrc/inductor/aoti_runtime/utils.h>\n"  # AtenTensorHandle, shim.h
_SHIM = re.compile(r"^[^\n;{}]*AOTITorchError (aoti_torch_cpu_\w+)\(([^)]*)\)\s*\{", re.MULTILINE)


def declarations(source: Path) -> dict[str, str]:
    """Shim name -> the declaration the wrapper needs, read from the source's definitions.
    C++ linkage: a declaration that disagrees with the definition fails to link."""
    return {
        name: f'"C++" AOTITorchError {name}({" ".join(params.split())})'
        for name, params in _SHIM.findall(source.read_text())
    }


def used_kernels(graph: torch.fx.Graph) -> list[tuple[Path, list]]:
    """The kernel sources the graph calls into, with the ops it calls."""
    targets = {node.target for node in graph.nodes}
    used = [(source, [op for op in ops if op in targets]) for source, ops in KERNELS]
    return [(source, ops) for source, ops in used if ops]


def link_options(graph: torch.fx.Graph, directory: Path) -> tuple[dict, list[KernelObject]]:
    """Inductor options that declare the shims the graph calls, and the kernel objects that
    define them in `directory` (built and linked by `linking`)."""
    shims: dict = {}
    sources: list[Path] = []
    for source, ops in used_kernels(graph):
        declared = declarations(source)
        for op in ops:
            name = f"aoti_torch_cpu_{op._opname}"
            if name not in declared:
                raise RuntimeError(f"{source.name} defines no C shim {name}")
            shims[op] = [declared[name]]
        sources += [source, *NEEDS.get(source, ())]
    objects = [KernelObject.of(source, directory) for source in dict.fromkeys(sources)]
    return ({C_SHIMS: shims} if shims else {}), objects


def library_options(objects: list[KernelObject]) -> dict:
    """The Inductor option that links `objects`: one linker script (`linking` writes it),
    named alike for every graph. AOTInductor keys its precompiled headers by the compile
    command, libraries included: a name per set of objects built two headers (~9 s each on
    one core) for every set."""
    return {LIBS: [f":{LINK_SCRIPT}"]} if objects else {}


def _compile_options():
    from torch._inductor.cpp_builder import CppTorchDeviceOptions
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    # The wrapper's options (codecache.AotCodeCompiler): the kernels pin their own
    # optimisation level with `#pragma GCC optimize`.
    return CppTorchDeviceOptions(
        vec_isa=pick_vec_isa(), device_type="cpu", aot_mode=True, compile_only=True,
        min_optimize=True,
    )  # fmt: skip


@dataclass(frozen=True)
class KernelObject:
    """A C++ source compiled to `path` = `<dir>/aotgen-<stem>-<key>.o`, the key covering the
    source, the flags, the compiler and torch (whose headers it includes): a changed kernel,
    CPU or torch compiles anew."""

    text: str
    path: Path

    @staticmethod
    def of(source: Path, directory: Path) -> KernelObject:
        return KernelObject.from_text(source.stem, HEADER + source.read_text(), directory)

    @staticmethod
    def from_text(stem: str, text: str, directory: Path) -> KernelObject:
        from torch._inductor.cpp_builder import get_compiler_version_info

        options = _compile_options()
        flags = (
            options.get_compiler(),
            get_compiler_version_info(options.get_compiler()),
            options.get_definitions(),
            options.get_include_dirs(),
            options.get_cflags(),
            options.get_passthrough_args(),
            torch.__version__,
        )
        key = hashlib.sha256((text + json.dumps(flags)).encode()).hexdigest()[:20]
        return KernelObject(text, directory / f"aotgen-{stem}-{key}.o")

    def build(self) -> None:
        """Compile, if not there yet: in a private dir, renamed into place whole."""
        from torch._inductor.cpp_builder import CppBuilder

        if self.path.is_file():
            return
        remove_stale(self.path.parent)
        work = partial_dir(self.path)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        unit = work / f"{self.path.stem}.cpp"
        unit.write_text(self.text)
        builder = CppBuilder(
            name=self.path.stem, sources=str(unit), output_dir=str(work),
            BuildOption=_compile_options(),
        )  # fmt: skip
        builder.build()
        Path(builder.get_target_file_path()).replace(self.path)
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def linking(objects: list[KernelObject]) -> Iterator[None]:
    """The objects built, and while AOTInductor links, LIBRARY_PATH (where gcc looks for
    `-l`) leading to a linker script that names them by absolute, quoted paths: a directory
    is never put on LIBRARY_PATH itself, which splits at `:`."""
    if not objects:
        yield
        return
    for obj in objects:
        obj.build()
    before = os.environ.get("LIBRARY_PATH")
    with tempfile.TemporaryDirectory(prefix="aotgen-link-") as script_dir:
        names = " ".join(json.dumps(str(obj.path.resolve())) for obj in objects)
        Path(script_dir, LINK_SCRIPT).write_text(f"INPUT({names})\n")
        os.environ["LIBRARY_PATH"] = os.pathsep.join([script_dir] + ([before] if before else []))
        try:
            yield
        finally:
            if before is None:
                del os.environ["LIBRARY_PATH"]
            else:
                os.environ["LIBRARY_PATH"] = before


@contextlib.contextmanager
def kernel_dir(cache: Path | None) -> Iterator[Path]:
    """Where kernel objects live: `kernels/` beside the compile cache, or a temporary dir.
    Absolute: the compiler runs in a directory of its own (a relative cache dir, the default
    without `aotgen.toml`, would name no file there)."""
    if cache is not None:
        directory = (cache.parent / "kernels").absolute()
        directory.mkdir(parents=True, exist_ok=True)
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix="aotgen-kernels-") as tmp:
        yield Path(tmp)
