#pragma once
// Wall time for the metrics and reports every layer keeps (steady clock: never jumps).
#include <chrono>

namespace qkvshare {

using SteadyClock = std::chrono::steady_clock;

inline double seconds_since(SteadyClock::time_point t) {
  return std::chrono::duration<double>(SteadyClock::now() - t).count();
}

}  // namespace qkvshare
