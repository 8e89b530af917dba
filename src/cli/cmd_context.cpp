// qkvshare context inspect|release|revoke: look at and end handed-off contexts;
// export|import: move a context between pools (and machines) in the portable
// format (docs/tiers.md); keygen: a key file for encrypted exports.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <optional>
#include <nlohmann/json.hpp>

#include "common.hpp"
#include "qkvshare/core/error.hpp"
#include "qkvshare/core/file_io.hpp"
#include "qkvshare/core/mapped_file.hpp"
#include "qkvshare/share/fingerprint.hpp"
#include "qkvshare/share/share_pool.hpp"
#include "qkvshare/tiers/context_io.hpp"
#include "qkvshare/tiers/crypto.hpp"
#include "qkvshare/tiers/redis_tier.hpp"

namespace qkvshare::cli {

namespace {

struct ContextArgs {
  std::string descriptor, pool, agent;
  ModelArgs model;
  bool verify = false;
};

struct TransferArgs {
  std::string input, output, pool, agent, key, redis = "127.0.0.1:6379", name;
  int ttl = 3600, timeout_ms = 2000;
  std::vector<std::string> grants;
  ModelArgs model;
};

std::optional<KeyCipher> key_of(const std::string& path) {
  if (path.empty()) return std::nullopt;
  return KeyCipher::from_file(path);
}

void run_export(const TransferArgs& a) {
  const Descriptor d = read_descriptor_file(a.input);
  auto pool = SharePool::attach(a.pool);
  const auto key = key_of(a.key);
  const std::uint64_t bytes = write_file_atomic(a.output, [&](const ByteSink& sink) {
    export_descriptor(*pool, d, a.agent, sink, key ? &*key : nullptr);
  }, 0600);
  std::fprintf(stderr, "exported context %llu (%u tokens, %s) to %s: %llu bytes\n",
               static_cast<unsigned long long>(d.context_id), d.token_count, key ? "encrypted" : "not encrypted",
               a.output.c_str(), static_cast<unsigned long long>(bytes));
}

RedisOptions redis_options(const TransferArgs& a) {
  RedisOptions o;
  const auto colon = a.redis.rfind(':');
  if (colon == std::string::npos || colon == 0)
    fail(ErrorCode::invalid_argument, "--redis: '{}' is not HOST:PORT", a.redis);
  o.host = a.redis.substr(0, colon);
  try {
    std::size_t used = 0;
    o.port = std::stoi(a.redis.substr(colon + 1), &used);
    if (used != a.redis.size() - colon - 1) throw std::invalid_argument("port");
  } catch (const std::exception&) {
    fail(ErrorCode::invalid_argument, "--redis: '{}' is not HOST:PORT", a.redis);
  }
  o.ttl_seconds = a.ttl;
  o.timeout_ms = a.timeout_ms;
  if (!a.key.empty()) o.cipher = std::make_shared<KeyCipher>(KeyCipher::from_file(a.key));
  return o;
}

void run_push(const TransferArgs& a) {
  RedisTier tier(redis_options(a));  // a bad --redis or --key before anything else
  const Descriptor d = read_descriptor_file(a.input);
  auto pool = SharePool::attach(a.pool);
  const PushResult r = tier.push(*pool, d, a.agent, a.name);
  write_file_atomic(a.output, [&](const ByteSink& sink) {
    const std::string j = r.ref.json() + "\n";
    sink(std::span(reinterpret_cast<const std::uint8_t*>(j.data()), j.size()));
  });
  std::fprintf(stderr, "pushed context %llu as '%s' to redis %s: %d blocks, %d new, %llu bytes sent; reference in %s\n",
               static_cast<unsigned long long>(d.context_id), a.name.c_str(), a.redis.c_str(), r.blocks,
               r.blocks_stored, static_cast<unsigned long long>(r.bytes_sent), a.output.c_str());
}

void run_pull(const TransferArgs& a) {
  check_input_file(a.input, "remote context reference");
  std::ifstream in(a.input);
  if (!in) fail(ErrorCode::io, "{}: cannot open the remote context reference", a.input);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const RemoteRef ref = RemoteRef::parse(text, a.input);
  TransferArgs b = a;
  if (b.redis == "127.0.0.1:6379") b.redis = ref.host + ":" + std::to_string(ref.port);
  RedisTier tier(redis_options(b));
  const std::vector<std::uint8_t> bytes = tier.fetch(ref.name);
  const ContextReader reader(bytes, "remote context '" + ref.name + "'");
  const auto key = key_of(a.key);
  auto pool = SharePool::attach(a.pool);
  const SealedContext sealed = import_sealed(*pool, reader, a.agent, &ref.fingerprint, key ? &*key : nullptr);
  for (const std::string& g : a.grants) {
    const std::string path = a.grants.size() == 1 ? a.output : a.output + "." + g;
    write_descriptor_file(path, pool->grant(sealed, a.agent, g));
    std::fprintf(stderr, "pulled '%s' (%d tokens) as context %llu, granted to '%s' in %s\n", ref.name.c_str(),
                 sealed.tokens, static_cast<unsigned long long>(sealed.context_id), g.c_str(), path.c_str());
  }
  pool->release(sealed);
}

void run_import(const TransferArgs& a) {
  const MappedFile file(a.input);
  const ContextReader reader(file.bytes(), a.input);
  const auto key = key_of(a.key);
  std::optional<ModelFingerprint> expected;
  if (!a.model.model_path.empty()) expected = model_fingerprint(*load_model(a.model));
  auto pool = SharePool::attach(a.pool);
  const SealedContext sealed = import_sealed(*pool, reader, a.agent, expected ? &*expected : nullptr,
                                             key ? &*key : nullptr);
  for (const std::string& g : a.grants) {
    const std::string path = a.grants.size() == 1 ? a.output : a.output + "." + g;
    write_descriptor_file(path, pool->grant(sealed, a.agent, g));
    std::fprintf(stderr, "imported %s as context %llu (%d tokens), granted to '%s' in %s\n", a.input.c_str(),
                 static_cast<unsigned long long>(sealed.context_id), sealed.tokens, g.c_str(), path.c_str());
  }
  pool->release(sealed);  // the grants keep it now
}

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

