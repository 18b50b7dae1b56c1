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

std::string did_you_mean(const std::string& name, const std::vector<std::string>& candidates,
                         const std::vector<std::pair<std::string, std::string>>& aliases) {
    auto lower = [](std::string s) {
        for (char& c : s) c = (char)std::tolower((unsigned char)c);
        return s;
    };
    const std::string n = lower(name);
    for (const auto& [alias, target] : aliases)
        if (lower(alias) == n) return "\"" + target + "\"";
    // A family named without its variant ("a100" of "a100-40gb"): every variant.
    std::vector<std::string> begun;
    if (n.size() >= 2)
        for (const auto& c : candidates)
            if (lower(c).rfind(n + "-", 0) == 0) begun.push_back("\"" + c + "\"");
    if (begun.size() == 1) return begun[0];
    if (begun.size() > 1) {
        std::string out;
        for (std::size_t i = 0; i < begun.size(); i++)
            out += (i == 0 ? "" : i + 1 == begun.size() ? " or " : ", ") + begun[i];
        return out;
    }
    return "\"" + nearest_name(name, candidates) + "\"";
}

}  // namespace memtrain::plan
