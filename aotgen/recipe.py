"""Build recipes (YAML) and project defaults (`aotgen.toml`).

A recipe is plain data validated once, at the entry point; every stage below receives
the typed `Recipe` and never re-reads YAML. Unknown keys are errors that list the valid
keys, because a typo silently ignored builds the wrong package.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be built, with a message that says how to fix it."""


@dataclass(frozen=True)
class CompileOptions:
    max_autotune: bool = False
    # Decode / verify linears: "reduction" (Inductor-generated, see passes/gemv.py) or "blas".
    few_token_linears: str = "reduction"
    # Linears reading the same activation (q/k/v, gate/up) as one (see passes/fuse.py).
    fuse_linears: bool = True


# KV positions past max_seq_len: a full verify block may run that far. At least 8, so that
# every k up to 7 gives the same cache shape and so the same prefill/decode graphs: a build
# that changes only k takes those from the compile cache and compiles the verify graph alone.
VERIFY_ROOM = 8


def kv_cache_len(max_seq_len: int, verify_k: int) -> int:
    """KV positions per layer for a package serving `max_seq_len` tokens."""
    return max_seq_len + max(verify_k + 1, VERIFY_ROOM)


@dataclass(frozen=True)
class Recipe:
    name: str
    checkpoint: Path
    max_seq_len: int = 2048  # prompt + generated tokens the package supports
    prefill_chunk: int = 256  # max tokens per prefill call; longer prompts are chunked
    verify_k: int = 4  # the verify graph scores verify_k + 1 positions
    dtype: str = "float32"
    # Where the package runs: "cpu", or "cuda" (built on a machine with the GPU it targets).
    device: str = "cpu"
    quantize: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None
    parallel: dict[str, Any] | None = None
    compile: CompileOptions = field(default_factory=CompileOptions)

    @property
    def cache_len(self) -> int:
        return kv_cache_len(self.max_seq_len, self.verify_k)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checkpoint"] = str(self.checkpoint)
        return d


DTYPES = ("float32", "bfloat16")
DEVICES = ("cpu", "cuda")


def _check_keys(where: str, given: dict, valid: list[str]) -> None:
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise RecipeError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(valid)}"
        )


