// What the CPU engine says about itself: its description, its memory report's title, predicted
// rows and footer, and the pipeline's timeline file (see cpu_engine.h).
#include <filesystem>

#include <fmt/format.h>

#include "engine/cpu/cpu_engine.h"
#include "engine/host_memory.h"
#include "io/text_file.h"
#include "kernels/cpu/gemm.h"

namespace memtrain {

std::string CpuEngine::chunk_blocks() const {
    std::string out;
    for (const auto& g : chunks_)
        out +=
            fmt::format("{}{}..{}", out.empty() ? "" : ", ", g->first_block(), g->end_block() - 1);
    return out;
}

std::string cpu_compute_label(const ModelConfig& m) {
    return m.cpu_bf16 ? fmt::format("bf16 GEMMs on {}, fp32 elsewhere", cpu::bf16_gemm_path())
                      : std::string("fp32");
}

std::string CpuEngine::describe() const {
    const bool sp = plan_.sequence_parallel;
    if (pipelined()) {
        const int p = stages(), v = plan_.virtual_stages, rank = stage();
        const std::string kind = pp::kind_name(plan_.schedule);
        std::string side =
            replicas_->replicas() > 1
                ? fmt::format(", pipeline {} of {} ({})", replica(), replicas(),
                              replicas_->sharded() ? "ZeRO-1 across pipelines"
                                                   : "gradients all-reduced across them")
                : std::string();
        if (tp_)
            side = fmt::format(", tensor-parallel shard {} of {}", tp_->rank(), tp_->size()) + side;
        if (v == 1)
            return fmt::format("cpu ({}), pipeline stage {} of {} (blocks {}, {} schedule){}",
                               cpu_compute_label(model_), rank, p, chunk_blocks(), kind, side);
        return fmt::format(
            "cpu ({}), pipeline rank {} of {}, {} chunks (virtual stages of {}: blocks {}, {} "
            "schedule){}",
            cpu_compute_label(model_), rank, p, v, p * v, chunk_blocks(), kind, side);
    }
    if (tp_)
        return fmt::format("cpu ({}), tensor-parallel rank {} of {}{}{}", cpu_compute_label(model_),
                           tp_->rank(), tp_->size(), sp ? ", sequence-parallel" : "",
                           shard16_ ? ", bf16 weights without a master copy" : "");
    if (plan_.lora) {
        std::string names;
        for (const auto& n : lora_layout_.names) names += (names.empty() ? "" : ", ") + n;
        return fmt::format("cpu ({}), {} r={} alpha={} on {} ({} trainable), base {} frozen",
                           cpu_compute_label(model_), quant_base_ ? "QLoRA" : "LoRA",
                           plan_.cfg.lora.rank, plan_.cfg.lora.alpha, names,
                           lora_layout_.params.total,
                           quant_base_ ? quant_base_->quant().name() : std::string("fp32"));
    }
    if (zero_ && zero_->bf16_params())
        return fmt::format(
            "cpu ({} compute, bf16 weights without a master copy: optim.master = none)",
            cpu_compute_label(model_));
    return fmt::format("cpu ({})", cpu_compute_label(model_));
}

std::string CpuEngine::memory_title() const {
    if (pipelined())
        return fmt::format(
            "host, fp32, pipeline stage {} of {}{}{} (rank {})", stage(), stages(),
            replicas() > 1 ? fmt::format(" of pipeline {} of {}", replica(), replicas())
                           : std::string(),
            tp_ ? fmt::format(", tensor-parallel shard {} of {}", tp_->rank(), tp_->size())
                : std::string(),
            world_.rank());
    if (tp_)
        return fmt::format("host, fp32, tensor-parallel rank {} of {}{}", tp_->rank(), tp_->size(),
                           plan_.sequence_parallel ? ", sequence-parallel" : "");
    const int N = world_.size();
    if (plan_.lora)
        return fmt::format(
            "host, fp32, LoRA{}",
            N > 1 ? fmt::format(", rank 0 of {}, adapters at ZeRO stage {}", N, plan_.zero_stage)
                  : std::string());
    return fmt::format(
        "host, fp32{}",
        N > 1 ? fmt::format(", rank 0 of {}, ZeRO stage {}", N, plan_.zero_stage) : std::string());
}

std::vector<MemoryPrediction> CpuEngine::predicted_memory(int B, int T) const {
    if (pipelined()) return stage_memory(B, T);
    return predict_cpu_memory(plan_.cfg, remat_, world_.rank(), B, T);
}

std::vector<MemoryPrediction> CpuEngine::stage_memory(int B, int T) const {
    // What the stage allocated: its units (and the mirror, and the weight versions), the
    // replicas' reduce-scattered piece and the optimizer over the piece, each chunk's slots of its
    // own blocks' arena, and a workspace per chunk; the plan predicts the same footprint
    // (stage_footprint) before any of it exists.
    StageFootprint f;
    for (const pp::StageStore::Range& r : stages_->ranges())
        f.units += fmt::format("{}{}..{}", f.units.empty() ? "" : ", ",
                               layout_.units[r.first_unit].name, layout_.units[r.last_unit].name);
    f.params = stages_->count();
    f.mirror = stages_->mirror_size();
    if (f.mirror) f.units += " + a copy of wte";
    f.version_bytes = versions_->predicted_bytes();
    f.versions = pp::weight_version_formula(plan_.schedule, stages(), stage());
    f.replicas = replicas();
    f.piece = replicas_->sharded();
    f.updated = (std::size_t)replicas_->owned().count;
    for (int c = 0; c < opt_->parts(); c++) f.state_bytes += opt_->part(c).state_bytes();
    f.reduce_buffer = replicas_->buffer_floats();
    for (const auto& g : chunks_) {
        const ArenaPlan a = g->stage_arena(B, T);
        f.activations +=
            (std::size_t)g->slots() * (a.activation_bytes + g->split_backward_bytes(B, T));
        f.workspace += a.workspace_bytes;
        f.slots +=
            fmt::format("{}{} x activation_layout(blocks {}..{})", f.slots.empty() ? "" : " + ",
                        g->slots(), g->first_block(), g->end_block() - 1);
    }
    f.split_backward = chunks_.front()->split_backward();
    f.chunks = chunks();
    f.tp = plan_.mesh.tp;
    if (f.tp > 1) {
        std::vector<std::pair<int, int>> units;
        for (const pp::StageStore::Range& r : stages_->ranges())
            units.emplace_back(r.first_unit, r.last_unit);
        f.gathers = tp_gather_bytes(make_param_layout(plan_.cfg.model), layout_, units, f.tp);
    }
    return stage_memory_rows(plan_, f);
}

std::string CpuEngine::memory_footer() const {
    std::string out = host_rss_line();
    if (pipelined()) {
        const int p = stages(), v = chunks();
        const std::string kind = pp::kind_name(plan_.schedule);
        if (v == 1) {
            out += fmt::format(
                "pipeline: {} stages, {} schedule, stage {} holds blocks {} and up to {} "
                "micro-batches in flight\n",
                p, kind, stage(), chunk_blocks(), slots());
        } else {
            std::string slots;
            for (const auto& g : chunks_)
                slots += fmt::format("{}{}", slots.empty() ? "" : " + ", g->slots());
            out += fmt::format(
                "pipeline: {} ranks x {} chunks = {} virtual stages, {} schedule, rank {} holds "
                "blocks {} with {} activation slots (each chunk's most micro-batches in "
                "flight)\n",
                p, v, p * v, kind, stage(), chunk_blocks(), slots);
        }
        out += versions_->summary();
        if (replicas() > 1)
            out += fmt::format(
                "pipelines: {} side by side (job rank = pipeline x {} + stage); stage {}'s {} "
                "gradient floats {} across its {} replicas each step{}\n",
                replicas(), p, stage(), stages_->count(), replicas_->reduction(), replicas(),
                replicas_->sharded()
                    ? fmt::format(", each updating a shard of {} and all-gathering the parameters",
                                  replicas_->owned().count)
                    : std::string());
        out += timeline_->summary(exec_->schedule());
        return out;
    }
    if (tp_) {
        const std::size_t whole = tpl_.replicated_floats(), cut = tpl_.full.total - whole;
        out += fmt::format(
            "tensor parallel: parameters per rank {} whole + {} / {} cut = {} floats (one "
            "process: {})\n",
            whole, cut, tp_->size(), tpl_.local.total, tpl_.full.total);
        if (steps_ > 0) {
            const dist::TpGroup::Counts& c = step_counts_;
            std::string sites;
            for (int s = 0; s < kTpSites; s++)
                if (c.calls[s] > 0)
                    sites += fmt::format("{}{} x{} ({} elements)", sites.empty() ? "" : ", ",
                                         tp_site_name((TpSite)s), c.calls[s], c.elements[s]);
            out += fmt::format(
                "tensor parallel, last step's collectives: {}; {:.3f} MiB in all ({:.3f} MiB sent "
                "per rank by a ring), {:.1f} ms inside them\n",
                sites, c.bytes() / 1048576.0, c.ring_bytes(tp_->size()) / 1048576.0,
                1e3 * c.seconds);
        }
        return out;
    }
    if (plan_.lora) {
        const std::size_t base = layout_.total, trained = lora_layout_.params.total;
        return out +
               fmt::format(
                   "LoRA: {} adapters, {} trainable parameters = {:.3f}% of the base's {}\n",
                   lora_layout_.sites.size(), trained, 100.0 * (double)trained / (double)base,
                   base) +
               (quant_base_ ? "QLoRA base: " + quant_base_->summary() + "\n" : std::string());
    }
    // What the overlap did, beside the communication buffers it cost (parallel/data/zero_store.h).
    const dist::ReduceStats& r = zero_->reduce_stats();
    const dist::PrefetchStats& pf = zero_->prefetch_stats();
    if (r.started > 0)
        out += fmt::format(
            "overlap: {} reduce-scatters, {} arrived under compute, the rest waited for (at most "
            "{} in flight)\n",
            r.started, r.arrived, r.max_in_flight);
    if (world_.size() > 1 && zero_->stage() == 0) {
        // What the gradient all-reduce moves, for comparison with the parameter server's counted
        // bytes (engine/cpu/ps_engine.h): the ring's formula (MPI may pick another algorithm).
        const double psi4 = 4.0 * (double)layout_.total, N = world_.size();
        out += fmt::format(
            "all-reduce per step: Ψ = {} floats; a ring moves 2 Ψ (N-1)/N x 4 B = {:.2f} MiB per "
            "rank, {:.2f} MiB over all links\n",
            layout_.total, 2 * (N - 1) / N * psi4 / 1048576.0, 2 * (N - 1) * psi4 / 1048576.0);
    }
    if (pf.hits + pf.misses > 0)
        out += fmt::format("overlap: ZeRO-3 gathers {} prefetched, {} on the spot, {} dropped\n",
                           pf.hits, pf.misses, pf.dropped);
    return out;
}

std::string CpuEngine::write_run_files(const std::string& out_dir) {
    if (!pipelined()) return "";
    const std::string svg = timeline_->svg(exec_->schedule());
    if (svg.empty()) return "";
    const std::string path = (std::filesystem::path(out_dir) / "pipeline_timeline.svg").string();
    io::write_text_file_atomically(path, svg);
    return fmt::format("pipeline timeline (measured, last step): {}\n", path);
}

}  // namespace memtrain
