// aotgen-batch: serve many requests at once with the C++ BatchEngine (aotgen.h).
//
//   aotgen-batch PACKAGE REQUESTS [options]
//
// REQUESTS is a file (or - for stdin) with one request per line: a plain text prompt, or a
// JSON object with the prompt and its own generation parameters. All are submitted at once
// and served in continuous batches. Prints one JSON line per request as it finishes, then a
// summary line; timings go to stderr. Errors: one message on stderr, exit status 1 (2 for a
// command line that cannot be parsed).
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "aotgen.h"
#include "model_sampling.h"
#include "result_json.h"
#include "threads.h"

namespace {

using json = nlohmann::json;

constexpr const char* kUsage = R"(usage: aotgen-batch PACKAGE REQUESTS [options]

REQUESTS: a file (- for stdin), one request per line: a plain text prompt, or a JSON object
  {"prompt": TEXT | "chat": TEXT | "prompt_ids": [IDS], "system": TEXT,
   "suffix": TEXT (with prompt: fill in the middle, the prompt the text before the gap),
   "chat_template_kwargs": {...} (over --chat-template-kwargs),
   "max_new_tokens": N, "temperature": T, "top_k": K, "top_p": P, "min_p": P, "seed": S,
   "repetition_penalty": R, "presence_penalty": P, "frequency_penalty": F,
   "logit_bias": {"ID": BIAS},
   "stop": [TEXT], "stop_token_ids": [IDS], "min_tokens": N, "ignore_eos": BOOL,
   "lookup": "ngram" | null, "speculative": BOOL,
   "k": K, "ngram_min": N, "ngram_max": N, "logprobs": N, "reasoning_budget": N,
   "reasoning_budget_message": TEXT, "cancel_after": STEPS}
  (speculative: draft with the package's draft model, with lookup only where lookup finds
  no match; cancel_after: cancel the request after that many engine steps).
options (defaults for every request):
  --chat                 plain text lines are chat messages (the chat template), not raw prompts
  --max-new-tokens N     (default 256)
  --temperature T, --top-k K, --top-p P, --min-p P, --seed S, --ignore-eos,
  --lookup ngram, --speculative
  --generation-config auto|none  temperature, top-k, top-p, min-p and repetition penalty
                         given nowhere: the model's (auto, default), or greedy and off (none)
  --chat-template-kwargs JSON  more chat template variables, e.g. '{"enable_thinking": false}'
  --lookup-cache FILE    n-gram counts of earlier requests for lookup to draft from
                         (llama.cpp's lookup-cache format): read if it exists, every
                         request's text added, written back at the end
  --slots N              KV-cache slots (default: the package's max_batch)
  --prefill-step N       prompt tokens per step while others decode (default 64)
  --threads N            intra-op threads
  --no-verify            skip the sha256 check of the package files
Output: one JSON line per finished request (request, prompt_ids, ids, text, reasoning and
content (a chat answer's <think> reasoning or harmony analysis channel apart; null and the
text where the template has neither), finish_reason, stop_reason, step, spec, error), then
{"summary": {...}}.
)";

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

template <typename T>
T parse_number(std::string_view flag, std::string_view text) {
  T value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size()) {
    throw UsageError(std::string(flag) + ": not a valid number: '" + std::string(text) + "'");
  }
  return value;
}

struct Args {
  std::string package, requests;
  std::optional<std::string> lookup_cache;
  bool chat = false, lookup = false, draft = false;
  bool model_sampling = true;            // --generation-config auto
  std::set<std::string> sampling_given;  // the sampling options given, by ModelSampling's names
  std::string template_kwargs = "{}";    // --chat-template-kwargs
  aotgen::GenerationConfig config;
  aotgen::LoadOptions load;
  aotgen::BatchOptions batch;
};

// The speculative mode of n-gram lookup and / or the draft model.
aotgen::Speculative speculative(bool lookup, bool draft) {
  using aotgen::Speculative;
  if (draft) return lookup ? Speculative::DraftNgram : Speculative::Draft;
  return lookup ? Speculative::Ngram : Speculative::None;
}

Args parse_args(int argc, char** argv) {
  Args args;
  auto& cfg = args.config;
  std::vector<std::string_view> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError(std::string(arg) + " needs a value");
      return argv[++i];
    };
    if (arg == "--chat") {
      args.chat = true;
    } else if (arg == "--max-new-tokens") {
      cfg.max_new_tokens = parse_number<int64_t>(arg, value());
    } else if (arg == "--generation-config") {
      const std::string_view mode = value();
      if (mode != "auto" && mode != "none") {
        throw UsageError("--generation-config '" + std::string(mode) + "': give 'auto' or 'none'");
      }
      args.model_sampling = mode == "auto";
    } else if (arg == "--chat-template-kwargs") {
      args.template_kwargs = value();
    } else if (arg == "--temperature") {
      args.sampling_given.insert("temperature");
      cfg.sampling.temperature = parse_number<double>(arg, value());
    } else if (arg == "--top-k") {
      args.sampling_given.insert("top_k");
      cfg.sampling.top_k = parse_number<int64_t>(arg, value());
    } else if (arg == "--top-p") {
      args.sampling_given.insert("top_p");
      cfg.sampling.top_p = parse_number<double>(arg, value());
    } else if (arg == "--min-p") {
      args.sampling_given.insert("min_p");
      cfg.sampling.min_p = parse_number<double>(arg, value());
    } else if (arg == "--seed") {
      cfg.sampling.seed = parse_number<uint64_t>(arg, value());
    } else if (arg == "--ignore-eos") {
      cfg.ignore_eos = true;
    } else if (arg == "--lookup") {
      if (value() != "ngram") throw UsageError("--lookup: the only lookup proposer is 'ngram'");
      args.lookup = true;
    } else if (arg == "--speculative") {
      args.draft = true;
    } else if (arg == "--lookup-cache") {
      args.lookup_cache = value();
    } else if (arg == "--slots") {
      args.batch.slots = parse_number<int64_t>(arg, value());
    } else if (arg == "--prefill-step") {
      args.batch.prefill_step = parse_number<int64_t>(arg, value());
    } else if (arg == "--threads") {
      args.load.threads = parse_number<int>(arg, value());
    } else if (arg == "--no-verify") {
      args.load.verify_hashes = false;
    } else if (arg.starts_with("-") && arg != "-") {
      throw UsageError("unexpected argument: " + std::string(arg));
    } else {
      positional.push_back(arg);
    }
  }
  if (positional.size() != 2) throw UsageError("give the package directory and the requests file");
  cfg.speculative = speculative(args.lookup, args.draft);
  args.package = positional[0];
  args.requests = positional[1];
  return args;
}

