// The orchestrator on stories260K: exact continue semantics, context
// lifetimes (pool counters) and the modes agreeing with each other.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>

#include "qkvshare/agents/compare.hpp"
#include "qkvshare/agents/demo_workflow.hpp"
#include "qkvshare/agents/orchestrator.hpp"
#include "qkvshare/engine/generate.hpp"
#include "qkvshare/kv/kv_codebook.hpp"
#include "qkvshare/model/model.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/model/synthetic_model.hpp"
#include "test_paths.hpp"

namespace qkvshare::agents {
namespace {

const std::string kModel = testing::shared_path("models/stories260K.bin");
const std::string kTok = testing::shared_path("models/tok512.bin");

const char* kChain = R"(name: chain
agents:
  teller:
    system: A story.
    prompt: Once upon a time there was a cat.
    max_tokens: 40
  continuer:
    prompt: The next day the cat
    max_tokens: 30
steps:
  - {id: first, agent: teller}
  - {id: second, agent: continuer, inputs: [{from: first, mode: continue}]}
)";

RunOptions options(RunMode mode, const std::string& kv) {
  RunOptions o;
  o.mode = mode;
  o.kv = kv;
  o.threads = 1;
  o.context = 512;
  return o;
}

std::vector<TokenId> encode(const Tokenizer& tok, const std::string& text) { return tok.encode(text, true); }

TEST(Orchestrator, ContinueEqualsOneSessionRunningTheSameTokens) {
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  const RunReport r = run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "f32"));
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_EQ(r.steps[1].handoff, "continue");
  EXPECT_GT(r.steps[1].prefill_reused, 0);

  // The same token sequence through one plain session, without any handoff.
  auto model = Model::load(kModel, kTok);
  Engine engine(*model, EngineOptions{1});
  auto session = engine.new_session(512);
  const Tokenizer& tok = model->tokenizer();
  GenerateOptions go;
  go.sampling.temperature = 0.0f;
  go.max_new_tokens = 40;
  std::vector<TokenId> feed{tok.bos_id()};
  const auto first = encode(tok, "A story.\nOnce upon a time there was a cat.\n");
  feed.insert(feed.end(), first.begin(), first.end());
  const GenerateResult g1 = generate(engine, *session, feed, go);
  EXPECT_EQ(g1.tokens, r.steps[0].output_tokens);

  std::vector<TokenId> feed2;
  if (!g1.tokens.empty() && g1.stop_reason != StopReason::end_of_generation) feed2.push_back(g1.tokens.back());
  const auto second = encode(tok, "\nThe next day the cat\n");
  feed2.insert(feed2.end(), second.begin(), second.end());
  go.max_new_tokens = 30;
  const GenerateResult g2 = generate(engine, *session, feed2, go);
  EXPECT_EQ(g2.tokens, r.steps[1].output_tokens);
  EXPECT_EQ(r.steps[1].prefill_computed, static_cast<int>(feed2.size()));
}

// Dropping tokens at handoff (budget=) would break the steps' token
// positions: refused by name before anything loads, for --kv and per agent.
TEST(Orchestrator, RefusesFormatsThatDropTokens) {
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  try {
    run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "int8:budget=0.5"));
    FAIL() << "a budget format was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(e.what()).find("--kv"), std::string::npos) << e.what();
  }
  std::string per_agent = kChain;
  per_agent.replace(per_agent.find("    max_tokens: 30"), 18, "    max_tokens: 30\n    kv: f16:budget=0.4");
  try {
    run_workflow(Workflow::parse(per_agent, "chain.yaml"), kModel, kTok, options(RunMode::qkvshare, "int8"));
    FAIL() << "a budget format was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("agent 'continuer'"), std::string::npos) << e.what();
  }
}

