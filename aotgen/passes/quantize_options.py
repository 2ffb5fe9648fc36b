"""A recipe's `quantize:` mapping, validated into `QuantizeOptions`.

    quantize: {linear: int8}                                   # per-channel symmetric
    quantize: {linear: {int4: {groupsize: 64}}, embedding: int8, skip: [lm_head]}

`activations: int8` (CPU): int4 (g32) / int8 weights against activations quantized per row and
block of 32 as the op runs, integer dot products (`aotgen/kernels/block_dot.py`, C++ compiled into
the package). Lossy in the activations: meant for speculative drafts.

`gguf: keep` (a GGUF checkpoint): linears run on the file's own quantization blocks, bit-exact
(`aotgen/kernels/gguf_blocks.py`); with float32 activations (the default) the package computes
exactly what the dequantized checkpoint computes, with `activations: int8` integer dot products
on activations quantized per block, as llama.cpp does on CPU. Tensors the file holds in float
stay float.

`method: gptq` picks the integers with GPTQ (passes/gptq.py) instead of rounding to nearest:
the builder first runs `calibrate` on a prefill graph over calibration text, which records
each linear's input Hessian; the kernels and the package format are the same.

Skip patterns are shell globs (`fnmatch`, case-sensitive), matched against the module path
of the op (`lm_head`, `model.layers.0.mlp.down_proj`, `model.embed_tokens`) and against
the weight's parameter name (`...down_proj.weight`). Globs, not regexes, because module
paths are full of dots that a regex would treat as wildcards.

Every error names the key at fault and what to write instead: recipes are written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotgen.kernels import block_dot
from aotgen.recipe import RecipeError, check_keys, matched_names

SCHEMES = ("int8", "int4")
EMBEDDING_SCHEMES = ("int8",)
GROUP_SIZES = (32, 64, 128, 256)
DEFAULT_GROUPSIZE = 64
ACTIVATION_DTYPES = ("bfloat16", "float32", "int8")
METHODS = ("rtn", "gptq")
OPTION_KEYS = (
    "linear", "embedding", "skip", "overrides", "activations", "method", "calibration", "gguf"
)  # fmt: skip
CALIBRATION_TEXT = Path(__file__).resolve().parents[1] / "data" / "calibration.txt"


@dataclass(frozen=True)
class Scheme:
    """One weight format: the kernel family, and for int4 the inputs sharing a scale."""

    kind: str  # "int8" | "int4"
    groupsize: int | None = None  # int4 only

    @property
    def label(self) -> str:
        return self.kind if self.groupsize is None else f"{self.kind}-g{self.groupsize}"


@dataclass(frozen=True)
class QuantizeOptions:
    """A validated `quantize:` mapping; frozen, so a pass and the build hash see one value."""

    linear: Scheme | None = None
    embedding: Scheme | None = None
    skip: tuple[str, ...] = ()
    overrides: tuple[tuple[str, Scheme], ...] = ()  # (glob, scheme) for matching linears
    activations: str = "bfloat16"  # dtype the quantized kernels compute in
    method: str = "rtn"  # "rtn": round to nearest; "gptq": see passes/gptq.py
    calibration: Path = CALIBRATION_TEXT  # text GPTQ runs the model on
    gguf: str | None = None  # "keep": run a GGUF checkpoint's own blocks


def _scheme(where: str, value: Any) -> Scheme:
    """`int8` | `int4` | `{int4: {groupsize: 64}}` | `{int8: {}}`."""
    if isinstance(value, str):
        kind, params = value, {}
    elif isinstance(value, dict) and len(value) == 1:
        kind, params = next(iter(value.items()))
        params = params or {}
    else:
        raise RecipeError(
            f"quantize.{where}: expected a scheme name ({', '.join(SCHEMES)}) or "
            f"{{int4: {{groupsize: N}}}}, got {value!r}"
        )
    if kind not in SCHEMES:
        raise RecipeError(f"quantize.{where}: unknown scheme {kind!r}; valid: {', '.join(SCHEMES)}")
    if not isinstance(params, dict):
        raise RecipeError(f"quantize.{where}.{kind}: expected a mapping, got {params!r}")
    valid = ["groupsize"] if kind == "int4" else []
    check_keys(f"quantize.{where}.{kind}", params, valid)
    if kind == "int8":
        return Scheme("int8")
    g = params.get("groupsize", DEFAULT_GROUPSIZE)
    if g not in GROUP_SIZES:
        raise RecipeError(
            f"quantize.{where}.int4: groupsize {g!r} is not supported by the int4 kernels; "
            f"valid: {', '.join(map(str, GROUP_SIZES))}"
        )
    return Scheme("int4", g)


def parse_quantize(raw: dict[str, Any] | None) -> QuantizeOptions | None:
    """Validate a recipe's `quantize:` mapping; errors say what to write instead."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RecipeError(f"quantize: expected a mapping like {{linear: int8}}, got {raw!r}")
    check_keys("quantize", raw, list(OPTION_KEYS))
    if "gguf" in raw:
        return _parse_gguf(raw)
    linear = _scheme("linear", raw["linear"]) if raw.get("linear") is not None else None
    embedding = None
    if raw.get("embedding") is not None:
        embedding = _scheme("embedding", raw["embedding"])
        if embedding.kind not in EMBEDDING_SCHEMES:
            raise RecipeError(
                f"quantize.embedding: {embedding.kind} is not supported for embeddings; "
                f"valid: {', '.join(EMBEDDING_SCHEMES)}"
            )
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise RecipeError(
            f"quantize.overrides: expected {{glob: scheme}} like {{lm_head: int8}}, got "
            f"{overrides!r}"
        )
    override_schemes = tuple((str(p), _scheme(f"overrides.{p}", v)) for p, v in overrides.items())
    if linear is None and embedding is None and not override_schemes:
        raise RecipeError("quantize: nothing to do; set `linear:` and/or `embedding:`")
    skip = raw.get("skip") or []
    if isinstance(skip, str):
        skip = [skip]
    if not isinstance(skip, list) or not all(isinstance(p, str) and p for p in skip):
        raise RecipeError(f"quantize.skip: expected a list of glob patterns, got {skip!r}")
    act = raw.get("activations", "bfloat16")
    if act not in ACTIVATION_DTYPES:
        raise RecipeError(f"quantize.activations: {act!r}; valid: {', '.join(ACTIVATION_DTYPES)}")
    method = raw.get("method", "rtn")
    if method not in METHODS:
        raise RecipeError(f"quantize.method: {method!r}; valid: {', '.join(METHODS)}")
    if act == "int8":
        overridden = [(f"overrides.{p}", s) for p, s in override_schemes]
        _check_block_schemes([("linear", linear), *overridden])
        if method != "rtn":
            raise RecipeError(
                "quantize.method: gptq is not implemented for `activations: int8`; "
                "drop `method` (round to nearest)"
            )
    calibration = Path(raw.get("calibration") or CALIBRATION_TEXT)
    if "calibration" in raw and method != "gptq":
        raise RecipeError("quantize.calibration: only `method: gptq` reads calibration text")
    if not calibration.is_file():
        raise RecipeError(
            f"quantize.calibration: {calibration} is not a file; give a plain-text file "
            "(relative paths resolve against the recipe's directory)"
        )
    return QuantizeOptions(
        linear, embedding, tuple(skip), override_schemes, act, method, calibration
    )


