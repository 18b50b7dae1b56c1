// memtrain diagnose's pieces: the phase clock counts nested phases once, timings.json round
// trips and its errors name the file and field, and the split of known timings names the loss
// and (against a baseline) the growth that was built into them.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>

#include "core/error.h"
#include "core/phase_clock.h"
#include "io/text_file.h"
#include "test_util.h"
#include "train/diagnose.h"

namespace memtrain {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

TEST(PhaseClock, NestedPhasesCountOnceAndTimeOutsideCountsNowhere) {
    PhaseClock c;
    const auto t0 = std::chrono::steady_clock::now();
    c.enter(Phase::compute);
    std::this_thread::sleep_for(20ms);
    c.enter(Phase::comm);
    std::this_thread::sleep_for(20ms);
    const PhaseTimes open = c.totals();  // an open phase counts up to now
    EXPECT_GE(open[Phase::comm], 0.02);
    c.leave();
    std::this_thread::sleep_for(20ms);
    c.leave();
    const double wall =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::this_thread::sleep_for(20ms);  // outside every phase
    const PhaseTimes t = c.totals();
    EXPECT_GE(t[Phase::compute], 0.04);
    EXPECT_GE(t[Phase::comm], 0.02);
    // Exclusive: the inner phase is not also the outer one's, and nothing after the last leave.
    EXPECT_LE(t.total(), wall);
    EXPECT_EQ(t[Phase::data] + t[Phase::p2p] + t[Phase::optimizer] + t[Phase::recompute], 0.0);
    c.leave();  // one too many: ignored
    EXPECT_EQ(c.totals().total(), t.total());
}

TEST(PhaseClock, ACollectiveInsideAPipelinesSynchronisationIsP2p) {
    PhaseClock c;
    c.enter(Phase::p2p);
    c.enter(Phase::comm);
    std::this_thread::sleep_for(5ms);
    c.leave();
    c.leave();
    EXPECT_EQ(c.totals()[Phase::comm], 0.0);
    EXPECT_GE(c.totals()[Phase::p2p], 0.005);
}

TEST(PhaseClock, EachThreadHasItsOwn) {
    phase_clock().enter(Phase::data);
    double other = -1;
    std::thread([&] { other = phase_clock().totals().total(); }).join();
    phase_clock().leave();
    EXPECT_EQ(other, 0.0);
}

RankTimes rank_times(int rank, double step, double compute, double comm, double p2p = 0,
                     double data = 0, double recompute = 0, double optimizer = 0.002) {
    RankTimes r;
    r.rank = rank;
    r.step_s = step;
    r.phases[Phase::compute] = compute;
    r.phases[Phase::comm] = comm;
    r.phases[Phase::p2p] = p2p;
    r.phases[Phase::data] = data;
    r.phases[Phase::recompute] = recompute;
    r.phases[Phase::optimizer] = optimizer;
    return r;
}

RunTimings timings(int dp, int pp, int m) {
    RunTimings t;
    t.steps = 4;
    t.engine = "cpu";
    t.dp = dp;
    t.pp = pp;
    t.micro_batches = m;
    t.schedule = pp > 1 ? "1f1b" : "";
    t.remat = "none";
    t.tokens_per_step = 1000 * dp;
    if (pp > 1) t.bubble_fraction = (pp - 1.0) / (m + pp - 1.0);
    return t;
}

std::string write_run(const std::string& name, const RunTimings& t) {
    const std::string dir = test::temp_dir(name);
    write_timings_json(dir + "/timings.json", t);
    return dir;
}

TEST(Diagnose, TimingsRoundTripAndBadFilesNameTheFileAndField) {
    RunTimings t = timings(2, 1, 1);
    t.ranks = {rank_times(0, 0.1, 0.05, 0.04), rank_times(1, 0.1, 0.09, 0.001)};
    t.ranks[1].stage = 0;
    t.ranks[1].replica = 1;
    const std::string dir = write_run("diag_roundtrip", t);
    const RunTimings r = read_timings_json(dir + "/timings.json");
    EXPECT_EQ(r.dp, 2);
    ASSERT_EQ(r.ranks.size(), 2u);
    EXPECT_EQ(r.ranks[1].replica, 1);
    EXPECT_EQ(r.ranks[1].phases[Phase::compute], 0.09);
    EXPECT_EQ(r.ranks[0].phases[Phase::comm], 0.04);

    try {
        diagnose_run(dir + "/nowhere", "");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not a directory"), std::string::npos) << e.what();
    }
    const std::string empty = test::temp_dir("diag_empty");
    try {
        diagnose_run(empty, "");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("timings.json: no such file"), std::string::npos)
            << e.what();
    }
    io::write_text_file(empty + "/timings.json", "{\"steps\": 3");
    try {
        read_timings_json(empty + "/timings.json");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("not JSON"), std::string::npos) << e.what();
    }
    io::write_text_file(empty + "/timings.json", "{\"steps\": 3}");
    try {
        read_timings_json(empty + "/timings.json");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("no field \"engine\""), std::string::npos) << e.what();
    }
    RunTimings none = t;
    none.steps = 0;
    try {
        diagnose_run(write_run("diag_nosteps", none), "");
        FAIL();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("at least 2 steps"), std::string::npos) << e.what();
    }
}

