"""`aotgen run` and `aotgen serve`: text from a package, one request at a time or many."""

from __future__ import annotations

import dataclasses
import functools
import json
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console

from aotgen.cli.common import (
    BACKEND_HELP,
    LOOKUP_CACHE_HELP,
    REASONING_BUDGET_HELP,
    REASONING_MESSAGE_HELP,
    SEED_MAX,
    CliError,
    app,
    at_least,
    check_backend,
    check_generation_config,
    check_lookup_cache,
    check_lookup_cache_every,
    check_origin,
    check_reasoning_budget,
    console,
    print_json,
    read_prompt_file,
    resolve_threads,
    user_errors_exit,
)
from aotgen.package.manifest import read_manifest
from aotgen.runtime.harmony import HarmonyStream, head_of, split_harmony
from aotgen.runtime.reasoning import ReasoningStream, SplitStream, split_reasoning, thinking_of

if TYPE_CHECKING:
    from aotgen.runtime.batch_engine import BatchEngine
    from aotgen.runtime.engine import Engine, GenerationConfig
    from aotgen.runtime.grammar import Grammar


@app.command()
@user_errors_exit
def run(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    prompt: Annotated[str | None, typer.Option(help="raw prompt text")] = None,
    prompt_file: Annotated[
        Path | None, typer.Option(help="read the raw prompt from a UTF-8 text file")
    ] = None,
    chat: Annotated[
        str | None, typer.Option(help="user message, wrapped in the chat template")
    ] = None,
    suffix: Annotated[
        str | None,
        typer.Option(
            help="fill in the middle: the text after the insertion point, --prompt (or "
            "--prompt-file) the text before it; needs a code model's FIM tokens"
        ),
    ] = None,
    system: Annotated[
        str | None, typer.Option(help="system message for --chat or --interactive")
    ] = None,
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(
            help="more chat template variables, a JSON object, e.g. '{\"enable_thinking\": false}'"
        ),
    ] = None,
    interactive: Annotated[
        bool,
        typer.Option(
            help="a conversation: each line on stdin is the next user message; each turn runs "
            "only what the KV cache does not hold yet"
        ),
    ] = False,
    max_new_tokens: Annotated[
        int, typer.Option(help="stop after this many new tokens (>= 1)")
    ] = 256,
    temperature: Annotated[
        float | None,
        typer.Option(help="0 = greedy; higher = more random (default: the model's, else 0)"),
    ] = None,
    top_k: Annotated[
        int | None,
        typer.Option(help="sample from the K likeliest tokens; 0 = off (default: the model's)"),
    ] = None,
    top_p: Annotated[
        float | None,
        typer.Option(
            help="sample from the smallest set with this much probability; 1 = off (default: "
            "the model's)"
        ),
    ] = None,
    min_p: Annotated[
        float | None,
        typer.Option(
            help="drop tokens below this fraction of the top token's probability; 0 = off "
            "(default: the model's)"
        ),
    ] = None,
    generation_config: Annotated[
        str,
        typer.Option(
            help="'auto': sampling options not given take the model's values (its "
            "generation_config.json, as transformers reads it); 'none': greedy and no filters"
        ),
    ] = "auto",
    seed: Annotated[
        int | None,
        typer.Option(help=f"sampling seed, 0..{SEED_MAX} (default: random)"),
    ] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    stop_token_id: Annotated[
        list[int] | None,
        typer.Option(help="end the answer at this token id, as at eos (repeatable)"),
    ] = None,
    min_tokens: Annotated[
        int, typer.Option(help="no eos, stop token or stop string before this many tokens")
    ] = 0,
    repetition_penalty: Annotated[
        float | None,
        typer.Option(
            help="> 1 discourages tokens of the prompt and answer; 1 = off (default: the model's)"
        ),
    ] = None,
    presence_penalty: Annotated[
        float, typer.Option(help="-2..2, subtracted from tokens the answer holds; 0 = off")
    ] = 0.0,
    frequency_penalty: Annotated[
        float, typer.Option(help="-2..2, subtracted per occurrence in the answer; 0 = off")
    ] = 0.0,
    ignore_eos: Annotated[bool, typer.Option(help="keep going past end-of-sequence")] = False,
    json_schema: Annotated[
        str | None,
        typer.Option(
            help="structured output: the answer is JSON matching this schema (its JSON text, "
            'or a .json file); \'{"type": "object"}\' for any JSON object'
        ),
    ] = None,
    regex: Annotated[
        str | None, typer.Option(help="structured output: the answer matches this regex")
    ] = None,
    grammar: Annotated[
        Path | None,
        typer.Option(help="structured output: the answer matches this Lark or llama.cpp GBNF file"),
    ] = None,
    logprobs: Annotated[
        int | None,
        typer.Option(
            help="with --json: each token's log-probability and its N likeliest alternatives "
            "(0..20)"
        ),
    ] = None,
    reasoning_budget: Annotated[
        int | None, typer.Option(help=REASONING_BUDGET_HELP, show_default=False)
    ] = None,
    reasoning_budget_message: Annotated[
        str | None, typer.Option(help=REASONING_MESSAGE_HELP, show_default=False)
    ] = None,
    lookup: Annotated[
        str | None,
        typer.Option(
            help="'ngram': prompt-lookup speculation; with --speculative, the draft "
            "proposes only when lookup finds no match"
        ),
    ] = None,
    speculative: Annotated[bool, typer.Option(help="use the package's draft model")] = False,
    k: Annotated[
        int | None,
        typer.Option(help="draft length, >= 1 (default and maximum: the package's verify_k)"),
    ] = None,
    adaptive_k: Annotated[
        bool, typer.Option(help="adapt the draft length (+2 after a full accept, else -1)")
    ] = False,
    ngram_min: Annotated[
        int | None,
        typer.Option(help="shortest lookup match (default: 1; 3 with --speculative too)"),
    ] = None,
    ngram_max: Annotated[int, typer.Option(help="longest lookup match tried first")] = 4,
    lookup_cache: Annotated[Path | None, typer.Option(help=LOOKUP_CACHE_HELP)] = None,
    draft_parallel: Annotated[
        int | None,
        typer.Option(
            help="tree drafting: up to N sequences (llama.cpp's n_parallel), scored in one "
            "tree-graph call; needs a package built with tree_nodes"
        ),
    ] = None,
    p_split: Annotated[
        float, typer.Option(help="tree drafting: branch where an alternative's probability > P")
    ] = 0.1,
    best_first: Annotated[
        bool,
        typer.Option(
            help="tree drafting: keep the nodes most likely to be accepted (the chain and "
            "one-token leaves beside it) instead of --p-split branches"
        ),
    ] = False,
    threads: Annotated[
        int | None, typer.Option(help="intra-op threads, >= 1 (default: aotgen.toml's)")
    ] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="print one JSON object (text, ids, timings, finish reason, speculative "
            "stats) on stdout instead of streaming the text",
        ),
    ] = False,
    backend: Annotated[str, typer.Option(help=BACKEND_HELP)] = "aoti",
    nnodes: Annotated[int, typer.Option(help="tensor parallel: nodes taking part")] = 1,
    node_rank: Annotated[int, typer.Option(help="tensor parallel: this node's rank")] = 0,
    master_addr: Annotated[str | None, typer.Option(help="tensor parallel: node 0's host")] = None,
    master_port: Annotated[int | None, typer.Option(help="tensor parallel: node 0's port")] = None,
) -> None:
    """Generate text from a package (streams it, then prints speed and speculation stats).

    A tensor-parallel package starts its ranks through torch.distributed.run (or runs
    under `torchrun --nproc-per-node N -m aotgen run ...`); only rank 0 prints.
    """
    _check_prompt_source(prompt, prompt_file, chat, system, interactive)
    if suffix is not None and (chat is not None or interactive):
        raise CliError("--suffix goes with --prompt or --prompt-file (the text before it)")
    check_generation_config(generation_config)
    template_kwargs = _template_kwargs(chat_template_kwargs, chat, interactive)
    _check_speculation_options(lookup, k, ngram_min, ngram_max, draft_parallel, p_split)
    check_lookup_cache(lookup_cache, lookup)
    if best_first and not draft_parallel:
        raise CliError("--best-first shapes a token tree: add --draft-parallel N")
    at_least("--max-new-tokens", max_new_tokens)
    if logprobs is not None and not 0 <= logprobs <= 20:
        raise CliError(f"--logprobs must be in 0..20, got {logprobs}")
    if logprobs is not None and not as_json:
        raise CliError("--logprobs N goes with --json, which prints them")
    if seed is not None and not 0 <= seed <= SEED_MAX:
        raise CliError(f"--seed must be an integer in 0..{SEED_MAX}, got {seed}")
    if "" in (stop or ()):
        raise CliError("--stop is empty: give the text that ends the answer")
    check_reasoning_budget(reasoning_budget, reasoning_budget_message)
    read_manifest(package)  # a path that holds no package, too
    # After the checks above: a mistyped option is refused without the seconds torch takes.
    from aotgen.runtime.engine import GenerationConfig
    from aotgen.runtime.lookup_cache import LookupCache
    from aotgen.runtime.rules import Penalties
    from aotgen.runtime.sampling import SamplingParams
    from aotgen.runtime.tree_draft import TreeParams

    constraint = structured_output(json_schema, regex, grammar)
    given = {
        "temperature": temperature,
        "top_k": top_k,
        "top_p": top_p,
        "min_p": min_p,
        "repetition_penalty": repetition_penalty,
    }
    own = {key: value for key, value in given.items() if value is not None}
    values = RUN_SAMPLING | own
    penalties = Penalties(values["repetition_penalty"], presence_penalty, frequency_penalty)
    sampling = SamplingParams(
        temperature=values["temperature"],
        top_k=values["top_k"],
        top_p=values["top_p"],
        seed=seed,
        min_p=values["min_p"],
    )
    text = read_prompt_file(prompt_file) if prompt_file is not None else prompt
    mode = speculative_mode(speculative, lookup)
    cfg = GenerationConfig(
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop=tuple(stop or ()),
        stop_token_ids=tuple(stop_token_id or ()),
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
        speculative=mode,
        k=k,
        adaptive_k=adaptive_k,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        tree=TreeParams(draft_parallel, p_split, best_first) if draft_parallel else None,
        grammar=constraint,
        penalties=penalties,
        logprobs=logprobs,
        reasoning_budget=reasoning_budget,
        reasoning_budget_message=reasoning_budget_message or "",
    )
    launch = _Launch(nnodes, node_rank, master_addr, master_port)
    engine = _start_engine(package, backend, resolve_threads(threads), launch)
    if engine is None:  # launched as ranks, or a rank other than 0 (it served rank 0's calls)
        return
    if generation_config == "auto":
        cfg = _with_model_sampling(cfg, engine.generation_config(), set(own))
    if lookup_cache is not None:
        engine.lookup_cache = LookupCache.open(lookup_cache, engine.target.vocab_size)
    try:
        if interactive:
            _converse(engine, cfg, system, template_kwargs, as_json)
        elif suffix is not None:
            ids, cfg = _infill(engine, text, suffix, cfg)
            _answer(engine, ids, cfg, as_json, chat=False)
        elif chat is None:
            _answer(engine, engine.tokenizer.prompt_ids(text), cfg, as_json, chat=False)
        else:
            ids = engine.chat_ids(chat, system, template_kwargs)
            _answer(engine, ids, cfg, as_json, chat=True)
    finally:
        if engine.lookup_cache is not None and lookup_cache is not None:
            engine.lookup_cache.save(lookup_cache)