def _parse_gguf(raw: dict[str, Any]) -> QuantizeOptions:
    """`{gguf: keep}`, optionally with `activations: float32 | int8`; nothing else applies."""
    if raw["gguf"] != "keep":
        raise RecipeError(f"quantize.gguf: {raw['gguf']!r}; valid: keep")
    other = sorted(set(raw) - {"gguf", "activations"})
    if other:
        raise RecipeError(
            f"quantize: {', '.join(other)} cannot be combined with `gguf: keep` (the file's "
            "blocks are the quantization); drop them or drop `gguf`"
        )
    act = raw.get("activations", "float32")
    if act not in ("float32", "int8"):
        raise RecipeError(f"quantize.activations: {act!r} with `gguf: keep`; valid: float32, int8")
    return QuantizeOptions(activations=act, gguf="keep")


def _check_block_schemes(schemes: list[tuple[str, Scheme | None]]) -> None:
    """`activations: int8` runs the block kernels (kernels/block_dot.py): blocks of 32."""
    for where, scheme in schemes:
        if scheme is not None and scheme.kind == "int4" and scheme.groupsize != block_dot.BLOCK:
            raise RecipeError(
                f"quantize.{where}: int4 with `activations: int8` quantizes in blocks of "
                f"{block_dot.BLOCK}; write {{int4: {{groupsize: {block_dot.BLOCK}}}}}"
            )


def check_patterns(options: QuantizeOptions | None, names: list[str], where: str) -> None:
    """A `skip` or `overrides` glob that matches no module path or weight name of the model
    (`names`, its linears' and embeddings' first) is a typo that would quantize what it was
    meant to keep: refused before export. One that names a module the pass never quantizes
    (a norm) is a warning in the build report."""
    if options is None:
        return
    patterns = [("skip", p) for p in options.skip]
    patterns += [("overrides", p) for p, _ in options.overrides]
    for key, pattern in patterns:
        matched_names(
            f"{where}.{key}", pattern, names, "module or weight of the model", "*.down_proj"
        )
