#include "qkvshare/server/metrics.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "qkvshare/core/error.hpp"

namespace qkvshare::server {

void Metrics::counter(const std::string& family, const std::string& help) {
  std::lock_guard lock(mu_);
  families_[family] = Family{"counter", help, {}, {}, {}, 0.0, 0};
}

void Metrics::gauge(const std::string& family, const std::string& help) {
  std::lock_guard lock(mu_);
  families_[family] = Family{"gauge", help, {}, {}, {}, 0.0, 0};
}

void Metrics::histogram(const std::string& family, const std::string& help, std::vector<double> bounds) {
  std::lock_guard lock(mu_);
  std::sort(bounds.begin(), bounds.end());
  const std::size_t n = bounds.size();
  families_[family] = Family{"histogram", help, {}, std::move(bounds), std::vector<unsigned long long>(n, 0), 0.0, 0};
}

Metrics::Family& Metrics::find(const std::string& family) {
  const auto it = families_.find(family);
  QKV_CHECK(it != families_.end());
  return it->second;
}

void Metrics::add(const std::string& family, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  find(family).samples[labels] += value;
}

void Metrics::set(const std::string& family, const std::string& labels, double value) {
  std::lock_guard lock(mu_);
  find(family).samples[labels] = value;
}

void Metrics::clear(const std::string& family) {
  std::lock_guard lock(mu_);
  find(family).samples.clear();
}

void Metrics::observe(const std::string& family, double value) {
  std::lock_guard lock(mu_);
  Family& f = find(family);
  QKV_CHECK(f.type == "histogram");
  for (std::size_t i = 0; i < f.bounds.size(); ++i)
    if (value <= f.bounds[i]) {
      ++f.buckets[i];
      break;
    }
  f.sum += value;
  ++f.count;
}

double Metrics::value(const std::string& family, const std::string& labels) const {
  std::lock_guard lock(mu_);
  const auto it = families_.find(family);
  if (it == families_.end()) return 0.0;
  const auto s = it->second.samples.find(labels);
  return s == it->second.samples.end() ? 0.0 : s->second;
}

std::string Metrics::render() const {
  std::lock_guard lock(mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, f.help, name, f.type);
    if (f.type == "histogram") {
      unsigned long long cumulative = 0;
      for (std::size_t i = 0; i < f.bounds.size(); ++i) {
        cumulative += f.buckets[i];
        out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, f.bounds[i], cumulative);
      }
      out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, f.count, name, f.sum, name, f.count);
      continue;
    }
    if (f.samples.empty()) out += fmt::format("{} 0\n", name);
    for (const auto& [labels, v] : f.samples)
      out += labels.empty() ? fmt::format("{} {}\n", name, v) : fmt::format("{}{{{}}} {}\n", name, labels, v);
  }
  return out;
}

}  // namespace qkvshare::server
