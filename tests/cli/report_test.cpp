// `memtrain report` end to end: a real tiny training run, its page rendered by headless
// Chromium, and the rendered DOM read back: every chart with one point per step, the step range
// on the axes, the summary numbers and the memory table as the run's own files say.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Shell = memtrain::test::CliResult;

Shell shell(const std::string& cmd) {
    return memtrain::test::run_command(cmd, false);
}

Shell memtrain_cmd(const std::string& args) {
    return memtrain::test::run_memtrain(args);
}

using memtrain::test::read_file;
using memtrain::test::write_file;

// The element whose id is `id`, from its start tag to the matching close tag of its name
// (the charts and tables hold no nested element of their own name).
std::string element(const std::string& dom, const std::string& id) {
    const std::size_t at = dom.find("id=\"" + id + "\"");
    if (at == std::string::npos) return "";
    const std::size_t open = dom.rfind('<', at);
    const std::size_t name_end = dom.find_first_of(" >", open);
    const std::string close = "</" + dom.substr(open + 1, name_end - open - 1) + ">";
    const std::size_t end = dom.find(close, at);
    return end == std::string::npos ? "" : dom.substr(open, end + close.size() - open);
}

// Attributes of every `tag` element in `html`.
std::vector<std::map<std::string, std::string>> tags(const std::string& html,
                                                     const std::string& tag) {
    std::vector<std::map<std::string, std::string>> out;
    const std::regex start("<" + tag + "\\b([^>]*)>");
    const std::regex attr("([a-zA-Z-]+)=\"([^\"]*)\"");
    for (std::sregex_iterator it(html.begin(), html.end(), start), end; it != end; ++it) {
        std::map<std::string, std::string> attrs;
        const std::string body = (*it)[1];
        for (std::sregex_iterator a(body.begin(), body.end(), attr); a != end; ++a)
            attrs[(*a)[1]] = (*a)[2];
        out.push_back(attrs);
    }
    return out;
}

// The points attribute of the `tag` whose `key` attribute is `value`, as a point count
// (-1: no such element).
int points_of(const std::string& svg, const std::string& tag, const std::string& key,
              const std::string& value) {
    for (const auto& t : tags(svg, tag)) {
        auto k = t.find(key);
        if (k == t.end() || k->second != value) continue;
        std::istringstream in(t.at("points"));
        std::string pair;
        int n = 0;
        while (in >> pair) n++;
        return n;
    }
    return -1;
}

// The text of the first element of `cls` inside `html`.
std::string text_of_class(const std::string& html, const std::string& cls) {
    std::smatch m;
    if (std::regex_search(html, m, std::regex("class=\"" + cls + "\"[^>]*>([^<]*)<"))) return m[1];
    return "";
}

std::string text_of_id(const std::string& dom, const std::string& id) {
    std::smatch m;
    if (std::regex_search(dom, m, std::regex("id=\"" + id + "\"[^>]*>([^<]*)<"))) return m[1];
    return "";
}

// Four famous first lines, four to a document.
std::string report_corpus() {
    const char* lines[] = {
        "It was the best of times, it was the worst of times.\n",
        "Call me Ishmael. Some years ago, never mind how long precisely.\n",
        "In a hole in the ground there lived a hobbit.\n",
        "Happy families are all alike; every unhappy family is unhappy in its own way.\n",
    };
    std::string s;
    for (int i = 0; i < 320; i++) {
        s += lines[i % 4];
        if (i % 4 == 3) s += "%\n";
    }
    return s;
}

}  // namespace

