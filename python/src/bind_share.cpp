// Pools, sealed contexts and descriptors: Pool.anonymous/create/attach,
// Session.seal() -> Context, Context.grant() -> Descriptor, Pool.open() ->
// Session continuing the producer's KV (no KV byte copied).
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cmath>

#include "py_common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/splice.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"

namespace qkvshare::py {

namespace {
// Runs the session's last generated token, not yet in its KV, through the
// model (with the engine's mutex held); its logits become the session's.
void feed_pending(SessionBox& s, Engine& engine, Session& session) {
  if (!s.pending) return;
  const TokenId t = *s.pending;
  store_logits(s, engine.forward(session, std::span<const TokenId>(&t, 1)), 1);
  s.pending.reset();
}
}  // namespace

SharePool& PoolBox::get() const {
  if (!pool) fail(ErrorCode::invalid_argument, "the pool{}{} is closed", name.empty() ? "" : " ", name);
  return *pool;
}

void PoolBox::close() noexcept {
  if (!pool) return;
  if (unlink_on_close && !name.empty()) ShmRegion::unlink(name);
  pool.reset();
}

ContextBox::~ContextBox() {
  if (released || !pool) return;
  try {
    pool->release(sealed);  // the grants keep the record alive for their consumers
  } catch (...) {
    // A destructor must not throw; the reaper reclaims what is left.
  }
}

void ContextBox::check_live() const {
  if (released) fail(ErrorCode::invalid_argument, "context {} was released", sealed.context_id);
}

namespace {

nb::object json_loads(const std::string& text) { return nb::module_::import_("json").attr("loads")(text); }

ShareConfig share_config(const IntArg& bytes, int block_tokens, int max_contexts, int max_grants, int max_processes,
                         int max_tokens) {
  ShareConfig c;
  c.bytes = u64_value(bytes, "bytes");
  // Mapping 0 bytes fails as if memory had run out: it is the same mistake as 1.
  if (c.bytes == 0) fail(ErrorCode::invalid_argument, "share pool of 0 bytes is too small: bytes must be > 0");
  c.block_tokens = block_tokens;
  c.max_contexts = max_contexts;
  c.max_grants = max_grants;
  c.max_processes = max_processes;
  c.max_tokens = max_tokens;
  return c;  // SharePool validates every field and names the bad one
}

Descriptor descriptor_from(nb::bytes b) {
  const auto* p = static_cast<const std::uint8_t*>(b.data());
  return Descriptor::decode(std::span<const std::uint8_t>(p, b.size()));
}

nb::bytes descriptor_bytes(const Descriptor& d) {
  const DescriptorBytes e = d.encode();
  return nb::bytes(reinterpret_cast<const char*>(e.data()), e.size());
}

// The reason as an identifier (to_string() gives words, for messages).
std::string fallback_name(FallbackReason r) {
  switch (r) {
    case FallbackReason::none: return "none";
    case FallbackReason::model: return "model";
    case FallbackReason::format: return "format";
    case FallbackReason::checksum: return "checksum";
    case FallbackReason::shape: return "shape";
    case FallbackReason::requested: return "requested";
  }
  return "unknown";
}

std::string format_name(const Descriptor& d) {
  const auto f = d.format();
  return f ? f->to_string() : "unknown";
}

}  // namespace

void bind_share(nb::module_& m) {
  nb::class_<Descriptor>(m, "Descriptor",
                         "The 256-byte value naming a sealed context for one grantee (bytes(d), pickle, d.json()).")
      .def_static("from_bytes", &descriptor_from, nb::arg("data"),
                  "Decodes and validates 256 bytes (raises BadDescriptor naming the field).")
      .def("__bytes__", &descriptor_bytes)
      .def("json", [](const Descriptor& d) { return d.json(); }, "Every field as one JSON object (a str).")
      // Pickling (nanobind's protocol): the state is the 256 bytes, validated again on load.
      .def("__getstate__", &descriptor_bytes)
      .def("__setstate__", [](Descriptor& d, nb::bytes b) { new (&d) Descriptor(descriptor_from(b)); })
      .def("__eq__", [](const Descriptor& a, nb::handle b) {
        if (!nb::isinstance<Descriptor>(b)) return false;
        return a.encode() == nb::cast<const Descriptor&>(b).encode();
      })
      .def("__hash__", [](const Descriptor& d) { return nb::hash(descriptor_bytes(d)); })
      .def_ro("context_id", &Descriptor::context_id)
      .def_ro("pool_id", &Descriptor::pool_id)
      .def_ro("token_count", &Descriptor::token_count)
      .def_ro("producer", &Descriptor::producer)
      .def_ro("grantee", &Descriptor::grantee)
      .def_prop_ro("kv", &format_name, "The KV format of the context.")
      .def_prop_ro("fingerprint", [](const Descriptor& d) { return d.fingerprint.hex(); })
      .def("__repr__", [](const Descriptor& d) {
        return "<qkvshare.Descriptor context " + std::to_string(d.context_id) + ", " +
               std::to_string(d.token_count) + " tokens, " + d.producer + " -> " + d.grantee + ">";
      });

  nb::class_<ContextBox>(m, "Context", "A producer's claim on a sealed context; grant() hands it on.")
      .def(
          "grant",
          [](ContextBox& c, const std::string& agent) {
            c.check_live();
            return c.pool->grant(c.sealed, c.producer, agent);
          },
          nb::arg("agent"), "A descriptor that only `agent` can open (one per consumer; several make a fork).")
      .def(
          "release",
          [](ContextBox& c) {
            c.check_live();
            c.pool->release(c.sealed);
            c.released = true;
          },
          "Drops the producer's claim; the context lives on while a grant is unopened or open.")
      .def(
          "revoke",
          [](ContextBox& c) {
            c.check_live();
            c.pool->revoke(c.sealed);
            c.released = true;
          },
          "Ends the context and every grant of it.")
      .def_prop_ro("id", [](const ContextBox& c) { return c.sealed.context_id; })
      .def_prop_ro("tokens", [](const ContextBox& c) { return c.sealed.tokens; }, "Token count.")
      .def_prop_ro("producer", [](const ContextBox& c) { return c.producer; })
      .def_prop_ro("released", [](const ContextBox& c) { return c.released; })
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](ContextBox& c, nb::args) {
        if (!c.released) {
          c.pool->release(c.sealed);
          c.released = true;
        }
      })
      .def("__repr__", [](const ContextBox& c) {
        return "<qkvshare.Context " + std::to_string(c.sealed.context_id) + " (" + std::to_string(c.sealed.tokens) +
               " tokens by " + c.producer + (c.released ? ", released" : "") + ")>";
      });

  nb::class_<PoolBox>(m, "Pool", "A shared context pool: the KV arena and the registry of sealed contexts.")
      .def_static(
          "anonymous",
          [](IntArg bytes, int block_tokens, int max_contexts, int max_grants, int max_processes, int max_tokens) {
            auto box = std::make_shared<PoolBox>();
            const ShareConfig c = share_config(bytes, block_tokens, max_contexts, max_grants, max_processes, max_tokens);
            nb::gil_scoped_release release;
            box->pool = SharePool::create_anonymous(c);
            return box;
          },
          nb::arg("bytes") = std::size_t{256} << 20, nb::arg("block_tokens") = 32, nb::arg("max_contexts") = 64,
          nb::arg("max_grants") = 256, nb::arg("max_processes") = 32, nb::arg("max_tokens") = 16384,
          "A pool in this process's memory (and children it forks).")
      .def_static(
          "create",
          [](const std::string& name, IntArg bytes, int block_tokens, int max_contexts, int max_grants,
             int max_processes, int max_tokens, bool unlink_on_close) {
            auto box = std::make_shared<PoolBox>();
            const ShareConfig c = share_config(bytes, block_tokens, max_contexts, max_grants, max_processes, max_tokens);
            {
              nb::gil_scoped_release release;
              box->pool = SharePool::create(name, c);
            }
            box->name = name;
            box->unlink_on_close = unlink_on_close;
            return box;
          },
          nb::arg("name"), nb::arg("bytes") = std::size_t{256} << 20, nb::arg("block_tokens") = 32,
          nb::arg("max_contexts") = 64, nb::arg("max_grants") = 256, nb::arg("max_processes") = 32,
          nb::arg("max_tokens") = 16384, nb::arg("unlink_on_close") = true,
          "A named POSIX shared-memory pool (/dev/shm/qkvshare.NAME) other processes can attach; its name is "
          "removed when this handle closes (unlink_on_close), attached processes keep their mapping.")
      .def_static(
          "attach",
          [](const std::string& name) {
            auto box = std::make_shared<PoolBox>();
            {
              nb::gil_scoped_release release;
              box->pool = SharePool::attach(name);
            }
            box->name = name;
            return box;
          },
          nb::arg("name"), "Maps a pool another process created.")
      .def(
          "open",
          [](PoolBox& p, const Descriptor& d, std::shared_ptr<EngineBox> engine, const std::string& agent,
             const std::string& mode, bool verify, IntArg capacity_arg, bool release_grant) {
            SharePool& pool = p.get();
            if (!engine) fail(ErrorCode::invalid_argument, "open: engine is None");
            const int capacity = int_value(capacity_arg, "capacity");
            HandoffOptions o;
            o.mode = parse_handoff_mode(mode);
            o.verify = verify;
            const int ctx = engine->model->model->config().context_length;
            if (capacity < 0 || capacity > ctx)
              fail(ErrorCode::invalid_argument, "capacity {} is outside [0, {}]", capacity, ctx);
            o.capacity = capacity;
            auto s = std::make_shared<SessionBox>();
            s->engine = engine;
            nb::gil_scoped_release release;
            std::lock_guard lock(engine->mu);
            HandoffResult r = open_session(pool, *engine->engine, engine->model->fingerprint, d, agent, o);
            s->session = std::move(r.session);
            const bool pooled = dynamic_cast<const PooledKvCache*>(&s->session->cache()) != nullptr;
            s->pool = pooled ? p.pool : nullptr;
            s->kv = pooled ? d.format().value_or(KvFormat{}).to_string() : "dense";
            std::string detail = r.detail;
            if (detail.empty() && r.fallback != FallbackReason::none) detail = to_string(r.fallback);
            s->handoff = {true, r.kv, fallback_name(r.fallback), detail, r.prefill_tokens, r.seconds};
            // The session holds its own block references: the grant has done its job.
            if (release_grant) pool.release(d, agent);
            return s;
          },
          nb::arg("descriptor"), nb::arg("engine"), nb::arg("agent"), nb::arg("mode") = "auto",
          nb::arg("verify") = false, nb::arg("capacity") = 0, nb::arg("release") = true,
          "Opens a descriptor granted to `agent` as a session of `engine` that continues the context. mode: "
          "'auto' (the KV, else a text re-prefill with the reason in session.handoff), 'kv' (the KV or "
          "BadDescriptor), 'text'. verify: rehash every block first. release: end the grant once opened (the "
          "session holds its own block references, so the descriptor goes stale; False keeps it openable "
          "until pool.release()). Forged, stale or foreign descriptors raise BadDescriptor.")
      .def(
          "release",
          [](PoolBox& p, const Descriptor& d, const std::string& agent) { p.get().release(d, agent); },
          nb::arg("descriptor"), nb::arg("agent"), "The grantee is done with the descriptor (it goes stale).")
      .def(
          "revoke",
          [](PoolBox& p, const Descriptor& d, const std::string& agent) { p.get().revoke(d, agent); },
          nb::arg("descriptor"), nb::arg("agent"), "The producer `agent` ends the context and all its grants.")
      .def(
          "check",
          [](PoolBox& p, const Descriptor& d, bool verify) {
            DescriptorStatus st;
            {
              SharePool& pool = p.get();
              nb::gil_scoped_release release;
              st = pool.check(d, verify);
            }
            nb::dict r;
            r["valid"] = st.problem.empty();
            r["pool_matches"] = st.pool_matches;
            r["capability_valid"] = st.capability_valid;
            r["live"] = st.live;
            r["checksums_match"] = st.checksums_match;
            r["blocks_verified"] = st.blocks_verified;
            r["problem"] = st.problem;
            return r;
          },
          nb::arg("descriptor"), nb::arg("verify") = false, "Checks a descriptor without opening it (never raises for "
          "a bad one: 'problem' says what is wrong).")
      .def("stats", [](PoolBox& p) { return json_loads(p.get().stats().json()); },
           "Counters and occupancy (the same JSON as `qkvshare pool stat`), as a dict.")
      .def("reap", [](PoolBox& p) { return p.get().reap(); }, "Reclaims what dead processes held; returns how many.")
      .def("close", &PoolBox::close, "Drops this handle (sessions and contexts from it keep working).")
      .def_prop_ro("closed", [](const PoolBox& p) { return !p.pool; })
      .def_prop_ro("name", [](const PoolBox& p) -> std::optional<std::string> {
        if (p.name.empty()) return std::nullopt;
        return p.name;
      })
      .def_prop_ro("id", [](const PoolBox& p) { return p.get().pool_id(); })
      .def("__enter__", [](nb::handle self) { return self; })
      .def("__exit__", [](PoolBox& p, nb::args) { p.close(); })
      .def("__repr__", [](const PoolBox& p) {
        return "<qkvshare.Pool " + (p.name.empty() ? std::string("anonymous") : p.name) + (p.pool ? "" : " closed") + ">";
      });

  nb::handle session_type = nb::type<SessionBox>();
  nb::setattr(
      session_type, "seal",
      nb::cpp_function(
          [](std::shared_ptr<SessionBox> s, const std::string& producer) {
            s->get();
            if (!s->pool)
              fail(ErrorCode::invalid_argument,
                   "seal: the session's KV is private; create it with engine.session(kv=..., pool=pool)");
            auto c = std::make_shared<ContextBox>();
            c->pool = s->pool;
            c->producer = producer;
            nb::gil_scoped_release release;
            std::lock_guard lock(s->engine->mu);
            Session& session = s->locked();  // a close() or a request may have come first
            Engine& engine = *s->engine->engine;
            feed_pending(*s, engine, session);
            c->sealed = seal_session(*s->pool, engine, s->engine->model->fingerprint, session, producer);
            return c;
          },
          nb::is_method(), nb::scope(session_type), nb::name("seal"), nb::arg("producer"),
          "Seals the session's context (its last generated token fed first) and returns the producer's claim. "
          "The session may go on appending: it copies the partly filled tail block first."));

  nb::setattr(
      session_type, "splice",
      nb::cpp_function(
          [](std::shared_ptr<SessionBox> s, std::shared_ptr<PoolBox> p, const Descriptor& d, const std::string& agent,
             int begin, std::optional<int> end, double recompute, bool guard, std::optional<double> threshold,
             bool release_grant) {
            s->get();
            if (!p) fail(ErrorCode::invalid_argument, "splice: pool is None");
            SharePool& pool = p->get();
            if (!s->pool || s->pool != p->pool)
              fail(ErrorCode::invalid_argument,
                   "splice: the session's KV must live in this pool; create it with engine.session(kv=..., pool=pool)");
            if (d.fingerprint.model != s->engine->model->fingerprint.model)
              fail(ErrorCode::bad_descriptor, "splice: the descriptor's context was made by another model");
            if (!(recompute >= 0.0 && recompute <= 1.0))
              fail(ErrorCode::invalid_argument, "splice: recompute {} is outside [0, 1]", recompute);
            SpliceOptions o;
            o.recompute = recompute;
            o.guard = guard;
            // The library reads a negative threshold as "calibrated": only None may mean that.
            if (threshold && !(std::isfinite(*threshold) && *threshold >= 0.0))
              fail(ErrorCode::invalid_argument, "splice: threshold must be a finite number >= 0 (or None), got {}",
                   *threshold);
            if (threshold) o.threshold = *threshold;
            SpliceResult r;
            {
              nb::gil_scoped_release release;
              std::lock_guard lock(s->engine->mu);
              Session& session = s->locked();  // a close() or a request may have come first
              OpenedContext oc = pool.open(d, agent, true, session.cache().capacity());
              if (!oc.cache)
                fail(ErrorCode::bad_descriptor, "splice: the context's KV cannot be used here: {}{}",
                     to_string(oc.refused), oc.refused_detail.empty() ? "" : " (" + oc.refused_detail + ")");
              const int n = static_cast<int>(oc.tokens.size());
              const int stop = end.value_or(n);
              if (begin < 0 || stop > n || begin >= stop)
                fail(ErrorCode::invalid_argument, "splice: range [{}, {}) is not inside the context's {} tokens", begin,
                     stop, n);
              Engine& engine = *s->engine->engine;
              feed_pending(*s, engine, session);  // the last generated token goes in first, in its place
              r = splice_tokens(engine, session, *oc.cache, oc.tokens, begin, stop, o);
              s->logits.reset();  // no pass ended on the spliced tokens' last position
              // Only now: a call that fails leaves the descriptor openable. The
              // session holds its own block references.
              if (release_grant) pool.release(d, agent);
            }
            nb::dict out;
            out["tokens"] = r.tokens;
            out["recomputed"] = r.recomputed;
            out["reused"] = r.reused;
            out["probe_tokens"] = r.probe_tokens;
            out["fraction"] = r.fraction;
            out["estimate"] = r.estimate;
            out["escalated"] = r.escalated;
            out["text"] = r.text;
            out["seconds"] = r.seconds;
            return out;
          },
          nb::is_method(), nb::scope(session_type), nb::name("splice"), nb::arg("pool"), nb::arg("descriptor"),
          nb::arg("agent"), nb::arg("begin") = 0, nb::arg("end") = nb::none(), nb::arg("recompute") = 0.15,
          nb::arg("guard") = true, nb::arg("threshold") = nb::none(), nb::arg("release") = true,
          "Splices tokens [begin, end) of a context granted to `agent` onto the end of this session (docs/design.md "
          "handoff mode splice): the session keeps its own prefix (its role), the spliced tokens' KV is reused at a "
          "position offset after the first `recompute` fraction of them is run again under this prefix; the guard "
          "recomputes more (up to all of it, a text re-read) when its estimate of the deviation is above "
          "`threshold` (None: calibrated for the session's KV format). Returns what it did: tokens, recomputed, "
          "reused, probe_tokens, fraction, estimate, escalated, text, seconds. Raises BadDescriptor for a stale, "
          "forged or foreign descriptor and InvalidArgument for a bad range or a session outside `pool`."));
}

}  // namespace qkvshare::py
