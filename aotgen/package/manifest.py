"""The package manifest: what was built, with what, and the sha256 of every file.

Shared by the builder (writes it) and the runtime (checks it before any `.so` is loaded),
so it imports nothing but the standard library, and torch only inside the functions that ask
its version or ISA: reading a manifest (the CLI's first check of a package) loads no torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import platform
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

FORMAT_VERSION = 3
MANIFEST = "manifest.json"
ISA_ORDER = ("DEFAULT", "AVX2", "AVX512")
# Files are hashed in chunks so that all cores verify a package at load (one sha256 over
# 555 MB takes ~0.4 s on one core). `split -b 64M FILE && sha256sum x*` gives the same list.
HASH_CHUNK_BYTES = 64 << 20


class PackageError(RuntimeError):
    """A package that must not be loaded, with the reason and what to do."""


def sha256_chunks(path: Path, chunk_bytes: int = HASH_CHUNK_BYTES) -> list[str]:
    """sha256 of each `chunk_bytes` piece of the file, hashed in parallel (hashlib drops
    the GIL while hashing, and the mapping saves a copy per byte)."""
    size = path.stat().st_size
    if size == 0:
        return [hashlib.sha256().hexdigest()]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        starts = range(0, size, chunk_bytes)

        def digest(start: int) -> str:
            return hashlib.sha256(view[start : start + chunk_bytes]).hexdigest()

        try:
            with ThreadPoolExecutor(min(len(starts), os.cpu_count() or 1)) as pool:
                return list(pool.map(digest, starts))
        finally:
            view.release()


def target_info(device: str = "cpu") -> dict[str, str]:
    """Where compiled code built now can run: the ISA Inductor compiled the host code for,
    the OS, and for CUDA the GPU architecture its kernels were compiled for."""
    import torch

    info = {
        "device": device,
        "isa": torch.backends.cpu.get_cpu_capability(),
        "platform": f"{platform.system().lower()}-{platform.machine()}",
    }
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        info |= {
            "gpu": torch.cuda.get_device_name(),
            "compute_capability": f"{major}.{minor}",
            "cuda": str(torch.version.cuda),
        }
    return info


def cuda_problem() -> str | None:
    """Why CUDA packages cannot be built or run here, or None if they can."""
    import torch

    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    return None


def hash_files(root: Path) -> dict[str, dict[str, Any]]:
    """sha256 (per chunk) and size of every file under `root` except the manifest itself."""
    files = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[p.relative_to(root).as_posix()] = {
                "sha256": sha256_chunks(p),
                "bytes": p.stat().st_size,
            }
    return files


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    manifest = {**manifest, "hash_chunk_bytes": HASH_CHUNK_BYTES, "files": hash_files(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of the package at `root`, checked for format and structure."""
    root = Path(root)
    path = root / MANIFEST
    if path.is_symlink() or not path.is_file():
        raise PackageError(
            f"{root} is not an aotgen package (no {MANIFEST}); build one with `aotgen build RECIPE`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PackageError(f"{path} is corrupt ({e}); rebuild the package") from None
    if not isinstance(manifest, dict) or manifest.get("format_version") != FORMAT_VERSION:
        got = manifest.get("format_version") if isinstance(manifest, dict) else None
        raise PackageError(
            f"{root}: package format {got}, this aotgen reads "
            f"format {FORMAT_VERSION}; rebuild the package with this aotgen"
        )
    _check_structure(manifest, path)
    return manifest


# What a package's KV cache may hold (recipe.KV_DTYPES).
CACHE_DTYPES = ("float32", "bfloat16", "int8")

# The manifest keys loading relies on, with their JSON types.
_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "torch_version": str,
    "target": dict,
    "files": dict,
    "hash_chunk_bytes": int,
    "package": str,
    "models": dict,
    "tokenizer": dict,
    "max_seq_len": int,
    "verify_k": int,
}