# `aotgen run`'s sampling where neither the command line nor the model gives a value: greedy.
RUN_SAMPLING = {
    "temperature": 0.0,
    "top_k": 0,
    "top_p": 1.0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def _with_model_sampling(
    cfg: GenerationConfig, generation_config: dict[str, Any], own: set[str]
) -> GenerationConfig:
    """`cfg` with the model's sampling values where the command line gives none, said on
    stderr (runtime/model_sampling.py)."""
    from aotgen.runtime.model_sampling import generation_defaults

    defaults, refused = generation_defaults(generation_config)
    for value in refused:
        console.print(
            f"warning: generation_config.json's {value} left out", markup=False, soft_wrap=True
        )
    taken = {key: value for key, value in defaults.items() if key not in own}
    if not taken:
        return cfg
    listed = ", ".join(f"{key}={value}" for key, value in taken.items())
    console.print(
        f"the model's sampling (generation_config.json): {listed}; options given win "
        "(--generation-config none: greedy)",
        markup=False,
        style="dim",
        soft_wrap=True,
    )
    repetition = taken.pop("repetition_penalty", None)
    penalties = cfg.penalties
    if repetition is not None and penalties is not None:
        penalties = dataclasses.replace(penalties, repetition=float(repetition))
    return dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, **taken), penalties=penalties
    )


