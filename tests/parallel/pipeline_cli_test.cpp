// `memtrain pipeline` through the binary: the demo model split over stages, the simulated step
// and bubble printed, the timeline drawn, and bad layouts refused with one line.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli/cli_util.h"
#include "test_util.h"

namespace memtrain {
namespace {

using test::run_memtrain;

TEST(PipelineCli, DemoModelSchedulesAndTimeline) {
    const std::string dir = test::temp_dir("pipeline_cli");
    const std::string demo = std::string(MT_SOURCE_DIR) + "/configs/demo.toml";
    auto r = run_memtrain("pipeline " + demo + " --pp 2 --micro-batches 4 --lists --svg " + dir +
                          "/t.svg");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("bubble"), std::string::npos);
    std::ifstream f(dir + "/t.svg");
    std::stringstream svg;
    svg << f.rdbuf();
    EXPECT_EQ(svg.str().rfind("<svg", 0), 0u);
    for (const char* k : {"gpipe", "naive", "interleaved", "zb-h1", "pipedream", "pipedream-2bw"}) {
        r = run_memtrain("pipeline " + demo + " --pp 2 --micro-batches 4 --schedule " + k +
                         (std::string(k) == "interleaved" ? " --virtual 3" : ""));
        EXPECT_EQ(r.code, 0) << k << ": " << r.output;
    }
    r = run_memtrain("pipeline " + demo + " --pp 7 --micro-batches 4");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("7 pipeline stages for 6 layers"), std::string::npos) << r.output;
    r = run_memtrain("pipeline " + demo +
                     " --pp 2 --micro-batches 3 --schedule interleaved --virtual 2");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("multiple of the pipeline stages"), std::string::npos) << r.output;
    r = run_memtrain("pipeline " + demo + " --schedule 2f2b");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("unknown pipeline schedule"), std::string::npos) << r.output;
}

}  // namespace
}  // namespace memtrain