def _check_structure(manifest: dict[str, Any], path: Path) -> None:
    """Every key loading reads is there with its type, so a damaged manifest is one clear
    error here rather than a KeyError deep in the runtime."""

    def bad(what: str) -> PackageError:
        return PackageError(f"{path} is malformed ({what}); rebuild the package")

    for key, kind in _REQUIRED.items():
        if key not in manifest:
            raise bad(f"no `{key}`")
        if not isinstance(manifest[key], kind) or isinstance(manifest[key], bool):
            raise bad(f"`{key}` is not a {getattr(kind, '__name__', kind)}")
    for key in ("device", "isa", "platform"):
        if not isinstance(manifest["target"].get(key), str):
            raise bad(f"`target.{key}` missing")
    if manifest["hash_chunk_bytes"] <= 0:
        raise bad("`hash_chunk_bytes` is not positive")
    for rel, entry in manifest["files"].items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and isinstance(entry.get("sha256"), list)
            and all(isinstance(h, str) for h in entry["sha256"])
        )
        if not ok:
            raise bad(f"`files.{rel}` needs `bytes` and a `sha256` list")
    world = manifest.get("world_size", 1)
    if world != 1 and not (
        isinstance(manifest.get("ranks"), list) and len(manifest["ranks"]) == world
    ):
        raise bad(f"`ranks` does not list the {world} ranks of `world_size`")
    if "target" not in manifest["models"]:
        raise bad("no `models.target`")
    for role, entry in manifest["models"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("weights"), dict):
            raise bad(f"`models.{role}.weights` missing")
        _check_kv_cache(entry.get("kv_cache"), f"models.{role}.kv_cache", bad)
    try:
        referenced_files(manifest)
    except (KeyError, TypeError, AttributeError) as e:
        raise bad(f"a file reference is missing: {e}") from None


def _check_kv_cache(kv: Any, where: str, bad: Callable[[str], PackageError]) -> None:
    """The cache the runtime allocates: a known dtype, `cache_len`, 4-D `shapes`."""
    dtype = kv.get("dtype") if isinstance(kv, dict) else None
    if dtype not in CACHE_DTYPES:
        raise bad(f"`{where}`: dtype {dtype}, not one of {', '.join(CACHE_DTYPES)}")
    shapes = kv.get("shapes")
    if not (
        isinstance(kv.get("cache_len"), int)
        and isinstance(shapes, list)
        and shapes
        and all(
            isinstance(s, list)
            and len(s) == 4
            and all(type(n) is int and n > 0 for n in s[:3])
            and type(s[3]) is int
            and s[3] >= 0  # a latent-attention layer's values: none (model/mla.py)
            for s in shapes
        )
    ):
        raise bad(f"`{where}` needs `cache_len` and 4-D `shapes`")
    dtypes = kv.get("dtypes", [dtype] * len(shapes))
    if not (isinstance(dtypes, list) and len(dtypes) == len(shapes)) or any(
        d not in CACHE_DTYPES for d in dtypes
    ):
        raise bad(f"`{where}.dtypes` must name one of {', '.join(CACHE_DTYPES)} per shape")
    ring = kv.get("ring")
    if ring is not None and not (
        isinstance(ring, dict)
        and all(type(ring.get(k)) is int and ring[k] > 0 for k in ("cells", "window"))
        and any(s[2] == ring["cells"] for s in shapes)
    ):
        raise bad(f"`{where}.ring` needs positive `cells` (a layer's length) and `window`")


def kv_cache_bytes(kv: dict[str, Any]) -> int:
    """Bytes one sequence's cache takes: every layer's positions (a ring layer's cells)."""
    lengths = [k[2] for k in kv["shapes"][::2]]
    return sum(b * n for b, n in zip(kv_position_bytes(kv), lengths, strict=True))


def kv_dtypes(kv: dict[str, Any]) -> list[str]:
    """Each cache tensor's dtype, from a checked `kv_cache` entry: `dtype`, or `dtypes` where
    some differ (a linear-attention layer's float32 states)."""
    return kv.get("dtypes") or [kv["dtype"]] * len(kv["shapes"])


def kv_position_bytes(kv: dict[str, Any]) -> list[int]:
    """Bytes one position takes in each layer's cache (its keys and values, or a convolution
    layer's inputs) for one sequence, from a checked `kv_cache` entry: `shapes` are
    `[k0, v0, k1, v1, ...]`, positions on axis 2."""
    import torch

    per_tensor = [
        math.prod(shape) // shape[2] * getattr(torch, dtype).itemsize
        for shape, dtype in zip(kv["shapes"], kv_dtypes(kv), strict=True)
    ]
    return [k + v for k, v in zip(per_tensor[::2], per_tensor[1::2], strict=True)]


