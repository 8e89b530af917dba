#include "qkvshare/agents/compare.hpp"

#include <nlohmann/json.hpp>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "qkvshare/core/error.hpp"

namespace qkvshare::agents {

std::string ModeSpec::label() const {
  return mode == RunMode::qkvshare ? "qkvshare:" + kv : std::string(to_string(mode));
}

std::vector<ModeSpec> default_comparison() {
  return {{RunMode::qkvshare, "f32"},  {RunMode::independent, "f16"}, {RunMode::shared_text, "f16"},
          {RunMode::qkvshare, "f16"},  {RunMode::qkvshare, "int8"},   {RunMode::qkvshare, "int4"},
          {RunMode::qkvshare, "int2"}, {RunMode::solo, "f16"}};
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
  std::vector<ComparedRun> runs;
  for (const auto& spec : modes) {
    if (base.progress) base.progress("=== " + spec.label() + " ===");
    RunOptions opts = base;
    if (spec.mode == RunMode::solo) {
      // Equal work: the solo agent writes answers as long as the reference run's (f32 QKVShare, else the first run).
      const ComparedRun* ref = runs.empty() ? nullptr : &runs.front();
      for (const auto& r : runs)
        if (r.spec.mode == RunMode::qkvshare && r.spec.kv == "f32") ref = &r;
      if (ref != nullptr)
        for (const auto& s : ref->report.steps) opts.solo_tokens[s.step] = s.decode_tokens;
    }
    runs.push_back(run_in_child(wf, model_path, tokenizer_path, opts, spec));
  }
  // The f32-KV QKVShare run is the reference for output agreement.
  const RunReport* ref = nullptr;
  const ComparedRun* solo = nullptr;
  for (const auto& r : runs) {
    if (r.spec.mode == RunMode::qkvshare && r.spec.kv == "f32") ref = &r.report;
    if (r.spec.mode == RunMode::solo) solo = &r;
  }
  for (auto& r : runs) {
    std::size_t same = 0, total = 0;
    double ttft = 0;
    int consumers = 0;
    for (std::size_t i = 0; i < r.report.steps.size(); ++i) {
      const auto& s = r.report.steps[i];
      if (ref != nullptr) {
        const auto& want = ref->steps[i].output_tokens;
        const std::size_t n = std::max(want.size(), s.output_tokens.size());
        same += static_cast<std::size_t>(token_agreement(want, s.output_tokens) * static_cast<double>(n) + 0.5);
        total += n;
      }
      if (s.handoff != "new") {
        ttft += s.ttft_seconds;
        ++consumers;
      }
    }
    r.agreement = total == 0 ? 1.0 : static_cast<double>(same) / static_cast<double>(total);
    r.consumer_ttft = consumers == 0 ? 0.0 : ttft / consumers;
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
  std::string out = fmt::format("{:<16} {:>9} {:>12} {:>9} {:>9} {:>10} {:>10} {:>9} {:>11}\n", "mode", "e2e s",
                                "consumer TTFT", "prefill", "reused", "peak KV", "peak RSS", "agree", "team");
  out += fmt::format("{:<16} {:>9} {:>12} {:>9} {:>9} {:>10} {:>10} {:>9} {:>11}\n", "", "", "s", "tokens", "tokens",
                     "MiB", "MiB", "vs f32", "time / RSS");
  for (const auto& r : runs) {
    const std::string agree = r.spec.mode == RunMode::solo ? "-" : fmt::format("{:.1f}%", 100.0 * r.agreement);
    const std::string team = r.team_time > 0 ? fmt::format("{:.2f} / {:.2f}", r.team_time, r.team_rss) : "-";
    out += fmt::format("{:<16} {:>9.2f} {:>12.4f} {:>9} {:>9} {:>10.2f} {:>10.1f} {:>9} {:>11}\n", r.spec.label(),
                       r.report.total_seconds, r.consumer_ttft, r.report.prefill_computed, r.report.prefill_reused,
                       static_cast<double>(r.report.peak_kv_bytes) / (1 << 20),
                       static_cast<double>(r.peak_rss_bytes) / (1 << 20), agree, team);
  }
  out += "team: e2e time and peak RSS over those of one agent (solo) writing the same answers in one f16 session.\n";
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
    e["team_time"] = r.team_time;
    e["team_rss"] = r.team_rss;
    e["team_kv"] = r.team_kv;
    j.push_back(std::move(e));
  }
  return j.dump(2);
}

}  // namespace qkvshare::agents
