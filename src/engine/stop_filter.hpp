#pragma once
// Holds back the tail of generated text that could still grow into a stop
// string, so that streamed text never shows part of one.
#include <algorithm>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace qkvshare::detail {

class StopStringFilter {
 public:
  // Both referenced objects must outlive the filter.
  StopStringFilter(const std::vector<std::string>& stops, const std::function<void(std::string_view)>& sink)
      : stops_(stops), sink_(sink) {}

  // Returns true when a stop string was found; text before it is emitted.
  bool push(std::string_view piece, std::string& accepted) {
    pending_ += piece;
    std::size_t cut = std::string::npos;
    for (const auto& s : stops_)
      if (!s.empty()) cut = std::min(cut, pending_.find(s));
    if (cut != std::string::npos) {
      emit(pending_.substr(0, cut), accepted);
      pending_.clear();
      return true;
    }
    std::size_t hold = 0;
    for (const auto& s : stops_)
      for (std::size_t k = std::min(s.size() - 1, pending_.size()); k > hold; --k)
        if (pending_.compare(pending_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    emit(pending_.substr(0, pending_.size() - hold), accepted);
    pending_.erase(0, pending_.size() - hold);
    return false;
  }
  void flush(std::string& accepted) {
    emit(pending_, accepted);
    pending_.clear();
  }

 private:
  void emit(std::string_view text, std::string& accepted) {
    if (text.empty()) return;
    accepted += text;
    if (sink_) sink_(text);
  }
  const std::vector<std::string>& stops_;
  const std::function<void(std::string_view)>& sink_;
  std::string pending_;
};

}  // namespace qkvshare::detail
