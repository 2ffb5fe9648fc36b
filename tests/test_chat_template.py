"""A recipe's `chat_template`: the package carries it and both runtimes render it instead of
the checkpoint's, as transformers renders the same template; its content is part of the build's
identity. Bad templates are refused before any compile (tests/bad_input/test_bad_cli.py)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import TINY_RECIPE
from reference import CHAT_TEMPLATES

from aotgen.package.build import build
from aotgen.package.inputs import build_hash
from aotgen.package.manifest import read_manifest
from aotgen.recipe import parse_recipe
from aotgen.runtime.engine import Engine, GenerationConfig

GEMMA = "google-gemma-2-2b-it.jinja"  # not ChatML: the template itself renders every chat
MESSAGES = [
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def templated_package(tiny_checkpoint, project, tmp_path_factory) -> Path:
    """The tiny package built with Gemma 2's template (the checkpoint's is ChatML)."""
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text((CHAT_TEMPLATES / GEMMA).read_text())
    data = {"checkpoint": str(tiny_checkpoint), "chat_template": str(template), **TINY_RECIPE}
    return build(parse_recipe(data, "tiny-gemma-chat", Path(".")), project).path


def test_the_package_renders_the_recipes_template_as_transformers(
    templated_package, tiny_checkpoint
):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint).apply_chat_template(
        MESSAGES, chat_template=(CHAT_TEMPLATES / GEMMA).read_text(), tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    tokenizer = Engine.load(templated_package).tokenizer  # every file verified against its hash
    assert tokenizer.chat_prompt(MESSAGES) == reference
    assert reference.count("<start_of_turn>") == 4  # Gemma's turns, not the checkpoint's ChatML
    manifest = read_manifest(templated_package)
    assert "chat_template.jinja" in manifest["tokenizer"]["files"]
    assert "tokenizer/chat_template.jinja" in manifest["files"]


def test_the_cpp_runtime_renders_it_too(run_bin, templated_package):
    engine = Engine.load(templated_package)
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    args = ["--chat", "Hi", "--ids", "--max-new-tokens", "6", "--ignore-eos"]
    proc = subprocess.run(
        [str(run_bin), str(templated_package), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["prompt_ids"] == ids
    assert got["ids"] == engine.generate(ids, GenerationConfig(6, ignore_eos=True)).token_ids


def test_the_templates_content_is_part_of_the_build_identity(tiny_checkpoint, tmp_path):
    """Editing the template file makes the package out of date; moving it does not."""
    from aotgen.checkpoint.hf import open_checkpoint

    ckpt = open_checkpoint(tiny_checkpoint)

    def digest(path: Path, text: str) -> str:
        path.write_text(text)
        data = {"checkpoint": str(tiny_checkpoint), "chat_template": str(path), **TINY_RECIPE}
        return build_hash(ckpt, parse_recipe(data, "t", Path(".")), [])

    first = digest(tmp_path / "a.jinja", "{{ messages[0]['content'] }}")
    assert digest(tmp_path / "b.jinja", "{{ messages[0]['content'] }}") == first
    assert digest(tmp_path / "a.jinja", "{{ messages[-1]['content'] }}") != first
