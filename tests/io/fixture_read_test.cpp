// The PyTorch parity fixture (tests/parity/make_fixture.py, run with Debian's python3-torch) must
// be readable by SafetensorsFile: every tensor present with the right dtype and shape, and its
// contents self-consistent (the stored loss is the cross-entropy of the stored logits).
// No torch is a failure, not a skip: parity cannot be checked without it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "cli/cli_util.h"
#include "io/safetensors.h"
#include "test_util.h"

using namespace memtrain;

namespace {

using test::kFixtureBatch;
using test::kFixtureBlock;
using test::kFixtureEmbd;
using test::kFixtureHeads;
using test::kFixtureLayers;
using test::kFixtureSeq;
using test::kFixtureVocab;
using test::read_f32_tensor;

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_params() {
    std::vector<std::pair<std::string, std::vector<int64_t>>> p = {
        {"wte.weight", {kFixtureVocab, kFixtureEmbd}},
        {"wpe.weight", {kFixtureBlock, kFixtureEmbd}}};
    for (int i = 0; i < kFixtureLayers; i++) {
        std::string h = "h." + std::to_string(i) + ".";
        p.push_back({h + "ln_1.weight", {kFixtureEmbd}});
        p.push_back({h + "ln_1.bias", {kFixtureEmbd}});
        p.push_back({h + "attn.c_attn.weight", {kFixtureEmbd, 3 * kFixtureEmbd}});
        p.push_back({h + "attn.c_attn.bias", {3 * kFixtureEmbd}});
        p.push_back({h + "attn.c_proj.weight", {kFixtureEmbd, kFixtureEmbd}});
        p.push_back({h + "attn.c_proj.bias", {kFixtureEmbd}});
        p.push_back({h + "ln_2.weight", {kFixtureEmbd}});
        p.push_back({h + "ln_2.bias", {kFixtureEmbd}});
        p.push_back({h + "mlp.c_fc.weight", {kFixtureEmbd, 4 * kFixtureEmbd}});
        p.push_back({h + "mlp.c_fc.bias", {4 * kFixtureEmbd}});
        p.push_back({h + "mlp.c_proj.weight", {4 * kFixtureEmbd, kFixtureEmbd}});
        p.push_back({h + "mlp.c_proj.bias", {kFixtureEmbd}});
    }
    p.push_back({"ln_f.weight", {kFixtureEmbd}});
    p.push_back({"ln_f.bias", {kFixtureEmbd}});
    return p;
}

// Builds the fixture once per process; "" (after a test failure) if torch or the script fails.
const std::string& fixture() {
    static const std::string path = []() -> std::string {
        std::string out = std::string(MT_BINARY_DIR) + "/io_fixture.safetensors";
        // Per process: ctest runs each test in its own process, possibly at the same time.
        std::string log = out + "." + std::to_string(::getpid()) + ".log";
        std::string probe = "/usr/bin/python3 -c 'import torch, numpy' > " + log + " 2>&1";
        if (std::system(probe.c_str()) != 0) {
            ADD_FAILURE() << "/usr/bin/python3 cannot import torch and numpy, which the PyTorch "
                             "parity fixture needs; install python3-torch and python3-numpy "
                             "(scripts/deps.sh does). Python said:\n"
                          << test::read_file(log);
            return "";
        }
        std::string cmd = std::string("/usr/bin/python3 ") + MT_SOURCE_DIR +
                          "/tests/parity/make_fixture.py " + out + " > " + log + " 2>&1";
        if (std::system(cmd.c_str()) != 0) {
            ADD_FAILURE() << "tests/parity/make_fixture.py failed (" << cmd << "):\n"
                          << test::read_file(log);
            return "";
        }
        std::remove(log.c_str());
        return out;
    }();
    return path;
}

}  // namespace

