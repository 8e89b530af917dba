// Scheduler: requests batched together generate what each generates alone
// through generate(); budget, chunking, fairness, priorities, streaming,
// cancellation and failures of one request among others.
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>

#include "qkvshare/core/error.hpp"
#include "qkvshare/engine/scheduler.hpp"
#include "qkvshare/kv/pooled_kv_cache.hpp"
#include "test_paths.hpp"

namespace qkvshare {
namespace {

class SchedulerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = Model::load(testing::shared_path("models/stories260K.bin"), testing::shared_path("models/tok512.bin"));
    for (const char* t : {"Once upon a time there was a little dog", "Lily and Ben went to the beach. They",
                          "The sun was hot and the cat", "One day a bird flew into the garden and sang a song for",
                          "Tom had a red ball.", "The old man lived alone in a small house near the woods. Every day he"}) {
      std::vector<TokenId> ids{model_->tokenizer().bos_id()};
      const auto body = model_->tokenizer().encode(t);
      ids.insert(ids.end(), body.begin(), body.end());
      prompts_.push_back(ids);
    }
  }
  GenerateOptions greedy(int n) const {
    GenerateOptions o;
    o.max_new_tokens = n;
    o.sampling.temperature = 0.0f;
    return o;
  }
  Request request(Session& s, std::size_t prompt, GenerateOptions o) const {
    Request r;
    r.session = &s;
    r.prompt = prompts_[prompt];
    r.options = std::move(o);
    return r;
  }
  static std::map<RequestId, RequestResult> by_id(std::vector<RequestResult> v) {
    std::map<RequestId, RequestResult> m;
    for (auto& r : v) m.emplace(r.id, std::move(r));
    return m;
  }
  std::unique_ptr<Model> model_;
  std::vector<std::vector<TokenId>> prompts_;
};

// Greedy and seeded sampling, exact matmuls: every request's tokens, text and
// stop reason equal a generate() of it alone, whatever else shares its passes.
TEST_F(SchedulerTest, BatchedRequestsGenerateWhatEachGeneratesAlone) {
  EngineOptions eo;
  eo.n_threads = 2;
  eo.exact_matmul = true;
  Engine engine(*model_, eo);
  std::vector<GenerateOptions> opts;
  for (std::size_t i = 0; i < prompts_.size(); ++i) {
    GenerateOptions o = greedy(12 + 5 * static_cast<int>(i));
    if (i % 2 == 1) {
      o.sampling.temperature = 0.9f;
      o.sampling.seed = 100 + i;
    }
    if (i == 4) o.stop_strings = {"."};
    opts.push_back(o);
  }
  std::vector<GenerateResult> alone;
  for (std::size_t i = 0; i < prompts_.size(); ++i) {
    auto s = engine.new_session(256);
    alone.push_back(generate(engine, *s, prompts_[i], opts[i]));
  }
  for (const int budget : {7, 64}) {
    SchedulerOptions so;
    so.token_budget = budget;
    Scheduler sched(engine, so);
    std::vector<std::unique_ptr<Session>> sessions;
    std::map<RequestId, std::size_t> which;
    std::map<RequestId, std::string> streamed;
    for (std::size_t i = 0; i < prompts_.size(); ++i) {
      sessions.push_back(engine.new_session(256));
      Request r = request(*sessions.back(), i, opts[i]);
      const RequestId id = sched.submit(std::move(r));
      which[id] = i;
    }
    sched.run_until_idle();
    EXPECT_EQ(sched.size(), 0u);
    const auto done = by_id(sched.take_finished());
    ASSERT_EQ(done.size(), prompts_.size());
    for (const auto& [id, r] : done) {
      const GenerateResult& want = alone[which.at(id)];
      EXPECT_FALSE(r.error.has_value());
      EXPECT_EQ(r.generation.tokens, want.tokens) << "request " << which.at(id) << " budget " << budget;
      EXPECT_EQ(r.generation.text, want.text);
      EXPECT_EQ(r.generation.stop_reason, want.stop_reason);
      EXPECT_EQ(r.generation.decode_tokens, want.decode_tokens);
      EXPECT_EQ(r.generation.prefill_tokens, want.prefill_tokens);
    }
    // Batching happened: far fewer passes than the requests' passes summed.
    int passes = 0;
    for (const auto& [id, r] : done) passes += r.steps;
    EXPECT_LT(static_cast<int>(sched.steps_run()), passes / 2);
  }
}

