// memtrain diagnose (train/diagnose.h): timings.json in and out, the split of a step into its
// losses, the remedies, and the text and JSON pages.
#include "train/diagnose.h"

#include <algorithm>
#include <cmath>
#include <filesystem>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/text_file.h"
#include "parallel/pipeline/schedule.h"

namespace memtrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr Phase kAllPhases[] = {Phase::data, Phase::compute, Phase::recompute,
                                Phase::comm, Phase::p2p,     Phase::optimizer};

template <class T>
T field(const json& j, const char* key, const std::string& path) {
    if (!j.is_object() || !j.contains(key))
        fail("{}: no field \"{}\" (written by memtrain train at the end of a run)", path, key);
    try {
        return j.at(key).get<T>();
    } catch (const json::exception&) {
        fail("{}: field \"{}\" has the wrong type", path, key);
    }
}

}  // namespace

void write_timings_json(const std::string& path, const RunTimings& t) {
    json j;
    j["steps"] = t.steps;
    j["engine"] = t.engine;
    j["gpu"] = t.gpu;
    j["dp"] = t.dp;
    j["tp"] = t.tp;
    j["pp"] = t.pp;
    j["ps_servers"] = t.ps_servers;
    j["micro_batches"] = t.micro_batches;
    j["schedule"] = t.schedule;
    j["virtual_stages"] = t.virtual_stages;
    j["remat"] = t.remat;
    j["tokens_per_step"] = t.tokens_per_step;
    j["predicted"] = {{"recompute_fraction", t.recompute_fraction},
                      {"bubble_fraction", t.bubble_fraction}};
    json ranks = json::array();
    for (const RankTimes& r : t.ranks) {
        json o = {{"rank", r.rank},
                  {"stage", r.stage},
                  {"replica", r.replica},
                  {"shard", r.shard},
                  {"step_s", r.step_s}};
        json ph;
        for (Phase p : kAllPhases) ph[phase_key(p)] = r.phases[p];
        o["phases_s"] = ph;
        ranks.push_back(o);
    }
    j["ranks"] = ranks;
    io::write_text_file_atomically(path, j.dump(2) + "\n");
}

RunTimings read_timings_json(const std::string& path) {
    if (!fs::exists(path))
        fail(
            "{}: no such file: memtrain train writes it at the end of a run (a run stopped by "
            "a crash has none; a run of this version's memtrain that ended has one)",
            path);
    json j;
    try {
        j = json::parse(io::read_text_file(path));
    } catch (const json::exception& e) {
        fail("{}: not JSON ({})", path, e.what());
    }
    RunTimings t;
    t.steps = field<int>(j, "steps", path);
    t.engine = field<std::string>(j, "engine", path);
    t.gpu = field<bool>(j, "gpu", path);
    t.dp = field<int>(j, "dp", path);
    t.tp = field<int>(j, "tp", path);
    t.pp = field<int>(j, "pp", path);
    t.ps_servers = field<int>(j, "ps_servers", path);
    t.micro_batches = field<int>(j, "micro_batches", path);
    t.schedule = field<std::string>(j, "schedule", path);
    t.virtual_stages = field<int>(j, "virtual_stages", path);
    t.remat = field<std::string>(j, "remat", path);
    t.tokens_per_step = field<int64_t>(j, "tokens_per_step", path);
    const json pred = field<json>(j, "predicted", path);
    t.recompute_fraction = field<double>(pred, "recompute_fraction", path);
    t.bubble_fraction = field<double>(pred, "bubble_fraction", path);
    for (const json& o : field<json>(j, "ranks", path)) {
        RankTimes r;
        r.rank = field<int>(o, "rank", path);
        r.stage = field<int>(o, "stage", path);
        r.replica = field<int>(o, "replica", path);
        r.shard = field<int>(o, "shard", path);
        r.step_s = field<double>(o, "step_s", path);
        const json ph = field<json>(o, "phases_s", path);
        for (Phase p : kAllPhases) r.phases[p] = field<double>(ph, phase_key(p), path);
        t.ranks.push_back(r);
    }
    if (t.ranks.empty()) fail("{}: no ranks", path);
    if (t.dp < 1 || t.tp < 1 || t.pp < 1 || t.micro_batches < 1)
        fail("{}: a layout field below 1", path);
    return t;
}

