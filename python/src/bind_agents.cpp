// Workflows: Workflow.load(path).run(model, mode=..., kv=...) -> RunReport,
// the same numbers as `qkvshare run --json`.
#include <nanobind/stl/map.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "py_common.hpp"
#include "qkvshare/agents/orchestrator.hpp"
#include "qkvshare/agents/workflow.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare::py {

namespace {

using agents::RunReport;
using agents::StepMetrics;
using agents::Workflow;

nb::str utf8(const std::string& s) {
  return nb::steal<nb::str>(PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

}  // namespace

void bind_agents(nb::module_& m) {
  nb::class_<StepMetrics>(m, "StepMetrics", "One step of a workflow run.")
      .def_ro("step", &StepMetrics::step)
      .def_ro("agent", &StepMetrics::agent)
      .def_ro("handoff", &StepMetrics::handoff, "new, text, continue, fork or fallback:<reason>.")
      .def_ro("ttft_seconds", &StepMetrics::ttft_seconds)
      .def_ro("seconds", &StepMetrics::seconds)
      .def_ro("handoff_seconds", &StepMetrics::handoff_seconds)
      .def_ro("prefill_computed", &StepMetrics::prefill_computed)
      .def_ro("prefill_reused", &StepMetrics::prefill_reused)
      .def_ro("decode_tokens", &StepMetrics::decode_tokens)
      .def_ro("kv_bytes", &StepMetrics::kv_bytes)
      .def_ro("output_tokens", &StepMetrics::output_tokens)
      .def_prop_ro("output", [](const StepMetrics& s) { return utf8(s.output); })
      .def("__repr__", [](const StepMetrics& s) { return "<StepMetrics " + s.step + " (" + s.handoff + ")>"; });

  nb::class_<RunReport>(m, "RunReport", "What a workflow run measured (the JSON of `qkvshare run --json`).")
      .def_ro("workflow", &RunReport::workflow)
      .def_prop_ro("mode", [](const RunReport& r) { return std::string(agents::to_string(r.mode)); })
      .def_ro("kv", &RunReport::kv)
      .def_ro("steps", &RunReport::steps)
      .def_ro("total_seconds", &RunReport::total_seconds)
      .def_ro("load_seconds", &RunReport::load_seconds)
      .def_ro("peak_kv_bytes", &RunReport::peak_kv_bytes)
      .def_ro("weight_copies_bytes", &RunReport::weight_copies_bytes)
      .def_ro("prefill_computed", &RunReport::prefill_computed)
      .def_ro("prefill_reused", &RunReport::prefill_reused)
      .def_ro("contexts_alive_at_end", &RunReport::contexts_alive_at_end)
      .def_ro("pool_blocks_used_at_end", &RunReport::pool_blocks_used_at_end)
      .def("json", &RunReport::json, "The report as JSON text, as `qkvshare run --json` writes it.")
      .def("to_dict", [](const RunReport& r) { return nb::module_::import_("json").attr("loads")(r.json()); })
      .def("__repr__", [](const RunReport& r) {
        return "<RunReport " + r.workflow + " " + std::string(agents::to_string(r.mode)) + " kv=" + r.kv + ", " +
               std::to_string(r.steps.size()) + " steps, " + std::to_string(r.total_seconds) + " s>";
      });

  nb::class_<Workflow>(m, "Workflow", "A multi-agent workflow (YAML; schema in docs/workflows.md).")
      .def_static(
          "load",
          [](const std::string& path) {
            check_path(path, "path");
            nb::gil_scoped_release release;
            return Workflow::load(path);
          },
          nb::arg("path"), "Parses and validates a workflow file (BadWorkflow names file:line and the reason).")
      .def_static(
          "parse", [](const std::string& text, const std::string& source) { return Workflow::parse(text, source); },
          nb::arg("text"), nb::arg("source") = "<workflow>")
      .def_ro("name", &Workflow::name)
      .def_ro("task", &Workflow::task)
      .def_prop_ro("steps", [](const Workflow& w) {
        std::vector<std::string> ids;
        for (const auto& s : w.steps) ids.push_back(s.id);
        return ids;
      })
      .def_prop_ro("agents", [](const Workflow& w) {
        std::vector<std::string> names;
        for (const auto& [name, _] : w.agents) names.push_back(name);
        return names;
      })
      .def(
          "run",
          [](const Workflow& w, nb::handle model, const std::string& mode, const std::string& kv, IntArg threads_arg,
             int context, int max_tokens_cap, bool exact_matmul, bool float_activations) {
            std::string path, tokenizer;
            if (nb::isinstance<ModelBox>(model)) {
              const ModelBox& b = nb::cast<const ModelBox&>(model);
              path = b.model->path();
              tokenizer = b.tokenizer_path;
            } else if (nb::isinstance<nb::str>(model)) {
              path = text_value(model, "run: model");
              check_path(path, "run: model");
            } else {
              throw nb::type_error("run: model must be a qkvshare.Model or a path (str)");
            }
            agents::RunOptions o;
            o.mode = agents::parse_run_mode(mode);
            o.kv = kv;
            KvFormat::parse(kv);  // a bad name fails before the model loads
            const int threads = threads_value(threads_arg, "run: threads");
            if (context < 1) fail(ErrorCode::invalid_argument, "run: context must be >= 1, got {}", context);
            if (max_tokens_cap < 0)
              fail(ErrorCode::invalid_argument, "run: max_tokens_cap must be >= 0, got {}", max_tokens_cap);
            o.threads = threads;
            o.context = context;
            o.max_tokens_cap = max_tokens_cap;
            o.exact_matmul = exact_matmul;
            o.float_activations = float_activations;
            if (exact_matmul && float_activations)
              fail(ErrorCode::invalid_argument, "run: exact_matmul and float_activations: choose one");
            nb::gil_scoped_release release;
            return agents::run_workflow(w, path, tokenizer, o);
          },
          nb::arg("model"), nb::arg("mode") = "qkvshare", nb::arg("kv") = "int8", nb::arg("threads") = 0,
          nb::arg("context") = 4096, nb::arg("max_tokens_cap") = 0, nb::arg("exact_matmul") = false,
          nb::arg("float_activations") = false,
          "Runs the DAG (mode: qkvshare, shared-text or independent). The run loads the model file itself "
          "(independent mode needs one private copy per agent), so a Model argument only names the file.");
}

}  // namespace qkvshare::py
