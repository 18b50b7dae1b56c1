// Pipeline schedule generators, validator, simulator and drawings (see schedule.h).
#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::pp {

namespace {

const std::vector<std::pair<Kind, const char*>>& kind_names() {
    static const std::vector<std::pair<Kind, const char*>> names = {
        {Kind::Naive, "naive"},
        {Kind::GPipe, "gpipe"},
        {Kind::OneFOneB, "1f1b"},
        {Kind::Interleaved, "interleaved"},
        {Kind::ZbH1, "zb-h1"},
        {Kind::PipeDream, "pipedream"},
        {Kind::PipeDream2BW, "pipedream-2bw"}};
    return names;
}

const char* op_name(Op op) {
    switch (op) {
        case Op::F:
            return "F";
        case Op::B:
            return "B";
        case Op::I:
            return "I";
        case Op::W:
            return "W";
    }
    return "?";
}

// 1F1B on one rank over stage `stage`: `warmup` forwards, then forward/backward pairs (the
// backward of the oldest micro-batch, first in first out), then the remaining backwards.
std::vector<Action> one_f_one_b(int stage, int m, int warmup) {
    std::vector<Action> a;
    int f = 0, b = 0;
    for (; f < std::min(warmup, m); f++) a.push_back({Op::F, stage, f});
    for (; f < m; f++, b++) {
        a.push_back({Op::F, stage, f});
        a.push_back({Op::B, stage, b});
    }
    for (; b < m; b++) a.push_back({Op::B, stage, b});
    return a;
}

// ZB-H1: 1F1B's order with every backward split into I and W, stage r applying its W's r
// micro-batches late. The delayed W's fill the cool-down's idle slots, and the bubble shrinks from
// (p-1)(t_f+t_b) to (p-1)(t_f+t_I-t_W) when a W fits in such a slot (t_W <= t_F; longer W's
// still never make it slower than 1F1B). W's stay in micro-batch order, so the accumulated
// weight gradients are 1F1B's bit for bit.
std::vector<Action> zb_h1(int r, int p, int m) {
    std::vector<Action> a;
    const int warmup = std::min(p - 1 - r, m), lag = r;
    int f = 0, i = 0, w = 0;
    auto maybe_w = [&] {
        if (i - w > lag) a.push_back({Op::W, r, w++});
    };
    for (; f < warmup; f++) a.push_back({Op::F, r, f});
    for (; f < m; f++) {
        a.push_back({Op::F, r, f});
        a.push_back({Op::I, r, i++});
        maybe_w();
    }
    while (i < m) {
        a.push_back({Op::I, r, i++});
        maybe_w();
    }
    while (w < m) a.push_back({Op::W, r, w++});
    return a;
}

// Megatron's interleaved order on rank r: chunk-micro-batches in groups of p per chunk, the
// forward order visiting chunks 0..v-1 and the backward order v-1..0.
std::vector<Action> interleaved(int r, int p, int m, int v) {
    auto id = [&](int k, bool forward) {
        const int group = k / (p * v), x = k % (p * v), c = x / p;
        const int chunk = forward ? c : v - 1 - c;
        return std::pair<int, int>{chunk * p + r, group * p + x % p};
    };
    const int total = m * v, warmup = std::min(2 * (p - 1 - r) + (v - 1) * p, total);
    std::vector<Action> a;
    int f = 0, b = 0;
    auto fwd = [&] {
        auto [s, i] = id(f++, true);
        a.push_back({Op::F, s, i});
    };
    auto bwd = [&] {
        auto [s, i] = id(b++, false);
        a.push_back({Op::B, s, i});
    };
    while (f < warmup) fwd();
    while (f < total) {
        fwd();
        bwd();
    }
    while (b < total) bwd();
    return a;
}

}  // namespace

Kind parse_kind(std::string_view name) {
    std::string all;
    for (const auto& [k, n] : kind_names()) {
        if (name == n) return k;
        if (!all.empty()) all.append(" | ");
        all.append(n);
    }
    fail("unknown pipeline schedule '{}': expected {}", name, all);
}

