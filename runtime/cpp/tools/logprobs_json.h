// The `logprobs` field of aotgen-run's and aotgen-batch's JSON, as `aotgen run --json` prints
// it: per generated token {"id", "logprob", "top": [[id, logprob], ...]}, or null.
#pragma once

#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "aotgen.h"

inline nlohmann::json logprobs_json(const std::optional<std::vector<aotgen::TokenLogprob>>& lps) {
  if (!lps) return nullptr;
  nlohmann::json out = nlohmann::json::array();
  for (const auto& lp : *lps) {
    nlohmann::json top = nlohmann::json::array();
    for (const auto& [id, value] : lp.top) top.push_back({id, value});
    out.push_back({{"id", lp.token}, {"logprob", lp.logprob}, {"top", top}});
  }
  return out;
}
