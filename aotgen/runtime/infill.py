"""Fill in the middle: the prompt that asks a code model for the text between a prefix and a
suffix (OpenAI's completions `suffix`, `aotgen run --suffix`), in the model's own FIM tokens,
found by the names llama.cpp looks for (Qwen2.5-Coder, StarCoder2, Granite, DeepSeek-Coder,
CodeLlama, GLM-4.5).

The layout is llama.cpp's (prefix, suffix, middle):

    [bos] [FIM_PRE] prefix [FIM_SUF] suffix [FIM_MID]

and the model writes the middle. The prefix and suffix are the user's text: special-token
text in them is read as plain text, as llama.cpp tokenizes them. Where the whole does not
fit the room the request leaves (the context less its max_tokens), the suffix keeps at least
a quarter of it and the prefix the rest, each cut at its far end (the text nearest the
insertion point stays), as llama.cpp keeps a 3:1 split. The FIM pad, repo and file-separator
tokens end an infill, as llama.cpp counts them among the end-of-generation tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aotgen.runtime.tokenizer import Tokenizer

# Each role's token names, as llama.cpp's vocabulary loader looks for them.
_NAMES = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}  # fmt: skip


class InfillError(ValueError):
    """A fill-in-the-middle request this model cannot take."""


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    ends: tuple[int, ...]  # pad, repo, file separator: they end an infill

    @classmethod
    def of(cls, tok: Tokenizer) -> FimTokens:
        """The model's FIM tokens; InfillError (one line) where it has none."""
        found = {role: _first(tok, names) for role, names in _NAMES.items()}
        if None in (found["pre"], found["suf"], found["mid"]):
            raise InfillError(
                "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, "
                "<|fim_suffix|>, <|fim_middle|>): leave out the suffix, or serve a code model "
                "trained for infilling"
            )
        ends = tuple(found[r] for r in ("pad", "rep", "sep") if found[r] is not None)
        return cls(found["pre"], found["suf"], found["mid"], ends)


def _first(tok: Tokenizer, names: tuple[str, ...]) -> int | None:
    return next((i for i in map(tok.token_to_id, names) if i is not None), None)


def infill_ids(tok: Tokenizer, fim: FimTokens, prefix: str, suffix: str, room: int) -> list[int]:
    """The prompt ids asking for the text between `prefix` and `suffix`, in at most `room`
    tokens (InfillError where not even the FIM tokens fit)."""
    lead = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    free = room - len(lead) - 3
    if free < 0:
        raise InfillError(f"no room for a fill-in-the-middle prompt in {room} tokens")
    before, after = tok.encode_text(prefix), tok.encode_text(suffix)
    keep_after = min(len(after), max(free // 4, free - len(before)))
    keep_before = min(len(before), free - keep_after)
    before = before[len(before) - keep_before :]
    return [*lead, fim.prefix, *before, fim.suffix, *after[:keep_after], fim.middle]
