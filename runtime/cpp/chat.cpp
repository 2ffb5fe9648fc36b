#include "chat.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include <minja/minja.hpp>

#include "harmony.h"
#include "reasoning.h"

namespace aotgen {
namespace {

namespace fs = std::filesystem;
using ordered_json = nlohmann::ordered_json;

// tokenizer_config stores special tokens as a string or as an AddedToken object.
std::string token_text(const ordered_json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string()) {
    return value["content"].get<std::string>();
  }
  return "";
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path.string());
  return {std::istreambuf_iterator<char>(in), {}};
}

// Python's datetime.now().strftime(fmt), which Llama 3.x templates call for today's date.
minja::Value strftime_now() {
  return minja::Value::callable(
      [](const std::shared_ptr<minja::Context>&, minja::ArgumentsValue& args) {
        args.expectArgs("strftime_now", {1, 1}, {0, 0});
        const std::time_t now = std::chrono::system_clock::to_time_t(
            std::chrono::system_clock::now());
        std::tm local{};
        localtime_r(&now, &local);
        std::ostringstream out;
        out << std::put_time(&local, args.args[0].get<std::string>().c_str());
        return minja::Value(out.str());
      });
}

// minja's messages go on with the template's source around the fault: the first line says it.
std::string first_line(std::string_view message) {
  return std::string(message.substr(0, message.find('\n')));
}

// Placeholders for message content while the template renders (private-use characters
// U+E000, U+E001: tokenizer.py's _MARK_OPEN / _MARK_CLOSE).
constexpr std::string_view kMarkOpen = "\xEE\x80\x80";
constexpr std::string_view kMarkClose = "\xEE\x80\x81";

}  // namespace

struct ChatTemplate::Impl {
  std::string source, bos_token, eos_token;
  std::shared_ptr<minja::TemplateNode> root;
  std::string parse_error;
};

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::move(source);
  impl->bos_token = std::move(bos_token);
  impl->eos_token = std::move(eos_token);
  try {
    // The environment transformers renders chat templates in.
    impl->root = minja::Parser::parse(
        impl->source, {.trim_blocks = true, .lstrip_blocks = true, .keep_trailing_newline = false});
  } catch (const std::exception& e) {
    impl->parse_error = first_line(e.what());
  }
  impl_ = std::move(impl);
}

std::optional<ChatTemplate> ChatTemplate::from_dir(const fs::path& dir) {
  ordered_json config = ordered_json::object();
  if (fs::is_regular_file(dir / "tokenizer_config.json")) {
    try {
      config = ordered_json::parse(read_text(dir / "tokenizer_config.json"));
    } catch (const ordered_json::exception& e) {
      throw std::runtime_error((dir / "tokenizer_config.json").string() +
                               " is not valid JSON: " + e.what());
    }
  }
  std::optional<std::string> source;
  const ordered_json& value = config.contains("chat_template") ? config["chat_template"]
                                                                : ordered_json();
  if (value.is_string()) {
    source = value.get<std::string>();
  } else if (value.is_array()) {  // named templates: [{"name", "template"}]
    for (const auto& t : value) {
      if (t.is_object() && t.value("name", "") == "default") source = t.value("template", "");
    }
  }
  if (fs::is_regular_file(dir / "chat_template.json")) {  // a vision-language model's
    ordered_json processor;
    try {
      processor = ordered_json::parse(read_text(dir / "chat_template.json"));
    } catch (const ordered_json::exception& e) {
      throw std::runtime_error((dir / "chat_template.json").string() +
                               " is not valid JSON: " + e.what());
    }
    if (processor.is_object() && processor.value("chat_template", ordered_json()).is_string()) {
      source = processor["chat_template"].get<std::string>();
    }
  }
  if (fs::is_regular_file(dir / "chat_template.jinja")) {
    source = read_text(dir / "chat_template.jinja");
  }
  if (!source) return std::nullopt;
  return ChatTemplate(*source, token_text(config.value("bos_token", ordered_json())),
                      token_text(config.value("eos_token", ordered_json())));
}

