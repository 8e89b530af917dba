#include "qkvshare/agents/compare.hpp"

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "qkvshare/core/error.hpp"
#include "qkvshare/kv/kv_format.hpp"

namespace qkvshare::agents {

std::string ModeSpec::label() const {
  if (mode == RunMode::qkvshare) return "qkvshare:" + kv;
  if (mode == RunMode::shared_text && kv != "f16") return "shared-text:" + kv;
  return std::string(to_string(mode));
}

std::vector<ModeSpec> default_comparison() {
  return {{RunMode::shared_text, "f32"}, {RunMode::independent, "f16"}, {RunMode::shared_text, "f16"},
          {RunMode::qkvshare, "f16"},    {RunMode::qkvshare, "int8"},   {RunMode::qkvshare, "int4"},
          {RunMode::qkvshare, "int2"},   {RunMode::solo, "f16"}};
}

std::vector<ModeSpec> parse_mode_specs(const std::string& text) {
  std::vector<ModeSpec> specs;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string item = text.substr(pos, comma - pos);
    pos = comma + 1;
    if (item.empty()) fail(ErrorCode::invalid_argument, "--modes: empty item in '{}'", text);
    const std::size_t colon = item.find(':');
    ModeSpec s;
    s.mode = parse_run_mode(item.substr(0, colon));
    if (colon != std::string::npos) s.kv = item.substr(colon + 1);
    else if (s.mode == RunMode::qkvshare) s.kv = "int8";
    if ((s.mode == RunMode::independent || s.mode == RunMode::solo) && s.kv != "f16")
      fail(ErrorCode::invalid_argument, "--modes: '{}': {} keeps f16 KV", item, to_string(s.mode));
    KvFormat::parse(s.kv);
    specs.push_back(s);
  }
  return specs;
}

