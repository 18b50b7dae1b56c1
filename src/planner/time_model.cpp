// The step-time model. Efficiency drops for narrow GEMMs (small h/tp) and short micro-batches,
// which is what makes very high TP or tiny micro-batches lose in the ranking, as they do in
// practice. Constants are calibrated against the runs in docs/planner-validation.md.
#include "planner/time_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "parallel/pipeline/schedule.h"
#include "planner/memory_model.h"

namespace memtrain::plan {

double model_flops_per_token(const ModelSpec& m, const RunSpec& r) {
    double passes = r.lora_rank > 0 ? 4.0 : 6.0;  // forward 2, input grads 2, weight grads 2
    double matmul = static_cast<double>(m.matmul_params());
    double attn = 2.0 * m.n_layer * m.n_embd * static_cast<double>(r.seq_len(m));
    return passes * (matmul + attn);
}

double hardware_flops_per_token(const ModelSpec& m, const RunSpec& r) {
    double f = model_flops_per_token(m, r);
    double attn_fwd = 4.0 * m.n_layer * m.n_embd * static_cast<double>(r.seq_len(m));
    double layers_fwd = 2.0 * m.n_layer * m.layer_matrix_params() + attn_fwd;
    if (!r.block_plan.empty()) {  // a per-block plan: each block's share of its recompute
        const double L = static_cast<double>(r.block_plan.size());
        const auto count = [&](BlockKeep k) {
            return static_cast<double>(std::count(r.block_plan.begin(), r.block_plan.end(), k));
        };
        // Every block that re-runs whole, and the forwards that rebuild dropped inputs.
        const double whole = count(BlockKeep::Input) + count(BlockKeep::Offload) +
                             count(BlockKeep::Segment) + count(BlockKeep::Dropped) +
                             static_cast<double>(input_rebuild(r.block_plan).forwards);
        f += layers_fwd * whole / L;
        if (!r.flash_attention) f += attn_fwd * count(BlockKeep::Selective) / L;
        return f;
    }
    if (r.recompute == Recompute::full) f += layers_fwd;
    if (r.recompute == Recompute::selective && !r.flash_attention) f += attn_fwd;
    return f;
}

double ring_all_reduce_s(double bytes, int n, double bw) {
    if (n <= 1) return 0;
    return 2.0 * (n - 1) / n * bytes / bw;
}

double ring_gather_s(double bytes, int n, double bw) {
    if (n <= 1) return 0;
    return (n - 1.0) / n * bytes / bw;
}

double gemm_efficiency(double M, double N, double K, double elem_bytes, double peak,
                       const GpuSpec& g) {
    constexpr double kTile = 128;
    const double tm = std::ceil(M / kTile), tn = std::ceil(N / kTile), tiles = tm * tn;
    const double tile = M * N / (tm * kTile * tn * kTile);  // padding of the edge tiles
    const double sms = std::max(1, g.sms);
    const double wave = tiles / (std::ceil(tiles / sms) * sms);  // the last wave's idle SMs
    const double k_loop = K / (K + kTile);  // each tile's fixed prologue and epilogue
    const double intensity = 2 * M * N * K / (elem_bytes * (M * K + K * N + M * N));
    const double memory = std::min(1.0, intensity / (peak / g.hbm_bandwidth));
    return g.efficiency * tile * wave * k_loop * memory;
}

double block_gemm_efficiency(const ModelSpec& m, const RunSpec& r, double elem_bytes, double peak,
                             const GpuSpec& g, bool last_stage) {
    // One layer's GEMMs on a tp rank for a micro-batch of T tokens (the head's on the last
    // stage), each forward (T x N x K), input gradient (T x K x N) and weight gradient
    // (K x N x T): their FLOPs over their times.
    const double T = static_cast<double>(r.micro_batch) * r.seq_len(m), t = r.tp;
    const double h = m.n_embd, kv = static_cast<double>(m.kv_dim());
    const double F = static_cast<double>(m.ffn()) * (m.swiglu ? 2 : 1);
    std::vector<std::pair<double, double>> nk = {{(h + 2 * kv) / t, h},  // QKV
                                                 {h, h / t},             // attention output
                                                 {F / t, h},             // MLP in
                                                 {h, static_cast<double>(m.ffn()) / t}};  // MLP out
    if (last_stage) nk.push_back({m.vocab_size / t, h});  // the head
    double flops = 0, time = 0;
    for (const auto& [N, K] : nk)
        for (const auto& [a, b, c] :
             {std::array<double, 3>{T, N, K}, std::array<double, 3>{T, K, N},
              std::array<double, 3>{K, N, T}}) {
            const double f = 2 * a * b * c;
            flops += f;
            time += f / gemm_efficiency(a, b, c, elem_bytes, peak, g);
        }
    return flops / time;
}

TimeEstimate estimate_time(const ModelSpec& m, const RunSpec& r, const ClusterSpec& c) {
    TimeEstimate out;
    const GpuSpec& g = c.gpu;
    const double s = r.seq_len(m), b = r.micro_batch, h = m.n_embd;
    const double e = activation_bytes(r.precision);
    const StateBytes k = state_bytes(m, r);
    const int mb = r.micro_batches;
    const double peak = r.precision == Precision::fp32 ? g.peak_flops_fp32 : g.peak_flops;

    // GEMM efficiency by shape (gemm_efficiency): the block's GEMMs on this tp rank, the head's
    // on a single stage; attention and the rest of the step at the same rate.
    const double tokens = b * s;
    out.gemm_efficiency = block_gemm_efficiency(m, r, e, peak, g, r.pp == 1);

    // Placement: tp innermost, then dp, then pp (Megatron's rank order).
    const double tp_bw = r.tp <= c.gpus_per_node ? g.intra_node_bw : g.inter_node_bw;
    const double dp_bw = r.tp * r.dp <= c.gpus_per_node ? g.intra_node_bw : g.inter_node_bw;
    const double pp_bw = r.tp * r.dp * r.pp <= c.gpus_per_node ? g.intra_node_bw : g.inter_node_bw;

    // One micro-batch on one stage: its share of the layers, split over tp.
    double hw_flops = hardware_flops_per_token(m, r) * tokens / r.pp / r.tp;
    double t_compute = hw_flops / (peak * out.gemm_efficiency);
    // Megatron TP: 2 all-reduces forward, 2 backward (+2 when the forward is recomputed);
    // with sequence parallelism they become reduce-scatter + all-gather of the same volume.
    double layers = static_cast<double>(m.n_layer) / r.pp;
    double n_collectives = 4 + (r.recompute == Recompute::full ? 2 : 0);
    double t_tp = layers * n_collectives * ring_all_reduce_s(e * tokens * h, r.tp, tp_bw);
    double t_p2p = r.pp > 1 ? 2.0 * e * tokens * h / (r.sequence_parallel ? r.tp : 1) / pp_bw : 0;
    out.compute_s = mb * t_compute;
    out.tp_comm_s = mb * t_tp;
    out.pp_comm_s = mb * t_p2p;
    double t_micro = t_compute + t_tp + t_p2p;
    if (r.pp > 1) {
        // The executor's schedule, simulated (parallel/pipeline/schedule.h): p - 1 micro-batch
        // times of fill for GPipe and 1F1B, (p - 1) / v interleaved.
        const double fill = pp::uniform_fill(
            r.schedule, r.pp, mb, r.schedule == pp::Kind::Interleaved ? r.virtual_stages : 1);
        out.bubble_s = fill * t_micro;
        out.bubble_fraction = fill / mb;
    }

    // Data parallel: gradients of this GPU's parameters (per stage, per tp rank).
    MemoryEstimate mem = estimate_memory(m, r);
    double trainable = static_cast<double>(mem.trainable_on_gpu);
    double grad_bytes = trainable * k.grad;
    double param_bytes =
        mem.params_on_gpu *
        (r.lora_rank > 0 ? frozen_bytes_per_weight(r.frozen_bits, r.precision, r.fp32_master)
                         : k.param);
    double backward_last = t_compute * 2.0 / 3.0;
    if (r.zero >= 3) {
        // Every micro-batch gathers the weights twice (forward, backward) and reduce-scatters
        // the gradients; prefetching hides it behind that micro-batch's compute.
        double per_mb =
            2 * ring_gather_s(param_bytes, r.dp, dp_bw) + ring_gather_s(grad_bytes, r.dp, dp_bw);
        out.dp_comm_s = mb * std::max(0.0, per_mb - t_compute);
    } else {
        // One all-reduce (or reduce-scatter + all-gather for ZeRO-1/2) per step, overlapped with
        // the backward of the last micro-batch.
        double comm = ring_all_reduce_s(grad_bytes, r.dp, dp_bw);
        out.dp_comm_s = std::max(0.0, comm - backward_last);
    }

    double shard = trainable / (r.zero >= 1 ? r.dp : 1);
    if (r.offload == Offload::none) {
        // Memory bound: read params, grads, states; write params and states.
        out.optimizer_s = shard * (2 * k.param + k.grad + 2 * k.optim) / g.hbm_bandwidth;
    } else {
        out.optimizer_s = shard / c.cpu_adam_params_per_s;
        out.offload_s = shard * (k.grad + k.param) / g.pcie_bw;
        if (r.offload == Offload::optimizer_and_params)
            out.offload_s +=
                std::max(0.0, mb * 2.0 * param_bytes / r.dp / g.pcie_bw - out.compute_s);
    }

    out.step_s = out.compute_s + out.tp_comm_s + out.pp_comm_s + out.bubble_s + out.dp_comm_s +
                 out.optimizer_s + out.offload_s;
    double global_tokens = static_cast<double>(r.global_batch()) * s;
    out.tokens_per_s = global_tokens / out.step_s;
    double total_peak = peak * r.gpus();
    out.mfu = model_flops_per_token(m, r) * out.tokens_per_s / total_peak;
    out.hfu = hardware_flops_per_token(m, r) * out.tokens_per_s / total_peak;
    return out;
}

}  // namespace memtrain::plan
