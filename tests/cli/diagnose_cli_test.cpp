// `memtrain diagnose` on runs built to have a cause: recompute on, a slow data loader; the
// metrics lines carry each step's phases; a directory without timings.json is refused. (The
// pipeline with one micro-batch and the rank slowed by a sleep run under mpirun:
// mpi_cli_test.cpp.)
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "test_util.h"

namespace {

using memtrain::test::count_occurrences;
using memtrain::test::read_file;
using memtrain::test::slow_config;

std::string memtrain_cmd(const std::string& env, const std::string& args) {
    return env + " OMP_NUM_THREADS=1 timeout -k 5 120 " + std::string(MT_BINARY_DIR) +
           "/memtrain " + args;
}

// The key of the largest loss `memtrain diagnose DIR --json` names.
std::string largest_loss(const std::string& dir) {
    auto r = memtrain::test::run_command(memtrain_cmd("", "diagnose " + dir + " --json"), false);
    EXPECT_EQ(r.code, 0) << r.output;
    return nlohmann::json::parse(r.output).at("largest_loss").get<std::string>();
}

TEST(DiagnoseCli, RecomputeOnIsNamed) {
    const std::string dir = memtrain::test::temp_dir("cli_diag_recompute");
    const std::string cfg = slow_config(dir, 5, 64);
    auto r = memtrain::test::run_command(memtrain_cmd(
        "", "train " + cfg + " --set train.remat=full train.batch_size=64 io.out_dir=" + dir +
                "/full"));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(largest_loss(dir + "/full"), "recompute");
    auto text = memtrain::test::run_memtrain("diagnose " + dir + "/full");
    ASSERT_EQ(text.code, 0) << text.output;
    EXPECT_EQ(count_occurrences(text.output, "largest loss: recompute"), 1) << text.output;
    EXPECT_EQ(count_occurrences(text.output, "what would recover it: train.remat = full"), 1)
        << text.output;
    EXPECT_EQ(count_occurrences(text.output, "memory (rank 0)"), 1) << text.output;
    // Every step's line has its phases.
    EXPECT_EQ(count_occurrences(read_file(dir + "/full/metrics.jsonl"), "\"phases_ms\": {\"data\""),
              5);
}

TEST(DiagnoseCli, SlowDataLoaderIsNamed) {
    const std::string dir = memtrain::test::temp_dir("cli_diag_data");
    const std::string cfg = slow_config(dir, 4, 64);
    auto r = memtrain::test::run_command(memtrain_cmd(
        "MEMTRAIN_TEST_SLOW_DATA_MS=150", "train " + cfg + " --set io.out_dir=" + dir + "/slow"));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(largest_loss(dir + "/slow"), "data");
}

TEST(DiagnoseCli, ARunWithoutTimingsIsRefused) {
    const std::string dir = memtrain::test::temp_dir("cli_diag_none");
    auto r = memtrain::test::run_memtrain("diagnose " + dir);
    EXPECT_NE(r.code, 0);
    EXPECT_EQ(count_occurrences(r.output, dir + "/timings.json: no such file"), 1) << r.output;
    r = memtrain::test::run_memtrain("diagnose " + dir + "/missing");
    EXPECT_NE(r.code, 0);
    EXPECT_EQ(count_occurrences(r.output, "not a directory"), 1) << r.output;
}

}  // namespace
