"""Build recipes (YAML) and project defaults (`aotgen.toml`).

A recipe is plain data validated once, at the entry point; every stage below receives
the typed `Recipe` and never re-reads YAML. Unknown keys are errors that list the valid
keys, because a typo silently ignored builds the wrong package.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class RecipeError(ValueError):
    """A recipe that cannot be built, with a message that says how to fix it."""


class ProjectError(ValueError):
    """An `aotgen.toml` that cannot be used, with a message that says how to fix it."""


@dataclass(frozen=True)
class CompileOptions:
    max_autotune: bool = False
    # Decode / verify linears: "reduction" (Inductor-generated, see passes/gemv.py) or "blas".
    few_token_linears: str = "reduction"
    # Linears reading the same activation (q/k/v, gate/up) as one (see passes/fuse.py).
    fuse_linears: bool = True
    # CPU linears on weights packed into panels, register-tiled (see passes/pack.py).
    packed_linears: bool = True


# KV positions past max_seq_len: a full verify block may run that far. At least 8, so that
# every k up to 7 gives the same cache shape and so the same prefill/decode graphs: a build
# that changes only k takes those from the compile cache and compiles the verify graph alone.
VERIFY_ROOM = 8


def kv_cache_len(max_seq_len: int, verify_k: int, tree_nodes: int = 0) -> int:
    """KV positions per layer for a package serving `max_seq_len` tokens."""
    return max_seq_len + max(verify_k + 1, tree_nodes, VERIFY_ROOM)


@dataclass(frozen=True)
class Recipe:
    name: str
    checkpoint: Path
    max_seq_len: int = 2048  # prompt + generated tokens the package supports
    prefill_chunk: int = 256  # max tokens per prefill call; longer prompts are chunked
    verify_k: int = 4  # the verify graph scores verify_k + 1 positions
    tree_nodes: int = 0  # the tree verify graph's rows (runtime/tree.py); 0: no tree graph
    # Sequences the batched graphs serve at once (runtime/batch_engine.py); 0: no batched graphs.
    max_batch: int = 0
    dtype: str = "float32"
    # The KV cache's dtype, if not `dtype`: bfloat16 halves its memory and what attention reads,
    # int8 (a scale per position and head, kernels/cache_rows.py) takes (d + 4) / 4d of it.
    kv_cache_dtype: str | None = None
    # Sliding-window layers' cache: "ring" (window + the widest call's positions, each
    # position in cell p % cells) or "full" (cache_len positions, as global layers). Unset:
    # a ring where the package can take one (CPU, AOTInductor graphs only).
    sliding_cache: str | None = None
    # Where the package runs: "cpu", or "cuda" (built on a machine with the GPU it targets).
    device: str = "cpu"
    # LoRA adapters (PEFT directories) merged into the weights before the passes (passes/lora.py).
    lora: tuple[Path, ...] = ()
    # A jinja chat template the package carries instead of the checkpoint's (a base model has
    # none; a fine-tune's may be wrong): both runtimes render it (package/inputs.py checks it).
    chat_template: Path | None = None
    quantize: dict[str, Any] | None = None
    speculative: dict[str, Any] | None = None
    parallel: dict[str, Any] | None = None
    compile: CompileOptions = field(default_factory=CompileOptions)
    # Held-out perplexity, eager vs package, in the build report (always on when quantized).
    perplexity: bool = False
    # A `score` graph: the prefill graph returning every row's logits, so that prompt
    # logprobs (lm-eval's loglikelihood requests) and perplexity run at prefill speed.
    score_graph: bool = False
    # Graph formats written: AOTInductor always; "onnx" adds ONNX graphs (export/onnx.py).
    formats: tuple[str, ...] = ("aoti",)

    @property
    def kv_dtype(self) -> str:
        return self.kv_cache_dtype or self.dtype

    @property
    def cache_len(self) -> int:
        return kv_cache_len(self.max_seq_len, self.verify_k, self.tree_nodes)

    def ring_cells(self, window: int | None) -> int | None:
        """A sliding layer's ring length for `window`, or None for a full-length cache. A call
        writes its rows before they attend, and a rejected speculative row stays written
        until a later call overwrites it, so the cells hold the window plus the widest call
        (prefill chunk, verify block, tree): every key a row's window sees is still there."""
        widest = max(self.prefill_chunk, self.verify_k + 1, self.tree_nodes, VERIFY_ROOM)
        ring = self.sliding_cache or ("ring" if ring_capable(self) else "full")
        if window is None or ring == "full" or window + widest >= self.cache_len:
            return None
        return window + widest

    def state_cells(self, conv_kernel: int) -> int:
        """A linear-attention layer's ring length (model/qwen3_5.py): a call at p0 reads the
        convolution inputs of the `conv_kernel - 1` positions before it and the state after
        p0 - 1, and writes its rows' before the next call; a rejected speculative row stays
        written. So the widest few-row call (verify block, padded prompt tail) plus the
        kernel: every cell the next call reads is still there. A prompt chunk writes its last
        `cells` rows' (the next call goes on after its end)."""
        return max(self.verify_k + 1, VERIFY_ROOM) + conv_kernel

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["checkpoint"] = str(self.checkpoint)
        d["lora"] = [str(p) for p in self.lora]
        d["chat_template"] = None if self.chat_template is None else str(self.chat_template)
        return d


