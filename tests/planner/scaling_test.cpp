// Scaling laws: the closed-form Chinchilla optimum against brute force, the 20N rule, Kaplan.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "planner/scaling.h"

namespace memtrain::plan {

TEST(PlanScaling, ChinchillaLossAt70B1_4T) {
    // 1.69 + 406.4 / 7e10^0.34 + 410.7 / 1.4e12^0.28 = 1.69 + 0.0836 + 0.1633
    EXPECT_NEAR(chinchilla_loss(70e9, 1.4e12), 1.9368, 0.001);
}

TEST(PlanScaling, TwentyTokensPerParam) {
    Allocation a = chinchilla_20x(5.76e23);  // Chinchilla's budget
    EXPECT_NEAR(a.params, 6.93e10, 0.01e10);
    EXPECT_NEAR(a.tokens / a.params, 20, 1e-9);
}

TEST(PlanScaling, ClosedFormIsTheMinimum) {
    const double C = 1e23;
    Allocation opt = chinchilla_optimal(C);
    EXPECT_NEAR(6 * opt.params * opt.tokens, C, C * 1e-9);
    for (double f : {0.5, 0.8, 0.95, 1.05, 1.25, 2.0}) {
        double n = opt.params * f;
        EXPECT_GT(chinchilla_loss(n, C / (6 * n)), opt.loss);
    }
}

TEST(PlanScaling, KaplanPrefersBiggerModels) {
    EXPECT_GT(kaplan_optimal(1e23).params, chinchilla_20x(1e23).params);
    EXPECT_THROW(chinchilla_optimal(-1), memtrain::Error);
}

TEST(PlanScaling, ShapeForParams) {
    ModelSpec m = shape_for_params(7e9);
    EXPECT_NEAR(std::log(m.total_params() / 7e9), 0, 0.35);
    EXPECT_EQ(m.n_embd % m.n_head, 0);
}

}  // namespace memtrain::plan
