"""Runtime Tokenizer / StreamDecoder / chat templates on a tiny freshly trained byte-level BPE."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from aotgen.runtime.tokenizer import StreamDecoder, Tokenizer, render_chatml

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# SmolLM2's template: injects a default system prompt when the first message is not "system".
SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Ça va très bien, merci! Größe und Maße. 日本語 テキスト",
    "def hello(name):\n    return f'hello {name}'\n",
] * 20


def _write_dir(path: Path, template: str | None, **tok_config: object) -> Path:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"chat_template": template, "bos_token": "<|im_start|>", "add_bos_token": False}
    config |= {"eos_token": {"content": "<|im_end|>", "special": True}} | tok_config
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_dir(tmp_path_factory.mktemp("tok"), SMOL_TEMPLATE)


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


def test_ids_and_special_tokens(tok: Tokenizer) -> None:
    assert tok.bos_id == 1 and tok.eos_ids == {0, 2} and tok.eos_token == "<|im_end|>"
    for i, text in enumerate(SPECIALS):
        assert tok.encode(text) == [i] and tok.decode([i]) == text
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids and tok.decode(ids, skip_special_tokens=True) == "user\nhi\n"


def test_roundtrip(tok: Tokenizer) -> None:
    for text in [*CORPUS[:4], "unseen wörds ✨🤗 and\ttabs  ", ""]:
        assert tok.decode(tok.encode(text)) == text


def test_chat_prompt_has_no_default_system(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    plain = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.is_chatml
    assert tok.chat_prompt(messages) == plain == render_chatml(messages)
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n" + plain
    )
    sys_prompt = "<|im_start|>system\nBe brief.<|im_end|>\n" + plain
    assert tok.chat_prompt(messages, system="Be brief.") == sys_prompt
    assert tok.chat_prompt([{"role": "system", "content": "Be brief."}, *messages]) == sys_prompt
    assert tok.chat_prompt(messages, add_generation_prompt=False) == plain.removesuffix(
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError, match="either"):
        tok.chat_prompt([{"role": "system", "content": "a"}, *messages], system="b")


def test_non_chatml_template_features(tmp_path: Path) -> None:
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('bad role') }}{% endif %}"
        "{% if loop.index > 2 %}{% break %}{% endif %}\n"  # loopcontrols
        # trim_blocks drops a newline after a block tag, lstrip_blocks the indent before one
        "  {% generation %}[{{ m['role'] }}] {{ m['content'] | tojson }}{% endgeneration %}\n"
        "{{ '|' }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ eos_token }}"
    )
    tok = Tokenizer.from_dir(_write_dir(tmp_path, template))
    assert not tok.is_chatml
    messages = [
        {"role": "user", "content": "<a & 'é'>"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "dropped by break"},
    ]
    # The non-ChatML template is used as is; tojson does not HTML-escape or ASCII-escape.
    assert tok.chat_prompt(messages) == (
        '<|im_start|>[user] "<a & \'é\'>"|\n[assistant] "ok"|\n[assistant]<|im_end|>'
    )
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_no_template_and_named_templates(tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(_write_dir(tmp_path / "a", None))
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert Tokenizer.from_dir(_write_dir(tmp_path / "b", named)).apply_chat_template([]) == "D"
    d = _write_dir(tmp_path / "c", "old")
    (d / "chat_template.json").write_text(json.dumps({"chat_template": "processor's"}))
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "processor's"
    (d / "chat_template.jinja").write_text("new")
    assert Tokenizer.from_dir(d).apply_chat_template([]) == "new"


@pytest.mark.parametrize(
    "text", ["héllo 🤗 wörld", "日本語のテキスト", "👨‍👩‍👧‍👦 family 🇫🇷", "plain ascii", "a\u0301"]
)
def test_stream_decoder_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    dec = StreamDecoder(tok)
    pieces = [dec.put(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == tok.decode(ids) == text


def test_stream_decoder_holds_partial_utf8(tok: Tokenizer) -> None:
    ids = tok.encode("a🤗")
    assert len(ids) > 2  # the emoji is several byte tokens in this tiny vocab
    dec = StreamDecoder(tok)
    assert dec.put(ids[0]) == "a"
    assert [dec.put(i) for i in ids[1:-1]] == [""] * (len(ids) - 2)
    tail = dec.flush()  # generation stopped mid-character: emit what we have, lossy
    assert tail and set(tail) == {"\ufffd"}
    assert dec.flush() == ""


def test_stream_decoder_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nOK<|im_end|>")
    dec = StreamDecoder(tok, skip_special_tokens=True)
    assert "".join(dec.put(i) for i in ids) + dec.flush() == "assistant\nOK"


def test_runtime_imports_no_model_code() -> None:
    code = (
        "import sys, aotgen.runtime.tokenizer; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
        "or m.startswith(('aotgen.model', 'aotgen.export', 'aotgen.checkpoint'))]; "
        "assert not bad, bad"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)
