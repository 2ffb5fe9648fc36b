"""Bad input through the real command lines: `aotgen` (Python) and `aotgen-run` (C++).

Each row runs one command in a subprocess, in a fresh project directory whose aotgen.toml keeps
the artifacts and the compile cache inside it, and checks what a user sees and what is left:
the exit status, exactly one line on stderr carrying the row's key phrase, no traceback,
nothing changed outside the project's artifacts and cache dirs (nor in the shared tiny package
and checkpoint), and no `.partial-*` build directory anywhere in the project. The `run` rows
that aotgen-run also takes run through it too: both runtimes refuse the same values, with the
same message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import pytest

GOOD_TOML = (
    'artifacts_dir = "artifacts"\ncache_dir = "cache"\ncheckpoints_dir = "checkpoints"\n'
    "threads = 1\n"
)
SEED_RANGE = "0..18446744073709551615"
TIMEOUT_S = 300  # a row that (wrongly) builds a package takes about a minute


@dataclass(frozen=True)
class Env:
    """The paths a row's `{project}`, `{pkg}` and `{ckpt}` placeholders stand for."""

    project: Path  # the command's working directory, holding aotgen.toml
    package: Path  # the tiny package, built once per session outside the project
    checkpoint: Path  # the tiny checkpoint, likewise

    def fill(self, text: str) -> str:
        for key, value in (("project", self.project), ("pkg", self.package)):
            text = text.replace("{" + key + "}", str(value))
        return text.replace("{ckpt}", str(self.checkpoint))


@dataclass(frozen=True)
class Row:
    id: str
    args: tuple[str, ...]  # after `aotgen`, placeholders filled
    phrase: str  # must appear in the single stderr line
    files: dict[str, str | bytes] = field(default_factory=dict)  # written into the project
    toml: str | bytes = GOOD_TOML
    setup: Callable[[Env], None] | None = None  # more preparation, in the project
    cpp: bool = False  # a `run` row: aotgen-run takes the same arguments
    environ: dict[str, str] = field(default_factory=dict)  # set for the command


def recipe(id: str, yaml: str | bytes, phrase: str, file: str = "r.yaml", **kw) -> Row:
    """`aotgen build recipes/FILE` with a recipe on the tiny checkpoint plus `yaml`."""
    if not isinstance(yaml, bytes):  # a small context, so that a build that wrongly runs is quick
        context = "" if "max_seq_len" in yaml else "max_seq_len: 64\n"
        yaml = "checkpoint: {ckpt}\n" + context + yaml
    files = {f"recipes/{file}": yaml, **kw.pop("files", {})}
    return Row(id, ("build", f"recipes/{file}"), phrase, files=files, **kw)


def run(id: str, args: tuple[str, ...], phrase: str, cpp: bool = True, **kw) -> Row:
    """`aotgen run PACKAGE ARGS`, with `--prompt hi` unless ARGS give the prompt."""
    if not {"--prompt", "--prompt-file", "--chat"} & set(args):
        args = ("--prompt", "hi", *args)
    return Row(id, ("run", "{pkg}", *args), phrase, cpp=cpp, **kw)


def toml(id: str, text: str | bytes, args: tuple[str, ...], phrase: str) -> Row:
    """A bad aotgen.toml under a command that reads it (build, run, bench)."""
    files = {"recipes/r.yaml": "checkpoint: {ckpt}\n"}
    return Row(id, args, phrase, files=files, toml=text)


