// aotgen-run: generate text from an aotgen package with the C++ runtime (aotgen.h).
//
//   aotgen-run PACKAGE (--chat TEXT | --prompt TEXT | --prompt-file PATH | --prompt-ids JSON
//                       | --interactive) [options]
//
// Streams the text to stdout, then prints load / first-token / decode timings on stderr.
// A chat answer's reasoning (`<think> ... </think>`, or gpt-oss's harmony analysis channel)
// streams on stderr, the answer alone on stdout. With --json (or --ids), prints one JSON
// object on stdout instead: prompt_ids, ids (generated), text, reasoning (null where the
// template has none) and content (the text without it), finish_reason, stop_reason (the stop
// string or stop token id that ended it, or null), spec (or null), logprobs (with --logprobs N, or null) and timings. Errors: one message on
// stderr, exit status 1 (2 for a command line that cannot be parsed at all). Option values
// are checked as the Python CLI (`aotgen run`) checks them, with the same messages.
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <unistd.h>  // isatty, access

#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "aotgen.h"
#include "model_sampling.h"
#include "result_json.h"
#include "threads.h"

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr const char* kUsage = R"(usage: aotgen-run PACKAGE PROMPT [options]

prompt (exactly one):
  --chat TEXT            user message, in the chat template (no system message unless --system)
  --interactive          a conversation: each line on stdin is the next user message; each
                         turn runs only what the KV cache does not hold yet
  --prompt TEXT          raw prompt text (with --suffix TEXT: the text before a gap to fill)
  --prompt-file PATH     raw prompt text from a file
  --prompt-ids JSON      prompt token ids, e.g. "[1, 2, 3]"
options:
  --system TEXT          system message; --chat-template-kwargs JSON: template variables
  --max-new-tokens N     stop after N new tokens, N >= 1 (default 256)
  --temperature T        0 = greedy; --top-k K: 0 = off; --top-p P: 1 = off; --min-p P: drop
                         tokens below P x the top one's probability, 0 = off
  --repetition-penalty R, --presence-penalty P, --frequency-penalty F
                         penalties on repeated tokens, as `aotgen run`'s (off: 1, 0, 0)
  --generation-config auto|none  temperature, top-k, top-p, min-p and repetition penalty
                         not given: the model's (auto, default), or greedy and off (none)
  --seed S               sampling seed, 0..18446744073709551615 (default: random)
  --stop TEXT            stop string; --stop-token-id ID: stop token (both repeatable)
  --ignore-eos           keep going past eos; --min-tokens N: no end before N tokens
  --reasoning-budget N   at most N tokens of reasoning; --reasoning-budget-message TEXT
  --lookup ngram         speculative decoding with prompt-lookup (n-gram) drafts
  --speculative          speculative decoding with the package's draft model (with
                         --lookup ngram: the draft proposes only when lookup finds no match)
  --k K, --adaptive-k    draft length, >= 1 (default, most: verify_k); adapt it (+2 / -1)
  --ngram-min N, --ngram-max N  lookup match lengths (defaults 1, or 3 with --speculative; 4)
  --lookup-cache FILE    n-gram counts of earlier runs for lookup (llama-lookup -lcd's file)
  --draft-parallel N     tree drafting: up to N sequences, scored in one tree-graph call
                         (needs a package built with tree_nodes)
  --p-split P            tree drafting: branch where an alternative's probability > P (0.1)
  --best-first           tree drafting: keep the draft's most probable nodes (the chain and
                         one-token leaves beside it) instead of p-split branches
  --threads N            intra-op threads, >= 1 (default: torch's default)
  --no-verify            skip the sha256 check of the package files
  --no-cuda-graphs       call a CUDA package's graphs directly instead of replaying them
  --json, --ids          print a JSON object (ids, text, stats) instead of streaming text
  --logprobs N           with --json: each token's log-probability and its N likeliest
                         alternatives (0..20)
)";

struct UsageError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A value that parses but is out of range, or a prompt file that cannot be used: reported as one
// `error:` line with exit status 1, like the Python CLI.
struct BadValue : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

