// Pipeline schedules against the closed forms and the test-vector table of
// ../shared/research/model-parallelism.md (§0, §5.2 A): makespans, peak in-flight micro-batches,
// PipeDream's weight versions, and the validator's refusals.
#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"
#include "core/rng.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain::pp {
namespace {

double simulated_makespan(Kind k, int p, int m, int v, double tf, double tb, double ti = 0,
                          double tw = 0) {
    Schedule s = make_schedule(k, p, m, v);
    return simulate(s, StageCosts::uniform(p * v, tf / v, tb / v, ti / v, tw / v)).makespan;
}

TEST(PipelineSchedule, TestVectorTable) {
    struct Row {
        int p, m;
        double gpipe, zb, inter, bubble;
        std::vector<int> peak_1f1b, peak_inter;
    };
    const std::vector<Row> rows = {
        {2, 4, 15, 13, 13.5, 0.2000, {2, 1}, {5, 3}},
        {2, 8, 27, 25, 25.5, 0.1111, {2, 1}, {5, 3}},
        {4, 4, 21, 15, 16.5, 0.4286, {4, 3, 2, 1}, {8, 8, 7, 5}},
        {4, 8, 33, 27, 28.5, 0.2727, {4, 3, 2, 1}, {11, 9, 7, 5}},
        {4, 16, 57, 51, 52.5, 0.1579, {4, 3, 2, 1}, {11, 9, 7, 5}},
        {8, 32, 117, 103, 106.5, 0.1795, {8, 7, 6, 5, 4, 3, 2, 1}, {23, 21, 19, 17, 15, 13, 11, 9}},
    };
    for (const Row& r : rows) {
        SCOPED_TRACE(testing::Message() << "p " << r.p << " m " << r.m);
        EXPECT_DOUBLE_EQ(simulated_makespan(Kind::GPipe, r.p, r.m, 1, 1, 2), r.gpipe);
        EXPECT_DOUBLE_EQ(simulated_makespan(Kind::OneFOneB, r.p, r.m, 1, 1, 2), r.gpipe);
        EXPECT_DOUBLE_EQ(simulated_makespan(Kind::ZbH1, r.p, r.m, 1, 1, 0, 1, 1), r.zb);
        EXPECT_DOUBLE_EQ(simulated_makespan(Kind::Interleaved, r.p, r.m, 2, 1, 2), r.inter);
        auto one =
            simulate(make_schedule(Kind::OneFOneB, r.p, r.m), StageCosts::uniform(r.p, 1, 2));
        EXPECT_NEAR(one.bubble(), r.bubble, 5e-5);  // the table rounds to 4 digits
        EXPECT_EQ(one.peak_in_flight, r.peak_1f1b);
        auto inter = simulate(make_schedule(Kind::Interleaved, r.p, r.m, 2),
                              StageCosts::uniform(2 * r.p, 0.5, 1));
        EXPECT_EQ(inter.peak_in_flight, r.peak_inter);
    }
}

TEST(PipelineSchedule, ClosedFormsOverAGrid) {
    const std::vector<std::pair<double, double>> fb = {{1, 1}, {1, 2}, {1, 3}, {2, 3}};
    for (int p = 1; p <= 8; p++)
        for (int m = 1; m <= 32; m++)
            for (auto [tf, tb] : fb) {
                SCOPED_TRACE(testing::Message() << "p " << p << " m " << m << " tf " << tf);
                const double ideal = (m + p - 1) * (tf + tb);
                EXPECT_DOUBLE_EQ(simulated_makespan(Kind::GPipe, p, m, 1, tf, tb), ideal);
                EXPECT_DOUBLE_EQ(simulated_makespan(Kind::OneFOneB, p, m, 1, tf, tb), ideal);
                EXPECT_DOUBLE_EQ(simulated_makespan(Kind::Naive, p, m, 1, tf, tb),
                                 m * p * (tf + tb));
                auto g = simulate(make_schedule(Kind::GPipe, p, m), StageCosts::uniform(p, tf, tb));
                auto o =
                    simulate(make_schedule(Kind::OneFOneB, p, m), StageCosts::uniform(p, tf, tb));
                for (int s = 0; s < p; s++) {
                    EXPECT_EQ(g.peak_in_flight[s], m);
                    EXPECT_EQ(o.peak_in_flight[s], std::min(p - s, m));
                }
                for (int v = 2; v <= 4 && m % p == 0; v++) {
                    EXPECT_NEAR(simulated_makespan(Kind::Interleaved, p, m, v, tf, tb),
                                m * (tf + tb) + (p - 1) * (tf + tb) / v, 1e-9);
                    auto in = simulate(make_schedule(Kind::Interleaved, p, m, v),
                                       StageCosts::uniform(p * v, tf / v, tb / v));
                    for (int r = 0; r < p; r++)
                        EXPECT_EQ(in.peak_in_flight[r],
                                  std::min(2 * (p - 1 - r) + (v - 1) * p + 1, m * v));
                }
                // ZB-H1 with t_b split into I and W: the closed form for m >= p while a W fits
                // where 1F1B idles (t_W <= t_F); never slower than 1F1B with B = I + W.
                for (double tw : {tb / 2, tb / 3}) {
                    const double ti = tb - tw;
                    const double zb = simulated_makespan(Kind::ZbH1, p, m, 1, tf, 0, ti, tw);
                    EXPECT_LE(zb, ideal + 1e-9);
                    if (m < p || tw > tf) continue;
                    EXPECT_NEAR(zb, m * (tf + ti + tw) + (p - 1) * (tf + ti - tw), 1e-9);
                }
            }
}

TEST(PipelineSchedule, UnevenStages) {
    Rng rng(5);
    for (int trial = 0; trial < 200; trial++) {
        const int p = 2 + (int)(rng.next_u64() % 6), m = 1 + (int)(rng.next_u64() % 12);
        StageCosts c = StageCosts::uniform(p, 0, 0);
        for (int s = 0; s < p; s++) {
            c.f[s] = 0.5 + rng.uniform();
            c.b[s] = 1 + 2 * rng.uniform();
        }
        double sum = 0, max_f = 0, max_b = 0, max_c = 0;
        for (int s = 0; s < p; s++) {
            sum += c.f[s] + c.b[s];
            max_f = std::max(max_f, c.f[s]);
            max_b = std::max(max_b, c.b[s]);
            max_c = std::max(max_c, c.f[s] + c.b[s]);
        }
        // GPipe is exact; 1F1B never exceeds the bound.
        EXPECT_NEAR(simulate(make_schedule(Kind::GPipe, p, m), c).makespan,
                    sum + (m - 1) * (max_f + max_b), 1e-9);
        EXPECT_LE(simulate(make_schedule(Kind::OneFOneB, p, m), c).makespan,
                  sum + (m - 1) * max_c + 1e-9);
    }
}

TEST(PipelineSchedule, PipeDreamVersions) {
    for (int p = 1; p <= 6; p++)
        for (int s = 0; s < p; s++) {
            EXPECT_EQ(pipedream_versions(p, s), p - s);
            // The versions in flight at once on stage s: minibatch i's forward uses version
            // max(0, i - (p - 1 - s)), and the forwards of p - s minibatches are in flight.
            for (int i = 0; i < 20; i++) {
                const int lo = pipedream_version(p, s, i),
                          hi = pipedream_version(p, s, i + p - s - 1);
                EXPECT_LE(hi - lo + 1, p - s);
            }
            EXPECT_EQ(pipedream_version(p, s, p - 1 - s), 0);
            EXPECT_EQ(pipedream_version(p, s, p - s), 1);
        }
}

TEST(PipelineSchedule, RefusalsNameTheProblem) {
    auto refused = [](auto f, const std::string& needle) {
        try {
            f();
            ADD_FAILURE() << "accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
        }
    };
    refused([] { make_schedule(Kind::Interleaved, 4, 6, 2); }, "multiple of the pipeline");
    refused([] { make_schedule(Kind::GPipe, 2, 4, 2); }, "interleaved");
    refused([] { make_schedule(Kind::PipeDream2BW, 8, 4); }, "p - 1");
    refused([] { make_schedule(Kind::OneFOneB, 0, 4); }, "positive");
    refused([] { parse_kind("2f2b"); }, "unknown pipeline schedule");
    Schedule s = make_schedule(Kind::OneFOneB, 2, 2);
    std::swap(s.ranks[0][0], s.ranks[0].back());  // a backward before its forward
    refused([&] { validate(s); }, "backward before forward");
    s = make_schedule(Kind::OneFOneB, 2, 2);
    s.ranks[1].pop_back();
    refused([&] { validate(s); }, "no backward");
    s = make_schedule(Kind::GPipe, 2, 2);
    std::swap(s.ranks[0], s.ranks[1]);
    refused([&] { validate(s); }, "belongs to rank");
    // A schedule that passes the validator can still deadlock across ranks.
    s = make_schedule(Kind::GPipe, 2, 2);
    std::reverse(s.ranks[1].begin(), s.ranks[1].begin() + 2);  // F1 before F0 on rank 1: fine
    EXPECT_NO_THROW(simulate(s, StageCosts::uniform(2, 1, 1)));
    s = make_schedule(Kind::OneFOneB, 2, 2);
    // Rank 0 waits for B1.0 before F0.1, rank 1 waits for F0.1 before B1.0... build a cycle:
    s.ranks[0] = {{Op::F, 0, 0}, {Op::B, 0, 0}, {Op::F, 0, 1}, {Op::B, 0, 1}};
    s.ranks[1] = {{Op::F, 1, 1}, {Op::B, 1, 1}, {Op::F, 1, 0}, {Op::B, 1, 0}};
    validate(s);
    refused([&] { simulate(s, StageCosts::uniform(2, 1, 1)); }, "deadlocks");
}

TEST(PipelineSchedule, ListsAndTimeline) {
    Schedule s = make_schedule(Kind::OneFOneB, 2, 3);
    EXPECT_EQ(format_lists(s),
              "rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 B0.2\nrank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2\n");
    auto r = simulate(s, StageCosts::uniform(2, 1, 2));
    const std::string svg = timeline_svg(s, r, "1f1b p=2 m=3");
    EXPECT_EQ(svg.rfind("<svg", 0), 0u);
    std::size_t boxes = 0;
    for (std::size_t at = 0; (at = svg.find("<rect x=", at)) != std::string::npos; at++) boxes++;
    EXPECT_EQ(boxes, 12u);  // one per action
}

// What the planner reads (planner/time_model, planner/memory_model): the fill and the in-flight
// micro-batches of the executor's schedules, simulated, equal to the closed forms.
TEST(PipelineSchedule, PlannerFillAndInFlightComeFromTheSimulator) {
    for (int p : {2, 3, 4, 8})
        for (int m : {1, 2, 5, 8, 16}) {
            EXPECT_NEAR(uniform_fill(Kind::GPipe, p, m), p - 1, 1e-9) << p << " " << m;
            EXPECT_NEAR(uniform_fill(Kind::OneFOneB, p, m), p - 1, 1e-9) << p << " " << m;
            const auto g = uniform_in_flight(Kind::GPipe, p, m);
            const auto o = uniform_in_flight(Kind::OneFOneB, p, m);
            for (int s = 0; s < p; s++) {
                EXPECT_EQ(g[s], m);
                EXPECT_EQ(o[s], std::min(p - s, m));
            }
            if (m % p != 0) continue;
            for (int v : {2, 4})
                EXPECT_NEAR(uniform_fill(Kind::Interleaved, p, m, v), (p - 1.0) / v, 1e-9);
        }
    // Asked again: the remembered answer.
    EXPECT_EQ(uniform_fill(Kind::GPipe, 4, 8), 3.0);
}

}  // namespace
}  // namespace memtrain::pp
