// Rendering planner results for people and programs: text tables, JSON, an SVG chart of the
// memory breakdown, and a memtrain TOML for the chosen plan. No arithmetic lives here.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "planner/search.h"

namespace memtrain {
struct RunConfig;
}

namespace memtrain::plan {

std::string format_bytes(double bytes);  // "24.00 GB"
// The per-GPU table; with a cluster, whether it fits the GPU's memory and, for offloaded states,
// the host memory of a node (ClusterSpec::host_memory_bytes, when given).
std::string format_memory_table(const MemoryEstimate& est, const ClusterSpec* cluster = nullptr);
std::string format_time(const TimeEstimate& t);
std::string format_plans(const SearchResult& result, int top, int reasons,
                         const ClusterSpec& cluster);
nlohmann::json to_json(const MemoryEstimate& est);
nlohmann::json to_json(const SearchResult& result, int top);
// Stacked bars, one per plan, one colour per memory category, a line at the GPU capacity.
std::string memory_svg(const SearchResult& result, int top, double capacity_bytes);
// A whole memtrain config for `plan`, its layout in the [train], [optim] and [lora] keys and
// described in a comment block above: every other key is `source`'s (the TOML the model came
// from: its exact model, optimizer, data and io sections), or the defaults around the planned
// model (config_from_model) without one.
std::string emit_config_toml(const ModelSpec& model, const Plan& plan,
                             const RunConfig* source = nullptr);

}  // namespace memtrain::plan
