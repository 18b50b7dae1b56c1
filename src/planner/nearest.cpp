// Edit distance and nearest-name lookup used by every "unknown X, did you mean Y" message.
#include "planner/nearest.h"

#include <algorithm>
#include <cctype>

namespace memtrain::plan {

int edit_distance(const std::string& a, const std::string& b) {
    std::vector<int> row(b.size() + 1);
    for (size_t j = 0; j <= b.size(); ++j) row[j] = static_cast<int>(j);
    for (size_t i = 1; i <= a.size(); ++i) {
        int diag = row[0];
        row[0] = static_cast<int>(i);
        for (size_t j = 1; j <= b.size(); ++j) {
            int up = row[j];
            bool same = std::tolower(static_cast<unsigned char>(a[i - 1])) ==
                        std::tolower(static_cast<unsigned char>(b[j - 1]));
            row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (same ? 0 : 1)});
            diag = up;
        }
    }
    return row[b.size()];
}

std::string nearest_name(const std::string& name, const std::vector<std::string>& candidates) {
    std::string best;
    int best_d = 1 << 30;
    for (const auto& c : candidates) {
        int d = edit_distance(name, c);
        if (d < best_d) best_d = d, best = c;
    }
    return best;
}

}  // namespace memtrain::plan
