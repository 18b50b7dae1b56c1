// Chinchilla's third approach on known laws: points on Chinchilla's published law give it back,
// noisy points of another law give it back within the noise, with bootstrap intervals that hold
// the truth; too few or bad points are refused by name.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "planner/scaling_fit.h"
#include "test_util.h"

namespace memtrain::plan {
namespace {

// Runs on isoFLOP curves, as a sweep makes them: for each compute, sizes around its optimum.
std::vector<LossPoint> isoflop_points(const ChinchillaFit& law, double noise, uint64_t seed) {
    Rng rng(seed);
    std::vector<LossPoint> pts;
    for (double c : {1e18, 1e19, 1e20, 1e21})
        for (double k : {0.25, 0.5, 1.0, 2.0, 4.0}) {
            const double n = chinchilla_optimal(c, law).params * k, d = c / (6 * n);
            const double z = noise * std::sqrt(-2 * std::log(1 - rng.uniform())) *
                             std::cos(6.283185307179586 * rng.uniform());
            pts.push_back({n, d, chinchilla_loss(n, d, law) * std::exp(z), ""});
        }
    return pts;
}

}  // namespace

TEST(ScalingFit, PointsOnChinchillasLawGiveItBack) {
    const ChinchillaFit truth;  // E 1.69, A 406.4, B 410.7, alpha 0.34, beta 0.28
    FitOptions o;
    o.bootstrap = 0;
    const ScalingLawFit f = fit_scaling_law(isoflop_points(truth, 0, 1), o);
    EXPECT_NEAR(f.law.E, truth.E, 1e-3 * truth.E);
    EXPECT_NEAR(f.law.alpha, truth.alpha, 1e-3);
    EXPECT_NEAR(f.law.beta, truth.beta, 1e-3);
    EXPECT_NEAR(std::log(f.law.A), std::log(truth.A), 1e-2);
    EXPECT_NEAR(std::log(f.law.B), std::log(truth.B), 1e-2);
    EXPECT_LT(f.objective, 1e-12);
    // ... and so its compute-optimal allocation.
    EXPECT_NEAR(chinchilla_optimal(1e23, f.law).params / chinchilla_optimal(1e23, truth).params,
                1.0, 0.01);
}

TEST(ScalingFit, NoisyPointsOfAnotherLawGiveItBackWithinTheIntervals) {
    // Epoch AI's refit of Chinchilla (Besiroglu et al. 2024) as the truth, 1% noise on the loss.
    const ChinchillaFit truth{1.82, 482.0, 2085.4, 0.3478, 0.3658};
    FitOptions o;
    o.bootstrap = 60;
    const ScalingLawFit f = fit_scaling_law(isoflop_points(truth, 0.01, 7), o);
    EXPECT_NEAR(f.law.alpha, truth.alpha, 0.08);
    EXPECT_NEAR(f.law.beta, truth.beta, 0.08);
    EXPECT_NEAR(f.law.E, truth.E, 0.15);
    EXPECT_LE(f.alpha.lo, truth.alpha);
    EXPECT_GE(f.alpha.hi, truth.alpha);
    EXPECT_LE(f.beta.lo, truth.beta);
    EXPECT_GE(f.beta.hi, truth.beta);
    EXPECT_LE(f.E.lo, truth.E);
    EXPECT_GE(f.E.hi, truth.E);
    EXPECT_EQ((int)f.resamples.size(), 60);
    // The predicted loss at a held-out point, within 2%.
    const double n = 3e9, d = 6e10;
    EXPECT_NEAR(chinchilla_loss(n, d, f.law) / chinchilla_loss(n, d, truth), 1.0, 0.02);
}

TEST(ScalingFit, TooFewOrBadPointsAreRefusedByName) {
    std::vector<LossPoint> pts = isoflop_points(ChinchillaFit{}, 0, 1);
    pts.resize(4);
    EXPECT_NE(test::error_of([&] { fit_scaling_law(pts); }).find("at least 5 runs"),
              std::string::npos);
    std::vector<LossPoint> same_n(6, LossPoint{1e6, 1e9, 3.0, ""});
    for (int i = 0; i < 6; i++) same_n[(std::size_t)i].tokens = 1e9 * (i + 1);
    EXPECT_NE(test::error_of([&] { fit_scaling_law(same_n); }).find("1 sizes"), std::string::npos);
    pts = isoflop_points(ChinchillaFit{}, 0, 1);
    pts[3].loss = NAN;
    pts[3].origin = "runs/c1e19_n2";
    EXPECT_NE(test::error_of([&] {
                  fit_scaling_law(pts);
              }).find("runs/c1e19_n2: the loss nan is not a positive number"),
              std::string::npos);
}

}  // namespace memtrain::plan
