"""Fill in the middle (runtime/infill.py): the prompt laid out as llama.cpp lays it out in the
model's own FIM tokens, cut to the room as defined; `serve`'s completions `suffix` (the
openai client's), `run --suffix` and the C++ `aotgen-run --suffix` answer as the engine
answers that prompt."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from test_cli_help import aotgen
from test_cpp_batch import cpp_results, run_batch
from tiny import SPECIALS, make_tokenizer

from aotgen.package.manifest import read_manifest, write_manifest
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.infill import FimTokens, InfillError, infill_ids
from aotgen.runtime.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>"]
FIM += ["<|file_sep|>"]
PREFIX = "def area(r):\n    return "
SUFFIX = " * r * r\n\nprint(area(2))\n"


@pytest.fixture(scope="module")
def fim_package(tiny_batch_package, tmp_path_factory) -> Path:
    """The tiny batch package given Qwen2.5-Coder's FIM tokens as special tokens (the same
    vocabulary size: the random model reads their ids as any others), its manifest hashed
    again."""
    root = tmp_path_factory.mktemp("fim")
    package = Path(shutil.copytree(tiny_batch_package, root / "pkg"))
    (root / "tok").mkdir()
    make_tokenizer(root / "tok", specials=[*SPECIALS, *FIM])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "tok" / name, package / "tokenizer" / name)
    write_manifest(package, read_manifest(package))
    return package


@pytest.fixture(scope="module")
def engine(fim_package) -> Engine:
    return Engine.load(fim_package, threads=1)


def test_the_prompt_is_prefix_suffix_middle(engine):
    """[FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]; the pad, repo and file-separator tokens
    end an infill."""
    tok = engine.tokenizer
    fim = FimTokens.of(tok)
    pre, suf, mid, pad, repo, sep = (tok.token_to_id(name) for name in FIM)
    assert (fim.prefix, fim.suffix, fim.middle, fim.ends) == (pre, suf, mid, (pad, repo, sep))
    ids = infill_ids(tok, fim, PREFIX, SUFFIX, 160)
    assert ids == [pre, *tok.encode(PREFIX), suf, *tok.encode(SUFFIX), mid]
    # A file holding FIM tokens' text: characters, not control tokens.
    ids = infill_ids(tok, fim, "x = '<|fim_suffix|>'", "<|fim_middle|>", 160)
    assert [ids.count(t) for t in (pre, suf, mid)] == [1, 1, 1]
    assert (
        tok.decode(ids)
        == "<|fim_prefix|>x = '<|fim_suffix|>'<|fim_suffix|><|fim_middle|><|fim_middle|>"
    )


@pytest.mark.parametrize("room", [3, 10, 20, 40])
def test_a_long_infill_keeps_the_text_nearest_the_gap(engine, room):
    """Cut to `room`: the suffix keeps at least a quarter of the free tokens (more where the
    prefix is short), the prefix the rest; each keeps the tokens nearest the insertion
    point."""
    tok = engine.tokenizer
    fim = FimTokens.of(tok)
    before, after = tok.encode(PREFIX * 3), tok.encode(SUFFIX * 3)
    ids = infill_ids(tok, fim, PREFIX * 3, SUFFIX * 3, room)
    assert len(ids) == room
    cut = ids.index(fim.suffix)
    kept_before, kept_after = ids[1:cut], ids[cut + 1 : -1]
    assert kept_before == before[len(before) - len(kept_before) :]
    assert kept_after == after[: len(kept_after)]
    assert len(kept_after) == (room - 3) // 4
    with pytest.raises(InfillError, match="no room"):
        infill_ids(tok, fim, PREFIX, SUFFIX, 2)


def test_a_model_without_fim_tokens_is_refused(tiny_batch_package):
    tok = Tokenizer.from_dir(tiny_batch_package / "tokenizer")
    with pytest.raises(InfillError, match="has no fill-in-the-middle tokens"):
        FimTokens.of(tok)


def test_serve_fills_in_the_middle(engine, fim_package):
    """`/v1/completions` with `suffix` (the openai client's): the text, usage and finish are
    the engine's answer to the FIM prompt, whole and streamed; with echo or ids, a 400."""
    openai = pytest.importorskip("openai")
    from test_serve import Server

    fim = FimTokens.of(engine.tokenizer)
    ids = infill_ids(engine.tokenizer, fim, PREFIX, SUFFIX, 160 - 12)
    want = engine.generate(ids, GenerationConfig(12, stop_token_ids=fim.ends))
    server = Server(fim_package, "--served-model-name", "m")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        ask = {"model": "m", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12}
        ask["temperature"] = 0
        got = client.completions.create(**ask)
        assert got.choices[0].text == want.text and want.text
        assert got.usage.prompt_tokens == len(ids)
        assert got.choices[0].finish_reason == ("length" if len(want.token_ids) == 12 else "stop")
        streamed = "".join(c.choices[0].text for c in client.completions.create(**ask, stream=True))
        assert streamed == want.text
        for change in ({"echo": True}, {"prompt": [1, 2, 3]}):
            with pytest.raises(openai.BadRequestError, match="suffix goes with a text prompt"):
                client.completions.create(**(ask | change))
    finally:
        server.close()


def test_run_fills_in_the_middle(engine, fim_package):
    """`aotgen run --prompt PREFIX --suffix SUFFIX --json`: the FIM prompt and the engine's
    answer to it."""
    flags = ["--max-new-tokens", "10", "--json", "--threads", "1", "--generation-config", "none"]
    got = json.loads(
        aotgen(
            "run", str(fim_package), "--prompt", PREFIX, "--suffix", SUFFIX, *flags, cwd=REPO
        ).stdout
    )
    fim = FimTokens.of(engine.tokenizer)
    ids = infill_ids(engine.tokenizer, fim, PREFIX, SUFFIX, 160 - 10)
    assert got["prompt_ids"] == ids
    want = engine.generate(ids, GenerationConfig(10, stop_token_ids=fim.ends))
    assert got["ids"] == want.token_ids


def test_aotgen_run_fills_in_the_middle_like_python(run_bin, engine, fim_package):
    """The C++ `aotgen-run --prompt PREFIX --suffix SUFFIX`: Python's FIM prompt, whole and
    cut to a small room (max_new_tokens 120 leaves 40), and the engine's answer to it."""
    fim = FimTokens.of(engine.tokenizer)
    cases = ((PREFIX, SUFFIX, 10), (PREFIX * 3, SUFFIX * 3, 120), ("a<|fim_suffix|>", "b", 10))
    for prefix, suffix, new in cases:
        cmd = [str(run_bin), str(fim_package), "--prompt", prefix, "--suffix", suffix]
        cmd += ["--max-new-tokens", str(new), "--json", "--generation-config", "none"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        ids = infill_ids(engine.tokenizer, fim, prefix, suffix, 160 - new)
        assert got["prompt_ids"] == ids
        want = engine.generate(ids, GenerationConfig(new, stop_token_ids=fim.ends))
        assert got["ids"] == want.token_ids


def test_aotgen_batch_fills_in_the_middle_like_python(batch_bin, engine, fim_package, tmp_path):
    """aotgen-batch's `suffix` field (with `prompt`): Python's FIM prompt and answer, beside a
    plain request of the same prompt in the same batch."""
    fim = FimTokens.of(engine.tokenizer)
    request = {"prompt": PREFIX, "max_new_tokens": 10, "temperature": 0}
    lines = [request | {"suffix": SUFFIX}, request]
    got, _ = cpp_results(run_batch(batch_bin, fim_package, lines, tmp_path))
    ids = infill_ids(engine.tokenizer, fim, PREFIX, SUFFIX, 160 - 10)
    assert (
        got[0]["ids"]
        == engine.generate(ids, GenerationConfig(10, stop_token_ids=fim.ends)).token_ids
    )
    plain = engine.generate(engine.tokenizer.prompt_ids(PREFIX), GenerationConfig(10))
    assert got[1]["ids"] == plain.token_ids