// A pq format hands off by codebook id within the run's one process: the
// continuing step reuses the context; a codebook of another model is refused.
TEST(Orchestrator, PqFormatsHandOffAndRefuseAnotherModelsCodebook) {
  const auto model = Model::load(kModel, kTok);
  const KvShape shape = Engine(*model, EngineOptions{1}).kv_shape();
  KvCodebook::Header h = KvCodebook::Header::of(shape, 4, 256);
  h.model = model_fingerprint(*model).model;
  std::vector<float> rows(static_cast<std::size_t>(shape.n_layers) * 256 * shape.kv_dim());
  for (std::size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f;
  CodebookTraining how;
  how.iterations = 2;
  const std::string ours = testing::temp_dir() + "/orchestrator-pq2.kvc", theirs = testing::temp_dir() + "/other-pq2.kvc";
  train_codebook(h, rows, rows, 256, how).save(ours);
  h.model[0] ^= 1;
  train_codebook(h, rows, rows, 256, how).save(theirs);
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  const RunReport r = run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "pq2:book=" + ours));
  EXPECT_GT(r.steps[1].prefill_reused, 0);
  try {
    run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "pq2:book=" + theirs));
    FAIL() << "another model's codebook was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("learned on another model"), std::string::npos) << e.what();
  }
}

// --float-activations for workflows: every engine gets the f32 weight copies,
// and the run reports them in its weight bytes.
TEST(Orchestrator, FloatActivationsCountTheirWeightCopies) {
  const std::string path = testing::temp_dir() + "/orchestrator-float-acts.gguf";
  SyntheticOptions so;
  so.type = GgmlType::Q4_0;
  write_synthetic_model(find_synthetic_shape("tiny-llama"), so, path);
  const auto model = Model::load(path);
  EngineOptions eo;
  eo.float_activations = true;
  const std::size_t copies = Engine(*model, eo).float_copy_bytes();
  ASSERT_GT(copies, 0u);
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  RunOptions o = options(RunMode::qkvshare, "int8");
  o.float_activations = true;
  const RunReport r = run_workflow(wf, path, "", o);
  EXPECT_EQ(r.weight_copies_bytes, model->weight_bytes() + copies);
  EXPECT_EQ(r.pool_blocks_used_at_end, 0u);
  o.mode = RunMode::independent;  // one engine, and one set of copies, per agent
  EXPECT_EQ(run_workflow(wf, path, "", o).weight_copies_bytes, 2 * (model->weight_bytes() + copies));
  o.float_activations = false;
  EXPECT_EQ(run_workflow(wf, path, "", o).weight_copies_bytes, 2 * model->weight_bytes());
}

TEST(Orchestrator, NoContextOutlivesItsLastConsumer) {
  const char* fanout = R"(agents:
  reader: {prompt: "The dog ran to the park and found a red ball.", max_tokens: 0}
  asker: {prompt: "What did the dog find?", max_tokens: 12}
steps:
  - {id: doc, agent: reader}
  - {id: q1, agent: asker, inputs: [{from: doc, mode: fork}]}
  - {id: q2, agent: asker, inputs: [{from: doc, mode: fork}]}
  - {id: q3, agent: asker, inputs: [{from: doc, mode: fork}]}
  - {id: sum, agent: asker, inputs: [q1, q2, q3]}
)";
  const Workflow wf = Workflow::parse(fanout, "fanout.yaml");
  for (const char* kv : {"f32", "int8", "int4", "int2"}) {
    const RunReport r = run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, kv));
    EXPECT_EQ(r.contexts_alive_at_end, 0) << kv;
    EXPECT_EQ(r.pool_blocks_used_at_end, 0u) << kv;
    for (int i = 1; i <= 3; ++i) {
      EXPECT_EQ(r.steps[static_cast<std::size_t>(i)].handoff, "fork") << kv;
      EXPECT_EQ(r.steps[static_cast<std::size_t>(i)].prefill_reused, r.steps[0].prefill_computed) << kv;
    }
    // The three forks ask the same question of the same context: same answer.
    EXPECT_EQ(r.steps[1].output_tokens, r.steps[2].output_tokens) << kv;
  }
}

TEST(Orchestrator, TextModesRecomputeWhatQkvshareReuses) {
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  const RunReport shared = run_workflow(wf, kModel, kTok, options(RunMode::shared_text, "f16"));
  const RunReport indep = run_workflow(wf, kModel, kTok, options(RunMode::independent, "f16"));
  const RunReport kv = run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "f16"));
  EXPECT_EQ(shared.steps[1].handoff, "text");
  EXPECT_EQ(shared.steps[1].prefill_reused, 0);
  EXPECT_GT(shared.steps[1].prefill_computed, kv.steps[1].prefill_computed);
  EXPECT_LT(kv.prefill_computed, shared.prefill_computed);
  // One engine or two, the same f16 text pipeline gives the same tokens.
  for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(shared.steps[i].output_tokens, indep.steps[i].output_tokens);
  EXPECT_EQ(indep.weight_copies_bytes, 2 * shared.weight_copies_bytes);
}

