"""Hugging Face-layout checkpoint directories: config, safetensors weights, tokenizer files."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from aotgen.checkpoint import multimodal, prequantized

BLOCKS_FILE = "gguf_blocks.safetensors"  # written by checkpoint/gguf.py
INPUT_ORDER = ".input_order"  # BLOCKS_FILE: a kept weight's input behind each block input
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",  # a vision-language model's processor template
)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded, with the reason and the fix."""


@dataclass
class Checkpoint:
    path: Path
    config: dict
    weight_files: list[Path]
    tokenizer_files: list[Path]
    # a vision-language checkpoint: its language model's tensors only, under its names
    text_part: bool = False
    # a quantized checkpoint's float weights and blocks (checkpoint/prequantized.py), read once
    _quantized: prequantized.QuantizedRead | None = field(default=None, repr=False)

    def load_weights(self) -> dict[str, torch.Tensor]:
        """All tensors, as fp32 CPU tensors (the build's reference precision); a quantized
        checkpoint's packed linears dequantized."""
        if self.quant_scheme is not None:
            return dict(self._read_quantized().weights)
        return {name: t.float() for name, t in self._read_tensors().items()}

    @property
    def quant_scheme(self) -> prequantized.Scheme | None:
        return _quant_scheme(self.path, self.config)

    def _read_tensors(self) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for f in self.weight_files:
            try:
                with safe_open(str(f), framework="pt") as sf:
                    for name in sf.keys():
                        key = multimodal.text_name(name) if self.text_part else name
                        if key is None:
                            continue
                        tensor = sf.get_tensor(name)
                        if self.text_part:
                            tensor = multimodal.text_tensor(self.config, key, tensor)
                        tensors[key] = tensor
            except (SafetensorError, OSError) as e:
                raise CheckpointError(
                    f"cannot read {f}: {e}. The file is truncated or corrupt: re-create it "
                    "(e.g. `aotgen import-gguf` again)"
                ) from None
        return tensors

    def quant_note(self) -> str | None:
        """What a quantized checkpoint was read as, for the build's report."""
        scheme = self.quant_scheme
        return None if scheme is None else self._read_quantized().note(scheme)

    def _read_quantized(self) -> prequantized.QuantizedRead:
        if self._quantized is None:
            scheme = self.quant_scheme
            assert scheme is not None
            try:
                self._quantized = prequantized.read_quantized(self._read_tensors(), scheme)
            except prequantized.QuantConfigError as e:
                raise CheckpointError(f"{self.path}: {e}") from None
        return self._quantized

    def block_input_orders(self) -> dict[str, np.ndarray]:
        """For the linears whose blocks hold their inputs in another order (a quantized
        checkpoint's act-order ones, a GGUF's whose inputs the import moved): the weight's
        input behind each block input (load_gguf_blocks)."""
        if self.quant_scheme is not None:
            return self._read_quantized().orders
        orders = self._read_blocks_file(orders=True)
        return {name.removesuffix(INPUT_ORDER): order for name, (_, order) in orders.items()}

    def load_gguf_blocks(self) -> dict[str, tuple[str, np.ndarray]]:
        """The GGUF blocks `aotgen import-gguf` kept: name -> (block type, uint8 [rows, bytes]);
        for a GPTQ, AWQ or compressed-tensors checkpoint, its codes as blocks (of its inputs
        in block_input_orders where it names the weight)."""
        if self.quant_scheme is not None:
            blocks = self._read_quantized().blocks
            if not blocks:
                raise CheckpointError(
                    f"{self.path}: no linear's codes fit a GGUF block type (FP8, groups "
                    "not a multiple of 32 inputs, or 8-bit with zero points), so "
                    "`quantize: {gguf: keep}` has nothing to keep: leave it out to build the "
                    "dequantized weights, or quantize them again (`quantize: {linear: int4}`)"
                )
            return blocks
        if not (self.path / BLOCKS_FILE).is_file():
            raise CheckpointError(
                f"{self.path} holds no GGUF blocks ({BLOCKS_FILE}): `quantize: {{gguf: keep}}` "
                "needs a GPTQ, AWQ or compressed-tensors checkpoint, or one imported from a "
                "quantized GGUF by this version; run `aotgen import-gguf FILE.gguf DIR` again or "
                "point the recipe at the .gguf file"
            )
        return self._read_blocks_file(orders=False)

    def _read_blocks_file(self, orders: bool) -> dict[str, tuple[str, np.ndarray]]:
        """BLOCKS_FILE's blocks, or its input orders (`INPUT_ORDER` names), each with its
        metadata; none if there is no such file."""
        path = self.path / BLOCKS_FILE
        if not path.is_file():
            return {}
        try:
            with safe_open(str(path), framework="np") as sf:
                types = sf.metadata() or {}
                names = [n for n in sf.keys() if n.endswith(INPUT_ORDER) == orders]
                return {name: (types[name], sf.get_tensor(name)) for name in names}
        except (SafetensorError, OSError, KeyError) as e:
            raise CheckpointError(
                f"cannot read {path}: {e}. Re-create it with `aotgen import-gguf`"
            ) from None


def _quant_scheme(path: Path, config: dict) -> prequantized.Scheme | None:
    try:
        return prequantized.scheme(config)
    except prequantized.QuantConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); re-create the checkpoint") from None


def open_checkpoint(path: str | Path) -> Checkpoint:
    """Find and sanity-check the files of an HF checkpoint dir without loading weights."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint dir not found: {path}. Create one with "
            "`aotgen import-gguf FILE.gguf DIR` or point the recipe at an HF model dir"
        )
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face checkpoint dir")
    config = _read_json(path / "config.json")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index)["weight_map"]
        weight_files = [path / s for s in sorted(set(weight_map.values()))]
    else:
        weight_map, weight_files = None, [path / "model.safetensors"]
    missing = [f.name for f in weight_files if not f.is_file()]
    if missing:
        raise CheckpointError(
            f"{path} is missing weight file(s) {', '.join(missing)}; "
            "only .safetensors weights are read (never pickles)"
        )
    text_part = multimodal.is_multimodal(config)
    if text_part:
        names = weight_map or _tensor_names(weight_files[0])
        try:
            config = multimodal.text_config(config, names)
        except ValueError as e:
            raise CheckpointError(f"{path}/{e}") from None
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json; the package needs the tokenizer")
    tokenizer_files = [path / f for f in TOKENIZER_FILES if (path / f).is_file()]
    _quant_scheme(path, config)  # an unreadable quantization_config: an error before any work
    return Checkpoint(path, config, weight_files, tokenizer_files, text_part)


def _tensor_names(path: Path) -> list[str]:
    """The tensors a safetensors file holds (its header only)."""
    try:
        with safe_open(str(path), framework="pt") as sf:
            return list(sf.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(
            f"cannot read {path}: {e}. The file is truncated or corrupt; get it again"
        ) from None


def write_checkpoint_dir(out_dir: Path, write: Callable[[Path], None]) -> Path:
    """Run `write(tmp)` in a temp dir beside out_dir, then swap it into place, so an
    interrupted write never leaves a half-written checkpoint behind; returns out_dir."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the checkpoint is an ordinary dir
        write(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes 0600
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
