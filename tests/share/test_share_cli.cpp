// The command line across real processes: `pool serve`, a producer
// (`generate --publish`) and a consumer (`generate --from`) as separate
// programs, `context inspect`, and every bad input giving "error: ..." and a
// non-zero exit.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "qkvshare/engine/generate.hpp"
#include "share_test_util.hpp"

namespace qkvshare {
namespace {

struct CliRun {
  int status = -1;
  std::string out, err;
};

// Runs the CLI with `args` (a shell-quoted string); stdout and stderr apart.
CliRun cli(const std::string& args) {
  const std::string dir = testing::temp_dir();
  const std::string cmd = testing::cli_path() + " " + args + " > " + dir + "/out 2> " + dir + "/err";
  CliRun r;
  const int rc = std::system(cmd.c_str());
  r.status = WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  std::ifstream o(dir + "/out"), e(dir + "/err");
  r.out.assign(std::istreambuf_iterator<char>(o), {});
  r.err.assign(std::istreambuf_iterator<char>(e), {});
  return r;
}

const std::string kModel = " -m " + testing::shared_path("models/stories260K.bin") + " -t " +
                           testing::shared_path("models/tok512.bin");

class ShareCli : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::temp_dir();
    name_ = testing::unique_pool_name("cli");
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    server_ = ::fork();
    if (server_ == 0) {
      ::dup2(fds[1], 1);
      ::close(fds[0]);
      const std::string cli = testing::cli_path();
      ::execl(cli.c_str(), cli.c_str(), "pool", "serve", "--name", name_.c_str(), "--bytes", "32M", "--max-tokens",
              "1024", "--reap-ms", "20", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(fds[1]);
    char line[256] = {};
    FILE* f = ::fdopen(fds[0], "r");
    ASSERT_NE(std::fgets(line, sizeof line, f), nullptr);
    std::fclose(f);
    ASSERT_NE(std::string(line).find("ready"), std::string::npos) << line;
  }
  void TearDown() override {
    if (server_ > 0) {
      ::kill(server_, SIGTERM);
      EXPECT_EQ(testing::wait_exit(server_), 0);
      EXPECT_FALSE(std::filesystem::exists("/dev/shm/qkvshare." + name_));  // unlinked on SIGTERM
    }
  }
  CliRun publish(const std::string& out, const std::string& extra = "") {
    return cli("generate" + kModel + " -p 'Lily had a red ball' -n 12 --temp 0 --ignore-eos --json --pool " + name_ +
               " --publish " + out + " --agent A --grant B" + extra);
  }
  std::string dir_, name_;
  pid_t server_ = -1;
};

std::vector<TokenId> ids_of(const CliRun& r) {
  return nlohmann::json::parse(r.out)["generated_ids"].get<std::vector<TokenId>>();
}

TEST_F(ShareCli, ProducerAndConsumerProcessesMatchOneProcess) {
  const CliRun a = publish(dir_ + "/a.desc");
  ASSERT_EQ(a.status, 0) << a.err;
  const CliRun b = cli("generate" + kModel + " -p ' and a big dog' -n 12 --temp 0 --ignore-eos --json --pool " + name_ +
                    " --from " + dir_ + "/a.desc --agent B --handoff kv");
  ASSERT_EQ(b.status, 0) << b.err;
  EXPECT_NE(b.err.find("on its KV"), std::string::npos) << b.err;
  const auto j = nlohmann::json::parse(b.out);
  EXPECT_EQ(j["share"]["from"]["mode"], "kv");
  EXPECT_EQ(j["share"]["from"]["prefill_tokens"], 0);  // nothing re-read

  // The same in one process, through the library.
  auto model = testing::load_stories();
  Engine engine(*model, EngineOptions{1});
  auto pool = SharePool::create_anonymous(testing::small_config());
  auto s = new_pooled_session(*pool, engine, KvFormat::parse("f16"), 0);
  const Tokenizer& tok = model->tokenizer();
  std::vector<TokenId> prompt{tok.bos_id()};
  const auto body = tok.encode("Lily had a red ball");
  prompt.insert(prompt.end(), body.begin(), body.end());
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.sampling.temperature = 0;
  g.stop_at_end_of_generation = false;
  const auto first = generate(engine, *s, prompt, g);
  EXPECT_EQ(first.tokens, ids_of(a));
  engine.forward(*s, std::vector<TokenId>{first.tokens.back()});
  const auto second = generate(engine, *s, tok.encode(" and a big dog"), g);
  EXPECT_EQ(second.tokens, ids_of(b));

  // B released its grant: the descriptor is stale now.
  const CliRun again = cli("context inspect " + dir_ + "/a.desc --pool " + name_);
  EXPECT_EQ(again.status, 1);
  EXPECT_NE(again.err.find("error: "), std::string::npos);
  EXPECT_NE(again.err.find("stale"), std::string::npos) << again.err;
  EXPECT_NE(again.out.find("\"live\": false"), std::string::npos) << again.out;
}

TEST_F(ShareCli, PoolLsListsGrantsWithTheirHolderAndLease) {
  const CliRun a = publish(dir_ + "/a.desc");
  ASSERT_EQ(a.status, 0) << a.err;
  const CliRun ls = cli("pool ls --name " + name_ + " --json");
  ASSERT_EQ(ls.status, 0) << ls.err;
  const auto j = nlohmann::json::parse(ls.out);
  EXPECT_EQ(j["lease_ms"], 30000);
  ASSERT_EQ(j["grants"].size(), 1u) << ls.out;
  EXPECT_EQ(j["grants"][0]["producer"], "A");
  EXPECT_EQ(j["grants"][0]["grantee"], "B");
  EXPECT_EQ(j["grants"][0]["state"], "issued");  // not opened; its issuer exited cleanly
  EXPECT_EQ(j["grants"][0]["holder_pid"], 0);
  const CliRun table = cli("pool ls --name " + name_);
  ASSERT_EQ(table.status, 0) << table.err;
  EXPECT_NE(table.out.find("issued"), std::string::npos) << table.out;
  EXPECT_NE(table.out.find("1 grant, lease 30000 ms"), std::string::npos) << table.out;
  // B continues and releases its grant: nothing is listed any more.
  const CliRun b = cli("generate" + kModel + " -p ' and a big dog' -n 4 --temp 0 --pool " + name_ + " --from " + dir_ +
                       "/a.desc --agent B --handoff kv");
  ASSERT_EQ(b.status, 0) << b.err;
  const auto after = nlohmann::json::parse(cli("pool ls --name " + name_ + " --json").out);
  EXPECT_TRUE(after["grants"].empty()) << after.dump();
}

// Publishing again to the same path ends the grant the overwritten descriptor
// carried: nobody could release it once its file is gone.
TEST_F(ShareCli, RepublishingToAPathReleasesTheGrantItReplaces) {
  ASSERT_EQ(publish(dir_ + "/a.desc").status, 0);
  const CliRun again = publish(dir_ + "/a.desc");
  ASSERT_EQ(again.status, 0) << again.err;
  EXPECT_NE(again.err.find("that grant is released"), std::string::npos) << again.err;
  const auto j = nlohmann::json::parse(cli("pool ls --name " + name_ + " --json").out);
  EXPECT_EQ(j["grants"].size(), 1u) << j.dump();
  EXPECT_EQ(nlohmann::json::parse(cli("pool stat --name " + name_).out)["live"]["contexts"], 1);
}

TEST_F(ShareCli, InspectShowsTheDescriptorAndVerifiesIt) {
  const CliRun a = publish(dir_ + "/a.desc");
  ASSERT_EQ(a.status, 0) << a.err;
  const CliRun r = cli("context inspect " + dir_ + "/a.desc --pool " + name_ + " --verify" + kModel);
  ASSERT_EQ(r.status, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["valid"], true);
  EXPECT_EQ(j["checks"]["blocks_verified"], true);
  EXPECT_EQ(j["checks"]["model_matches"], true);
  EXPECT_EQ(j["descriptor"]["producer"], "A");
  EXPECT_EQ(j["descriptor"]["grantee"], "B");
  // The prompt and every generated token (the last one fed before sealing).
  EXPECT_EQ(j["descriptor"]["token_count"], nlohmann::json::parse(a.out)["prompt_ids"].size() + 12);
  const CliRun stat = cli("pool stat --name " + name_);
  ASSERT_EQ(stat.status, 0) << stat.err;
  EXPECT_EQ(nlohmann::json::parse(stat.out)["live"]["contexts"], 1);
}

TEST_F(ShareCli, BadInputsAreClearErrors) {
  ASSERT_EQ(publish(dir_ + "/a.desc").status, 0);
  const std::string good = dir_ + "/a.desc";
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  const auto write = [&](const std::string& name, const std::string& content) {
    std::ofstream(dir_ + "/" + name, std::ios::binary) << content;
    return dir_ + "/" + name;
  };
  std::string flipped = bytes;
  flipped[60] ^= 1;
  const std::string cont = "generate" + kModel + " -p ' more' -n 2 --pool " + name_ + " --agent B --from ";
  const std::pair<std::string, std::string> cases[] = {
      {"context inspect " + dir_ + "/missing.desc", "cannot open"},
      {"context inspect " + write("short.desc", bytes.substr(0, 100)), "truncated"},
      {"context inspect " + write("flipped.desc", flipped), "self checksum"},
      {"context inspect " + write("text.desc", std::string(256, 'x')), "bad magic"},
      {cont + write("flipped2.desc", flipped), "self checksum"},
      {"generate" + kModel + " -p x --pool " + name_ + " --agent C --from " + good, "granted to 'B', not to 'C'"},
      {"generate" + kModel + " -p x --pool no-such-pool --agent B --from " + good, "does not exist"},
      {"generate" + kModel + " -p x --agent B --from " + good, "need --pool"},
      {"generate" + kModel + " -p x --pool " + name_ + " --publish x.desc --agent A", "--grant"},
      {"generate" + kModel + " -p x --pool " + name_ + " --publish x.desc --agent 'a b' --grant B", "agent id"},
      {"pool stat --name no-such-pool", "does not exist"},
      {"pool serve --name " + name_ + " --bytes 1M", "already exists"},
      {"pool serve --name bad/name", "pool name"},
      {"pool serve --name x" + name_ + " --bytes 12Q", "not a size"},
      {"context release " + good + " --pool " + name_ + " --agent C", "granted to 'B'"},
      {"context revoke " + good + " --pool " + name_ + " --agent B", "only the producer 'A'"},
  };
  for (const auto& [args, what] : cases) {
    const CliRun r = cli(args);
    EXPECT_EQ(r.status, 1) << args << "\n" << r.err;
    EXPECT_EQ(r.err.rfind("error: ", 0) == 0 || r.err.find("\nerror: ") != std::string::npos, true) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << args << "\n" << r.err;
  }
  // Released, then stale for good.
  ASSERT_EQ(cli("context release " + good + " --pool " + name_ + " --agent B").status, 0);
  const CliRun stale = cli(cont + good);
  EXPECT_EQ(stale.status, 1);
  EXPECT_NE(stale.err.find("stale"), std::string::npos) << stale.err;
}

TEST_F(ShareCli, AnotherModelFallsBackToTextOrFailsWhenKvIsRequired) {
  ASSERT_EQ(publish(dir_ + "/a.desc").status, 0);
  const std::string other = dir_ + "/tiny.gguf";
  ASSERT_EQ(cli("make-model --shape tiny-llama -o " + other).status, 0);
  const std::string cont = "generate -m " + other + " -p ' more' -n 2 --json --pool " + name_ +
                           " --agent B --from " + dir_ + "/a.desc";
  const CliRun strict = cli(cont + " --handoff kv --keep");
  EXPECT_EQ(strict.status, 1);
  EXPECT_NE(strict.err.find("model fingerprint differs"), std::string::npos) << strict.err;
  const CliRun r = cli(cont);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("text mode"), std::string::npos) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["share"]["from"]["mode"], "text");
  EXPECT_GT(j["share"]["from"]["prefill_tokens"].get<int>(), 0);
  const CliRun stat = cli("pool stat --name " + name_);
  EXPECT_EQ(nlohmann::json::parse(stat.out)["counters"]["fallback_model"], 1);
}