void at_least(std::string_view flag, int64_t value, int64_t low = 1) {
  if (value < low) {
    throw BadValue(std::string(flag) + " must be >= " + std::to_string(low) + ", got " +
                   std::to_string(value));
  }
}

uint64_t parse_seed(std::string_view text) {
  constexpr const char* kRange = "0..18446744073709551615";
  uint64_t value{};
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  const bool digits = !text.empty() && text.find_first_not_of("-0123456789") == text.npos;
  if (ec == std::errc() && end == text.data() + text.size()) return value;
  if (digits && (ec == std::errc::result_out_of_range || text.front() == '-')) {
    throw BadValue("--seed must be an integer in " + std::string(kRange) + ", got " +
                   std::string(text));
  }
  throw UsageError("--seed: not a valid number: '" + std::string(text) + "'");
}

// Strict UTF-8 (no overlong forms, surrogates or code points past U+10FFFF), as Python decodes.
std::optional<std::size_t> first_invalid_utf8(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    std::size_t n = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    for (std::size_t j = 1; j <= n; ++j) {
      if (i + j >= s.size()) return i;
      const auto b = static_cast<unsigned char>(s[i + j]);
      if (b < (j == 1 ? lo : 0x80) || b > (j == 1 ? hi : 0xBF)) return i;
    }
    i += n + 1;
  }
  return std::nullopt;
}

std::string read_prompt_file(const std::string& path) {
  const std::string where = "--prompt-file " + path + ": ";
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    throw BadValue(where + "is a directory; give a UTF-8 text file");
  }
  if (!std::filesystem::is_regular_file(path, ec)) throw BadValue(where + "no such file");
  std::ifstream in(path, std::ios::binary);
  std::string text(std::istreambuf_iterator<char>(in), {});
  if (!in && !in.eof()) throw BadValue(where + "cannot be read");
  if (const auto bad = first_invalid_utf8(text)) {
    throw BadValue(where + "not UTF-8 text (invalid byte at offset " + std::to_string(*bad) +
                   "); save it as UTF-8");
  }
  return text;
}

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
  std::string package;
  std::optional<std::string> chat, prompt, prompt_file, prompt_ids, system, lookup_cache;
  std::optional<std::string> template_kwargs;  // --chat-template-kwargs
  std::optional<std::string> suffix;           // fill in the middle after --prompt
  std::optional<int> threads;
  aotgen::GenerationConfig config;
  aotgen::LoadOptions load;
  bool print_ids = false;
  bool interactive = false;
  bool model_sampling = true;             // --generation-config auto
  bool budget_message = false;            // --reasoning-budget-message given
  std::set<std::string> sampling_given;  // the sampling flags given, by ModelSampling's names
};

const char* mode_name(aotgen::Speculative mode) {
  switch (mode) {
    case aotgen::Speculative::Ngram: return "ngram";
    case aotgen::Speculative::Draft: return "draft";
    case aotgen::Speculative::DraftNgram: return "draft+ngram";
    default: return "none";
  }
}

