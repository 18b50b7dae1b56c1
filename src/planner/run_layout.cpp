// Parsers, validation and per-parameter byte counts for RunSpec.
// The byte table is the ZeRO paper's accounting (mixed-precision Adam: 2 + 2 + 12 = 16 bytes),
// extended to fp32, bf16-only, SGD with momentum and 8-bit Adam states.
#include "planner/run_layout.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <fmt/ranges.h>

#include "core/error.h"
#include "optim/optimizer.h"
#include "parallel/data/tensor_gather.h"
#include "planner/nearest.h"

namespace memtrain::plan {

namespace {

template <typename E>
E parse_enum(const char* what, const std::string& s,
             const std::vector<std::pair<std::string, E>>& table) {
    std::vector<std::string> names;
    for (const auto& [name, value] : table) {
        if (name == s) return value;
        names.push_back(name);
    }
    fail("unknown {} \"{}\"; did you mean \"{}\"? (one of {})", what, s, nearest_name(s, names),
         fmt::format("{}", fmt::join(names, ", ")));
}

}  // namespace

Precision parse_precision(const std::string& s, bool* fp32_master) {
    *fp32_master = s != "bf16-only";
    return parse_enum<Precision>("precision", s,
                                 {{"bf16", Precision::bf16},
                                  {"fp16", Precision::fp16},
                                  {"fp32", Precision::fp32},
                                  {"bf16-only", Precision::bf16}});
}

Optimizer parse_optimizer(const std::string& s) {
    return parse_enum<Optimizer>("optimizer", s,
                                 {{"adamw", Optimizer::adamw},
                                  {"sgd", Optimizer::sgd},
                                  {"adamw8bit", Optimizer::adamw8bit},
                                  {"muon", Optimizer::muon},
                                  {"adafactor", Optimizer::adafactor}});
}

Recompute parse_recompute(const std::string& s) {
    return parse_enum<Recompute>("recompute policy", s,
                                 {{"none", Recompute::none},
                                  {"selective", Recompute::selective},
                                  {"full", Recompute::full}});
}

pp::Kind parse_schedule(const std::string& s) {
    return parse_enum<pp::Kind>("pipeline schedule", s,
                                {{"1f1b", pp::Kind::OneFOneB},
                                 {"gpipe", pp::Kind::GPipe},
                                 {"interleaved", pp::Kind::Interleaved},
                                 {"zb-h1", pp::Kind::ZbH1}});
}

Offload parse_offload(const std::string& s) {
    return parse_enum<Offload>("offload", s,
                               {{"none", Offload::none},
                                {"optimizer", Offload::optimizer},
                                {"params", Offload::optimizer_and_params}});
}

LoraTargets parse_lora_targets(const std::string& s) {
    return parse_enum<LoraTargets>("LoRA targets", s,
                                   {{"attn", LoraTargets::attn}, {"all", LoraTargets::all}});
}

namespace {
std::string runtime_plain_only(const RunSpec& r) {
    return fmt::format(
        "--runtime {} prices plain full-parameter training (no offload, LoRA, compressed moments "
        "or step in backward); those are memtrain's",
        to_string(r.runtime));
}
}  // namespace

std::string runtime_layout_refusal(const RunSpec& r) {
    if (r.runtime == Runtime::memtrain) return "";
    if (r.offload != Offload::none) return runtime_plain_only(r);
    if (r.runtime == Runtime::pytorch && (r.zero > 0 || r.tp > 1 || r.pp > 1))
        return "--runtime pytorch prices DDP (ZeRO-0, no tp or pp); use --runtime deepspeed for "
               "ZeRO or megatron for tp and pp";
    if (r.runtime == Runtime::deepspeed && r.zero == 0)
        return "--runtime deepspeed prices ZeRO 1-3; use --runtime pytorch for plain DDP";
    if (r.runtime == Runtime::megatron && r.zero > 1)
        return "--runtime megatron shards the optimizer state at most (its distributed "
               "optimizer, ZeRO-1); use --runtime deepspeed for ZeRO 2-3";
    return "";
}

bool trainer_runs(const RunSpec& run) {
    return run.offload != Offload::optimizer_and_params;
}

const char* precision_label(Precision p, bool fp32_master) {
    return p == Precision::bf16 && !fp32_master ? "bf16-only" : precision_name(p);
}
const char* to_string(Optimizer o) {
    switch (o) {
        case Optimizer::adamw:
            return "adamw";
        case Optimizer::sgd:
            return "sgd";
        case Optimizer::adamw8bit:
            return "adamw8bit";
        case Optimizer::muon:
            return "muon";
        case Optimizer::adafactor:
            return "adafactor";
    }
    return "?";
}
const char* to_string(Recompute r) {
    switch (r) {
        case Recompute::none:
            return "none";
        case Recompute::selective:
            return "selective";
        case Recompute::full:
            return "full";
    }
    return "?";
}
std::string to_string(pp::Kind s) {
    return pp::kind_name(s);
}
const char* to_string(Offload o) {
    switch (o) {
        case Offload::none:
            return "none";
        case Offload::optimizer:
            return "optimizer";
        case Offload::optimizer_and_params:
            return "params";
    }
    return "?";
}

const char* to_string(LoraTargets t) {
    return t == LoraTargets::all ? "all" : "attn";
}

Runtime parse_runtime(const std::string& s) {
    return parse_enum<Runtime>("runtime", s,
                               {{"memtrain", Runtime::memtrain},
                                {"pytorch", Runtime::pytorch},
                                {"deepspeed", Runtime::deepspeed},
                                {"megatron", Runtime::megatron}});
}

const char* to_string(Runtime r) {
    switch (r) {
        case Runtime::memtrain:
            return "memtrain";
        case Runtime::pytorch:
            return "pytorch";
        case Runtime::deepspeed:
            return "deepspeed";
        case Runtime::megatron:
            return "megatron";
    }
    return "?";
}

std::string describe_method(const RunSpec& r) {
    if (r.lora_rank <= 0) {
        const std::string weights =
            !r.fp32_master && r.precision != Precision::fp32 ? ", bf16 weights" : "";
        return r.state_format == StateFormat::Fp32
                   ? "full-parameter training" + weights
                   : fmt::format("full-parameter training{}, {} moments", weights,
                                 state_format_name(r.state_format));
    }
    if (r.frozen_bits == 16) return fmt::format("LoRA r={}", r.lora_rank);
    return fmt::format("QLoRA {}-bit r={}", r.frozen_bits, r.lora_rank);
}

StateBytes state_bytes(Precision precision, bool fp32_master, Optimizer optimizer,
                       StateFormat format) {
    // Optimizer bytes: Adam keeps two moments, SGD one, each in its storage format (8-bit Adam:
    // int8 with a scale per 256). Mixed precision adds a 4-byte fp32 master copy of the weights
    // unless !fp32_master (optim.master = "none"; `--precision bf16-only` also stores the moments
    // in bf16 unless --state-format says otherwise, plan_cmd.cpp).
    const double moments = optimizer == Optimizer::sgd         ? 1
                           : optimizer == Optimizer::adafactor ? 0
                                                               : 2;
    if (optimizer == Optimizer::adamw8bit) format = StateFormat::Int8;
    const double states = moments * moment_bytes_per_param(format);
    // fp32 without a master: the CPU engine's optim.master = "none", bf16 weights computed in fp32.
    if (precision == Precision::fp32) return {fp32_master ? 4.0 : 2.0, 4, states};
    if (!fp32_master) return {2, 2, states};
    return {2, 2, 4 + states, 4};
}

StateBytes state_bytes(const RunSpec& r) {
    return state_bytes(r.precision, r.fp32_master, r.optimizer, r.state_format);
}

double muon_matrix_fraction(const ModelSpec& m) {
    const ParamLayout layout = make_param_layout(config_from_model(m));
    const std::vector<char> matrix = muon_matrices(layout);
    std::size_t n = 0;
    for (std::size_t i = 0; i < matrix.size(); i++)
        if (matrix[i]) n += layout.tensors[i].numel;
    return layout.total ? (double)n / (double)layout.total : 0.0;
}

double muon_scratch_bytes(const ModelSpec& m) {
    const ParamLayout layout = make_param_layout(config_from_model(m));
    const std::vector<char> matrix = muon_matrices(layout);
    double numel = 0, gram = 0;
    for (std::size_t i = 0; i < matrix.size(); i++) {
        if (!matrix[i]) continue;
        const ParamSpec& t = layout.tensors[i];
        const double r = (double)std::min(t.global_shape()[0], t.global_shape()[1]);
        numel = std::max(numel, (double)t.global_numel());
        gram = std::max(gram, r * r);
    }
    return 4.0 * 2 * (numel + gram) + 8;
}

double adafactor_cut_scratch_bytes(const ModelSpec& m, int dp, int elem_bytes) {
    if (dp < 2) return 0;
    const ParamLayout layout = make_param_layout(config_from_model(m));
    OptimConfig adafactor;
    adafactor.name = "adafactor";
    std::size_t largest = 0;
    for (const dist::TensorCut& c :
         dist::cut_tensors(layout, dist::padded_shard_ranges((int64_t)layout.total, dp),
                           whole_step_tensors(adafactor, layout)))
        largest = std::max(largest, layout.tensors[c.tensor].numel);
    return (double)largest * (2.0 * elem_bytes + 4);
}

double adafactor_bytes_per_param(const ModelSpec& m) {
    const ParamLayout layout = make_param_layout(config_from_model(m));
    return layout.total ? 4.0 * (double)adafactor_state_floats(layout, 0, layout.total) /
                              (double)layout.total
                        : 0.0;
}

StateBytes state_bytes(const ModelSpec& m, const RunSpec& r) {
    StateBytes k = state_bytes(r);
    if (r.optimizer == Optimizer::adafactor) k.optim += adafactor_bytes_per_param(m);
    if (r.optimizer == Optimizer::muon) {
        const double moments = k.optim - k.master;  // two, as AdamW's
        k.optim = k.master + moments / 2 * (2 - muon_matrix_fraction(m));
    }
    return k;
}

int activation_bytes(Precision precision) {
    return precision == Precision::fp32 ? 4 : 2;
}

double frozen_bytes_per_weight(int frozen_bits, Precision precision, bool fp32_master) {
    switch (frozen_bits) {
        case 8:
            return 1;
        case 4:
            return (4 + 8.0 / 64 + 32.0 / (64 * 256)) / 8;
        default:
            return state_bytes(precision, fp32_master, Optimizer::adamw).param;
    }
}

void validate_run(const ModelSpec& m, const RunSpec& r) {
    if (r.dp < 1 || r.tp < 1 || r.pp < 1)
        fail("parallel degrees must be >= 1, got dp={} tp={} pp={}", r.dp, r.tp, r.pp);
    if (m.n_head % r.tp != 0) {
        std::vector<int> ok;
        for (int t = 1; t <= m.n_head && t <= 64; ++t)
            if (m.n_head % t == 0) ok.push_back(t);
        fail(
            "tensor parallel degree {} does not divide the {} attention heads of {}; use one of "
            "{}",
            r.tp, m.n_head, m.name, fmt::format("{}", fmt::join(ok, ", ")));
    }
    if (m.kv_heads() % r.tp != 0 && r.tp % m.kv_heads() != 0)
        fail(
            "tensor parallel degree {} neither divides nor is a multiple of the {} key/value "
            "heads of {}",
            r.tp, m.kv_heads(), m.name);
    if (r.pp > m.n_layer)
        fail("pipeline degree {} exceeds the {} layers of {}", r.pp, m.n_layer, m.name);
    if (r.zero < 0 || r.zero > 3) fail("ZeRO stage must be 0, 1, 2 or 3, got {}", r.zero);
    if (r.micro_batch < 1) fail("micro-batch must be >= 1, got {}", r.micro_batch);
    if (r.micro_batches < 1) fail("micro-batches per step must be >= 1, got {}", r.micro_batches);
    if (r.seq < 0) fail("sequence length must be positive, got {}", r.seq);
    if (!m.rope && r.seq_len(m) > m.block_size)
        fail("sequence length {} exceeds the {} learned positions of {}", r.seq_len(m),
             m.block_size, m.name);
    if (r.runtime != Runtime::memtrain &&
        (r.lora_rank > 0 || r.step_in_backward || r.state_format != StateFormat::Fp32 ||
         r.optimizer == Optimizer::adamw8bit))
        fail("{}", runtime_plain_only(r));
    if (const std::string why = runtime_layout_refusal(r); !why.empty()) fail("{}", why);
    if (r.offload == Offload::optimizer_and_params && r.zero != 3)
        fail(
            "offloading parameters needs ZeRO-3 (got ZeRO-{}); use --zero 3 or --offload "
            "optimizer",
            r.zero);
    if (r.offload == Offload::optimizer && r.zero == 0 && r.dp > 1)
        fail(
            "offloading the optimizer with dp={} needs ZeRO >= 1 (each rank updates its shard on "
            "its host; without sharding every rank would repeat the whole update); add --zero 2",
            r.dp);
    if (r.zero >= 2 && r.pp > 1)
        fail(
            "ZeRO-{} with pipeline parallelism is not supported (gradients are needed on every "
            "micro-batch); use ZeRO-1 with pp={}",
            r.zero, r.pp);
    if (r.schedule == pp::Kind::Interleaved) {
        if (r.pp < 2 || r.virtual_stages < 2)
            fail("the interleaved schedule needs pp >= 2 and --virtual-stages >= 2");
        // Uneven chunks are allowed (Llama 3 405B runs 126 layers this way); at least one layer
        // per chunk is not optional.
        if (m.n_layer < r.pp * r.virtual_stages)
            fail("interleaved schedule: {} layers cannot fill pp={} x virtual stages={} chunks",
                 m.n_layer, r.pp, r.virtual_stages);
    }
    if (r.lora_rank < 0) fail("LoRA rank must be >= 0, got {}", r.lora_rank);
    if (r.frozen_bits != 16 && r.frozen_bits != 8 && r.frozen_bits != 4)
        fail("frozen weight bits must be 16, 8 or 4, got {}", r.frozen_bits);
    if (r.frozen_bits != 16 && r.lora_rank == 0)
        fail("quantized frozen weights ({} bits) need LoRA (--lora-rank > 0)", r.frozen_bits);
    if (r.fragmentation < 0 || r.fragmentation > 1)
        fail("fragmentation margin must be within 0..1, got {}", r.fragmentation);
}

}  // namespace memtrain::plan
