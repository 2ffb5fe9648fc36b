// Fill in the middle (aotgen/runtime/infill.py, token for token): the prompt that asks a code
// model for the text between a prefix and a suffix in its own FIM tokens, found by the names
// llama.cpp looks for, laid out as llama.cpp lays it out and cut to the room the same way.
#include <algorithm>
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "aotgen.h"
#include "runner.h"

namespace aotgen {
namespace {

using Names = std::vector<const char*>;

// Each role's token names, as llama.cpp's vocabulary loader looks for them.
const std::array<Names, 6>& fim_names() {
  static const std::array<Names, 6> names = {
      Names{"<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>"},
      Names{"<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>"},
      Names{"<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>"},
      Names{"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"},
      Names{"<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"},
      Names{"<|file_sep|>"},
  };
  return names;
}

std::optional<int64_t> first_of(const Tokenizer& tok, const Names& names) {
  for (const char* name : names) {
    if (const auto id = tok.token_id(name)) return id;
  }
  return std::nullopt;
}

}  // namespace

Infill Engine::infill(const std::string& prefix, const std::string& suffix, int64_t room) const {
  const Tokenizer& tok = *impl_->tokenizer;
  std::array<std::optional<int64_t>, 6> found;
  for (std::size_t role = 0; role < found.size(); ++role) {
    found[role] = first_of(tok, fim_names()[role]);
  }
  if (!found[0] || !found[1] || !found[2]) {
    throw GenerationError(
        "this model has no fill-in-the-middle tokens (such as <|fim_prefix|>, <|fim_suffix|>, "
        "<|fim_middle|>): leave out the suffix, or serve a code model trained for infilling");
  }
  Infill out;
  for (std::size_t role = 3; role < found.size(); ++role) {
    if (found[role]) out.end_ids.push_back(*found[role]);
  }
  if (impl_->bos_id) out.prompt_ids.push_back(*impl_->bos_id);
  const int64_t free = room - static_cast<int64_t>(out.prompt_ids.size()) - 3;
  if (free < 0) {
    throw GenerationError("no room for a fill-in-the-middle prompt in " + std::to_string(room) +
                          " tokens");
  }
  // The user's text: special-token text in it is read as plain text.
  const std::vector<int64_t> before = tok.encode(prefix, /*parse_special=*/false);
  const std::vector<int64_t> after = tok.encode(suffix, /*parse_special=*/false);
  const auto n_before = static_cast<int64_t>(before.size());
  const auto n_after = static_cast<int64_t>(after.size());
  const int64_t keep_after = std::min(n_after, std::max(free / 4, free - n_before));
  const int64_t keep_before = std::min(n_before, free - keep_after);
  out.prompt_ids.push_back(*found[0]);
  out.prompt_ids.insert(out.prompt_ids.end(), before.end() - keep_before, before.end());
  out.prompt_ids.push_back(*found[1]);
  out.prompt_ids.insert(out.prompt_ids.end(), after.begin(), after.begin() + keep_after);
  out.prompt_ids.push_back(*found[2]);
  return out;
}

}  // namespace aotgen