// A long prompt is chunked to the budget and decoding requests get a token in
// every pass meanwhile.
TEST_F(SchedulerTest, LongPromptIsChunkedAndDecodersKeepTheirPace) {
  Engine engine(*model_, EngineOptions{2});
  SchedulerOptions so;
  so.token_budget = 8;
  Scheduler sched(engine, so);
  auto a = engine.new_session(512), b = engine.new_session(512);
  Request ra = request(*a, 0, greedy(40));
  ra.options.stop_at_end_of_generation = false;
  int a_tokens = 0;
  ra.on_token = [&](TokenId) { ++a_tokens; };
  sched.submit(std::move(ra));
  while (a_tokens == 0) ASSERT_TRUE(sched.step());  // a is decoding now
  Request rb;
  rb.session = b.get();
  rb.prompt.assign(100, 7);
  rb.prompt[0] = model_->tokenizer().bos_id();
  rb.options = greedy(1);
  const RequestId idb = sched.submit(std::move(rb));
  for (int i = 0; i < 10; ++i) {
    const int before = a_tokens, b_before = b->n_past();
    ASSERT_TRUE(sched.step());
    EXPECT_EQ(a_tokens, before + 1) << "pass " << i;
    const int fed = b->n_past() - b_before;
    EXPECT_GE(fed, 1);
    EXPECT_LE(fed + 1, 8);  // with a's token, within the budget
  }
  sched.run_until_idle();
  const auto done = by_id(sched.take_finished());
  EXPECT_EQ(done.at(idb).generation.prefill_tokens, 100);
  EXPECT_GE(done.at(idb).steps, 100 / 7);
}

TEST_F(SchedulerTest, PrioritiesAndFairnessDecideWhoRunsWhenSessionsAreCapped) {
  Engine engine(*model_, EngineOptions{1});
  SchedulerOptions so;
  so.max_sessions = 1;
  {
    Scheduler sched(engine, so);
    auto lo = engine.new_session(), hi = engine.new_session();
    std::vector<int> order;
    Request rl = request(*lo, 0, greedy(6));
    rl.on_token = [&](TokenId) { order.push_back(0); };
    Request rh = request(*hi, 1, greedy(6));
    rh.priority = 5;
    rh.on_token = [&](TokenId) { order.push_back(1); };
    sched.submit(std::move(rl));
    sched.submit(std::move(rh));
    sched.run_until_idle();
    ASSERT_FALSE(order.empty());
    // The high-priority request finishes all its tokens before the other starts.
    const auto first_low = std::find(order.begin(), order.end(), 0) - order.begin();
    EXPECT_EQ(std::count(order.begin(), order.begin() + first_low, 1), std::count(order.begin(), order.end(), 1));
  }
  {
    Scheduler sched(engine, so);
    auto x = engine.new_session(), y = engine.new_session();
    std::vector<int> order;
    for (int k = 0; k < 2; ++k) {
      Request r = request(k == 0 ? *x : *y, static_cast<std::size_t>(k), greedy(8));
      r.options.stop_at_end_of_generation = false;
      r.on_token = [&order, k](TokenId) { order.push_back(k); };
      sched.submit(std::move(r));
    }
    sched.run_until_idle();
    // Equal priority, one session per pass: once both decode they alternate.
    ASSERT_EQ(order.size(), 16u);
    for (std::size_t i = 2; i + 1 < order.size() - 1; ++i) EXPECT_NE(order[i], order[i + 1]) << i;
  }
}

