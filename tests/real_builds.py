"""Build the real-model packages for the slow tests: `python tests/real_builds.py OUT NAME...`.

Run by conftest.py in a process of its own at the start of a session, so the packages compile
on the second core while the other tests run. Writes OUT/NAME.done (holding the package's
path) as each recipe finishes; a failure ends the process with its traceback in the log.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from conftest import build_real_recipe, bundled_gguf  # noqa: E402

from aotgen.checkpoint.gguf import import_gguf, resolve_gguf  # noqa: E402


def main(out: Path, names: list[str]) -> None:
    checkpoints: dict[str, Path] = {}
    start = time.monotonic()
    for name in names:
        t0 = time.monotonic()
        gguf = bundled_gguf(name)
        if gguf not in checkpoints:
            checkpoints[gguf] = import_gguf(resolve_gguf(gguf), out / "checkpoints" / gguf)
        path = build_real_recipe(name, checkpoints[gguf], out / name)
        (out / f"{name}.tmp").write_text(str(path))
        (out / f"{name}.tmp").rename(out / f"{name}.done")  # whole, or not there yet
        now = time.monotonic()
        print(f"built {name} in {now - t0:.0f} s, {now - start:.0f} s since start", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
