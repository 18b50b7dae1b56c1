// `memtrain report`'s reading side: the metrics.jsonl parser on good, old and malformed logs,
// memory.json round trip, run directory errors, and pages of runs that recorded less.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "core/error.h"
#include "io/run_report.h"
#include "planner/scaling_fit.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace memtrain;

namespace {

using test::error_of;
using test::write_file;

const char* kOldLog =
    R"({"step": 1, "loss": 5.5, "lr": 1e-4, "grad_norm": 1.5, "tokens_per_s": 900.0, "ms_per_step": 10.0, "mem_bytes": 1000, "peak_mem_bytes": 1200}
{"step": 2, "loss": 5.25, "lr": 2e-4, "grad_norm": 1.25, "tokens_per_s": 1000.0, "ms_per_step": 9.0, "mem_bytes": 1000, "peak_mem_bytes": 1300}
{"step": 2, "val_loss": 5.4}
)";

}  // namespace

TEST(RunReport, ParsesStepsValidationAndMemory) {
    const std::string log =
        R"({"step": 1, "loss": 4.0, "lr": 0.001, "grad_norm": 2.0, "tokens_per_s": 10.0, "ms_per_step": 5.0, "mem_bytes": 30, "peak_mem_bytes": 40, "mem": {"parameters": 10, "gradients": 20}}

{"step": 2, "loss": 3.5, "lr": 0.002, "grad_norm": nan, "tokens_per_s": 12.0, "ms_per_step": 4.0, "mem_bytes": 30, "peak_mem_bytes": 40, "loss_scale": 65536, "skipped": true, "overflow": "inf in h.0"}
{"step": 2, "val_loss": 3.75}
)";
    const auto m = io::parse_metrics(log, "m.jsonl");
    ASSERT_EQ(m.steps.size(), 2u);
    EXPECT_EQ(m.steps[0].step, 1);
    EXPECT_DOUBLE_EQ(*m.steps[0].loss, 4.0);
    ASSERT_EQ(m.steps[0].mem.size(), 2u);
    const auto grads = std::find_if(m.steps[0].mem.begin(), m.steps[0].mem.end(),
                                    [](const auto& kv) { return kv.first == "gradients"; });
    ASSERT_NE(grads, m.steps[0].mem.end());
    EXPECT_DOUBLE_EQ(grads->second, 20);
    EXPECT_FALSE(m.steps[1].grad_norm) << "a non-finite norm reads as not recorded";
    EXPECT_TRUE(m.steps[1].skipped);
    EXPECT_DOUBLE_EQ(*m.steps[1].loss_scale, 65536);
    ASSERT_EQ(m.val_loss.size(), 1u);
    EXPECT_EQ(m.val_loss[0].first, 2);
    EXPECT_DOUBLE_EQ(m.val_loss[0].second, 3.75);
}

TEST(RunReport, ResumedRunKeepsTheLaterLineOfARepeatedStep) {
    const auto m = io::parse_metrics(
        "{\"step\": 1, \"loss\": 3}\n{\"step\": 2, \"loss\": 2}\n{\"step\": 2, \"loss\": 1.5}\n"
        "{\"step\": 3, \"loss\": 1}\n",
        "m.jsonl");
    ASSERT_EQ(m.steps.size(), 3u);
    EXPECT_DOUBLE_EQ(*m.steps[1].loss, 1.5);
}

// A guard event undoes the steps after its to_step (they run again) and is drawn on the loss
// chart and listed above it.
TEST(RunReport, GuardEventsDropUndoneStepsAndMarkTheLossChart) {
    io::ReportInput in;
    in.run_dir = "run";
    in.metrics = io::parse_metrics(
        "{\"step\": 1, \"loss\": 3}\n{\"step\": 2, \"loss\": 2.9}\n{\"step\": 3, \"loss\": 2.8}\n"
        "{\"step\": 4, \"event\": \"guard\", \"action\": \"skip\", \"to_step\": 1, "
        "\"reason\": \"loss 9 is 40 robust deviations above the median\"}\n"
        "{\"step\": 2, \"loss\": 2.95}\n{\"step\": 3, \"loss\": 2.85}\n{\"step\": 4, \"loss\": "
        "2.7}\n",
        "m.jsonl");
    const io::RunMetrics& m = in.metrics;
    ASSERT_EQ(m.steps.size(), 4u);
    EXPECT_DOUBLE_EQ(*m.steps[1].loss, 2.95);
    ASSERT_EQ(m.guard.size(), 1u);
    EXPECT_EQ(m.guard[0].step, 4);
    EXPECT_EQ(m.guard[0].to_step, 1);
    EXPECT_EQ(m.guard[0].action, "skip");
    const std::string html = io::render_report_html(in);
    EXPECT_NE(html.find("id=\"guard-events\""), std::string::npos);
    EXPECT_NE(html.find("<line class=\"mark\" data-step=\"4\""), std::string::npos);
    EXPECT_NE(html.find("40 robust deviations"), std::string::npos);
}