def parse_recipe(data: dict[str, Any], name: str, base_dir: Path) -> Recipe:
    """Validate a recipe dict; relative checkpoint paths resolve against `base_dir`."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {name!r} must be a YAML mapping, got {type(data).__name__}")
    valid = [f.name for f in dataclasses.fields(Recipe)]
    _check_keys(f"recipe {name!r}", data, valid)
    if "checkpoint" not in data:
        raise RecipeError(f"recipe {name!r}: 'checkpoint' is required (an HF checkpoint dir)")
    data = dict(data)
    compile_opts = data.pop("compile", None) or {}
    _check_keys(
        f"recipe {name!r} compile",
        compile_opts,
        [f.name for f in dataclasses.fields(CompileOptions)],
    )
    if compile_opts.get("few_token_linears", "reduction") not in ("reduction", "blas"):
        raise RecipeError(f"recipe {name!r} compile.few_token_linears: 'reduction' or 'blas'")
    if not isinstance(compile_opts.get("fuse_linears", True), bool):
        raise RecipeError(f"recipe {name!r} compile.fuse_linears: true or false")
    ckpt = Path(data.pop("checkpoint"))
    if not ckpt.is_absolute():
        ckpt = base_dir / ckpt
    if "quantize" in data:
        data["quantize"] = _resolve_calibration(data["quantize"], base_dir)
    recipe = Recipe(
        name=data.pop("name", name), checkpoint=ckpt, compile=CompileOptions(**compile_opts), **data
    )
    for key in ("max_seq_len", "prefill_chunk", "verify_k"):
        value = getattr(recipe, key)
        if not isinstance(value, int) or value < 1:
            raise RecipeError(f"recipe {name!r}: {key} must be a positive integer, got {value!r}")
    if recipe.prefill_chunk < 2:
        raise RecipeError(f"recipe {name!r}: prefill_chunk must be >= 2 (1 token is decode)")
    if recipe.speculative is not None:
        recipe = _parse_speculative(recipe, "verify_k" in data, base_dir)
    if recipe.dtype not in DTYPES:
        raise RecipeError(f"recipe {name!r}: dtype {recipe.dtype!r}; valid: {', '.join(DTYPES)}")
    if recipe.device not in DEVICES:
        raise RecipeError(f"recipe {name!r}: device {recipe.device!r}; valid: {', '.join(DEVICES)}")
    if recipe.device != "cpu" and recipe.parallel:
        raise RecipeError(
            f"recipe {name!r}: `parallel` runs on CPU ranks only so far; drop it for "
            f"device {recipe.device}"
        )
    return recipe


def _resolve_calibration(quantize: Any, base_dir: Path) -> Any:
    """`quantize.calibration` (GPTQ's text file) resolves against base_dir like checkpoints."""
    if isinstance(quantize, dict) and isinstance(quantize.get("calibration"), str):
        path = Path(quantize["calibration"])
        return {**quantize, "calibration": str(path if path.is_absolute() else base_dir / path)}
    return quantize


DRAFT_SOURCES = ("checkpoint", "layers")  # at most one; none = the target's own weights


def _parse_speculative(recipe: Recipe, explicit_k: bool, base_dir: Path) -> Recipe:
    """`speculative: {draft: {checkpoint|layers|quantize: ...}, k: K, share_kv: bool}`; k
    sizes the verify graph; share_kv (default: whenever the draft is made from the target's
    own weights) lets the draft run on the target's KV cache."""
    where = f"recipe {recipe.name!r} speculative"
    spec = recipe.speculative
    if not isinstance(spec, dict):
        raise RecipeError(f"{where}: must be a mapping with keys draft, k")
    _check_keys(where, spec, ["draft", "k", "share_kv"])
    k = spec.get("k", recipe.verify_k)
    if not isinstance(k, int) or not 1 <= k <= 16:
        raise RecipeError(f"{where}: k must be an integer in 1..16, got {k!r}")
    if explicit_k and k != recipe.verify_k:
        raise RecipeError(f"{where}: k={k} contradicts verify_k={recipe.verify_k}; give one")
    draft = spec.get("draft")
    if draft is not None:
        valid = (*DRAFT_SOURCES, "quantize")
        if (
            not isinstance(draft, dict)
            or not draft
            or set(draft) - set(valid)
            or len(set(draft) & set(DRAFT_SOURCES)) > 1
        ):
            raise RecipeError(
                f"{where}: draft takes at most one of {', '.join(DRAFT_SOURCES)}, plus an "
                f"optional quantize (e.g. {{layers: 8, quantize: {{linear: int8}}}}), got {draft!r}"
            )
        if "checkpoint" in draft:
            path = Path(draft["checkpoint"])
            draft = {**draft, "checkpoint": str(path if path.is_absolute() else base_dir / path)}
        if "quantize" in draft:
            draft = {**draft, "quantize": _resolve_calibration(draft["quantize"], base_dir)}
        if "layers" in draft and (not isinstance(draft["layers"], int) or draft["layers"] < 1):
            raise RecipeError(f"{where}: draft layers must be a positive integer")
    own_weights = draft is not None and "checkpoint" not in draft
    share_kv = spec.get("share_kv", own_weights)
    if not isinstance(share_kv, bool):
        raise RecipeError(f"{where}: share_kv must be true or false, got {share_kv!r}")
    if share_kv and not own_weights:
        raise RecipeError(
            f"{where}: share_kv needs a draft made from the target's weights (quantize or "
            "layers); a separate checkpoint computes other keys and values, so it keeps its own"
        )
    return dataclasses.replace(
        recipe, verify_k=k, speculative={"draft": draft, "k": k, "share_kv": share_kv}
    )


def load_recipe(path: str | Path, base_dir: Path | None = None) -> Recipe:
    """Read a YAML recipe. Relative checkpoint paths are taken from the project dir (cwd)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path} is not valid YAML: {e}") from None
    return parse_recipe(data or {}, path.stem, base_dir or Path.cwd())


@dataclass(frozen=True)
class Project:
    """Project defaults from `aotgen.toml` (all optional)."""

    artifacts_dir: Path = Path("artifacts")
    checkpoints_dir: Path = Path("checkpoints")
    cache_dir: Path = Path(".aotgen-cache")
    threads: int = 0  # 0: torch's default

    @classmethod
    def load(cls, root: Path | None = None) -> Project:
        root = root or Path.cwd()
        path = root / "aotgen.toml"
        if not path.is_file():
            return cls()
        data = tomllib.loads(path.read_text())
        _check_keys(str(path), data, [f.name for f in dataclasses.fields(cls)])
        paths = {k: root / v for k, v in data.items() if k.endswith("_dir")}
        return cls(**{**data, **paths})