TEST_F(SchedulerTest, StreamedTextIsTheResultTextAndACallbackErrorFailsOnlyItsRequest) {
  Engine engine(*model_, EngineOptions{1});
  Scheduler sched(engine);
  auto a = engine.new_session(), b = engine.new_session(), ref = engine.new_session();
  std::string streamed;
  Request ra = request(*a, 2, greedy(20));
  ra.on_text = [&](std::string_view t) { streamed += t; };
  Request rb = request(*b, 3, greedy(20));
  rb.on_token = [n = 0](TokenId) mutable {
    if (++n == 3) fail(ErrorCode::io, "client went away");
  };
  const RequestId ida = sched.submit(std::move(ra));
  const RequestId idb = sched.submit(std::move(rb));
  sched.run_until_idle();
  const auto done = by_id(sched.take_finished());
  EXPECT_EQ(streamed, done.at(ida).generation.text);
  EXPECT_EQ(done.at(ida).generation.tokens, generate(engine, *ref, prompts_[2], greedy(20)).tokens);
  ASSERT_TRUE(done.at(idb).error.has_value());
  EXPECT_EQ(done.at(idb).error->code(), ErrorCode::io);
  EXPECT_EQ(done.at(idb).generation.stop_reason, StopReason::error);
  EXPECT_EQ(done.at(idb).generation.tokens.size(), 3u);
}

TEST_F(SchedulerTest, CancelEndsOneRequestMidBatchAndTheOthersAreUnchanged) {
  EngineOptions eo;
  eo.n_threads = 2;
  eo.exact_matmul = true;
  Engine engine(*model_, eo);
  Scheduler sched(engine);
  auto a = engine.new_session(), b = engine.new_session(), ref = engine.new_session();
  GenerateOptions o = greedy(30);
  o.stop_at_end_of_generation = false;
  const RequestId ida = sched.submit(request(*a, 0, o));
  const RequestId idb = sched.submit(request(*b, 1, o));
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(sched.step());
  EXPECT_TRUE(sched.cancel(ida));
  sched.run_until_idle();
  const auto done = by_id(sched.take_finished());
  EXPECT_EQ(done.at(ida).generation.stop_reason, StopReason::cancelled);
  EXPECT_EQ(done.at(ida).generation.tokens.size(), 5u);
  EXPECT_FALSE(done.at(ida).error.has_value());
  // Its session holds the prompt and the tokens fed so far (the last sampled one is not fed).
  EXPECT_EQ(a->n_past(), static_cast<int>(prompts_[0].size()) + 4);
  EXPECT_EQ(done.at(idb).generation.tokens, generate(engine, *ref, prompts_[1], o).tokens);
  EXPECT_FALSE(sched.cancel(ida));  // finished
  EXPECT_FALSE(sched.cancel(12345));
}