namespace {

double mean_of(const RunTimings& t, Phase p) {
    double s = 0;
    for (const RankTimes& r : t.ranks) s += r.phases[p];
    return s / (double)t.ranks.size();
}

// The split of a step (seconds; means over ranks): compute, recompute, data, optimizer,
// bubble (p2p), comm (the least any rank spent in collectives: the transfer itself), wait (the
// most any rank spent in collectives beyond that: waiting for the slowest rank, whose own excess
// shows in the mean compute too) and other (the step outside every phase).
struct Split {
    double step = 0, compute = 0, recompute = 0, data = 0, optimizer = 0, p2p = 0, comm = 0,
           wait = 0, other = 0;
    int slowest = 0;
    double slowest_busy = 0, median_busy = 0;  // work outside communication: its, the others'
};

Split split(const RunTimings& t) {
    Split s;
    double least = INFINITY;
    for (const RankTimes& r : t.ranks) {
        s.step = std::max(s.step, r.step_s);
        if (r.phases[Phase::comm] < least) {
            least = r.phases[Phase::comm];
            s.slowest = r.rank;
        }
    }
    s.compute = mean_of(t, Phase::compute);
    s.recompute = mean_of(t, Phase::recompute);
    s.data = mean_of(t, Phase::data);
    s.optimizer = mean_of(t, Phase::optimizer);
    s.p2p = mean_of(t, Phase::p2p);
    s.comm = least;
    double other = 0;
    for (const RankTimes& r : t.ranks) {
        s.wait = std::max(s.wait, r.phases[Phase::comm] - least);
        other += std::max(0.0, r.step_s - r.phases.total());
    }
    s.other = other / (double)t.ranks.size();
    std::vector<double> busy;
    for (const RankTimes& r : t.ranks) {
        const double b = r.phases.total() - r.phases[Phase::comm] - r.phases[Phase::p2p];
        if (r.rank == s.slowest)
            s.slowest_busy = b;
        else
            busy.push_back(b);
    }
    std::sort(busy.begin(), busy.end());
    if (!busy.empty()) s.median_busy = busy[busy.size() / 2];
    return s;
}

std::string pct(double part, double whole) {
    return whole > 0 ? fmt::format("{:.0f}%", 100 * part / whole) : std::string("-");
}

// The pipeline's fill share at m micro-batches.
double bubble_at(const RunTimings& t, int m) {
    if (t.pp <= 1 || t.schedule.empty()) return 0;
    return pp::uniform_bubble(pp::parse_kind(t.schedule), t.pp, m, t.virtual_stages);
}

std::string bubble_remedy(const RunTimings& t) {
    if (t.ps_servers > 0)
        return "the workers wait on their pushes to and pulls from the parameter servers: raise "
               "train.ps_staleness (updates a worker may run ahead) or train.ps_servers";
    if (t.pp <= 1) return "point-to-point traffic outside a pipeline";
    const int m = t.micro_batches;
    std::string out = fmt::format(
        "the pipeline runs {} micro-batch{} per step over {} stages, so the plan's bubble is "
        "{:.0f}% "
        "of the step: more micro-batches shrink it ({} micro-batches: {:.0f}%, {}: {:.0f}%; "
        "lower train.micro_batch_size or raise train.batch_size)",
        m, m == 1 ? "" : "es", t.pp, 100 * bubble_at(t, m), 4 * m, 100 * bubble_at(t, 4 * m), 8 * m,
        100 * bubble_at(t, 8 * m));
    if (t.schedule != "interleaved" && m % t.pp == 0)
        out += fmt::format(
            "; train.pp_schedule = \"interleaved\" with train.pp_virtual = 2 "
            "halves the fill ({:.0f}%)",
            100 * pp::uniform_bubble(pp::Kind::Interleaved, t.pp, m, 2));
    else if (t.schedule != "zb-h1" && t.schedule != "interleaved")
        out += "; train.pp_schedule = \"zb-h1\" fills part of it with weight gradients";
    // Unequal stages idle the others at the slowest one's pace, whatever the schedule.
    std::vector<double> busy((std::size_t)t.pp, 0.0), n((std::size_t)t.pp, 0.0);
    for (const RankTimes& r : t.ranks) {
        if (r.stage < 0 || r.stage >= t.pp) continue;
        busy[(std::size_t)r.stage] += r.phases[Phase::compute] + r.phases[Phase::recompute];
        n[(std::size_t)r.stage] += 1;
    }
    for (std::size_t i = 0; i < busy.size(); i++) busy[i] /= std::max(1.0, n[i]);
    const auto lo = std::min_element(busy.begin(), busy.end());
    const auto hi = std::max_element(busy.begin(), busy.end());
    if (*lo > 0 && *hi > 1.3 * *lo)
        out += fmt::format(
            "; the stages are unequal (stage {} computes {:.1f} ms a step, stage {} {:.1f} ms; the "
            "last stage holds the classifier): the pipeline runs at its slowest stage's pace, "
            "`memtrain pipeline CONFIG` shows the split",
            hi - busy.begin(), 1e3 * *hi, lo - busy.begin(), 1e3 * *lo);
    return out;
}

std::vector<TimeLoss> losses_of(const RunTimings& t, const Split& s, double* predicted_step) {
    const double pred_recompute = s.compute * t.recompute_fraction;
    const double f = t.bubble_fraction;
    const double pred_bubble = f > 0 && f < 1 ? (s.compute + s.recompute) * f / (1 - f) : 0;
    *predicted_step = s.compute + pred_recompute + pred_bubble;
    std::vector<TimeLoss> out;
    out.push_back(
        {"recompute", "recomputing dropped activations", 1e3 * s.recompute, 1e3 * pred_recompute,
         fmt::format("train.remat = {} re-runs forwards in the backward (the plan: {:.0f}% of the "
                     "compute): `memtrain remat CONFIG --frontier` lists the plans with less "
                     "recompute for more memory; train.remat = \"selective\" or a larger "
                     "\"budget:BYTES\" where the memory allows",
                     t.remat, 100 * t.recompute_fraction)});
    out.push_back({"bubble",
                   t.ps_servers > 0 ? "waiting on the parameter servers"
                                    : "pipeline bubble (waiting on the neighbouring stages)",
                   1e3 * s.p2p, t.ps_servers > 0 ? -1 : 1e3 * pred_bubble, bubble_remedy(t)});
    out.push_back({"wait", fmt::format("waiting on the slowest rank ({})", s.slowest), 1e3 * s.wait,
                   -1,
                   fmt::format("rank {} arrives last at the collectives ({:.1f} ms a step of its "
                               "own work against {:.1f} ms on the others' median), and the other "
                               "ranks wait for it: look at what else runs on its host or core, "
                               "its data reads, or (a pipeline) the blocks its stage holds",
                               s.slowest, 1e3 * s.slowest_busy, 1e3 * s.median_busy)});
    out.push_back({"comm", "collectives (the least time any rank spent in them)", 1e3 * s.comm, -1,
                   "overlap the gradient reduction with the backward (ZeRO stage 0-2 reduces "
                   "buckets as they finish), larger micro-batches per rank (fewer reductions per "
                   "token), or tensor parallelism only within a node"});
    out.push_back({"optimizer", "the optimizer step", 1e3 * s.optimizer, -1,
                   "the update reads every state once: shard it over the ranks (train.zero_stage "
                   ">= 1), compress the moments (optim.state_format), or apply it inside the "
                   "backward (optim.step_in_backward = true)"});
    out.push_back({"data", "loading batches", 1e3 * s.data, -1,
                   "the loader reads the token shards on the training thread: put data.train "
                   "on a local disk or in the page cache, or check what else reads that disk"});
    out.push_back({"other", "the rest (logging, metrics, the guard)", 1e3 * s.other, -1,
                   "raise train.log_every or guard.snapshot_every"});
    // Rows that cannot apply to this layout are left out (no pipeline or servers: no bubble; one
    // rank: no collectives).
    const bool p2p = t.pp > 1 || t.ps_servers > 0, many = t.ranks.size() > 1;
    std::erase_if(out, [&](const TimeLoss& l) {
        return (l.ms < 0.05 && l.predicted_ms < 0.05 && l.key != "data") ||
               (l.key == "bubble" && !p2p && l.ms < 0.05) ||
               ((l.key == "wait" || l.key == "comm") && !many);
    });
    std::stable_sort(out.begin(), out.end(),
                     [](const TimeLoss& a, const TimeLoss& b) { return a.ms > b.ms; });
    return out;
}

std::vector<MemoryRow> read_memory(const std::string& path, double* rss) {
    std::vector<MemoryRow> rows;
    if (!fs::exists(path)) return rows;
    json j;
    try {
        j = json::parse(io::read_text_file(path));
    } catch (const json::exception& e) {
        fail("{}: not JSON ({})", path, e.what());
    }
    for (const json& c : field<json>(j, "categories", path)) {
        MemoryRow r;
        r.name = field<std::string>(c, "name", path);
        r.peak = field<double>(c, "peak", path);
        r.current = field<double>(c, "current", path);
        r.reserved = field<double>(c, "reserved", path);
        if (c.contains("predicted") && c["predicted"].is_number())
            r.predicted = c["predicted"].get<double>();
        rows.push_back(r);
    }
    if (j.contains("process_peak_rss") && j["process_peak_rss"].is_number())
        *rss = j["process_peak_rss"].get<double>();
    return rows;
}

double tokens_per_replica_k(const RunTimings& t) {
    return (double)t.tokens_per_step / std::max(1, t.dp) / 1000.0;
}

std::string mib_text(double b) {
    return fmt::format("{:.1f} MiB", b / 1048576.0);
}

}  // namespace