Args parse_args(int argc, char** argv) {
  Args args;
  auto& cfg = args.config;
  bool lookup = false, draft = false, use_tree = false;
  aotgen::TreeParams tree;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    const auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError(std::string(arg) + " needs a value");
      return argv[++i];
    };
    if (arg == "--chat") {
      args.chat = value();
    } else if (arg == "--prompt") {
      args.prompt = value();
    } else if (arg == "--prompt-file") {
      args.prompt_file = value();
    } else if (arg == "--prompt-ids") {
      args.prompt_ids = value();
    } else if (arg == "--interactive") {
      args.interactive = true;
    } else if (arg == "--system") {
      args.system = value();
    } else if (arg == "--chat-template-kwargs") {
      args.template_kwargs = value();
    } else if (arg == "--max-new-tokens") {
      cfg.max_new_tokens = parse_number<int64_t>(arg, value());
    } else if (arg == "--generation-config") {
      const std::string_view mode = value();
      if (mode != "auto" && mode != "none") {
        throw BadValue("--generation-config '" + std::string(mode) + "': give 'auto' or 'none'");
      }
      args.model_sampling = mode == "auto";
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
    } else if (arg == "--repetition-penalty") {
      args.sampling_given.insert("repetition_penalty");
      cfg.penalties.repetition = parse_number<double>(arg, value());
    } else if (arg == "--presence-penalty") {
      cfg.penalties.presence = parse_number<double>(arg, value());
    } else if (arg == "--frequency-penalty") {
      cfg.penalties.frequency = parse_number<double>(arg, value());
    } else if (arg == "--seed") {
      cfg.sampling.seed = parse_seed(value());
    } else if (arg == "--stop") {
      cfg.stop.emplace_back(value());
      if (cfg.stop.back().empty()) {
        throw BadValue("--stop is empty: give the text that ends the answer");
      }
    } else if (arg == "--stop-token-id") {
      cfg.stop_token_ids.push_back(parse_number<int64_t>(arg, value()));
    } else if (arg == "--min-tokens") {
      cfg.min_tokens = parse_number<int64_t>(arg, value());
    } else if (arg == "--ignore-eos") {
      cfg.ignore_eos = true;
    } else if (arg == "--suffix") {
      args.suffix = value();
    } else if (arg == "--reasoning-budget") {
      cfg.reasoning_budget = parse_number<int64_t>(arg, value());
    } else if (arg == "--reasoning-budget-message") {
      cfg.reasoning_budget_message = value();
      args.budget_message = true;
    } else if (arg == "--lookup") {
      if (value() != "ngram") throw UsageError("--lookup: the only lookup proposer is 'ngram'");
      lookup = true;
    } else if (arg == "--speculative") {
      draft = true;
    } else if (arg == "--k") {
      cfg.k = parse_number<int64_t>(arg, value());
    } else if (arg == "--adaptive-k") {
      cfg.adaptive_k = true;
    } else if (arg == "--ngram-min") {
      cfg.ngram_min = parse_number<int64_t>(arg, value());
    } else if (arg == "--ngram-max") {
      cfg.ngram_max = parse_number<int64_t>(arg, value());
    } else if (arg == "--lookup-cache") {
      args.lookup_cache = value();
    } else if (arg == "--draft-parallel") {
      tree.n_parallel = parse_number<int64_t>(arg, value());
      use_tree = true;
    } else if (arg == "--p-split") {
      tree.p_split = parse_number<double>(arg, value());
    } else if (arg == "--best-first") {
      tree.best_first = true;
    } else if (arg == "--threads") {
      args.threads = parse_number<int>(arg, value());
    } else if (arg == "--no-verify") {
      args.load.verify_hashes = false;
    } else if (arg == "--no-cuda-graphs") {
      args.load.cuda_graphs = false;
    } else if (arg == "--ids" || arg == "--json") {
      args.print_ids = true;
    } else if (arg == "--logprobs") {
      cfg.logprobs = parse_number<int64_t>(arg, value());
    } else if (arg.starts_with("-") || !args.package.empty()) {
      throw UsageError("unexpected argument: " + std::string(arg));
    } else {
      args.package = arg;
    }
  }
  if (args.package.empty()) throw UsageError("give the package directory");
  if (tree.best_first && !use_tree) {
    throw BadValue("--best-first shapes a token tree: add --draft-parallel N");
  }
  if (use_tree) cfg.tree = tree;
  using aotgen::Speculative;
  cfg.speculative = draft    ? (lookup ? Speculative::DraftNgram : Speculative::Draft)
                    : lookup ? Speculative::Ngram
                             : Speculative::None;
  const int prompts = args.chat.has_value() + args.prompt.has_value() +
                      args.prompt_file.has_value() + args.prompt_ids.has_value() +
                      args.interactive;
  if (prompts != 1) {
    throw UsageError(
        "give exactly one of --chat, --prompt, --prompt-file, --prompt-ids, --interactive");
  }
  if (args.suffix && !args.prompt && !args.prompt_file) {
    throw UsageError("--suffix goes with --prompt or --prompt-file (the text before it)");
  }
  if (args.system && !args.chat && !args.interactive) {
    throw UsageError("--system goes with --chat or --interactive");
  }
  if (args.template_kwargs && !args.chat && !args.interactive) {
    throw UsageError("--chat-template-kwargs goes with --chat or --interactive");
  }
  if (args.template_kwargs) {
    try {
      aotgen::check_template_kwargs(*args.template_kwargs);
    } catch (const std::invalid_argument& e) {
      throw BadValue(std::string("--chat-template-kwargs ") + e.what());
    }
  }
  return args;
}

