"""The tokenizer a GGUF carries (`tokenizer.ggml.*`) as a Hugging Face `tokenizers` object.

Two llama.cpp tokenizer models are implemented, each producing the ids llama.cpp produces:

- `gpt2`: byte-level BPE from tokens + merges. The pre-tokenizer is not stored in the file, only
  its name (`tokenizer.ggml.pre`); llama.cpp compiles in one list of regexes per name and
  applies them one after another, each splitting the pieces the previous one left. Here each
  regex is a `Split(..., "isolated")` step, in the same order.
- `llama`: SentencePiece-style BPE from tokens + scores. SentencePiece merges the adjacent pair
  whose concatenation is the highest-scoring vocabulary entry; a BPE whose merge ranks follow
  the merged token's score does the same (as transformers' SentencePiece converter builds
  them). Pieces outside the vocabulary fall back to `<0xXX>` byte tokens.

A tokenizer model or pre-tokenizer name not listed here is an error: splitting text the wrong
way gives ids the model never saw, and the output is quietly worse.
"""

from __future__ import annotations

from typing import Any

import gguf
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
)

from aotgen.checkpoint.hf import CheckpointError

# llama.cpp src/llama-vocab.cpp: the regexes behind each `tokenizer.ggml.pre` name.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's with combining marks (\p{M}) inside words.
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Seed-OSS's: Qwen2's with one digit at a time and no newlines after punctuation.
_SEED_CODER = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3's (and Hunyuan dense's) three splits: digits in threes, CJK runs, then words
# and punctuation.
_DEEPSEEK3 = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# DeepSeek LLM's / DeepSeek-V2's: newlines alone, runs of letters of its scripts, of
# punctuation, trailing spaces, CJK runs, digit runs; DeepSeek-Coder's: one digit at a time.
_DEEPSEEK_CJK = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_LLM = [
    r"[\r\n]",
    (
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
        "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0"
        "-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-"
        "\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
        "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
        "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
        "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
        "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
        "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00"
        "-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
        "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
        "\U000118df\U0001e900-\U0001e943]+"
    ),
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+$",
    _DEEPSEEK_CJK,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}"]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]
