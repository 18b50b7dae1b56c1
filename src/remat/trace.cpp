// A step's recompute schedule, event by event, and its animation (see trace.h).
#include "remat/trace.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace memtrain::remat {

const char* event_name(TraceEvent::Kind k) {
    switch (k) {
        case TraceEvent::Kind::Forward:
            return "forward";
        case TraceEvent::Kind::Rebuild:
            return "rebuild";
        case TraceEvent::Kind::Recompute:
            return "recompute";
        case TraceEvent::Kind::Backward:
            return "backward";
    }
    return "?";
}

std::vector<TraceEvent> trace_step(const Chain& c, const RematPlan& plan_in) {
    const int n = (int)c.blocks.size();
    const RematPlan plan = plan_in.empty() ? RematPlan(n, BlockKeep::All) : plan_in;
    if ((int)plan.size() != n)
        fail("internal: a remat plan of {} blocks for a chain of {}", plan.size(), n);
    const InputRebuild rb = input_rebuild(plan);
    const std::size_t stream = c.resid_bytes;
    const std::size_t lnf = c.fixed_bytes - (std::size_t)(n + 1) * stream;
    // What each block holds: its input stream (kept, a temporary, or held after a rebuild), and
    // its fields (kept by the plan, or recomputed into the scratch for its backward).
    enum class In : uint8_t { None, Kept, Temp, Held };
    std::vector<In> input(n + 1, In::None);
    std::vector<bool> kept(n, false), recomputed(n, false);
    const auto kept_of = [&](int l) { return option(c, l, plan[l]).kept_bytes; };
    const auto scratch_of = [&](int l) { return option(c, l, plan[l]).scratch_bytes; };
    const auto full_scratch = [&](int l) { return option(c, l, BlockKeep::Input).scratch_bytes; };
    std::vector<TraceEvent> out;
    const auto emit = [&](TraceEvent::Kind kind, int block, std::size_t extra) {
        TraceEvent e;
        e.kind = kind;
        e.block = block;
        std::size_t live = lnf + extra;
        for (int l = 0; l <= n; l++) live += input[l] != In::None ? stream : 0;
        for (int l = 0; l < n; l++) live += kept[l] ? kept_of(l) : 0;
        e.live_bytes = live;
        for (int l = 0; l < n; l++) {
            char ch = '.';
            if (input[l] == In::Kept) ch = 'i';
            if (input[l] == In::Temp) ch = 't';
            if (input[l] == In::Held) ch = 'h';
            if (kept[l]) ch = plan[l] == BlockKeep::All ? 'A' : 'S';
            if (recomputed[l]) ch = 'f';
            e.state.push_back(ch);
        }
        out.push_back(std::move(e));
    };
    const auto own = [&](int l) { return rebuilds_input(plan[l]) ? In::Temp : In::Kept; };

    // Forward: block l reads its input and writes the next; the fields it drops go through the
    // scratch; a rebuilt input is gone once its block has run.
    input[0] = In::Kept;
    for (int l = 0; l < n; l++) {
        input[l + 1] = l + 1 < n ? own(l + 1) : In::Kept;
        kept[l] = kept_of(l) > 0;
        emit(TraceEvent::Kind::Forward, l, plan[l] == BlockKeep::All ? 0 : scratch_of(l));
        if (input[l] == In::Temp) input[l] = In::None;
    }
    input[n] = In::None;  // the head's backward has read the last stream
    // Backward, from the last block: rebuild the input if it is gone, recompute the dropped
    // fields, run the backward, and free what the block held.
    for (int i = n - 1; i >= 0; i--) {
        if (rb.from[i] >= 0) {
            for (int m = rb.from[i]; m < i; m++) {
                input[m + 1] = rb.holder[m + 1] == i ? In::Held : In::Temp;
                emit(TraceEvent::Kind::Rebuild, m, full_scratch(m));
                if (m > rb.from[i] && input[m] == In::Temp) input[m] = In::None;
            }
        }
        const std::size_t scratch = plan[i] == BlockKeep::All ? 0 : scratch_of(i);
        if (plan[i] != BlockKeep::All) {
            recomputed[i] = true;
            emit(TraceEvent::Kind::Recompute, i, scratch);
        }
        emit(TraceEvent::Kind::Backward, i, scratch);
        recomputed[i] = kept[i] = false;
        input[i] = In::None;
        if (i + 1 < n && input[i + 1] == In::Temp) input[i + 1] = In::None;
        out.back().state[i] = '.';
    }
    return out;
}

namespace {

// The colours of a block's two cells for its state letter.
const char* input_colour(char s) {
    switch (s) {
        case 'i':
        case 'S':
        case 'A':
            return "#4682b4";  // kept input
        case 't':
            return "#a9cce3";  // a temporary
        case 'h':
            return "#f39c12";  // held after a rebuild
        case 'f':
            return "#4682b4";
        default:
            return "#ffffff";
    }
}
const char* field_colour(char s) {
    switch (s) {
        case 'A':
            return "#1e8449";  // every field
        case 'S':
            return "#82e0aa";  // selective's fields
        case 'f':
            return "#f4d03f";  // recomputed into the scratch
        default:
            return "#ffffff";
    }
}

// A discrete SMIL animation of `attr` through `values` (one per event), listing only the changes.
std::string discrete(const char* attr, const std::vector<std::string>& values, double dur) {
    const std::size_t E = values.size();
    std::string v, k;
    for (std::size_t e = 0; e < E; e++) {
        if (e > 0 && values[e] == values[e - 1]) continue;
        v += (v.empty() ? "" : ";") + values[e];
        k += fmt::format("{}{:.5f}", k.empty() ? "" : ";", (double)e / E);
    }
    return fmt::format(
        "<animate attributeName=\"{}\" values=\"{}\" keyTimes=\"{}\" calcMode=\"discrete\" "
        "dur=\"{:.2f}s\" repeatCount=\"indefinite\"/>",
        attr, v, k, dur);
}

}  // namespace