// One line's request: its prompt ids, its config, when to cancel it (if ever), and for a
// chat, where its answer starts (Engine::thinking, Engine::harmony_head: its reasoning comes
// apart).
struct Line {
  std::vector<int64_t> prompt_ids;
  aotgen::GenerationConfig config;
  std::optional<int64_t> cancel_after;
  std::optional<bool> thinking;
  std::optional<std::string> head;

  void read_answer_start(const aotgen::Engine& engine) {
    thinking = engine.thinking(prompt_ids);
    head = engine.harmony_head(prompt_ids);
  }
  // The answer's reasoning and content, as aotgen/cli/run.py splits them: harmony first,
  // then `<think>` (reasoning a string, not null).
  aotgen::ReasoningSplit split(const std::string& text) const {
    if (!head) return aotgen::split_answer(text, thinking);
    auto whole = aotgen::split_harmony(text, *head);
    return {std::move(whole.reasoning), std::move(whole.content)};
  }
};

// A request's chat template variables: its own `chat_template_kwargs` over the command line's.
std::string template_kwargs(const Args& args, const json& request) {
  json kwargs = json::parse(args.template_kwargs);
  const json own = request.value("chat_template_kwargs", json::object());
  if (!own.is_object()) throw std::invalid_argument("chat_template_kwargs must be a JSON object");
  kwargs.update(own);
  try {
    aotgen::check_template_kwargs(kwargs.dump());
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("chat_template_kwargs ") + e.what());
  }
  return kwargs.dump();
}