// --lookup-cache goes with --lookup ngram and names a writable file (aotgen/cli/common.py).
void check_lookup_cache(const std::filesystem::path& path, aotgen::Speculative mode) {
  if (mode != aotgen::Speculative::Ngram && mode != aotgen::Speculative::DraftNgram) {
    throw BadValue("--lookup-cache holds what --lookup ngram drafts from: add --lookup ngram");
  }
  const auto dir = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
  if (std::filesystem::is_directory(path) || !std::filesystem::is_directory(dir) ||
      access(dir.c_str(), W_OK) != 0) {
    throw BadValue("--lookup-cache " + path.string() +
                   ": give a file in an existing, writable directory (it is written back at "
                   "exit)");
  }
}

// Range checks, after parsing so that a malformed command line is reported as such first.
void check_values(Args& args) {
  auto& cfg = args.config;
  at_least("--max-new-tokens", cfg.max_new_tokens);
  if (cfg.logprobs && (*cfg.logprobs < 0 || *cfg.logprobs > 20)) {
    throw BadValue("--logprobs must be in 0..20, got " + std::to_string(*cfg.logprobs));
  }
  if (cfg.logprobs && !args.print_ids) {
    throw BadValue("--logprobs N goes with --json, which prints them");
  }
  if (cfg.reasoning_budget && *cfg.reasoning_budget < 0) {
    throw BadValue("--reasoning-budget must be >= 0 (tokens of reasoning), got " +
                   std::to_string(*cfg.reasoning_budget));
  }
  if (args.budget_message && !cfg.reasoning_budget) {
    throw BadValue("--reasoning-budget-message goes with --reasoning-budget N");
  }
  if (cfg.k) at_least("--k", *cfg.k);
  if (cfg.ngram_min) at_least("--ngram-min", *cfg.ngram_min);
  at_least("--ngram-max", cfg.ngram_max);
  if (cfg.tree) {
    at_least("--draft-parallel", cfg.tree->n_parallel);
    if (cfg.tree->p_split < 0 || cfg.tree->p_split > 1) throw BadValue("--p-split must be in 0..1");
  }
  if (cfg.ngram_min && *cfg.ngram_min > cfg.ngram_max) {
    throw BadValue("--ngram-min (" + std::to_string(*cfg.ngram_min) +
                   ") must be <= --ngram-max (" + std::to_string(cfg.ngram_max) +
                   "); the lookup tries matches from ngram-max tokens down to ngram-min");
  }
  if (args.lookup_cache) check_lookup_cache(*args.lookup_cache, cfg.speculative);
  if (args.threads) {
    at_least("--threads", *args.threads);
    args.load.threads = *args.threads;
  }
  cfg.sampling.validate();
}

std::vector<int64_t> prompt_ids(Args& args, const aotgen::Engine& engine) {
  if (args.chat) return engine.chat_ids(*args.chat, args.system);
  if (args.suffix) {  // fill in the middle; its answer ends at the FIM end tokens too
    const int64_t room = engine.max_seq_len() - args.config.max_new_tokens;
    aotgen::Infill infill = engine.infill(*args.prompt, *args.suffix, room);
    auto& stops = args.config.stop_token_ids;
    stops.insert(stops.end(), infill.end_ids.begin(), infill.end_ids.end());
    return std::move(infill.prompt_ids);
  }
  if (args.prompt) return engine.prompt_ids(*args.prompt);
  try {
    return json::parse(*args.prompt_ids).get<std::vector<int64_t>>();
  } catch (const json::exception&) {
    throw UsageError("--prompt-ids: expected a JSON array of token ids");
  }
}

void write(std::FILE* file, std::string_view text) {
  std::fwrite(text.data(), 1, text.size(), file);
  std::fflush(file);
}