TEST(Diagnose, SplitOfKnownTimings) {
    // Two data-parallel ranks: rank 1 computes 90 ms, rank 0 50 ms and waits 40 ms for it.
    RunTimings t = timings(2, 1, 1);
    t.ranks = {rank_times(0, 0.1, 0.05, 0.045), rank_times(1, 0.1, 0.09, 0.005)};
    const Diagnosis d = diagnose_run(write_run("diag_split", t), "");
    EXPECT_DOUBLE_EQ(d.step_ms, 100);
    EXPECT_DOUBLE_EQ(d.compute_ms, 70);  // the mean
    EXPECT_EQ(d.slowest_rank, 1);
    ASSERT_FALSE(d.losses.empty());
    EXPECT_EQ(d.losses[0].key, "wait");
    EXPECT_NEAR(d.losses[0].ms, 40, 1e-9);
    for (const TimeLoss& l : d.losses) {
        if (l.key == "comm") {
            EXPECT_NEAR(l.ms, 5, 1e-9);
        }
        if (l.key == "optimizer") {
            EXPECT_NEAR(l.ms, 2, 1e-9);
        }
        if (l.key == "other") {
            EXPECT_NEAR(l.ms, 3, 1e-9);  // 100 - (50 + 45 + 2), 100 - 97
        }
        EXPECT_NE(l.key, "bubble");                        // no pipeline
    }
    EXPECT_NE(d.losses[0].remedy.find("rank 1 arrives last"), std::string::npos);
    EXPECT_NE(d.losses[0].remedy.find("92.0 ms a step of its own work against 52.0 ms"),
              std::string::npos)
        << d.losses[0].remedy;
    const std::string text = diagnosis_text(d);
    EXPECT_NE(text.find("largest loss: wait"), std::string::npos) << text;
    EXPECT_NE(diagnosis_json(d).find("\"largest_loss\": \"wait\""), std::string::npos);
}

TEST(Diagnose, PipelineBubbleAgainstThePlanAndItsRemedy) {
    // pp 2, one micro-batch: the plan's bubble is half the step; each stage idles as long as it
    // computes.
    RunTimings t = timings(1, 2, 1);
    t.ranks = {rank_times(0, 0.1, 0.048, 0.0, 0.05), rank_times(1, 0.1, 0.048, 0.0, 0.05)};
    t.ranks[1].stage = 1;
    const Diagnosis d = diagnose_run(write_run("diag_bubble", t), "");
    ASSERT_FALSE(d.losses.empty());
    EXPECT_EQ(d.losses[0].key, "bubble");
    EXPECT_NEAR(d.losses[0].predicted_ms, 48, 1e-9);  // busy x f / (1 - f), f = 1/2
    EXPECT_NEAR(d.predicted_step_ms, 96, 1e-9);
    EXPECT_NE(d.losses[0].remedy.find("the plan's bubble is 50%"), std::string::npos)
        << d.losses[0].remedy;
    EXPECT_NE(d.losses[0].remedy.find("4 micro-batches: 20%"), std::string::npos)
        << d.losses[0].remedy;
}

TEST(Diagnose, RecomputeAndDataAreNamed) {
    RunTimings t = timings(1, 1, 1);
    t.remat = "full";
    t.recompute_fraction = 0.25;
    t.ranks = {rank_times(0, 0.1, 0.06, 0, 0, 0.001, 0.02)};
    Diagnosis d = diagnose_run(write_run("diag_recompute", t), "");
    EXPECT_EQ(d.losses[0].key, "recompute");
    EXPECT_NEAR(d.losses[0].predicted_ms, 15, 1e-9);
    EXPECT_NE(d.losses[0].remedy.find("train.remat = full"), std::string::npos);
    t.remat = "none";
    t.recompute_fraction = 0;
    t.ranks = {rank_times(0, 0.1, 0.04, 0, 0, 0.05)};
    d = diagnose_run(write_run("diag_data", t), "");
    EXPECT_EQ(d.losses[0].key, "data");
    for (const TimeLoss& l : d.losses) EXPECT_NE(l.key, "recompute");  // none ran, none planned
}

TEST(Diagnose, BaselineNamesWhatGrewPerTokenPerReplica) {
    // One rank: 50 ms of compute for 1000 tokens. Two ranks (1000 tokens each): compute the
    // same, and 30 ms in collectives on both (none slower): communication grew.
    RunTimings one = timings(1, 1, 1);
    one.ranks = {rank_times(0, 0.052, 0.05, 0)};
    RunTimings two = timings(2, 1, 1);
    two.ranks = {rank_times(0, 0.082, 0.05, 0.03), rank_times(1, 0.082, 0.05, 0.03)};
    two.ranks[1].replica = 1;
    const Diagnosis d = diagnose_run(write_run("diag_two", two), write_run("diag_one", one));
    ASSERT_FALSE(d.growth.empty());
    EXPECT_EQ(d.growth[0].key, "comm");
    EXPECT_NEAR(d.growth[0].here - d.growth[0].base, 30, 1e-9);
    for (const auto& g : d.growth) {
        if (g.key == "compute") {
            EXPECT_NEAR(g.here, g.base, 1e-9);
        }
    }
    EXPECT_NE(diagnosis_text(d).find("the scaling regression is mostly comm"), std::string::npos);
    EXPECT_NE(diagnosis_json(d).find("\"largest_growth\": \"comm\""), std::string::npos);
}

}  // namespace
}  // namespace memtrain