namespace {

// `kwargs` (a JSON object's text, or empty) as template variables, checked.
ordered_json template_variables(const std::string& kwargs) {
  if (kwargs.empty()) return ordered_json::object();
  ordered_json object;
  try {
    object = ordered_json::parse(kwargs);
  } catch (const std::exception& e) {
    throw std::invalid_argument("is not JSON (" + first_line(e.what()) + ")");
  }
  if (!object.is_object()) throw std::invalid_argument("must be a JSON object");
  for (const char* name : {"messages", "add_generation_prompt", "bos_token", "eos_token"}) {
    if (object.contains(name)) {
      throw std::invalid_argument(std::string("sets '") + name +
                                  "', which the chat itself gives the template");
    }
  }
  return object;
}

}  // namespace

void check_template_kwargs(const std::string& kwargs) { template_variables(kwargs); }

std::string ChatTemplate::render(const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, const std::string& kwargs) const {
  if (!impl_->root) {
    throw std::runtime_error("the chat template does not parse in the C++ runtime (" +
                             impl_->parse_error + "): format the prompt yourself");
  }
  ordered_json list = ordered_json::array();
  for (const auto& [role, content] : messages) {
    list.push_back({{"role", role}, {"content", content}});
  }
  ordered_json variables = template_variables(kwargs);
  variables["messages"] = std::move(list);
  variables["add_generation_prompt"] = add_generation_prompt;
  variables["bos_token"] = impl_->bos_token;
  variables["eos_token"] = impl_->eos_token;
  auto context = minja::Context::make(minja::Value(std::move(variables)));
  context->set("strftime_now", strftime_now());
  try {
    return impl_->root->render(context);
  } catch (const std::exception& e) {
    throw std::runtime_error("the chat template failed: " + first_line(e.what()));
  }
}

bool ChatTemplate::is_chatml() const {
  return impl_->source.find("<|im_start|>") != std::string::npos;
}

bool ChatTemplate::takes_reasoning() const { return aotgen::takes_reasoning(impl_->source); }

bool ChatTemplate::takes_harmony() const { return aotgen::takes_harmony(impl_->source); }

std::string chat_prompt(const ChatTemplate& tmpl, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::string& kwargs) {
  const bool has_system = !messages.empty() && messages.front().first == "system";
  if (tmpl.is_chatml() && !has_system && template_variables(kwargs).empty()) {
    return chatml_prompt(messages, add_generation_prompt);
  }
  return tmpl.render(messages, add_generation_prompt, kwargs);
}

std::vector<int64_t> encode_chat(const Tokenizer& tok, const ChatTemplate& tmpl,
                                 const std::vector<ChatMessage>& messages,
                                 bool add_generation_prompt, const std::string& kwargs) {
  const bool plain = std::all_of(messages.begin(), messages.end(), [&](const auto& m) {
    return tok.encode(m.second) == tok.encode(m.second, /*parse_special=*/false);
  });
  if (plain) return tok.encode(chat_prompt(tmpl, messages, add_generation_prompt, kwargs));
  // Render with a placeholder for each message's content, then encode the template's text
  // (its special tokens are real) and each content (as text) separately.
  std::vector<ChatMessage> marked;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    marked.emplace_back(messages[i].first,
                        std::string(kMarkOpen) + std::to_string(i) + std::string(kMarkClose));
  }
  const std::string rendered = chat_prompt(tmpl, marked, add_generation_prompt, kwargs);
  std::vector<int64_t> ids;
  const auto append = [&ids](const std::vector<int64_t>& more) {
    ids.insert(ids.end(), more.begin(), more.end());
  };
  std::size_t at = 0;
  while (at < rendered.size()) {
    const std::size_t open = rendered.find(kMarkOpen, at);
    const std::size_t close =
        open == std::string::npos ? open : rendered.find(kMarkClose, open + kMarkOpen.size());
    if (close == std::string::npos) {
      append(tok.encode(std::string_view(rendered).substr(at)));
      break;
    }
    if (open > at) append(tok.encode(std::string_view(rendered).substr(at, open - at)));
    const std::size_t index =
        std::stoul(rendered.substr(open + kMarkOpen.size(), close - open - kMarkOpen.size()));
    append(tok.encode(messages.at(index).second, /*parse_special=*/false));
    at = close + kMarkClose.size();
  }
  return ids;
}

}  // namespace aotgen
