// Loads an aotgen package and answers one chat question greedily.
//
//   aotgen-embed PACKAGE_DIR "What is the capital of France?"
#include <exception>
#include <iostream>

#include <aotgen/aotgen.h>

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: " << argv[0] << " PACKAGE_DIR QUESTION\n";
    return 2;
  }
  try {
    auto engine = aotgen::Engine::load(argv[1]);

    aotgen::GenerationConfig config;  // greedy: sampling.temperature is 0 by default
    config.max_new_tokens = 256;
    const auto result =
        engine.generate(engine.chat_ids(argv[2]), config,
                        [](std::string_view text) { std::cout << text << std::flush; });

    std::cout << std::endl;  // the answer's line, before the stats on stderr
    std::cerr << result.token_ids.size() << " tokens, " << result.decode_tok_s()
              << " tok/s, finish: " << result.finish_reason << "\n";
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
