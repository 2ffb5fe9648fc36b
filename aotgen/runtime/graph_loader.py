"""Opening one AOTInductor graph of a package, leaving nothing behind in the temp dir.

torch's loader extracts the graph's library from its `.pt2` into a fresh
`$TMPDIR/aotinductor_XXXXXX/` and removes it only when the loader is destroyed: a process
stopped by SIGTERM's default action, SIGKILL or a crash leaves it there (a few MB per graph,
each start of a service). On a CPU nothing in it is read after the library is mapped, so the
directory is removed as soon as the loader is open; the mapping outlives the files.
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import torch

_OPENING = threading.Lock()  # a loader's new mappings are its own, not another thread's


def _is_extraction(name: str) -> bool:
    """mkdtemp's name for an extraction: aotinductor_ and six random characters."""
    return name.startswith("aotinductor_") and len(name) == len("aotinductor_XXXXXX")


def mapped_extractions() -> set[Path]:
    """The extraction directories holding a library this process has mapped (Linux's
    /proc/self/maps; empty elsewhere)."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return set()
    found: set[Path] = set()
    for line in lines:
        if "/aotinductor_" not in line:  # most lines: torch's and Python's own libraries
            continue
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            found.update(p for p in Path(fields[5]).parents if _is_extraction(p.name))
    return found


class TempDirError(ValueError):
    """The temp dir, where torch's loader extracts a graph, cannot be written."""


def _loader(pt2: Path, package_model: str, device: torch.device) -> Any:
    # (path, model name, run single-threaded, runners, device index): -1 is CPU. On a GPU
    # single-threaded, so that a call can be captured as a CUDA graph (runtime/cuda_graph.py).
    index = -1 if device.type == "cpu" else (device.index or 0)
    gpu = device.type == "cuda"
    try:
        return torch._C._aoti.AOTIModelPackageLoader(str(pt2), package_model, gpu, 1, index)
    except RuntimeError as e:
        if "temporary directory" not in str(e):
            raise
        raise TempDirError(
            f"cannot extract graph {package_model} of {pt2.name} into the temp dir ({e}): "
            "set TMPDIR to a writable directory"
        ) from None


def open_loader(pt2: Path, package_model: str, device: torch.device) -> Any:
    """The AOTInductor loader of one graph on `device`: the runtime binds weights and runs
    graphs through it, and the builder reads the constant names a graph asks for."""
    if device.type == "cuda":  # its kernels' cubins are read from the directory at first call
        return _loader(pt2, package_model, device)
    with _OPENING:
        before = mapped_extractions()
        loader = _loader(pt2, package_model, device)
        for directory in mapped_extractions() - before:
            shutil.rmtree(directory, ignore_errors=True)
    return loader
