// qkvshare generate: stream a continuation (or a chat reply) to stdout;
// load time and speeds go to stderr.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <iostream>
#include <optional>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "share_cli.hpp"

namespace qkvshare::cli {

namespace {

struct GenerateArgs {
  ModelArgs model;
  std::string prompt;
  int n_new = 128;
  SamplingParams sampling;
  bool chat = false;
  std::string chat_template;  // a family name; empty: the model's own
  bool no_think = false;
  std::optional<std::string> system;
  std::vector<std::string> stops;
  bool ignore_eos = false;
  bool json = false;
  int ctx = 0;
  ShareArgs share;  // --pool, --publish, --from (share_cli.hpp)
};

void run_generate(const GenerateArgs& a) {
  a.sampling.validate();
  auto model = load_model(a.model);
  const Tokenizer& tok = model->tokenizer();
  std::vector<TokenId> prompt;
  const bool chat = a.chat || !a.chat_template.empty();
  std::optional<ChatTemplate> tmpl;
  if (chat) {
    tmpl = model->chat_template(a.chat_template, !a.no_think);
    // Without --system, the default system message of the model's own template (SmolLM2, Qwen2.5 have one).
    const std::string system =
        a.system.value_or(template_default_system(model->chat_template_source()).value_or(""));
    std::vector<ChatMessage> messages;
    if (!system.empty()) messages.push_back({"system", system});
    messages.push_back({"user", a.prompt});
    prompt = encode_prompt(tok, tmpl->format(messages, true), /*special=*/true);
  } else {
    prompt = encode_prompt(tok, a.prompt, /*special=*/false);
  }
  if (prompt.empty()) fail(ErrorCode::invalid_argument, "-p: the prompt is empty and the model adds no BOS token");

  Engine engine(*model, engine_options(a.model));
  ShareRun share(a.share, *model, engine, a.ctx);
  prompt = share.prompt(tok, a.prompt, tmpl ? &*tmpl : nullptr, prompt);
  auto session = share.session(engine, a.ctx);
  GenerateOptions opts;
  opts.max_new_tokens = a.n_new;
  opts.sampling = a.sampling;
  opts.stop_strings = a.stops;
  opts.stop_at_end_of_generation = !a.ignore_eos;

  std::function<void(std::string_view)> sink;
  if (!a.json) {
    std::fputs(a.prompt.c_str(), stdout);
    if (chat) std::fputc('\n', stdout);
    std::fflush(stdout);
    sink = [](std::string_view s) {
      std::fwrite(s.data(), 1, s.size(), stdout);
      std::fflush(stdout);
    };
  }
  const GenerateResult r = generate(engine, *session, prompt, opts, sink);
  share.finish(engine, *session, r);
  if (a.json) {
    nlohmann::json j;
    j["prompt_ids"] = prompt;
    j["generated_ids"] = r.tokens;
    j["text"] = r.text;
    j["stop_reason"] = to_string(r.stop_reason);
    j["prefill_seconds"] = r.prefill_seconds;
    j["decode_seconds"] = r.decode_seconds;
    if (share.active()) j["share"] = share.json();
    std::cout << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  } else {
    std::fputc('\n', stdout);
  }
  std::fprintf(stderr, "prefill: %d tokens in %.3f s (%.1f tokens/s) | decode: %d tokens in %.3f s (%.1f tokens/s) | stop: %s\n",
               r.prefill_tokens, r.prefill_seconds, r.prefill_tokens / std::max(r.prefill_seconds, 1e-9),
               r.decode_tokens, r.decode_seconds, r.decode_tokens / std::max(r.decode_seconds, 1e-9),
               std::string(to_string(r.stop_reason)).c_str());
  if (r.stop_reason == StopReason::context_full)
    std::fprintf(stderr, "warning: generation stopped at the context length (%d tokens)\n", session->n_past());
}

}  // namespace

void register_generate(CLI::App& app) {
  auto args = std::make_shared<GenerateArgs>();
  CLI::App* cmd = app.add_subcommand("generate", "Generate text from a prompt");
  add_model_args(*cmd, args->model);
  cmd->add_option("-p,--prompt", args->prompt, "Prompt text")->required();
  cmd->add_option("-n,--new-tokens", args->n_new, "Maximum new tokens")->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--temp", args->sampling.temperature, "Temperature (0: greedy)");
  cmd->add_option("--top-k", args->sampling.top_k, "Top-k (0: off)");
  cmd->add_option("--top-p", args->sampling.top_p, "Top-p (1: off)");
  cmd->add_option("--min-p", args->sampling.min_p, "Min-p (0: off)");
  cmd->add_option("--repeat-penalty", args->sampling.repeat_penalty, "Repetition penalty (1: off)");
  cmd->add_option("--repeat-last-n", args->sampling.repeat_last_n, "Tokens the penalty looks back over");
  cmd->add_option("--seed", args->sampling.seed, "Random seed")->check(seed_validator());
  cmd->add_flag("--chat", args->chat, "Format the prompt as a user turn of the model's own chat template");
  cmd->add_option("--chat-template", args->chat_template,
                  "Chat template family instead of the model's (chatml, qwen3, llama3, gemma, phi3, mistral, plain); "
                  "implies --chat");
  cmd->add_flag("--no-think", args->no_think, "Qwen3: answer without a reasoning block");
  cmd->add_option("--system", args->system, "System message for --chat (default: the one the model's template inserts, if any)");
  cmd->add_option("--stop", args->stops, "Stop string (repeatable)");
  cmd->add_flag("--ignore-eos", args->ignore_eos, "Do not stop at end-of-generation tokens");
  cmd->add_option("--ctx", args->ctx, "Context size in tokens (0: the model's)")->check(CLI::Range(0, 1 << 22));
  cmd->add_flag("--json", args->json, "Print one JSON object (ids, text, timings) instead of streaming");
  add_share_args(*cmd, args->share);
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace qkvshare::cli