Line parse_line(const std::string& text, const Args& args, const aotgen::Engine& engine) {
  Line line{{}, args.config, std::nullopt, std::nullopt, std::nullopt};
  if (!text.starts_with("{")) {
    line.prompt_ids = args.chat ? engine.chat_ids({{"user", text}}, args.template_kwargs)
                                : engine.prompt_ids(text);
    if (args.chat) line.read_answer_start(engine);
    return line;
  }
  const json r = json::parse(text);  // json::exception: reported with the line number
  static const std::vector<std::string> known = {
      "prompt", "chat", "prompt_ids", "system", "suffix", "chat_template_kwargs", "max_new_tokens",
      "temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty",
      "presence_penalty", "frequency_penalty", "logit_bias", "stop", "stop_token_ids",
      "min_tokens", "ignore_eos", "lookup", "speculative", "k", "ngram_min", "ngram_max",
      "logprobs", "reasoning_budget", "reasoning_budget_message", "cancel_after"};
  for (const auto& [key, _] : r.items()) {
    if (std::find(known.begin(), known.end(), key) == known.end()) {
      throw std::invalid_argument("unknown field '" + key + "'");
    }
  }
  const int prompts = r.contains("prompt") + r.contains("chat") + r.contains("prompt_ids");
  if (prompts != 1) throw std::invalid_argument("give exactly one of prompt, chat, prompt_ids");
  if (r.contains("chat")) {
    std::vector<aotgen::ChatMessage> messages;
    if (r.contains("system")) messages.emplace_back("system", r["system"].get<std::string>());
    messages.emplace_back("user", r["chat"].get<std::string>());
    line.prompt_ids = engine.chat_ids(messages, template_kwargs(args, r));
    line.read_answer_start(engine);
  } else if (r.contains("prompt")) {
    line.prompt_ids = engine.prompt_ids(r["prompt"].get<std::string>());
  } else {
    line.prompt_ids = r["prompt_ids"].get<std::vector<int64_t>>();
  }
  auto& c = line.config;
  c.max_new_tokens = r.value("max_new_tokens", c.max_new_tokens);
  c.sampling.temperature = r.value("temperature", c.sampling.temperature);
  c.sampling.top_k = r.value("top_k", c.sampling.top_k);
  c.sampling.top_p = r.value("top_p", c.sampling.top_p);
  c.sampling.min_p = r.value("min_p", c.sampling.min_p);
  c.penalties.repetition = r.value("repetition_penalty", c.penalties.repetition);
  c.penalties.presence = r.value("presence_penalty", c.penalties.presence);
  c.penalties.frequency = r.value("frequency_penalty", c.penalties.frequency);
  const json logit_bias = r.value("logit_bias", json::object());
  for (const auto& [key, bias] : logit_bias.items()) {
    int64_t token = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), token);
    if (ec != std::errc() || end != key.data() + key.size()) {
      throw std::invalid_argument("logit_bias keys are token ids, got '" + key + "'");
    }
    c.penalties.logit_bias.emplace_back(token, bias.get<double>());
  }
  if (r.contains("seed")) c.sampling.seed = r["seed"].get<uint64_t>();
  if (r.contains("stop")) {
    c.stop = r["stop"].is_string() ? std::vector{r["stop"].get<std::string>()}
                                   : r["stop"].get<std::vector<std::string>>();
  }
  c.stop_token_ids = r.value("stop_token_ids", c.stop_token_ids);
  c.min_tokens = r.value("min_tokens", c.min_tokens);
  c.ignore_eos = r.value("ignore_eos", c.ignore_eos);
  bool lookup = args.lookup;
  if (r.contains("lookup")) {
    if (!r["lookup"].is_null() && r["lookup"] != "ngram") {
      throw std::invalid_argument("lookup: the only lookup proposer is 'ngram'");
    }
    lookup = !r["lookup"].is_null();
  }
  c.speculative = speculative(lookup, r.value("speculative", args.draft));
  if (r.contains("k")) c.k = r["k"].get<int64_t>();
  if (r.contains("ngram_min")) c.ngram_min = r["ngram_min"].get<int64_t>();
  c.ngram_max = r.value("ngram_max", c.ngram_max);
  if (r.contains("logprobs")) c.logprobs = r["logprobs"].get<int64_t>();
  if (r.contains("reasoning_budget")) c.reasoning_budget = r["reasoning_budget"].get<int64_t>();
  c.reasoning_budget_message = r.value("reasoning_budget_message", c.reasoning_budget_message);
  if (r.contains("cancel_after")) line.cancel_after = r["cancel_after"].get<int64_t>();
  if (r.contains("suffix")) {  // fill in the middle, in the room max_new_tokens leaves
    if (!r.contains("prompt")) throw std::invalid_argument("suffix goes with prompt");
    const int64_t room = engine.max_seq_len() - c.max_new_tokens;
    aotgen::Infill infill = engine.infill(r["prompt"].get<std::string>(),
                                          r["suffix"].get<std::string>(), room);
    line.prompt_ids = std::move(infill.prompt_ids);
    c.stop_token_ids.insert(c.stop_token_ids.end(), infill.end_ids.begin(), infill.end_ids.end());
  }
  return line;
}