TEST(ReportCli, TrainingRunRendersInHeadlessChromium) {
    const Shell which = shell("command -v chromium 2>/dev/null");
    ASSERT_EQ(which.code, 0) << "chromium is not installed: scripts/deps.sh installs it";
    const std::string chromium = which.output.substr(0, which.output.find('\n'));

    const auto dir = memtrain::test::temp_dir("report_e2e");
    Shell r = memtrain::test::tokenize_corpus(dir, report_corpus(), 300);
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/run.toml",
               "[model]\nn_layer = 2\nn_head = 2\nn_embd = 32\nblock_size = 32\nvocab_size = 300\n"
               "[train]\nseq_len = 32\nbatch_size = 4\nmicro_batch_size = 2\nmax_steps = 7\n"
               "eval_every = 3\neval_batches = 1\n"
               "[data]\ntrain = \"train.bin\"\nval = \"val.bin\"\ntokenizer = \"tok.json\"\n"
               "[sample]\nmax_tokens = 0\n");
    const std::string out = dir + "/out";
    r = memtrain_cmd("train " + dir + "/run.toml --set io.out_dir=" + out);
    ASSERT_EQ(r.code, 0) << r.output;
    ASSERT_TRUE(fs::exists(out + "/memory.json"));

    r = memtrain_cmd("report " + out);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("wrote " + out + "/report.html"), std::string::npos) << r.output;
    const std::string page = out + "/report.html";
    ASSERT_TRUE(fs::exists(page));

    // What the run recorded, read independently of the report's parser.
    std::vector<nlohmann::json> steps, vals;
    {
        std::istringstream in(read_file(out + "/metrics.jsonl"));
        std::string line;
        while (std::getline(in, line)) {
            auto j = nlohmann::json::parse(line);
            (j.contains("val_loss") ? vals : steps).push_back(j);
        }
    }
    ASSERT_EQ(steps.size(), 7u);
    ASSERT_EQ(vals.size(), 3u);  // steps 3, 6 and the last
    const auto memory = nlohmann::json::parse(read_file(out + "/memory.json"));

    const std::string profile = dir + "/chromium";
    fs::create_directories(profile);
    const Shell dom_run =
        shell("HOME=" + profile + " timeout 60 " + chromium +
              " --headless --no-sandbox --disable-gpu --no-first-run "
              "--user-data-dir=" +
              profile + "/data --dump-dom file://" + page + " 2>" + profile + "/stderr.log");
    ASSERT_EQ(dom_run.code, 0) << read_file(profile + "/stderr.log");
    const std::string& dom = dom_run.output;
    ASSERT_NE(dom.find("memtrain run report"), std::string::npos) << dom.substr(0, 500);

    // Line charts: one point per step, the step range on the x axis.
    struct Chart {
        const char* id;
        const char* series;
        std::size_t points;
    };
    for (const Chart& c : {Chart{"chart-loss", "training loss", steps.size()},
                           Chart{"chart-loss", "validation loss", vals.size()},
                           Chart{"chart-lr", "learning rate", steps.size()},
                           Chart{"chart-grad-norm", "gradient norm", steps.size()},
                           Chart{"chart-tokens-per-s", "tokens/s", steps.size()},
                           Chart{"chart-phases", "compute", steps.size()},
                           Chart{"chart-phases", "whole step", steps.size()},
                           Chart{"chart-memory", "peak", steps.size()}}) {
        const std::string svg = element(dom, c.id);
        ASSERT_FALSE(svg.empty()) << c.id << " missing from the rendered page";
        EXPECT_EQ(svg.rfind("<svg", 0), 0u) << c.id;
        EXPECT_EQ(points_of(svg, "polyline", "data-series", c.series), (int)c.points)
            << c.id << " " << c.series;
        EXPECT_EQ(text_of_class(svg, "x-min"), "1") << c.id;
        EXPECT_EQ(text_of_class(svg, "x-max"), "7") << c.id;
        EXPECT_EQ(text_of_class(svg, "x-label"), "step") << c.id;
    }
    // Memory timeline: a stacked band per category holding memory (top and bottom edges).
    const std::string timeline = element(dom, "chart-memory");
    for (const char* cat : {"parameters", "gradients", "optimizer_state", "activations"})
        EXPECT_EQ(points_of(timeline, "polygon", "data-category", cat), 2 * (int)steps.size())
            << cat;

    // Summary numbers, from metrics.jsonl.
    EXPECT_EQ(text_of_id(dom, "summary-steps"), "7");
    EXPECT_EQ(text_of_id(dom, "summary-final-loss"),
              fmt::format("{:.4f}", steps.back()["loss"].get<double>()));
    std::pair<double, int> best{1e30, 0};
    for (const auto& v : vals)
        if (v["val_loss"].get<double>() < best.first)
            best = {v["val_loss"].get<double>(), v["step"].get<int>()};
    EXPECT_EQ(text_of_id(dom, "summary-best-val-loss"),
              fmt::format("{:.4f} (step {})", best.first, best.second));
    double tps = 0;
    for (std::size_t i = 1; i < steps.size(); i++) tps += steps[i]["tokens_per_s"].get<double>();
    EXPECT_EQ(text_of_id(dom, "summary-mean-tokens-per-s"),
              fmt::format("{:.0f}", tps / (steps.size() - 1)));

    // Memory table and bars: measured peak and predicted bytes per category, as memory.json.
    const std::string table = element(dom, "memory-table");
    ASSERT_FALSE(table.empty());
    const std::string bars = element(dom, "chart-memory-compare");
    ASSERT_FALSE(bars.empty());
    int rows = 0;
    for (const auto& c : memory["categories"]) {
        if (c["peak"].get<double>() == 0) continue;
        const std::string name = c["name"];
        const std::regex row("<tr data-category=\"" + name +
                             "\">.*?class=\"peak\" data-bytes=\"(\\d+)\".*?class=\"predicted\" "
                             "data-bytes=\"(\\d+)\"");
        std::smatch m;
        ASSERT_TRUE(std::regex_search(table, m, row)) << name << "\n" << table;
        EXPECT_EQ(std::stod(m[1]), c["peak"].get<double>()) << name;
        EXPECT_EQ(std::stod(m[2]), c["predicted"].get<double>()) << name;
        int measured = 0;
        for (const auto& t : tags(bars, "rect"))
            measured += t.at("class") == "bar-measured" && t.at("data-category") == name;
        EXPECT_EQ(measured, 1) << name;
        rows++;
    }
    EXPECT_GE(rows, 4);
    // The CPU engine predicts its model states exactly.
    EXPECT_EQ(memory["categories"][0]["name"], "parameters");
    EXPECT_EQ(memory["categories"][0]["peak"].get<double>(),
              memory["categories"][0]["predicted"].get<double>());

    // The config of the latest checkpoint.
    EXPECT_NE(element(dom, "config-toml").find("n_layer = 2"), std::string::npos);

    // --out writes elsewhere; the planner counts the checkpoint's tensors from its config.json.
    r = memtrain_cmd("report " + out + " --out " + dir + "/elsewhere.html");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir + "/elsewhere.html"));
    r = memtrain_cmd("estimate " + out + "/ckpt_000007 --json");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto weights =
        memtrain::io::SafetensorsFile::open(out + "/ckpt_000007/model.safetensors");
    int64_t numel = 0;
    for (const auto& t : weights.tensors()) numel += t.numel;
    EXPECT_EQ(nlohmann::json::parse(r.output)["params"].get<int64_t>(), numel);
}

