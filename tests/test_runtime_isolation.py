"""The product's promise: running a package imports no model code, compiles nothing and leaves
nothing behind outside the package."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

FORBIDDEN_MODULES = (
    "aotgen.model",
    "aotgen.export",
    "aotgen.passes",
    "aotgen.checkpoint",
    "aotgen.package.build",
    "transformers",
)

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError("the runtime called torch.export / torch.compile")

    torch.export.export = refuse
    torch.compile = refuse

    from aotgen.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(sys.argv[1])
    ids = engine.tokenizer.encode("The quick brown fox")
    result = engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True))
    assert len(result.token_ids) == 8
    result = engine.generate(ids, GenerationConfig(max_new_tokens=8, ignore_eos=True,
                                                   speculative="ngram"))
    assert len(result.token_ids) == 8
    forbidden = {FORBIDDEN!r}
    loaded = sorted(m for m in sys.modules if m.startswith(forbidden))
    print("LOADED", loaded)
    assert not loaded, loaded
    assert "torch._dynamo" not in sys.modules, "torch._dynamo was imported"
    print("OK")
    """
).replace("{FORBIDDEN!r}", repr(FORBIDDEN_MODULES))


def test_runtime_imports_no_model_code(tiny_package):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_package)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout


KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from aotgen.runtime.engine import Engine, GenerationConfig

    engine = Engine.load(sys.argv[1])
    result = engine.generate([1, 2, 3], GenerationConfig(max_new_tokens=4, ignore_eos=True))
    print("IDS", result.token_ids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_killed_runtime_leaves_no_extracted_graphs(tiny_package, tmp_path):
    """torch's loader extracts each graph's library into the temp dir: a process killed with
    its package loaded (SIGKILL, or SIGTERM's default action) leaves none of them there."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", KILLED, str(tiny_package)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert "IDS" in proc.stdout
    assert sorted(p.name for p in tmp.iterdir()) == []
