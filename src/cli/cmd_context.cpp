// qkvshare context inspect|release|revoke: look at and end handed-off contexts.
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/share/share_pool.hpp"

namespace qkvshare::cli {

namespace {

struct ContextArgs {
  std::string descriptor, pool, agent;
  ModelArgs model;
  bool verify = false;
};

// Prints the JSON view and every check; fails (exit 1) when one failed.
void run_inspect(const ContextArgs& a) {
  const Descriptor d = read_descriptor_file(a.descriptor);
  nlohmann::json out;
  out["descriptor"] = nlohmann::json::parse(d.json());
  out["checks"]["layout"] = "ok";  // magic, version, size, self checksum, field ranges
  std::string problem;
  if (!a.pool.empty()) {
    auto pool = SharePool::attach(a.pool);
    const DescriptorStatus st = pool->check(d, a.verify);
    out["checks"]["pool_matches"] = st.pool_matches;
    out["checks"]["capability_valid"] = st.capability_valid;
    out["checks"]["live"] = st.live;
    out["checks"]["checksums_match"] = st.checksums_match;
    if (a.verify) out["checks"]["blocks_verified"] = st.blocks_verified;
    problem = st.problem;
  } else if (a.verify) {
    fail(ErrorCode::invalid_argument, "--verify needs --pool NAME (the blocks live in the pool)");
  }
  if (!a.model.model_path.empty()) {
    auto model = load_model(a.model);
    const ModelFingerprint fp = model_fingerprint(*model);
    const bool same = fp.model == d.fingerprint.model;
    out["checks"]["model_matches"] = same;
    out["checks"]["tokenizer_matches"] = fp.tokenizer == d.fingerprint.tokenizer;
    if (!same && problem.empty())
      problem = fmt::format("made by model {}, not by {} ({}): a consumer would fall back to text",
                            d.fingerprint.hex(), a.model.model_path, fp.hex());
  }
  out["valid"] = problem.empty();
  if (!problem.empty()) out["problem"] = problem;
  std::cout << out.dump(2) << "\n";
  std::cout.flush();
  if (!problem.empty()) fail(ErrorCode::bad_descriptor, "{}: {}", a.descriptor, problem);
}

void run_release(const ContextArgs& a, bool revoke) {
  const Descriptor d = read_descriptor_file(a.descriptor);
  auto pool = SharePool::attach(a.pool);
  if (revoke) {
    pool->revoke(d, a.agent);
    std::fprintf(stderr, "revoked context %llu and all its grants\n", static_cast<unsigned long long>(d.context_id));
  } else {
    pool->release(d, a.agent);
    std::fprintf(stderr, "released %s's grant of context %llu\n", a.agent.c_str(),
                 static_cast<unsigned long long>(d.context_id));
  }
}

}  // namespace

void register_context(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("context", "Inspect, release or revoke handed-off contexts");
  cmd->require_subcommand(1);

  auto ins = std::make_shared<ContextArgs>();
  CLI::App* inspect = cmd->add_subcommand("inspect", "Print a descriptor as JSON and check it (exit 1 if invalid)");
  inspect->add_option("descriptor", ins->descriptor, "Descriptor file")->required();
  inspect->add_option("--pool", ins->pool, "Check it against this pool: capability, liveness, checksums");
  inspect->add_flag("--verify", ins->verify, "Rehash the context's blocks and compare (needs --pool)");
  inspect->add_option("-m,--model", ins->model.model_path, "Check the model fingerprint against this model");
  inspect->add_option("-t,--tokenizer", ins->model.tokenizer_path, "Tokenizer file (llama2.c models)");
  inspect->callback([ins] { run_inspect(*ins); });

  for (const bool revoke : {false, true}) {
    auto args = std::make_shared<ContextArgs>();
    CLI::App* sub = cmd->add_subcommand(revoke ? "revoke" : "release",
                                        revoke ? "End a context and every grant of it (its producer only)"
                                               : "End this grantee's grant (the descriptor goes stale)");
    sub->add_option("descriptor", args->descriptor, "Descriptor file")->required();
    sub->add_option("--pool", args->pool, "Pool name")->required();
    sub->add_option("--agent", args->agent, revoke ? "The producer's agent id" : "The grantee's agent id")->required();
    sub->callback([args, revoke] { run_release(*args, revoke); });
  }
}

}  // namespace qkvshare::cli