TEST(ReportCli, BadRunDirectoriesGiveOneLine) {
    const auto dir = memtrain::test::temp_dir("report_bad");
    Shell r = memtrain_cmd("report " + dir + "/missing");
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("does not exist"), std::string::npos) << r.output;
    r = memtrain_cmd("report " + dir);
    EXPECT_EQ(r.code, 1);
    EXPECT_NE(r.output.find("no metrics.jsonl"), std::string::npos) << r.output;
    // A broken line before the last is an error naming it, and no page is written.
    write_file(dir + "/metrics.jsonl",
               "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"lo\n{\"step\": 3, \"loss\": 1.0}\n");
    r = memtrain_cmd("report " + dir);
    EXPECT_EQ(r.code, 1);
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
    EXPECT_NE(r.output.find(dir + "/metrics.jsonl:2:"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + "/report.html"));
    // A torn last line (a run killed while writing it) is skipped, and the report says so
    // (docs/report.md).
    write_file(dir + "/metrics.jsonl", "{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"lo");
    r = memtrain_cmd("report " + dir);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(dir + "/metrics.jsonl:2: the last line is incomplete"),
              std::string::npos)
        << r.output;
    EXPECT_TRUE(fs::exists(dir + "/report.html"));
    r = memtrain_cmd("report");
    EXPECT_EQ(r.code, 2) << r.output;
}