// A pq context names its codebook by id: a consumer process that loaded the
// same codebook (its own --pool-format names it) opens the KV; one that did not
// falls back to text and says why. The codebook comes from `calibrate`.
TEST_F(ShareCli, APqContextOpensWhereItsCodebookIsLoadedAndFallsBackElsewhere) {
  const std::string book = dir_ + "/stories-pq2.kvc";
  const CliRun cal = cli("calibrate" + kModel + " --text " + testing::shared_path("data/tinystories-valid-sample.txt") +
                         " -o " + book + " --sub 4 --tokens 300 --ctx 256 --iterations 3");
  ASSERT_EQ(cal.status, 0) << cal.err;
  EXPECT_NE(cal.out.find("pq2 codebook"), std::string::npos) << cal.out;
  const std::string format = " --pool-format pq2:book=" + book;
  ASSERT_EQ(publish(dir_ + "/a.desc", format).status, 0);
  ASSERT_EQ(publish(dir_ + "/b.desc", format).status, 0);
  const std::string cont = "generate" + kModel + " -p ' more' -n 2 --json --pool " + name_ + " --agent B --from ";
  const CliRun with = cli(cont + dir_ + "/a.desc --handoff kv" + format);
  ASSERT_EQ(with.status, 0) << with.err;
  EXPECT_EQ(nlohmann::json::parse(with.out)["share"]["from"]["mode"], "kv");
  const CliRun without = cli(cont + dir_ + "/b.desc");
  ASSERT_EQ(without.status, 0) << without.err;
  EXPECT_NE(without.err.find("not loaded in this process"), std::string::npos) << without.err;
  EXPECT_EQ(nlohmann::json::parse(without.out)["share"]["from"]["mode"], "text");
  const CliRun bad = cli("calibrate" + kModel + " --text " + testing::shared_path("data/tinystories-valid-sample.txt") +
                         " -o " + book + " --sub 3");
  EXPECT_EQ(bad.status, 1);
  EXPECT_NE(bad.err.find("sub-vectors of 3 channels"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace qkvshare
