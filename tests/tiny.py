"""Tiny random HF-layout checkpoints that build in seconds (made by the tests, never shipped)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and verifies them in one pass.",
    "Ahead-of-time compilation turns a checkpoint into a package.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "1 2 3 4 5 6 7 8 9 10 11 12",
] * 20
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(
    out: Path, vocab_size: int = 320, specials: list[str] | tuple[str, ...] = tuple(SPECIALS)
) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
        )
    )
    return tok


def make_tiny_checkpoint(
    out: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    tie: bool = False,
    seed: int = 0,
    std: float = 0.08,
) -> Path:
    """A random Llama checkpoint; weights large enough that greedy choices are not near-ties."""
    out.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(out)
    vocab = tok.get_vocab_size()
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": tie,
        "bos_token_id": tok.token_to_id("<|im_start|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": rnd(vocab, hidden) * 10, "model.norm.weight": 1 + rnd(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rnd(heads * head_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_heads * head_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden, heads * head_dim)
        w[p + "mlp.gate_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.up_proj.weight"] = rnd(intermediate, hidden)
        w[p + "mlp.down_proj.weight"] = rnd(hidden, intermediate)
        w[p + "input_layernorm.weight"] = 1 + rnd(hidden)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden)
    if not tie:
        w["lm_head.weight"] = rnd(vocab, hidden) * 4
    save_file(w, str(out / "model.safetensors"))
    return out
