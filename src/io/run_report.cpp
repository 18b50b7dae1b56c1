// `memtrain report`: metrics.jsonl and memory.json in, one HTML page out. The charts are SVG
// drawn here, so the page needs no scripts, fonts or network and renders the same anywhere.
#include "io/run_report.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <toml++/toml.h>
#include <nlohmann/json.hpp>

#include "config/run_config.h"
#include "core/error.h"
#include "core/regular_file.h"
#include "io/out_dir.h"
#include "io/text_file.h"
#include "planner/scaling_fit.h"

namespace fs = std::filesystem;

namespace memtrain::io {

namespace {

std::string file_key(std::string_view category) {
    std::string s(category);
    std::replace(s.begin(), s.end(), ' ', '_');
    return s;
}

std::string display_name(std::string s) {
    std::replace(s.begin(), s.end(), '_', ' ');
    return s;
}

// fmt writes a non-finite double as nan or inf, which JSON has no spelling for; such a value
// (an fp16 step's overflowed gradient norm) reads as null: not recorded.
std::string nonfinite_to_null(const std::string& line) {
    std::string out;
    out.reserve(line.size());
    bool in_string = false;
    for (std::size_t i = 0; i < line.size(); i++) {
        char c = line[i];
        if (in_string) {
            out += c;
            if (c == '\\' && i + 1 < line.size())
                out += line[++i];
            else if (c == '"')
                in_string = false;
            continue;
        }
        if (c == '"') {
            in_string = true;
            out += c;
            continue;
        }
        bool replaced = false;
        for (const char* word : {"-nan", "-inf", "nan", "inf"}) {
            std::size_t n = std::char_traits<char>::length(word);
            if (line.compare(i, n, word) == 0 &&
                (i + n == line.size() || !std::isalnum(static_cast<unsigned char>(line[i + n])))) {
                out += "null";
                i += n - 1;
                replaced = true;
                break;
            }
        }
        if (!replaced) out += c;
    }
    return out;
}

}  // namespace

RunMetrics parse_metrics(const std::string& text, const std::string& origin) {
    std::map<int64_t, StepRecord> steps;
    std::map<int64_t, double> val;
    std::vector<int64_t> resumes;
    std::vector<RunMetrics::GuardMark> guard;
    std::vector<RunMetrics::AmpRecord> amp, amp_act;
    std::string note;
    std::istringstream in(text);
    std::string line;
    int line_no = 0;
    // The last line, when the text does not end in a newline: maybe cut short by a kill or a
    // full disk.
    const std::size_t last_start = text.rfind('\n') == std::string::npos ? 0 : text.rfind('\n') + 1;
    std::size_t at = 0;
    while (std::getline(in, line)) {
        line_no++;
        const bool unterminated = at == last_start && last_start < text.size();
        at += line.size() + 1;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.find_first_not_of(" \t") == std::string::npos) continue;
        nlohmann::json j;
        try {
            j = nlohmann::json::parse(nonfinite_to_null(line));
        } catch (const nlohmann::json::exception&) {
            if (unterminated) {
                note = fmt::format(
                    "{}:{}: the last line is incomplete ({} bytes, from a run stopped while "
                    "writing it); skipped",
                    origin, line_no, line.size());
                break;
            }
            fail("{}:{}: not a JSON line", origin, line_no);
        }
        if (!j.is_object()) fail("{}:{}: expected a JSON object, got {}", origin, line_no, line);
        if (!j.contains("step") || !j["step"].is_number_integer())
            fail("{}:{}: expected an integer \"step\", got {}", origin, line_no, line);
        const int64_t step = j["step"].get<int64_t>();
        if (j.contains("event") && j["event"] == "guard") {
            RunMetrics::GuardMark g;
            g.step = step;
            g.to_step = j.contains("to_step") && j["to_step"].is_number_integer()
                            ? j["to_step"].get<int64_t>()
                            : step - 1;
            g.action = j.value("action", std::string("skip"));
            g.reason = j.value("reason", std::string());
            // The steps after to_step run again: their earlier lines are dropped.
            steps.erase(steps.upper_bound(g.to_step), steps.end());
            val.erase(val.upper_bound(g.to_step), val.end());
            guard.push_back(std::move(g));
            continue;
        }
        if (j.contains("event") && (j["event"] == "amp" || j["event"] == "amp_activations")) {
            const bool act = j["event"] == "amp_activations";
            RunMetrics::AmpRecord a;
            a.step = step;
            try {
                const nlohmann::json& hj = act ? j.at("activation_grads") : j;
                a.log2_lo = hj.at("log2_lo").get<int>();
                a.loss_scale_log2 = j.value("loss_scale_log2", 0);
                a.counts = hj.at("log2_counts").get<std::vector<double>>();
                a.values = hj.value("values", (int64_t)0);
                a.zeros = hj.value("zeros", (int64_t)0);
            } catch (const nlohmann::json::exception& e) {
                fail("{}:{}: an {} line without log2_lo and log2_counts: {}", origin, line_no,
                     act ? "amp_activations" : "amp", e.what());
            }
            (act ? amp_act : amp).push_back(std::move(a));
            continue;
        }
        if (j.contains("event") && j["event"] == "resume") {
            // A run resumed from step `step`: what was logged for later steps is re-run now.
            steps.erase(steps.upper_bound(step), steps.end());
            val.erase(val.upper_bound(step), val.end());
            resumes.push_back(step);
            continue;
        }
        auto number = [&](const char* key) -> std::optional<double> {
            if (!j.contains(key) || j[key].is_null()) return std::nullopt;
            if (!j[key].is_number())
                fail("{}:{}: \"{}\" must be a number, got {}", origin, line_no, key, j[key].dump());
            return j[key].get<double>();
        };
        if (j.contains("val_loss")) {
            if (auto v = number("val_loss")) val[step] = *v;
            continue;
        }
        StepRecord r;
        r.step = step;
        r.loss = number("loss");
        r.lr = number("lr");
        r.grad_norm = number("grad_norm");
        r.tokens_per_s = number("tokens_per_s");
        r.ms_per_step = number("ms_per_step");
        r.mem_bytes = number("mem_bytes");
        r.peak_mem_bytes = number("peak_mem_bytes");
        r.loss_scale = number("loss_scale");
        if (j.contains("skipped")) {
            if (!j["skipped"].is_boolean())
                fail("{}:{}: \"skipped\" must be true or false, got {}", origin, line_no,
                     j["skipped"].dump());
            r.skipped = j["skipped"].get<bool>();
        }
        // An object of numbers, by name ("mem": bytes per category; "phases_ms": ms per phase).
        auto named_numbers = [&](const char* key, const char* what,
                                 std::vector<std::pair<std::string, double>>& out) {
            if (!j.contains(key) || j[key].is_null()) return;
            if (!j[key].is_object())
                fail("{}:{}: \"{}\" must be an object of {}, got {}", origin, line_no, key, what,
                     j[key].dump());
            for (const auto& [k, v] : j[key].items()) {
                if (!v.is_number())
                    fail("{}:{}: \"{}\".\"{}\" must be a number, got {}", origin, line_no, key, k,
                         v.dump());
                out.emplace_back(k, v.get<double>());
            }
        };
        named_numbers("phases_ms", "ms per phase", r.phases);
        named_numbers("mem", "bytes per category", r.mem);
        steps[step] = std::move(r);
    }
    RunMetrics m;
    for (auto& [s, r] : steps) m.steps.push_back(std::move(r));
    for (auto& [s, v] : val) m.val_loss.emplace_back(s, v);
    m.resumes = std::move(resumes);
    m.guard = std::move(guard);
    m.amp = std::move(amp);
    m.amp_activation_grads = std::move(amp_act);
    m.note = std::move(note);
    return m;
}

