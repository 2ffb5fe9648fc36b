// A model's own sampling values from its generation_config.json: aotgen/runtime/model_sampling.py
// generation_defaults, key for key.
#include <nlohmann/json.hpp>

#include <optional>
#include <stdexcept>
#include <string>

#include "detail.h"

namespace aotgen::detail {

namespace {

using json = nlohmann::json;

// `value` as the key's number, checked as a request's would be; throws std::invalid_argument
// with the reason for one the runtime refuses.
template <typename T>
T checked(const std::string& key, const json& value) {
  if (!value.is_number()) throw std::invalid_argument("not a number");
  if constexpr (std::is_integral_v<T>) {
    if (!value.is_number_integer()) throw std::invalid_argument(key + " must be an int >= 0");
  }
  const T number = value.get<T>();
  SamplingParams sampling;
  Penalties penalties;
  if (key == "temperature") sampling.temperature = static_cast<double>(number);
  if (key == "top_k") sampling.top_k = static_cast<int64_t>(number);
  if (key == "top_p") sampling.top_p = static_cast<double>(number);
  if (key == "min_p") sampling.min_p = static_cast<double>(number);
  if (key == "repetition_penalty") penalties.repetition = static_cast<double>(number);
  sampling.validate();
  penalties.validate();
  return number;
}

}  // namespace

ModelSampling read_model_sampling(const json& generation_config) {
  ModelSampling out;
  if (!generation_config.is_object()) return out;
  json values = json::object();
  for (const char* key : {"temperature", "top_k", "top_p", "min_p", "repetition_penalty"}) {
    const auto it = generation_config.find(key);
    if (it != generation_config.end() && !it->is_null()) values[key] = *it;
  }
  const json do_sample = generation_config.value("do_sample", json());
  if (do_sample == json(false)) values.erase("temperature");
  if (do_sample == json(true) && !values.contains("temperature")) values["temperature"] = 1.0;
  const auto take = [&](const char* key, auto& field) {
    if (!values.contains(key)) return;
    try {
      field = checked<typename std::remove_reference_t<decltype(field)>::value_type>(
          key, values[key]);
    } catch (const std::invalid_argument& e) {
      out.refused.push_back(std::string(key) + "=" + values[key].dump() + " (" + e.what() + ")");
    }
  };
  take("temperature", out.temperature);
  take("top_k", out.top_k);
  take("top_p", out.top_p);
  take("min_p", out.min_p);
  take("repetition_penalty", out.repetition_penalty);
  return out;
}

}  // namespace aotgen::detail
