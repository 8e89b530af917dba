// libFuzzer target: workflow files (agents::Workflow::parse, over yaml-cpp) on
// arbitrary text must either return a validated workflow or throw
// qkvshare::Error, never crash, hang or exhaust memory. Documents named in the
// file are served from memory, so no input reads the disk.
#include <cstddef>
#include <cstdint>
#include <string>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/core/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const auto read = [](const std::string& file) { return "document " + file; };
  try {
    const auto wf = qkvshare::agents::Workflow::parse(text, "fuzz.yaml", read);
    (void)wf.consumer_count(wf.steps.empty() ? std::string() : wf.steps.front().id);
  } catch (const qkvshare::Error&) {
  }
  return 0;
}
