// `memtrain sweep` and `memtrain scale --fit` from the command line: an isoFLOP grid of tiny
// models trains, records itself and is fitted; run again it trains nothing; the fit alone reads
// the same runs; bad input is named.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"

namespace memtrain::test {
namespace {

// slow_config's tiny runs, with a validation shard.
std::string sweep_config(const std::string& dir) {
    const std::string cfg = slow_config(dir, 10);
    data::write_shard(dir + "/val.bin", patterned_tokens(4096, 50, 2), 50);
    write_file(cfg, read_file(cfg) + "[guard]\nenabled = true\n");
    return cfg;
}

}  // namespace

TEST(SweepCli, TrainsTheGridFitsItAndResumesWithoutRetraining) {
    const std::string dir = temp_dir("sweep_cli");
    const std::string cfg = sweep_config(dir);
    const std::string args = "sweep " + cfg + " --flops 2e9,4e9,8e9 --sizes 1x64,2x64 --out " +
                             dir + "/grid --min-steps 5 --set data.val=" + dir +
                             "/val.bin --set train.eval_batches=4";
    const CliResult r = run_memtrain(args);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("sweep: 6 runs in"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("scaling law fitted to 6 runs"), std::string::npos) << r.output;
    // (at the largest budget the runs spent: 8e9 to within a step's tokens)
    EXPECT_NE(r.output.find("compute-optimal at C = 8"), std::string::npos) << r.output;
    const auto rec = nlohmann::json::parse(read_file(dir + "/grid/sweep.json"));
    ASSERT_EQ(rec["runs"].size(), 6u);
    for (const auto& run : rec["runs"]) {
        EXPECT_GT(run["val_loss"].get<double>(), 0.0);
        // C = 6 N D to within one step's tokens.
        const double c = 6 * run["params"].get<double>() * run["tokens"].get<double>();
        EXPECT_NEAR(c / run["flops"].get<double>(), 1.0, 0.1) << run.dump();
    }

    // Again: every run is complete, none trains.
    const CliResult again = run_memtrain(args);
    ASSERT_EQ(again.code, 0) << again.output;
    EXPECT_EQ(count_occurrences(again.output, "done before"), 6) << again.output;
    EXPECT_EQ(count_occurrences(again.output, "done in"), 0) << again.output;

    // The fit alone, over the same runs, as JSON.
    std::string dirs;
    for (const auto& run : rec["runs"]) {
        dirs += ' ';  // (appended in two steps: GCC 12's -Wrestrict misfires on " " + s here)
        dirs += run["dir"].get<std::string>();
    }
    const CliResult fit = run_memtrain("scale --json --flops 1e10 --fit" + dirs, "memtrain");
    ASSERT_EQ(fit.code, 0) << fit.output;
    const auto j = nlohmann::json::parse(fit.output);
    EXPECT_EQ(j["runs"].size(), 6u);
    EXPECT_EQ(j["bootstrap"].get<int>(), 200);
    EXPECT_DOUBLE_EQ(j["flops"].get<double>(), 1e10);
    // (How well a law is recovered is tests/planner/scaling_fit_test.cpp's; six tiny runs of
    // two sizes pin it down loosely.)
    for (const auto& run : j["runs"]) EXPECT_GT(run["fitted"].get<double>(), 0.0) << run.dump();
    EXPECT_TRUE(j["law"]["alpha"].is_number()) << fit.output;
}

TEST(SweepCli, BadInputIsNamed) {
    const std::string dir = temp_dir("sweep_cli_bad");
    const std::string cfg = slow_config(dir, 10);  // no data.val
    CliResult r = run_memtrain("sweep " + cfg + " --flops 1e9 --sizes 1x64");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("set data.val"), std::string::npos) << r.output;
    r = run_memtrain("sweep " + cfg + " --flops 1e9 --sizes 2x100 --set data.val=" + dir +
                     "/train.bin");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("\"2x100\" is not LAYERSxWIDTH"), std::string::npos) << r.output;
    r = run_memtrain("sweep " + cfg + " --flops 1e9,x --sizes 1x64 --set data.val=" + dir +
                     "/train.bin");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("--flops: \"x\""), std::string::npos) << r.output;
    // A run without validation losses cannot be fitted: the directory is named.
    ASSERT_EQ(run_memtrain("train " + cfg).code, 0);
    r = run_memtrain("scale --fit " + dir + "/out " + dir + "/out " + dir + "/out " + dir +
                     "/out " + dir + "/out");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find(dir + "/out: no validation loss at step 10"), std::string::npos)
        << r.output;
    r = run_memtrain("scale --fit " + dir + "/nowhere");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("nowhere"), std::string::npos) << r.output;
}

}  // namespace memtrain::test
