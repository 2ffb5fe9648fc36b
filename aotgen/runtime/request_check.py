"""What a request may ask of a package: the first thing it cannot run, as one GenerationError
that names it and the fix, before any of it runs (the Python and batched engines, the server)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from aotgen.runtime.logprobs import MAX_TOP
from aotgen.runtime.model_runner import GenerationError

if TYPE_CHECKING:
    from aotgen.runtime.engine import GenerationConfig

SPECULATIVE_MODES = (None, "draft", "ngram", "draft+ngram")


@dataclass(frozen=True)
class PackageLimits:
    """What a loaded package can do, as the checks need it."""

    root: Path
    vocab_size: int
    max_seq_len: int
    has_draft: bool
    has_tree: bool  # a tree verify graph


def check_request(prompt_ids: list[int], config: GenerationConfig, limits: PackageLimits) -> None:
    if not prompt_ids:
        raise GenerationError("empty prompt: give at least one token")
    _check_numbers(prompt_ids, config, limits)
    _check_speculation(config, limits)
    _check_outputs(config, limits.vocab_size)
    if config.uses_lookup and not 1 <= config.lookup_min <= config.ngram_max:
        raise GenerationError(
            f"need 1 <= ngram_min <= ngram_max, got {config.lookup_min} and "
            f"{config.ngram_max} (--ngram-min / --ngram-max)"
        )


def _check_numbers(prompt_ids: list[int], config: GenerationConfig, limits: PackageLimits) -> None:
    """Counts, token ids and the context, in the order a request's errors are reported."""
    least = 0 if config.prompt_logprobs is not None else 1  # 0: score the prompt only
    if isinstance(config.max_new_tokens, bool) or not (
        isinstance(config.max_new_tokens, int) and config.max_new_tokens >= least
    ):
        raise GenerationError(
            f"max_new_tokens must be a whole number >= {least}, got {config.max_new_tokens!r}"
        )
    # k above the package's verify_k is capped to it, as documented; below 1 is an error.
    if config.k is not None and not (isinstance(config.k, int) and config.k >= 1):
        raise GenerationError(f"k (the draft length) must be >= 1, got {config.k!r}")
    vocab = limits.vocab_size
    if any(not 0 <= t < vocab for t in prompt_ids):
        raise GenerationError(f"prompt token ids must be in 0..{vocab - 1}")
    if any(not 0 <= t < vocab for t in config.stop_token_ids):
        raise GenerationError(f"stop token ids must be in 0..{vocab - 1}")
    if isinstance(config.min_tokens, bool) or not (
        isinstance(config.min_tokens, int) and 0 <= config.min_tokens <= config.max_new_tokens
    ):
        raise GenerationError(
            f"min_tokens must be a whole number in 0..max_new_tokens "
            f"({config.max_new_tokens}), got {config.min_tokens!r}"
        )
    total = len(prompt_ids) + config.max_new_tokens
    if total > limits.max_seq_len:
        raise GenerationError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({config.max_new_tokens}) "
            f"= {total} exceeds the package context of {limits.max_seq_len} tokens; shorten "
            "the prompt, lower max_new_tokens, or rebuild with a larger max_seq_len"
        )


def _check_speculation(config: GenerationConfig, limits: PackageLimits) -> None:
    if config.speculative not in SPECULATIVE_MODES:
        raise GenerationError(
            f"speculative={config.speculative!r}: expected one of {SPECULATIVE_MODES}"
        )
    if config.uses_draft and not limits.has_draft:
        raise GenerationError(
            f"{limits.root} has no draft model; build with a `speculative: draft:` recipe "
            "or use n-gram lookup (--lookup ngram)"
        )
    if config.tree is None:
        return
    if config.speculative is None:
        raise GenerationError("tree drafting needs a speculative mode (draft or ngram)")
    if not limits.has_tree:
        raise GenerationError(
            f"{limits.root} has no tree verify graph: rebuild it with `tree_nodes: N` in the "
            "recipe, or draft a chain (no --draft-parallel)"
        )
    if config.adaptive_k:
        raise GenerationError("adaptive k drafts chains only: drop it with tree drafting")


def _check_outputs(config: GenerationConfig, vocab: int) -> None:
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(config, name)
        if value is not None and not (
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOP
        ):
            raise GenerationError(
                f"{name} must be a whole number in 0..{MAX_TOP} (the most likely tokens to "
                f"list beside each one), got {value!r}"
            )
    for token, _ in config.penalties.logit_bias if config.penalties else ():
        if not 0 <= token < vocab:
            raise GenerationError(f"logit_bias token {token} is outside 0..{vocab - 1}")
    budget = config.reasoning_budget
    whole = isinstance(budget, int) and not isinstance(budget, bool)
    if budget is not None and not (whole and budget >= 0):
        raise GenerationError(
            f"reasoning_budget must be a whole number >= 0 (tokens of reasoning), got {budget!r}"
        )
    if config.grammar is not None and config.ignore_eos:
        raise GenerationError(
            "a grammar ends generation with eos where its text is complete: drop ignore_eos"
        )
