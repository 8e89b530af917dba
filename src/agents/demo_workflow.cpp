#include "qkvshare/agents/demo_workflow.hpp"

namespace qkvshare::agents {

// The README's main job: three agents on one task, each continuing the
// context the previous one produced (examples/demo.yaml holds the same text).
const char* demo_workflow_yaml() {
  return R"(name: research-write-review
task: Explain why the sky is blue to a curious ten-year-old.
agents:
  researcher:
    system: You are a careful researcher. You list the key facts, briefly.
    prompt: "Task: {task}\nList the key scientific facts needed for this task."
    max_tokens: 96
  writer:
    system: You are a clear, friendly writer.
    prompt: "Using the facts above, write the explanation for the task: {task}"
    max_tokens: 128
  reviewer:
    system: You are a strict reviewer.
    prompt: "Review the explanation above for accuracy and clarity. Give two concrete suggestions."
    max_tokens: 96
steps:
  - id: research
    agent: researcher
  - id: write
    agent: writer
    inputs: [{from: research, mode: continue}]
  - id: review
    agent: reviewer
    inputs: [{from: write, mode: continue}]
)";
}

}  // namespace qkvshare::agents
