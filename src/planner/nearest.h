// Nearest-name suggestions for unknown presets and flag values ("did you mean ...?").
// Edit distance is enough: preset lists are short and typos are the usual cause.
#pragma once

#include <string>
#include <vector>

namespace memtrain::plan {

// Levenshtein distance, case-insensitive.
int edit_distance(const std::string& a, const std::string& b);

// The candidate closest to `name`; empty when `candidates` is empty.
std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates);

}  // namespace memtrain::plan