def _infill(
    engine: Engine, prefix: str, suffix: str, cfg: GenerationConfig
) -> tuple[list[int], GenerationConfig]:
    """`--suffix`: the fill-in-the-middle prompt (runtime/infill.py) in the room max_new_tokens
    leaves, and the config that ends the answer at the FIM pad, repo and file tokens too."""
    from aotgen.runtime.infill import FimTokens, InfillError, infill_ids

    try:
        fim = FimTokens.of(engine.tokenizer)
        room = engine.max_seq_len - cfg.max_new_tokens
        ids = infill_ids(engine.tokenizer, fim, prefix, suffix, room)
    except InfillError as e:
        raise CliError(f"--suffix: {e}") from None
    ends = (*cfg.stop_token_ids, *fim.ends)
    return ids, dataclasses.replace(cfg, stop_token_ids=ends)


def _check_prompt_source(
    prompt: str | None,
    prompt_file: Path | None,
    chat: str | None,
    system: str | None,
    interactive: bool,
) -> None:
    """One prompt source, or none with --interactive; a system message only for a chat."""
    given = [x for x in (prompt, prompt_file, chat) if x is not None]
    if len(given) != (0 if interactive else 1):
        raise CliError(
            "--interactive reads the user's messages from stdin: drop --prompt, --prompt-file, "
            "--chat"
            if interactive
            else "give exactly one of --prompt, --prompt-file, --chat (or --interactive)"
        )
    if system is not None and chat is None and not interactive:
        raise CliError(
            "--system goes with --chat or --interactive (a system message for the chat template)"
        )


