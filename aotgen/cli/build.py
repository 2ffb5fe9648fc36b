"""`aotgen import-gguf`, `build` and `inspect`: checkpoints in, packages out."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from aotgen.cli.common import (
    app,
    console,
    print_json,
    user_errors_exit,
)


@app.command("import-gguf")
@user_errors_exit
def import_gguf_cmd(
    gguf_file: Annotated[
        Path,
        typer.Argument(help="a .gguf file, or 'smollm2' / 'gemma3-270m' for a bundled one"),
    ],
    out_dir: Annotated[Path, typer.Argument(help="HF-layout checkpoint dir to write")],
    overwrite: Annotated[
        bool, typer.Option(help="replace OUT_DIR if it already exists and is not empty")
    ] = False,
) -> None:
    """GGUF → Hugging Face-layout checkpoint dir (dequantized fp32 safetensors + tokenizer)."""
    from aotgen.checkpoint.gguf import import_gguf, resolve_gguf

    src = resolve_gguf(gguf_file)
    with console.status(f"importing {src.name}"):
        import_gguf(src, out_dir, overwrite=overwrite)
    console.print(f"wrote {out_dir}")


class _RichProgress:
    def __init__(self, progress: Progress):
        self.progress, self.tasks = progress, {}

    def stage(self, name: str, total: int) -> None:
        self.tasks[name] = self.progress.add_task(name, total=total)

    def advance(self, name: str, detail: str = "") -> None:
        self.progress.update(self.tasks[name], advance=1, description=f"{name} {detail}")


@app.command()
@user_errors_exit
def build(
    recipe: Annotated[Path, typer.Argument(help="recipes/NAME.yaml")],
    force: Annotated[bool, typer.Option(help="rebuild even if up to date")] = False,
    artifacts_dir: Annotated[
        Path | None, typer.Option(help="where to write the package (overrides aotgen.toml)")
    ] = None,
) -> None:
    """Compile a recipe into artifacts/NAME (prefill/decode/verify graphs + weights)."""
    from aotgen.recipe import Project, load_recipe

    project = Project.load()
    if artifacts_dir:
        project = dataclasses.replace(project, artifacts_dir=artifacts_dir)
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
    )
    r = load_recipe(recipe)
    from aotgen.package.build import build as run_build  # torch: after the recipe is read

    # transient: on an error, the one `error:` line is all that stays on screen.
    with Progress(*columns, console=console, transient=True) as progress:
        report = run_build(r, project, _RichProgress(progress), force=force)
    if report.up_to_date:
        console.print(
            f"{report.path} is up to date (same checkpoint, recipe and toolchain): "
            "nothing to do. Use --force to rebuild."
        )
        return
    table = Table(title=f"built {report.path}")
    for col in ("model", "graph", "export s", "compile s", ".so bytes"):
        table.add_column(col, justify="right" if "s" in col.split()[-1] else "left")
    for g in report.graphs:
        table.add_row(
            g.model,
            g.graph,
            f"{g.export_s:.1f}",
            "cached" if g.cached else f"{g.compile_s:.1f}",
            f"{g.so_bytes:,}",
        )
    console.print(table)
    console.print(
        f"weights {report.weight_bytes:,} B, package {report.package_bytes:,} B "
        f"({report.package_bytes / max(report.weight_bytes, 1):.2f}× weights), "
        f"{report.seconds:.0f} s"
    )
    for note in report.notes:
        console.print(f"note: {note}")


@app.command()
@user_errors_exit
def inspect(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    as_json: Annotated[
        bool, typer.Option("--json", help="print the whole manifest as JSON on stdout")
    ] = False,
) -> None:
    """Summarise a package's manifest: model, graphs, files, versions."""
    from aotgen.package.manifest import read_manifest

    m = read_manifest(package)
    if as_json:
        print_json(m, indent=2)
        return
    out = Console()
    target = m["target"]
    gpu = f" ({target['gpu']}, sm {target['compute_capability']})" if "gpu" in target else ""
    out.print(
        f"[bold]{m['name']}[/]  format {m['format_version']} · aotgen {m['aotgen_version']} · "
        f"torch {m['torch_version']} · {target['device']}{gpu} {target['isa']} "
        f"{target['platform']} · world size {m['world_size']}"
    )
    out.print(
        f"context {m['max_seq_len']} tokens · verify k {m['verify_k']} · built {m['built_at']}"
    )
    for role, entry in m["models"].items():
        c = entry["config"]
        out.print(
            f"[bold]{role}[/]: {c['architecture']} {c['num_hidden_layers']} layers, "
            f"hidden {c['hidden_size']}, heads {c['num_attention_heads']}/"
            f"{c['num_key_value_heads']}, vocab {c['vocab_size']}; kv cache "
            f"{_cache_summary(entry['kv_cache']['shapes'])} {entry['kv_cache']['dtype']}"
            + (
                " (the target's)"
                if entry["kv_cache"].get("shared_with") == "target"
                else _cache_bytes(entry["kv_cache"])
            )
        )
        if entry.get("quantization"):
            out.print(f"  quantization: {json.dumps(entry['quantization'])}")
        for name, g in entry["graphs"].items():
            t = g["tokens"]
            out.print(f"  graph {name:8s} tokens {t['min']}..{t['max']}  ({g['package_model']})")
    table = Table("file", "bytes", "sha256 (first chunk)")
    for rel, f in m["files"].items():
        table.add_row(rel, f"{f['bytes']:,}", f["sha256"][0][:16])
    out.print(table)


def _cache_bytes(kv: dict) -> str:
    """`, 33.4 MB (4,080 B a position)`: what one sequence's cache allocates, for sizing a
    deployment (a batched engine allocates it once per slot); with a ring, the bytes a
    position takes in the layers that keep every position."""
    from aotgen.package.manifest import kv_cache_bytes, kv_position_bytes

    keys = kv["shapes"][::2]
    per = sum(
        b for b, k in zip(kv_position_bytes(kv), keys, strict=True) if k[2] == kv["cache_len"]
    )
    ring = f", sliding layers a ring of {kv['ring']['cells']:,}" if kv.get("ring") else ""
    return f", {kv_cache_bytes(kv) / 1e6:.1f} MB ({per:,} B a position{ring})"


def _cache_summary(shapes: list[list[int]]) -> str:
    """`[1, 3, 2048, 64] × 60`; one term per distinct shape (LFM2's convolution layers)."""
    counts = Counter(str(shape) for shape in shapes)
    return ", ".join(f"{shape} × {n}" for shape, n in counts.items())
