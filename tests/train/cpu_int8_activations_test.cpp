// train.cpu_activations = "int8": block-scaled int8 saved activations on the CPU engine. The
// kernels round and store exactly (a rounded field stores and comes back bit for bit, rounding
// twice is rounding once, the error stays within half a step of the block's power-of-two
// scale); a run tracks the fp32 run, holds its predicted bytes (about a quarter of fp32's saved
// fields), keeps every remat policy bitwise and resumes bitwise, under fp32 and bf16 compute.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "kernels/cpu/act_int8.h"
#include "test_util.h"
#include "train/measured_run.h"
#include "train/trainer.h"
#include "train/validate.h"

using namespace memtrain;

namespace {

std::vector<float> ramp(std::size_t n, float scale) {
    std::vector<float> x(n);
    for (std::size_t i = 0; i < n; i++)
        x[i] = scale * std::sin(0.37f * (float)i) * (1.0f + (float)(i % 7));
    return x;
}

RunConfig int8_run(const std::string& name, int steps, const std::string& precision = "fp32") {
    RunConfig c = test::wide_tiny_run(name, steps);
    c.model.n_layer = 4;
    c.train.precision = precision;
    c.train.cpu_activations = "int8";
    c.train.eval_every = 10;
    return c;
}

}  // namespace

TEST(Int8Activations, RoundingIsExactlyStoredAndIdempotentWithinHalfAStep) {
    const std::size_t n = 3 * cpu::kInt8Block + 17;  // a short last block
    EXPECT_EQ(cpu::int8_store_bytes(n), n + 4 * sizeof(float));
    const std::vector<float> x = ramp(n, 0.013f);
    std::vector<float> q = x;
    cpu::qdq_int8(q.data(), n);
    for (std::size_t b = 0; b * cpu::kInt8Block < n; b++) {
        const std::size_t lo = b * cpu::kInt8Block, hi = std::min(n, lo + cpu::kInt8Block);
        float amax = 0;
        for (std::size_t i = lo; i < hi; i++) amax = std::max(amax, std::fabs(x[i]));
        // The block's scale: the least power of two s with amax <= 127 s; every error <= s / 2.
        float s = 1;
        while (amax > 127 * s) s *= 2;
        while (amax <= 127 * (s / 2)) s /= 2;
        for (std::size_t i = lo; i < hi; i++) {
            EXPECT_LE(std::fabs(q[i] - x[i]), s / 2) << i;
            EXPECT_EQ(q[i], std::nearbyint(q[i] / s) * s) << "a multiple of the scale, " << i;
        }
    }
    std::vector<float> twice = q;
    cpu::qdq_int8(twice.data(), n);
    EXPECT_EQ(0, std::memcmp(twice.data(), q.data(), n * sizeof(float))) << "idempotent";
    std::vector<char> store(cpu::int8_store_bytes(n) + 4);
    void* aligned = store.data() + (4 - (reinterpret_cast<uintptr_t>(store.data()) % 4)) % 4;
    cpu::to_int8(aligned, q.data(), n);
    std::vector<float> back(n, -1.0f);
    cpu::from_int8(back.data(), aligned, n);
    EXPECT_EQ(0, std::memcmp(back.data(), q.data(), n * sizeof(float))) << "stored exactly";
    // The forward's one pass (qdq_int8_store: round and store together), whole and by parts on
    // the block grid (a tile of rows), gives the rounded values and the store's bytes of the two.
    for (std::size_t part : {n, 2 * cpu::kInt8Block}) {
        std::vector<float> fused = x;
        std::vector<char> one(store.size(), 0x55);
        void* out = one.data() + ((char*)aligned - store.data());
        for (std::size_t at = 0; at < n; at += part)
            cpu::qdq_int8_store(fused.data() + at, out, n, at, std::min(part, n - at));
        EXPECT_EQ(0, std::memcmp(fused.data(), q.data(), n * sizeof(float))) << part;
        EXPECT_EQ(0, std::memcmp(out, aligned, cpu::int8_store_bytes(n))) << part;
    }

    // An all-zero block stays zero; a block with a non-finite value becomes NaN, the others
    // are untouched by it.
    std::vector<float> z(2 * cpu::kInt8Block, 0.0f);
    z[cpu::kInt8Block + 5] = std::numeric_limits<float>::infinity();
    z[cpu::kInt8Block + 6] = 1.0f;
    cpu::qdq_int8(z.data(), z.size());
    for (std::size_t i = 0; i < cpu::kInt8Block; i++) EXPECT_EQ(z[i], 0.0f);
    EXPECT_TRUE(std::isnan(z[cpu::kInt8Block + 6]));
    cpu::to_int8(aligned, z.data(), z.size());
    std::vector<float> zb(z.size());
    cpu::from_int8(zb.data(), aligned, z.size());
    EXPECT_EQ(zb[0], 0.0f);
    EXPECT_TRUE(std::isnan(zb[cpu::kInt8Block]));
}