def _answer(
    engine: Engine, ids: list[int], cfg: GenerationConfig, as_json: bool, chat: bool
) -> str:
    """Generate from `ids`: the text streamed, then the stats (or one JSON object). A chat
    answer's reasoning (`<think>`, aotgen/runtime/reasoning.py; gpt-oss's analysis channel,
    aotgen/runtime/harmony.py) comes apart from the answer, on stderr and in the JSON. Returns the
    answer without it."""
    thinking = thinking_of(engine.tokenizer, ids) if chat else None
    head = head_of(engine.tokenizer, ids) if chat else None
    split: SplitStream | None = HarmonyStream(head) if head is not None else None
    if split is None and thinking is not None:
        split = ReasoningStream(thinking)
    printer = None if as_json else _Printer(split)
    result = engine.generate(ids, cfg, on_text=printer.feed if printer else None)
    reasoning, content = (None, result.text)
    if head is not None:
        whole = split_harmony(result.text, head)
        reasoning, content = whole.reasoning, whole.content
    elif thinking is not None:
        reasoning, content = split_reasoning(result.text, thinking)
    if printer is None:
        out = _run_json(engine.load_s, ids, result, cfg.speculative)
        print_json(out | {"reasoning": reasoning, "content": content})
    else:
        printer.finish()
        _print_stats(engine.load_s, result, cfg.speculative, tree=cfg.tree is not None)
    return content


