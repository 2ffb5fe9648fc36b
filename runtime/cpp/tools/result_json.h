// Fields of aotgen-run's and aotgen-batch's JSON, as `aotgen run --json` prints them.
#pragma once

#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "aotgen.h"

// `stop_reason`: the stop string or stop token id that ended the answer, else null.
inline nlohmann::json stop_reason_json(const aotgen::GenerationResult& r) {
  if (r.stop_string) return *r.stop_string;
  if (r.stop_token) return *r.stop_token;
  return nullptr;
}

// `logprobs`: per generated token {"id", "logprob", "top": [[id, logprob], ...]}, or null.
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
