#include "qkvshare/agents/demo_workflow.hpp"

namespace qkvshare::agents {

// The README's main job: three agents on one task, each with its own system
// prompt, splicing the replies it builds on from the producers' KV
// (examples/demo.yaml holds the same text).
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
    prompt: "Review the explanation above for accuracy and clarity against the facts. Give two concrete suggestions."
    max_tokens: 96
steps:
  - id: research
    agent: researcher
  - id: write
    agent: writer
    inputs: [{from: research, mode: splice, recompute: 0.15}]
  - id: review
    agent: reviewer
    inputs: [{from: research, mode: splice, recompute: 0.15}, {from: write, mode: splice, recompute: 0.15}]
)";
}

}  // namespace qkvshare::agents
