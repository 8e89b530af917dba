// qkvshare tokenize / logits: machine-readable views of the tokenizer and the
// forward pass, used by the reference tests and for debugging.
#include <nlohmann/json.hpp>

#include <iostream>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/engine.hpp"

namespace qkvshare::cli {

namespace {

struct TokenizeArgs {
  ModelArgs model;
  std::string prompt;
  bool special = false;
};

struct LogitsArgs {
  ModelArgs model;
  std::string ids;
  bool decode = false;
};

void run_tokenize(const TokenizeArgs& a) {
  auto model = load_model(a.model);
  nlohmann::json j;
  j["ids"] = model->tokenizer().encode(a.prompt, a.special);
  std::cout << j.dump() << "\n";
}

void run_logits(const LogitsArgs& a) {
  const std::vector<TokenId> ids = parse_ids(a.ids);
  auto model = load_model(a.model);
  Engine engine(*model, engine_options(a.model));
  auto session = engine.new_session(static_cast<int>(ids.size()));
  const auto vocab = static_cast<std::size_t>(model->config().vocab_size);
  nlohmann::json rows = nlohmann::json::array();
  if (a.decode) {
    for (TokenId id : ids) {
      auto l = engine.forward(*session, std::span<const TokenId>(&id, 1));
      rows.push_back(std::vector<float>(l.begin(), l.end()));
    }
  } else {
    auto l = engine.forward(*session, ids, /*all_logits=*/true);
    for (std::size_t t = 0; t < ids.size(); ++t)
      rows.push_back(std::vector<float>(l.begin() + static_cast<std::ptrdiff_t>(t * vocab),
                                        l.begin() + static_cast<std::ptrdiff_t>((t + 1) * vocab)));
  }
  nlohmann::json j;
  j["ids"] = ids;
  j["logits"] = std::move(rows);
  std::cout << j.dump() << "\n";
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto targs = std::make_shared<TokenizeArgs>();
  CLI::App* tok = app.add_subcommand("tokenize", "Print the token ids of a text as JSON");
  add_model_args(*tok, targs->model);
  tok->add_option("-p,--prompt", targs->prompt, "Text to tokenize")->required();
  tok->add_flag("--parse-special", targs->special, "Turn special-token texts such as <|im_start|> into their ids");
  tok->callback([targs] { run_tokenize(*targs); });

  auto largs = std::make_shared<LogitsArgs>();
  CLI::App* lg = app.add_subcommand("logits", "Print the next-token logits at every position as JSON");
  add_model_args(*lg, largs->model);
  lg->add_option("--ids", largs->ids, "Comma-separated token ids")->required();
  lg->add_flag("--decode", largs->decode, "One forward pass per token instead of one batched prefill");
  lg->callback([largs] { run_logits(*largs); });
}

}  // namespace qkvshare::cli
