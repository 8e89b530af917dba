// Sessions: prefill, generate, stream (an iterator of text pieces), logits as
// NumPy views; Engine.session() makes them.
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "py_common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/kv/kv_pool.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::py {

namespace {

nb::str utf8(std::string_view s) {
  return nb::steal<nb::str>(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

// Bytes at the end of `s` that start a UTF-8 sequence not complete yet.
std::size_t incomplete_utf8_tail(std::string_view s) {
  for (std::size_t back = 1; back <= 3 && back <= s.size(); ++back) {
    const auto c = static_cast<unsigned char>(s[s.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const std::size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? back : 0;
  }
  return 0;
}

GenerateOptions generate_options(const IntArg& max_tokens, double temperature, const IntArg& top_k, double top_p,
                                 double min_p, double repeat_penalty, const IntArg& repeat_last_n, const IntArg& seed,
                                 std::vector<std::string> stop, bool ignore_eos) {
  GenerateOptions o;
  o.max_new_tokens = int_value(max_tokens, "max_tokens");
  if (o.max_new_tokens < 0)
    fail(ErrorCode::invalid_argument, "max_tokens must be >= 0, got {}", o.max_new_tokens);
  o.sampling.temperature = static_cast<float>(temperature);
  o.sampling.top_k = int_value(top_k, "top_k");
  o.sampling.top_p = static_cast<float>(top_p);
  o.sampling.min_p = static_cast<float>(min_p);
  o.sampling.repeat_penalty = static_cast<float>(repeat_penalty);
  o.sampling.repeat_last_n = int_value(repeat_last_n, "repeat_last_n");
  o.sampling.seed = u64_value(seed, "seed");
  o.sampling.validate();
  o.stop_strings = std::move(stop);
  o.stop_at_end_of_generation = !ignore_eos;
  return o;
}

// The prompt with the pending token of the previous generate in front.
std::vector<TokenId> with_pending(SessionBox& s, const nb::handle& prompt, bool special) {
  const Session& session = s.get();  // a closed session has nothing to read
  std::vector<TokenId> ids;
  if (s.pending) ids.push_back(*s.pending);
  const bool at_start = session.n_past() == 0 && ids.empty();
  const auto body = prompt_ids(*s.engine->model, prompt, at_start, special);
  ids.insert(ids.end(), body.begin(), body.end());
  return ids;
}

// A request of the engine's scheduler on one session (the session is busy
// until finish()). Text the scheduler releases lands in `text`, which the
// callback shares, so a callback running on another caller's step never
// touches a freed object.
struct Job {
  std::shared_ptr<SessionBox> s;
  std::shared_ptr<std::string> text = std::make_shared<std::string>();
  RequestId id = 0;
  int n_past_before = 0, prompt_tokens = 0;
  int n_past_after = 0;  // read when collected: the session may be closed by the time finish() runs
  bool active = false;     // guarded by the GIL: submitted, not finish()ed
  bool collected = false;  // guarded by the engine's mutex: one caller took the result

  // Call with the GIL held (s->use is guarded by it) and the engine's mutex not held.
  void submit(std::vector<TokenId> prompt, const GenerateOptions& o, SessionBox::Use use, int priority = 0) {
    s->get();
    prompt_tokens = static_cast<int>(prompt.size());
    Request r;
    r.prompt = std::move(prompt);
    r.options = o;
    r.priority = priority;
    if (use == SessionBox::Use::stream) r.on_text = [t = text](std::string_view piece) { t->append(piece); };
    {
      nb::gil_scoped_release release;
      std::lock_guard lock(s->engine->mu);
      Session& session = s->locked();  // a close() or another request may have come first
      n_past_before = session.n_past();
      r.session = &session;
      id = s->engine->scheduler->submit(std::move(r));
      s->queued = true;
    }
    s->pending.reset();  // it is the prompt's first token now
    s->use = use;
    active = true;
  }
  // With the engine's mutex held: the result, if the request has finished.
  std::optional<RequestResult> poll() {
    EngineBox& e = *s->engine;
    for (RequestResult& r : e.scheduler->take_finished()) e.finished.emplace(r.id, std::move(r));
    auto it = e.finished.find(id);
    if (it == e.finished.end()) return std::nullopt;
    RequestResult r = std::move(it->second);
    e.finished.erase(it);
    collected = true;
    s->queued = false;
    n_past_after = s->session->n_past();
    return r;
  }
  // With the GIL held: the session is free again; the last sampled token is
  // pending when no pass ran for it.
  void finish(const RequestResult& r) {
    active = false;
    s->use = SessionBox::Use::idle;
    s->logits.reset();  // the logits of prefill() no longer describe the session
    const int fed = n_past_after - n_past_before - prompt_tokens;
    const auto& t = r.generation.tokens;
    if (static_cast<int>(t.size()) > fed && !t.empty()) s->pending = t.back();
  }
};

// Steps the engine's scheduler (one forward pass for every request of this
// engine) until `job` finishes. Call without the GIL. Nothing when another
// caller collected the result first (a stream's next() in another thread).
std::optional<RequestResult> run_until_done(Job& job) {
  EngineBox& e = *job.s->engine;
  for (;;) {
    std::lock_guard lock(e.mu);
    if (job.collected) return std::nullopt;
    if (auto r = job.poll()) return r;
    const bool ran = e.scheduler->step();
    if (auto r = job.poll()) return r;
    if (!ran) fail(ErrorCode::internal, "request {} is neither running nor finished", job.id);
  }
}

// run_until_done() for a job no other thread can see.
RequestResult wait(Job& job) {
  if (auto r = run_until_done(job)) return std::move(*r);
  fail(ErrorCode::internal, "request {} was collected by another caller", job.id);
}

class Stream {
 public:
  Stream(std::shared_ptr<SessionBox> s, std::vector<TokenId> prompt, const GenerateOptions& o, int priority) {
    job_.s = std::move(s);
    job_.submit(std::move(prompt), o, SessionBox::Use::stream, priority);
  }
  ~Stream() {
    try {
      close();
    } catch (...) {
      // A destructor must not throw; the request ended either way.
    }
  }

  nb::str next() {
    std::string out;
    std::optional<RequestResult> done;
    {
      nb::gil_scoped_release release;
      EngineBox& e = *job_.s->engine;
      std::lock_guard lock(e.mu);
      std::string& text = *job_.text;
      while (!job_.collected) {
        done = job_.poll();
        if (done) break;
        if (text.size() > incomplete_utf8_tail(text)) break;
        e.scheduler->step();
      }
      const std::size_t keep = job_.collected ? 0 : incomplete_utf8_tail(text);
      out = text.substr(0, text.size() - keep);
      text.erase(0, text.size() - keep);
    }
    if (done) {
      job_.finish(*done);
      result_ = done->generation;
      if (done->error) throw *done->error;
    }
    if (out.empty()) throw nb::stop_iteration();
    return utf8(out);
  }

  // Ends the stream now (the tokens generated so far stay in the session).
  // A no-op when the stream has ended, also when it just ended in another
  // thread's next(), which then finishes it.
  void close() {
    if (!job_.active) return;
    std::optional<RequestResult> r;
    {
      nb::gil_scoped_release release;
      {
        std::lock_guard lock(job_.s->engine->mu);
        if (job_.collected) return;
        job_.s->engine->scheduler->cancel(job_.id);
      }
      r = run_until_done(job_);
      std::lock_guard lock(job_.s->engine->mu);
      job_.text->clear();  // a closed stream yields nothing more
    }
    if (!r) return;
    job_.finish(*r);
    result_ = r->generation;
  }
  const GenerateResult& result() const { return result_; }
  bool done() const noexcept { return !job_.active; }

 private:
  Job job_;
  GenerateResult result_;
};

}  // namespace

namespace {
[[noreturn]] void fail_busy() {
  fail(ErrorCode::invalid_argument,
       "the session is busy with another request (a generate() or stream() in another thread)");
}
}  // namespace

Session& SessionBox::get() {
  if (!session) fail(ErrorCode::invalid_argument, "the session is closed");
  if (use == Use::stream)
    fail(ErrorCode::invalid_argument, "the session has a stream in progress: finish the iterator or call its close()");
  if (use == Use::generate) fail_busy();
  return *session;
}

namespace {
// Reads the session under the engine's mutex, the GIL released while it
// waits: another thread's prefill() or a scheduler step may be writing it.
template <typename F>
auto read_session(SessionBox& s, F read) {
  if (!s.session) fail(ErrorCode::invalid_argument, "the session is closed");
  nb::gil_scoped_release release;
  std::lock_guard lock(s.engine->mu);
  if (!s.session) fail(ErrorCode::invalid_argument, "the session is closed");  // closed while we waited
  return read(*s.session);
}
}  // namespace

Session& SessionBox::locked() {
  if (!session) fail(ErrorCode::invalid_argument, "the session is closed");
  if (queued) fail_busy();
  return *session;
}

std::vector<TokenId> prompt_ids(const ModelBox& model, const nb::handle& prompt, bool at_start, bool special) {
  std::vector<TokenId> ids;
  const Tokenizer& tok = model.model->tokenizer();
  if (nb::isinstance<nb::str>(prompt)) {
    if (at_start && tok.add_bos()) ids.push_back(tok.bos_id());
    const auto body = tok.encode(text_value(prompt, "prompt"), special);
    ids.insert(ids.end(), body.begin(), body.end());
  } else if (nb::isinstance<nb::sequence>(prompt) && !nb::isinstance<nb::bytes>(prompt)) {
    const int vocab = model.model->config().vocab_size;
    for (nb::handle item : prompt) {
      if (!nb::isinstance<nb::int_>(item))
        throw nb::type_error("prompt: expected a str or a sequence of int token ids");
      int overflow = 0;  // beyond a long long: outside the vocabulary too
      const long long v = PyLong_AsLongLongAndOverflow(item.ptr(), &overflow);
      if (overflow != 0 || v < 0 || v >= vocab)
        fail(ErrorCode::invalid_argument, "prompt: token {} at index {} is outside the vocabulary [0, {})",
             nb::str(item).c_str(), ids.size(), vocab);
      ids.push_back(static_cast<TokenId>(v));
    }
  } else {
    throw nb::type_error("prompt: expected a str or a sequence of int token ids");
  }
  if (ids.empty() && !at_start) return ids;
  if (ids.empty()) fail(ErrorCode::invalid_argument, "prompt: it has no tokens");
  return ids;
}

void store_logits(SessionBox& s, std::span<const float> logits, int rows) {
  s.logits = std::make_shared<std::vector<float>>(logits.begin(), logits.end());
  s.logits_rows = rows;
}

nb::object logits_view(const std::shared_ptr<SessionBox>& s) {
  if (!s->logits || s->logits->empty()) return nb::none();
  const std::size_t vocab = static_cast<std::size_t>(s->engine->model->model->config().vocab_size);
  auto* keep = new std::shared_ptr<std::vector<float>>(s->logits);
  nb::capsule owner(keep, [](void* p) noexcept { delete static_cast<std::shared_ptr<std::vector<float>>*>(p); });
  const float* data = (*keep)->data();
  if (s->logits_rows <= 1) {
    const std::size_t shape[1] = {vocab};
    return nb::cast(nb::ndarray<nb::numpy, const float, nb::ndim<1>>(data, 1, shape, owner));
  }
  const std::size_t shape[2] = {static_cast<std::size_t>(s->logits_rows), vocab};
  return nb::cast(nb::ndarray<nb::numpy, const float, nb::ndim<2>>(data, 2, shape, owner));
}

std::unique_ptr<Session> make_session(EngineBox& e, const std::shared_ptr<SharePool>& pool, const std::string& kv,
                                      int capacity) {
  const Engine& engine = *e.engine;
  const int ctx = engine.model().config().context_length;
  if (capacity < 0 || capacity > ctx)
    fail(ErrorCode::invalid_argument, "capacity {} is outside [0, {}] (0: the model's context length)", capacity, ctx);
  if (capacity == 0) capacity = ctx;
  if (kv == "dense") {
    if (pool) fail(ErrorCode::invalid_argument, "kv='dense' is a private f32 cache; it cannot live in a pool");
    return engine.new_session(capacity);
  }
  const KvFormat format = KvFormat::parse(kv);
  if (pool) return new_pooled_session(*pool, engine, format, capacity);
  const KvShape shape = engine.kv_shape();
  PoolConfig pc;
  pc.shape = shape;
  format.validate(shape, pc.block_tokens);
  pc.capacity_bytes = KvPool::arena_bytes_for(shape, pc.block_tokens, format, capacity);
  return std::make_unique<Session>(std::make_unique<PooledKvCache>(KvPool::create(pc), format, capacity));
}

void bind_session(nb::module_& m) {
  nb::class_<GenerateResult>(m, "GenerateResult", "What one generate() or stream() produced.")
      .def_ro("tokens", &GenerateResult::tokens, "Generated ids (an end-of-generation token is not included).")
      .def_prop_ro("text", [](const GenerateResult& r) { return utf8(r.text); })
      .def_prop_ro("stop_reason", [](const GenerateResult& r) { return std::string(to_string(r.stop_reason)); },
                   "max_tokens, end_of_generation, stop_string or context_full.")
      .def_ro("prefill_tokens", &GenerateResult::prefill_tokens)
      .def_ro("decode_tokens", &GenerateResult::decode_tokens)
      .def_ro("prefill_seconds", &GenerateResult::prefill_seconds)
      .def_ro("decode_seconds", &GenerateResult::decode_seconds)
      .def("__repr__", [](const GenerateResult& r) {
        return "<GenerateResult " + std::to_string(r.tokens.size()) + " tokens, " +
               std::string(to_string(r.stop_reason)) + ">";
      });

  nb::class_<Stream>(m, "Stream", "Iterator of text pieces of a generation; see Session.stream().")
      .def("__iter__", [](nb::handle self) { return self; })
      .def("__next__", &Stream::next)
      .def("close", &Stream::close, "Stops generating (cancels the request); the tokens so far stay in the session.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](Stream& s, nb::args) { s.close(); })
      .def_prop_ro("done", &Stream::done)
      .def_prop_ro("result", &Stream::result, nb::rv_policy::copy,
                   "The GenerateResult so far (final once the iterator is exhausted).");

  nb::class_<SessionBox>(m, "Session", "An agent's decoding state: its tokens and their KV cache.")
      .def(
          "prefill",
          [](std::shared_ptr<SessionBox> s, nb::handle prompt, bool all_logits, bool special) {
            std::vector<TokenId> ids = with_pending(*s, prompt, special);
            {
              nb::gil_scoped_release release;
              std::lock_guard lock(s->engine->mu);
              Session& session = s->locked();  // a close() or a request may have come first
              auto logits = s->engine->engine->forward(session, ids, all_logits);
              store_logits(*s, logits, all_logits ? static_cast<int>(ids.size()) : 1);
              s->pending.reset();
            }
            return logits_view(s);
          },
          nb::arg("prompt"), nb::arg("all_logits") = false, nb::arg("special") = false,
          "Feeds a str or token ids; returns the next-token logits (a read-only NumPy view, [vocab], or "
          "[tokens, vocab] with all_logits). A str is encoded with BOS first when the session is empty and "
          "the model adds BOS; `special` parses texts such as <|im_start|>.")
      .def(
          "generate",
          [](std::shared_ptr<SessionBox> s, nb::handle prompt, IntArg max_tokens, double temperature, IntArg top_k,
             double top_p, double min_p, double repeat_penalty, IntArg repeat_last_n, IntArg seed,
             std::vector<std::string> stop, bool ignore_eos, bool special, IntArg priority) {
            s->get();
            const GenerateOptions o = generate_options(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
                                                       repeat_last_n, seed, std::move(stop), ignore_eos);
            const int p = int_value(priority, "priority");
            Job job;
            job.s = s;
            job.submit(with_pending(*s, prompt, special), o, SessionBox::Use::generate, p);
            RequestResult r;
            {
              nb::gil_scoped_release release;
              r = wait(job);
            }
            job.finish(r);
            if (r.error) throw *r.error;
            return r.generation;
          },
          nb::arg("prompt"), nb::arg("max_tokens") = 128, nb::arg("temperature") = 0.8, nb::arg("top_k") = 40,
          nb::arg("top_p") = 0.95, nb::arg("min_p") = 0.05, nb::arg("repeat_penalty") = 1.0,
          nb::arg("repeat_last_n") = 64, nb::arg("seed") = 0, nb::arg("stop") = std::vector<std::string>{},
          nb::arg("ignore_eos") = false, nb::arg("special") = false, nb::arg("priority") = 0,
          "Appends the prompt and generates (blocking); sampling options as the CLI's (temperature 0: greedy). "
          "priority: higher runs first when the engine's token_budget or max_sessions limits a pass.")
      .def(
          "stream",
          [](std::shared_ptr<SessionBox> s, nb::handle prompt, IntArg max_tokens, double temperature, IntArg top_k,
             double top_p, double min_p, double repeat_penalty, IntArg repeat_last_n, IntArg seed,
             std::vector<std::string> stop, bool ignore_eos, bool special, IntArg priority) {
            s->get();
            const GenerateOptions o = generate_options(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
                                                       repeat_last_n, seed, std::move(stop), ignore_eos);
            const int p = int_value(priority, "priority");
            std::vector<TokenId> ids = with_pending(*s, prompt, special);
            return new Stream(s, std::move(ids), o, p);
          },
          nb::arg("prompt"), nb::arg("max_tokens") = 128, nb::arg("temperature") = 0.8, nb::arg("top_k") = 40,
          nb::arg("top_p") = 0.95, nb::arg("min_p") = 0.05, nb::arg("repeat_penalty") = 1.0,
          nb::arg("repeat_last_n") = 64, nb::arg("seed") = 0, nb::arg("stop") = std::vector<std::string>{},
          nb::arg("ignore_eos") = false, nb::arg("special") = false, nb::arg("priority") = 0,
          nb::rv_policy::take_ownership,
          "Like generate(), as an iterator of text pieces. Each next() steps the engine's scheduler until text "
          "arrives: every stream, generate() and generate_batch() of this engine in progress advances in the "
          "same forward pass (the GIL is released while the model runs).")
      .def_prop_ro("logits", [](std::shared_ptr<SessionBox> s) { return logits_view(s); },
                   "Logits of the last prefill() (read-only NumPy view, no copy); None before any and after generate/stream.")
      .def_prop_ro("tokens", [](SessionBox& s) {
        std::vector<TokenId> t = read_session(s, [](const Session& x) { return x.tokens(); });
        if (s.pending) t.push_back(*s.pending);
        return t;
      }, "Every token of the session, the pending one included.")
      .def_prop_ro("n_past", [](SessionBox& s) { return read_session(s, [](const Session& x) { return x.n_past(); }); },
                   "Tokens whose KV is stored.")
      .def_prop_ro("pending_token", [](const SessionBox& s) { return s.pending; },
                   "The last generated token when no pass ran for it yet (it is fed first by the next call).")
      .def_prop_ro("capacity",
                   [](SessionBox& s) { return read_session(s, [](const Session& x) { return x.cache().capacity(); }); })
      .def_prop_ro("kv", [](const SessionBox& s) { return s.kv; }, "The KV format.")
      .def_prop_ro("text", [](SessionBox& s) {
        std::vector<TokenId> t = read_session(s, [](const Session& x) { return x.tokens(); });
        if (s.pending) t.push_back(*s.pending);
        return utf8(s.engine->model->model->tokenizer().decode(t));
      })
      .def_prop_ro("shared", [](const SessionBox& s) { return s.pool != nullptr; }, "Whether the KV is in a Pool.")
      .def_prop_ro("handoff", [](const SessionBox& s) {
        nb::dict d;
        d["opened"] = s.handoff.opened;
        d["kv"] = s.handoff.kv;
        d["fallback"] = s.handoff.fallback;
        d["detail"] = s.handoff.detail;
        d["prefill_tokens"] = s.handoff.prefill_tokens;
        d["seconds"] = s.handoff.seconds;
        return d;
      }, "How pool.open() made this session: kv (continued on the producer's blocks) or fallback (none, model, format, checksum, shape, requested) with detail.")
      .def_prop_ro("closed", [](const SessionBox& s) { return !s.session; })
      .def("close", [](SessionBox& s) {
        if (!s.session) return;
        s.get();  // a stream or request in progress: raises
        nb::gil_scoped_release release;
        std::lock_guard lock(s.engine->mu);
        if (!s.session) return;  // another thread's close() came first
        if (s.queued) fail_busy();
        // Callers that read the session with only the GIL held (properties,
        // get()) must see it alive or gone: the GIL too. No thread waits for
        // the engine's mutex while it holds the GIL, so this cannot deadlock.
        nb::gil_scoped_acquire acquire;
        s.session.reset();  // gives the KV blocks back
      }, "Frees the session's KV now (later calls raise).")
      .def("__repr__", [](const SessionBox& s) {
        return "<qkvshare.Session kv=" + s.kv + (s.session ? " tokens=" + std::to_string(s.session->n_past()) : " closed") +
               ">";
      });

  nb::handle engine_type = nb::type<EngineBox>();
  nb::setattr(
      engine_type, "generate_batch",
      nb::cpp_function(
          [](std::shared_ptr<EngineBox> e, std::vector<std::shared_ptr<SessionBox>> sessions, nb::list prompts,
             IntArg max_tokens, double temperature, IntArg top_k, double top_p, double min_p, double repeat_penalty,
             IntArg repeat_last_n, IntArg seed, std::vector<std::string> stop, bool ignore_eos, bool special,
             std::optional<std::vector<int>> priorities) {
            if (sessions.size() != nb::len(prompts))
              fail(ErrorCode::invalid_argument, "generate_batch: {} sessions but {} prompts", sessions.size(),
                   nb::len(prompts));
            if (priorities && priorities->size() != sessions.size())
              fail(ErrorCode::invalid_argument, "generate_batch: {} sessions but {} priorities", sessions.size(),
                   priorities->size());
            GenerateOptions o = generate_options(max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
                                                 repeat_last_n, seed, std::move(stop), ignore_eos);
            std::vector<Job> jobs(sessions.size());
            for (std::size_t i = 0; i < sessions.size(); ++i) {
              if (!sessions[i]) fail(ErrorCode::invalid_argument, "generate_batch: session {} is None", i);
              if (sessions[i]->engine != e)
                fail(ErrorCode::invalid_argument, "generate_batch: session {} belongs to another engine", i);
              sessions[i]->get();  // closed or busy: nothing of the batch starts
              for (std::size_t j = 0; j < i; ++j)
                if (sessions[j] == sessions[i])
                  fail(ErrorCode::invalid_argument, "generate_batch: session {} is also session {}", i, j);
            }
            std::vector<RequestResult> results(jobs.size());
            std::optional<Error> first_error;
            std::size_t submitted = 0;
            try {
              for (; submitted < jobs.size(); ++submitted) {
                jobs[submitted].s = sessions[submitted];
                jobs[submitted].submit(with_pending(*sessions[submitted], prompts[submitted], special), o,
                                       SessionBox::Use::generate, priorities ? (*priorities)[submitted] : 0);
              }
            } catch (...) {
              // Nothing of a batch that could not start runs: cancel what was queued.
              for (std::size_t i = 0; i < submitted; ++i) {
                RequestResult r;
                {
                  nb::gil_scoped_release release;
                  {
                    std::lock_guard lock(e->mu);
                    e->scheduler->cancel(jobs[i].id);
                  }
                  r = wait(jobs[i]);
                }
                jobs[i].finish(r);
              }
              throw;
            }
            {
              nb::gil_scoped_release release;
              for (std::size_t i = 0; i < jobs.size(); ++i) results[i] = wait(jobs[i]);
            }
            std::vector<GenerateResult> out;
            for (std::size_t i = 0; i < jobs.size(); ++i) {
              jobs[i].finish(results[i]);
              if (results[i].error && !first_error) first_error = results[i].error;
              out.push_back(std::move(results[i].generation));
            }
            if (first_error) throw *first_error;
            return out;
          },
          nb::is_method(), nb::scope(engine_type), nb::name("generate_batch"), nb::arg("sessions"),
          nb::arg("prompts"), nb::arg("max_tokens") = 128, nb::arg("temperature") = 0.8, nb::arg("top_k") = 40,
          nb::arg("top_p") = 0.95, nb::arg("min_p") = 0.05, nb::arg("repeat_penalty") = 1.0,
          nb::arg("repeat_last_n") = 64, nb::arg("seed") = 0, nb::arg("stop") = std::vector<std::string>{},
          nb::arg("ignore_eos") = false, nb::arg("special") = false, nb::arg("priorities") = nb::none(),
          "Generates for several sessions of this engine together through the step API: each step is one "
          "forward pass carrying the next token of every decoding session and prompt chunks of the others. "
          "Returns one GenerateResult per session; a session that fails ends alone, and its error is raised "
          "after the others have finished."));
  nb::setattr(
      engine_type, "session",
      nb::cpp_function(
          [](std::shared_ptr<EngineBox> e, const std::string& kv, PoolBox* pool, IntArg capacity_arg) {
            const int capacity = int_value(capacity_arg, "capacity");
            auto s = std::make_shared<SessionBox>();
            s->engine = e;
            s->kv = kv;
            if (pool != nullptr) {
              pool->get();  // raises when closed
              s->pool = pool->pool;
            }
            nb::gil_scoped_release release;
            s->session = make_session(*e, s->pool, kv, capacity);
            return s;
          },
          nb::is_method(), nb::scope(engine_type), nb::name("session"), nb::arg("kv") = "int8",
          nb::arg("pool").none() = nb::none(), nb::arg("capacity") = 0,
          "A new session. kv: a KV format (f32, f16, int8, int4, int2, k8v4, ...; 'dense': the f32 reference "
          "cache). pool: a Pool to keep the KV in (needed to seal and hand it on); None: a private pool. "
          "capacity: tokens (0: the model's context length)."));
}

}  // namespace qkvshare::py
