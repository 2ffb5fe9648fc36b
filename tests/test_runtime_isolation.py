"""The product's promise: running a package imports no model code and compiles nothing."""

from __future__ import annotations

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