Diagnosis diagnose_run(const std::string& run_dir, const std::string& baseline_dir) {
    if (!fs::is_directory(run_dir)) fail("{}: not a directory (a run's io.out_dir)", run_dir);
    Diagnosis d;
    d.run_dir = run_dir;
    d.t = read_timings_json((fs::path(run_dir) / "timings.json").string());
    if (d.t.steps < 1)
        fail(
            "{}: the run timed no step (its first step pays the warm-up and is left out): run "
            "at least 2 steps",
            run_dir);
    const Split s = split(d.t);
    d.step_ms = 1e3 * s.step;
    d.compute_ms = 1e3 * s.compute;
    d.slowest_rank = s.slowest;
    d.losses = losses_of(d.t, s, &d.predicted_step_ms);
    d.predicted_step_ms *= 1e3;
    d.memory = read_memory((fs::path(run_dir) / "memory.json").string(), &d.peak_rss);
    if (d.t.gpu)
        d.notes.push_back(
            "the GPU engine's phases are host times: kernels run asynchronously, so the compute "
            "shows where the host waits for the device (in the optimizer step's synchronisation "
            "or a collective) rather than where the device worked");
    if (d.t.ranks.size() == 1) d.notes.push_back("one rank: no collectives to wait in");
    if (d.memory.empty()) d.notes.push_back("no memory.json: the run wrote no memory report");
    for (const MemoryRow& r : d.memory)
        if (r.predicted >= 0 && r.peak > r.predicted)
            d.notes.push_back(fmt::format("{} peaked at {}, above the plan's {}", r.name,
                                          mib_text(r.peak), mib_text(r.predicted)));
    if (!baseline_dir.empty()) {
        const RunTimings b = read_timings_json((fs::path(baseline_dir) / "timings.json").string());
        if (b.steps < 1) fail("{}: the baseline timed no step", baseline_dir);
        d.baseline_dir = baseline_dir;
        const Split bs = split(b);
        d.base_step_ms = 1e3 * bs.step;
        double unused = 0;
        std::vector<TimeLoss> bl = losses_of(b, bs, &unused);
        const double kh = tokens_per_replica_k(d.t), kb = tokens_per_replica_k(b);
        d.growth.push_back({"compute", "compute", 1e3 * bs.compute / kb, 1e3 * s.compute / kh});
        // Every loss either run has (a row one layout leaves out is 0 there).
        auto ms_of = [](const std::vector<TimeLoss>& v, const std::string& key) {
            for (const TimeLoss& l : v)
                if (l.key == key) return l.ms;
            return 0.0;
        };
        for (const TimeLoss& l : d.losses)
            d.growth.push_back({l.key, l.what, ms_of(bl, l.key) / kb, l.ms / kh});
        for (const TimeLoss& o : bl)
            if (std::none_of(d.losses.begin(), d.losses.end(),
                             [&](const TimeLoss& l) { return l.key == o.key; }))
                d.growth.push_back({o.key, o.what, o.ms / kb, 0.0});
        std::stable_sort(d.growth.begin(), d.growth.end(), [](const auto& x, const auto& y) {
            return x.here - x.base > y.here - y.base;
        });
    }
    return d;
}