// The built-in demo is examples/w4_roles.yaml with its source, compiled in.
TEST(Orchestrator, DemoIsTheW4WorkflowWithItsSource) {
  const Workflow demo = demo_workflow();
  const Workflow w4 = Workflow::load(testing::source_path("examples/w4_roles.yaml"));
  EXPECT_EQ(demo.documents, w4.documents);
  ASSERT_EQ(demo.steps.size(), w4.steps.size());
  for (std::size_t i = 0; i < demo.steps.size(); ++i) EXPECT_EQ(demo.steps[i].id, w4.steps[i].id);
  for (const auto& [name, agent] : w4.agents) {
    EXPECT_EQ(demo.agents.at(name).system, agent.system) << name;
    EXPECT_EQ(demo.agents.at(name).prompt, agent.prompt) << name;
  }
}

// On a short context the source is cut after a whole sentence, leaving room
// for the replies; on a long one it is kept whole.
TEST(Orchestrator, DemoSourceIsCutToFitTheContext) {
  const auto model = Model::load(kModel, kTok);
  Workflow whole = demo_workflow();
  const std::string text = whole.documents.at("source");
  const SourceFit all = fit_demo_source(whole, model->tokenizer(), 1 << 20, 0);
  EXPECT_FALSE(all.cut());
  EXPECT_EQ(whole.documents.at("source"), text);
  EXPECT_EQ(all.kept_tokens, all.total_tokens);

  Workflow cut = demo_workflow();
  const SourceFit fit = fit_demo_source(cut, model->tokenizer(), 512, 40);
  ASSERT_TRUE(fit.cut());
  EXPECT_GT(fit.kept_sentences, 0);
  EXPECT_LT(fit.kept_tokens, 512 - 3 * 40);
  EXPECT_EQ(fit.total_tokens, all.total_tokens);
  const std::string& kept = cut.documents.at("source");
  EXPECT_EQ(text.compare(0, kept.size(), kept), 0);  // a prefix
  EXPECT_TRUE(kept.back() == '.' || kept.back() == '\n') << kept;
  EXPECT_EQ(static_cast<int>(model->tokenizer().encode(kept).size()), fit.kept_tokens);
}

TEST(Orchestrator, DemoComparisonRunsEndToEnd) {
  Workflow wf = demo_workflow();
  RunOptions o = options(RunMode::qkvshare, "int8");
  o.max_tokens_cap = 40;  // stories260K has a 512-token context: the source is cut to fit
  fit_demo_source(wf, Model::load(kModel, kTok)->tokenizer(), 512, o.max_tokens_cap);
  const auto runs = compare_modes(wf, kModel, kTok, o, default_comparison());
  ASSERT_EQ(runs.size(), default_comparison().size());
  for (const auto& r : runs) {
    EXPECT_GT(r.peak_rss_bytes, 0u) << r.spec.label();
    EXPECT_EQ(r.report.steps.size(), 3u);
    // Equal work: every mode generates the reference's tokens.
    for (std::size_t i = 0; i < 3; ++i)
      EXPECT_EQ(r.report.steps[i].output_tokens, runs[0].report.steps[i].output_tokens) << r.spec.label();
    EXPECT_DOUBLE_EQ(r.agreement, 1.0);
    // Every run has the team overhead against solo; solo's own distributions are not scored.
    EXPECT_GT(r.team_time, 0.0) << r.spec.label();
    EXPECT_GT(r.team_rss, 0.0) << r.spec.label();
    if (r.spec.mode == RunMode::solo) continue;
    EXPECT_GT(r.ppl, 1.0) << r.spec.label();
    EXPECT_GE(r.kl, 0.0);
  }
  EXPECT_EQ(runs.back().spec.label(), "solo");
  EXPECT_DOUBLE_EQ(runs.back().team_time, 1.0);
  EXPECT_EQ(runs[0].spec.label(), "shared-text:f32");
  EXPECT_NEAR(runs[0].kl, 0.0, 1e-6);  // its own rows, rounded to float once
  EXPECT_DOUBLE_EQ(runs[0].top1, 1.0);
  // f16 KV stays closer to the f32 reference than int2 KV.
  EXPECT_LT(runs[3].kl, runs[6].kl);
  EXPECT_GT(runs[6].kl, 0.0);
  EXPECT_NE(format_comparison(runs).find("qkvshare:int4"), std::string::npos);
}