// A sweep's page: one isoFLOP curve per budget, the fitted law's beside it, the optimum marked.
TEST(RunReport, SweepPageDrawsIsoflopCurvesAndTheFit) {
    nlohmann::json j;
    j["runs"] = nlohmann::json::array();
    const plan::ChinchillaFit law{1.5, 300.0, 500.0, 0.3, 0.35};
    for (double c : {1e16, 1e17})
        for (double n : {2e6, 8e6, 3e7}) {
            const double d = c / (6 * n);
            j["runs"].push_back({{"dir", "grid/run"},
                                 {"flops", c},
                                 {"params", n},
                                 {"tokens", d},
                                 {"val_loss", plan::chinchilla_loss(n, d, law)}});
        }
    const std::string html = io::render_sweep_html("grid", j.dump());
    EXPECT_NE(html.find("id=\"chart-isoflop\""), std::string::npos);
    EXPECT_EQ(test::count_occurrences(html, "<polyline"), 4) << "two budgets, measured and fitted";
    EXPECT_EQ(test::count_occurrences(html, "class=\"mark\""), 2) << "an optimum per budget";
    EXPECT_NE(html.find("L(N, D) = 1.5"), std::string::npos) << "the law the points lie on";
    EXPECT_NE(error_of([] {
                  io::render_sweep_html("grid", "{\"runs\": [{\"flops\": 1}]}");
              }).find("grid/sweep.json: a run lacks"),
              std::string::npos);
    EXPECT_NE(error_of([] { io::render_sweep_html("grid", "nope"); }).find("is not JSON"),
              std::string::npos);
}

TEST(RunReport, MalformedLinesNameFileAndLine) {
    auto err = [](const std::string& text) {
        return error_of([&] { io::parse_metrics(text, "run/metrics.jsonl"); });
    };
    const std::string good = "{\"step\": 1, \"loss\": 3}\n";
    EXPECT_NE(err(good + "{\"step\": 2, \"loss\": 2.5\n").find("run/metrics.jsonl:2:"),
              std::string::npos);
    EXPECT_NE(err(good + good + "not json\n").find("run/metrics.jsonl:3: not a JSON line"),
              std::string::npos);
    EXPECT_NE(err(good + "[1, 2]\n").find("run/metrics.jsonl:2: expected a JSON object"),
              std::string::npos);
    EXPECT_NE(err("{\"loss\": 3}\n").find("run/metrics.jsonl:1: expected an integer \"step\""),
              std::string::npos);
    EXPECT_NE(err("{\"step\": \"one\"}\n").find(":1: expected an integer \"step\""),
              std::string::npos);
    EXPECT_NE(
        err(good + "{\"step\": 2, \"loss\": \"low\"}\n").find(":2: \"loss\" must be a number"),
        std::string::npos);
    EXPECT_NE(err("{\"step\": 2, \"mem\": 5}\n").find(":1: \"mem\" must be an object"),
              std::string::npos);
    EXPECT_NE(err("{\"step\": 2, \"mem\": {\"parameters\": \"x\"}}\n")
                  .find("\"mem\".\"parameters\" must be a number"),
              std::string::npos);
    EXPECT_NE(err("{\"step\": 2, \"skipped\": 1}\n").find("\"skipped\" must be true or false"),
              std::string::npos);
    // nan inside a string is text, not a number to replace.
    EXPECT_EQ(err("{\"step\": 2, \"overflow\": \"nan in h.0\"}\n"), "");
}

TEST(RunReport, MemoryJsonRoundTrip) {
    const auto dir = test::temp_dir("run_report_memory");
    MemoryStats s;
    s.used[0] = 100, s.peak_used[0] = 100, s.reserved[0] = 128;
    s.used[3] = 50, s.peak_used[3] = 70, s.reserved[3] = 64;
    s.total_used = 150, s.peak_total_used = 170, s.total_reserved = 192;
    std::vector<MemoryPrediction> pred = {{MemCategory::Parameters, "4 x params", 100},
                                          {MemCategory::Activations, "layout", 60}};
    plan::MemoryEstimate est;
    est.lines.push_back({"parameters", 100, "x"});
    io::write_memory_json(dir + "/memory.json", "host, fp32", s, pred, est, 4096);
    EXPECT_FALSE(fs::exists(dir + "/memory.json.tmp"));
    std::ifstream in(dir + "/memory.json");
    std::stringstream ss;
    ss << in.rdbuf();
    const auto m = io::parse_memory_json(ss.str(), "memory.json");
    EXPECT_EQ(m.title, "host, fp32");
    ASSERT_EQ(m.categories.size(), static_cast<std::size_t>(kNumMemCategories));
    EXPECT_EQ(m.categories[2].name, "optimizer_state");
    EXPECT_DOUBLE_EQ(*m.categories[0].predicted, 100);
    EXPECT_DOUBLE_EQ(m.categories[3].peak, 70);
    EXPECT_DOUBLE_EQ(*m.categories[3].predicted, 60);
    EXPECT_FALSE(m.categories[1].predicted);
    EXPECT_DOUBLE_EQ(m.peak_total, 170);
    ASSERT_EQ(m.planner.size(), 1u);
    EXPECT_DOUBLE_EQ(m.process_peak_rss, 4096);
    EXPECT_NE(
        error_of([] { io::parse_memory_json("{\"categories\": 3}", "mem.json"); }).find("mem.json"),
        std::string::npos);
}