DTYPES = ("float32", "bfloat16")
KV_DTYPES = (*DTYPES, "int8")  # widest first: a cache narrower than dtype comes after it
FORMATS = ("aoti", "onnx")
DEVICES = ("cpu", "cuda")
SLIDING_CACHES = ("ring", "full")
# verify_k (and speculative.k) bound: the verify graph scores k + 1 positions and the KV cache
# grows by max(k + 1, VERIFY_ROOM); drafts longer than this are almost never accepted whole.
MAX_VERIFY_K = 16
# max_batch bound: each slot holds a whole KV cache (max_seq_len positions per layer).
MAX_BATCH = 64
# tree_nodes bound: the tree graph's rows (root included), like verify_k + 1 for the chain.
MAX_TREE_NODES = 32
# A package name becomes one directory under artifacts/: no separators, no `..`, not hidden.
_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def check_name(name: Any, where: str, fix: str) -> str:
    """A recipe name names the directory artifacts/NAME, so it must not be a path."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise RecipeError(
            f"{where} {name!r} is not a plain name: use letters, digits, '.', '_' and '-', not "
            f"starting with '.' (it names the package directory artifacts/NAME); {fix}"
        )
    return name


def _is_int(value: Any) -> bool:
    """YAML `true` is a Python bool, and bool is an int: never accept it as a number."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_keys(
    where: str, given: dict, valid: list[str], error: type[ValueError] = RecipeError
) -> None:
    """One line naming the unknown keys of a recipe section and the valid ones."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise error(
            f"{where}: unknown key(s) {', '.join(unknown)}; "
            f"valid keys: {', '.join(valid) or '(none)'}"
        )


def matched_names(where: str, pattern: str, names: list[str], what: str, example: str) -> list[str]:
    """The `names` a recipe's shell glob matches; one that matches none is a typo that would
    leave the recipe's intent undone silently, so it is refused naming two real names."""
    matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    if not matched:
        raise RecipeError(
            f"{where}: pattern {pattern!r} matches no {what}; names look like {names[0]!r}, "
            f"{names[1]!r} (shell globs: {example!r})"
        )
    return matched


def read_utf8(path: Path, what: str, error: type[ValueError]) -> str:
    """The file's text, or one line naming the file when it is not UTF-8."""
    try:
        return path.read_bytes().decode()
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not UTF-8 text; save it as UTF-8") from None


