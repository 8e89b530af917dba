#include "reference_trace.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>

#include <fcntl.h>
#include <unistd.h>

#include "qkvshare/core/error.hpp"

namespace qkvshare::agents {

namespace {

constexpr char kMagic[8] = {'Q', 'K', 'V', 'R', 'E', 'F', '1', '\0'};

struct File {
  std::FILE* f;
  ~File() {
    if (f != nullptr) std::fclose(f);
  }
};

}  // namespace

GenerateOptions step_generate_options(const AgentSpec& agent, int max_tokens_cap, const TraceStep* forced) {
  GenerateOptions go;
  go.max_new_tokens = max_tokens_cap > 0 ? std::min(agent.max_tokens, max_tokens_cap) : agent.max_tokens;
  go.sampling = agent.sampling;
  go.stop_strings = agent.stop;
  if (forced != nullptr) {
    go.forced = forced->tokens;
    if (go.forced.empty()) go.max_new_tokens = 0;
  }
  return go;
}

void log_softmax(std::span<const float> x, std::vector<float>& out) {
  double m = -1e300, s = 0;
  for (float v : x) m = std::max(m, static_cast<double>(v));
  for (float v : x) s += std::exp(v - m);
  const double lse = m + std::log(s);
  out.resize(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(x[i] - lse);
}

void QualitySum::add(const float* ref, std::span<const float> logits, TokenId forced) {
  thread_local std::vector<float> q;
  log_softmax(logits, q);
  double d = 0;
  std::size_t best_p = 0, best_q = 0;
  for (std::size_t v = 0; v < q.size(); ++v) {
    d += std::exp(static_cast<double>(ref[v])) * (static_cast<double>(ref[v]) - q[v]);
    if (ref[v] > ref[best_p]) best_p = v;
    if (q[v] > q[best_q]) best_q = v;
  }
  kl += std::max(0.0, d);
  nll -= q[static_cast<std::size_t>(forced)];
  same += best_p == best_q ? 1 : 0;
  ++n;
}

void ReferenceTrace::save(const std::string& path) const {
  File f{std::fopen(path.c_str(), "wb")};
  if (f.f == nullptr) fail(ErrorCode::io, "{}: cannot write the reference trace", path);
  const auto put = [&](const void* p, std::size_t n) {
    if (std::fwrite(p, 1, n, f.f) != n) fail(ErrorCode::io, "{}: write failed", path);
  };
  put(kMagic, sizeof kMagic);
  const std::uint32_t head[2] = {static_cast<std::uint32_t>(vocab), static_cast<std::uint32_t>(steps.size())};
  put(head, sizeof head);
  for (const auto& [id, s] : steps) {
    const std::uint32_t sizes[2] = {static_cast<std::uint32_t>(id.size()), static_cast<std::uint32_t>(s.tokens.size())};
    QKV_CHECK(s.logprobs.size() == s.tokens.size() * static_cast<std::size_t>(vocab));
    put(sizes, sizeof sizes);
    put(id.data(), id.size());
    put(s.tokens.data(), s.tokens.size() * sizeof(TokenId));
    put(s.logprobs.data(), s.logprobs.size() * sizeof(float));
  }
}

ReferenceTrace ReferenceTrace::load(const std::string& path) {
  File f{std::fopen(path.c_str(), "rb")};
  if (f.f == nullptr) fail(ErrorCode::io, "{}: cannot open the reference trace", path);
  const auto get = [&](void* p, std::size_t n) {
    if (std::fread(p, 1, n, f.f) != n) fail(ErrorCode::io, "{}: reference trace is truncated", path);
  };
  char magic[8];
  get(magic, sizeof magic);
  if (std::memcmp(magic, kMagic, sizeof magic) != 0) fail(ErrorCode::io, "{}: not a reference trace", path);
  std::uint32_t head[2];
  get(head, sizeof head);
  ReferenceTrace t;
  t.vocab = static_cast<int>(head[0]);
  if (t.vocab <= 0 || t.vocab > (1 << 22) || head[1] > 100000) fail(ErrorCode::io, "{}: bad reference trace header", path);
  for (std::uint32_t i = 0; i < head[1]; ++i) {
    std::uint32_t sizes[2];
    get(sizes, sizeof sizes);
    if (sizes[0] > 4096 || sizes[1] > (1u << 20)) fail(ErrorCode::io, "{}: bad reference trace step", path);
    std::string id(sizes[0], '\0');
    get(id.data(), id.size());
    TraceStep s;
    s.tokens.resize(sizes[1]);
    get(s.tokens.data(), s.tokens.size() * sizeof(TokenId));
    const long at = std::ftell(f.f);
    const std::uint64_t bytes = static_cast<std::uint64_t>(sizes[1]) * static_cast<std::uint64_t>(t.vocab) * sizeof(float);
    if (at < 0 || std::fseek(f.f, static_cast<long>(bytes), SEEK_CUR) != 0)
      fail(ErrorCode::io, "{}: reference trace is truncated", path);
    s.logprobs_offset = static_cast<std::uint64_t>(at);
    t.steps.emplace(std::move(id), std::move(s));
  }
  // fseek past the end succeeds: the last step's rows must really be there.
  const long end = std::ftell(f.f);
  if (std::fseek(f.f, 0, SEEK_END) != 0 || std::ftell(f.f) < end)
    fail(ErrorCode::io, "{}: reference trace is truncated", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(ErrorCode::io, "{}: cannot open the reference trace", path);
  t.fd_ = std::shared_ptr<int>(new int(fd), [](int* p) {
    ::close(*p);
    delete p;
  });
  t.path_ = path;
  return t;
}

const float* ReferenceTrace::row(const TraceStep& s, std::size_t i, std::vector<float>& buffer) const {
  const std::size_t n = static_cast<std::size_t>(vocab);
  QKV_CHECK(i < s.tokens.size());
  if (!s.logprobs.empty()) return s.logprobs.data() + i * n;
  QKV_CHECK(fd_ != nullptr);
  buffer.resize(n);
  const std::size_t bytes = n * sizeof(float);
  const auto off = static_cast<off_t>(s.logprobs_offset + i * bytes);
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t got = ::pread(*fd_, reinterpret_cast<char*>(buffer.data()) + done, bytes - done,
                                off + static_cast<off_t>(done));
    if (got <= 0) fail(ErrorCode::io, "{}: cannot read the reference trace", path_);
    done += static_cast<std::size_t>(got);
  }
  return buffer.data();
}

}  // namespace qkvshare::agents