// Ready steps run together through the scheduler: W2-like forks start at
// once and share forward passes, and with exact matmuls every output equals
// the one-step-at-a-time run's (batching changes no result).
TEST(Orchestrator, ConcurrentForksShareForwardPassesAndChangeNoOutput) {
  const char* fanout = R"(agents:
  reader: {prompt: "The dog ran to the park and found a red ball under a big tree.", max_tokens: 0}
  a: {prompt: "What did the dog find?", max_tokens: 16}
  b: {prompt: "Where did the dog go?", max_tokens: 20}
  c: {prompt: "Once upon a time", max_tokens: 24, temperature: 0.8, seed: 7}
  sum: {prompt: "All together:", max_tokens: 10}
steps:
  - {id: doc, agent: reader}
  - {id: q1, agent: a, inputs: [{from: doc, mode: fork}]}
  - {id: q2, agent: b, inputs: [{from: doc, mode: fork}]}
  - {id: q3, agent: c, inputs: [{from: doc, mode: fork}]}
  - {id: chain, agent: a, inputs: [{from: q1, mode: continue}]}
  - {id: total, agent: sum, inputs: [q2, q3, chain]}
)";
  const Workflow wf = Workflow::parse(fanout, "fanout.yaml");
  for (const RunMode mode : {RunMode::qkvshare, RunMode::shared_text}) {
    for (const char* kv : {"f32", "int4"}) {
      if (mode == RunMode::shared_text && std::string(kv) != "f32") continue;
      RunOptions o = options(mode, kv);
      o.threads = 2;
      o.exact_matmul = true;
      o.concurrent = false;
      const RunReport seq = run_workflow(wf, kModel, kTok, o);
      o.concurrent = true;
      const RunReport con = run_workflow(wf, kModel, kTok, o);
      ASSERT_EQ(seq.steps.size(), con.steps.size());
      for (std::size_t i = 0; i < seq.steps.size(); ++i) {
        EXPECT_EQ(con.steps[i].step, seq.steps[i].step);
        EXPECT_EQ(con.steps[i].output_tokens, seq.steps[i].output_tokens) << kv << " " << seq.steps[i].step;
        EXPECT_EQ(con.steps[i].prefill_computed, seq.steps[i].prefill_computed);
        EXPECT_EQ(con.steps[i].prefill_reused, seq.steps[i].prefill_reused);
      }
      // q1..q3 overlap in time: each starts before the others end; chain waits for q1, total for all.
      const auto& s = con.steps;
      for (int i = 1; i <= 3; ++i)
        for (int j = 1; j <= 3; ++j)
          EXPECT_LT(s[static_cast<std::size_t>(i)].start_seconds,
                    s[static_cast<std::size_t>(j)].start_seconds + s[static_cast<std::size_t>(j)].seconds);
      EXPECT_GE(s[4].start_seconds, s[1].start_seconds + s[1].seconds - 1e-6);
      EXPECT_GE(s[5].start_seconds, s[4].start_seconds + s[4].seconds - 1e-6);
      EXPECT_LT(con.forward_passes, seq.forward_passes * 3 / 4) << kv;
      if (mode == RunMode::qkvshare) {
        EXPECT_EQ(con.contexts_alive_at_end, 0);
        EXPECT_EQ(con.pool_blocks_used_at_end, 0u);
      }
    }
  }
}