// The answer streamed on stdout; a chat answer's reasoning (a harmony `head` or `thinking`
// set) on stderr before it, dimmed on a terminal, so that stdout holds the answer alone
// (aotgen/cli/run.py _Printer).
class Printer {
 public:
  Printer(std::optional<bool> thinking, const std::optional<std::string>& head) {
    if (head) {
      harmony_.emplace(*head);
    } else if (thinking) {
      reasoning_.emplace(*thinking);
    }
  }
  void feed(std::string_view piece) {
    if (harmony_) return show(harmony_->feed(piece));
    if (reasoning_) return show(reasoning_->feed(piece));
    show({"", std::string(piece)});
  }
  void finish() {
    if (harmony_) show(harmony_->finish());
    if (reasoning_) show(reasoning_->finish());
    if (reasoned_ && !answered_) write(stderr, "\n");  // the stats start a line of their own
    write(stdout, "\n");
  }

 private:
  void show(const std::pair<std::string, std::string>& deltas) {
    const auto& [reasoning, content] = deltas;
    if (!reasoning.empty()) {
      write(stderr, dim_ ? "\x1b[2m" + reasoning + "\x1b[0m" : reasoning);
      reasoned_ = true;
    }
    if (!content.empty()) {
      if (reasoned_ && !answered_) write(stderr, "\n");  // the reasoning ends its line
      answered_ = true;
      write(stdout, content);
    }
  }

  std::optional<aotgen::HarmonyStream> harmony_;
  std::optional<aotgen::ReasoningStream> reasoning_;
  bool dim_ = isatty(fileno(stderr));
  bool reasoned_ = false, answered_ = false;
};

// Generates from ids: the text streamed (or one JSON object), then the stats on stderr. A
// chat answer's reasoning (`<think>`, reasoning.h; gpt-oss's analysis channel, harmony.h)
// comes apart from the answer, on stderr and in the JSON. `since` is when the command started
// or the turn's message arrived. Returns the answer without its reasoning.
std::string answer(aotgen::Engine& engine, const std::vector<int64_t>& ids, const Args& args,
                   bool chat, Clock::time_point since) {
  const auto t_generate = Clock::now();
  std::optional<bool> thinking;
  std::optional<std::string> head;
  if (chat) {
    thinking = engine.thinking(ids);
    head = engine.harmony_head(ids);
  }
  std::optional<Printer> printer;
  aotgen::TextCallback stream;
  if (!args.print_ids) {
    stream = [&printer = printer.emplace(thinking, head)](std::string_view text) {
      printer.feed(text);
    };
  }
  const auto result = engine.generate(ids, args.config, stream);
  const double to_first_token =
      std::chrono::duration<double>(t_generate - since).count() + result.prefill_s;
  // As aotgen/cli/run.py _answer: harmony first, then `<think>` (reasoning a string, not null).
  auto split = aotgen::split_answer(result.text, thinking);
  if (head) {
    auto whole = aotgen::split_harmony(result.text, *head);
    split = {std::move(whole.reasoning), std::move(whole.content)};
  }

  if (args.print_ids) {
    json out = {{"prompt_ids", ids},
                {"ids", result.token_ids},
                {"text", result.text},
                {"reasoning", split.reasoning ? json(*split.reasoning) : json(nullptr)},
                {"content", split.content},
                {"finish_reason", result.finish_reason},
                {"stop_reason", stop_reason_json(result)},
                {"cached_tokens", result.cached_tokens},
                {"load_s", engine.load_s()},
                {"load_to_first_token_s", to_first_token},
                {"prefill_s", result.prefill_s},
                {"decode_tok_s", result.decode_tok_s()},
                {"spec", nullptr}};
    if (result.spec) {
      out["spec"] = {{"drafted", result.spec->drafted},
                     {"accepted", result.spec->accepted},
                     {"steps", result.spec->steps},
                     {"lookup_steps", result.spec->lookup_steps},
                     {"tree_nodes", result.spec->tree_nodes},
                     {"branch_steps", result.spec->branch_steps}};
    }
    out["logprobs"] = logprobs_json(result.logprobs);
    std::cout << out.dump(-1, ' ', false, json::error_handler_t::replace) << std::endl;
  } else {
    printer->finish();
  }
  std::fprintf(stderr,
               "load %.2f s · prompt %lld tok (%lld in the cache), first token %.3f s · "
               "load-to-first-token %.2f s · %zu tok, decode %.1f tok/s · finish: %s\n",
               engine.load_s(), static_cast<long long>(result.prompt_tokens),
               static_cast<long long>(result.cached_tokens), result.prefill_s, to_first_token,
               result.token_ids.size(), result.decode_tok_s(), result.finish_reason.c_str());
  if (const auto& s = result.spec) {
    std::fprintf(stderr,
                 "speculative (%s): drafted %lld, accepted %lld, acceptance %.2f, mean accepted "
                 "length %.2f tok/step, n-gram proposed %lld of %lld steps\n",
                 mode_name(args.config.speculative), static_cast<long long>(s->drafted),
                 static_cast<long long>(s->accepted), s->acceptance_rate(),
                 s->mean_accepted_length(), static_cast<long long>(s->lookup_steps),
                 static_cast<long long>(s->steps));
  }
  return std::move(split.content);
}