std::string kind_name(Kind k) {
    for (const auto& [kk, n] : kind_names())
        if (kk == k) return n;
    return "?";
}

Schedule make_schedule(Kind kind, int p, int m, int v) {
    if (p <= 0) fail("pipeline stages (pp) must be positive, got {}", p);
    if (m <= 0) fail("micro-batches must be positive, got {}", m);
    if (v <= 0) fail("chunks per rank (pp_virtual) must be positive, got {}", v);
    if (v > 1 && kind != Kind::Interleaved)
        fail("pp_virtual = {} needs the interleaved schedule, not {}", v, kind_name(kind));
    if (kind == Kind::Interleaved && m % p != 0)
        fail(
            "the interleaved schedule needs micro-batches ({}) to be a multiple of the pipeline "
            "stages ({})",
            m, p);
    if (kind == Kind::PipeDream2BW && m < p - 1)
        fail(
            "PipeDream-2BW needs at least p - 1 = {} micro-batches per step to keep two weight "
            "versions, got {}",
            p - 1, m);
    Schedule s{kind, p, m, v, std::vector<std::vector<Action>>(p)};
    for (int r = 0; r < p; r++) {
        auto& a = s.ranks[r];
        switch (kind) {
            case Kind::Naive:
                for (int i = 0; i < m; i++) {
                    a.push_back({Op::F, r, i});
                    a.push_back({Op::B, r, i});
                }
                break;
            case Kind::GPipe:
                a = one_f_one_b(r, m, m);
                break;
            case Kind::OneFOneB:
            case Kind::PipeDream:
            case Kind::PipeDream2BW:
                a = one_f_one_b(r, m, p - 1 - r);
                break;
            case Kind::Interleaved:
                a = interleaved(r, p, m, v);
                break;
            case Kind::ZbH1:
                a = zb_h1(r, p, m);
                break;
        }
    }
    validate(s);
    return s;
}

void validate(const Schedule& s) {
    const int S = s.num_stages();
    if ((int)s.ranks.size() != s.p)
        fail("schedule has {} rank lists for p = {}", s.ranks.size(), s.p);
    // Position of each op of each (stage, mb) in its rank's list, -1 while unseen.
    std::vector<std::array<int, 4>> pos((std::size_t)S * s.m, {-1, -1, -1, -1});
    for (int r = 0; r < s.p; r++) {
        for (int k = 0; k < (int)s.ranks[r].size(); k++) {
            const Action& a = s.ranks[r][k];
            if (a.stage < 0 || a.stage >= S || a.mb < 0 || a.mb >= s.m)
                fail("rank {}: action {} is outside {} stages x {} micro-batches", r,
                     action_text(a), S, s.m);
            if (s.rank_of(a.stage) != r)
                fail("rank {}: action {} belongs to rank {}", r, action_text(a),
                     s.rank_of(a.stage));
            int& p = pos[(std::size_t)a.stage * s.m + a.mb][(int)a.op];
            if (p >= 0) fail("rank {}: action {} appears twice", r, action_text(a));
            p = k;
        }
    }
    for (int st = 0; st < S; st++)
        for (int i = 0; i < s.m; i++) {
            const auto& p = pos[(std::size_t)st * s.m + i];
            const int F = p[(int)Op::F], B = p[(int)Op::B], I = p[(int)Op::I], W = p[(int)Op::W];
            const std::string at = fmt::format("stage {} micro-batch {}", st, i);
            if (F < 0) fail("{} has no forward", at);
            if (B >= 0 && (I >= 0 || W >= 0)) fail("{} has both B and I/W", at);
            if (B < 0 && (I < 0 || W < 0)) fail("{} has no backward (B, or I and W)", at);
            if (B >= 0 && B < F) fail("{}: backward before forward", at);
            if (I >= 0 && (I < F || W < I)) fail("{}: expected F, then I, then W", at);
        }
}

StageCosts StageCosts::uniform(int stages, double f, double b, double i, double w) {
    StageCosts c;
    c.f.assign(stages, f);
    c.b.assign(stages, b);
    c.i.assign(stages, i);
    c.w.assign(stages, w);
    return c;
}

