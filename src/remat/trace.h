// A step's recompute schedule event by event, as the CPU model runs it (model/gpt.cpp over
// model/unit_walk.h and input_rebuild): every block forward, every forward a rebuild re-runs,
// every block recompute and backward, with what each block holds after it and the activation
// bytes alive while it runs. `memtrain remat --animate` draws it (the lecture's animation of
// vanilla, memory-poor and checkpointed backprop, for any plan).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "remat/solver.h"

namespace memtrain::remat {

struct TraceEvent {
    enum class Kind : uint8_t {
        Forward,    // the step's forward of a block
        Rebuild,    // a forward re-run to rebuild a dropped input above it
        Recompute,  // the block's dropped fields recomputed before its backward
        Backward,
    };
    Kind kind = Kind::Forward;
    int block = 0;
    // Bytes alive while the event runs: the residual streams and fields held, the recompute
    // scratch when the event writes into it, ln_f's output.
    std::size_t live_bytes = 0;
    // After the event, per block: what it holds.
    //   '.' nothing   'i' its input   'h' its rebuilt input, held   'S' input and the selective
    //   fields   'A' input and every field   'f' fields without a kept input (Segment/Dropped
    //   blocks between their forward and backward never keep fields, so only while running)
    std::string state;
};
const char* event_name(TraceEvent::Kind k);

// The events of one step under `plan`, with bytes from `chain` (make_chain of the same model
// and micro-batch). The largest live_bytes never exceeds peak_bytes(chain, plan), the arena the
// model allocates once.
std::vector<TraceEvent> trace_step(const Chain& chain, const RematPlan& plan);

// An animated SVG of the trace: one row per block (its input and its fields, coloured by what it
// holds), the event running, and the live activation bytes over the step against the arena.
std::string trace_svg(const std::vector<TraceEvent>& events, const Chain& chain,
                      const RematPlan& plan, const std::string& title);

}  // namespace memtrain::remat