def parse_recipe(data: dict[str, Any], name: str, base_dir: Path) -> Recipe:
    """Validate a recipe dict; relative checkpoint paths resolve against `base_dir`."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {name!r} must be a YAML mapping, got {type(data).__name__}")
    valid = [f.name for f in dataclasses.fields(Recipe)]
    check_keys(f"recipe {name!r}", data, valid)
    if "name" in data:
        check_name(data["name"], f"recipe {name!r}: name", "change `name:`")
    else:
        check_name(name, "recipe file name", "rename the file or set `name:` in it")
    where = f"recipe {data.get('name', name)!r}"
    if "checkpoint" not in data:
        raise RecipeError(f"{where}: 'checkpoint' is required (an HF checkpoint dir)")
    data = dict(data)
    compile_opts = _parse_compile(data.pop("compile", None) or {}, where)
    _check_value_types(data, where)
    ckpt = Path(data.pop("checkpoint"))
    if not ckpt.is_absolute():
        ckpt = base_dir / ckpt
    if "lora" in data:
        data["lora"] = _parse_lora(data["lora"], base_dir, where)
    if data.get("chat_template") is not None:
        data["chat_template"] = base_dir / data["chat_template"]  # an absolute path stays
    if "quantize" in data:
        data["quantize"] = _resolve_calibration(data["quantize"], base_dir)
    if "formats" in data:
        data["formats"] = _parse_formats(data["formats"], where)
    recipe = Recipe(name=data.pop("name", name), checkpoint=ckpt, compile=compile_opts, **data)
    recipe = _fit_prefill_chunk(recipe, "prefill_chunk" in data, where)
    _check_sizes(recipe, where)
    if recipe.speculative is not None:
        recipe = _parse_speculative(recipe, "verify_k" in data, base_dir)
    _check_target(recipe, where)
    return recipe


def _parse_compile(opts: Any, where: str) -> CompileOptions:
    """The recipe's `compile:` mapping."""
    if not isinstance(opts, dict):
        raise RecipeError(f"{where} compile: must be a mapping, e.g. {{max_autotune: true}}")
    check_keys(f"{where} compile", opts, [f.name for f in dataclasses.fields(CompileOptions)])
    if opts.get("few_token_linears", "reduction") not in ("reduction", "blas"):
        raise RecipeError(f"{where} compile.few_token_linears: 'reduction' or 'blas'")
    for key in ("fuse_linears", "max_autotune", "packed_linears"):
        if not isinstance(opts.get(key, False), bool):
            raise RecipeError(f"{where} compile.{key}: must be true or false, got {opts[key]!r}")
    return CompileOptions(**opts)