TEST(FixtureRead, EveryTensorHasItsNameDTypeAndShape) {
    const std::string& path = fixture();
    ASSERT_FALSE(path.empty());
    auto f = io::SafetensorsFile::open(path);
    auto params = hf_params();
    // The weights, their gradients, the weights after five AdamW steps and the gradients under
    // PyTorch's CPU autocast, plus tokens, logits, loss, autocast.loss and three adam.* series.
    EXPECT_EQ(f.names().size(), 4 * params.size() + 7);
    for (const std::string prefix : {"", "grad.", "adam.final.", "autocast.grad."}) {
        for (const auto& [name, shape] : params) {
            const io::TensorInfo* t = f.find(prefix + name);
            ASSERT_NE(t, nullptr) << prefix + name << " missing from " << path;
            EXPECT_EQ(t->dtype, io::DType::F32) << t->name;
            EXPECT_EQ(t->shape, shape) << t->name;
            auto v = read_f32_tensor(f, t->name, shape);
            for (float x : v) ASSERT_TRUE(std::isfinite(x)) << t->name;
        }
    }
    const auto& tok = f.get("tokens");
    EXPECT_EQ(tok.dtype, io::DType::I32);
    ASSERT_EQ(tok.shape, (std::vector<int64_t>{kFixtureBatch, kFixtureSeq + 1}));
    const auto* ids = static_cast<const int32_t*>(f.data(tok));
    for (int i = 0; i < kFixtureBatch * (kFixtureSeq + 1); i++) {
        EXPECT_GE(ids[i], 0);
        EXPECT_LT(ids[i], kFixtureVocab);
    }
    EXPECT_EQ(f.get("logits").shape,
              (std::vector<int64_t>{kFixtureBatch, kFixtureSeq, kFixtureVocab}));
    EXPECT_EQ(f.get("loss").shape, (std::vector<int64_t>{1}));
    EXPECT_EQ(f.get("adam.losses").shape, (std::vector<int64_t>{5}));

    const auto& m = f.metadata();
    EXPECT_EQ(m.at("fixture_version"), "1");
    EXPECT_EQ(m.at("vocab_size"), "96");
    EXPECT_EQ(m.at("padded_vocab"), "128");
    EXPECT_EQ(m.at("n_layer"), "2");
    EXPECT_EQ(m.at("n_head"), "4");
    EXPECT_EQ(m.at("n_embd"), "64");
    EXPECT_EQ(m.at("block_size"), "32");
    EXPECT_EQ(m.at("warmup_steps"), "2");
    EXPECT_EQ(m.at("steps"), "5");
    (void)kFixtureHeads;
}

TEST(FixtureRead, StoredLossIsTheCrossEntropyOfTheStoredLogits) {
    const std::string& path = fixture();
    ASSERT_FALSE(path.empty());
    auto f = io::SafetensorsFile::open(path);
    auto logits = read_f32_tensor(f, "logits", {kFixtureBatch, kFixtureSeq, kFixtureVocab});
    const auto* ids = static_cast<const int32_t*>(f.data(f.get("tokens")));
    double total = 0;
    for (int b = 0; b < kFixtureBatch; b++)
        for (int t = 0; t < kFixtureSeq; t++) {
            const float* row = logits.data() + ((std::size_t)b * kFixtureSeq + t) * kFixtureVocab;
            double mx = row[0];
            for (int v = 1; v < kFixtureVocab; v++) mx = std::max(mx, (double)row[v]);
            double sum = 0;
            for (int v = 0; v < kFixtureVocab; v++) sum += std::exp(row[v] - mx);
            int target = ids[b * (kFixtureSeq + 1) + t + 1];
            total += mx + std::log(sum) - row[target];
        }
    double ce = total / (kFixtureBatch * kFixtureSeq);
    float loss = read_f32_tensor(f, "loss", {1})[0];
    EXPECT_NEAR(ce, loss, 1e-5 * loss);
    EXPECT_NEAR(loss, std::log((double)kFixtureVocab), 0.5);  // near-uniform at initialisation

    // The AdamW run starts from the same weights, and its loss goes down.
    auto losses = read_f32_tensor(f, "adam.losses", {5});
    EXPECT_FLOAT_EQ(losses[0], loss);
    for (int i = 1; i < 5; i++) EXPECT_LT(losses[i], losses[i - 1]);
    // The learning rates follow warmup (2 steps) then cosine to 0.1 * peak at step 5.
    auto lrs = read_f32_tensor(f, "adam.lrs", {5});
    const double pi = std::acos(-1.0), peak = 1e-3, lo = 1e-4;
    double expect[5] = {peak / 2, peak, peak, lo + 0.5 * (peak - lo) * (1 + std::cos(pi / 3)),
                        lo + 0.5 * (peak - lo) * (1 + std::cos(2 * pi / 3))};
    for (int i = 0; i < 5; i++) EXPECT_NEAR(lrs[i], expect[i], 1e-9) << "step " << i;
}
