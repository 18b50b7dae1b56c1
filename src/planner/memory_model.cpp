// Per-GPU memory: model states by precision/optimizer, placed by the ZeRO table
// (parallel/placement.h) and split by TP/PP; for layouts the CPU engines run, element counts and
// activations from their own layout functions (planner/rank_layout.h, planner/stage_activations.h),
// otherwise per-layer counts and Korthikanti et al. 2022's activations times the micro-batches in
// flight; logits, buckets, ZeRO-3 gather buffers, reserve and a fragmentation margin as separate
// lines.
#include "planner/memory_model.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "model/param_layout.h"
#include "parallel/placement.h"
#include "planner/rank_layout.h"
#include "planner/stage_activations.h"

namespace memtrain::plan {

namespace {

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}
int64_t to_bytes(double x) {
    return static_cast<int64_t>(std::ceil(x));
}

int layers_for_stage(const ModelSpec& m, const RunSpec& r, int stage) {
    return m.n_layer / r.pp + (stage < m.n_layer % r.pp ? 1 : 0);
}

// Micro-batches whose activations are alive at once on `stage`: the executor's schedule,
// simulated (parallel/pipeline/schedule.h; GPipe m, 1F1B min(p - s, m), interleaved chunks counted
// as 1/v).
double in_flight(const RunSpec& r, int stage) {
    if (r.pp == 1) return 1;
    const int v = r.schedule == pp::Kind::Interleaved ? r.virtual_stages : 1;
    return pp::uniform_in_flight(r.schedule, r.pp, r.micro_batches, v).at(stage);
}

std::string gb(double bytes) {
    return fmt::format("{:.2f} GB", bytes / 1e9);
}

}  // namespace

int64_t MemoryEstimate::bytes(std::string_view name) const {
    for (const auto& l : lines)
        if (l.name == name) return l.bytes;
    return 0;
}

int64_t MemoryEstimate::model_states() const {
    return bytes("parameters") + bytes("gradients") + bytes("optimizer states");
}

int64_t lora_params_per_layer(const ModelSpec& m, int rank, LoraTargets targets) {
    const int64_t h = m.n_embd, kv = m.kv_dim(), f = m.ffn();
    auto adapter = [&](int64_t fan_in, int64_t fan_out) { return rank * (fan_in + fan_out); };
    int64_t params;
    if (m.is_llama()) {
        params = adapter(h, h) + 2 * adapter(h, kv) + adapter(h, h);  // q, k, v, o
        if (targets == LoraTargets::all) params += 2 * adapter(h, f) + adapter(f, h);
    } else {
        params = adapter(h, h + 2 * kv) + adapter(h, h);  // c_attn [q | k | v], c_proj
        if (targets == LoraTargets::all)  // c_fc ([gate | up] for SwiGLU), mlp.c_proj
            params += adapter(h, (m.swiglu ? 2 : 1) * f) + adapter(f, h);
    }
    return params;
}

LayerActivations layer_activation_bytes(const ModelSpec& m, const RunSpec& r) {
    const int64_t s = r.seq_len(m), b = r.micro_batch, h = m.n_embd, a = m.n_head;
    const int64_t kv = m.kv_dim(), f = m.ffn(), t = r.tp;
    const int64_t e = activation_bytes(r.precision);
    const int64_t sbh = s * b * h;
    // Outside the tensor-parallel region (replicated over tp unless sequence parallel):
    // the two norm inputs, the two norm outputs feeding QKV and the MLP, and the two dropout
    // masks (1 byte each). For GPT-3 in bf16 this is Korthikanti's 10sbh.
    int64_t outside = 4 * e * sbh + (m.dropout ? 2 * sbh : 0);
    // Inside (split over tp): Q and K for QK^T, V for the attention-weighted sum, the
    // out-projection input, and the MLP's hidden activations (24sbh for GPT-3).
    int64_t inside = e * s * b * (h + 2 * kv) + e * sbh + (m.swiglu ? 3 : 2) * e * s * b * f;
    // Attention scores: softmax output (+ dropout mask and output): 5as^2b in bf16.
    int64_t scores = a * s * s * b * (e + (m.dropout ? 1 + e : 0));
    // Flash attention keeps only a fp32 log-sum-exp per head and token instead of the scores.
    int64_t flash_stats = 4 * a * s * b;
    int64_t attn_extra = r.flash_attention ? flash_stats : scores;
    int64_t full =
        (r.sequence_parallel ? ceil_div(outside, t) : outside) + ceil_div(inside + attn_extra, t);
    LayerActivations out;
    out.full = full;
    switch (r.recompute) {
        case Recompute::none:
            out.saved = full;
            break;
        case Recompute::selective:  // attention core recomputed: the s^2 term goes
            out.saved =
                full - ceil_div(attn_extra, t) + (r.flash_attention ? ceil_div(flash_stats, t) : 0);
            break;
        case Recompute::full:  // only the layer input survives the forward pass
            out.saved = r.sequence_parallel ? ceil_div(e * sbh, t) : e * sbh;
            break;
    }
    return out;
}