std::vector<Line> read_lines(const Args& args, const aotgen::Engine& engine) {
  std::ifstream file;
  if (args.requests != "-") {
    file.open(args.requests);
    if (!file) throw std::invalid_argument(args.requests + ": cannot be read");
  }
  std::istream& in = args.requests == "-" ? std::cin : file;
  std::vector<Line> lines;
  std::string text;
  for (int n = 1; std::getline(in, text); ++n) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      lines.push_back(parse_line(text, args, engine));
    } catch (const std::exception& e) {
      throw std::invalid_argument(args.requests + " line " + std::to_string(n) + ": " + e.what());
    }
  }
  if (lines.empty()) throw std::invalid_argument(args.requests + ": no requests");
  return lines;
}

json spec_json(const std::optional<aotgen::SpecStats>& s) {
  if (!s) return nullptr;
  return {{"drafted", s->drafted}, {"accepted", s->accepted}, {"steps", s->steps},
          {"lookup_steps", s->lookup_steps}};
}

int run(Args args) {
  const auto t0 = std::chrono::steady_clock::now();
  args.batch.max_queue = 1 << 30;  // every line is submitted up front
  try {
    aotgen::check_template_kwargs(args.template_kwargs);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--chat-template-kwargs ") + e.what());
  }
  warn_if_oversubscribed(args.load.threads);
  auto batch = aotgen::BatchEngine::load(args.package, args.load, args.batch);
  if (args.model_sampling) {
    take_model_sampling(batch.engine().model_sampling(), args.sampling_given, args.config);
  }
  if (args.lookup_cache) {
    batch.set_lookup_cache(std::make_shared<aotgen::LookupCache>(
        aotgen::LookupCache::open(*args.lookup_cache, batch.engine().vocab_size())));
  }
  const auto lines = read_lines(args, batch.engine());
  int64_t steps = 0, tokens = 0;
  std::map<int64_t, std::size_t> line_of;  // request id -> line index
  for (std::size_t i = 0; i < lines.size(); ++i) try {
    const auto id = batch.submit(
        lines[i].prompt_ids, lines[i].config, {},
        [&](int64_t id, const aotgen::GenerationResult& r) {
          const std::size_t n = line_of.at(id);
          tokens += static_cast<int64_t>(r.token_ids.size());
          const auto split = lines[n].split(r.text);
          const json out = {{"request", n},           {"prompt_ids", lines[n].prompt_ids},
                            {"ids", r.token_ids},     {"text", r.text},
                            {"reasoning", split.reasoning ? json(*split.reasoning) : json(nullptr)},
                            {"content", split.content},
                            {"finish_reason", r.finish_reason},
                            {"stop_reason", stop_reason_json(r)}, {"step", steps},
                            {"cached_tokens", r.cached_tokens},
                            {"spec", spec_json(r.spec)}, {"error", r.error},
                            {"logprobs", logprobs_json(r.logprobs)}};
          std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
        });
    line_of[id] = i;
  } catch (const std::invalid_argument& e) {  // GenerationError, bad sampling parameters
    throw std::invalid_argument("request " + std::to_string(i + 1) + ": " + e.what());
  }
  const auto t_start = std::chrono::steady_clock::now();
  while (true) {
    for (const auto& [id, i] : line_of) {
      if (lines[i].cancel_after && *lines[i].cancel_after == steps) batch.cancel(id);
    }
    if (!batch.step()) break;
    ++steps;
  }
  const auto seconds_since = [](auto start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const double wall = seconds_since(t_start);
  if (args.lookup_cache) batch.engine().lookup_cache()->save(*args.lookup_cache);
  const json summary = {{"requests", lines.size()}, {"steps", steps}, {"tokens", tokens},
                        {"slots", batch.slots()},   {"free_slots", batch.free_slots()},
                        {"wall_s", wall}};
  std::cout << json{{"summary", summary}}.dump() << std::endl;
  std::fprintf(stderr,
               "load %.2f s · %zu requests on %lld slots · %lld steps · %lld tok in %.2f s"
               " (%.1f tok/s) · total %.2f s\n",
               batch.engine().load_s(), lines.size(), static_cast<long long>(batch.slots()),
               static_cast<long long>(steps), static_cast<long long>(tokens), wall,
               wall > 0 ? double(tokens) / wall : 0.0,
               seconds_since(t0));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    for (int i = 1; i < argc; ++i) {
      if (std::string_view(argv[i]) == "-h" || std::string_view(argv[i]) == "--help") {
        std::cout << kUsage;
        return 0;
      }
    }
    args = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::cerr << "aotgen-batch: " << e.what() << "\n" << kUsage;
    return 2;
  }
  try {
    return run(args);
  } catch (const c10::Error& e) {  // torch errors: without their C++ backtrace
    std::cerr << "aotgen-batch: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "aotgen-batch: error: " << e.what() << "\n";
    return 1;
  }
}
