#pragma once
// The objects behind the Python classes. Every Python object is a handle to
// one of these, created by a factory and held by std::shared_ptr, so the C++
// side decides lifetimes: a session keeps its engine and pool alive, an
// engine its model, whatever Python drops first.
//
// Threads: the GIL is released around every call that computes (forward
// passes, sealing, opening, loading). One Engine's scratch buffers serve one
// forward pass at a time, so EngineBox::mu serialises the passes of all
// sessions of an engine; sessions of different engines run in parallel.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <map>

#include "qkvshare/engine/engine.hpp"
#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/model/model.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/share/handoff.hpp"
#include "qkvshare/share/share_pool.hpp"

namespace qkvshare::py {

namespace nb = nanobind;

struct ModelBox {
  std::unique_ptr<Model> model;
  std::string tokenizer_path;
  ModelFingerprint fingerprint;
};

struct EngineBox {
  std::shared_ptr<ModelBox> model;
  std::unique_ptr<Engine> engine;
  std::mutex mu;  // one forward pass at a time (the engine's scratch); guards everything below
  // The engine's step API: every stream and batch of this engine is a request
  // of this one scheduler, so whichever caller steps it advances them all in
  // one forward pass per step.
  std::unique_ptr<Scheduler> scheduler;
  std::map<RequestId, RequestResult> finished;  // results not yet collected by their caller
};

// A pool handle; close() drops it (sessions and contexts made from it keep
// the mapping alive until they go).
struct PoolBox {
  std::shared_ptr<SharePool> pool;
  std::string name;  // empty: anonymous
  bool unlink_on_close = false;
  ~PoolBox() { close(); }
  SharePool& get() const;  // Error(invalid_argument) when closed
  void close() noexcept;
};

// What pool.open() did, for an opened session.
struct HandoffInfo {
  bool opened = false;  // the session came from a descriptor
  bool kv = false;
  std::string fallback = "none";
  std::string detail;
  int prefill_tokens = 0;
  double seconds = 0.0;
};

struct SessionBox {
  std::shared_ptr<EngineBox> engine;
  std::shared_ptr<SharePool> pool;  // null for a private (unshared) KV
  std::unique_ptr<Session> session;
  std::string kv;
  // generate() samples a last token that is not fed through the model yet;
  // it goes in front of the next prompt, or into the KV before seal().
  std::optional<TokenId> pending;
  // Logits of the last position(s) fed, [rows][vocab]; a new buffer per
  // pass, so a NumPy view handed out earlier never dangles or changes.
  std::shared_ptr<std::vector<float>> logits;
  int logits_rows = 0;
  // A request of the engine's scheduler runs on the session: a stream's, or a
  // generate() of another thread (guarded by the GIL; other calls raise).
  enum class Use { idle, generate, stream };
  Use use = Use::idle;
  // The scheduler holds the session for a request not collected yet (guarded
  // by the engine's mutex). close() frees the session with both the GIL and
  // the mutex held, so a caller holding either sees it alive or closed.
  bool queued = false;
  HandoffInfo handoff;

  Session& get();     // with the GIL: Error(invalid_argument) when closed or in use
  Session& locked();  // with the engine's mutex: the same, for a call that waited for it after get()
};

// A producer's claim on a sealed context.
struct ContextBox {
  std::shared_ptr<SharePool> pool;
  SealedContext sealed;
  std::string producer;
  bool released = false;
  ~ContextBox();
  void check_live() const;
};

// An int argument the binding range-checks itself (int_value, u64_value),
// so that a value out of range gets an error naming the parameter instead of
// nanobind's generic "incompatible function arguments". Shown as `int`.
struct IntArg {
  nb::object value;
};

}  // namespace qkvshare::py

namespace nanobind::detail {
template <>
struct type_caster<qkvshare::py::IntArg> {
  NB_TYPE_CASTER(qkvshare::py::IntArg, const_name("int"))
  bool from_python(handle src, uint8_t, cleanup_list*) noexcept {
    value.value = borrow(src);
    return true;
  }
  static handle from_cpp(const qkvshare::py::IntArg& v, rv_policy, cleanup_list*) noexcept {
    return v.value.inc_ref();
  }
};
}  // namespace nanobind::detail

namespace qkvshare::py {

// Argument checks (module.cpp). TypeError for a value of the wrong type,
// Error(invalid_argument) naming `name` for one out of range.
int int_value(const IntArg& v, std::string_view name);
std::uint64_t u64_value(const IntArg& v, std::string_view name);
// A str as UTF-8 (a lone surrogate cannot be encoded).
std::string text_value(nb::handle v, std::string_view name);
// A file path for the C library, which would end it at a NUL.
void check_path(const std::string& path, std::string_view name);
// The bound of the CLI's --threads.
inline constexpr int kMaxThreads = 1024;
int threads_value(const IntArg& v, std::string_view name);

// Raises qkvshare errors as Python exceptions (module.cpp).
void register_errors(nb::module_& m);
void bind_model(nb::module_& m);
void bind_session(nb::module_& m);
void bind_share(nb::module_& m);
void bind_agents(nb::module_& m);

// Shared helpers (bind_session.cpp).
std::vector<TokenId> prompt_ids(const ModelBox& model, const nb::handle& prompt, bool at_start, bool special);
nb::object logits_view(const std::shared_ptr<SessionBox>& s);
void store_logits(SessionBox& s, std::span<const float> logits, int rows);
std::unique_ptr<Session> make_session(EngineBox& e, const std::shared_ptr<SharePool>& pool, const std::string& kv,
                                      int capacity);

}  // namespace qkvshare::py