namespace {

// Whose arena the layout path prices: the whole model's, or the tensor-parallel shard's
// (sequence-parallel: its sequence regions hold this rank's token rows only).
std::string shard_note(const RunSpec& r) {
    if (r.tp == 1) return "";
    return fmt::format(" of the tp = {}{} shard", r.tp,
                       r.sequence_parallel ? " sequence-parallel" : "");
}

// What the layout path says about activations, for the table.
std::string layout_detail(const PipelineActivations& pa, const RunSpec& r, int T, int stage) {
    const RankActivations& ra = pa.ranks[stage];
    const std::string format =
        pa.format.cuda
            ? fmt::format("GPU arena: fused attention, {}-byte activations", pa.format.elem_bytes)
            : fmt::format("CPU arena: attention probabilities, {}-byte activations",
                          pa.format.elem_bytes);
    const std::string arena = fmt::format(
        "plan_stage_arena (activation_layout) of blocks {}{}, {} x {} tokens, remat {}, {}",
        ra.block_ranges(), shard_note(r), r.micro_batch, T, remat_label(r), format);
    if (ra.chunks.size() == 1)
        return fmt::format("{} micro-batches in flight ({}) x {:.1f} MB, {}", ra.slots[0],
                           pp::kind_name(pa.schedule.kind), ra.arena[0] / 1e6, arena);
    std::string slots;
    for (std::size_t c = 0; c < ra.chunks.size(); c++)
        slots += fmt::format("{}{} x {:.1f} MB", c ? " + " : "", ra.slots[c], ra.arena[c] / 1e6);
    return fmt::format("micro-batches in flight per chunk ({}): {}, {}",
                       pp::kind_name(pa.schedule.kind), slots, arena);
}

MemoryEstimate stage_memory(const ModelSpec& m, const RunSpec& r, RankCoord at,
                            const PipelineActivations* pa) {
    const int stage = at.stage;
    MemoryEstimate est;
    est.stage = stage;
    est.replica = at.replica;
    est.engine_layout = uses_engine_layout(m, r);
    const bool first = stage == 0, last = stage == r.pp - 1;
    // The layout path's stage holds the trainer's split; the formulas split the layers evenly.
    const int layers = pa ? pa->ranks.at(stage).total_blocks : layers_for_stage(m, r, stage);
    est.layers_on_stage = layers;
    const int64_t t = r.tp, d = r.dp;
    const int64_t s = r.seq_len(m), b = r.micro_batch;
    const int64_t e = activation_bytes(r.precision);
    const StateBytes k = state_bytes(m, r);
    const dist::ShardSpec spec = dist::shard_spec(r.zero, r.offload != Offload::none,
                                                  r.offload == Offload::optimizer_and_params);

    // Parameters on this GPU: weight matrices and column-parallel biases are split over tp,
    // norms and row-parallel biases are replicated; the token table is vocab-parallel.
    int64_t layer_split = ceil_div(m.layer_matrix_params() + m.layer_split_bias_params(), t);
    int64_t layer_repl = m.layer_replicated_params();
    int64_t matrices = layers * ceil_div(m.layer_matrix_params(), t);
    int64_t params = layers * (layer_split + layer_repl);
    const int64_t tok = static_cast<int64_t>(m.vocab_size) * m.n_embd;
    if (first) params += ceil_div(tok, t) + (m.rope ? 0 : int64_t{m.block_size} * m.n_embd);
    if (last) {
        params += m.n_embd * (m.rmsnorm ? 1 : 2);
        // An untied head, or with pp > 1 the last stage's copy of a tied embedding (Megatron).
        if (!m.tied_embeddings || !first) params += ceil_div(tok, t);
    }

    // Trainable vs frozen: under LoRA only the adapters get gradients and optimizer states;
    // frozen weight matrices may be stored quantized.
    int64_t trainable = params, frozen_matrix = 0, frozen_other = 0;
    const double frozen_bytes = frozen_bytes_per_weight(r.frozen_bits, r.precision, r.fp32_master);
    if (r.lora_rank > 0) {
        trainable = layers * ceil_div(lora_params_per_layer(m, r.lora_rank, r.lora_targets), t);
        frozen_matrix = matrices;
        frozen_other = params - matrices;
    }
    // Elements of each state this rank holds (wherever the shard table puts them): from the
    // engines' layout and the balanced ZeRO shard where they run the layout, else the formulas
    // above split evenly over dp.
    double param_n, grad_n, opt_n;
    std::string count_detail;
    bool rs_buffer = false;  // the gradients include ZeRO-1's reduce-scattered piece
    if (est.engine_layout) {
        const RankStates rs = rank_states(m, r, at, pa ? &pa->split : nullptr);
        params = trainable = rs.params;
        const int64_t unsharded = rs.params - rs.optimized;  // a pipeline's embedding copy
        param_n = (double)dist::held(spec.params, rs.params, rs.shard + unsharded);
        grad_n =
            (double)(dist::held(spec.grads, rs.params, rs.shard + unsharded) + rs.reduce_buffer);
        opt_n = (double)dist::held(spec.optimizer, rs.optimized, rs.shard);
        count_detail = ", " + rs.source;
        rs_buffer = rs.reduce_buffer > 0;
    } else {
        param_n = (double)params * dist::held_fraction(spec.params, r.dp);
        grad_n = (double)trainable * dist::held_fraction(spec.grads, r.dp);
        opt_n = (double)trainable * dist::held_fraction(spec.optimizer, r.dp);
    }
    est.params_on_gpu = params;
    est.trainable_on_gpu = trainable;
    auto zero_note = [&](dist::Placement p) {
        return dist::sharded(p) && d > 1 ? fmt::format(" / {} (ZeRO-{})", d, r.zero)
                                         : std::string();
    };
    double param_bytes;
    std::string param_detail;
    if (r.lora_rank > 0) {
        param_bytes = (frozen_matrix * frozen_bytes + (frozen_other + trainable) * k.param) *
                      dist::held_fraction(spec.params, r.dp);
        const std::string storage = r.frozen_bits == 16  ? fmt::format("at {:g} B", k.param)
                                    : r.frozen_bits == 8 ? "in int8"
                                                         : "in NF4, 4.127 bits";
        param_detail = fmt::format("{:.3f}B frozen (matrices {}) + {:.1f}M LoRA r={} ({}) x {} B",
                                   (frozen_matrix + frozen_other) / 1e9, storage, trainable / 1e6,
                                   r.lora_rank, to_string(r.lora_targets), k.param);
    } else {
        param_bytes = param_n * k.param;
        param_detail = fmt::format("{:.3f}B params x {} B{}", params / 1e9, k.param, count_detail);
    }
    param_detail += zero_note(spec.params);
    std::string grad_detail = fmt::format(
        "{:.3f}B x {} B{}{}", trainable / 1e9, k.grad, zero_note(spec.grads),
        rs_buffer ? " + the reduce-scattered piece (ZeRO-1 in the pipeline engine)" : "");
    if (r.step_in_backward && r.micro_batches == 1) {
        // Each unit's gradient lives from its backward to its update (parallel/data/zero_store.h):
        // the embedding's (tied: open from the head's backward) and the largest other unit's;
        // LoRA's, one block's adapters. ZeRO 2-3 keep no shard (their buckets are priced as
        // communication).
        if (r.zero >= 2) {
            grad_n = 0;
            grad_detail = "none (step in backward, no shard)";
        } else if (r.lora_rank > 0) {
            grad_n = (double)ceil_div(trainable, layers);
            grad_detail = fmt::format("one block's adapters, {:.1f}M x {} B (step in backward)",
                                      grad_n / 1e6, k.grad);
        } else {
            const ModelConfig rc = rank_config(m, r);
            grad_n =
                (double)step_in_backward_grad_floats(make_param_layout(rc), rc.tied_embeddings);
            grad_detail = fmt::format(
                "{} unit, {:.1f}M x {} B (step in backward)",
                rc.tied_embeddings ? "the embedding + the largest other" : "the largest",
                grad_n / 1e6, k.grad);
        }
    }
    double grad_bytes = grad_n * k.grad;
    double opt_bytes = opt_n * k.optim;
    // Muon's Newton-Schulz scratch beside its state (the largest matrix's, whole on every rank);
    // Adafactor's under GPU ZeRO, where every rank gathers each tensor the shards cut.
    const bool device_states =
        r.device_optimizer && r.lora_rank == 0 && !dist::offloaded(spec.optimizer);
    const double ns =
        !device_states                   ? 0
        : r.optimizer == Optimizer::muon ? muon_scratch_bytes(m)
        : r.optimizer == Optimizer::adafactor && dist::sharded(spec.optimizer)
            ? adafactor_cut_scratch_bytes(m, r.dp, r.precision == Precision::fp32 ? 4 : 2)
            : 0;
    opt_bytes += ns;
    std::string opt_detail = fmt::format(
        "{:.3f}B x {:.4g} B ({} {}{}){}{}", trainable / 1e9, k.optim,
        precision_label(r.precision, r.fp32_master), to_string(r.optimizer),
        r.state_format == StateFormat::Fp32
            ? std::string()
            : fmt::format(", {} moments", state_format_name(r.state_format)),
        ns > 0
            ? fmt::format(" + {} scratch {:.1f} MiB",
                          r.optimizer == Optimizer::muon ? "Newton-Schulz" : "cut tensors' gather",
                          ns / 1048576.0)
            : std::string(),
        zero_note(spec.optimizer));
    if (dist::offloaded(spec.optimizer)) {
        // ZeRO-Offload as memtrain's engine runs it (src/engine/cuda/cuda_engine.cpp): the
        // gradients stay on the GPU, where the backward writes and accumulates them (their ZeRO
        // shard from stage 2), and stream down after the last micro-batch. The host holds, for this
        // GPU's shard of the optimizer: fp32 master weights, the moments, the fp32 gradients the
        // update reads and the pinned buffer the transfers go through (a parameter's bytes).
        // Without the fp32 master (bf16-only) the host reads the device's bf16 weights through
        // the pinned buffer and steps them a chunk of at most 2^18 floats at a time.
        const double moments = k.optim - k.master;
        const double master = r.fp32_master || r.precision == Precision::fp32 ? 4 : 0;
        const double host_per_param = master + moments + 4 + k.param;
        const double scratch = master > 0 ? 0 : 4.0 * std::min(opt_n, 262144.0);
        const double host = opt_n * host_per_param + scratch;
        est.cpu_bytes += to_bytes(host);
        opt_detail = fmt::format(
            "offloaded: {} host = {:.3f}B x {:g} B ({} + moments {:g} + fp32 grads 4 + pinned "
            "transfer {:g}){}",
            gb(host), trainable / 1e9, host_per_param,
            master > 0 ? "fp32 master 4" : "no master, a 1 MiB update scratch", moments, k.param,
            zero_note(spec.optimizer));
        opt_bytes = 0;
    }
    if (dist::offloaded(spec.params)) {
        est.cpu_bytes += to_bytes(param_bytes);
        param_detail = "offloaded: " + gb(param_bytes) + " host = " + param_detail;
        param_bytes = 0;
    }

    // Activations: per layer per micro-batch, times layers and micro-batches in flight; or the
    // engine's arena of the stage's blocks times the micro-batches its schedule holds (the
    // layout has no dropout masks: model.dropout hashes them).
    LayerActivations la = layer_activation_bytes(m, r);
    est.in_flight = in_flight(r, stage);
    double act;
    std::string act_detail;
    // Without a pipeline, a run the engines run is their arena (which holds its recompute
    // scratch: no separate working set).
    const bool arena = !pa && uses_engine_arena(m, r);
    if (pa) {
        act = static_cast<double>(pa->ranks[stage].bytes);
        act_detail = layout_detail(*pa, r, static_cast<int>(s), stage);
    } else if (arena) {
        act = static_cast<double>(arena_activation_bytes(m, r));
        const ActFormat f = arena_format(rank_config(m, r), r);
        act_detail = fmt::format(
            "plan_arena (activation_layout){} of {} blocks, {} x {} tokens, remat {}, {} arena, "
            "{}-byte activations",
            shard_note(r), layers, b, s, remat_label(r),
            f.cuda ? "GPU (fused attention)" : "CPU (attention probabilities)", f.elem_bytes);
    } else {
        act = static_cast<double>(la.saved) * layers * est.in_flight;
        // The embedding's dropout mask (the embedding output itself is layer 0's input).
        if (first && m.dropout)
            act += static_cast<double>(s * b * m.n_embd) / (r.sequence_parallel ? t : 1);
        act_detail = fmt::format(
            "{} layers x {} micro-batches x {:.1f} MB ({} recompute, {}{}) "
            "(Korthikanti's formulas: no engine runs this layout)",
            layers, est.in_flight, la.saved / 1e6, to_string(r.recompute),
            r.flash_attention ? "flash" : "no flash", r.sequence_parallel ? ", SP" : "");
    }
    // Zero bubble (ZB-H1): each micro-batch in flight also keeps, per layer, the output gradients
    // of its four GEMMs until the deferred weight-gradient pass (d(mlp out) and d(attn out)
    // b s h, d(fc out) b s ffn (x2 for SwiGLU gate and up), d(qkv) b s (h + 2 kv_dim)),
    // in the activation dtype, split over tp as the GEMMs are.
    double zb = 0;
    if (r.pp > 1 && r.schedule == pp::Kind::ZbH1) {
        const double h = m.n_embd, fc = (double)m.ffn() * (m.swiglu ? 2 : 1);
        const double qkv = h + 2.0 * (double)m.kv_dim();
        zb = (double)s * b * (2 * h + fc + qkv) / t * e * layers * est.in_flight;
    }
    // Full recomputation rebuilds one layer's activations during its backward (the layout path
    // has it already: the arena's recompute scratch).
    int64_t working = r.recompute == Recompute::full && !pa && !arena ? la.full : 0;
    // Logits in the activation dtype, their fp32 softmax and the fp32 gradient.
    int64_t logits =
        last ? ceil_div(s * b * static_cast<int64_t>(m.vocab_size), t) * (e + 4 + 4) : 0;
    // Gradient buckets: two in flight while backward overlaps with the all-reduce.
    int64_t buckets = 0;
    if (d > 1) buckets = std::min<int64_t>(2 * r.bucket_bytes, to_bytes(trainable * k.grad));
    // ZeRO-3 gathers the current layer and prefetches the next one in full (per tp rank); with
    // the parameters offloaded, one GPU also fetches them from the host into such buffers.
    int64_t gather = 0;
    if (r.zero >= 3 && (d > 1 || r.offload == Offload::optimizer_and_params))
        gather =
            to_bytes(2.0 * (layer_split + layer_repl) * (r.lora_rank > 0 ? frozen_bytes : k.param));

    // A peer's runtime (--runtime): its own layout of the states and the buffers it keeps at
    // its defaults, in place of memtrain's planned ones (docs/planner.md, "Runtime profiles").
    double runtime_bytes = 0;
    std::string runtime_detail = "none beyond the lines above (memtrain plans its buffers)";
    std::string bucket_detail =
        buckets ? fmt::format("2 x {:.0f} MB all-reduce buckets", r.bucket_bytes / 1e6)
                : "no data-parallel all-reduce";
    const bool mixed = r.precision != Precision::fp32;
    const double kElem = 5e8;  // DeepSpeed's reduce_bucket_size and allgather_bucket_size
    if (r.runtime == Runtime::pytorch) {
        // torch.amp: the fp32 parameters are the master weights and their .grad is fp32; the
        // optimizer holds the moments only. autocast's 16-bit casts of the weights are saved
        // for the backward. DDP's buckets hold a copy of every gradient unless
        // gradient_as_bucket_view=True (its default is False).
        param_bytes = param_n * 4;
        param_detail =
            fmt::format("{:.3f}B params x 4 B (torch.amp: fp32 parameters)", params / 1e9);
        grad_bytes = grad_n * 4;
        grad_detail = fmt::format("{:.3f}B x 4 B (fp32 .grad)", trainable / 1e9);
        opt_bytes = opt_n * (k.optim - k.master);
        opt_detail = fmt::format("{:.3f}B x {:g} B ({} moments, no separate master)",
                                 trainable / 1e9, k.optim - k.master, to_string(r.optimizer));
        if (mixed) {
            runtime_bytes = param_n * e;
            runtime_detail =
                fmt::format("autocast's {}-byte weight casts, saved for the backward", e);
        }
        if (d > 1) {
            buckets = to_bytes(grad_n * 4);
            bucket_detail = "DDP buckets: a copy of every gradient (gradient_as_bucket_view=False)";
        }
    } else if (r.runtime == Runtime::deepspeed) {
        // ZeRO's 16-bit gradients reduce through a bucket of reduce_bucket_size elements; the
        // shard's reduced gradients are copied to fp32 for the step; stages 1-2 all-gather the
        // updated parameters in allgather_bucket_size pieces, stage 3 prefetches
        // stage3_prefetch_bucket_size (5e7) elements ahead.
        buckets = to_bytes(std::min(kElem, (double)trainable) * k.grad);
        bucket_detail = "reduce_bucket_size 5e8 elements (DeepSpeed's default), or the model";
        const double fp32_grads = mixed ? opt_n * 4 : 0;
        const double gather_bucket = r.zero < 3 ? std::min(kElem, (double)params) * k.param
                                                : std::min(5e7, (double)params) * k.param;
        runtime_bytes = fp32_grads + gather_bucket;
        runtime_detail = fmt::format(
            "{}{}",
            mixed ? fmt::format("fp32 copy of the gradient shard {}; ", gb(fp32_grads)) : "",
            r.zero < 3
                ? fmt::format("allgather_bucket_size 5e8 elements {}", gb(gather_bucket))
                : fmt::format("stage3_prefetch_bucket_size 5e7 elements {}", gb(gather_bucket)));
    } else if (r.runtime == Runtime::megatron) {
        // Megatron-LM accumulates and all-reduces bf16 gradients in fp32 (main_grad; it sets
        // accumulate_allreduce_grads_in_fp32 with --bf16), in one contiguous buffer that the
        // collectives reduce in place.
        if (r.precision == Precision::bf16) {
            grad_bytes = grad_n * 4;
            grad_detail = fmt::format("{:.3f}B x 4 B (fp32 main_grad, as Megatron-LM's --bf16)",
                                      trainable / 1e9);
        }
        buckets = 0;
        bucket_detail = "none: the gradient buffer is reduced in place";
        runtime_detail = "none beyond its gradient buffer (the gradients line)";
    }
    auto add = [&](std::string name, double bytes, std::string detail) {
        est.lines.push_back({std::move(name), to_bytes(bytes), std::move(detail)});
    };
    add("parameters", param_bytes, param_detail);
    add("gradients", grad_bytes, grad_detail);
    add("optimizer states", opt_bytes, opt_detail);
    add("activations", act, act_detail);
    if (zb > 0)
        add("zero-bubble W gradients", zb,
            fmt::format("{} layers x {} micro-batches: the GEMMs' output gradients kept until W",
                        layers, est.in_flight));
    add("recompute working set", working,
        working ? "one layer rebuilt during its backward"
        : (pa || arena) && (r.recompute != Recompute::none || !r.block_plan.empty())
            ? "in the activations: the arena's recompute scratch"
            : "no full recompute");
    add("logits and loss", logits,
        last ? fmt::format("{} tokens x {} vocab / tp {} x {} B", s * b, m.vocab_size, t, e + 8)
             : "not on this stage");
    add("gradient buckets", buckets, bucket_detail);
    add("zero-3 gather buffer", gather, gather ? "current + prefetched layer" : "not ZeRO-3");
    add("runtime buffers", runtime_bytes,
        r.runtime == Runtime::memtrain
            ? runtime_detail
            : fmt::format("{}: {}", to_string(r.runtime), runtime_detail));
    add("runtime reserve", static_cast<double>(r.reserve_bytes),
        "CUDA context, cuBLAS/NCCL workspaces");
    int64_t subtotal = 0;
    for (const auto& l : est.lines) subtotal += l.bytes;
    add("fragmentation margin", (subtotal - r.reserve_bytes) * r.fragmentation,
        fmt::format("{:.0f}% of the above", r.fragmentation * 100));
    for (const auto& l : est.lines) est.total += l.bytes;
    est.not_included = {"NCCL internal buffers beyond the reserve",
                        "input/target token buffers and data loader",
                        "memory of other processes on the GPU"};
    return est;
}

std::vector<int64_t> stage_activation_bytes(const PipelineActivations& pa) {
    std::vector<int64_t> out;
    for (const RankActivations& ra : pa.ranks) out.push_back(static_cast<int64_t>(ra.bytes));
    return out;
}

}  // namespace