  auto ex = std::make_shared<TransferArgs>();
  CLI::App* exp = cmd->add_subcommand("export", "Write a descriptor's context to a portable context file");
  exp->add_option("descriptor", ex->input, "Descriptor file (granted to --agent)")->required();
  exp->add_option("-o,--output", ex->output, "Context file to write (replaced atomically)")->required();
  exp->add_option("--pool", ex->pool, "Pool name")->required();
  exp->add_option("--agent", ex->agent, "The grantee's agent id")->required();
  exp->add_option("--key", ex->key, "Key file: encrypt the blocks (XChaCha20-Poly1305)");
  exp->callback([ex] { run_export(*ex); });

  auto im = std::make_shared<TransferArgs>();
  CLI::App* imp = cmd->add_subcommand("import", "Seal a context file into a pool and grant it");
  imp->add_option("file", im->input, "Context file")->required();
  imp->add_option("-o,--output", im->output, "Descriptor file to write (OUT.<grantee> for several)")->required();
  imp->add_option("--pool", im->pool, "Pool name")->required();
  imp->add_option("--agent", im->agent, "Agent id the context is sealed as (its producer)")->required();
  imp->add_option("--grant", im->grants, "Grantee agent id (repeat for a fork)")->required();
  imp->add_option("--key", im->key, "Key file of an encrypted context");
  imp->add_option("-m,--model", im->model.model_path, "Refuse the file unless this model made it");
  imp->add_option("-t,--tokenizer", im->model.tokenizer_path, "Tokenizer file (llama2.c models)");
  imp->callback([im] { run_import(*im); });

  auto pu = std::make_shared<TransferArgs>();
  CLI::App* push = cmd->add_subcommand("push", "Push a descriptor's context to Redis; write a remote reference");
  push->add_option("descriptor", pu->input, "Descriptor file (granted to --agent)")->required();
  push->add_option("-o,--output", pu->output, "Remote context reference (JSON) to write")->required();
  push->add_option("--pool", pu->pool, "Pool name")->required();
  push->add_option("--agent", pu->agent, "The grantee's agent id")->required();
  push->add_option("--name", pu->name, "Name of the context in Redis")->required();
  push->add_option("--redis", pu->redis, "Redis HOST:PORT");
  push->add_option("--ttl", pu->ttl, "Seconds every key lives")->check(CLI::Range(1, 1 << 30));
  push->add_option("--timeout-ms", pu->timeout_ms, "Connect and reply timeout")->check(CLI::Range(1, 600000));
  push->add_option("--key", pu->key, "Key file: encrypt the blocks (XChaCha20-Poly1305)");
  push->callback([pu] { run_push(*pu); });

  auto pl = std::make_shared<TransferArgs>();
  CLI::App* pull = cmd->add_subcommand("pull", "Pull a remote context from Redis into a pool and grant it");
  pull->add_option("reference", pl->input, "Remote context reference (JSON, from push)")->required();
  pull->add_option("-o,--output", pl->output, "Descriptor file to write (OUT.<grantee> for several)")->required();
  pull->add_option("--pool", pl->pool, "Pool name")->required();
  pull->add_option("--agent", pl->agent, "Agent id the context is sealed as")->required();
  pull->add_option("--grant", pl->grants, "Grantee agent id (repeat for a fork)")->required();
  pull->add_option("--redis", pl->redis, "Redis HOST:PORT (default: the reference's)");
  pull->add_option("--timeout-ms", pl->timeout_ms, "Connect and reply timeout")->check(CLI::Range(1, 600000));
  pull->add_option("--key", pl->key, "Key file of encrypted blocks");
  pull->callback([pl] { run_pull(*pl); });

  auto kg = std::make_shared<std::string>();
  CLI::App* keygen = cmd->add_subcommand("keygen", "Write a new random key file (64 hex digits, mode 0600)");
  keygen->add_option("-o,--output", *kg, "Key file to create (never overwritten)")->required();
  keygen->callback([kg] {
    KeyCipher::generate_file(*kg);
    std::fprintf(stderr, "wrote key %016llx to %s\n",
                 static_cast<unsigned long long>(KeyCipher::from_file(*kg).key_id()), kg->c_str());
  });

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
