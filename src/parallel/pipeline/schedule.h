// Pipeline schedules as data: for each rank, the ordered list of compute actions (forward,
// backward, or backward split into input-gradient I and weight-gradient W) on micro-batch i of
// (virtual) stage s. One generator per schedule, one validator, and one dependency-driven
// simulator that gives the step time, each rank's busy time and the micro-batches each stage
// holds; the planner, `memtrain pipeline` and (later) the executor all read the same lists.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace memtrain::pp {

enum class Op { F, B, I, W };  // B = I + W, unsplit

struct Action {
    Op op;
    int stage;  // virtual stage: chunk * p + rank (chunk 0 when v = 1)
    int mb;     // micro-batch
    bool operator==(const Action&) const = default;
};

enum class Kind {
    Naive,        // one micro-batch at a time through every stage, forward then backward
    GPipe,        // all forwards, then all backwards (Huang et al. 2019)
    OneFOneB,     // warm-up forwards, then one forward / one backward (PipeDream-Flush)
    Interleaved,  // 1F1B over v chunks per rank (Megatron virtual stages); m % p == 0
    ZbH1,         // 1F1B with the backward split, W delayed to fill the bubble (Qi et al. 2024)
    PipeDream,    // asynchronous 1F1B, no flush, weight stashing (p - s versions on stage s)
    PipeDream2BW  // asynchronous 1F1B, double-buffered weights, 1-stale updates
};

Kind parse_kind(std::string_view name);  // naive | gpipe | 1f1b | interleaved | zb-h1 | ...
std::string kind_name(Kind k);

struct Schedule {
    Kind kind;
    int p = 1;                               // ranks (pipeline stages per chunk)
    int m = 1;                               // micro-batches per optimizer step
    int v = 1;                               // chunks per rank
    std::vector<std::vector<Action>> ranks;  // ranks[r]: rank r's actions in order
    int num_stages() const { return p * v; }
    int rank_of(int stage) const { return stage % p; }
};

// The schedule's action lists. Errors (memtrain::Error) name the parameter at fault: p, m, v
// must be positive, v > 1 only for interleaved (which needs m % p == 0), PipeDream-2BW needs
// m >= p - 1 (fewer would need a third weight version).
Schedule make_schedule(Kind kind, int p, int m, int v = 1);

// Every (stage, micro-batch) has exactly one F and either one B or one I and one W, on the rank
// that owns the stage, with F before B/I and I before W in that rank's list. Throws an Error
// that says which action is missing, duplicated or out of order.
void validate(const Schedule& s);

// Per virtual stage costs of one micro-batch (any unit): forward, full backward, and its split
// into input gradient and weight gradient (used by I and W; b is used by B).
struct StageCosts {
    std::vector<double> f, b, i, w;
    static StageCosts uniform(int stages, double f, double b, double i = 0, double w = 0);
};

struct Span {
    Action a;
    double start, end;
};

struct SimResult {
    double makespan = 0;
    std::vector<double> busy;               // per rank: time spent computing
    std::vector<int> peak_in_flight;        // per rank: most micro-batches (of all its chunks)
                                            // between their F and their B (or W)
    std::vector<int> peak_stage_in_flight;  // per virtual stage: the same count for its own
                                            // micro-batches (an interleaved chunk's slots)
    std::vector<std::vector<Span>> spans;   // per rank, in execution order
    // Idle share of the step, mean over ranks: 1 - mean(busy) / makespan (GPipe's definition:
    // (p - 1) / (m + p - 1) for uniform stages).
    double bubble() const;
};

// Runs the lists with zero communication cost: an action starts when its rank is free and its
// inputs exist (F(s,i) after F(s-1,i); B/I(s,i) after F(s,i) and B/I(s+1,i); W(s,i) after
// I(s,i)). Throws an Error on a deadlock, with the grid of where each rank is stuck.
SimResult simulate(const Schedule& s, const StageCosts& costs);

// The pipeline's fill for equal stages (forward 1, backward 2 per micro-batch and stage, or per
// chunk 1/v and 2/v), in micro-batch times: makespan / (forward + backward) - m, from simulate on
// make_schedule's lists, so the planner's step time comes from the executor's schedules (GPipe
// and 1F1B give p - 1, interleaved (p - 1) / v). Remembered per (kind, p, m, v): the planner asks
// for thousands of layouts.
double uniform_fill(Kind kind, int p, int m, int v = 1);
// The idle share of such a step, fill / (m + fill): what the run plan predicts for the bubble
// (`memtrain diagnose`).
double uniform_bubble(Kind kind, int p, int m, int v = 1);
// The most micro-batches each rank holds between forward and backward under `kind`, in whole
// stage micro-batches (an interleaved chunk's count as 1/v).
std::vector<double> uniform_in_flight(Kind kind, int p, int m, int v = 1);

// "1F0" style text of one action (op, stage, micro-batch), and the whole schedule as one line
// per rank.
std::string action_text(const Action& a);
std::string format_lists(const Schedule& s);
// The timeline as a self-contained SVG: one row per rank, one box per action (forwards and
// backwards in two colours, W in a third), time on the x axis.
std::string timeline_svg(const Schedule& s, const SimResult& r, const std::string& title);

// PipeDream's weight stashing: the weight version (number of updates applied) stage s uses for
// minibatch i, max(0, i - (p - 1 - s)), and how many versions stage s keeps alive, p - s.
int pipedream_version(int p, int s, int i);
int pipedream_versions(int p, int s);

}  // namespace memtrain::pp