TEST(Int8Activations, TracksFp32InItsPredictedBytesAndRematIsBitwise) {
    const int steps = 40;
    RunConfig half = int8_run("int8act_bf16", 2);
    half.train.cpu_activations = "bf16";
    const test::MeasuredRun bf16 = test::measured_run(half);
    RunConfig plain = int8_run("int8act_ref", steps);
    plain.train.cpu_activations = "fp32";
    const test::MeasuredRun ref = test::measured_run(plain);
    const test::MeasuredRun q = test::measured_run(int8_run("int8act_int8", steps));
    // Stated tolerance: the final training loss within 2% of the fp32-stored run's.
    const double a = q.summary.losses.back(), b = ref.summary.losses.back();
    EXPECT_NEAR(a, b, 0.02 * b);
    EXPECT_LT(a, q.summary.losses.front() - 0.5) << "it learned";
    EXPECT_NE(q.summary.losses[1], ref.summary.losses[1]) << "the fields were not quantized";
    for (int k = 0; k < kNumMemCategories; k++)
        EXPECT_EQ(q.peak[k], q.predicted[k]) << category_name(MemCategory(k));
    // Every block's fields in int8 beside one fp32 working block (and the fp32 residual streams).
    EXPECT_LT(test::category_bytes(q.peak, MemCategory::Activations),
              test::category_bytes(bf16.peak, MemCategory::Activations));
    EXPECT_LT(test::category_bytes(bf16.peak, MemCategory::Activations),
              test::category_bytes(ref.peak, MemCategory::Activations));

    for (const char* policy : {"full", "memory-poor"}) {
        RunConfig c = int8_run(std::string("int8act_") + policy, steps);
        c.train.remat = policy;
        const test::MeasuredRun r = test::measured_run(c);
        EXPECT_EQ(q.summary.losses, r.summary.losses) << policy;
        EXPECT_EQ(0, std::memcmp(q.params.data(), r.params.data(), q.params.size() * sizeof(float)))
            << policy << " changed the int8 run's weights";
        for (int k = 0; k < kNumMemCategories; k++)
            EXPECT_EQ(r.peak[k], r.predicted[k]) << policy << " " << category_name(MemCategory(k));
    }
}

TEST(Int8Activations, UnderBf16ComputeRematAndResumeAreBitwise) {
    const test::MeasuredRun a = test::measured_run(int8_run("int8bf_none", 6, "bf16"));
    RunConfig c = int8_run("int8bf_selective", 6, "bf16");
    c.train.remat = "selective";
    const test::MeasuredRun b = test::measured_run(c);
    EXPECT_EQ(a.summary.losses, b.summary.losses);
    EXPECT_EQ(0, std::memcmp(a.params.data(), b.params.data(), a.params.size() * sizeof(float)));
    RunConfig whole = int8_run("int8bf_whole", 8, "bf16");
    Trainer w(whole, test::quiet());
    const TrainSummary sw = w.run();
    TrainSummary sr;
    auto r = test::train_stop_and_resume(int8_run("int8bf_split", 8, "bf16"), 4, sr);
    ASSERT_EQ(sr.losses.size(), 4u);
    for (int i = 0; i < 4; i++) EXPECT_EQ(sr.losses[i], sw.losses[4 + i]) << i;
    EXPECT_EQ(0, std::memcmp(w.model().params(), r->model().params(),
                             w.model().num_params() * sizeof(float)));
}