std::string metrics_memory_field(const MemoryStats& stats) {
    std::string out = ", \"mem\": {";
    for (int i = 0; i < kNumMemCategories; i++)
        out += fmt::format("{}\"{}\": {}", i ? ", " : "",
                           file_key(category_name(static_cast<MemCategory>(i))), stats.used[i]);
    return out + "}";
}

void write_memory_json(const std::string& path, const std::string& title, const MemoryStats& stats,
                       const std::vector<MemoryPrediction>& predicted,
                       const plan::MemoryEstimate& planner, std::size_t process_peak_rss) {
    std::vector<std::optional<std::size_t>> pred(kNumMemCategories);
    std::vector<std::string> formula(kNumMemCategories);
    std::size_t pred_total = 0;
    for (const auto& p : predicted) {
        const int i = static_cast<int>(p.category);
        pred[i] = pred[i].value_or(0) + p.bytes;
        formula[i] += (formula[i].empty() ? "" : " + ") + p.formula;
        pred_total += p.bytes;
    }
    nlohmann::json cats = nlohmann::json::array();
    for (int i = 0; i < kNumMemCategories; i++) {
        nlohmann::json c;
        c["name"] = file_key(category_name(static_cast<MemCategory>(i)));
        c["current"] = stats.used[i];
        c["peak"] = stats.peak_used[i];
        c["reserved"] = stats.reserved[i];
        c["predicted"] = pred[i] ? nlohmann::json(*pred[i]) : nlohmann::json(nullptr);
        c["formula"] = formula[i];
        cats.push_back(c);
    }
    nlohmann::json plan_lines = nlohmann::json::array();
    for (const auto& l : planner.lines)
        plan_lines.push_back({{"name", l.name}, {"bytes", l.bytes}, {"detail", l.detail}});
    nlohmann::json j;
    j["title"] = title;
    j["categories"] = cats;
    j["total"] = {{"current", stats.total_used},
                  {"peak", stats.peak_total_used},
                  {"reserved", stats.total_reserved},
                  {"predicted", pred_total}};
    j["planner"] = plan_lines;
    j["process_peak_rss"] = process_peak_rss;
    write_text_file_atomically(path, j.dump(2) + "\n");
}

MemoryRecord parse_memory_json(const std::string& text, const std::string& origin) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(text);
    } catch (const std::exception& e) {
        fail("{}: not valid JSON ({})", origin, e.what());
    }
    auto number = [&](const nlohmann::json& o, const char* key, const std::string& where) {
        if (!o.contains(key) || !o[key].is_number())
            fail("{}: {} needs a number \"{}\"", origin, where, key);
        return o[key].get<double>();
    };
    if (!j.is_object() || !j.contains("categories") || !j["categories"].is_array())
        fail("{}: expected an object with a \"categories\" list", origin);
    MemoryRecord m;
    if (j.contains("title") && j["title"].is_string()) m.title = j["title"].get<std::string>();
    for (const auto& c : j["categories"]) {
        if (!c.is_object() || !c.contains("name") || !c["name"].is_string())
            fail("{}: every category needs a \"name\"", origin);
        MemoryCategoryRecord r;
        r.name = c["name"].get<std::string>();
        const std::string where = "category " + r.name;
        r.current = number(c, "current", where);
        r.peak = number(c, "peak", where);
        r.reserved = number(c, "reserved", where);
        if (c.contains("predicted") && !c["predicted"].is_null())
            r.predicted = number(c, "predicted", where);
        if (c.contains("formula") && c["formula"].is_string())
            r.formula = c["formula"].get<std::string>();
        m.categories.push_back(std::move(r));
    }
    if (j.contains("total") && j["total"].is_object())
        m.peak_total = number(j["total"], "peak", "total");
    if (j.contains("planner") && j["planner"].is_array())
        for (const auto& l : j["planner"]) {
            if (!l.is_object() || !l.contains("name") || !l["name"].is_string())
                fail("{}: every planner line needs a \"name\"", origin);
            m.planner.emplace_back(l["name"].get<std::string>(), number(l, "bytes", "planner"));
        }
    if (j.contains("process_peak_rss") && j["process_peak_rss"].is_number())
        m.process_peak_rss = j["process_peak_rss"].get<double>();
    return m;
}

