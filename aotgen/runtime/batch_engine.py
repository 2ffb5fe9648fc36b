"""Many requests on one package at once: continuous batching over the batched graphs.

Each request holds a slot, one row of the target's KV cache (`[slots, kv_heads, cache_len,
head_dim]` per layer; model/layers.py): the free slot holding the longest prefix of its
prompt, which it does not run again (runtime/scheduler.py). A step runs, in order:

- one prefill chunk of the oldest request still prefilling, at most `prefill_step` tokens
  while others decode (the whole prefill graph when none does), through the single-sequence
  graphs on the slot's row; before its first, the longest prefix of its prompt that any row
  holds is copied into its row (`ModelRunner.share_prefix`), so requests running at once
  with one system prompt run it once, and one left with only its last prompt token runs it
  in the decode below;
- one decode for every request past its prompt: the `batch_decode` graph for two or more
  (each weight read once for all of them), the single-sequence `decode` graph for one;
- with speculation, the requests with a proposal (n-gram lookup, or the draft model run in
  the request's own cache row) verify it in one `batch_verify` call instead, and each
  accepts its own prefix (lossless, as alone).

Sampling is per request (its parameters, its seeded generator, its stop strings), with the
same functions as `Engine`, so a request's output does not depend on what it is batched with
beyond float rounding between graphs. Requests join and leave between steps; a cancelled one
gives its slot back at the next step.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from aotgen.runtime.batch_draft import can_draft_in_batch, draft_batch
from aotgen.runtime.engine import Engine, GenerationConfig, GenerationError, GenerationResult
from aotgen.runtime.logprobs import token_logprobs
from aotgen.runtime.proposers import LookupProposer
from aotgen.runtime.rules import fit, select, verify_within
from aotgen.runtime.scheduler import Scheduler
from aotgen.runtime.sequence import Sequence, TokenSink
from aotgen.runtime.speculative import Proposal, SpecStats

OnDone = Callable[[GenerationResult], None]


class BatchEngine:
    """A loaded package serving requests in batches; `start()` runs steps in a thread."""

    def __init__(self, engine: Engine, max_queue: int = 64, prefill_step: int = 64):
        self.engine = engine
        self.target = engine.target
        self.tokenizer = engine.tokenizer
        self.slots = len(self.target.slot_caches)
        self.scheduler = Scheduler(self.target.cached, max_queue)
        self.prefill_step = max(1, prefill_step)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closing = False
        self.finished: dict[str, int] = {}  # finish reason -> requests, since load

    @classmethod
    def load(
        cls,
        path: str | Path,
        slots: int = 0,
        threads: int | None = None,
        max_queue: int = 64,
        prefill_step: int = 64,
    ) -> BatchEngine:
        """`slots` 0: as many as the package's batched graphs serve (`max_batch`)."""
        engine = Engine.load(path, threads=threads, slots=slots)
        return cls(engine, max_queue, prefill_step)

    def warm_cache(self) -> None:
        """Write every slot's cache rows once (and forget what they held): the rows are
        allocated lazily, and a slot's first request otherwise pays for its fresh pages
        (SmolLM2 fp32, 512 positions: ~190 ms on a 2-core AMD EPYC). A server does it before
        serving, as llama.cpp zeroes its cache at load. Call it before `start()`."""
        for runner in (self.target, self.engine.draft):
            if runner is not None and not runner.shares_cache:
                for cache in runner.caches:
                    cache.zero_()
                runner.cached.clear()

    # ---- requests (any thread) -----------------------------------------------------------
    def submit(
        self,
        prompt_ids: list[int],
        config: GenerationConfig | None = None,
        on_text: Callable[[str], None] | None = None,
        on_done: OnDone | None = None,
    ) -> int:
        """Queue a request; returns its id. Raises GenerationError for a request the package
        cannot serve and QueueFull when `max_queue` requests already wait beyond the free
        slots."""
        config = config or GenerationConfig()
        self._check(prompt_ids, config)
        sink = TokenSink.for_request(self.tokenizer, config, on_text)
        seq = Sequence(next(self._ids), list(prompt_ids), sink, config, on_done)
        seq.rules = self.engine.rules(config, prompt_ids)
        if config.speculative:
            seq.spec = SpecStats()
        with self._lock:
            self.scheduler.add(seq)
            self._wake.notify()
        return seq.id

    def cancel(self, request_id: int) -> None:
        """Stop a request (e.g. its client went away); its slot is free at the next step."""
        with self._lock:
            seq = self.scheduler.find(request_id)
            if seq is not None:
                seq.cancelled = True
                self._wake.notify()

    def generate_many(
        self, prompts: list[list[int]], configs: list[GenerationConfig] | GenerationConfig
    ) -> list[GenerationResult]:
        """Serve `prompts` together and return their results in order (steps run here unless
        the engine's thread runs them)."""
        if isinstance(configs, GenerationConfig):
            configs = [configs] * len(prompts)
        results: dict[int, GenerationResult] = {}
        done = threading.Event()
        for i, (prompt, config) in enumerate(zip(prompts, configs, strict=True)):

            def finished(result: GenerationResult, i: int = i) -> None:
                results[i] = result
                if len(results) == len(prompts):
                    done.set()

            self.submit(prompt, config, on_done=finished)
        while not done.is_set():
            if self._thread is None:
                self.step()
            else:
                done.wait(0.1)
        return [results[i] for i in range(len(prompts))]

    def _check(self, prompt_ids: list[int], config: GenerationConfig) -> None:
        if config.tree is not None or config.adaptive_k:
            raise GenerationError(
                "the batch engine drafts chains of a fixed length: tree drafting and adaptive k "
                "serve one request at a time (Engine)"
            )
        self.engine.check_request(prompt_ids, config)

    # ---- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        """Run steps in a background thread while there is work."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="aotgen-batch", daemon=True)
            self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        while True:
            with self._lock:
                while self.scheduler.idle and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
            self.step()

    def step(self) -> bool:
        """One engine step; False when there was nothing to do. Callbacks run in the calling
        thread, outside the engine's lock (they may submit or cancel)."""
        with self._lock:
            cancelled = [
                s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.cancelled
            ]
            for seq in cancelled:
                seq.sink.close("cancelled")
                self._release(seq)
            self.scheduler.admit()
            prefilling = self.scheduler.prefilling()
        self._report(cancelled)
        prefill = self._share_prefixes(prefilling)
        decoding = self.scheduler.decoding()
        try:
            if prefill is not None:
                self._prefill(prefill, others_decoding=bool(decoding))
            if decoding:
                self._decode(decoding)
        except Exception as e:  # a failed step ends the requests in it, not the engine
            _fail([s for s in (prefill, *decoding) if s is not None], e)
        with self._lock:
            done = [s for s in self.scheduler.running if s.done]
            for seq in done:
                self._release(seq)
        self._report(done)
        return prefill is not None or bool(decoding) or bool(done)

    def _release(self, seq: Sequence) -> None:
        """A finished request leaves its slot (under the lock)."""
        self.scheduler.release(seq)
        seq.finished = time.perf_counter()
        reason = seq.sink.finish_reason
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def _report(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            if seq.sink.finish_reason != "error":
                self.engine.learn(seq.prompt, seq.sink.ids)
            if seq.on_done is not None:
                seq.on_done(self._result(seq))

    @staticmethod
    def _result(seq: Sequence) -> GenerationResult:
        first = seq.first_token or seq.finished
        return GenerationResult(
            text=seq.sink.text,
            token_ids=seq.sink.ids,
            prompt_tokens=len(seq.prompt),
            finish_reason=seq.sink.finish_reason,
            prefill_s=first - seq.submitted,  # time to first token, queueing included
            decode_s=seq.finished - first,
            spec=seq.spec,
            error=seq.error,
            cached_tokens=seq.cached_tokens,
            logprobs=seq.logprobs,
            prompt_logprobs=seq.prompt_logprobs,
            stop_reason=seq.sink.stop_reason,
        )

    # ---- model steps ---------------------------------------------------------------------
    def _share_prefixes(self, prefilling: list[Sequence]) -> Sequence | None:
        """Before a request's prompt starts, copy into its row the longest prefix of it that
        any row holds: rows written since it took its slot (a request ahead of it, still
        running, with the same system prompt) may hold more than its own. Oldest first, up to
        the first with more than its last token to run: its chunk runs this step. Those left
        with their last token join the step's decode."""
        for seq in prefilling:
            if seq.pos == seq.cached_tokens and seq.config.reuses_prefix:  # not started
                try:
                    # Not the last token, which runs: a ring is checked where the row goes on.
                    held = self.target.share_prefix(seq.slot, seq.prompt[:-1])
                except Exception as e:  # a failed copy ends its request, not the engine
                    _fail([seq], e)
                    continue
                seq.pos = seq.cached_tokens = min(held, len(seq.prompt) - 1)
            if not seq.last_prompt_token:
                return seq
        return None

    def _prefill(self, seq: Sequence, others_decoding: bool) -> None:
        """The next chunk of `seq`'s prompt; after the last, its first token."""
        limit = self.prefill_step if others_decoding else self.target.prefill_chunk
        chunk = seq.prompt[seq.pos : seq.pos + limit]
        if seq.prompt_logprobs is None:
            logits = self.target.forward(chunk, seq.pos, slot=seq.slot)
        else:  # every row, for the prompt tokens after each position
            rows = self.target.forward(chunk, seq.pos, all_logits=True, slot=seq.slot)
            following = seq.prompt[seq.pos + 1 : seq.pos + len(chunk) + 1]
            seq.prompt_logprobs += token_logprobs(rows, following, seq.config.prompt_logprobs)
            logits = rows[-1]
        seq.pos += len(chunk)
        if not seq.prefilling and seq.config.max_new_tokens == 0:  # a prompt scored only
            seq.sink.close("length")
        elif not seq.prefilling:
            tok = select(logits, seq.config.sampling, seq.generator, seq.rules)
            seq.accept([tok], logits[None])

    def _decode(self, seqs: list[Sequence]) -> None:
        """Every request past its prompt moves on by one decode or one verify."""
        # A request's first token (its prompt's last token runs here) comes unproposed.
        proposals = self._proposals([s for s in seqs if s.config.speculative and not s.prefilling])
        # Under rules: cut where the grammar refuses, and the rules of each verify row.
        row_rules = {}
        for seq in seqs:
            if seq.id in proposals:
                proposals[seq.id], row_rules[seq.id] = fit(proposals[seq.id], seq.rules)
        verifying = [s for s in seqs if s.id in proposals and proposals[s.id].tokens]
        plain = [s for s in seqs if s not in verifying]
        if plain:
            for seq, row in zip(
                plain,
                self.target.decode_many(
                    [s.decode_input for s in plain], [s.pos for s in plain], [s.slot for s in plain]
                ),
                strict=True,
            ):
                if seq.spec is not None and not seq.prefilling:  # it found nothing to propose
                    seq.spec.update(0, 0)
                seq.pos += 1
                tok = select(row, seq.config.sampling, seq.generator, seq.rules)
                self._accepted(seq, [tok], row[None])
        if verifying:
            props = [proposals[s.id] for s in verifying]
            all_logits = self._verify_logits(verifying, props)
            for seq, p, logits in zip(verifying, props, all_logits, strict=True):
                params, gen = seq.config.sampling, seq.generator
                accepted = verify_within(p, logits, row_rules[seq.id], params, gen, seq.rules)
                seq.spec.update(len(p.tokens), len(accepted) - 1, lookup=p.looked_up)
                seq.pos += len(accepted)
                self._accepted(seq, accepted, logits[: len(accepted)])

    @staticmethod
    def _accepted(seq: Sequence, tokens: list[int], rows: Tensor) -> None:
        """A step's tokens (and the logits rows that chose them), once `seq.pos` counts the
        positions its cache now holds."""
        if seq.proposer is not None:
            seq.proposer.accepted(seq.pos)
        seq.accept(tokens, rows)

    def _proposals(self, seqs: list[Sequence]) -> dict[int, Proposal]:
        """Each speculating request's proposal (empty: nothing to propose). Requests whose
        draft runs on the target's cache draft together through the draft's batched graph
        (runtime/batch_draft.py); the others through their own proposer, made the first time
        they decode: n-gram lookup, their draft in their cache row, or both."""
        engine = self.engine
        together = can_draft_in_batch(engine.draft)
        out: dict[int, Proposal] = {}
        drafting: list[tuple[Sequence, int]] = []
        for seq in seqs:
            k = min(seq.config.k or engine.verify_k, engine.verify_k)
            k = min(k, engine.max_seq_len + engine.verify_k - seq.pos)
            if seq.proposer is None and not (together and seq.config.uses_draft):
                seq.proposer = engine.proposer(
                    seq.prompt, seq.config, seq.generator, seq.slot, seq.rules
                )
            if together and seq.config.uses_draft:
                if seq.config.uses_lookup and seq.proposer is None:
                    seq.proposer = LookupProposer(
                        seq.config.lookup_min, seq.config.ngram_max, engine.lookup_cache
                    )
                out[seq.id] = seq.proposer.propose(seq.history, k) if seq.proposer else Proposal([])
                if not out[seq.id].tokens and k > 0:
                    drafting.append((seq, k))
            else:
                out[seq.id] = seq.proposer.propose(seq.history, k)
        if drafting:
            seqs_, ks = [s for s, _ in drafting], [k for _, k in drafting]
            for seq, proposal in zip(seqs_, draft_batch(engine.draft, seqs_, ks), strict=True):
                out[seq.id] = proposal
        return out

    def _verify_logits(self, seqs: list[Sequence], props: list[Proposal]) -> list[Tensor]:
        """Each sequence's `[k + 1, V]` logits for its pending token and its proposal. Rows
        are padded to the graph's width by repeating the last token: padded positions are
        written past the proposal and never read before they are overwritten."""
        target = self.target
        rows = [[s.pending, *p.tokens] for s, p in zip(seqs, props, strict=True)]
        if len(seqs) == 1 or "batch_verify" not in target.graphs:
            return [
                target.forward(r, s.pos, all_logits=True, slot=s.slot)
                for s, r in zip(seqs, rows, strict=True)
            ]
        width = target.verify_len
        tokens = torch.tensor([r + r[-1:] * (width - len(r)) for r in rows])
        positions = torch.tensor([[s.pos + i for i in range(width)] for s in seqs])
        slots = torch.tensor([s.slot for s in seqs])
        logits = target.batch("batch_verify", tokens, positions, slots)
        return [logits[i, : len(r)] for i, r in enumerate(rows)]


def _fail(seqs: list[Sequence], error: Exception) -> None:
    for seq in seqs:
        seq.error = f"{type(error).__name__}: {error}"
        seq.sink.close("error")