def referenced_files(manifest: dict[str, Any]) -> list[str]:
    """Every package-relative path the runtimes open: the compiled package, the weights
    files (per rank for tensor parallel), the ONNX graphs and their data, and the tokenizer
    files."""
    refs = [manifest["package"]]
    refs += [m["weights"]["file"] for m in manifest["models"].values()]
    for m in manifest["models"].values():
        if "onnx" in m:  # formats: [aoti, onnx]
            refs += [*m["onnx"]["graphs"].values(), m["onnx"]["data"]]
    for rank in manifest.get("ranks", []):
        refs.append(rank["package"])
        refs += [w["file"] for w in rank["weights"].values()]
    tok = manifest["tokenizer"]
    refs += [f"{tok['dir']}/{name}" for name in tok["files"]]
    if not all(isinstance(r, str) for r in refs):
        raise TypeError("a path is not a string")
    return refs


def _is_plain_relative(rel: str) -> bool:
    """A normalised relative POSIX path: no root, no `..`/`.`/empty parts, no backslash."""
    parts = rel.split("/")
    return bool(rel) and "\\" not in rel and all(p not in ("", ".", "..") for p in parts)


def check_paths(manifest: dict[str, Any], root: Path) -> None:
    """A package is a closed set of files: every path the manifest names is relative,
    inside the package, listed with its hash, and no link leads out of it."""
    listed = manifest["files"]
    for rel in listed:
        if not _is_plain_relative(rel):
            raise PackageError(
                f"{root}: manifest lists {rel!r}, a path outside the package; refusing"
            )
    for rel in referenced_files(manifest):
        if rel not in listed:
            raise PackageError(
                f"{root}: manifest names {rel!r}, which is not a listed, hashed file of the "
                "package; refusing"
            )
    for path in root.rglob("*"):
        if path.is_symlink():
            raise PackageError(
                f"{root}: {path.relative_to(root).as_posix()} is a symbolic link; a package "
                "holds plain files only (copy it with `cp -rL`); refusing"
            )


def check_compatible(manifest: dict[str, Any], root: Path) -> None:
    """Refuse packages whose native code was built for another torch or a larger ISA."""
    import torch

    built = manifest["torch_version"]
    if built != torch.__version__:
        raise PackageError(
            f"{root} was built with torch {built} but this is torch {torch.__version__}; "
            "compiled AOTInductor code is tied to the torch version: rebuild the package"
        )
    want = manifest["target"]
    if want["device"] == "cuda":
        problem = cuda_problem()
        if problem:
            raise PackageError(
                f"{root} was built for a CUDA GPU ({want.get('gpu')}) but {problem}; "
                "run it on such a machine, or build the recipe with `device: cpu` here"
            )
    have = target_info(want["device"])
    if want["device"] == "cuda" and want["compute_capability"] != have["compute_capability"]:
        raise PackageError(
            f"{root}'s GPU kernels were compiled for compute capability "
            f"{want['compute_capability']} ({want['gpu']}), this GPU is "
            f"{have['compute_capability']} ({have['gpu']}); rebuild the package on this machine"
        )
    if want["platform"] != have["platform"]:
        raise PackageError(
            f"{root} was built for {want['platform']}, this machine is {have['platform']}"
        )
    rank = {isa: i for i, isa in enumerate(ISA_ORDER)}
    if rank.get(want["isa"], len(ISA_ORDER)) > rank.get(have["isa"], 0):
        raise PackageError(
            f"{root} was compiled for {want['isa']} but this CPU supports {have['isa']}; "
            "rebuild the package on (or for) this machine"
        )


def verify_files(manifest: dict[str, Any], root: Path) -> None:
    """Every listed file present with its recorded hash, and no unlisted file."""
    check_paths(manifest, root)
    listed = manifest["files"]
    for rel, entry in listed.items():
        path = root / rel
        if not path.is_file():
            raise PackageError(f"{root}: file {rel} is missing; rebuild or re-copy the package")
        size_ok = path.stat().st_size == entry["bytes"]
        if not size_ok or sha256_chunks(path, manifest["hash_chunk_bytes"]) != entry["sha256"]:
            raise PackageError(
                f"{root}: {rel} does not match its sha256 in the manifest (corrupt or "
                "tampered); refusing to load native code from it. Rebuild the package"
            )
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if not path.is_dir() and rel != MANIFEST and rel not in listed:
            raise PackageError(f"{root}: unexpected file {rel} not in the manifest; refusing")


def verify_package(root: str | Path, check_hashes: bool = True) -> dict[str, Any]:
    """Read and check a package; returns the manifest. Call before loading any `.so`.
    Without `check_hashes` (a package the caller has just written) the paths are still
    checked: loading opens only listed files inside the package."""
    root = Path(root)
    manifest = read_manifest(root)
    check_compatible(manifest, root)
    if check_hashes:
        verify_files(manifest, root)
    else:
        check_paths(manifest, root)
    return manifest