int run(Args args) {
  const auto t_start = Clock::now();
  check_values(args);
  if (args.prompt_file) {  // read before loading, so a bad file fails fast
    args.prompt = read_prompt_file(*args.prompt_file);
    args.prompt_file.reset();
  }
  warn_if_oversubscribed(args.load.threads);
  auto engine = aotgen::Engine::load(args.package, args.load);
  if (args.model_sampling) {
    take_model_sampling(engine.model_sampling(), args.sampling_given, args.config);
  }
  if (args.template_kwargs) engine.set_chat_template_kwargs(*args.template_kwargs);
  if (args.lookup_cache) {
    engine.set_lookup_cache(std::make_shared<aotgen::LookupCache>(
        aotgen::LookupCache::open(*args.lookup_cache, engine.vocab_size())));
  }
  const auto save_lookup_cache = [&] {
    if (args.lookup_cache) engine.lookup_cache()->save(*args.lookup_cache);
  };
  if (!args.interactive) {
    answer(engine, prompt_ids(args, engine), args, args.chat.has_value(), t_start);
    save_lookup_cache();
    return 0;
  }
  // The whole conversation is each turn's prompt, as a chat client sends it; the engine runs
  // only what its KV cache does not hold yet. A conversation that outgrows the context (with
  // max_new_tokens of room) loses its oldest turns (aotgen/cli/run.py _converse).
  std::vector<aotgen::ChatMessage> messages;
  if (args.system) messages.emplace_back("system", *args.system);
  const std::ptrdiff_t oldest = args.system ? 1 : 0;  // the first message a turn may drop
  // The first turn's wait includes the load; a later turn's starts when its message arrives.
  bool first = true;
  for (std::string line; std::getline(std::cin, line);) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto since = first ? t_start : Clock::now();
    first = false;
    messages.emplace_back("user", line);
    auto ids = engine.chat_ids(messages);
    while (static_cast<int64_t>(ids.size()) + args.config.max_new_tokens > engine.max_seq_len() &&
           static_cast<std::ptrdiff_t>(messages.size()) > oldest + 1) {
      messages.erase(messages.begin() + oldest, messages.begin() + oldest + 2);
      ids = engine.chat_ids(messages);
    }
    // The answer without its reasoning, as a chat client sends it back.
    messages.emplace_back("assistant", answer(engine, ids, args, true, since));
  }
  save_lookup_cache();
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
    std::cerr << "aotgen-run: " << e.what() << "\n" << kUsage;
    return 2;
  } catch (const BadValue& e) {
    std::cerr << "aotgen-run: error: " << e.what() << "\n";
    return 1;
  }
  try {
    return run(args);
  } catch (const UsageError& e) {
    std::cerr << "aotgen-run: " << e.what() << "\n";
    return 2;
  } catch (const BadValue& e) {
    std::cerr << "aotgen-run: error: " << e.what() << "\n";
    return 1;
  } catch (const c10::Error& e) {  // torch errors: without their C++ backtrace
    std::cerr << "aotgen-run: error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "aotgen-run: error: " << e.what() << "\n";
    return 1;
  }
}
