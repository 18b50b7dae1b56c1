// Shared by the op tests: random inputs, the objective L = sum(out * w), and the check of an
// analytic gradient against central finite differences of that objective.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "core/rng.h"

namespace memtrain::test {

inline std::vector<float> randn(std::size_t n, uint64_t seed, float scale = 1.0f) {
    Rng r(seed);
    std::vector<float> v(n);
    for (auto& x : v) x = (float)(r.normal() * scale);
    return v;
}

inline double dot(const std::vector<float>& a, const std::vector<float>& b) {
    double s = 0;
    for (std::size_t i = 0; i < a.size(); i++) s += (double)a[i] * b[i];
    return s;
}

// Checks grad (analytic, d objective / d x) against finite differences of objective(), probing
// up to `probes` coordinates of x.
inline void check_grad(const char* what, std::vector<float>& x, const std::vector<float>& grad,
                       const std::function<double()>& objective, double tol = 2e-2,
                       int probes = 40) {
    ASSERT_EQ(x.size(), grad.size()) << what;
    const float h = 1e-2f;
    std::size_t stride = std::max<std::size_t>(1, x.size() / probes);
    for (std::size_t i = 0; i < x.size(); i += stride) {
        float saved = x[i];
        x[i] = saved + h;
        double lp = objective();
        x[i] = saved - h;
        double lm = objective();
        x[i] = saved;
        double num = (lp - lm) / (2.0 * h);
        double err = std::abs(num - grad[i]) / std::max(1.0, std::abs(num) + std::abs(grad[i]));
        EXPECT_LT(err, tol) << what << "[" << i << "]: analytic " << grad[i] << " numeric " << num;
    }
}

}  // namespace memtrain::test
