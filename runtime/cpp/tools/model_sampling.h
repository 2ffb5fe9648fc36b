// aotgen-run's and aotgen-batch's sampling defaults: the model's values (its
// generation_config.json, Engine::model_sampling) where the command line gives none, said on
// stderr as `aotgen run` says them (aotgen/cli/run.py _with_model_sampling).
#pragma once

#include <iostream>
#include <set>
#include <sstream>
#include <string>

#include "aotgen.h"

// `given`: the sampling options the command line gave, by ModelSampling's names.
inline void take_model_sampling(const aotgen::ModelSampling& model,
                                const std::set<std::string>& given,
                                aotgen::GenerationConfig& cfg) {
  for (const auto& value : model.refused) {
    std::cerr << "warning: generation_config.json's " << value << " left out\n";
  }
  std::ostringstream taken;
  const auto take = [&](const char* name, const auto& value, auto& field) {
    if (!value || given.count(name)) return;
    field = *value;
    taken << (taken.tellp() > 0 ? ", " : "") << name << "=" << *value;
  };
  take("temperature", model.temperature, cfg.sampling.temperature);
  take("top_k", model.top_k, cfg.sampling.top_k);
  take("top_p", model.top_p, cfg.sampling.top_p);
  take("min_p", model.min_p, cfg.sampling.min_p);
  take("repetition_penalty", model.repetition_penalty, cfg.penalties.repetition);
  if (taken.tellp() > 0) {
    std::cerr << "the model's sampling (generation_config.json): " << taken.str()
              << "; options given win (--generation-config none: greedy)\n";
  }
}