std::string trace_svg(const std::vector<TraceEvent>& events, const Chain& chain,
                      const RematPlan& plan, const std::string& title) {
    if (events.empty()) fail("internal: an empty trace");
    const int n = (int)chain.blocks.size();
    const std::size_t E = events.size();
    const double dur = std::clamp(0.25 * (double)E, 4.0, 60.0);  // seconds for the whole step
    const double row = std::clamp(360.0 / n, 6.0, 22.0), top = 60, left = 70, cell = 28;
    const double H = std::max(top + row * n + 70, 420.0), W = 860;
    const double gx0 = 260, gx1 = W - 30, gy0 = top, gy1 = H - 60;  // the memory chart
    std::size_t most = peak_bytes(chain, plan);
    for (const TraceEvent& e : events) most = std::max(most, e.live_bytes);
    const auto X = [&](double e) { return gx0 + (gx1 - gx0) * e / (double)E; };
    const auto Y = [&](double b) { return gy1 - (gy1 - gy0) * b / (double)most; };
    std::string o = fmt::format(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{:.0f}\" "
        "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%\" height=\"100%\" "
        "fill=\"white\"/>\n<text x=\"10\" y=\"20\" font-size=\"14\">{}</text>\n",
        W, H, title);
    o += fmt::format(
        "<text x=\"10\" y=\"38\">{} events; blue: a kept input, light blue: a temporary, orange: "
        "a rebuilt input held; green: kept fields (light: selective), yellow: recomputed</text>\n",
        E);
    // The blocks, the last at the top: input cell, fields cell.
    for (int l = 0; l < n; l++) {
        const double y = top + row * (n - 1 - l);
        std::vector<std::string> in, fl;
        for (const TraceEvent& e : events) {
            in.push_back(input_colour(e.state[l]));
            fl.push_back(field_colour(e.state[l]));
        }
        if (row >= 10)
            o += fmt::format("<text x=\"10\" y=\"{:.1f}\">block {}</text>\n", y + row * 0.75, l);
        o += fmt::format(
            "<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{:.1f}\" "
            "stroke=\"#999\">{}</rect>\n",
            left, y, cell, row - 1, discrete("fill", in, dur));
        o += fmt::format(
            "<rect x=\"{}\" y=\"{:.1f}\" width=\"{}\" height=\"{:.1f}\" "
            "stroke=\"#999\">{}</rect>\n",
            left + cell + 4, y, cell * 2, row - 1, discrete("fill", fl, dur));
    }
    // The running block's outline and the event's name.
    std::vector<std::string> ys, names;
    for (const TraceEvent& e : events) {
        ys.push_back(fmt::format("{:.1f}", top + row * (n - 1 - e.block)));
        names.push_back(fmt::format("{} {}", event_name(e.kind), e.block));
    }
    o += fmt::format(
        "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{:.1f}\" fill=\"none\" stroke=\"red\" "
        "stroke-width=\"2\">{}</rect>\n",
        left - 3, top, cell * 3 + 10, row + 1, discrete("y", ys, dur));
    // The memory over the step: live bytes per event, the arena, and a cursor.
    o += fmt::format(
        "<line x1=\"{}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n<line x1=\"{}\" "
        "y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>\n",
        gx0, gy1, gx1, gy1, gx0, gy0, gx0, gy1);
    std::string line;
    for (std::size_t e = 0; e < E; e++)
        line += fmt::format("{:.1f},{:.1f} {:.1f},{:.1f} ", X((double)e), Y(events[e].live_bytes),
                            X((double)e + 1), Y(events[e].live_bytes));
    o += fmt::format("<polyline points=\"{}\" fill=\"none\" stroke=\"steelblue\"/>\n", line);
    const std::size_t arena = peak_bytes(chain, plan);
    o += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"gray\" "
        "stroke-dasharray=\"4 3\"/>\n<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">arena "
        "{:.2f} MiB</text>\n",
        gx0, Y(arena), gx1, Y(arena), gx1, Y(arena) - 4, arena / 1048576.0);
    o += fmt::format(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">events of one step (forward, then "
        "backward); live activation bytes</text>\n<text x=\"{}\" y=\"{:.1f}\" "
        "text-anchor=\"end\">{:.1f} MiB</text>\n",
        (gx0 + gx1) / 2, H - 30, gx0 - 4, gy0 + 4, most / 1048576.0);
    std::vector<std::string> xs;
    for (std::size_t e = 0; e < E; e++) xs.push_back(fmt::format("{:.1f}", X((double)e + 0.5)));
    o += fmt::format("<line x1=\"0\" y1=\"{}\" x2=\"0\" y2=\"{}\" stroke=\"red\">{}{}</line>\n",
                     gy0, gy1, discrete("x1", xs, dur), discrete("x2", xs, dur));
    // The event's name under the chart (one text per distinct name run would be as long: the
    // label is drawn per event, shown only in its slot).
    for (std::size_t e = 0; e < E; e++) {
        std::vector<std::string> vis(E, "hidden");
        vis[e] = "visible";
        o += fmt::format("<text x=\"{}\" y=\"{}\" visibility=\"hidden\">{}{}</text>\n", gx0, H - 12,
                         names[e], discrete("visibility", vis, dur));
    }
    o += "</svg>\n";
    return o;
}

}  // namespace memtrain::remat
