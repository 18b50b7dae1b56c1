// One rank's memory from the engines' layout functions (see rank_layout.h).
#include "planner/rank_layout.h"

#include <fmt/format.h>

#include "comm/communicator.h"
#include "core/error.h"
#include "model/activation_layout.h"
#include "model/param_layout.h"
#include "planner/stage_activations.h"

namespace memtrain::plan {

namespace {

// ModelConfig::validate_tp's checks, answered rather than thrown.
bool tp_divides(const ModelConfig& c, int tp) {
    if (tp == 1) return true;
    try {
        c.validate_tp(tp);
        return true;
    } catch (const Error&) {
        return false;
    }
}

}  // namespace

bool uses_engine_layout(const ModelSpec& m, const RunSpec& r) {
    if (m.dropout || m.attn_bias != m.mlp_bias || r.lora_rank > 0) return false;
    // Sequence parallelism the trainer refuses is left to the formulas.
    if (r.sequence_parallel && !sequence_parallel_runs(m, r)) return false;
    return tp_divides(config_from_model(m), r.tp);
}

bool sequence_parallel_runs(const ModelSpec& m, const RunSpec& r) {
    return r.tp > 1 && ((int64_t)r.micro_batch * r.seq_len(m)) % r.tp == 0;
}

bool uses_engine_arena(const ModelSpec& m, const RunSpec& r) {
    if (uses_engine_layout(m, r)) return true;
    // LoRA on one rank's whole model: the adapters change the model states, not the arena (their
    // rank-wide intermediates live in the workspace), so the engine's arena prices it.
    RunSpec full = r;
    full.lora_rank = 0;
    return r.lora_rank > 0 && r.tp == 1 && r.pp == 1 && uses_engine_layout(m, full);
}

ModelConfig rank_config(const ModelSpec& m, const RunSpec& r) {
    ModelConfig c = config_from_model(m);
    c.tp = r.tp;
    // ModelConfig::sp_rows then shards the arena's sequence regions as the engines' shard
    // configs do (dist::tp_shard_config).
    c.sequence_parallel = r.sequence_parallel && r.tp > 1;
    c.lse_attention = r.lse_attention && !r.flash_attention;
    c.cpu_bf16 = r.cpu_bf16 && !r.flash_attention;
    c.saved_activations = r.flash_attention ? SavedStore::fp32 : r.cpu_saved;
    return c;
}

RankStates rank_states(const ModelSpec& m, const RunSpec& r, RankCoord at,
                       const pp::StageSplit* given) {
    if (at.stage < 0 || at.stage >= r.pp || at.replica < 0 || at.replica >= r.dp)
        fail("internal: rank (stage {}, replica {}) of pp {} x dp {}", at.stage, at.replica, r.pp,
             r.dp);
    const ModelConfig cfg = rank_config(m, r);
    const ParamLayout layout = make_param_layout(cfg);
    RankStates s;
    if (r.pp == 1) {
        s.params = s.optimized = (int64_t)layout.total;
        s.source = r.tp > 1 ? fmt::format("make_param_layout of the tp = {} shard", r.tp)
                            : std::string("make_param_layout");
    } else {
        // CpuEngine's pipeline units: each chunk (virtual stages stage, stage + pp, ...) its
        // blocks, the embedding with block 0 and the head with the last block.
        const int v = r.schedule == pp::Kind::Interleaved ? r.virtual_stages : 1;
        // The split is the whole model's (every tensor-parallel shard of a stage has the same
        // blocks); the units' sizes are the shard's.
        const pp::StageSplit split =
            given ? *given
                  : pp::split_stages(config_from_model(m), r.pp * v, r.micro_batch, r.seq_len(m));
        std::string units;
        for (int c = 0; c < v; c++) {
            const int vs = c * r.pp + at.stage;
            const int b0 = split.first_block[vs], b1 = b0 + split.blocks[vs];
            const int first = b0 == 0 ? ParamLayout::embedding_unit() : layout.block_unit(b0);
            const int last = b1 == cfg.n_layer ? layout.head_unit() : layout.block_unit(b1 - 1);
            s.optimized += (int64_t)(layout.units[last].end - layout.units[first].begin);
            units += fmt::format("{}{}..{}", c ? ", " : "", layout.units[first].name,
                                 layout.units[last].name);
        }
        s.params = s.optimized;
        // The last stage's copy of a tied embedding (Megatron's): parameters and gradients only.
        const bool mirror = at.stage == r.pp - 1 && cfg.tied_embeddings;
        if (mirror) s.params += (int64_t)layout.units[ParamLayout::embedding_unit()].size();
        s.source = fmt::format("make_param_layout units {}{}", units, mirror ? " + wte copy" : "");
    }
    s.shard = dist::shard_ranges(s.optimized, r.dp).at(at.replica).count;
    // ZeRO-1 in the pipeline engine (pipelines, or tensor-parallel stages, side by side)
    // reduce-scatters into a buffer of the replica's piece.
    if ((r.pp > 1 || r.tp > 1) && r.dp > 1 && r.zero == 1) s.reduce_buffer = s.shard;
    return s;
}

std::size_t arena_activation_bytes(const ModelSpec& m, const RunSpec& r) {
    const ModelConfig cfg = rank_config(m, r);
    return plan_arena(cfg, r.micro_batch, r.seq_len(m), remat_plan(r, m.n_layer),
                      arena_format(cfg, r))
        .activation_bytes;
}

}  // namespace memtrain::plan
