#include <nlohmann/json.hpp>

#include "qkvshare/agents/orchestrator.hpp"
#include "qkvshare/core/error.hpp"

namespace qkvshare::agents {

std::string RunReport::json() const {
  nlohmann::json j;
  j["workflow"] = workflow;
  j["mode"] = to_string(mode);
  j["kv"] = kv;
  j["total_seconds"] = total_seconds;
  j["load_seconds"] = load_seconds;
  j["peak_kv_bytes"] = peak_kv_bytes;
  j["weight_copies_bytes"] = weight_copies_bytes;
  j["prefill_computed"] = prefill_computed;
  j["prefill_reused"] = prefill_reused;
  j["contexts_alive_at_end"] = contexts_alive_at_end;
  j["pool_blocks_used_at_end"] = pool_blocks_used_at_end;
  j["tiers"] = {{"spills", tiers.spills},
                {"evictions", tiers.evictions},
                {"restores_on_demand", tiers.restores_on_demand},
                {"prefetches", tiers.prefetches},
                {"bytes_written", tiers.bytes_written},
                {"bytes_read", tiers.bytes_read},
                {"restore_wait_seconds", tiers.restore_wait_seconds},
                {"peak_at_rest_bytes", tiers.peak_at_rest_bytes},
                {"failures", tiers.failures},
                {"demotions", nlohmann::json::array()}};
  for (const TierDemotion& d : tiers.demotions)
    j["tiers"]["demotions"].push_back({{"producer", d.producer},
                                       {"from", d.from},
                                       {"to", d.to},
                                       {"bytes_before", d.bytes_before},
                                       {"bytes_after", d.bytes_after},
                                       {"k_rel_rms", d.k_rel_rms},
                                       {"v_rel_rms", d.v_rel_rms},
                                       {"seconds", d.seconds}});
  j["splices"] = splices;
  j["guard_raised"] = guard_raised;
  j["guard_text"] = guard_text;
  j["forward_passes"] = forward_passes;
  j["steps"] = nlohmann::json::array();
  for (const auto& s : steps) {
    j["steps"].push_back({{"step", s.step},
                          {"agent", s.agent},
                          {"handoff", s.handoff},
                          {"start_seconds", s.start_seconds},
                          {"ttft_seconds", s.ttft_seconds},
                          {"seconds", s.seconds},
                          {"handoff_seconds", s.handoff_seconds},
                          {"prefill_computed", s.prefill_computed},
                          {"prefill_reused", s.prefill_reused},
                          {"decode_tokens", s.decode_tokens},
                          {"kv_bytes", s.kv_bytes},
                          {"splice_tokens", s.splice_tokens},
                          {"splice_recomputed", s.splice_recomputed},
                          {"guard_probe_tokens", s.guard_probe_tokens},
                          {"guard_estimate", s.guard_estimate},
                          {"recompute_fraction", s.recompute_fraction},
                          {"guard_raised", s.guard_raised},
                          {"guard_text", s.guard_text},
                          {"kl", s.kl},
                          {"top1", s.top1},
                          {"nll", s.nll},
                          {"scored_tokens", s.scored_tokens},
                          {"output_tokens", s.output_tokens},
                          {"output", s.output}});
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

RunReport RunReport::from_json(const std::string& text) {
  try {
    const auto j = nlohmann::json::parse(text);
    RunReport r;
    r.workflow = j.at("workflow").get<std::string>();
    r.mode = parse_run_mode(j.at("mode").get<std::string>());
    r.kv = j.at("kv").get<std::string>();
    r.total_seconds = j.at("total_seconds").get<double>();
    r.load_seconds = j.at("load_seconds").get<double>();
    r.peak_kv_bytes = j.at("peak_kv_bytes").get<std::size_t>();
    r.weight_copies_bytes = j.at("weight_copies_bytes").get<std::size_t>();
    r.prefill_computed = j.at("prefill_computed").get<int>();
    r.prefill_reused = j.at("prefill_reused").get<int>();
    r.contexts_alive_at_end = j.at("contexts_alive_at_end").get<int>();
    r.pool_blocks_used_at_end = j.at("pool_blocks_used_at_end").get<std::size_t>();
    if (const auto t = j.find("tiers"); t != j.end()) {
      r.tiers.spills = t->at("spills").get<int>();
      r.tiers.evictions = t->at("evictions").get<int>();
      r.tiers.restores_on_demand = t->at("restores_on_demand").get<int>();
      r.tiers.prefetches = t->at("prefetches").get<int>();
      r.tiers.bytes_written = t->at("bytes_written").get<std::uint64_t>();
      r.tiers.bytes_read = t->at("bytes_read").get<std::uint64_t>();
      r.tiers.restore_wait_seconds = t->at("restore_wait_seconds").get<double>();
      r.tiers.peak_at_rest_bytes = t->at("peak_at_rest_bytes").get<std::size_t>();
      r.tiers.failures = t->at("failures").get<std::vector<std::string>>();
      if (const auto ds = t->find("demotions"); ds != t->end())
        for (const auto& d : *ds)
          r.tiers.demotions.push_back(TierDemotion{d.at("producer").get<std::string>(), d.at("from").get<std::string>(),
                                                   d.at("to").get<std::string>(), d.at("bytes_before").get<std::size_t>(),
                                                   d.at("bytes_after").get<std::size_t>(), d.at("k_rel_rms").get<double>(),
                                                   d.at("v_rel_rms").get<double>(), d.at("seconds").get<double>()});
    }
    r.splices = j.at("splices").get<int>();
    r.guard_raised = j.at("guard_raised").get<int>();
    r.guard_text = j.at("guard_text").get<int>();
    r.forward_passes = j.value("forward_passes", std::uint64_t{0});
    for (const auto& s : j.at("steps")) {
      StepMetrics m;
      m.step = s.at("step").get<std::string>();
      m.agent = s.at("agent").get<std::string>();
      m.handoff = s.at("handoff").get<std::string>();
      m.start_seconds = s.value("start_seconds", 0.0);
      m.ttft_seconds = s.at("ttft_seconds").get<double>();
      m.seconds = s.at("seconds").get<double>();
      m.handoff_seconds = s.at("handoff_seconds").get<double>();
      m.prefill_computed = s.at("prefill_computed").get<int>();
      m.prefill_reused = s.at("prefill_reused").get<int>();
      m.decode_tokens = s.at("decode_tokens").get<int>();
      m.kv_bytes = s.at("kv_bytes").get<std::size_t>();
      m.splice_tokens = s.at("splice_tokens").get<int>();
      m.splice_recomputed = s.at("splice_recomputed").get<int>();
      m.guard_probe_tokens = s.at("guard_probe_tokens").get<int>();
      m.guard_estimate = s.at("guard_estimate").get<double>();
      m.recompute_fraction = s.at("recompute_fraction").get<double>();
      m.guard_raised = s.at("guard_raised").get<int>();
      m.guard_text = s.at("guard_text").get<int>();
      m.kl = s.at("kl").get<double>();
      m.top1 = s.at("top1").get<double>();
      m.nll = s.at("nll").get<double>();
      m.scored_tokens = s.at("scored_tokens").get<int>();
      m.output_tokens = s.at("output_tokens").get<std::vector<TokenId>>();
      m.output = s.at("output").get<std::string>();
      r.steps.push_back(std::move(m));
    }
    return r;
  } catch (const nlohmann::json::exception& e) {
    fail(ErrorCode::internal, "run report JSON: {}", e.what());
  }
}

}  // namespace qkvshare::agents