MemoryEstimate estimate_rank_memory(const ModelSpec& m, const RunSpec& r, RankCoord at) {
    m.validate();
    validate_run(m, r);
    if (at.stage < 0 || at.stage >= r.pp || at.replica < 0 || at.replica >= r.dp)
        fail("rank (stage {}, replica {}) is not in a layout of pp = {} x dp = {}", at.stage,
             at.replica, r.pp, r.dp);
    if (!uses_stage_layout(m, r)) return stage_memory(m, r, at, nullptr);
    const PipelineActivations pa = pipeline_activations(m, r);
    MemoryEstimate est = stage_memory(m, r, at, &pa);
    est.stage_activations = stage_activation_bytes(pa);
    return est;
}

MemoryEstimate estimate_stage_memory(const ModelSpec& m, const RunSpec& r, int stage) {
    return estimate_rank_memory(m, r, RankCoord{stage, 0});
}

MemoryEstimate estimate_memory(const ModelSpec& m, const RunSpec& r) {
    m.validate();
    validate_run(m, r);
    // Replica 0 holds the largest ZeRO piece (shard_ranges gives the remainder to the first).
    if (uses_stage_layout(m, r)) {
        // Every stage: the split balances compute, so any stage may hold the most.
        const PipelineActivations pa = pipeline_activations(m, r);
        MemoryEstimate best = stage_memory(m, r, RankCoord{0, 0}, &pa);
        for (int s = 1; s < r.pp; s++) {
            MemoryEstimate e = stage_memory(m, r, RankCoord{s, 0}, &pa);
            if (e.total > best.total) best = std::move(e);
        }
        best.stage_activations = stage_activation_bytes(pa);
        return best;
    }
    MemoryEstimate best = stage_memory(m, r, RankCoord{0, 0}, nullptr);
    if (r.pp > 1) {
        MemoryEstimate lastst = stage_memory(m, r, RankCoord{r.pp - 1, 0}, nullptr);
        if (lastst.total > best.total) best = std::move(lastst);
    }
    return best;
}

}  // namespace memtrain::plan