std::string diagnosis_text(const Diagnosis& d) {
    const RunTimings& t = d.t;
    std::string o = fmt::format(
        "memtrain diagnose: {}\n  {} engine, tp {} x pp {} x dp {}{}, {} micro-batch{} of {} "
        "tokens per step, remat {}, {} timed step{} (the first left out)\n",
        d.run_dir, t.engine, t.tp, t.pp, t.dp,
        t.ps_servers ? fmt::format(" + {} parameter servers", t.ps_servers) : std::string(),
        t.micro_batches, t.micro_batches == 1 ? "" : "es", t.tokens_per_step, t.remat, t.steps,
        t.steps == 1 ? "" : "s");
    o += fmt::format(
        "\nstep: {:.1f} ms measured (the slowest rank); {:.1f} ms from the run plan (the measured "
        "compute, plus the plan's recompute and pipeline bubble)\n",
        d.step_ms, d.predicted_step_ms);
    o += "\nwhere the step went (ms per step: means over ranks, but waiting is the rank that "
         "waited most; plan where it predicts):\n";
    o += fmt::format("  {:<52} {:>9.1f} {:>5}\n", "compute (forward and backward)", d.compute_ms,
                     pct(d.compute_ms, d.step_ms));
    for (const TimeLoss& l : d.losses)
        o += fmt::format("  {:<52} {:>9.1f} {:>5}{}\n", l.what, l.ms, pct(l.ms, d.step_ms),
                         l.predicted_ms >= 0 && (l.predicted_ms > 0 || l.ms > 0)
                             ? fmt::format("   plan {:.1f}", l.predicted_ms)
                             : std::string());
    const TimeLoss& top = d.losses.front();
    o += fmt::format(
        "\nlargest loss: {} ({}), {:.1f} ms a step, {} of it.\n  what would recover "
        "it: {}\n",
        top.key, top.what, top.ms, pct(top.ms, d.step_ms), top.remedy);
    if (t.ranks.size() > 1) {
        o += "\nper rank (ms per step):\n  rank stage replica shard      step";
        for (Phase p : kAllPhases) o += fmt::format(" {:>9}", phase_key(p));
        o += "\n";
        for (const RankTimes& r : t.ranks) {
            o += fmt::format("  {:>4} {:>5} {:>7} {:>5} {:>9.1f}", r.rank, r.stage, r.replica,
                             r.shard, 1e3 * r.step_s);
            for (Phase p : kAllPhases) o += fmt::format(" {:>9.1f}", 1e3 * r.phases[p]);
            o += "\n";
        }
    }
    if (!d.memory.empty()) {
        o += "\nmemory (rank 0): category, peak, predicted, reserved beyond used\n";
        for (const MemoryRow& r : d.memory) {
            if (r.peak == 0 && r.reserved == 0) continue;
            o += fmt::format("  {:<16} {:>12} {:>12} {:>12}\n", r.name, mib_text(r.peak),
                             r.predicted >= 0 ? mib_text(r.predicted) : std::string("-"),
                             mib_text(std::max(0.0, r.reserved - r.current)));
        }
        if (d.peak_rss >= 0) o += fmt::format("  process peak RSS {}\n", mib_text(d.peak_rss));
    }
    if (!d.baseline_dir.empty()) {
        o += fmt::format(
            "\nagainst the baseline {} (step {:.1f} ms; here {:.1f} ms), in ms per 1000 tokens "
            "per data-parallel replica:\n",
            d.baseline_dir, d.base_step_ms, d.step_ms);
        for (const auto& g : d.growth)
            o += fmt::format("  {:<52} {:>9.2f} {:>9.2f} {:>+9.2f}\n", g.what, g.base, g.here,
                             g.here - g.base);
        const auto& g = d.growth.front();
        o += fmt::format(
            "\nthe scaling regression is mostly {} ({}): {:+.2f} ms per 1000 tokens "
            "per replica.\n",
            g.key, g.what, g.here - g.base);
        for (const TimeLoss& l : d.losses)
            if (l.key == g.key) o += "  what would recover it: " + l.remedy + "\n";
    }
    for (const std::string& n : d.notes) o += "note: " + n + "\n";
    return o;
}