def _check_value_types(data: dict[str, Any], where: str) -> None:
    """The top-level values' types (`checkpoint` is known to be present)."""
    if not isinstance(data["checkpoint"], str) or not data["checkpoint"]:
        raise RecipeError(f"{where}: checkpoint must be a path, got {data['checkpoint']!r}")
    for key in ("quantize", "speculative", "parallel"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise RecipeError(f"{where}: {key} must be a mapping, got {data[key]!r}")
    template = data.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise RecipeError(
            f"{where}: chat_template must be the path of a jinja template file, got {template!r}"
        )
    for key in ("dtype", "kv_cache_dtype", "device", "sliding_cache"):
        if key in data and not isinstance(data[key], str):
            raise RecipeError(f"{where}: {key} must be a string, got {data[key]!r}")
    for key in ("perplexity", "score_graph"):
        if not isinstance(data.get(key, False), bool):
            raise RecipeError(f"{where}: {key} must be true or false, got {data[key]!r}")
    for key in ("max_seq_len", "prefill_chunk", "verify_k"):
        value = data.get(key, 1)
        if not _is_int(value) or value < 1:
            raise RecipeError(f"{where}: {key} must be a positive integer, got {value!r}")


def _fit_prefill_chunk(recipe: Recipe, given: bool, where: str) -> Recipe:
    """A prompt holds at most max_seq_len tokens, so a longer prefill graph only compiles rows
    no call takes (and widens sliding layers' rings): the default chunk is cut to
    max_seq_len, and a chunk the recipe names must fit in it."""
    fit = max(recipe.max_seq_len, 2)
    if recipe.prefill_chunk <= fit:
        return recipe
    if given:
        raise RecipeError(
            f"{where}: prefill_chunk {recipe.prefill_chunk} is longer than max_seq_len "
            f"{recipe.max_seq_len} (a prompt holds at most max_seq_len tokens); set "
            f"prefill_chunk to at most {fit}"
        )
    return dataclasses.replace(recipe, prefill_chunk=fit)


def _check_sizes(recipe: Recipe, where: str) -> None:
    """The graphs' row counts within what their kernels and runtimes take."""
    if recipe.verify_k > MAX_VERIFY_K:
        raise RecipeError(
            f"{where}: verify_k must be an integer in 1..{MAX_VERIFY_K} (the verify graph "
            f"scores verify_k + 1 positions), got {recipe.verify_k}"
        )
    if recipe.prefill_chunk < 2:
        raise RecipeError(f"{where}: prefill_chunk must be >= 2 (1 token is decode)")
    _check_rows(recipe, "tree_nodes", MAX_TREE_NODES, "the tree graph's rows, root included", where)
    _check_rows(recipe, "max_batch", MAX_BATCH, "the sequences a batched step serves", where)


def _check_target(recipe: Recipe, where: str) -> None:
    """dtype, device, parallel and formats: each known, and together buildable."""
    if recipe.dtype not in DTYPES:
        raise RecipeError(f"{where}: dtype {recipe.dtype!r}; valid: {', '.join(DTYPES)}")
    if recipe.kv_dtype not in KV_DTYPES:
        raise RecipeError(
            f"{where}: kv_cache_dtype {recipe.kv_dtype!r}; valid: {', '.join(KV_DTYPES)}"
        )
    if recipe.kv_dtype != recipe.dtype:
        _check_narrow_cache(recipe, where)
    if recipe.device not in DEVICES:
        raise RecipeError(f"{where}: device {recipe.device!r}; valid: {', '.join(DEVICES)}")
    if recipe.sliding_cache not in (None, *SLIDING_CACHES):
        raise RecipeError(
            f"{where}: sliding_cache {recipe.sliding_cache!r}; valid: {', '.join(SLIDING_CACHES)}"
        )
    if recipe.sliding_cache == "ring" and not ring_capable(recipe):
        raise RecipeError(
            f"{where}: sliding_cache ring is for CPU packages; drop it (a full cache is the "
            "default there)"
        )
    if recipe.device != "cpu" and recipe.parallel:
        raise RecipeError(
            f"{where}: `parallel` runs on CPU ranks only so far; drop it for device {recipe.device}"
        )
    if "onnx" in recipe.formats and (
        recipe.device != "cpu"
        or recipe.parallel
        or recipe.dtype != "float32"
        or recipe.kv_dtype != "float32"
    ):
        raise RecipeError(
            f"{where}: formats onnx is for float32 CPU packages without `parallel`; drop onnx, "
            "or build with dtype: float32 (and its KV cache), device: cpu and no parallel"
        )


def ring_capable(recipe: Recipe) -> bool:
    """Whether the package's graphs can keep sliding layers in a ring: CUDA graphs are
    replayed over the `key_pos` they are given. ONNX graphs are exported from the same
    modules as the AOTInductor ones and share their cache, ring included."""
    return recipe.device == "cpu"


def _check_narrow_cache(recipe: Recipe, where: str) -> None:
    """A KV cache narrower than the model's dtype: bfloat16 or int8 for a float32 CPU
    package, int8 for a bfloat16 one."""
    if KV_DTYPES.index(recipe.kv_dtype) < KV_DTYPES.index(recipe.dtype):
        raise RecipeError(
            f"{where}: kv_cache_dtype {recipe.kv_dtype} is wider than dtype {recipe.dtype}: "
            f"a cache holds the model's {recipe.dtype} keys and values or narrower ones; "
            "drop kv_cache_dtype or choose int8"
        )
    if recipe.device != "cpu":
        raise RecipeError(
            f"{where}: kv_cache_dtype other than dtype is for CPU packages so far; drop it for "
            f"device {recipe.device}"
        )


def _parse_lora(lora: Any, base_dir: Path, where: str) -> tuple[Path, ...]:
    """`lora: DIR` or a list of them, relative to the recipe's directory."""
    paths = [lora] if isinstance(lora, str) else lora
    if not isinstance(paths, list) or not all(isinstance(p, str) and p for p in paths):
        raise RecipeError(
            f"{where}: lora must be a PEFT adapter directory or a list of them, got {lora!r}"
        )
    return tuple(p if p.is_absolute() else base_dir / p for p in map(Path, paths))


def _parse_formats(formats: Any, where: str) -> tuple[str, ...]:
    """`formats: [aoti, onnx]`: the AOTInductor graphs are always built (the runtime's
    default backend, and the build's perplexity check runs them)."""
    if (
        not isinstance(formats, list)
        or not all(isinstance(f, str) and f in FORMATS for f in formats)
        or "aoti" not in formats
    ):
        raise RecipeError(
            f"{where}: formats must be a list of {', '.join(FORMATS)} that includes aoti, "
            f"e.g. [aoti, onnx]; got {formats!r}"
        )
    return tuple(dict.fromkeys(formats))


def _check_rows(recipe: Recipe, key: str, bound: int, what: str, where: str) -> None:
    """tree_nodes / max_batch: 0 (no such graph) or 2..bound, single-rank packages only (the
    tensor-parallel runtime verifies chains of one sequence)."""
    n = getattr(recipe, key)
    if not _is_int(n) or not (n == 0 or 2 <= n <= bound):
        raise RecipeError(
            f"{where}: {key} must be 0 (no such graph) or an integer in 2..{bound} ({what}), "
            f"got {n!r}"
        )
    if n and recipe.parallel:
        raise RecipeError(
            f"{where}: {key} is not supported with `parallel` (the tensor-parallel runtime "
            "verifies chains of one sequence); drop one of them"
        )


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
    check_keys(where, spec, ["draft", "k", "share_kv"])
    k = spec.get("k", recipe.verify_k)
    if not _is_int(k) or not 1 <= k <= MAX_VERIFY_K:
        raise RecipeError(f"{where}: k must be an integer in 1..{MAX_VERIFY_K}, got {k!r}")
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
        if "layers" in draft and (not _is_int(draft["layers"]) or draft["layers"] < 1):
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


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's message on one line: its own spans several, with a caret drawing."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_recipe(path: str | Path, base_dir: Path | None = None) -> Recipe:
    """Read a YAML recipe. Relative checkpoint paths are taken from the project dir (cwd)."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file not found: {path}")
    text = read_utf8(path, "recipe", RecipeError)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise RecipeError(f"recipe {path} is not valid YAML ({_yaml_problem(e)}); fix it") from None
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
        """Read `aotgen.toml` in `root` (default: cwd); every problem is one ProjectError."""
        root = root or Path.cwd()
        path = root / "aotgen.toml"
        if not path.is_file():
            return cls()
        text = read_utf8(path, "project file", ProjectError)
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ProjectError(f"{path} is not valid TOML ({e}); fix or delete it") from None
        check_keys(str(path), data, [f.name for f in dataclasses.fields(cls)], ProjectError)
        for key, value in data.items():
            if key.endswith("_dir") and (not isinstance(value, str) or not value):
                raise ProjectError(f'{path}: {key} must be a path string, e.g. {key} = "dir"')
        threads = data.get("threads", 0)
        if not _is_int(threads) or threads < 0:
            raise ProjectError(
                f"{path}: threads must be a whole number >= 0 (0: torch's default), got {threads!r}"
            )
        paths = {k: root / v for k, v in data.items() if k.endswith("_dir")}
        return cls(**{**data, **paths})
