"""The `aotgen` command line: import-gguf, build, inspect, run, serve, bench.

Errors that come from the user's input (recipe, checkpoint, package, prompt) print one
line and exit 1; anything else is a bug and keeps its traceback (cli/common.py).
"""

import importlib

from aotgen.cli.common import app

for _commands in ("build", "run", "bench"):  # importing registers them, in `--help`'s order
    importlib.import_module(f"aotgen.cli.{_commands}")


def main() -> None:
    app()
