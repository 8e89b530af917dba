#pragma once
// A random mix of seal / grant / open / fork / append / release / revoke on
// synthetic contexts, run by the multi-process and the multi-threaded tests.
// Descriptors travel to a peer through `send` and come back through `receive`;
// every descriptor issued is also given to `log`, so that whoever cleans up
// can release grants whose grantee died.
#include <functional>
#include <optional>
#include <random>

#include "qkvshare/core/error.hpp"
#include "share_test_util.hpp"

namespace qkvshare::testing {

struct OpsPeer {
  std::string me, peer;
  std::function<bool(const Descriptor&)> send;             // false: could not deliver
  std::function<std::optional<Descriptor>()> receive;      // nullopt: nothing waiting
  std::function<void(const Descriptor&)> log;
};

struct OpsCounts {
  int ops = 0, seals = 0, grants = 0, opens = 0, forks = 0, appends = 0, releases = 0, revokes = 0, refused = 0;
};

class RandomOps {
 public:
  RandomOps(SharePool& pool, const KvShape& shape, OpsPeer peer, unsigned seed)
      : pool_(pool), kv_(pool.kv_pool(shape)), peer_(std::move(peer)), rng_(seed) {}

  // Runs `n` operations (forever when n < 0).
  OpsCounts run(int n) {
    for (int i = 0; n < 0 || i < n; ++i) step();
    return counts_;
  }

  // Gives everything back: sessions, claims, received grants.
  void finish() {
    ctx_.clear();
    for (const SealedContext& c : claims_) try_op([&] { pool_.release(c); });
    claims_.clear();
    while (auto d = peer_.receive()) received_.push_back(*d);
    for (const Descriptor& d : received_) try_op([&] { pool_.release(d, peer_.me); });
    received_.clear();
  }

 private:
  struct Ctx {
    std::unique_ptr<PooledKvCache> cache;
    std::vector<TokenId> ids;
  };

  template <typename F>
  void try_op(F f) {
    try {
      f();
    } catch (const Error& e) {
      // A full pool or a descriptor released meanwhile (by its producer's
      // revoke) are expected; anything else is a bug.
      if (e.code() != ErrorCode::out_of_memory && e.code() != ErrorCode::bad_descriptor &&
          e.code() != ErrorCode::context_full)
        throw;
      ++counts_.refused;
    }
  }
  std::size_t pick(std::size_t n) { return std::uniform_int_distribution<std::size_t>(0, n - 1)(rng_); }
  void append(Ctx& c, int n) {
    if (c.cache->size() + n > c.cache->capacity()) return;
    append_random(*c.cache, n, static_cast<unsigned>(rng_()), threads_);
    for (int i = 0; i < n; ++i) c.ids.push_back(static_cast<TokenId>(c.ids.size() % 500));
    ++counts_.appends;
  }

  void step() {
    ++counts_.ops;
    static const char* formats[] = {"f32", "f16", "int8", "k8v4"};
    switch (pick(11)) {
      case 0:
        if (ctx_.size() < 6)
          try_op([&] {
            Ctx c{std::make_unique<PooledKvCache>(kv_, KvFormat::parse(formats[pick(4)]), 200), {}};
            append(c, 1 + static_cast<int>(pick(40)));
            ctx_.push_back(std::move(c));
          });
        break;
      case 1:
        if (!ctx_.empty()) try_op([&] { append(ctx_[pick(ctx_.size())], 1 + static_cast<int>(pick(9))); });
        break;
      case 2:
        if (!ctx_.empty() && claims_.size() < 6)
          try_op([&] {
            Ctx& c = ctx_[pick(ctx_.size())];
            if (c.cache->size() == 0) return;
            claims_.push_back(pool_.seal(*c.cache, c.ids, "", ModelFingerprint{}, peer_.me));
            ++counts_.seals;
          });
        break;
      case 3:
      case 4:
        if (!claims_.empty())
          try_op([&] {
            const bool to_peer = pick(2) == 0;
            const Descriptor d = pool_.grant(claims_[pick(claims_.size())], peer_.me, to_peer ? peer_.peer : peer_.me);
            peer_.log(d);
            ++counts_.grants;
            if (!to_peer) {
              received_.push_back(d);
            } else if (!peer_.send(d)) {
              pool_.revoke(d, peer_.me);  // undeliverable: end it as its producer
            }
          });
        break;
      case 5:
        if (!received_.empty() && ctx_.size() < 8)
          try_op([&] {
            OpenedContext o = pool_.open(received_[pick(received_.size())], peer_.me, true, 200);
            if (!o.cache) return;
            ctx_.push_back(Ctx{std::move(o.cache), std::move(o.tokens)});
            ++counts_.opens;
          });
        break;
      case 6:
        if (!ctx_.empty() && ctx_.size() < 8) {
          Ctx& c = ctx_[pick(ctx_.size())];
          ctx_.push_back(Ctx{c.cache->fork(), c.ids});
          ++counts_.forks;
        }
        break;
      case 7:
        if (!ctx_.empty()) ctx_.erase(ctx_.begin() + static_cast<std::ptrdiff_t>(pick(ctx_.size())));
        break;
      case 8:
        if (!received_.empty())
          try_op([&] {
            const std::size_t i = pick(received_.size());
            const Descriptor d = received_[i];
            received_.erase(received_.begin() + static_cast<std::ptrdiff_t>(i));
            pool_.release(d, peer_.me);
            ++counts_.releases;
          });
        break;
      case 9:
        if (!claims_.empty())
          try_op([&] {
            const std::size_t i = pick(claims_.size());
            const SealedContext c = claims_[i];
            claims_.erase(claims_.begin() + static_cast<std::ptrdiff_t>(i));
            if (pick(3) == 0) {
              pool_.revoke(c);
              ++counts_.revokes;
            } else {
              pool_.release(c);
              ++counts_.releases;
            }
          });
        break;
      default:
        while (received_.size() < 10)
          if (auto d = peer_.receive()) received_.push_back(*d); else break;
        break;
    }
  }

  SharePool& pool_;
  std::shared_ptr<KvPool> kv_;
  OpsPeer peer_;
  std::mt19937 rng_;
  ThreadPool threads_{1};
  std::vector<Ctx> ctx_;
  std::vector<SealedContext> claims_;
  std::vector<Descriptor> received_;
  OpsCounts counts_;
};

}  // namespace qkvshare::testing
