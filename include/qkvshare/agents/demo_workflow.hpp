#pragma once

namespace qkvshare::agents {

// YAML of the built-in researcher -> writer -> reviewer workflow.
const char* demo_workflow_yaml();

}  // namespace qkvshare::agents