def bad_config_checkpoint(env: Env) -> None:
    """A copy of the tiny checkpoint whose config.json has a string where a number goes."""
    ckpt = Path(shutil.copytree(env.checkpoint, env.project / "badckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"rope_theta": "abc"}))


def quantized_config_checkpoint(env: Env) -> None:
    """A copy of the tiny checkpoint whose config.json says HQQ quantized it."""
    ckpt = Path(shutil.copytree(env.checkpoint, env.project / "hqqckpt"))
    config = json.loads((ckpt / "config.json").read_text())
    qc = {"quant_method": "hqq", "quant_config": {"nbits": 4}}
    (ckpt / "config.json").write_text(json.dumps(config | {"quantization_config": qc}))


def write_gguf(path: Path) -> bytes:
    """A small valid llama GGUF (metadata, byte-level vocab, a few tensors); returns its bytes."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(ord("a") + i) for i in range(16)])
    w.add_token_merges([])
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (16, 8)), ("blk.0.ffn_up.weight", (16, 8))]:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def cut_gguf(end: int | None) -> Callable[[Env], None]:
    """Write `cut.gguf`: a valid GGUF's bytes up to `end` (a slice end; None: all of them)."""

    def setup(env: Env) -> None:
        data = write_gguf(env.project / "whole.gguf")
        (env.project / "whole.gguf").unlink()
        (env.project / "cut.gguf").write_bytes(data[:end])

    return setup


VICTIM = {"victim/notes.txt": "not a package: must survive any build"}
GGUF_IMPORT = ("import-gguf", "cut.gguf", "out")

ROWS = [
    # ---- recipes: a name is a name, not a path; every scalar has its type
    recipe("name-parent-dir", "name: ../victim\n", "is not a plain name", files=VICTIM),
    recipe("name-nested", "name: a/b\n", "is not a plain name"),
    recipe("name-absolute", "name: {project}/victim\n", "is not a plain name", files=VICTIM),
    recipe("name-empty", "name: ''\n", "is not a plain name"),
    recipe("name-dot", "name: '.'\n", "is not a plain name"),
    recipe("name-dotdot", "name: '..'\n", "is not a plain name"),
    recipe("name-hidden", "name: .hidden\n", "is not a plain name"),
    recipe("name-space", "name: my model\n", "is not a plain name"),
    recipe("name-not-text", "name: 5\n", "is not a plain name"),
    recipe("file-stem", "", "recipe file name 'my model' is not a plain name", "my model.yaml"),
    recipe("max-seq-len-bool", "max_seq_len: true\n", "max_seq_len must be a positive integer"),
    recipe("verify-k-huge", "verify_k: 100\n", "verify_k must be an integer in 1..16"),
    recipe(
        "max-autotune-text",
        "compile: {max_autotune: 'yes'}\n",
        "compile.max_autotune: must be true or false",
    ),
    recipe("speculative-k-bool", "speculative: {k: true}\n", "k must be an integer in 1..16"),
    recipe("score-graph-text", "score_graph: 'yes'\n", "score_graph must be true or false"),
    recipe("prefill-chunk-text", "prefill_chunk: '16'\n", "prefill_chunk must be a positive"),
    recipe(
        "prefill-chunk-past-max-seq-len",
        "prefill_chunk: 128\n",
        "prefill_chunk 128 is longer than max_seq_len 64",
    ),
    recipe("unknown-key", "max_seq_length: 64\n", "unknown key(s) max_seq_length"),
    recipe(
        "quantize-skip-names-nothing",
        "quantize: {linear: int8, skip: [lm-head]}\n",
        "quantize.skip: pattern 'lm-head' matches no module or weight of the model",
    ),
    recipe(
        "quantize-override-names-nothing",
        "quantize: {linear: int8, overrides: {'*.dwn_proj': int4}}\n",
        "quantize.overrides: pattern '*.dwn_proj' matches no module or weight of the model",
    ),
    recipe("ring-without-sliding-layers", "sliding_cache: ring\n", "has no sliding-window layers"),
    recipe("lora-missing", "lora: none\n", "is not a directory: point `lora:` at the directory"),
    recipe("lora-number", "lora: 5\n", "lora must be a PEFT adapter directory or a list"),
    recipe(
        "lora-pickle",
        "lora: adapter\n",
        "holds adapter_model.bin, a pickle aotgen never loads",
        files={
            "adapter/adapter_config.json": '{"peft_type": "LORA"}',
            "adapter/adapter_model.bin": b"x",
        },
    ),
    recipe(
        "lora-gguf-keep",
        "lora: adapter\nquantize: {gguf: keep}\n",
        "runs the GGUF file's own blocks, which a LoRA adapter cannot change",
        files={
            "adapter/adapter_config.json": '{"peft_type": "LORA"}',
            "adapter/adapter_model.safetensors": b"x",
        },
    ),
    recipe("chat-template-number", "chat_template: 5\n", "chat_template must be the path of a"),
    recipe("chat-template-missing", "chat_template: none.jinja\n", "none.jinja is not a file"),
    recipe(
        "chat-template-empty",
        "chat_template: t.jinja\n",
        "t.jinja is empty",
        files={"t.jinja": " \n"},
    ),
    recipe(
        "chat-template-not-utf8",
        "chat_template: t.jinja\n",
        "t.jinja is not UTF-8 text",
        files={"t.jinja": b"{{ 'caf\xe9' }}"},
    ),
    recipe(
        "chat-template-syntax",
        "chat_template: t.jinja\n",
        "t.jinja: line 2: Expected an expression, got 'end of statement block'; fix the template",
        files={"t.jinja": "{{ messages[0].content }}\n{% if %}"},
    ),
    recipe(
        "chat-template-raises",
        "chat_template: t.jinja\n",
        "does not render a one-message chat (TemplateError: roles must alternate)",
        files={"t.jinja": "{{ raise_exception('roles must alternate') }}"},
    ),
    recipe("invalid-yaml", "max_seq_len: [\n", "is not valid YAML"),
    recipe("not-utf8", b"checkpoint: x\nname: caf\xe9\n", "recipes/r.yaml is not UTF-8 text"),
    Row("recipe-missing", ("build", "recipes/none.yaml"), "recipe file not found"),
    recipe(
        "config-rope-theta-text",
        "checkpoint: badckpt\n",
        "rope_theta must be a positive number, got 'abc'",
        setup=bad_config_checkpoint,
    ),
    recipe(
        "checkpoint-hqq",
        "checkpoint: hqqckpt\n",
        "checkpoint quantized with 'hqq': aotgen reads GPTQ",
        setup=quantized_config_checkpoint,
    ),
    # ---- aotgen.toml, in each command that reads it
    toml("toml-unknown-key-build", "foo = 1\n", ("build", "recipes/r.yaml"), "unknown key(s) foo"),
    toml("toml-invalid-build", "threads = \n", ("build", "recipes/r.yaml"), "is not valid TOML"),
    toml(
        "toml-threads-text-build",
        'threads = "two"\n',
        ("build", "recipes/r.yaml"),
        "threads must be a whole number >= 0",
    ),
    toml(
        "toml-dir-not-text-build",
        "artifacts_dir = 5\n",
        ("build", "recipes/r.yaml"),
        "artifacts_dir must be a path string",
    ),
    toml("toml-not-utf8-build", b"cache_dir = '\xff'\n", ("build", "recipes/r.yaml"), "not UTF-8"),
    toml("toml-invalid-run", "threads = \n", ("run", "{pkg}", "--prompt", "hi"), "not valid TOML"),
    toml(
        "toml-threads-text-run",
        'threads = "two"\n',
        ("run", "{pkg}", "--prompt", "hi"),
        "threads must be a whole number >= 0",
    ),
    toml(
        "toml-threads-negative-run",
        "threads = -1\n",
        ("run", "{pkg}", "--prompt", "hi"),
        "threads must be a whole number >= 0",
    ),
    toml("toml-unknown-key-bench", "foo = 1\n", ("bench", "{pkg}"), "unknown key(s) foo"),
    toml("toml-invalid-bench", "threads = \n", ("bench", "{pkg}"), "is not valid TOML"),
    toml(
        "toml-threads-text-bench",
        'threads = "two"\n',
        ("bench", "{pkg}"),
        "threads must be a whole number >= 0",
    ),
    # ---- run options (the C++ CLI takes the same ones)
    run(
        "temp-dir-missing",
        (),
        "into the temp dir (Error generating temporary directory: No such file or directory): "
        "set TMPDIR to a writable directory",
        environ={"TMPDIR": "/nonexistent-aotgen-tmp"},
    ),
    run("max-new-tokens-zero", ("--max-new-tokens", "0"), "--max-new-tokens must be >= 1"),
    run("max-new-tokens-negative", ("--max-new-tokens", "-5"), "--max-new-tokens must be >= 1"),
    run("k-zero", ("--lookup", "ngram", "--k", "0"), "--k must be >= 1"),
    run("k-negative", ("--lookup", "ngram", "--k", "-2"), "--k must be >= 1"),
    run("k-zero-plain", ("--k", "0"), "--k must be >= 1"),
    run("ngram-min-zero", ("--lookup", "ngram", "--ngram-min", "0"), "--ngram-min must be >= 1"),
    run("ngram-max-zero", ("--ngram-max", "0"), "--ngram-max must be >= 1"),
    run(
        "ngram-min-over-max",
        ("--ngram-min", "5", "--ngram-max", "2"),
        "--ngram-min (5) must be <= --ngram-max (2)",
    ),
    run(
        "lookup-cache-without-lookup",
        ("--lookup-cache", "c.bin"),
        "--lookup-cache holds what --lookup ngram drafts from: add --lookup ngram",
    ),
    run(
        "lookup-cache-no-directory",
        ("--lookup", "ngram", "--lookup-cache", "missing/c.bin"),
        "give a file in an existing, writable directory",
    ),
    run(
        "lookup-cache-damaged",  # 2 bytes: not even one n-gram
        ("--lookup", "ngram", "--lookup-cache", "c.bin"),
        "lookup cache c.bin: the file ends inside an n-gram at byte 0",
        files={"c.bin": b"\x01\x00"},
    ),
    run(
        "lookup-cache-other-vocabulary",  # (7) -> 100000: a token past the tiny model's
        ("--lookup", "ngram", "--lookup-cache", "c.bin"),
        "token 100000 lies outside the vocabulary",
        files={
            "c.bin": bytes.fromhex("07000000" + "ff" * 12 + "01000000" + "a0860100" + "01000000")
        },
    ),
    Row(
        "serve-api-key-empty",
        ("serve", "{pkg}", "--api-key", ""),
        "--api-key (or AOTGEN_API_KEY) is empty",
    ),
    Row(
        "serve-allowed-origin-with-path",
        ("serve", "{pkg}", "--allowed-origin", "http://localhost:3000/"),
        "--allowed-origin 'http://localhost:3000/': give an origin as browsers send it",
    ),
    Row(
        "serve-model-name-empty",
        ("serve", "{pkg}", "--served-model-name", " "),
        "--served-model-name is empty",
    ),
    Row(
        "serve-generation-config-bad",
        ("serve", "{pkg}", "--generation-config", "vllm"),
        "--generation-config 'vllm': give 'auto' or 'none'",
    ),
    Row(  # TEST-NET-1 (RFC 5737): no machine's own address
        "serve-host-not-this-machine",
        ("serve", "{pkg}", "--host", "192.0.2.1"),
        "cannot listen on 192.0.2.1:8000",
    ),
    Row(
        "serve-lookup-cache-every-without-file",
        ("serve", "{pkg}", "--lookup", "ngram", "--lookup-cache-every", "5"),
        "--lookup-cache-every sets how often --lookup-cache is written: add it",
    ),
    Row(
        "serve-lookup-cache-every-nan",
        ("serve", "{pkg}", "--lookup", "ngram", "--lookup-cache", "c.bin")
        + ("--lookup-cache-every", "nan"),
        "--lookup-cache-every must be a number of seconds >= 0, got nan",
    ),
    run("logprobs-past-20", ("--logprobs", "21", "--json"), "--logprobs must be in 0..20, got 21"),
    run("logprobs-without-json", ("--logprobs", "2"), "--logprobs N goes with --json"),
    run("threads-negative", ("--threads", "-1"), "--threads must be >= 1"),
    run(
        "chat-template-kwargs-not-json",
        ("--chat", "hi", "--chat-template-kwargs", "{x"),
        "--chat-template-kwargs is not JSON",
    ),
    run(
        "chat-template-kwargs-not-object",
        ("--chat", "hi", "--chat-template-kwargs", "[1]"),
        "--chat-template-kwargs must be a JSON object",
    ),
    run(
        "chat-template-kwargs-reserved",
        ("--chat", "hi", "--chat-template-kwargs", '{"messages": []}'),
        "--chat-template-kwargs sets 'messages', which the chat itself gives the template",
    ),
    run(
        "chat-template-kwargs-without-chat",
        ("--chat-template-kwargs", "{}"),
        "--chat-template-kwargs goes with --chat or --interactive",
        cpp=False,  # a usage error there: the usage follows
    ),
    run(
        "generation-config-bad",
        ("--generation-config", "hf"),
        "--generation-config 'hf': give 'auto' or 'none'",
    ),
    run("stop-empty", ("--stop", ""), "--stop is empty: give the text that ends the answer"),
    run("threads-zero", ("--threads", "0"), "--threads must be >= 1"),
    run(
        "prompt-file-directory",
        ("--prompt-file", "prompts"),
        "--prompt-file prompts: is a directory",
        files={"prompts/p.txt": "hi"},
    ),
    run("prompt-file-missing", ("--prompt-file", "none.txt"), "--prompt-file none.txt: no such"),
    run(
        "prompt-file-not-utf8",
        ("--prompt-file", "p.txt"),
        "--prompt-file p.txt: not UTF-8 text",
        files={"p.txt": b"caf\xe9 au lait"},
    ),
    run("seed-23-digits", ("--seed", "1" * 23), f"--seed must be an integer in {SEED_RANGE}"),
    run("seed-negative", ("--seed", "-1"), f"--seed must be an integer in {SEED_RANGE}"),
    run("temperature-negative", ("--temperature", "-1"), "temperature must be a finite number"),
    run("top-p-over-one", ("--top-p", "2"), "top_p must be in (0, 1]"),
    run("min-p-negative", ("--min-p", "-0.5"), "min_p must be in [0, 1]"),
    run(
        "min-tokens-over-max",
        ("--max-new-tokens", "4", "--min-tokens", "5"),
        "min_tokens must be a whole number in 0..max_new_tokens (4), got 5",
    ),
    run("stop-token-id-outside", ("--stop-token-id", "99999"), "stop token ids must be in 0.."),
    run(
        "reasoning-budget-negative",
        ("--reasoning-budget", "-1"),
        "--reasoning-budget must be >= 0 (tokens of reasoning), got -1",
    ),
    run(
        "reasoning-budget-message-alone",
        ("--reasoning-budget-message", "Enough."),
        "--reasoning-budget-message goes with --reasoning-budget N",
    ),
    run(
        "reasoning-budget-no-reasoning",
        ("--reasoning-budget", "8", "--max-new-tokens", "8"),
        "this package's chat template has no reasoning",
    ),
    run(
        "prompt-over-context",
        ("--prompt", "The quick brown fox", "--max-new-tokens", "159"),
        "exceeds the package context of 160 tokens",
    ),
    run("two-prompts", ("--prompt", "a", "--chat", "b"), "give exactly one of", cpp=False),
    run(
        "suffix-with-chat",
        ("--chat", "b", "--suffix", "c"),
        "--suffix goes with --prompt or --prompt-file",
        cpp=False,
    ),
    run(
        "suffix-without-fim-tokens",
        ("--suffix", "c", "--max-new-tokens", "8"),
        "this model has no fill-in-the-middle tokens",
    ),
    run("system-without-chat", ("--system", "be brief"), "--system goes with --chat", cpp=False),
    run("lookup-unknown", ("--lookup", "tree"), "the only lookup proposer is 'ngram'", cpp=False),
    run(
        "best-first-without-tree",
        ("--lookup", "ngram", "--best-first"),
        "--best-first shapes a token tree: add --draft-parallel N",
    ),
    Row(
        "package-missing",
        ("run", "{project}/none", "--prompt", "hi"),
        "is not an aotgen package",
        cpp=True,
    ),
    # ---- bench
    Row("bench-runs-zero", ("bench", "{pkg}", "--runs", "0"), "--runs must be >= 1"),
    Row("bench-gen-tokens-zero", ("bench", "{pkg}", "--gen-tokens", "0"), "--gen-tokens must be"),
    Row("bench-threads-negative", ("bench", "{pkg}", "--threads", "-1"), "--threads must be >= 1"),
    Row("bench-package-missing", ("bench", "{project}/none"), "is not an aotgen package"),
    Row(
        "bench-llama-lookup-without-speculative",
        ("bench", "{pkg}", "--llama-lookup", "{pkg}/manifest.json"),
        "--llama-lookup compares n-gram speculation: add --speculative",
    ),
    Row(
        "bench-llama-lookup-missing-gguf",
        ("bench", "{pkg}", "--speculative", "--llama-lookup", "{project}/none.gguf"),
        "no such GGUF file",
    ),
    Row(
        "bench-temperature-without-speculative",
        ("bench", "{pkg}", "--temperature", "0.8"),
        "--temperature samples the --speculative comparison: add --speculative",
    ),
    Row(
        "bench-temperature-negative",
        ("bench", "{pkg}", "--speculative", "--temperature", "-1"),
        "temperature must be a finite number >= 0",
    ),
    Row(
        "bench-top-p-zero",
        ("bench", "{pkg}", "--speculative", "--temperature", "1", "--top-p", "0"),
        "top_p must be in (0, 1]",
    ),
    # ---- inspect
    Row("inspect-package-missing", ("inspect", "{project}/none"), "is not an aotgen package"),
    # ---- import-gguf
    Row("gguf-cut-64-bytes", GGUF_IMPORT, "cut.gguf is truncated or corrupt", setup=cut_gguf(64)),
    Row("gguf-cut-mid-tensor", GGUF_IMPORT, "cut.gguf is truncated", setup=cut_gguf(-100)),
    Row(
        "gguf-not-gguf",
        GGUF_IMPORT,
        "cut.gguf is truncated or corrupt",
        files={"cut.gguf": "plain text, not a GGUF file\n" * 8},
    ),
    Row("gguf-missing", ("import-gguf", "none.gguf", "out"), "GGUF file not found"),
    Row(
        "gguf-out-not-empty",
        ("import-gguf", "cut.gguf", "out"),
        "already exists and is not empty",
        files={"out/keep.txt": "mine"},
        setup=cut_gguf(None),
    ),
    Row(
        "gguf-out-a-file",
        ("import-gguf", "cut.gguf", "out", "--overwrite"),
        "out is a file, not a directory",
        files={"out": "mine"},
        setup=cut_gguf(None),
    ),
]


# ---- running a row ------------------------------------------------------------------------


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[int, int]]:
    """Every path under `root` (except the top-level `skip` entries) with its size and mtime."""
    if not root.exists():
        return {}
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in skip:
            continue
        st = p.lstat()
        out[rel.as_posix()] = (st.st_size if p.is_file() else -1, st.st_mtime_ns)
    return out


@pytest.fixture
def env(tmp_path: Path, tiny_package: Path, tiny_checkpoint: Path) -> Env:
    project = tmp_path / "project"
    project.mkdir()
    return Env(project, tiny_package, tiny_checkpoint)


def prepare(row: Row, env: Env) -> None:
    toml = row.toml if isinstance(row.toml, bytes) else env.fill(row.toml)
    (env.project / "aotgen.toml").write_bytes(toml if isinstance(toml, bytes) else toml.encode())
    for rel, content in row.files.items():
        path = env.project / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(env.fill(content))
    if row.setup:
        row.setup(env)


def check_refused(cmd: list[str], row: Row, env: Env, error_prefix: str) -> None:
    """Run `cmd` in the project; assert one clear line, exit 1, and nothing touched."""
    before = {
        "project": snapshot(env.project, skip=("artifacts", "cache")),
        "package": snapshot(env.package),
        "checkpoint": snapshot(env.checkpoint),
    }
    proc = subprocess.run(
        cmd,
        cwd=env.project,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
        env={**os.environ, **row.environ},
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr and "terminate called" not in proc.stderr, proc.stderr
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-3000:])
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(error_prefix), lines[0]
    assert row.phrase in lines[0], lines[0]
    assert proc.stdout.strip() == "", proc.stdout
    after = {
        "project": snapshot(env.project, skip=("artifacts", "cache")),
        "package": snapshot(env.package),
        "checkpoint": snapshot(env.checkpoint),
    }
    for where in before:
        assert after[where] == before[where], f"{where} changed"
    partial = [p for p in env.project.rglob("*") if ".partial" in p.name]
    assert not partial, partial


@pytest.mark.parametrize("row", [pytest.param(r, id=r.id) for r in ROWS])
def test_python_cli_refuses(row: Row, env: Env) -> None:
    prepare(row, env)
    cmd = [sys.executable, "-m", "aotgen", *(env.fill(a) for a in row.args)]
    check_refused(cmd, row, env, "error: ")


# ---- the same `run` rows through the C++ CLI -------------------------------------------------


CPP_ROWS = [pytest.param(r, id=r.id, marks=pytest.mark.cpp) for r in ROWS if r.cpp]


@pytest.mark.parametrize("row", CPP_ROWS)
def test_cpp_cli_refuses(row: Row, env: Env, run_bin: Path) -> None:
    assert row.args[0] == "run"
    prepare(row, env)
    check_refused(
        [str(run_bin), *(env.fill(a) for a in row.args[1:])], row, env, "aotgen-run: error: "
    )
