"""The product text speaks of the product as it is, not of how it was made.

README.md, docs/, the package's code comments and docstrings, recipes, scripts and the C++
runtime carry no narration of past work: no numbered sessions or rounds of development, no
"this VM", no "see NOTES". Measurements say which CPU they ran on, not which sitting.
The README stays a user's document: at most README_MAX_LINES lines, details in docs/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 250

# Where the product text lives, and which files in it are text.
ROOTS = ("README.md", "docs", "aotgen", "recipes", "scripts", "runtime")
SUFFIXES = {".md", ".py", ".yaml", ".yml", ".sh", ".cpp", ".h", ".txt", ".toml"}
NAMES = {"CMakeLists.txt"}
SKIP_DIRS = {"__pycache__", "build", "node_modules"}
# Corpus data (calibration and held-out text, bench prompts), not prose about aotgen.
SKIP_FILES = {"aotgen/data"}

# (pattern, flags): each a way development history shows up in prose.
NARRATION = [
    (r"\bsessions? \d+", re.IGNORECASE),  # "session 14", "sessions 11–14"
    (r"\bsession-\d+", re.IGNORECASE),  # "the session-3 binary"
    (r"\b(this|that|earlier|previous|past|next|no|each) sessions?\b", re.IGNORECASE),
    (r"\bVMs?\b", 0),  # "this VM", "the VM's speed", "the AVX2 VMs"
    (r"\brounds? \d+ of (the )?(work|development|review)\b", re.IGNORECASE),
    (r"\bround \d+ of\b", re.IGNORECASE),
    (r"\bsee NOTES\b", 0),
    (r"\bthe notes'", re.IGNORECASE),
    (r"\byesterday\b", re.IGNORECASE),
    (r"\bwe (tried|measured|found)\b", re.IGNORECASE),
]
COMPILED = [re.compile(p, f) for p, f in NARRATION]


def product_files() -> list[Path]:
    files: list[Path] = []
    for name in ROOTS:
        top = ROOT / name
        if top.is_file():
            files.append(top)
            continue
        if not top.is_dir():
            continue
        for path in sorted(top.rglob("*")):
            rel = path.relative_to(ROOT)
            if not path.is_file() or any(p in SKIP_DIRS or p.startswith(".") for p in rel.parts):
                continue
            if any(rel.as_posix().startswith(s + "/") for s in SKIP_FILES):
                continue
            if path.suffix in SUFFIXES or path.name in NAMES:
                files.append(path)
    return files


def narration_hits(text: str) -> list[tuple[int, str]]:
    hits = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for rx in COMPILED:
            m = rx.search(line)
            if m:
                hits.append((lineno, m.group(0)))
                break
    return hits


def test_product_text_has_no_development_history():
    files = product_files()
    assert any(f.name == "README.md" for f in files) and len(files) > 20
    found = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, match in narration_hits(text):
            found.append(f"{path.relative_to(ROOT)}:{lineno}: {match!r}")
    assert not found, "development history in product text:\n" + "\n".join(found)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move details to docs/"
    )


def test_readme_keeps_the_ci_command():
    # CI (.ci/run) runs the README's test command.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "bash scripts/test.sh" in readme and "bash scripts/demo.sh" in readme
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_patterns_catch_narration():
    bad = [
        "measured in session 14 on the AVX2 VM",
        "the session-3 binary",
        "Earlier sessions, for the record.",
        "The VM's speed drifts",
        "see NOTES",
    ]
    good = [
        "Measured on AMD EPYC Zen 4 (2 vCPUs), 2 threads.",
        "each speculative round drafts k tokens",
        "a pytest session fixture",
    ]
    assert all(narration_hits(s) for s in bad)
    assert not any(narration_hits(s) for s in good)