class _Printer:
    """The answer streamed on stdout; a chat answer's reasoning (`split` not None) dimmed on
    stderr before it, so that stdout holds the answer alone, on a line of its own."""

    def __init__(self, split: SplitStream | None):
        self.split = split
        self.reasoned = self.answered = False

    def feed(self, piece: str) -> None:
        self._show(*(self.split.feed(piece) if self.split else ("", piece)))

    def finish(self) -> None:
        if self.split:
            self._show(*self.split.finish())
        if self.reasoned and not self.answered:
            console.print()  # the stats start a line of their own
        sys.stdout.write("\n")

    def _show(self, reasoning: str, content: str) -> None:
        if reasoning:
            console.print(reasoning, style="dim", end="", markup=False, highlight=False)
            self.reasoned = True
        if content:
            if self.reasoned and not self.answered:
                console.print()  # the reasoning ends its line
            self.answered = True
            sys.stdout.write(content)
            sys.stdout.flush()


def _template_kwargs(text: str | None, chat: str | None, interactive: bool) -> dict | None:
    """`--chat-template-kwargs`, checked as aotgen-run checks it (chat.cpp)."""
    if text is None:
        return None
    if chat is None and not interactive:
        raise CliError("--chat-template-kwargs goes with --chat or --interactive")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise CliError(f"--chat-template-kwargs is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise CliError("--chat-template-kwargs must be a JSON object")
    from aotgen.runtime.tokenizer import CHAT_VARIABLES

    for name in CHAT_VARIABLES:
        if name in value:
            raise CliError(
                f"--chat-template-kwargs sets '{name}', which the chat itself gives the template"
            )
    return value


def _converse(
    engine: Engine,
    cfg: GenerationConfig,
    system: str | None,
    template_kwargs: dict | None,
    as_json: bool,
) -> None:
    """`--interactive`: each line on stdin is the next user message of one conversation. The
    whole conversation is the next prompt, encoded through the chat template as a client
    would send it; the engine runs only what its KV cache does not hold yet. A conversation
    that outgrows the context (with `max_new_tokens` of room) loses its oldest turns, so the
    chat goes on (that prompt then runs whole: its start changed)."""
    encode = functools.partial(
        engine.tokenizer.encode_chat, system=system, template_kwargs=template_kwargs
    )
    messages: list[dict[str, str]] = []
    for line in sys.stdin:
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = encode(messages)
        while len(ids) + cfg.max_new_tokens > engine.max_seq_len and len(messages) > 1:
            del messages[:2]  # the oldest turn: a message and its answer
            ids = encode(messages)
        # The answer without its reasoning, as a chat client sends the history back.
        content = _answer(engine, ids, cfg, as_json, chat=True)
        messages.append({"role": "assistant", "content": content})


def structured_output(
    json_schema: str | None, regex: str | None, grammar_file: Path | None
) -> Grammar | None:
    """The grammar of --json-schema, --regex or --grammar (at most one), checked before the
    package loads."""
    from aotgen.runtime.grammar import Grammar

    given = [x for x in (json_schema, regex, grammar_file) if x is not None]
    if len(given) > 1:
        raise CliError("give at most one of --json-schema, --regex, --grammar")
    if json_schema is not None:
        schema = Path(json_schema)
        text = json_schema if json_schema.lstrip().startswith("{") else _read_text(schema)
        grammar = Grammar("json_schema", text)
    elif regex is not None:
        grammar = Grammar("regex", regex)
    elif grammar_file is not None:
        grammar = Grammar("grammar", _read_text(grammar_file))
    else:
        return None
    grammar.check()
    return grammar


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise CliError(f"{path}: no such file (give the grammar's file, or a JSON schema's text)")
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise CliError(f"{path}: not UTF-8 text") from None


def _check_speculation_options(
    lookup: str | None,
    k: int | None,
    ngram_min: int | None,
    ngram_max: int,
    draft_parallel: int | None,
    p_split: float,
) -> None:
    if lookup not in (None, "ngram"):
        raise CliError(f"--lookup {lookup!r}: the only lookup proposer is 'ngram'")
    at_least("--k", k)
    at_least("--ngram-min", ngram_min)
    at_least("--ngram-max", ngram_max)
    at_least("--draft-parallel", draft_parallel)
    if not 0.0 <= p_split <= 1.0:
        raise CliError(f"--p-split must be in 0..1, got {p_split}")
    if ngram_min is not None and ngram_min > ngram_max:
        raise CliError(
            f"--ngram-min ({ngram_min}) must be <= --ngram-max ({ngram_max}); the lookup tries "
            "matches from ngram-max tokens down to ngram-min"
        )


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Where a tensor-parallel package's ranks run (torch.distributed.run's options)."""

    nnodes: int
    node_rank: int
    master_addr: str | None
    master_port: int | None


def _start_engine(
    package: Path, backend: str, threads: int | None, launch: _Launch
) -> Engine | None:
    """The package's engine; None when this process only started the ranks of a
    tensor-parallel package (which re-run this command), or is a rank other than 0."""
    from aotgen.runtime import distributed
    from aotgen.runtime.engine import Engine

    check_backend(backend)
    if backend != "aoti":
        if distributed.needs_launch(package):
            raise CliError(
                f"--backend {backend} runs single-process packages; {package} is tensor-parallel "
                "(its recipe cannot have formats onnx): use --backend aoti"
            )
        return Engine.load(package, threads=threads, backend=backend)
    if distributed.needs_launch(package):
        distributed.launch(
            ["aotgen", *sys.argv[1:]],
            distributed.package_world_size(package),
            nnodes=launch.nnodes,
            node_rank=launch.node_rank,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            threads=threads,
        )
        return None
    return distributed.start(package, threads=threads)


def _print_stats(load_s: float, result: Any, mode: str | None, tree: bool) -> None:
    """Speed, then speculation's counts, dimmed on stderr after the streamed text."""
    cached = f" ({result.cached_tokens} in the cache)" if result.cached_tokens else ""
    console.print(
        f"[dim]load {load_s:.2f} s · prompt {result.prompt_tokens} tok{cached}, prefill "
        f"{result.prefill_tok_s:.1f} tok/s · {len(result.token_ids)} tok, decode "
        f"{result.decode_tok_s:.1f} tok/s · finish: {result.finish_reason}[/]",
        highlight=False,
    )
    if result.spec:
        s = result.spec
        by_pos = ", ".join(f"{r:.2f}" for r in s.acceptance_rate_by_position)
        lookups = (
            f", n-gram proposed {s.lookup_steps} of {s.steps}" if mode == "draft+ngram" else ""
        )
        if tree:
            lookups += f", tree nodes {s.tree_nodes}, a branch won {s.branch_steps} steps"
        console.print(
            f"[dim]speculative ({mode}): drafted {s.drafted}, accepted {s.accepted}, "
            f"acceptance {s.acceptance_rate:.2f}, mean accepted length "
            f"{s.mean_accepted_length:.2f} tok/step, by position [{by_pos}]{lookups}[/]",
            highlight=False,
        )