std::string diagnosis_json(const Diagnosis& d) {
    json j;
    j["run_dir"] = d.run_dir;
    j["step_ms"] = d.step_ms;
    j["predicted_step_ms"] = d.predicted_step_ms;
    j["compute_ms"] = d.compute_ms;
    j["slowest_rank"] = d.slowest_rank;
    j["largest_loss"] = d.losses.front().key;
    json ls = json::array();
    for (const TimeLoss& l : d.losses) {
        json o = {{"key", l.key}, {"what", l.what}, {"ms", l.ms}, {"remedy", l.remedy}};
        o["predicted_ms"] = l.predicted_ms >= 0 ? json(l.predicted_ms) : json(nullptr);
        ls.push_back(o);
    }
    j["losses"] = ls;
    json mem = json::array();
    for (const MemoryRow& r : d.memory)
        mem.push_back({{"name", r.name},
                       {"peak", r.peak},
                       {"predicted", r.predicted >= 0 ? json(r.predicted) : json(nullptr)},
                       {"reserved_beyond_used", std::max(0.0, r.reserved - r.current)}});
    j["memory"] = mem;
    j["peak_rss"] = d.peak_rss >= 0 ? json(d.peak_rss) : json(nullptr);
    json ranks = json::array();
    for (const RankTimes& r : d.t.ranks) {
        json o = {{"rank", r.rank}, {"step_ms", 1e3 * r.step_s}};
        for (Phase p : kAllPhases) o[std::string(phase_key(p)) + "_ms"] = 1e3 * r.phases[p];
        ranks.push_back(o);
    }
    j["ranks"] = ranks;
    if (!d.baseline_dir.empty()) {
        j["baseline"] = {{"run_dir", d.baseline_dir}, {"step_ms", d.base_step_ms}};
        json g = json::array();
        for (const auto& x : d.growth)
            g.push_back({{"key", x.key}, {"base", x.base}, {"here", x.here}});
        j["growth_ms_per_1k_tokens_per_replica"] = g;
        j["largest_growth"] = d.growth.front().key;
    }
    j["notes"] = d.notes;
    return j.dump(2) + "\n";
}

}  // namespace memtrain