double SimResult::bubble() const {
    if (makespan <= 0 || busy.empty()) return 0;
    double sum = 0;
    for (double b : busy) sum += b;
    return 1.0 - sum / (double)busy.size() / makespan;
}

SimResult simulate(const Schedule& s, const StageCosts& c) {
    const int S = s.num_stages();
    for (const auto* v : {&c.f, &c.b, &c.i, &c.w})
        if ((int)v->size() != S)
            fail("stage costs for {} stages, the schedule has {}", v->size(), S);
    constexpr double kNotDone = -1;
    // done[op][stage * m + mb]: finish time, or kNotDone.
    std::array<std::vector<double>, 4> done;
    for (auto& d : done) d.assign((std::size_t)S * s.m, kNotDone);
    auto at = [&](Op op, int stage, int mb) -> double& {
        return done[(int)op][(std::size_t)stage * s.m + mb];
    };
    SimResult r;
    r.busy.assign(s.p, 0);
    r.peak_in_flight.assign(s.p, 0);
    r.spans.resize(s.p);
    std::vector<std::size_t> next(s.p, 0);
    std::vector<double> free(s.p, 0);
    std::vector<int> in_flight(s.p, 0), stage_in_flight(S, 0);
    r.peak_stage_in_flight.assign(S, 0);
    std::size_t left = 0;
    for (const auto& l : s.ranks) left += l.size();
    while (left > 0) {
        bool moved = false;
        for (int rk = 0; rk < s.p; rk++) {
            // Run as many of this rank's actions as have their inputs.
            while (next[rk] < s.ranks[rk].size()) {
                const Action& a = s.ranks[rk][next[rk]];
                double ready = free[rk];
                bool ok = true;
                auto need = [&](Op op, int stage) {
                    const double t = at(op, stage, a.mb);
                    if (t == kNotDone) ok = false;
                    ready = std::max(ready, t);
                };
                double cost = 0;
                if (a.op == Op::F) {
                    if (a.stage > 0) need(Op::F, a.stage - 1);
                    cost = c.f[a.stage];
                } else if (a.op == Op::W) {
                    need(Op::I, a.stage);
                    cost = c.w[a.stage];
                } else {
                    need(Op::F, a.stage);
                    // The gradient from the stage above, computed by its B or its I.
                    if (a.stage + 1 < S) {
                        const Op above = at(Op::B, a.stage + 1, a.mb) != kNotDone ? Op::B : Op::I;
                        need(above, a.stage + 1);
                    }
                    cost = a.op == Op::B ? c.b[a.stage] : c.i[a.stage];
                }
                if (!ok) break;
                at(a.op, a.stage, a.mb) = free[rk] = ready + cost;
                r.spans[rk].push_back({a, ready, ready + cost});
                r.busy[rk] += cost;
                const int held = a.op == Op::F ? 1 : (a.op == Op::B || a.op == Op::W) ? -1 : 0;
                in_flight[rk] += held;
                r.peak_in_flight[rk] = std::max(r.peak_in_flight[rk], in_flight[rk]);
                stage_in_flight[a.stage] += held;
                r.peak_stage_in_flight[a.stage] =
                    std::max(r.peak_stage_in_flight[a.stage], stage_in_flight[a.stage]);
                next[rk]++;
                left--;
                moved = true;
            }
        }
        if (!moved) {
            std::string where;
            for (int rk = 0; rk < s.p; rk++)
                where +=
                    fmt::format("\n  rank {} waits at {}", rk,
                                next[rk] < s.ranks[rk].size() ? action_text(s.ranks[rk][next[rk]])
                                                              : std::string("(done)"));
            fail("pipeline schedule {} deadlocks:{}", kind_name(s.kind), where);
        }
    }
    r.makespan = *std::max_element(free.begin(), free.end());
    return r;
}

std::string action_text(const Action& a) {
    return fmt::format("{}{}.{}", op_name(a.op), a.stage, a.mb);
}