def speculative_mode(speculative: bool, lookup: str | None) -> str | None:
    """--speculative (the draft) and --lookup ngram, alone or together."""
    return {(True, True): "draft+ngram", (True, False): "draft", (False, True): "ngram"}.get(
        (speculative, lookup is not None)
    )


def _run_json(load_s: float, prompt_ids: list[int], result: Any, mode: str | None) -> dict:
    """`run --json`: the same fields as the C++ `aotgen-run --json`, plus the rates and logprobs."""
    s = result.spec
    spec = None
    if s is not None:
        spec = {
            "mode": mode,
            "drafted": s.drafted,
            "accepted": s.accepted,
            "steps": s.steps,
            "lookup_steps": s.lookup_steps,
            "tree_nodes": s.tree_nodes,
            "branch_steps": s.branch_steps,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "acceptance_rate_by_position": s.acceptance_rate_by_position,
        }
    return {
        "prompt_ids": prompt_ids,
        "ids": result.token_ids,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "stop_reason": result.stop_reason,
        "load_s": load_s,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "prefill_tok_s": result.prefill_tok_s,
        "decode_tok_s": result.decode_tok_s,
        "spec": spec,
        "logprobs": None
        if result.logprobs is None
        else [{"id": lp.token, "logprob": lp.logprob, "top": lp.top} for lp in result.logprobs],
    }


