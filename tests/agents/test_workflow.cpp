#include <gtest/gtest.h>

#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/core/error.hpp"
#include "test_paths.hpp"

namespace qkvshare::agents {
namespace {

const char* kGood = R"(name: review chain
task: Write about tides.
agents:
  researcher:
    system: You research.
    prompt: "Collect facts for: {task}"
    max_tokens: 64
  writer:
    role: writer
    prompt: "Write a paragraph from the notes."
    kv: int8
  reviewer:
    prompt: "Review: {output:write}"
    temperature: 0.7
    seed: 3
steps:
  - id: research
    agent: researcher
  - id: write
    agent: writer
    inputs: [{from: research, mode: continue}]
  - id: review
    agent: reviewer
    inputs:
      - write
)";

TEST(Workflow, ParsesAgentsStepsAndOrder) {
  const Workflow w = Workflow::parse(kGood, "good.yaml");
  EXPECT_EQ(w.name, "review chain");
  EXPECT_EQ(w.task, "Write about tides.");
  ASSERT_EQ(w.agents.size(), 3u);
  EXPECT_EQ(w.agents.at("researcher").max_tokens, 64);
  EXPECT_EQ(w.agents.at("writer").system, "You are the writer.");
  EXPECT_EQ(w.agents.at("writer").kv, "int8");
  EXPECT_FLOAT_EQ(w.agents.at("reviewer").sampling.temperature, 0.7f);
  EXPECT_FLOAT_EQ(w.agents.at("writer").sampling.temperature, 0.0f);  // greedy by default
  ASSERT_EQ(w.steps.size(), 3u);
  EXPECT_EQ(w.steps[1].inputs[0].mode, HandoffMode::continue_);
  EXPECT_EQ(w.steps[2].inputs[0].mode, HandoffMode::text);
  EXPECT_EQ(w.order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(w.consumer_count("research"), 1);
  EXPECT_EQ(w.consumer_count("review"), 0);
  EXPECT_EQ(w.steps[1].context_input()->from, "research");
}

TEST(Workflow, OrderFollowsDependenciesNotTheWrittenOrder) {
  const Workflow w = Workflow::parse(R"(agents: {a: {prompt: go}}
steps:
  - {id: last, agent: a, inputs: [first]}
  - {id: first, agent: a}
)");
  EXPECT_EQ(w.order, (std::vector<int>{1, 0}));
}

// Each bad file must fail with bad_workflow and a message holding `want`.
void expect_bad(const std::string& yaml, const std::string& want) {
  try {
    Workflow::parse(yaml, "bad.yaml");
    FAIL() << "accepted:\n" << yaml;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::bad_workflow) << e.what();
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.yaml"), std::string::npos) << e.what();
  }
}

TEST(Workflow, RejectsCycles) {
  expect_bad(R"(agents: {a: {prompt: go}}
steps:
  - {id: x, agent: a, inputs: [y]}
  - {id: y, agent: a, inputs: [x]}
)",
             "cycle: x, y");
}