// The team overhead's denominator: one session writes every answer (the
// reference run's tokens), the material read once: nothing recomputed, nothing
// reused, the second turn feeding only its own prompt.
TEST(Orchestrator, SoloWritesTheReferenceAnswersInOneSession) {
  const Workflow wf = Workflow::parse(kChain, "chain.yaml");
  char trace[] = "/tmp/qkvshare-solo-trace-XXXXXX";
  const int fd = ::mkstemp(trace);
  ASSERT_GE(fd, 0);
  ::close(fd);
  RunOptions o = options(RunMode::shared_text, "f16");
  o.record_reference = trace;
  const RunReport ref = run_workflow(wf, kModel, kTok, o);
  o = options(RunMode::solo, "f16");
  o.force_reference = trace;
  const RunReport r = run_workflow(wf, kModel, kTok, o);
  ::unlink(trace);
  ASSERT_EQ(r.steps.size(), 2u);
  EXPECT_EQ(r.mode, RunMode::solo);
  for (std::size_t i = 0; i < 2; ++i) EXPECT_EQ(r.steps[i].output_tokens, ref.steps[i].output_tokens);
  EXPECT_EQ(r.prefill_reused, 0);
  // The text re-read feeds step one's prompt and answer again; solo only the new turn (and the answer's last token).
  EXPECT_EQ(r.steps[0].prefill_computed, ref.steps[0].prefill_computed);
  EXPECT_GT(r.steps[1].prefill_computed, 1);
  EXPECT_LT(r.steps[1].prefill_computed, ref.steps[1].prefill_computed - ref.steps[0].prefill_computed);
  EXPECT_GT(r.peak_kv_bytes, 0u);
  EXPECT_EQ(parse_run_mode("solo"), RunMode::solo);
}

TEST(Orchestrator, TokenAgreement) {
  EXPECT_DOUBLE_EQ(token_agreement({1, 2, 3}, {1, 2, 3}), 1.0);
  EXPECT_DOUBLE_EQ(token_agreement({1, 2, 3, 4}, {1, 2}), 0.5);
  EXPECT_DOUBLE_EQ(token_agreement({}, {}), 1.0);
}

const char* kRoles = R"(name: roles
agents:
  teller:
    system: A story about a dog.
    prompt: Once upon a time there was a dog named Max.
    max_tokens: 40
  writer:
    system: A story about a cat.
    prompt: The end.
    max_tokens: 20
  reviewer:
    system: A story about a bird.
    prompt: And then
    max_tokens: 20
steps:
  - {id: tell, agent: teller}
  - {id: write, agent: writer, inputs: [{from: tell, mode: splice, span: both, recompute: 0.25}]}
  - {id: review, agent: reviewer, inputs: [{from: tell, mode: splice}, {from: write, mode: splice, recompute: 1.0}]}
)";

// Splice edges: every mode reads the same token ids, the KV modes reuse the
// producers' blocks, 100% recompute is a text handoff, and nothing is left
// in the pool at the end.
TEST(Orchestrator, SpliceReusesTheRepliesAndReleasesEverything) {
  const Workflow wf = Workflow::parse(kRoles, "roles.yaml");
  RunOptions o = options(RunMode::qkvshare, "f32");
  o.splice.guard = false;
  const RunReport r = run_workflow(wf, kModel, kTok, o);
  const RunReport text = run_workflow(wf, kModel, kTok, options(RunMode::shared_text, "f16"));
  ASSERT_EQ(r.steps.size(), 3u);
  EXPECT_EQ(r.steps[1].handoff, "splice");
  EXPECT_EQ(text.steps[1].handoff, "text");
  // The writer reads the teller's prompt and reply: same tokens as the text run.
  EXPECT_EQ(r.steps[1].prefill_computed + r.steps[1].prefill_reused, text.steps[1].prefill_computed);
  EXPECT_EQ(r.steps[1].splice_tokens, r.steps[1].splice_recomputed + r.steps[1].prefill_reused);
  EXPECT_NEAR(r.steps[1].splice_recomputed, 0.25 * r.steps[1].splice_tokens, 1.0);  // 25% of each of the two runs
  EXPECT_GT(r.steps[1].prefill_reused, 10);
  // The reviewer splices two inputs; the writer's reply entirely recomputed.
  EXPECT_EQ(r.steps[2].prefill_computed + r.steps[2].prefill_reused, text.steps[2].prefill_computed);
  EXPECT_EQ(r.splices, 2 + 2);  // the teller's prompt and reply; the teller's and the writer's replies
  EXPECT_EQ(r.contexts_alive_at_end, 0);
  EXPECT_EQ(r.pool_blocks_used_at_end, 0u);
  // With the guard on, its decision is in the metrics.
  const RunReport g = run_workflow(wf, kModel, kTok, options(RunMode::qkvshare, "int4"));
  EXPECT_GE(g.steps[1].guard_estimate, 0.0);
  EXPECT_GT(g.steps[1].guard_probe_tokens, 0);
  EXPECT_GE(g.steps[1].recompute_fraction, 0.25);
  EXPECT_EQ(g.pool_blocks_used_at_end, 0u);
}

}  // namespace
}  // namespace qkvshare::agents