std::string format_lists(const Schedule& s) {
    std::string out;
    for (int r = 0; r < s.p; r++) {
        out += fmt::format("rank {}:", r);
        for (const Action& a : s.ranks[r]) {
            out.push_back(' ');
            out.append(action_text(a));
        }
        out += "\n";
    }
    return out;
}

std::string timeline_svg(const Schedule& s, const SimResult& r, const std::string& title) {
    const double left = 70, top = 40, row = 28, width = 900;
    const double scale = r.makespan > 0 ? width / r.makespan : 1;
    const double height = top + row * s.p + 40;
    std::string svg = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
        "font-family=\"sans-serif\" font-size=\"11\">\n"
        "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
        "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
        left + width + 20, height, left, title);
    auto colour = [](Op op) {
        switch (op) {
            case Op::F:
                return "#4e79a7";
            case Op::B:
                return "#f28e2b";
            case Op::I:
                return "#e15759";
            case Op::W:
                return "#59a14f";
        }
        return "#999";
    };
    for (int rk = 0; rk < s.p; rk++) {
        const double y = top + rk * row;
        svg += fmt::format("<text x=\"5\" y=\"{:.1f}\">rank {}</text>\n", y + row * 0.6, rk);
        for (const Span& sp : r.spans[rk]) {
            const double x = left + sp.start * scale, w = (sp.end - sp.start) * scale;
            // Later chunks of an interleaved rank are drawn lighter.
            const double opacity = 1.0 - 0.35 * (sp.a.stage / s.p) / std::max(1, s.v - 1);
            svg += fmt::format(
                "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\" "
                "fill-opacity=\"{:.2f}\" stroke=\"white\" stroke-width=\"0.5\"><title>{} "
                "[{:g}, {:g}]</title></rect>\n",
                x, y + 2, w, row - 4, colour(sp.a.op), opacity, action_text(sp.a), sp.start,
                sp.end);
            if (w >= 14)
                svg += fmt::format(
                    "<text x=\"{:.2f}\" y=\"{:.1f}\" fill=\"white\" "
                    "text-anchor=\"middle\">{}</text>\n",
                    x + w / 2, y + row * 0.62, sp.a.mb);
        }
    }
    const double y = top + row * s.p + 18;
    svg += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\">0</text><text x=\"{:.1f}\" y=\"{:.1f}\" "
        "text-anchor=\"end\">{:g}</text>\n",
        left, y, left + width, y, r.makespan);
    svg += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">F blue, B orange, I red, W green; "
        "bubble {:.1f}%</text>\n</svg>\n",
        left + width / 2, y, 100 * r.bubble());
    return svg;
}

int pipedream_version(int p, int s, int i) {
    return std::max(0, i - (p - 1 - s));
}
int pipedream_versions(int p, int s) {
    return p - s;
}

namespace {

struct UniformRun {
    double fill = 0;
    std::vector<double> in_flight;
};

const UniformRun& uniform_run(Kind kind, int p, int m, int v) {
    static std::mutex mu;
    static std::map<std::tuple<int, int, int, int>, UniformRun> memo;
    std::lock_guard<std::mutex> lock(mu);
    const auto key = std::make_tuple((int)kind, p, m, v);
    auto it = memo.find(key);
    if (it != memo.end()) return it->second;
    const Schedule s = make_schedule(kind, p, m, v);
    const double f = 1.0 / v, b = 2.0 / v;
    const SimResult r = simulate(s, StageCosts::uniform(p * v, f, b, b / 2, b / 2));
    UniformRun u;
    u.fill = r.makespan / 3.0 - m;
    for (int k : r.peak_in_flight) u.in_flight.push_back((double)k / v);
    return memo.emplace(key, std::move(u)).first->second;
}

}  // namespace

double uniform_fill(Kind kind, int p, int m, int v) {
    return uniform_run(kind, p, m, v).fill;
}

double uniform_bubble(Kind kind, int p, int m, int v) {
    const double fill = uniform_fill(kind, p, m, v);
    return fill / (m + fill);
}

std::vector<double> uniform_in_flight(Kind kind, int p, int m, int v) {
    return uniform_run(kind, p, m, v).in_flight;
}

}  // namespace memtrain::pp