# Mistral's Tekken (Nemo, Small 3.x, Ministral 3), as llama.cpp writes it: o200k's letter
# classes without its contractions, one digit at a time.
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (gpt-oss, `gpt-4o`), as llama.cpp writes it: the original's case classes as letters
# other than a-z, then letters other than A-Z (its regex engine has no \p{Lu} / \p{Ll}).
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS: dict[str, list[str]] = {
    "default": _DEFAULT,
    "gpt-2": [_GPT2],
    "gpt2": [_GPT2],
    "phi-2": [_GPT2],
    "exaone4": [_GPT2],
    "a.x-4.0": [_GPT2],
    "mellum": [_GPT2],
    "mpt": [_GPT2],
    "olmo": [_GPT2],
    "jais": [_GPT2],
    "llama-bpe": [_LLAMA3],
    "glm4": [_LLAMA3],  # GLM-4, GLM-4.7-Flash: Llama 3's regex, merges applied
    "chatglm-bpe": [_LLAMA3],
    "llama3": [_LLAMA3],
    "llama-v3": [_LLAMA3],
    "dbrx": [_LLAMA3],
    "smaug-bpe": [_LLAMA3],
    "lfm2": [_LLAMA3],
    "pixtral": [_LLAMA3],
    "tekken": [_TEKKEN],
    "gpt-4o": [_GPT4O],
    "qwen2": [_QWEN2],
    "qwen35": [_QWEN35],
    "stablelm2": [_QWEN2],
    "solar-open": [_QWEN2],
    "seed-coder": [_SEED_CODER],
    "hunyuan-dense": _DEEPSEEK3,
    "deepseek-v3": _DEEPSEEK3,
    "deepseek-llm": _DEEPSEEK_LLM,
    "deepseek-coder": _DEEPSEEK_CODER,
    "starcoder": [r"\p{N}", _GPT2],
    "refact": [r"\p{N}", _GPT2],
    "command-r": [r"\p{N}", _GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "codeshell": [r"\p{N}", _GPT2],
    "exaone": [r"\p{N}", _GPT2],
    "minerva-7b": [r"\p{N}", _GPT2],
}
TOKENIZER_MODELS = ("gpt2", "llama")
# Pre-tokenizers after which llama.cpp takes a piece that is a vocabulary entry whole, whatever
# the merges would make of it (its `ignore_merges`, as these tokenizers' own tokenizer.json
# says), and that add bos where the file does not say (`add_bos`).
IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3", "lfm2", "pixtral", "tekken")
BOS_BY_DEFAULT = IGNORE_MERGES


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _require(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise CheckpointError(f"GGUF metadata is missing required key {key!r}")
    return value


def check_tokenizer(reader: gguf.GGUFReader) -> None:
    """Refuse a tokenizer model or pre-tokenizer aotgen does not implement (before any write)."""
    model = _field(reader, "tokenizer.ggml.model")
    if model not in TOKENIZER_MODELS:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.model {model!r} is not supported; supported: "
            + ", ".join(TOKENIZER_MODELS)
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"GGUF tokenizer.ggml.pre {pre!r} is not supported; supported: "
            + ", ".join(sorted(PRE_TOKENIZERS))
        )


def adds_bos(reader: gguf.GGUFReader) -> bool:
    """Whether llama.cpp puts bos before a prompt: as the file says, else by default for
    SentencePiece vocabularies and the pre-tokenizers of BOS_BY_DEFAULT."""
    stored = _field(reader, "tokenizer.ggml.add_bos_token")
    if stored is not None:
        return bool(stored)
    if _field(reader, "tokenizer.ggml.model") == "llama":
        return True
    return _field(reader, "tokenizer.ggml.pre", "default") in BOS_BY_DEFAULT


def _add_vocab_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens are matched whole (special); user-defined ones too, as llama.cpp splits
    them out of the text before the model sees it."""
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == gguf.TokenType.USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _gpt2_tokenizer(reader: gguf.GGUFReader, tokens: list[str]) -> Tokenizer:
    merges = [tuple(m.split(" ", 1)) for m in _require(reader, "tokenizer.ggml.merges")]
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in IGNORE_MERGES))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    gpt2_split = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # GPT-2 and [\p{N}, GPT-2] in the simpler form both runtimes' tokenizers read.
    if PRE_TOKENIZERS[pre] == [_GPT2]:
        tok.pre_tokenizer = gpt2_split
    elif PRE_TOKENIZERS[pre] == [r"\p{N}", _GPT2]:
        digits = pre_tokenizers.Digits(individual_digits=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, gpt2_split])
    else:
        steps = [pre_tokenizers.Split(Regex(r), "isolated") for r in PRE_TOKENIZERS[pre]]
        tok.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-driven pairing: every split of a normal
    vocabulary entry into two entries, ranked by the entry's score (highest first)."""
    vocab = {
        t: i
        for i, (t, ty) in enumerate(zip(tokens, types, strict=True))
        if ty in (gguf.TokenType.NORMAL, gguf.TokenType.USER_DEFINED)
    }
    found: list[tuple[float, int, int, str, str]] = []
    for piece, i in vocab.items():
        if types[i] != gguf.TokenType.NORMAL:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _llama_tokenizer(reader: gguf.GGUFReader, tokens: list[str], types: list[int]) -> Tokenizer:
    scores = _require(reader, "tokenizer.ggml.scores")
    if len(scores) != len(tokens):
        raise CheckpointError(
            f"GGUF tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens"
        )
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    merges = spm_merges(tokens, [float(s) for s in scores], types)
    bpe = models.BPE(
        {t: i for i, t in enumerate(tokens)},
        merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(bpe)
    prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
    scheme = "first" if prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace("▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def build_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """The `tokenizers` equivalent of the GGUF's tokenizer (see the module docstring)."""
    check_tokenizer(reader)
    tokens: list[str] = _require(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(
            f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if _field(reader, "tokenizer.ggml.model") == "gpt2":
        tok = _gpt2_tokenizer(reader, tokens)
    else:
        tok = _llama_tokenizer(reader, tokens, types)
    _add_vocab_tokens(tok, tokens, types)
    return tok
