// Model (load, tokenizer, chat template) and Engine.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "py_common.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare::py {

namespace {

void check_ids(const Model& model, const std::vector<TokenId>& ids) {
  const int vocab = model.config().vocab_size;
  for (std::size_t i = 0; i < ids.size(); ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      fail(ErrorCode::invalid_argument, "token {} at index {} is outside the vocabulary [0, {})", ids[i], i, vocab);
}

std::string chat_text(const nb::handle& messages, bool add_generation_prompt) {
  std::vector<ChatMessage> turns;
  for (nb::handle item : messages) {
    ChatMessage m;
    const std::string at = "chat message " + std::to_string(turns.size()) + ": ";
    if (nb::isinstance<nb::dict>(item)) {
      nb::dict d = nb::borrow<nb::dict>(item);
      if (!d.contains("role") || !d.contains("content"))
        fail(ErrorCode::invalid_argument, "chat message {}: a dict needs 'role' and 'content'", turns.size());
      m.role = text_value(d["role"], at + "'role'");
      m.content = text_value(d["content"], at + "'content'");
    } else if (nb::isinstance<nb::tuple>(item) && nb::len(item) == 2) {
      m.role = text_value(item[0], at + "'role'");
      m.content = text_value(item[1], at + "'content'");
    } else {
      fail(ErrorCode::invalid_argument, "chat message {}: expected a dict with 'role' and 'content' or a "
           "(role, content) tuple", turns.size());
    }
    turns.push_back(std::move(m));
  }
  return format_chatml(turns, add_generation_prompt);
}

}  // namespace

void bind_model(nb::module_& m) {
  nb::class_<ModelBox>(m, "Model", "A loaded model: weights mapped from the file, tokenizer, configuration.")
      .def_static(
          "load",
          [](const std::string& path, std::optional<std::string> tokenizer) {
            check_path(path, "path");
            if (tokenizer) check_path(*tokenizer, "tokenizer");
            auto box = std::make_shared<ModelBox>();
            box->tokenizer_path = tokenizer.value_or("");
            {
              nb::gil_scoped_release release;
              box->model = Model::load(path, box->tokenizer_path);
              box->fingerprint = model_fingerprint(*box->model);
            }
            return box;
          },
          nb::arg("path"), nb::arg("tokenizer") = nb::none(),
          "Loads a GGUF or llama2.c model (llama2.c needs `tokenizer`, e.g. tok512.bin).")
      .def_prop_ro("path", [](const ModelBox& b) { return b.model->path(); })
      .def_prop_ro("tokenizer_path", [](const ModelBox& b) { return b.tokenizer_path; })
      .def_prop_ro("format", [](const ModelBox& b) { return b.model->format(); })
      .def_prop_ro("name", [](const ModelBox& b) { return b.model->config().name; })
      .def_prop_ro("architecture", [](const ModelBox& b) { return b.model->config().architecture; })
      .def_prop_ro("n_layers", [](const ModelBox& b) { return b.model->config().n_layers; })
      .def_prop_ro("d_model", [](const ModelBox& b) { return b.model->config().d_model; })
      .def_prop_ro("n_heads", [](const ModelBox& b) { return b.model->config().n_heads; })
      .def_prop_ro("n_kv_heads", [](const ModelBox& b) { return b.model->config().n_kv_heads; })
      .def_prop_ro("vocab_size", [](const ModelBox& b) { return b.model->config().vocab_size; })
      .def_prop_ro("context_length", [](const ModelBox& b) { return b.model->config().context_length; })
      .def_prop_ro("bos_id", [](const ModelBox& b) { return b.model->tokenizer().bos_id(); })
      .def_prop_ro("eos_id", [](const ModelBox& b) { return b.model->tokenizer().eos_id(); })
      .def_prop_ro("add_bos", [](const ModelBox& b) { return b.model->tokenizer().add_bos(); },
                   "Whether prompts start with BOS (prefill/generate add it to a session's first prompt).")
      .def_prop_ro("fingerprint", [](const ModelBox& b) { return b.fingerprint.hex(); },
                   "32 hex digits naming the model in descriptors.")
      .def(
          "tokenize",
          [](const ModelBox& b, nb::str text, bool add_bos, bool special) {
            std::vector<TokenId> ids;
            const Tokenizer& tok = b.model->tokenizer();
            if (add_bos && tok.bos_id() >= 0) ids.push_back(tok.bos_id());
            const auto body = tok.encode(text_value(text, "text"), special);
            ids.insert(ids.end(), body.begin(), body.end());
            return ids;
          },
          nb::arg("text"), nb::arg("add_bos") = false, nb::arg("special") = false,
          "Text to token ids. `special`: texts such as <|im_start|> become their ids.")
      .def(
          "detokenize",
          [](const ModelBox& b, const std::vector<TokenId>& ids) {
            check_ids(*b.model, ids);
            const std::string text = b.model->tokenizer().decode(ids);
            return nb::steal<nb::str>(PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "replace"));
          },
          nb::arg("ids"), "Token ids to text (invalid UTF-8 is replaced by U+FFFD).")
      .def(
          "chat_template",
          [](const ModelBox&, nb::handle messages, bool add_generation_prompt) {
            return chat_text(messages, add_generation_prompt);
          },
          nb::arg("messages"), nb::arg("add_generation_prompt") = true,
          "The model's chat format (ChatML) of [{'role':..., 'content':...}, ...]; tokenize it with special=True.")
      .def("__repr__", [](const ModelBox& b) {
        return "<qkvshare.Model " + b.model->config().name + " (" + b.model->format() + ") " + b.model->path() + ">";
      });