TEST_F(SchedulerTest, ContextLimitAndPoolExhaustionEndOnlyTheirRequest) {
  Engine engine(*model_, EngineOptions{2});
  const KvShape shape = engine.kv_shape();
  const KvFormat f = KvFormat::parse("int8");
  auto tiny = KvPool::create(PoolConfig{shape, 32, KvPool::arena_bytes_for(shape, 32, f, 64)});
  auto roomy = KvPool::create(PoolConfig{shape, 32, 16 << 20});
  auto starving = std::make_unique<Session>(std::make_unique<PooledKvCache>(tiny, f, 512));
  auto shortctx = std::make_unique<Session>(std::make_unique<PooledKvCache>(roomy, f, 24));
  auto fine = std::make_unique<Session>(std::make_unique<PooledKvCache>(roomy, f, 512));
  auto ref = std::make_unique<Session>(std::make_unique<PooledKvCache>(roomy, f, 512));
  GenerateOptions o = greedy(100);
  o.stop_at_end_of_generation = false;
  Scheduler sched(engine);
  const RequestId is = sched.submit(request(*starving, 5, o));
  const RequestId ic = sched.submit(request(*shortctx, 4, o));
  const RequestId ifine = sched.submit(request(*fine, 0, greedy(30)));
  sched.run_until_idle();
  const auto done = by_id(sched.take_finished());
  ASSERT_TRUE(done.at(is).error.has_value());
  EXPECT_EQ(done.at(is).error->code(), ErrorCode::out_of_memory) << done.at(is).error->what();
  // Nothing half written: the session holds the prompt and every token fed
  // before the pass that found the pool full (the last sampled one failed).
  EXPECT_EQ(starving->n_past(), static_cast<int>(prompts_[5].size() + done.at(is).generation.tokens.size()) - 1);
  EXPECT_EQ(starving->cache().size(), starving->n_past());
  EXPECT_GE(starving->n_past(), 32);
  EXPECT_EQ(done.at(ic).generation.stop_reason, StopReason::context_full);
  EXPECT_EQ(shortctx->n_past(), 24);
  EXPECT_EQ(done.at(ifine).generation.tokens, generate(engine, *ref, prompts_[0], greedy(30)).tokens);
  starving.reset();
  EXPECT_EQ(tiny->counters().blocks_used, 0u);
}

TEST_F(SchedulerTest, BadSubmissionsAreClearErrors) {
  Engine engine(*model_, EngineOptions{1});
  Scheduler sched(engine);
  auto s = engine.new_session(16);
  const auto code = [&](Request r) {
    try {
      sched.submit(std::move(r));
    } catch (const Error& e) {
      return e.code();
    }
    return ErrorCode::internal;
  };
  Request r;
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);  // no session
  r.session = s.get();
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);  // no prompt
  r.prompt.assign(20, 3);
  EXPECT_EQ(code(r), ErrorCode::context_full);
  r.prompt = {1, 100000};
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);
  r.prompt = {1, 2};
  r.options.sampling.top_p = 2.0f;
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);
  r.options.sampling.top_p = 0.9f;
  r.options.max_new_tokens = -1;
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);
  r.options.max_new_tokens = 2;
  sched.submit(r);
  EXPECT_EQ(code(r), ErrorCode::invalid_argument);  // the session is taken
  EXPECT_EQ(sched.size(), 1u);
  sched.run_until_idle();
  EXPECT_NO_THROW(sched.submit(r));  // free again
  EXPECT_THROW(Scheduler(engine, SchedulerOptions{0, 0}), Error);
}

// submit() and cancel() from other threads while one thread steps (run under TSan in CI).
TEST_F(SchedulerTest, SubmitAndCancelFromOtherThreads) {
  Engine engine(*model_, EngineOptions{2});
  Scheduler sched(engine);
  constexpr int kRequests = 12;
  std::vector<std::unique_ptr<Session>> sessions;
  for (int i = 0; i < kRequests; ++i) sessions.push_back(engine.new_session(256));
  std::atomic<int> submitted{0};
  std::thread producer([&] {
    for (int i = 0; i < kRequests; ++i) {
      const RequestId id = sched.submit(request(*sessions[static_cast<std::size_t>(i)],
                                                static_cast<std::size_t>(i) % prompts_.size(), greedy(16)));
      if (i % 3 == 0) sched.cancel(id);
      ++submitted;
      std::this_thread::yield();
    }
  });
  std::size_t finished = 0;
  while (finished < kRequests) {
    sched.step();
    finished += sched.take_finished().size();
    if (submitted == kRequests && sched.size() == 0) break;
  }
  producer.join();
  sched.run_until_idle();
  finished += sched.take_finished().size();
  EXPECT_EQ(finished, static_cast<std::size_t>(kRequests));
}

}  // namespace
}  // namespace qkvshare