TEST(Workflow, RejectsUnknownAgentsStepsFieldsAndModes) {
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: nobody}\n", "bad.yaml:3: step 'x' uses unknown agent 'nobody'");
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a, inputs: [ghost]}\n", "unknown step 'ghost'");
  expect_bad("agents: {a: {prompt: go, colour: red}}\nsteps: [{id: x, agent: a}]\n", "unknown field 'colour'");
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a}\n  - {id: y, agent: a, inputs: [{from: x, mode: teleport}]}\n",
             "bad.yaml:4: unknown handoff mode 'teleport'");
  expect_bad("agents: {a: {prompt: go}}\nsteps: [{id: x, agent: a}, {id: x, agent: a}]\n", "duplicate step id 'x'");
  expect_bad("agents: {a: {prompt: go}}\nsteps: [{id: x, agent: a, inputs: [x]}]\n", "reads itself");
  expect_bad("agents: {a: {prompt: go}}\nsteps: [{agent: a}]\n", "needs 'id'");
  expect_bad("agents: {a: {prompt: go}}\nsteps: [{id: 'has space', agent: a}]\n", "step id 'has space'");
  expect_bad("agents: {a: {prompt: go}}\nsteps: []\n", "'steps' must be a non-empty list");
  expect_bad("steps: [{id: x, agent: a}]\n", "'agents' must be a non-empty mapping");
  expect_bad("- just\n- a list\n", "must be a mapping");
  expect_bad("agents: {a: {prompt: go}, a: {prompt: again}}\nsteps: [{id: x, agent: a}]\n", "'a' appears twice in 'agents'");
  expect_bad("task: one\ntask: two\nagents: {a: {prompt: go}}\nsteps: [{id: x, agent: a}]\n",
             "bad.yaml:2: 'task' appears twice in the workflow");
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a}\n  - {id: y, agent: a, inputs: [{from: x, mode: splice, recompute: 0.15, recompute: 0.5}]}\n",
             "'recompute' appears twice in input");
  expect_bad("a: " + std::string(5000, '[') + std::string(5000, ']') + "\n", "levels deep, past the reader's limit");
  // YAML's complex keys ("? [a, b]") are not names (yaml-cpp threw a bare "bad conversion").
  expect_bad("agents:\n  ? [a, b]\n  : {prompt: go}\nsteps: [{id: x, agent: a}]\n",
             "bad.yaml:2: a key in 'agents' must be a plain name, not a list or mapping");
  expect_bad("? {name: x}\n: y\nagents: {a: {prompt: go}}\nsteps: [{id: x, agent: a}]\n",
             "a key in the workflow must be a plain name");
  expect_bad("agents: {a: {prompt: go, ? [k]: v}}\nsteps: [{id: x, agent: a}]\n",
             "a key in agent 'a' must be a plain name");
  // {output:X} only for a step that this one reads: X's output may not exist yet.
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a}\n  - {id: y, agent: a, prompt: 'see {output:x}'}\n",
             "bad.yaml:4: step 'y' uses '{output:x}' but does not read step 'x'");
  expect_bad("agents: {a: {prompt: go}}\nsteps:\n  - {id: y, agent: a, prompt: 'see {output:y}'}\n",
             "step 'y' uses '{output:y}' but does not read step 'y'");
}

TEST(Workflow, RejectsBadFieldValues) {
  expect_bad("agents: {a: {prompt: go, max_tokens: -3}}\nsteps: [{id: x, agent: a}]\n", "max_tokens");
  expect_bad("agents: {a: {prompt: go, max_tokens: lots}}\nsteps: [{id: x, agent: a}]\n", "max_tokens: 'lots'");
  expect_bad("agents: {a: {prompt: go, top_p: 7}}\nsteps: [{id: x, agent: a}]\n", "top-p");
  expect_bad("agents: {a: {prompt: '{weather}'}}\nsteps: [{id: x, agent: a}]\n", "unknown placeholder '{weather}'");
  expect_bad("agents: {a: {system: s}}\nsteps: [{id: x, agent: a}]\n", "has no prompt");
  expect_bad("agents: {a: {prompt: [1, 2]}}\nsteps: [{id: x, agent: a}]\n", "prompt must be a scalar");
}

TEST(Workflow, ContextEdgesAreConstrained) {
  expect_bad(R"(agents: {a: {prompt: go}}
steps:
  - {id: x, agent: a}
  - {id: y, agent: a, inputs: [{from: x, mode: continue}]}
  - {id: z, agent: a, inputs: [{from: x, mode: continue}]}
)",
             "use mode fork");
  expect_bad(R"(agents: {a: {prompt: go}}
steps:
  - {id: x, agent: a}
  - {id: w, agent: a}
  - {id: y, agent: a, inputs: [{from: x, mode: fork}, {from: w, mode: continue}]}
)",
             "more than one context");
  EXPECT_NO_THROW(Workflow::parse(R"(agents: {a: {prompt: go}}
steps:
  - {id: doc, agent: a}
  - {id: q1, agent: a, inputs: [{from: doc, mode: fork}]}
  - {id: q2, agent: a, inputs: [{from: doc, mode: fork}]}
  - {id: agg, agent: a, inputs: [q1, q2]}
)"));
}

