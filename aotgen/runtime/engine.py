"""Load a package and generate text — with no model code.

Imports torch (for tensors and the AOTInductor loader: model_runner.py runs each model's
graphs), safetensors, the tokenizer and the manifest checks; never aotgen's model/export/pass
code, never torch.export or torch.compile. `tests/test_runtime_isolation.py` enforces it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from aotgen.package.manifest import PackageError, verify_package
from aotgen.runtime.device_greedy import greedy_tokens
from aotgen.runtime.grammar import Grammar, GrammarError, GrammarTokens
from aotgen.runtime.logprobs import TokenLogprob, token_logprobs
from aotgen.runtime.lookup_cache import LookupCache
from aotgen.runtime.model_runner import GenerationError, ModelRunner
from aotgen.runtime.model_sampling import read_generation_config
from aotgen.runtime.onnx_backend import BACKENDS
from aotgen.runtime.proposers import (
    DraftOrLookupProposer,
    DraftProposer,
    LookupProposer,
    Proposer,
)
from aotgen.runtime.reasoning_budget import BudgetError, ReasoningBudget, marks_of, start_of
from aotgen.runtime.request_check import PackageLimits, check_request
from aotgen.runtime.rules import Penalties, TokenRules, fit, select, verify_within
from aotgen.runtime.sampling import SamplingParams, make_generator
from aotgen.runtime.sequence import TokenSink
from aotgen.runtime.speculative import AdaptiveK, SpecStats
from aotgen.runtime.tokenizer import Tokenizer
from aotgen.runtime.tree_draft import TreeParams, tree_steps

# Shortest n-gram match that may make a proposal (it must also convince by its counts:
# runtime/ngram.py). Backed by a draft (acceptance ~0.95 on SmolLM2), a 1-2 token match is
# mostly a worse guess than the draft's; from 3 tokens on, matches on a copy/edit task were
# all accepted in part or in full (the bench prompts; docs/speculative.md).
NGRAM_MIN = {"ngram": 1, "draft+ngram": 3}


@dataclass
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # end the answer like eos (finish_reason "stop")
    ignore_eos: bool = False
    min_tokens: int = 0  # no eos, stop token or stop string before this many tokens (vLLM's)
    speculative: str | None = None  # None | "draft" | "ngram" | "draft+ngram"
    k: int | None = None  # draft length; default: the package's verify_k
    adaptive_k: bool = False
    ngram_min: int | None = None  # shortest suffix match; default: see NGRAM_MIN
    ngram_max: int = 4
    tree: TreeParams | None = None  # tree speculation (runtime/tree_draft.py); None: a chain
    grammar: Grammar | None = None  # structured output (runtime/grammar.py)
    penalties: Penalties | None = None  # repetition, presence, frequency, logit bias (rules.py)
    logprobs: int | None = None  # None: off; N: each token's logprob and the N likeliest
    # The same for the prompt's tokens (all but the first); max_new_tokens may then be 0.
    prompt_logprobs: int | None = None
    # Run only the prompt past the prefix the KV cache already holds (runtime/cached_tokens.py);
    # off: every prompt runs from position 0, as benchmarks of prefill need.
    reuse_prefix: bool = True
    # At most this many tokens of reasoning, then its close is forced, after
    # `reasoning_budget_message` if one is given (runtime/reasoning_budget.py).
    reasoning_budget: int | None = None
    reasoning_budget_message: str = ""

    @property
    def reuses_prefix(self) -> bool:
        """Whether the prompt may start from what the cache holds: not when every prompt
        position's logits are wanted."""
        return self.reuse_prefix and self.prompt_logprobs is None

    @property
    def uses_draft(self) -> bool:
        return self.speculative in ("draft", "draft+ngram")

    @property
    def uses_lookup(self) -> bool:
        return self.speculative in ("ngram", "draft+ngram")

    @property
    def lookup_min(self) -> int:
        """The shortest n-gram match lookup proposes from (ngram_min, or the mode's default)."""
        return self.ngram_min if self.ngram_min is not None else NGRAM_MIN.get(self.speculative, 1)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos" | "stop" | "length"
    prefill_s: float
    decode_s: float
    spec: SpecStats | None = None
    error: str | None = None  # finish_reason "error": what failed
    cached_tokens: int = 0  # prompt tokens found in the KV cache, not run again
    logprobs: list[TokenLogprob] | None = None  # per token, with config.logprobs
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the first token's is None
    stop_reason: str | int | None = None  # finish "stop": the stop string or stop token id

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens run, over the time to the first token."""
        run = self.prompt_tokens - self.cached_tokens
        return run / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first one, over the time spent producing them."""
        n = len(self.token_ids) - 1
        return n / self.decode_s if n > 0 and self.decode_s else 0.0