namespace {

std::string escape(std::string_view s) {
    std::string out;
    for (char c : s) {
        switch (c) {
            case '&':
                out += "&amp;";
                break;
            case '<':
                out += "&lt;";
                break;
            case '>':
                out += "&gt;";
                break;
            case '"':
                out += "&quot;";
                break;
            case '\'':
                out += "&#39;";
                break;
            default:
                out += c;
        }
    }
    return out;
}

std::string bytes_str(double b) {
    const double a = std::fabs(b);
    if (a >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
    if (a >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
    if (a >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
    return fmt::format("{:.0f} B", b);
}

std::string number_str(double v) {
    const double a = std::fabs(v);
    if (a == 0) return "0";
    if (a >= 1e6 || a < 1e-3) return fmt::format("{:.2e}", v);
    if (a >= 100) return fmt::format("{:.0f}", v);
    return fmt::format("{:.4g}", v);
}

enum class Units { number, bytes };

std::string tick_str(double v, Units u) {
    return u == Units::bytes ? bytes_str(v) : number_str(v);
}

// Round tick spacing (1, 2 or 5 times a power of ten) giving about `n` intervals.
double nice_step(double range, int n) {
    if (!(range > 0)) return 1;
    const double raw = range / n, p = std::pow(10.0, std::floor(std::log10(raw)));
    for (double m : {1.0, 2.0, 5.0})
        if (raw <= m * p) return m * p;
    return 10 * p;
}

struct Point {
    double x, y;
};

struct Series {
    std::string name;
    std::string color;
    std::vector<Point> points;
    bool dashed = false;
};

// A vertical line on a chart at step x (the guard's actions), with what happened there.
struct Mark {
    double x;
    std::string label;
};
constexpr const char* kMarkColor = "#d62728";

constexpr int kWidth = 760, kHeight = 260;
constexpr int kLeft = 80, kRight = 20, kTop = 16, kBottom = 44;

struct Frame {
    double x0, x1, y0, y1;
    double px(double x) const { return kLeft + (x - x0) / (x1 - x0) * (kWidth - kLeft - kRight); }
    double py(double y) const {
        return kHeight - kBottom - (y - y0) / (y1 - y0) * (kHeight - kTop - kBottom);
    }
};

Frame make_frame(double x0, double x1, double y0, double y1) {
    if (!(x1 > x0)) x1 = x0 + 1;
    if (!(y1 > y0)) {
        const double pad = std::max(std::fabs(y0) * 0.1, 1e-9);
        y0 -= pad;
        y1 += pad;
    }
    return {x0, x1, y0, y1};
}

// Axes, grid and the step range: the x-min and x-max labels are the first and last step.
std::string axes(const Frame& f, const std::string& y_label, Units units) {
    std::string s;
    // Byte axes step in round KiB/MiB/GiB, as their labels are written.
    double unit = 1;
    if (units == Units::bytes)
        while (unit < 1024.0 * 1024 * 1024 && (f.y1 - f.y0) / unit >= 1024) unit *= 1024;
    const double ys = nice_step((f.y1 - f.y0) / unit, 4) * unit;
    for (double y = std::ceil(f.y0 / ys) * ys; y <= f.y1 + ys * 1e-9; y += ys) {
        s += fmt::format(
            "<line class=\"grid\" x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\"/>"
            "<text class=\"tick-y\" x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n",
            kLeft, f.py(y), kWidth - kRight, f.py(y), kLeft - 6, f.py(y) + 4,
            escape(tick_str(std::fabs(y) < ys * 1e-9 ? 0 : y, units)));
    }
    const double xs = nice_step(f.x1 - f.x0, 6), close = (f.x1 - f.x0) * 0.06;
    for (double x = std::ceil(f.x0 / xs) * xs; x <= f.x1; x += xs) {
        if (x - f.x0 < close || f.x1 - x < close) continue;
        s += fmt::format(
            "<text class=\"tick-x\" x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            f.px(x), kHeight - kBottom + 16, number_str(x));
    }
    s += fmt::format(
        "<text class=\"x-min\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>"
        "<text class=\"x-max\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
        kLeft, kHeight - kBottom + 16, number_str(f.x0), kWidth - kRight, kHeight - kBottom + 16,
        number_str(f.x1));
    s += fmt::format(
        "<line class=\"axis\" x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\"/>"
        "<line class=\"axis\" x1=\"{0}\" y1=\"{3}\" x2=\"{0}\" y2=\"{1}\"/>\n",
        kLeft, kHeight - kBottom, kWidth - kRight, kTop);
    s += fmt::format(
        "<text class=\"x-label\" x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>"
        "<text class=\"y-label\" x=\"14\" y=\"{}\" text-anchor=\"middle\" "
        "transform=\"rotate(-90 14 {})\">{}</text>\n",
        (kLeft + kWidth - kRight) / 2, kHeight - 6, (kTop + kHeight - kBottom) / 2,
        (kTop + kHeight - kBottom) / 2, escape(y_label));
    return s;
}

std::string not_recorded(const std::string& id, const std::string& title, const std::string& why) {
    return fmt::format(
        "<figure id=\"fig-{0}\" class=\"chart missing\"><figcaption>{1}</figcaption>"
        "<p class=\"not-recorded\" id=\"{0}-not-recorded\">not recorded: {2}</p></figure>\n",
        id, escape(title), escape(why));
}

std::string legend(const std::vector<Series>& series) {
    std::string s = "<div class=\"legend\">";
    for (const auto& se : series)
        s += fmt::format("<span><i style=\"background:{}\"></i>{}</span>", se.color,
                         escape(se.name));
    return s + "</div>";
}

// A chart is 660 pixels wide: beyond kMaxPoints a series keeps the lowest and the highest
// point of each run of steps (spikes stay visible), so a long run's page stays small.
constexpr std::size_t kMaxPoints = 2000;

std::vector<Point> thin(const std::vector<Point>& p) {
    if (p.size() <= kMaxPoints) return p;
    const std::size_t k = (p.size() + kMaxPoints / 2 - 1) / (kMaxPoints / 2);
    std::vector<Point> out;
    for (std::size_t i = 0; i < p.size(); i += k) {
        const auto first = p.begin() + i, last = p.begin() + std::min(i + k, p.size());
        const auto [lo, hi] =
            std::minmax_element(first, last, [](Point a, Point b) { return a.y < b.y; });
        if (lo == hi) {
            out.push_back(*lo);
        } else {
            out.push_back(*std::min(lo, hi));
            out.push_back(*std::max(lo, hi));
        }
    }
    return out;
}

std::string line_chart(const std::string& id, const std::string& title, const std::string& y_label,
                       const std::vector<Series>& all, Units units, bool from_zero,
                       const std::string& missing_why, const std::vector<Mark>& marks = {}) {
    std::vector<Series> series;
    for (const auto& s : all)
        if (!s.points.empty()) series.push_back(s);
    if (series.empty()) return not_recorded(id, title, missing_why);
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    for (const auto& s : series)
        for (const auto& p : s.points) {
            x0 = std::min(x0, p.x), x1 = std::max(x1, p.x);
            y0 = std::min(y0, p.y), y1 = std::max(y1, p.y);
        }
    for (const Mark& m : marks) x0 = std::min(x0, m.x), x1 = std::max(x1, m.x);  // all shown
    if (from_zero) {
        y0 = std::min(y0, 0.0);
    } else {  // keep the extremes off the frame's edges
        const double pad = (y1 - y0) * 0.05;
        y0 -= pad, y1 += pad;
    }
    y1 += from_zero ? (y1 - y0) * 0.05 : 0;
    const Frame f = make_frame(x0, x1, y0, y1);
    std::string s = fmt::format(
        "<figure id=\"fig-{0}\" class=\"chart\"><figcaption>{1}</figcaption>\n"
        "<svg id=\"{0}\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {2} {3}\" "
        "width=\"{2}\" height=\"{3}\" role=\"img\" aria-label=\"{1}\">\n",
        id, escape(title), kWidth, kHeight);
    s += axes(f, y_label, units);
    for (const auto& se : series) {
        std::string pts;
        for (const auto& p : thin(se.points))
            pts += fmt::format("{}{:.1f},{:.1f}", pts.empty() ? "" : " ", f.px(p.x), f.py(p.y));
        s += fmt::format(
            "<polyline class=\"series\" data-series=\"{}\" fill=\"none\" stroke=\"{}\" "
            "stroke-width=\"1.6\"{} points=\"{}\"/>\n",
            escape(se.name), se.color, se.dashed ? " stroke-dasharray=\"5 3\"" : "", pts);
        if (se.points.size() <= 60)  // few points (validation): mark each one
            for (const auto& p : se.points)
                s += fmt::format(
                    "<circle class=\"marker\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2.5\" fill=\"{}\"/>",
                    f.px(p.x), f.py(p.y), se.color);
    }
    for (const Mark& m : marks) {  // a vertical line where something happened, named on hover
        if (m.x < f.x0 || m.x > f.x1) continue;
        s += fmt::format(
            "<line class=\"mark\" data-step=\"{:g}\" x1=\"{:.1f}\" x2=\"{:.1f}\" y1=\"{:.1f}\" "
            "y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"1\" stroke-dasharray=\"3 3\"><title>{}"
            "</title></line>\n",
            m.x, f.px(m.x), f.px(m.x), f.py(f.y1), f.py(f.y0), kMarkColor, escape(m.label));
    }
    s += "</svg>\n" + legend(series) + "</figure>\n";
    return s;
}

const char* const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728",
                                "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"};

// Category order of the engine's tracker; names a log has beyond these follow by name.
std::vector<std::string> category_order(const RunMetrics& m) {
    std::vector<std::string> order;
    for (int i = 0; i < kNumMemCategories; i++)
        order.push_back(file_key(category_name(static_cast<MemCategory>(i))));
    for (const auto& r : m.steps)
        for (const auto& [k, v] : r.mem)
            if (std::find(order.begin(), order.end(), k) == order.end()) order.push_back(k);
    return order;
}

std::string memory_timeline(const RunMetrics& m) {
    const std::string id = "chart-memory", title = "Memory by category (current bytes per step)";
    std::vector<const StepRecord*> rows;
    for (const auto& r : m.steps)
        if (!r.mem.empty()) rows.push_back(&r);
    if (rows.size() > kMaxPoints) {  // every k-th step (the peak line below is thinned too)
        const std::size_t k = (rows.size() + kMaxPoints - 1) / kMaxPoints;
        std::vector<const StepRecord*> kept;
        for (std::size_t i = 0; i < rows.size(); i++)
            if (i % k == 0 || i + 1 == rows.size()) kept.push_back(rows[i]);
        rows = std::move(kept);
    }
    if (rows.empty()) {
        // Older logs: only the totals.
        Series cur{"tracked total", kPalette[0], {}}, peak{"peak", kPalette[3], {}, true};
        for (const auto& r : m.steps) {
            if (r.mem_bytes) cur.points.push_back({(double)r.step, *r.mem_bytes});
            if (r.peak_mem_bytes) peak.points.push_back({(double)r.step, *r.peak_mem_bytes});
        }
        std::string chart = line_chart(id, "Memory (total only)", "bytes", {cur, peak},
                                       Units::bytes, true, "no memory fields in metrics.jsonl");
        return chart +
               "<p class=\"note\" id=\"chart-memory-categories-not-recorded\">per-category "
               "bytes not recorded (metrics.jsonl of an older memtrain)</p>\n";
    }
    std::vector<std::string> cats;
    for (const auto& c : category_order(m)) {
        bool any = false;
        for (const auto* r : rows)
            for (const auto& [k, v] : r->mem) any = any || (k == c && v > 0);
        if (any) cats.push_back(c);
    }
    auto value = [](const StepRecord& r, const std::string& c) {
        for (const auto& [k, v] : r.mem)
            if (k == c) return v;
        return 0.0;
    };
    double y1 = 0;
    for (const auto* r : rows) {
        double sum = 0;
        for (const auto& c : cats) sum += value(*r, c);
        y1 = std::max({y1, sum, r->peak_mem_bytes.value_or(0)});
    }
    const Frame f = make_frame((double)rows.front()->step, (double)rows.back()->step, 0, y1);
    std::string s = fmt::format(
        "<figure id=\"fig-{0}\" class=\"chart\"><figcaption>{1}</figcaption>\n"
        "<svg id=\"{0}\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {2} {3}\" "
        "width=\"{2}\" height=\"{3}\" role=\"img\" aria-label=\"{1}\">\n",
        id, escape(title), kWidth, kHeight);
    s += axes(f, "bytes", Units::bytes);
    std::vector<double> below(rows.size(), 0.0);
    std::vector<Series> legend_series;
    for (std::size_t ci = 0; ci < cats.size(); ci++) {
        const char* color = kPalette[ci % std::size(kPalette)];
        std::string top, bottom;
        for (std::size_t i = 0; i < rows.size(); i++) {
            const double x = f.px((double)rows[i]->step), y = below[i] + value(*rows[i], cats[ci]);
            top += fmt::format("{}{:.1f},{:.1f}", top.empty() ? "" : " ", x, f.py(y));
        }
        for (std::size_t i = rows.size(); i-- > 0;)
            bottom += fmt::format(" {:.1f},{:.1f}", f.px((double)rows[i]->step), f.py(below[i]));
        for (std::size_t i = 0; i < rows.size(); i++) below[i] += value(*rows[i], cats[ci]);
        s += fmt::format(
            "<polygon class=\"area\" data-category=\"{}\" fill=\"{}\" fill-opacity=\"0.75\" "
            "stroke=\"{}\" points=\"{}{}\"/>\n",
            escape(cats[ci]), color, color, top, bottom);
        legend_series.push_back({display_name(cats[ci]), color, {{0, 0}}});
    }
    std::string peak;
    for (const auto* r : rows)
        if (r->peak_mem_bytes)
            peak += fmt::format("{}{:.1f},{:.1f}", peak.empty() ? "" : " ", f.px((double)r->step),
                                f.py(*r->peak_mem_bytes));
    if (!peak.empty()) {
        s += fmt::format(
            "<polyline class=\"series\" data-series=\"peak\" fill=\"none\" stroke=\"#000\" "
            "stroke-dasharray=\"5 3\" points=\"{}\"/>\n",
            peak);
        legend_series.push_back({"peak total (dashed)", "#000", {{0, 0}}});
    }
    s += "</svg>\n" + legend(legend_series) + "</figure>\n";
    return s;
}

// Measured peak against predicted bytes, one pair of bars per category.
std::string memory_bars(const MemoryRecord& mem) {
    std::vector<const MemoryCategoryRecord*> rows;
    double top = 0;
    for (const auto& c : mem.categories)
        if (c.peak > 0 || c.predicted.value_or(0) > 0) {
            rows.push_back(&c);
            top = std::max({top, c.peak, c.predicted.value_or(0)});
        }
    if (rows.empty() || !(top > 0)) return "";
    const int label_w = 130, bar_h = 12, group_h = 34, w = kWidth;
    const int h = (int)rows.size() * group_h + 30;
    const double scale = (w - label_w - 110) / top;
    std::string s = fmt::format(
        "<figure id=\"fig-chart-memory-compare\" class=\"chart\"><figcaption>Measured peak "
        "against predicted, per category</figcaption>\n<svg id=\"chart-memory-compare\" "
        "xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {0} {1}\" width=\"{0}\" "
        "height=\"{1}\" role=\"img\" aria-label=\"measured against predicted memory\">\n",
        w, h);
    for (std::size_t i = 0; i < rows.size(); i++) {
        const auto& c = *rows[i];
        const int y = 10 + (int)i * group_h;
        s +=
            fmt::format("<text class=\"bar-label\" x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
                        label_w - 8, y + bar_h + 4, escape(display_name(c.name)));
        s += fmt::format(
            "<rect class=\"bar-measured\" data-category=\"{}\" x=\"{}\" y=\"{}\" width=\"{:.1f}\" "
            "height=\"{}\" fill=\"#1f77b4\"/><text class=\"bar-value\" x=\"{:.1f}\" "
            "y=\"{}\">{}</text>",
            escape(c.name), label_w, y, c.peak * scale, bar_h, label_w + c.peak * scale + 4,
            y + bar_h - 2, bytes_str(c.peak));
        if (c.predicted)
            s += fmt::format(
                "<rect class=\"bar-predicted\" data-category=\"{}\" x=\"{}\" y=\"{}\" "
                "width=\"{:.1f}\" height=\"{}\" fill=\"#ff7f0e\"/><text class=\"bar-value\" "
                "x=\"{:.1f}\" y=\"{}\">{}</text>",
                escape(c.name), label_w, y + bar_h + 2, *c.predicted * scale, bar_h,
                label_w + *c.predicted * scale + 4, y + 2 * bar_h, bytes_str(*c.predicted));
        s += "\n";
    }
    s += "</svg>\n" +
         legend({{"measured peak", "#1f77b4", {}}, {"predicted (engine layout)", "#ff7f0e", {}}}) +
         "</figure>\n";
    return s;
}

std::string memory_section(const std::optional<MemoryRecord>& mem) {
    std::string s = "<section id=\"memory\"><h2>Memory: measured against predicted</h2>\n";
    if (!mem) {
        return s +
               "<p class=\"not-recorded\" id=\"memory-not-recorded\">not recorded: the run has no "
               "memory.json (memtrain writes it when a run ends)</p></section>\n";
    }
    if (!mem->title.empty()) s += "<p>" + escape(mem->title) + "</p>\n";
    s += memory_bars(*mem);
    s += "<table id=\"memory-table\"><thead><tr><th>category</th><th>current</th><th>peak</th>"
         "<th>reserved</th><th>predicted</th><th>peak / predicted</th><th>formula</th></tr>"
         "</thead><tbody>\n";
    double cur = 0, peak_sum = 0, res = 0, pred = 0;
    for (const auto& c : mem->categories) {
        cur += c.current, peak_sum += c.peak, res += c.reserved, pred += c.predicted.value_or(0);
        if (c.peak == 0 && c.current == 0 && !c.predicted) continue;
        auto cell = [](const char* cls, double b) {
            return fmt::format("<td class=\"{}\" data-bytes=\"{:.0f}\">{}</td>", cls, b,
                               bytes_str(b));
        };
        s += fmt::format("<tr data-category=\"{}\"><td>{}</td>{}{}{}", escape(c.name),
                         escape(display_name(c.name)), cell("current", c.current),
                         cell("peak", c.peak), cell("reserved", c.reserved));
        if (c.predicted) {
            s += cell("predicted", *c.predicted);
            s += fmt::format(
                "<td class=\"ratio\">{}</td>",
                *c.predicted > 0 ? fmt::format("{:.2f}", c.peak / *c.predicted) : std::string("-"));
        } else {
            s += "<td class=\"predicted\">-</td><td class=\"ratio\">-</td>";
        }
        s += fmt::format("<td class=\"formula\">{}</td></tr>\n", escape(c.formula));
    }
    s += fmt::format(
        "<tr class=\"total\" data-category=\"total\"><td>total tracked</td><td class=\"current\" "
        "data-bytes=\"{:.0f}\">{}</td><td class=\"peak\" data-bytes=\"{:.0f}\">{}</td>"
        "<td class=\"reserved\" data-bytes=\"{:.0f}\">{}</td><td class=\"predicted\" "
        "data-bytes=\"{:.0f}\">{}</td><td></td><td>peak of the sum</td></tr>\n",
        cur, bytes_str(cur), mem->peak_total, bytes_str(mem->peak_total), res, bytes_str(res), pred,
        bytes_str(pred));
    s += "</tbody></table>\n";
    if (mem->process_peak_rss > 0)
        s += fmt::format(
            "<p id=\"process-rss\">process peak RSS (everything the OS charged): {}</p>\n",
            bytes_str(mem->process_peak_rss));
    if (!mem->planner.empty()) {
        s += "<h3>The analytic planner for the same run (<code>memtrain estimate</code> "
             "formulas)</h3>\n<table id=\"planner-table\"><thead><tr><th>line</th><th>bytes</th>"
             "</tr></thead><tbody>\n";
        for (const auto& [name, b] : mem->planner)
            s += fmt::format("<tr><td>{}</td><td data-bytes=\"{:.0f}\">{}</td></tr>\n",
                             escape(name), b, bytes_str(b));
        s += "</tbody></table>\n";
    }
    return s + "</section>\n";
}

struct Summary {
    int64_t steps = 0;
    std::optional<double> final_loss, mean_tps, peak_mem, seconds;
    std::optional<std::pair<int64_t, double>> best_val;
    int skipped = 0;
};

Summary summarize(const RunMetrics& m) {
    Summary s;
    if (!m.steps.empty()) s.steps = m.steps.back().step;
    for (auto it = m.steps.rbegin(); it != m.steps.rend() && !s.final_loss; ++it)
        s.final_loss = it->loss;
    for (const auto& [step, v] : m.val_loss)
        if (!s.best_val || v < s.best_val->second) s.best_val = {{step, v}};
    // The first step carries the warm-up (allocation, thread start), as the trainer's own mean.
    double sum = 0, secs = 0;
    int n = 0;
    for (std::size_t i = m.steps.size() > 1 ? 1 : 0; i < m.steps.size(); i++) {
        if (!m.steps[i].tokens_per_s) continue;
        sum += *m.steps[i].tokens_per_s;
        n++;
    }
    if (n > 0) s.mean_tps = sum / n;
    bool timed = false;
    for (const auto& r : m.steps) {
        if (r.peak_mem_bytes) s.peak_mem = std::max(s.peak_mem.value_or(0), *r.peak_mem_bytes);
        if (r.ms_per_step) {
            secs += *r.ms_per_step / 1000;
            timed = true;
        }
        s.skipped += r.skipped ? 1 : 0;
    }
    if (timed) s.seconds = secs;
    return s;
}

std::string summary_section(const RunMetrics& m) {
    const Summary s = summarize(m);
    auto row = [](const char* id, const char* label, const std::string& value) {
        return fmt::format("<tr><th>{}</th><td id=\"{}\">{}</td></tr>\n", label, id, escape(value));
    };
    const std::string none = "not recorded";
    std::string out = "<section id=\"summary\"><h2>Summary</h2><table id=\"summary-table\">\n";
    out += row("summary-steps", "steps", std::to_string(s.steps));
    out += row("summary-final-loss", "final loss",
               s.final_loss ? fmt::format("{:.4f}", *s.final_loss) : none);
    out += row(
        "summary-best-val-loss", "best validation loss",
        s.best_val ? fmt::format("{:.4f} (step {})", s.best_val->second, s.best_val->first) : none);
    out += row("summary-mean-tokens-per-s", "mean tokens/s (first step left out)",
               s.mean_tps ? fmt::format("{:.0f}", *s.mean_tps) : none);
    out += row("summary-time", "time in training steps",
               s.seconds ? fmt::format("{:.3g} s", *s.seconds) : none);
    out +=
        row("summary-peak-mem", "peak tracked memory", s.peak_mem ? bytes_str(*s.peak_mem) : none);
    if (s.skipped > 0)
        out += row("summary-skipped", "steps skipped (fp16 overflow)", std::to_string(s.skipped));
    return out + "</table></section>\n";
}

Series step_series(const RunMetrics& m, const std::string& name, const char* color,
                   std::optional<double> StepRecord::*field) {
    Series s{name, color, {}};
    for (const auto& r : m.steps)
        if (const auto& v = r.*field) s.points.push_back({(double)r.step, *v});
    return s;
}

const char* kStyle = R"(body{font-family:sans-serif;margin:24px;color:#222;max-width:900px}
h1{font-size:22px}h2{font-size:18px;border-bottom:1px solid #ddd;padding-bottom:4px;margin-top:28px}
h3{font-size:15px}table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}td[data-bytes]{text-align:right}
figure{margin:16px 0}figcaption{font-weight:bold;margin-bottom:4px}
svg text{font-size:11px;fill:#333}.grid{stroke:#eee}.axis{stroke:#888}
.legend{font-size:12px}.legend span{margin-right:14px}
.legend i{display:inline-block;width:10px;height:10px;margin-right:4px}
.not-recorded{color:#a00}.note{color:#666;font-size:12px}.path{color:#666;font-family:monospace}
pre{background:#f6f6f6;padding:8px;font-size:12px;overflow:auto})";

}  // namespace

std::string render_report_html(const ReportInput& in) {
    const RunMetrics& m = in.metrics;
    std::string h = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
    h += "<title>memtrain report: " + escape(in.run_dir) + "</title>\n<style>" +
         std::string(kStyle) + "</style></head><body>\n";
    h += "<h1>memtrain run report</h1>\n<p class=\"path\" id=\"run-dir\">" + escape(in.run_dir) +
         "</p>\n";
    h += summary_section(m);
    if (!m.note.empty()) h += "<p class=\"note\" id=\"metrics-note\">" + escape(m.note) + "</p>\n";
    if (!m.resumes.empty()) {
        std::string steps;
        for (int64_t r : m.resumes) steps += (steps.empty() ? "" : ", ") + std::to_string(r);
        h += "<p class=\"note\" id=\"resumes\">resumed from step " + steps +
             " (steps logged after it by the run that stopped were replaced by the resumed "
             "run's)</p>\n";
    }
    if (!m.guard.empty()) {
        h += "<div class=\"note\" id=\"guard-events\">divergence guard (dashed lines on the loss "
             "chart):<ul>\n";
        for (const auto& g : m.guard)
            h += fmt::format("<li>step {}: {}; back to step {}, the step's batch skipped{}</li>\n",
                             g.step, escape(g.reason), g.to_step,
                             g.action == "rollback" ? ", learning rate lowered" : "");
        h += "</ul></div>\n";
    }
    h += "<section id=\"training\"><h2>Training</h2>\n";
    Series val{"validation loss", kPalette[1], {}};
    for (const auto& [step, v] : m.val_loss) val.points.push_back({(double)step, v});
    std::vector<Mark> guard_marks;
    for (const auto& g : m.guard)
        guard_marks.push_back({(double)g.step, fmt::format("guard at step {}: {}; back to step {}",
                                                           g.step, g.reason, g.to_step)});
    h += line_chart("chart-loss", "Loss", "loss",
                    {step_series(m, "training loss", kPalette[0], &StepRecord::loss), val},
                    Units::number, false, "no loss in metrics.jsonl", guard_marks);
    // The lecture's figures: the share of gradient values at each power of two, the first and
    // the last diagnosed step, with where fp16 flushes to zero unscaled and overflows at the
    // loss scale; the weight gradients, then the activation gradients.
    auto amp_chart = [&](const std::vector<RunMetrics::AmpRecord>& recs, const char* id,
                         const char* title) {
        if (recs.empty()) return;
        std::vector<Series> hs;
        for (const auto* a : {&recs.front(), &recs.back()}) {
            if (a == &recs.back() && recs.size() == 1) break;
            Series s{fmt::format("step {}", a->step), kPalette[hs.size() * 2], {}};
            const double n = a->values > 0 ? (double)a->values : 1.0;
            for (std::size_t i = 0; i < a->counts.size(); i++)
                s.points.push_back({(double)(a->log2_lo + (int)i), a->counts[i] / n});
            hs.push_back(s);
        }
        const int sc = recs.back().loss_scale_log2;
        h += line_chart(id, title, "share", hs, Units::number, true, "",
                        {{-24.0, "fp16 flushes to zero below 2^-24 (unscaled)"},
                         {(double)(-24 - sc), fmt::format("fp16 flushes below 2^{} at loss scale "
                                                          "2^{}",
                                                          -24 - sc, sc)},
                         {(double)(16 - sc), fmt::format("fp16 overflows from 2^{} at loss scale "
                                                         "2^{}",
                                                         16 - sc, sc)}});
    };
    amp_chart(m.amp, "chart-amp", "Gradient magnitudes: share of values per log2|g| (amp)");
    amp_chart(m.amp_activation_grads, "chart-amp-activation-grads",
              "Activation gradient magnitudes (of block inputs): share of values per log2|g| "
              "(amp)");
    h += line_chart("chart-lr", "Learning rate", "lr",
                    {step_series(m, "learning rate", kPalette[2], &StepRecord::lr)}, Units::number,
                    true, "no lr in metrics.jsonl");
    h += line_chart("chart-grad-norm", "Gradient norm (before clipping)", "grad norm",
                    {step_series(m, "gradient norm", kPalette[3], &StepRecord::grad_norm)},
                    Units::number, true, "no grad_norm in metrics.jsonl");
    h += line_chart("chart-tokens-per-s", "Throughput", "tokens/s",
                    {step_series(m, "tokens/s", kPalette[4], &StepRecord::tokens_per_s)},
                    Units::number, true, "no tokens_per_s in metrics.jsonl");
    {
        // Where each step's time went on rank 0 (docs/diagnose.md): one line per phase that
        // took any time, and the whole step dashed.
        std::vector<std::string> names;
        for (const auto& r : m.steps)
            for (const auto& [k, v] : r.phases)
                if (v > 0 && std::find(names.begin(), names.end(), k) == names.end())
                    names.push_back(k);
        std::vector<Series> ps;
        for (std::size_t i = 0; i < names.size(); i++) {
            Series s{names[i], kPalette[i % std::size(kPalette)], {}};
            for (const auto& r : m.steps)
                for (const auto& [k, v] : r.phases)
                    if (k == names[i]) s.points.push_back({(double)r.step, v});
            ps.push_back(s);
        }
        if (!ps.empty()) {
            Series step = step_series(m, "whole step", "#000", &StepRecord::ms_per_step);
            step.dashed = true;
            ps.push_back(step);
        }
        h += line_chart("chart-phases", "Step time by phase (rank 0, ms; memtrain diagnose)", "ms",
                        ps, Units::number, true,
                        "no phases_ms in metrics.jsonl (a run of an older memtrain)");
    }
    Series scale = step_series(m, "loss scale", kPalette[5], &StepRecord::loss_scale);
    if (!scale.points.empty())  // fp16 runs only
        h += line_chart("chart-loss-scale", "Loss scale (fp16)", "scale", {scale}, Units::number,
                        true, "");
    h += "</section>\n<section id=\"memory-timeline\"><h2>Memory over the run</h2>\n";
    h += memory_timeline(m);
    h += "</section>\n";
    h += memory_section(in.memory);
    h += "<section id=\"config\"><h2>Configuration</h2>\n";
    if (in.config_toml.empty())
        h += "<p class=\"not-recorded\" id=\"config-not-recorded\">not recorded: no checkpoint "
             "with a memtrain.toml in this run directory</p>\n";
    else
        h += "<p class=\"path\">" + escape(in.config_origin) + "</p>\n<pre id=\"config-toml\">" +
             escape(in.config_toml) + "</pre>\n";
    h += "</section>\n</body></html>\n";
    return h;
}

std::string render_sweep_html(const std::string& dir, const std::string& sweep_json) {
    nlohmann::json j;
    try {
        j = nlohmann::json::parse(sweep_json);
    } catch (const nlohmann::json::exception& e) {
        fail("{}/sweep.json is not JSON: {}", dir, e.what());
    }
    if (!j.contains("runs") || !j["runs"].is_array())
        fail("{}/sweep.json has no \"runs\" array (memtrain sweep writes it)", dir);
    std::vector<plan::LossPoint> pts;
    std::map<double, Series> curves;  // per budget
    for (const auto& r : j["runs"]) {
        plan::LossPoint p;
        try {
            p = {r.at("params").get<double>(), r.at("tokens").get<double>(),
                 r.at("val_loss").get<double>(), r.value("dir", std::string())};
            const double c = r.at("flops").get<double>();
            Series& s = curves[c];
            if (s.name.empty()) {
                s.name = fmt::format("C = {:.3g}", c);
                s.color = kPalette[(curves.size() - 1) % 8];
            }
            s.points.push_back({std::log10(p.params), p.loss});
        } catch (const nlohmann::json::exception& e) {
            fail("{}/sweep.json: a run lacks params, tokens, val_loss or flops: {}", dir, e.what());
        }
        pts.push_back(p);
    }
    std::string h = "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
    h += "<title>memtrain sweep: " + escape(dir) + "</title>\n<style>" + std::string(kStyle) +
         "</style></head><body>\n<h1>memtrain sweep</h1>\n<p class=\"path\" id=\"run-dir\">" +
         escape(dir) + "</p>\n";
    std::vector<Series> series;
    std::vector<Mark> marks;
    std::string law_text;
    for (auto& [c, s] : curves)
        std::sort(s.points.begin(), s.points.end(), [](auto& a, auto& b) { return a.x < b.x; });
    try {
        plan::FitOptions o;
        o.bootstrap = 0;
        const plan::ChinchillaFit law = plan::fit_scaling_law(pts, o).law;
        law_text = fmt::format(
            "L(N, D) = {:.4g} + {:.4g} / N^{:.4f} + {:.4g} / D^{:.4f} (N non-embedding "
            "parameters; the fit of memtrain scale --fit, docs/scaling.md)",
            law.E, law.A, law.alpha, law.B, law.beta);
        for (auto& [c, s] : curves) {
            series.push_back(s);
            Series fit{s.name + " fitted", s.color, {}, true};
            double lo = s.points.front().x - 0.3, hi = s.points.back().x + 0.3;
            if (law.alpha > 0 && law.beta > 0) {  // the fitted curve reaches its optimum
                const double at = std::log10(plan::chinchilla_optimal(c, law).params);
                if (std::isfinite(at) && at > lo - 3 && at < hi + 3) {
                    lo = std::min(lo, at - 0.3);
                    hi = std::max(hi, at + 0.3);
                }
            }
            // (More than line_chart's 60 points: a curve, without a marker at each point.)
            for (int i = 0; i <= 80; i++) {
                const double x = lo + (hi - lo) * i / 80.0, n = std::pow(10.0, x);
                fit.points.push_back({x, plan::chinchilla_loss(n, c / (6 * n), law)});
            }
            series.push_back(fit);
            if (law.alpha > 0 && law.beta > 0) {
                const plan::Allocation a = plan::chinchilla_optimal(c, law);
                marks.push_back({std::log10(a.params),
                                 fmt::format("optimum at C = {:.3g}: N = {:.3g}, D = {:.3g}, "
                                             "loss {:.4f}",
                                             c, a.params, a.tokens, a.loss)});
            }
        }
    } catch (const Error& e) {
        law_text = std::string("no fit: ") + e.what();
        for (auto& [c, s] : curves) series.push_back(s);
    }
    h += "<p class=\"note\" id=\"law\">" + escape(law_text) + "</p>\n";
    h += line_chart("chart-isoflop", "isoFLOP curves: validation loss against log10 N", "loss",
                    series, Units::number, false, "no runs in sweep.json", marks);
    h +=
        "<table id=\"runs\"><tr><th>run</th><th>C</th><th>N</th><th>D</th><th>val loss</th></tr>\n";
    for (const auto& r : j["runs"])
        h += fmt::format(
            "<tr><td>{}</td><td>{:.3g}</td><td>{:.3g}</td><td>{:.3g}</td><td>{:.4f}"
            "</td></tr>\n",
            escape(r.value("dir", std::string())), r["flops"].get<double>(),
            r["params"].get<double>(), r["tokens"].get<double>(), r["val_loss"].get<double>());
    h += "</table>\n</body></html>\n";
    return h;
}

ReportInput read_run(const std::string& run_dir) {
    const fs::path dir(run_dir);
    if (!fs::exists(dir)) fail("run directory {} does not exist", run_dir);
    if (!fs::is_directory(dir))
        fail("{} is not a directory: give a run's out_dir (it holds metrics.jsonl)", run_dir);
    // The latest checkpoint: the one `latest` names, else the highest step.
    fs::path ckpt;
    if (fs::exists(dir / "latest")) {
        std::string name = read_text_file(dir / "latest", 4096);
        while (!name.empty() && std::isspace(static_cast<unsigned char>(name.back())))
            name.pop_back();
        // Only a checkpoint of this directory (a `latest` of ../elsewhere is not followed).
        if (is_checkpoint_name(name) && fs::exists(dir / name / "memtrain.toml")) ckpt = dir / name;
    }
    if (ckpt.empty()) {
        std::string best;
        for (const auto& e : fs::directory_iterator(dir)) {
            const std::string name = e.path().filename().string();
            if (e.is_directory() && name.rfind("ckpt_", 0) == 0 &&
                fs::exists(e.path() / "memtrain.toml") && name > best)
                best = name;
        }
        if (!best.empty()) ckpt = dir / best;
    }
    ReportInput in;
    in.run_dir = run_dir;
    if (!ckpt.empty()) {
        in.config_origin = (ckpt / "memtrain.toml").string();
        in.config_toml = read_text_file(ckpt / "memtrain.toml", kMaxConfigBytes);
    }
    fs::path metrics = dir / "metrics.jsonl";
    if (!fs::exists(metrics)) {  // a run may name its log otherwise (io.metrics)
        try {
            check_toml_text(in.config_toml, in.config_origin);  // toml++ overflows on some
            const auto cfg = toml::parse(in.config_toml, in.config_origin);
            if (auto name = cfg["io"]["metrics"].value<std::string>();
                name && name->find('/') == std::string::npos && *name != ".." && *name != ".")
                metrics = dir / *name;
        } catch (const toml::parse_error&) {
        } catch (const Error&) {
        }
    }
    if (!fs::exists(metrics))
        fail("{} has no metrics.jsonl: is it a run's out_dir (io.out_dir of memtrain train)?",
             run_dir);
    // (A long run's log is large; it is memtrain's own file, still refused if not a regular one.)
    in.metrics = parse_metrics(read_text_file(metrics, std::size_t{2} << 30), metrics.string());
    if (fs::exists(dir / "memory.json"))
        in.memory =
            parse_memory_json(read_text_file(dir / "memory.json"), (dir / "memory.json").string());
    return in;
}

std::string write_run_report(const std::string& run_dir, const std::string& out_path,
                             std::string* note) {
    const std::string out =
        out_path.empty() ? (fs::path(run_dir) / "report.html").string() : out_path;
    std::error_code ec;
    if (!fs::exists(fs::path(run_dir) / "metrics.jsonl", ec) &&
        fs::is_regular_file(fs::path(run_dir) / "sweep.json", ec)) {
        write_text_file_atomically(
            out, render_sweep_html(run_dir, read_text_file(fs::path(run_dir) / "sweep.json")));
        return out;
    }
    const ReportInput input = read_run(run_dir);
    if (note) *note = input.metrics.note;
    const std::string html = render_report_html(input);
    write_text_file_atomically(out, html);
    return out;
}

}  // namespace memtrain::io