TEST(Workflow, SpliceEdgesAreChecked) {
  const std::string head = "agents: {a: {prompt: go}}\nsteps:\n  - {id: x, agent: a}\n";
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice, recompute: 1.5}]}\n",
             "bad.yaml:4: recompute must be a fraction from 0 to 1");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice, recompute: -0.1}]}\n",
             "bad.yaml:4: recompute must be a fraction");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice, recompute: most}]}\n",
             "bad.yaml:4: recompute: 'most' has the wrong type");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: fork, recompute: 0.2}]}\n",
             "bad.yaml:4: 'recompute' applies to mode splice only");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: ghost, mode: splice}]}\n",
             "bad.yaml:4: step 'y' reads unknown step 'ghost'");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice, span: all}]}\n", "bad.yaml:4: unknown span 'all'");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice}]}\n  - {id: z, agent: a, inputs: [{from: y, mode: continue}]}\n",
             "bad.yaml:5: step 'z' cannot continue 'y', whose context holds spliced segments");
  expect_bad(head + "  - {id: w, agent: a}\n  - {id: y, agent: a, inputs: [{from: x, mode: splice}, {from: w, mode: fork}]}\n",
             "splices into its own context, so it cannot also continue or fork");
  expect_bad(head + "  - {id: y, agent: a, inputs: [{from: x, mode: splice}]}\n  - {id: z, agent: a, inputs: [{from: y, mode: splice, span: prompt}]}\n",
             "does not start a context of its own");
  const Workflow w = Workflow::parse(head + "  - {id: y, agent: a, inputs: [x]}\n  - {id: z, agent: a, inputs: [{from: x, mode: splice, "
                                            "span: both}, {from: y, mode: splice, recompute: 0.3}]}\n");
  const StepSpec& z = w.step("z");
  EXPECT_TRUE(z.splices());
  EXPECT_EQ(z.context_input(), nullptr);
  EXPECT_TRUE(z.inputs[0].splice_prompt && z.inputs[0].splice_reply);
  EXPECT_DOUBLE_EQ(z.inputs[0].recompute, 0.15);
  EXPECT_DOUBLE_EQ(z.inputs[1].recompute, 0.3);
}

// Every shipped example parses; W4 and the splicing W2 splice every edge they claim to.
TEST(Workflow, ExamplesParse) {
  for (const char* name : {"w1_two_agents.yaml", "w2_fanout.yaml", "w2_fanout_synthetic.yaml",
                           "w2_fanout_splice.yaml", "w3_chain.yaml", "w4_roles.yaml"})
    EXPECT_NO_THROW(Workflow::load(testing::source_path(std::string("examples/") + name))) << name;
  const Workflow w4 = Workflow::load(testing::source_path("examples/w4_roles.yaml"));
  for (const auto& s : w4.steps)
    for (const auto& in : s.inputs) EXPECT_EQ(in.mode, HandoffMode::splice) << s.id;
  const Workflow w2 = Workflow::load(testing::source_path("examples/w2_fanout_splice.yaml"));
  EXPECT_EQ(w2.step("combine").inputs.size(), 4u);
  EXPECT_TRUE(w2.step("combine").splices());
}

TEST(Workflow, YamlSyntaxErrorHasALine) { expect_bad("agents:\n  a: {prompt: go\nsteps: [\n", "YAML syntax error"); }

TEST(Workflow, MissingFileIsAnIoError) {
  try {
    Workflow::load("/nonexistent/flow.yaml");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::io);
    EXPECT_NE(std::string(e.what()).find("/nonexistent/flow.yaml"), std::string::npos);
  }
}

}  // namespace
}  // namespace qkvshare::agents
