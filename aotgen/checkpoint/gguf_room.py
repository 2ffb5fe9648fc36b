"""What an import needs: its weights dequantized to float32 (a 4-bit file grows about 7x) are
written beside the output a shard of whole blocks at a time, with the kept blocks; an import
the disk or the memory cannot hold is refused before anything is written."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf

from aotgen.checkpoint.gguf_arch import model_tensors
from aotgen.checkpoint.hf import CheckpointError

SHARD_BYTES = 4 * 2**30  # float32 weights a safetensors file of an import holds
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")


def weight_shards(reader: gguf.GGUFReader) -> list[list[Any]]:
    """The weights in shards of whole blocks (the embeddings, head and final norm one unit),
    each up to SHARD_BYTES as float32 unless one block alone is larger."""
    units: dict[int | None, list[Any]] = {}
    for t in model_tensors(reader):
        units.setdefault(gguf_block(t.name), []).append(t)
    shards: list[list[Any]] = [[]]
    size = 0
    for unit in units.values():
        unit_size = sum(int(t.n_elements) * 4 for t in unit)
        if shards[-1] and size + unit_size > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1] += unit
        size += unit_size
    return shards


def gguf_block(name: str) -> int | None:
    parts = name.split(".", 2)
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 else None


def check_room(reader: gguf.GGUFReader, out_dir: Path) -> None:
    """Refuse an import this machine cannot hold: its weights are dequantized to float32 (a
    4-bit file grows about 7x) and written beside `out_dir` with the kept blocks, a shard at a
    time, which a block's rewriting (experts regrouped, halves joined) may copy once."""
    tensors = model_tensors(reader)
    weights = sum(int(t.n_elements) * 4 for t in tensors)
    blocks = sum(int(t.n_bytes) for t in tensors if t.tensor_type.name in KEPT_TYPES)
    shard = max(sum(int(t.n_elements) * 4 for t in s) for s in weight_shards(reader))
    where = next(p for p in (out_dir.absolute(), *out_dir.absolute().parents) if p.exists())
    free = shutil.disk_usage(where).free
    if weights + blocks > free:
        raise CheckpointError(
            f"importing this GGUF writes {_gb(weights + blocks)} (its weights as float32) but "
            f"{where} has {_gb(free)} free; import it onto a disk with more room"
        )
    memory = available_memory()
    if memory is not None and 2 * shard > memory:
        raise CheckpointError(
            f"importing this GGUF holds up to {_gb(2 * shard)} of float32 weights in memory "
            f"but {_gb(memory)} is available; import it on a machine with more memory"
        )


def available_memory() -> int | None:
    """Memory this process can still take (Linux: MemAvailable + SwapFree); None elsewhere."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in lines) if v}
    if "MemAvailable" not in kib:
        return None
    return (kib["MemAvailable"] + kib.get("SwapFree", 0)) * 1024


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"
