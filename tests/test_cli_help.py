"""The CLI explains itself: help text on every parameter, `--version`, and `--json` output that
a script can read (one JSON document on stdout, the same facts the text output gives)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import typer.main

from aotgen import __version__
from aotgen.cli import app
from aotgen.package.manifest import read_manifest
from aotgen.runtime.engine import Engine, GenerationConfig
from aotgen.runtime.lookup_cache import LookupCache

PROMPT = "The quick brown fox"


def aotgen(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "aotgen", *args],
        input=stdin,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def parameters() -> list[tuple[str, Any]]:
    """(command, click parameter) for the app's own options and every command's (typer ships
    its own copy of click, so the types are duck-typed here)."""
    root = typer.main.get_command(app)
    assert root.commands, "the app has no commands"
    out = [("aotgen", p) for p in root.params]
    for name, command in root.commands.items():
        out += [(f"aotgen {name}", p) for p in command.params]
    return out


def test_every_parameter_has_help() -> None:
    params = parameters()
    assert len(params) > 30  # the walk reached every command
    missing = [
        f"{command} {param.opts[0] if param.opts else param.name}"
        for command, param in params
        if not (getattr(param, "help", None) or "").strip()
    ]
    assert not missing, f"parameters without help text: {', '.join(missing)}"


def test_every_command_has_a_summary() -> None:
    root = typer.main.get_command(app)
    assert all((c.help or "").strip() for c in root.commands.values())


def test_version(tmp_path: Path) -> None:
    out = aotgen("--version", cwd=tmp_path).stdout.splitlines()
    assert out[0] == f"aotgen {__version__}"
    assert out[1] == f"torch {torch.__version__}"
    assert out[2].startswith(f"CPU ISA {torch.backends.cpu.get_cpu_capability()} ")


def test_inspect_json_is_the_manifest(tiny_package: Path, tmp_path: Path) -> None:
    out = aotgen("inspect", str(tiny_package), "--json", cwd=tmp_path).stdout
    assert json.loads(out) == read_manifest(tiny_package)


def test_inspect_prints_the_cache_bytes(tiny_package: Path, tmp_path: Path) -> None:
    """What the runtime allocates for the cache, in all and per position."""
    out = " ".join(aotgen("inspect", str(tiny_package), cwd=tmp_path).stdout.split())
    caches = Engine.load(tiny_package).target.caches
    total = sum(c.nbytes for c in caches)
    per_position = total // caches[0].shape[2]
    assert f", {total / 1e6:.1f} MB ({per_position:,} B a position)" in out


@pytest.mark.parametrize("lookup", [False, True], ids=["plain", "ngram"])
def test_run_json(tiny_package: Path, tmp_path: Path, lookup: bool) -> None:
    """`run --json`: nothing but one JSON object on stdout, holding what Engine.generate says."""
    flags = ["--lookup", "ngram"] if lookup else []
    args = ["run", str(tiny_package), "--prompt", PROMPT, "--max-new-tokens", "12"]
    out = json.loads(aotgen(*args, "--ignore-eos", "--json", *flags, cwd=tmp_path).stdout)
    engine = Engine.load(tiny_package)
    ids = engine.tokenizer.encode(PROMPT)
    cfg = GenerationConfig(
        max_new_tokens=12, ignore_eos=True, speculative="ngram" if lookup else None
    )
    ref = engine.generate(ids, cfg)
    assert out["prompt_ids"] == ids
    assert out["ids"] == ref.token_ids and out["text"] == ref.text
    assert out["finish_reason"] == "length" and out["prompt_tokens"] == len(ids)
    assert out["load_s"] > 0 and out["prefill_s"] > 0 and out["decode_tok_s"] > 0
    if lookup:
        assert out["spec"]["mode"] == "ngram"
        assert (out["spec"]["drafted"], out["spec"]["accepted"]) == (
            ref.spec.drafted,
            ref.spec.accepted,
        )
    else:
        assert out["spec"] is None


def test_run_lookup_cache_file(tiny_package: Path, tmp_path: Path) -> None:
    """`run --lookup ngram --lookup-cache FILE`: the file is created holding the run's text
    (prompt + answer) in llama.cpp's format, and the next run reads it and adds its own."""
    args = ["run", str(tiny_package), "--prompt", PROMPT, "--max-new-tokens", "12", "--json"]
    args += ["--ignore-eos", "--lookup", "ngram", "--lookup-cache", "c.bin"]
    want = LookupCache()
    for _ in range(2):
        out = json.loads(aotgen(*args, cwd=tmp_path).stdout)
        want.add(out["prompt_ids"] + out["ids"])
        want.save(tmp_path / "want.bin")
        assert (tmp_path / "c.bin").read_bytes() == (tmp_path / "want.bin").read_bytes()


def test_bench_json(tiny_package: Path, tmp_path: Path) -> None:
    args = ["bench", str(tiny_package), "--runs", "1", "--prompt-len", "8", "--gen-tokens", "4"]
    out = json.loads(aotgen(*args, "--threads", "1", "--json", cwd=tmp_path).stdout)
    assert out["threads"] == 1 and out["runs"] == 1 and out["gen_tokens"] == 4
    assert out["isa"] == torch.backends.cpu.get_cpu_capability()
    (result,) = out["results"]
    assert result["package"] == tiny_package.name
    assert result["decode_tok_s"] > 0 and 0 < result["roofline"] < 1
    assert out["bandwidth_gb_s"]["cpu"] > 0
