#pragma once
// Counters, gauges and histograms rendered in Prometheus text format
// (GET /metrics). Families are declared once with their help text; samples
// are keyed by their label set ("endpoint=\"chat\",status=\"200\"").
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace qkvshare::server {

class Metrics {
 public:
  void counter(const std::string& family, const std::string& help);
  void gauge(const std::string& family, const std::string& help);
  void histogram(const std::string& family, const std::string& help, std::vector<double> bounds);

  void add(const std::string& family, const std::string& labels, double value = 1.0);
  void set(const std::string& family, const std::string& labels, double value);
  void clear(const std::string& family);  // drops every sample of the family
  void observe(const std::string& family, double value);
  double value(const std::string& family, const std::string& labels) const;  // for tests and logs

  std::string render() const;

 private:
  struct Family {
    std::string type, help;
    std::map<std::string, double> samples;
    std::vector<double> bounds;        // histograms: upper bounds
    std::vector<unsigned long long> buckets;  // cumulative at render
    double sum = 0.0;
    unsigned long long count = 0;
  };
  Family& find(const std::string& family);
  mutable std::mutex mu_;
  std::map<std::string, Family> families_;
};

}  // namespace qkvshare::server
