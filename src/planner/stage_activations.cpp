// A pipeline stage's activations from the engine's layout (see stage_activations.h).
#include "planner/stage_activations.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"
#include "planner/rank_layout.h"

namespace memtrain::plan {

BlockKeep block_keep(Recompute r) {
    switch (r) {
        case Recompute::none:
            return BlockKeep::All;
        case Recompute::selective:
            return BlockKeep::Selective;
        case Recompute::full:
            return BlockKeep::Input;
    }
    fail("internal: unknown recompute option {}", static_cast<int>(r));
}

RematPlan remat_plan(Recompute r, int blocks) {
    return RematPlan(static_cast<std::size_t>(blocks), block_keep(r));
}

RematPlan remat_plan(const RunSpec& r, int blocks) {
    if (!r.block_plan.empty() && (int)r.block_plan.size() == blocks) return r.block_plan;
    return remat_plan(r.recompute, blocks);
}

std::string remat_label(const RunSpec& r) {
    if (r.block_plan.empty())
        return fmt::format("{} = {} blocks", to_string(r.recompute),
                           keep_name(block_keep(r.recompute)));
    std::string out;
    for (BlockKeep k : {BlockKeep::All, BlockKeep::Selective, BlockKeep::Input, BlockKeep::Offload,
                        BlockKeep::Segment, BlockKeep::Dropped}) {
        const auto n = std::count(r.block_plan.begin(), r.block_plan.end(), k);
        if (n > 0)
            out += fmt::format("{}{} {}", out.empty() ? "per block: " : ", ", n, keep_name(k));
    }
    return out;
}

ActFormat arena_format(const ModelConfig& cfg, const RunSpec& r) {
    const int e = activation_bytes(r.precision);
    const int T = r.seq > 0 ? r.seq : cfg.block_size;  // RunSpec::seq_len of the same model
    if (r.flash_attention) return cuda_arena_format(cfg, e, r.micro_batch, T);
    ActFormat f = cpu_arena_format(cfg);
    f.elem_bytes = e;
    return f;
}

bool uses_stage_layout(const ModelSpec& m, const RunSpec& r) {
    return r.pp > 1 && (r.tp == 1 || uses_engine_layout(m, r));
}

int RankActivations::total_slots() const {
    int n = 0;
    for (int k : slots) n += k;
    return n;
}

std::string RankActivations::block_ranges() const {
    std::string out;
    for (std::size_t c = 0; c < blocks.size(); c++)
        out +=
            fmt::format("{}{}..{}", c ? "," : "", first_block[c], first_block[c] + blocks[c] - 1);
    return out;
}

PipelineActivations pipeline_activations(const ModelSpec& m, const RunSpec& r) {
    if (r.pp < 2) fail("internal: pipeline_activations needs pp >= 2, got {}", r.pp);
    PipelineActivations out;
    out.config = config_from_model(m);
    const int B = r.micro_batch, T = r.seq_len(m), p = r.pp;
    const int v = r.schedule == pp::Kind::Interleaved ? r.virtual_stages : 1;
    // Each stage is split from the whole model; its arenas are those of the tensor-parallel
    // shard's config (CpuEngine's pipeline chunks, sequence-parallel when the run is), the
    // whole model's at tp = 1.
    const ModelConfig shard = rank_config(m, r);
    out.format = arena_format(shard, r);
    out.plan = remat_plan(r, m.n_layer);
    out.split = pp::split_stages(out.config, p * v, B, T);
    out.schedule = pp::make_schedule(r.schedule, p, r.micro_batches, v);
    // Per virtual stage: one micro-batch's arena of its blocks under their slice of the plan,
    // as CpuEngine::set_remat hands the stage's model its blocks' entries.
    std::vector<std::size_t> arena(p * v);
    for (int s = 0; s < p * v; s++) {
        const int b0 = out.split.first_block[s];
        const RematPlan slice = slice_plan(out.plan, b0, b0 + out.split.blocks[s]);
        arena[s] =
            plan_stage_arena(shard, out.split.blocks[s], B, T, slice, out.format).activation_bytes;
    }
    // The executor's slots: the simulator runs each rank's list in order, so its count of what a
    // virtual stage holds between F and B (or W) is the executor's, whatever the stages cost.
    const pp::SimResult sim =
        pp::simulate(out.schedule, pp::StageCosts::uniform(p * v, 1, 2, 1, 1));
    out.ranks.resize(p);
    for (int rk = 0; rk < p; rk++) {
        RankActivations& ra = out.ranks[rk];
        for (int c = 0; c < v; c++) {
            const int s = c * p + rk;
            ra.chunks.push_back(s);
            ra.first_block.push_back(out.split.first_block[s]);
            ra.blocks.push_back(out.split.blocks[s]);
            ra.arena.push_back(arena[s]);
            ra.slots.push_back(std::max(1, sim.peak_stage_in_flight[s]));
            ra.total_blocks += out.split.blocks[s];
            ra.bytes += static_cast<std::size_t>(ra.slots.back()) * arena[s];
        }
    }
    return out;
}

}  // namespace memtrain::plan