TEST(RunReport, RunDirectoryErrors) {
    const auto dir = test::temp_dir("run_report_errors");
    std::string e = error_of([&] { io::write_run_report(dir + "/nothing"); });
    EXPECT_NE(e.find(dir + "/nothing does not exist"), std::string::npos) << e;
    e = error_of([&] { io::write_run_report(dir); });
    EXPECT_NE(e.find("no metrics.jsonl"), std::string::npos) << e;
    write_file(dir + "/metrics.jsonl", std::string(kOldLog) + "{\"step\": 3, \"loss\": \n");
    e = error_of([&] { io::write_run_report(dir); });
    EXPECT_NE(e.find(dir + "/metrics.jsonl:4:"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(dir + "/report.html")) << "no page from a bad log";
    EXPECT_FALSE(fs::exists(dir + "/report.html.tmp"));
    write_file(dir + "/metrics.jsonl", kOldLog);
    e = error_of([&] { io::write_run_report(dir, dir + "/no/such/dir/r.html"); });
    EXPECT_NE(e.find("could not write"), std::string::npos) << e;
}

TEST(RunReport, OldMetricsRenderWithNotRecorded) {
    // A run of an older memtrain: no per-category bytes, no memory.json, no checkpoint.
    const auto dir = test::temp_dir("run_report_old");
    write_file(dir + "/metrics.jsonl", kOldLog);
    const std::string out = io::write_run_report(dir);
    EXPECT_EQ(out, dir + "/report.html");
    std::ifstream in(out);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string html = ss.str();
    EXPECT_NE(html.find("id=\"chart-loss\""), std::string::npos);
    EXPECT_NE(html.find("id=\"chart-memory-categories-not-recorded\""), std::string::npos);
    EXPECT_NE(html.find("id=\"memory-not-recorded\""), std::string::npos);
    EXPECT_NE(html.find("id=\"config-not-recorded\""), std::string::npos);
    EXPECT_NE(html.find("<td id=\"summary-final-loss\">5.2500</td>"), std::string::npos);
    EXPECT_NE(html.find("<td id=\"summary-best-val-loss\">5.4000 (step 2)</td>"),
              std::string::npos);
    // The first step is warm-up: the mean is of step 2 alone.
    EXPECT_NE(html.find("<td id=\"summary-mean-tokens-per-s\">1000</td>"), std::string::npos);
    EXPECT_EQ(html.find("<script"), std::string::npos);
    EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));
    // Nothing but step numbers: every chart says not recorded.
    write_file(dir + "/metrics.jsonl", "{\"step\": 1}\n");
    const std::string bare = io::render_report_html(io::read_run(dir));
    for (const char* id : {"chart-loss", "chart-lr", "chart-grad-norm", "chart-tokens-per-s",
                           "chart-memory", "chart-phases"})
        EXPECT_NE(bare.find(std::string("id=\"") + id + "-not-recorded\""), std::string::npos)
            << id;
}

TEST(RunReport, LongRunsKeepPagesSmallAndSpikesVisible) {
    io::ReportInput in;
    in.run_dir = "long";
    for (int i = 1; i <= 20000; i++) {
        io::StepRecord r;
        r.step = i;
        r.loss = i == 12345 ? 50.0 : 3.0;  // one spike
        r.mem = {{"parameters", 100.0}, {"activations", 50.0 + i % 7}};
        in.metrics.steps.push_back(r);
    }
    const std::string html = io::render_report_html(in);
    EXPECT_LT(html.size(), 400'000u);
    const std::size_t chart = html.find("id=\"chart-loss\"");
    ASSERT_NE(chart, std::string::npos);
    const std::size_t pts = html.find("points=\"", chart) + 8;
    const std::string points = html.substr(pts, html.find('"', pts) - pts);
    const auto n = std::count(points.begin(), points.end(), ',');
    EXPECT_LE(n, 2000);
    EXPECT_GE(n, 1000);
    // The spike is the chart's highest point: the smallest y pixel among the points.
    std::istringstream ps(points);
    std::string p;
    double top = 1e9;
    while (ps >> p) top = std::min(top, std::stod(p.substr(p.find(',') + 1)));
    EXPECT_LT(top, 40.0);
    EXPECT_NE(html.find(">20000</text>"), std::string::npos) << "the x axis ends at the last step";
}

TEST(RunReport, MetricsFileNamedByTheConfig) {
    const auto dir = test::temp_dir("run_report_io_metrics");
    fs::create_directories(dir + "/ckpt_000002");
    write_file(dir + "/ckpt_000002/memtrain.toml", "[io]\nmetrics = \"log.jsonl\"\n");
    write_file(dir + "/log.jsonl", kOldLog);
    const auto in = io::read_run(dir);
    EXPECT_EQ(in.metrics.steps.size(), 2u);
    EXPECT_NE(in.config_toml.find("log.jsonl"), std::string::npos);
}
