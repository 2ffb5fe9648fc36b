"""What a build reads, and its identity: the recipe with its GGUF checkpoints imported, the
checkpoint, its LoRA adapters, the recipe's chat template, and a content hash of (checkpoint,
adapters, template, recipe, aotgen, torch, ISA) that makes an unchanged rebuild a no-op."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import torch

from aotgen import __version__
from aotgen.checkpoint.gguf import IMPORT_FORMAT, import_gguf
from aotgen.checkpoint.hf import BLOCKS_FILE, Checkpoint, CheckpointError, open_checkpoint
from aotgen.package.manifest import (
    PackageError,
    cuda_problem,
    read_manifest,
    sha256_chunks,
    target_info,
    verify_files,
)
from aotgen.passes.lora import LoraAdapter, open_adapter
from aotgen.passes.quantize_options import parse_quantize
from aotgen.recipe import Project, Recipe, RecipeError, read_utf8
from aotgen.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class BuildInputs:
    """The recipe (its checkpoints imported), its target checkpoint, tokenizer (with the
    recipe's chat template, if it gives one) and LoRA adapters, and their identity."""

    recipe: Recipe
    ckpt: Checkpoint
    tokenizer: Tokenizer
    adapters: list[LoraAdapter]
    digest: str

    @property
    def chat_template(self) -> str | None:
        """The recipe's chat template's source, which the package carries; None without one."""
        return self.tokenizer.chat_template if self.recipe.chat_template is not None else None


def read_inputs(recipe: Recipe, project: Project) -> BuildInputs:
    """Check the recipe can build here, import GGUF checkpoints, and hash the inputs."""
    if recipe.device == "cuda" and (problem := cuda_problem()):
        raise RecipeError(
            f"recipe {recipe.name!r}: device cuda, but {problem}. Build on the machine class "
            "the package will run on (its kernels are compiled for that GPU), or use device: cpu"
        )
    recipe = _with_imported_checkpoints(recipe, project.cache_dir)
    ckpt = open_checkpoint(recipe.checkpoint)
    tokenizer = _load_tokenizer(ckpt)
    if recipe.chat_template is not None:
        tokenizer = with_recipe_template(recipe, tokenizer)
    adapters = [open_adapter(path) for path in recipe.lora]
    quantize = parse_quantize(recipe.quantize)
    if adapters and quantize is not None and quantize.gguf == "keep":
        raise RecipeError(
            f"recipe {recipe.name!r}: `quantize: {{gguf: keep}}` runs the GGUF file's own "
            "blocks, which a LoRA adapter cannot change; drop `lora:`, or quantize the merged "
            "weights (e.g. `quantize: {linear: int8}`)"
        )
    return BuildInputs(recipe, ckpt, tokenizer, adapters, build_hash(ckpt, recipe, adapters))


def _load_tokenizer(ckpt: Checkpoint) -> Tokenizer:
    """The tokenizer the package will carry, loaded as the runtime loads it: a broken one is
    refused before the compile, not by `aotgen run` after it."""
    try:
        return Tokenizer.from_dir(ckpt.path)
    except Exception as e:  # tokenizers raises bare Exceptions
        raise CheckpointError(
            f"{ckpt.path}/tokenizer.json does not load ({e}); re-create the checkpoint's "
            "tokenizer files (e.g. save them again with transformers, or `aotgen import-gguf`)"
        ) from None


def with_recipe_template(recipe: Recipe, tokenizer: Tokenizer) -> Tokenizer:
    """`tokenizer` rendering the recipe's chat template, checked as the runtimes will use it:
    it compiles and renders a one-message chat, so a broken one is refused before the compile,
    not by `aotgen run`."""
    path = recipe.chat_template
    where = f"recipe {recipe.name!r}: chat_template"
    if path is None or not path.is_file():
        raise RecipeError(
            f"{where} {path} is not a file; point `chat_template:` at a jinja template "
            "(a relative path is taken from the directory you run aotgen in)"
        )
    source = read_utf8(path, where, RecipeError)
    if not source.strip():
        raise RecipeError(f"{where} {path} is empty; write the template, or drop `chat_template:`")
    try:
        templated = tokenizer.with_chat_template(source)
    except jinja2.TemplateSyntaxError as e:
        raise RecipeError(
            f"{where} {path}: line {e.lineno}: {e.message}; fix the template"
        ) from None
    try:
        templated.apply_chat_template([{"role": "user", "content": "Hello"}])
    except Exception as e:  # whatever the user's template does wrong
        raise RecipeError(
            f"{where} {path} does not render a one-message chat ({type(e).__name__}: {e}); "
            "fix the template"
        ) from None
    return templated


def build_hash(ckpt: Checkpoint, recipe: Recipe, adapters: list[LoraAdapter]) -> str:
    """Identity of a build: same inputs and toolchain → same package."""
    h = hashlib.sha256()
    ckpts = [ckpt]
    draft = (recipe.speculative or {}).get("draft") or {}
    if "checkpoint" in draft:
        ckpts.append(open_checkpoint(draft["checkpoint"]))
    files = [
        f for c in ckpts for f in (c.path / "config.json", *c.weight_files, *c.tokenizer_files)
    ]
    files += [c.path / BLOCKS_FILE for c in ckpts if (c.path / BLOCKS_FILE).is_file()]
    files += [f for adapter in adapters for f in adapter.files]
    for f in files:
        h.update(f"{f.name}:{sha256_chunks(f)}\n".encode())
    recipe_dict = recipe.to_dict()
    recipe_dict.pop("checkpoint")  # the content counts, not where it lies
    recipe_dict.pop("lora")
    if recipe.chat_template is not None:
        recipe_dict["chat_template"] = sha256_chunks(recipe.chat_template)
    if "checkpoint" in draft:
        recipe_dict["speculative"]["draft"] = {**draft, "checkpoint": "(content hashed above)"}
    h.update(json.dumps(recipe_dict, sort_keys=True, default=str).encode())
    for quantize in (recipe.quantize, draft.get("quantize")):
        options = parse_quantize(quantize)
        if options and options.method == "gptq":
            h.update(f"calibration:{sha256_chunks(options.calibration)}\n".encode())
    target = json.dumps(target_info(recipe.device))
    h.update(f"{__version__}|{torch.__version__}|{target}".encode())
    # The source itself, not just the version: a changed pass or kernel must not look
    # "up to date".
    root = Path(__file__).resolve().parents[1]
    for src in sorted([*root.rglob("*.py"), *root.rglob("kernels/*.cpp")]):
        h.update(src.read_bytes())
    return h.hexdigest()


def up_to_date(out: Path, digest: str) -> bool:
    """Whether `out` holds an intact package built from inputs with this `digest`."""
    try:
        manifest = read_manifest(out)
        if manifest.get("build_hash") != digest:
            return False
        verify_files(manifest, out)
        return True
    except (PackageError, KeyError, OSError):
        return False


def _gguf_imported(path: Path, cache_dir: Path) -> Path:
    """A GGUF checkpoint's HF-layout dir (`aotgen import-gguf`), imported once per file
    content into the project cache; any other path is returned as is."""
    if path.suffix != ".gguf":
        return path
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    digest = hashlib.sha256("".join(sha256_chunks(path)).encode()).hexdigest()[:16]
    out = Path(cache_dir) / "gguf" / f"{path.stem}-{digest}-{IMPORT_FORMAT}"
    if not (out / "config.json").is_file():  # import_gguf renames a complete dir into place
        import_gguf(path, out, overwrite=True)
    return out


def _with_imported_checkpoints(recipe: Recipe, cache_dir: Path) -> Recipe:
    """The recipe with GGUF checkpoints (target, draft) replaced by their imported dirs."""
    spec = recipe.speculative
    draft = (spec or {}).get("draft") or {}
    if "checkpoint" in draft:
        imported = _gguf_imported(Path(draft["checkpoint"]), cache_dir)
        spec = {**spec, "draft": {**draft, "checkpoint": str(imported)}}
    checkpoint = _gguf_imported(recipe.checkpoint, cache_dir)
    return dataclasses.replace(recipe, checkpoint=checkpoint, speculative=spec)