@app.command()
@user_errors_exit
def serve(
    package: Annotated[Path, typer.Argument(help="artifacts/NAME")],
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    lookup: Annotated[
        str | None, typer.Option(help="'ngram': prompt-lookup speculation for every request")
    ] = None,
    speculative: Annotated[
        bool, typer.Option(help="draft-model speculation for every request (with --lookup: both)")
    ] = False,
    slots: Annotated[
        int,
        typer.Option(help="requests decoding at once (default: the package's max_batch, or 4)"),
    ] = 0,
    max_queue: Annotated[
        int, typer.Option(help="requests waiting for a slot (beyond the free ones) before 429s")
    ] = 64,
    prefill_step: Annotated[
        int, typer.Option(help="prompt tokens per step while other requests decode")
    ] = 64,
    lookup_cache: Annotated[Path | None, typer.Option(help=LOOKUP_CACHE_HELP)] = None,
    lookup_cache_every: Annotated[
        float | None,
        typer.Option(
            help="seconds between writes of --lookup-cache while requests add to it "
            "(default 60; 0: at shutdown only)"
        ),
    ] = None,
    threads: Annotated[
        int | None, typer.Option(help="intra-op threads, >= 1 (default: aotgen.toml's)")
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar="AOTGEN_API_KEY",
            help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every endpoint "
            "but /health, /metrics",
        ),
    ] = None,
    served_model_name: Annotated[
        list[str] | None,
        typer.Option(
            help="a name requests' `model` may give (repeat for aliases; default: the "
            "package directory's name); any other is a 404"
        ),
    ] = None,
    generation_config: Annotated[
        str,
        typer.Option(
            help="'auto': a request leaving out temperature, top_p, top_k, min_p, "
            "repetition_penalty or max_tokens gets the model's (its generation_config.json, "
            "as vLLM); 'none': OpenAI's defaults"
        ),
    ] = "auto",
    reasoning_budget: Annotated[
        int | None,
        typer.Option(
            help=REASONING_BUDGET_HELP + " (a request's thinking_token_budget wins)",
            show_default=False,
        ),
    ] = None,
    reasoning_budget_message: Annotated[
        str | None, typer.Option(help=REASONING_MESSAGE_HELP, show_default=False)
    ] = None,
    allowed_origin: Annotated[
        list[str] | None,
        typer.Option(
            help="a web origin (scheme://host[:port]) whose pages may call the API from a "
            "browser (CORS; repeat for more; '*': any). Default: none",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Serve a package over an OpenAI-compatible HTTP API (and Anthropic's Messages API), many
    requests at once."""
    origins = tuple(check_origin(o) for o in allowed_origin or ())
    check_generation_config(generation_config)
    check_reasoning_budget(reasoning_budget, reasoning_budget_message)
    if lookup not in (None, "ngram"):
        raise CliError(f"--lookup {lookup!r}: the only lookup is 'ngram'")
    check_lookup_cache(lookup_cache, lookup)
    for option, value in (("--max-queue", max_queue), ("--prefill-step", prefill_step)):
        at_least(option, value)
    at_least("--slots", slots, low=0)
    check_lookup_cache_every(lookup_cache_every, lookup_cache)
    if not 0 < port < 65536:
        raise CliError(f"--port must be in 1..65535, got {port}")
    if api_key is not None and not api_key.strip():
        raise CliError(
            "--api-key (or AOTGEN_API_KEY) is empty: give the key clients must send, or leave "
            "it unset to serve without one"
        )
    names = tuple(dict.fromkeys(served_model_name or (package.resolve().name,)))
    if any(not n.strip() for n in names):
        raise CliError("--served-model-name is empty: give the name clients send as `model`")
    read_manifest(package)  # a path that holds no package, before the seconds torch takes
    from aotgen.runtime import distributed
    from aotgen.runtime.batch_engine import BatchEngine
    from aotgen.runtime.lookup_cache import SAVE_EVERY_S, LookupCache

    if distributed.needs_launch(package):
        raise CliError(f"{package} is tensor-parallel: `aotgen serve` runs single-process packages")
    try:
        from aotgen.serve import serve as serve_http
    except ImportError as e:
        raise CliError(
            f"aotgen serve needs the serve extra ({e}): pip install 'aotgen[serve]'"
        ) from None
    listener = _listen(host, port)
    engine = BatchEngine.load(package, slots, resolve_threads(threads), max_queue, prefill_step)
    if speculative and engine.engine.draft is None:
        raise CliError(f"{package} has no draft model: drop --speculative, or use --lookup ngram")
    mode = speculative_mode(speculative, lookup)
    if lookup_cache is not None:
        engine.engine.lookup_cache = LookupCache.open(lookup_cache, engine.engine.target.vocab_size)
    engine.warm_cache()
    console = Console(stderr=True)
    console.print(
        f"serving {', '.join(names)} on http://{host}:{port}/v1 ({engine.slots} slots"
        f"{f', speculative: {mode}' if mode else ''})"
    )
    defaults = _sampling_defaults(engine, console) if generation_config == "auto" else {}
    defaults |= _budget_defaults(engine, reasoning_budget, reasoning_budget_message)
    every_s = SAVE_EVERY_S if lookup_cache_every is None else lookup_cache_every
    serve_http(engine, names, listener, mode, defaults, api_key, lookup_cache, every_s, origins)


def _budget_defaults(
    engine: BatchEngine, budget: int | None, message: str | None
) -> dict[str, Any]:
    """--reasoning-budget and its message as the request fields a request leaves out."""
    from aotgen.runtime.reasoning_budget import BudgetError, marks_of

    if budget is None:
        return {}
    try:
        marks_of(engine.tokenizer)
    except BudgetError as e:
        raise CliError(f"--reasoning-budget: {e}") from None
    return {"thinking_token_budget": budget, "reasoning_budget_message": message or ""}


def _sampling_defaults(engine: BatchEngine, console: Console) -> dict[str, Any]:
    """The model's sampling defaults, said once at start, as vLLM says them."""
    from aotgen.openai_api import sampling_defaults

    defaults, refused = sampling_defaults(engine.engine.generation_config())
    for value in refused:
        console.print(
            f"warning: generation_config.json's {value} left out: no request could send it"
        )
    if defaults:
        given = ", ".join(f"{k}={v}" for k, v in defaults.items())
        console.print(
            f"the model's sampling defaults (generation_config.json): {given}; a request's own "
            "values win (--generation-config none: OpenAI's)"
        )
    return defaults


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the package loads, as uvicorn binds it: an address
    this machine cannot take (not its own, a port in use) is one line, not a server that
    loads, starts and dies."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as e:  # socket.gaierror too: a name that does not resolve
        listener.close()
        raise CliError(
            f"cannot listen on {host}:{port}: {e.strerror or e}; give --host an address of this "
            "machine and a free --port"
        ) from None
    return listener