# KV-cache slots of a package without batched graphs: its requests take turns step by step.
DEFAULT_SLOTS = 4


def _cache_slots(manifest: dict[str, Any], slots: int) -> int:
    """The target cache's rows: `slots`, or 0 for the package's `max_batch` (its batched
    graphs are compiled for exactly that many)."""
    batch_graph = manifest["models"]["target"]["graphs"].get("batch_decode", {})
    max_batch = batch_graph.get("batch", {}).get("max", 0)
    if slots == 0:
        return max_batch or DEFAULT_SLOTS
    if max_batch and slots not in (1, max_batch):
        raise PackageError(
            f"the package's batched graphs serve a cache of {max_batch} slots, not {slots}: "
            f"use {max_batch} (or 0 for the package's own)"
        )
    return slots


class Engine:
    """A loaded package: tokenizer, target model, optional draft model."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        target: ModelRunner,
        draft: ModelRunner | None,
        max_seq_len: int,
        verify_k: int,
        root: Path | None = None,
        manifest: dict[str, Any] | None = None,
        load_s: float = 0.0,
        backend: str = "aoti",
    ):
        self.tokenizer, self.target, self.draft = tokenizer, target, draft
        self.max_seq_len, self.verify_k = max_seq_len, verify_k
        self.root, self.manifest, self.load_s = root, manifest or {}, load_s
        self.backend = backend  # "aoti" or "onnxruntime": which graphs run
        self.grammar_tokens = GrammarTokens(tokenizer, target.vocab_size)
        # n-gram counts of finished requests that n-gram lookup drafts from, when set
        # (runtime/lookup_cache.py); every request's text is added to it when it ends.
        self.lookup_cache: LookupCache | None = None
        # One KV cache, so one request at a time: concurrent generate() calls queue here.
        self._lock = threading.Lock()

    @classmethod
    def load(
        cls,
        path: str | Path,
        threads: int | None = None,
        verify: bool = True,
        backend: str = "aoti",
        slots: int = 1,
        cuda_graphs: bool = True,
    ) -> Engine:
        """Verify the manifest (hashes, torch version, ISA) first, then load native code:
        the AOTInductor graphs, or with `backend="onnxruntime"` the package's ONNX graphs.
        `slots` > 1 gives the models a KV cache row per sequence for the batch engine
        (runtime/batch_engine.py); 0: as many as the package's batched graphs serve.
        `cuda_graphs`: replay a CUDA package's fixed-width graphs (runtime/cuda_graph.py)."""
        t0 = time.perf_counter()
        root = Path(path)
        if backend not in BACKENDS:
            raise PackageError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
        manifest = verify_package(root, check_hashes=verify)
        if manifest.get("world_size", 1) != 1:
            raise PackageError(
                f"{root} is a tensor-parallel package ({manifest['world_size']} ranks): "
                "launch it with `aotgen run` (it starts the ranks) or torchrun"
            )
        if threads:
            torch.set_num_threads(threads)
        slots = _cache_slots(manifest, slots)
        tokenizer = Tokenizer.from_dir(root / manifest["tokenizer"]["dir"])
        pt2 = root / manifest["package"]
        models = manifest["models"]
        device = manifest["target"]["device"]
        target = ModelRunner(root, pt2, models["target"], None, device, backend, slots, cuda_graphs)
        draft = (
            ModelRunner(root, pt2, models["draft"], target, device, backend, slots, cuda_graphs)
            if "draft" in models
            else None
        )
        return cls(
            tokenizer,
            target,
            draft,
            manifest["max_seq_len"],
            manifest["verify_k"],
            root,
            manifest,
            time.perf_counter() - t0,
            backend,
        )

    def generation_config(self) -> dict[str, Any]:
        """The package's generation_config.json (verified at load): the model's own sampling
        values among its keys (runtime/model_sampling.py)."""
        if self.root is None or "tokenizer" not in self.manifest:
            return {}
        return read_generation_config(self.root / self.manifest["tokenizer"]["dir"])

    # ---- prompts -------------------------------------------------------------------------
    def chat_ids(
        self, user: str, system: str | None = None, template_kwargs: dict[str, Any] | None = None
    ) -> list[int]:
        """Prompt ids for one user turn; the user's text never becomes control tokens.
        `template_kwargs`: more template variables (e.g. {"enable_thinking": False})."""
        message = {"role": "user", "content": user}
        return self.tokenizer.encode_chat([message], system, template_kwargs=template_kwargs)

    # ---- generation ----------------------------------------------------------------------
    def generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate from token ids, streaming text through `on_text` as it is decoded. A
        prompt that starts with tokens the KV cache holds from an earlier request (the next
        turn of a chat, sent whole) runs only the rest (`config.reuse_prefix`).

        Safe to call from several threads: the engine has one KV cache, so calls run one
        after the other (each waits for the one before), never interleaved."""
        config = config or GenerationConfig()
        self.check_request(prompt_ids, config)
        rules = self.rules(config, prompt_ids)
        with self._lock:
            return self._generate(prompt_ids, config, on_text, rules)

    def check_request(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        """A GenerationError naming the first thing in the request this engine cannot run."""
        limits = PackageLimits(
            self.root,
            self.target.vocab_size,
            self.max_seq_len,
            has_draft=self.draft is not None,
            has_tree=bool(getattr(self.target, "tree_len", 0)),
        )
        check_request(prompt_ids, config, limits)

    def rules(self, config: GenerationConfig, prompt: list[int]) -> TokenRules | None:
        """A request's penalties, grammar, min_tokens and reasoning budget, at its start (None
        without any)."""
        penalties = config.penalties if config.penalties and config.penalties.active else None
        eos = set() if config.ignore_eos else set(self.tokenizer.eos_ids)  # what ends answers
        ends = eos | set(config.stop_token_ids)
        holds = config.min_tokens > 0 and bool(ends)  # min_tokens with nothing to hold: a no-op
        budget = config.reasoning_budget
        if config.grammar is None and penalties is None and not holds and budget is None:
            return None
        try:
            grammar = (
                None if config.grammar is None else self.grammar_tokens.constraint(config.grammar)
            )
            bounds = None if budget is None else self.reasoning_budget(config, prompt)
        except (GrammarError, BudgetError) as e:
            raise GenerationError(str(e)) from None
        vocab = self.target.vocab_size
        return TokenRules(penalties, prompt, vocab, eos, grammar, config.min_tokens, ends, bounds)

    def reasoning_budget(self, config: GenerationConfig, prompt: list[int]) -> ReasoningBudget:
        """The request's reasoning budget, from where its prompt leaves the reasoning."""
        tok, budget = self.tokenizer, config.reasoning_budget
        marks = marks_of(tok, config.reasoning_budget_message)
        return ReasoningBudget(tok, marks, start_of(tok, prompt, budget))

    def _generate(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        on_text: Callable[[str], None] | None,
        rules: TokenRules | None = None,
    ) -> GenerationResult:
        sink = TokenSink.for_request(self.tokenizer, config, on_text)
        spec = SpecStats() if config.speculative else None
        t0 = time.perf_counter()
        t_first = None
        cached = self.reusable(prompt_ids, config)
        logits, prompt_logprobs = self._prompt(prompt_ids, cached, config)
        logprobs = None if config.logprobs is None else []
        steps = self._token_steps(prompt_ids, logits, config, spec, rules)
        for new_tokens, rows in steps if config.max_new_tokens else ():
            if t_first is None:
                t_first = time.perf_counter()
            before = len(sink.ids)
            done = sink.add(new_tokens)
            if logprobs is not None:
                logprobs += token_logprobs(rows, sink.ids[before:], config.logprobs)
            if done:
                break
        steps.close()
        sink.close("length")  # a prompt scored only (max_new_tokens 0)
        t_end = time.perf_counter()
        self.learn(prompt_ids, sink.ids)
        return GenerationResult(
            text=sink.text,
            token_ids=sink.ids,
            prompt_tokens=len(prompt_ids),
            finish_reason=sink.finish_reason,
            prefill_s=(t_first or t_end) - t0,
            decode_s=t_end - (t_first or t_end),
            spec=spec,
            cached_tokens=cached,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_reason=sink.stop_reason,
        )

    def learn(self, prompt: list[int], answer: list[int]) -> None:
        """Add a finished request's text to the lookup cache, if the engine has one."""
        if self.lookup_cache is not None:
            self.lookup_cache.add([*prompt, *answer])

    def reusable(self, prompt: list[int], config: GenerationConfig) -> int:
        """Leading prompt tokens the target's cache holds from an earlier request."""
        return self.target.cached.reusable(0, prompt) if config.reuses_prefix else 0

    def _prompt(
        self, prompt: list[int], cached: int, config: GenerationConfig
    ) -> tuple[Tensor, list[TokenLogprob | None] | None]:
        """Run the prompt from position `cached`: the last position's logits, and with
        `prompt_logprobs` each prompt token's (every row: the verify graph's chunks)."""
        if config.prompt_logprobs is None:
            return self.target.forward(prompt[cached:], cached), None
        rows = self.target.forward(prompt, 0, all_logits=True)
        return rows[-1], [None, *token_logprobs(rows, prompt[1:], config.prompt_logprobs)]

    def _token_steps(
        self,
        prompt: list[int],
        logits: Tensor,
        config: GenerationConfig,
        spec: SpecStats | None,
        rules: TokenRules | None,
    ) -> Iterator[tuple[list[int], Tensor | None]]:
        """Yield newly accepted tokens, one list per model step, with the logits rows that
        chose them; `logits`: the prompt's last position's."""
        params = config.sampling
        gen = make_generator(params.seed)
        target = self.target
        tok = select(logits, params, gen, rules)
        yield [tok], logits[None]
        pos = len(prompt)  # position of `tok`, not yet in the cache
        if config.speculative is None:
            plain = rules is None and config.logprobs is None  # nothing wants the host logits
            if params.greedy and plain and target.device.type == "cuda":  # logits stay there
                yield from (([t], None) for t in greedy_tokens(target, tok, pos))
                return
            while True:
                logits = target.decode(tok, pos)
                tok = select(logits, params, gen, rules)
                pos += 1
                yield [tok], logits[None]
        yield from self._speculative_steps(prompt, tok, pos, config, spec, gen, rules)

    def _speculative_steps(
        self,
        prompt: list[int],
        tok: int,
        pos: int,
        config: GenerationConfig,
        spec: SpecStats,
        gen: torch.Generator,
        rules: TokenRules | None,
    ) -> Iterator[tuple[list[int], Tensor]]:
        """Propose -> verify -> accept, one verify step per yield."""
        if config.tree is not None:
            yield from tree_steps(self, prompt, tok, pos, config, spec, gen, rules)
            return
        max_k = self.verify_k
        k = min(config.k or max_k, max_k)
        adaptive = AdaptiveK(k=k, k_min=1, k_max=max_k) if config.adaptive_k else None
        history = list(prompt) + [tok]
        proposer = self.proposer(prompt, config, gen, rules=rules)
        while True:
            k = adaptive.k if adaptive else k
            k = min(k, self.max_seq_len + max_k - pos)
            proposal, row_rules = fit(proposer.propose(history, k), rules)
            # Score tok + proposal: row i predicts the token after history[:pos+i+1].
            logits = self.target.forward([tok] + proposal.tokens, pos, all_logits=True)
            accepted = verify_within(proposal, logits, row_rules, config.sampling, gen, rules)
            n, n_acc = len(proposal.tokens), len(accepted) - 1
            spec.update(n, n_acc, lookup=proposal.looked_up)
            if adaptive:
                adaptive.update(n, n_acc)
            pos += n_acc + 1
            proposer.accepted(pos)
            history.extend(accepted)
            tok = accepted[-1]
            yield accepted, logits[: len(accepted)]

    def proposer(
        self,
        prompt: list[int],
        config: GenerationConfig,
        gen: torch.Generator,
        slot: int = 0,
        rules: TokenRules | None = None,
    ) -> Proposer:
        """The proposer of config.speculative: "ngram", "draft" or "draft+ngram"; a draft
        runs in the cache row `slot` and drafts within the request's grammar."""
        lookup = LookupProposer(config.lookup_min, config.ngram_max, self.lookup_cache)
        if not config.uses_draft:
            return lookup
        draft = DraftProposer(
            self.draft, prompt, config.sampling, gen, slot, config.reuse_prefix, rules
        )
        return DraftOrLookupProposer(lookup, draft) if config.uses_lookup else draft