  nb::class_<EngineBox>(m, "Engine", "Runs the model's forward pass for any number of sessions.")
      .def(nb::new_([](std::shared_ptr<ModelBox> model, IntArg threads_arg, int max_batch, bool exact_matmul,
                       std::optional<int> token_budget, int max_sessions, bool float_activations) {
             if (!model) fail(ErrorCode::invalid_argument, "Engine: model is None");
             const int threads = threads_value(threads_arg, "Engine: threads");
             if (max_batch < 1) fail(ErrorCode::invalid_argument, "Engine: max_batch must be >= 1, got {}", max_batch);
             if (token_budget && (*token_budget < 1 || *token_budget > max_batch))
               fail(ErrorCode::invalid_argument, "Engine: token_budget must be in [1, max_batch={}], got {}", max_batch,
                    *token_budget);
             if (max_sessions < 0)
               fail(ErrorCode::invalid_argument, "Engine: max_sessions must be >= 0, got {}", max_sessions);
             if (exact_matmul && float_activations)
               fail(ErrorCode::invalid_argument, "Engine: exact_matmul and float_activations: choose one");
             auto box = std::make_shared<EngineBox>();
             box->model = std::move(model);
             EngineOptions o;
             o.n_threads = threads;
             o.max_batch = max_batch;
             o.exact_matmul = exact_matmul;
             o.float_activations = float_activations;
             nb::gil_scoped_release release;
             box->engine = std::make_unique<Engine>(*box->model->model, o);
             SchedulerOptions so;
             so.token_budget = token_budget.value_or(max_batch);
             so.max_sessions = max_sessions;
             box->scheduler = std::make_unique<Scheduler>(*box->engine, so);
             return box;
           }),
           nb::arg("model"), nb::arg("threads") = 0, nb::arg("max_batch") = 256, nb::arg("exact_matmul") = false,
           nb::arg("token_budget") = nb::none(), nb::arg("max_sessions") = 0, nb::arg("float_activations") = false,
           "threads=0: all hardware threads. exact_matmul: float activations (slow; for reference checks). "
           "float_activations: the SIMD kernels with float activations (weights dequantized to f32 once, 4 bytes "
           "per weight: float_copy_bytes). "
           "The step API's scheduler: token_budget, tokens per forward pass (default max_batch; a long prompt "
           "is chunked so decoding sessions keep their pace); max_sessions, requests per pass (0: no limit). "
           "Under either limit, requests with a higher `priority` run first.")
      .def_prop_ro("model", [](const EngineBox& e) { return e.model; })
      .def_prop_ro("float_copy_bytes", [](const EngineBox& e) { return e.engine->float_copy_bytes(); },
                   "Bytes of the f32 weight copies float_activations made (0 otherwise).")
      .def_prop_ro("threads", [](EngineBox& e) { return e.engine->pool().size(); });
}

}  // namespace qkvshare::py
