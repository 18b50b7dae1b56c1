// Nearest-name suggestions for unknown presets and flag values ("did you mean ...?").
// Edit distance is enough: preset lists are short and typos are the usual cause.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace memtrain::plan {

// Levenshtein distance, case-insensitive.
int edit_distance(const std::string& a, const std::string& b);

// The candidate closest to `name`; empty when `candidates` is empty.
std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates);

// What to suggest for an unknown `name`, quoted, for "did you mean ...?": the candidate an alias
// names (other tools' names for the same thing: {"gpt2-1.5b", "gpt2-xl"}), else every candidate
// that is `name` and a variant ("a100" -> "a100-40gb" or "a100-80gb"), else the nearest.
// Case-insensitive.
std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates,
                         const std::vector<std::pair<std::string, std::string>>& aliases = {});

}  // namespace memtrain::plan