namespace {

// Runs `spec` in a child process; returns its report and peak RSS.
ComparedRun run_in_child(const Workflow& wf, const std::string& model, const std::string& tok, RunOptions opts,
                         const ModeSpec& spec) {
  int fds[2];
  if (::pipe(fds) != 0) fail(ErrorCode::io, "pipe: {}", std::strerror(errno));
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = ::fork();
  if (pid < 0) fail(ErrorCode::io, "fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::close(fds[0]);
    int status = 0;
    std::string out;
    try {
      opts.mode = spec.mode;
      opts.kv = spec.kv;
      if (spec.mode == RunMode::shared_text) opts.text_kv = spec.kv;
      out = run_workflow(wf, model, tok, opts).json();
    } catch (const std::exception& e) {
      out = std::string("ERROR ") + e.what();
      status = 1;
    }
    for (std::size_t done = 0; done < out.size();) {
      const ssize_t n = ::write(fds[1], out.data() + done, out.size() - done);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::close(fds[1]);
    ::_exit(status);
  }
  ::close(fds[1]);
  std::string text;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  struct rusage usage {};
  while (::wait4(pid, &status, 0, &usage) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || text.rfind("ERROR ", 0) == 0)
    fail(ErrorCode::internal, "{} run failed: {}", spec.label(), text.empty() ? "child crashed" : text.substr(6));
  ComparedRun r;
  r.spec = spec;
  r.report = RunReport::from_json(text);
  r.peak_rss_bytes = static_cast<std::size_t>(usage.ru_maxrss) * 1024;
  return r;
}

}  // namespace

std::vector<ComparedRun> compare_modes(const Workflow& wf, const std::string& model_path,
                                       const std::string& tokenizer_path, const RunOptions& base,
                                       const std::vector<ModeSpec>& modes) {
  if (modes.empty()) fail(ErrorCode::invalid_argument, "compare: no modes");
  if (modes.front().mode == RunMode::solo)
    fail(ErrorCode::invalid_argument, "--modes: solo cannot be the reference (it is not the workflow); put it later");
  // The first mode records the token stream every other mode is forced along.
  char trace_path[] = "/tmp/qkvshare-reference-XXXXXX";
  const int fd = ::mkstemp(trace_path);
  if (fd < 0) fail(ErrorCode::io, "mkstemp: {}", std::strerror(errno));
  ::close(fd);
  struct Unlink {
    const char* p;
    ~Unlink() { ::unlink(p); }
  } unlink_at_end{trace_path};
  std::vector<ComparedRun> runs;
  for (std::size_t i = 0; i < modes.size(); ++i) {
    if (base.progress) base.progress("=== " + modes[i].label() + (i == 0 ? " (reference) ===" : " ==="));
    RunOptions o = base;
    (i == 0 ? o.record_reference : o.force_reference) = trace_path;
    runs.push_back(run_in_child(wf, model_path, tokenizer_path, o, modes[i]));
  }
  const RunReport& ref = runs.front().report;
  const ComparedRun* solo = nullptr;
  for (const auto& r : runs)
    if (r.spec.mode == RunMode::solo) solo = &r;
  for (auto& r : runs) {
    std::size_t same = 0, total = 0;
    double ttft = 0, kl = 0, nll = 0, top1 = 0;
    int consumers = 0, scored = 0;
    for (std::size_t i = 0; i < r.report.steps.size(); ++i) {
      const auto& s = r.report.steps[i];
      const auto& want = ref.steps[i].output_tokens;
      const std::size_t n = std::max(want.size(), s.output_tokens.size());
      same += static_cast<std::size_t>(token_agreement(want, s.output_tokens) * static_cast<double>(n) + 0.5);
      total += n;
      if (s.handoff == "new") continue;
      ttft += s.ttft_seconds;
      ++consumers;
      if (s.scored_tokens > 0) {
        kl += s.kl * s.scored_tokens;
        nll += s.nll * s.scored_tokens;
        top1 += s.top1 * s.scored_tokens;
        scored += s.scored_tokens;
      }
    }
    r.agreement = total == 0 ? 1.0 : static_cast<double>(same) / static_cast<double>(total);
    r.consumer_ttft = consumers == 0 ? 0.0 : ttft / consumers;
    r.kl = scored == 0 ? 0.0 : kl / scored;
    r.top1 = scored == 0 ? 1.0 : top1 / scored;
    r.ppl = scored == 0 ? 0.0 : std::exp(nll / scored);
    if (solo != nullptr && solo->report.total_seconds > 0 && solo->peak_rss_bytes > 0) {
      r.team_time = r.report.total_seconds / solo->report.total_seconds;
      r.team_rss = static_cast<double>(r.peak_rss_bytes) / static_cast<double>(solo->peak_rss_bytes);
      r.team_kv = solo->report.peak_kv_bytes == 0 ? 0.0
                                                   : static_cast<double>(r.report.peak_kv_bytes) /
                                                         static_cast<double>(solo->report.peak_kv_bytes);
    }
  }
  return runs;
}

std::string format_comparison(const std::vector<ComparedRun>& runs) {
  std::string out = fmt::format("{:<18} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8} {:>11}\n", "mode",
                                "e2e s", "consumer", "prefill", "reused", "peak KV", "peak RSS", "KL", "top-1", "PPL",
                                "team");
  out += fmt::format("{:<18} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8} {:>11}\n", "", "", "TTFT s", "tokens",
                     "tokens", "MiB", "MiB", "vs ref", "vs ref", "forced", "time / RSS");
  for (const auto& r : runs) {
    const bool solo = r.spec.mode == RunMode::solo;  // its own context: its distributions are not comparable
    const std::string team = r.team_time > 0 ? fmt::format("{:.2f} / {:.2f}", r.team_time, r.team_rss) : "-";
    out += fmt::format("{:<18} {:>8.2f} {:>9.4f} {:>8} {:>8} {:>8.2f} {:>9.1f} {:>9} {:>7} {:>8} {:>11}\n",
                       r.spec.label(), r.report.total_seconds, r.consumer_ttft, r.report.prefill_computed,
                       r.report.prefill_reused, static_cast<double>(r.report.peak_kv_bytes) / (1 << 20),
                       static_cast<double>(r.peak_rss_bytes) / (1 << 20),
                       solo ? "-" : fmt::format("{:.5f}", r.kl), solo ? "-" : fmt::format("{:.1f}%", 100.0 * r.top1),
                       solo ? "-" : fmt::format("{:.3f}", r.ppl), team);
  }
  if (!runs.empty())
    out += fmt::format("Every mode generates the tokens of {} (teacher forcing); KL, top-1 and PPL are measured along them "
                       "over the consumer steps.\n"
                       "team: e2e time and peak RSS over those of solo, one agent writing the same answers in one f16 "
                       "session (below 1 is better).\n", runs.front().spec.label());
  return out;
}

std::string comparison_json(const std::vector<ComparedRun>& runs) {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json e = nlohmann::json::parse(r.report.json());
    e["label"] = r.spec.label();
    e["peak_rss_bytes"] = r.peak_rss_bytes;
    e["agreement"] = r.agreement;
    e["consumer_ttft_seconds"] = r.consumer_ttft;
    e["kl"] = r.kl;
    e["top1"] = r.top1;
    e["ppl"] = r.ppl;
    e["team_time"] = r.team_time;
    e["team_rss"] = r.team_rss;
    e["team_kv"] = r.team_kv;
    j.push_back(std::move(e));
  }
  return j.dump(2);
}

}  // namespace qkvshare::agents
