// The key registry behind RunConfig: TOML parsing, --set overrides, printing, validation.
#include "config/run_config.h"

#include <toml++/toml.h>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/regular_file.h"

namespace memtrain {

namespace {

// What toml++ says about a parse error, without the bytes it saw there: the file may not be a
// TOML at all (a mistyped path to a secret), and an error message must not show its content.
std::string toml_error_text(std::string_view description) {
    std::string d(description);
    for (const char* cut : {", saw ", "; saw ", " saw "})
        if (auto at = d.find(cut); at != std::string::npos) d.resize(at);
    return d;
}

struct Key {
    std::string name;  // "section.key"
    std::string type;  // "integer" | "number" | "boolean" | "string"
    std::string doc;
    std::function<void(RunConfig&, const toml::node&, const std::string& src)> from_toml;
    std::function<void(RunConfig&, const std::string& text)> from_text;
    std::function<std::string(const RunConfig&)> to_text;  // TOML literal
};

template <typename T>
constexpr const char* type_name() {
    if constexpr (std::is_same_v<T, bool>)
        return "boolean";
    else if constexpr (std::is_integral_v<T>)
        return "integer";
    else if constexpr (std::is_floating_point_v<T>)
        return "number";
    else
        return "string";
}

std::string describe(const toml::node& n) {
    std::string v;
    n.visit([&](auto&& x) {
        std::ostringstream os;
        os << x;
        v = os.str();
    });
    switch (n.type()) {
        case toml::node_type::string:
            return "a string (" + v + ")";
        case toml::node_type::integer:
            return "an integer (" + v + ")";
        case toml::node_type::floating_point:
            return "a number (" + v + ")";
        case toml::node_type::boolean:
            return "a boolean (" + v + ")";
        case toml::node_type::table:
            return "a table";
        case toml::node_type::array:
            return "an array";
        default:
            return "a value of another type (" + v + ")";
    }
}

template <typename S, typename T>
Key make_key(std::string name, S RunConfig::*sec, T S::*field, std::string doc) {
    Key k;
    k.name = name;
    k.type = type_name<T>();
    k.doc = std::move(doc);
    k.from_toml = [=](RunConfig& c, const toml::node& n, const std::string& src) {
        T& dst = c.*sec.*field;
        auto bad = [&]() {
            fail("{}: {} must be {} {}, got {}", src, name, k.type == "integer" ? "an" : "a",
                 k.type, describe(n));
        };
        if constexpr (std::is_same_v<T, bool>) {
            if (!n.is_boolean()) bad();
            dst = n.as_boolean()->get();
        } else if constexpr (std::is_integral_v<T>) {
            if (!n.is_integer()) bad();
            int64_t v = n.as_integer()->get();
            if (v < (int64_t)std::numeric_limits<T>::min() ||
                (uint64_t)v > (uint64_t)std::numeric_limits<T>::max() ||
                (std::is_unsigned_v<T> && v < 0))
                fail("{}: {} = {} is out of range", src, name, v);
            dst = (T)v;
        } else if constexpr (std::is_floating_point_v<T>) {
            if (n.is_integer())
                dst = (T)n.as_integer()->get();
            else if (n.is_floating_point())
                dst = (T)n.as_floating_point()->get();
            else
                bad();
            // TOML has inf and nan literals; no key means anything by them, and a run with
            // optim.lr = inf turns every weight into NaN at its first step.
            if (!std::isfinite(dst)) fail("{}: {} = {} must be a finite number", src, name, dst);
        } else {
            if (!n.is_string()) bad();
            dst = n.as_string()->get();
        }
    };
    k.from_text = [=](RunConfig& c, const std::string& text) {
        // Parse the override as a TOML value; a bare word is taken as a string.
        toml::table t;
        check_toml_text("v = " + text, "--set " + name);
        try {
            t = toml::parse("v = " + text);
        } catch (const toml::parse_error&) {
            if constexpr (std::is_same_v<T, std::string>) {
                c.*sec.*field = text;
                return;
            } else {
                fail("--set {}={}: expected {} {}", name, text,
                     std::string(type_name<T>()) == "integer" ? "an" : "a", type_name<T>());
            }
        }
        if constexpr (std::is_same_v<T, std::string>) {
            if (!t["v"].is_string()) {
                c.*sec.*field = text;
                return;
            }
        }
        k.from_toml(c, *t.get("v"), "--set");
    };
    k.to_text = [=](const RunConfig& c) -> std::string {
        const T& v = c.*sec.*field;
        if constexpr (std::is_same_v<T, bool>)
            return v ? "true" : "false";
        else if constexpr (std::is_integral_v<T>)
            return fmt::format("{}", v);
        else if constexpr (std::is_floating_point_v<T>)
            return fmt::format("{}", v);
        else {
            std::ostringstream os;
            os << toml::value<std::string>(v);
            return os.str();
        }
    };
    return k;
}

// train.micro_batch_size also takes "auto" (TrainConfig::kAutoMicroBatch).
Key auto_micro_batch_key(Key k) {
    const auto int_toml = k.from_toml;
    const auto int_text = k.from_text;
    const auto int_to_text = k.to_text;
    k.from_toml = [=](RunConfig& c, const toml::node& n, const std::string& src) {
        if (n.is_string() && n.as_string()->get() == "auto") {
            c.train.micro_batch_size = TrainConfig::kAutoMicroBatch;
            return;
        }
        int_toml(c, n, src);
    };
    k.from_text = [=](RunConfig& c, const std::string& text) {
        if (text == "auto" || text == "\"auto\"" || text == "'auto'") {
            c.train.micro_batch_size = TrainConfig::kAutoMicroBatch;
            return;
        }
        int_text(c, text);
    };
    k.to_text = [=](const RunConfig& c) -> std::string {
        if (c.train.micro_batch_size == TrainConfig::kAutoMicroBatch) return "'auto'";
        return int_to_text(c);
    };
    return k;
}

const std::vector<Key>& registry() {
    using R = RunConfig;
    static const std::vector<Key> keys = {
        make_key("model.n_layer", &R::model, &ModelConfig::n_layer, "transformer blocks"),
        make_key("model.n_head", &R::model, &ModelConfig::n_head, "attention heads"),
        make_key("model.n_embd", &R::model, &ModelConfig::n_embd, "model width"),
        make_key("model.block_size", &R::model, &ModelConfig::block_size, "maximum context"),
        make_key("model.vocab_size", &R::model, &ModelConfig::vocab_size, "tokens"),
        make_key("model.vocab_pad", &R::model, &ModelConfig::vocab_pad,
                 "pad embedding rows to a multiple of this"),
        make_key("model.n_kv_head", &R::model, &ModelConfig::n_kv_head, "0 = n_head"),
        make_key("model.norm", &R::model, &ModelConfig::norm, "layernorm or rmsnorm"),
        make_key("model.activation", &R::model, &ModelConfig::activation, "gelu or swiglu"),
        make_key("model.positions", &R::model, &ModelConfig::positions, "learned or rope"),
        make_key("model.tied_embeddings", &R::model, &ModelConfig::tied_embeddings,
                 "output layer shares wte"),
        make_key("model.bias", &R::model, &ModelConfig::bias,
                 "linear layers have biases (false: Llama)"),
        make_key("model.ffn_hidden", &R::model, &ModelConfig::ffn_hidden,
                 "MLP hidden size (0 = 4 n_embd for gelu, 256-aligned 8 n_embd / 3 for swiglu)"),
        make_key("model.norm_eps", &R::model, &ModelConfig::norm_eps, "layernorm/rmsnorm eps"),
        make_key("model.rope_theta", &R::model, &ModelConfig::rope_theta, "rope base"),
        make_key("model.init_std", &R::model, &ModelConfig::init_std, "weight init std"),
        make_key("model.dropout", &R::model, &ModelConfig::dropout,
                 "dropout probability in training on the embedding, attention probabilities and "
                 "residual branches (0 = off; CPU engine)"),
        make_key("model.init_from", &R::model, &ModelConfig::init_from,
                 "weights to start from: a Hugging Face model directory, a memtrain checkpoint "
                 "or out_dir, or a .safetensors file (no other model.* key: the architecture is "
                 "the source's)"),
        make_key("model.init_partial", &R::model, &ModelConfig::init_partial,
                 "load only the tensors of model.init_from this model has (false: a source "
                 "holding others is refused)"),
        make_key("train.device", &R::train, &TrainConfig::device,
                 "cpu | cuda | auto (cuda where a GPU answers)"),
        make_key("train.precision", &R::train, &TrainConfig::precision,
                 "fp32 | bf16 | fp16 (fp32 master weights, loss scaling) | auto"),
        make_key("train.seq_len", &R::train, &TrainConfig::seq_len, "tokens per sequence"),
        make_key("train.batch_size", &R::train, &TrainConfig::batch_size,
                 "sequences per optimizer step"),
        make_key("train.batch_tokens", &R::train, &TrainConfig::batch_tokens,
                 "tokens per step; sets batch_size = batch_tokens / seq_len (0 = off)"),
        auto_micro_batch_key(make_key("train.micro_batch_size", &R::train,
                                      &TrainConfig::micro_batch_size,
                                      "sequences per forward/backward per rank (0 = batch_size / "
                                      "ranks; \"auto\": the largest that fits)")),
        make_key("train.max_steps", &R::train, &TrainConfig::max_steps, "optimizer steps"),
        make_key("train.seed", &R::train, &TrainConfig::seed, "init and data order"),
        make_key("train.eval_every", &R::train, &TrainConfig::eval_every,
                 "steps between validations (0 = end only)"),
        make_key("train.eval_batches", &R::train, &TrainConfig::eval_batches,
                 "micro-batches per validation"),
        make_key("train.log_every", &R::train, &TrainConfig::log_every, "steps between lines"),
        make_key("train.threads", &R::train, &TrainConfig::threads, "0 = all cores"),
        make_key("train.remat", &R::train, &TrainConfig::remat,
                 "none | full | every:K | sqrt | selective | budget:BYTES[+offload] | offload | "
                 "chen:K | memory-poor"),
        make_key(
            "train.remat_costs", &R::train, &TrainConfig::remat_costs,
            "price recompute by analytic FLOPs or a measured profiling pass: analytic | measured"),
        make_key("train.cpu_attention", &R::train, &TrainConfig::cpu_attention,
                 "what the CPU engine keeps for attention's backward: probs (B x heads x T x T) "
                 "| lse (B x heads x T log-sum-exps; the backward recomputes the probabilities)"),
        make_key("train.mlp_tile", &R::train, &TrainConfig::mlp_tile,
                 "the CPU engine's MLP over row tiles of this many token rows (0 = all at once): "
                 "a recomputed block holds one tile of its MLP activations"),
        make_key("train.cpu_activations", &R::train, &TrainConfig::cpu_activations,
                 "how the CPU engine stores saved activations: auto (bf16 under bf16 precision) "
                 "| fp32 | bf16 (rounded where made, half the bytes) | int8 (blocks of 256 with a "
                 "power-of-two scale, about a quarter)"),
        make_key("train.cuda_graphs", &R::train, &TrainConfig::cuda_graphs,
                 "cuda: replay each micro-batch's forward and backward as one CUDA graph"),
        make_key("train.diagnostics", &R::train, &TrainConfig::diagnostics,
                 "none | amp: gradient magnitude histograms against fp16 and bf16"),
        make_key("train.diagnostics_every", &R::train, &TrainConfig::diagnostics_every,
                 "steps between diagnostics"),
        make_key("train.offload_optimizer", &R::train, &TrainConfig::offload_optimizer,
                 "cuda: fp32 master weights, optimizer state and update on the CPU (ZeRO-Offload)"),
        make_key("train.zero_stage", &R::train, &TrainConfig::zero_stage,
                 "data-parallel sharding: 0 DDP | 1 optimizer | 2 + gradients | 3 + parameters"),
        make_key("train.pp", &R::train, &TrainConfig::pp,
                 "pipeline stages: mpirun -np PP runs one model split over PP ranks"),
        make_key("train.tp", &R::train, &TrainConfig::tp,
                 "tensor-parallel ranks (Megatron): mpirun -np TP splits every block's heads, MLP "
                 "and the vocabulary over TP ranks"),
        make_key("train.sequence_parallel", &R::train, &TrainConfig::sequence_parallel,
                 "Megatron sequence parallelism with train.tp > 1: norms and the residual stream "
                 "hold 1/TP of the tokens, all-gather / reduce-scatter in place of all-reduce"),
        make_key("train.pp_schedule", &R::train, &TrainConfig::pp_schedule,
                 "pipeline schedule: naive | gpipe | 1f1b | interleaved | zb-h1 | pipedream | "
                 "pipedream-2bw"),
        make_key("train.pp_virtual", &R::train, &TrainConfig::pp_virtual,
                 "interleaved: model chunks per pipeline rank (pp x pp_virtual virtual stages)"),
        make_key("train.dp_mode", &R::train, &TrainConfig::dp_mode,
                 "how data-parallel ranks combine gradients: allreduce | ps (parameter server)"),
        make_key("train.ps_servers", &R::train, &TrainConfig::ps_servers,
                 "ps: server ranks (the last ones), each holding a contiguous group of units"),
        make_key("train.ps_staleness", &R::train, &TrainConfig::ps_staleness,
                 "ps: workers compute on parameters at most this many steps old (0: synchronous)"),
        make_key("optim.name", &R::optim, &OptimConfig::name,
                 "adamw | sgd | muon (Muon on block matrices, AdamW on the rest) | adafactor "
                 "(factored second moment, relative step)"),
        make_key("optim.lr", &R::optim, &OptimConfig::lr, "peak learning rate"),
        make_key("optim.min_lr_ratio", &R::optim, &OptimConfig::min_lr_ratio, "final lr / peak lr"),
        make_key("optim.weight_decay", &R::optim, &OptimConfig::weight_decay,
                 "on matrices and embeddings"),
        make_key("optim.beta1", &R::optim, &OptimConfig::beta1, "AdamW"),
        make_key("optim.beta2", &R::optim, &OptimConfig::beta2, "AdamW"),
        make_key("optim.eps", &R::optim, &OptimConfig::eps, "AdamW"),
        make_key("optim.momentum", &R::optim, &OptimConfig::momentum, "SGD"),
        make_key("optim.nesterov", &R::optim, &OptimConfig::nesterov, "SGD"),
        make_key("optim.muon_lr", &R::optim, &OptimConfig::muon_lr,
                 "muon: peak lr of the block matrices"),
        make_key("optim.muon_momentum", &R::optim, &OptimConfig::muon_momentum,
                 "muon: momentum (Nesterov)"),
        make_key("optim.adafactor_beta2_decay", &R::optim, &OptimConfig::adafactor_beta2_decay,
                 "adafactor: 1 - beta2_t = t^decay"),
        make_key("optim.adafactor_clip", &R::optim, &OptimConfig::adafactor_clip,
                 "adafactor: the update's RMS threshold d"),
        make_key("optim.grad_clip", &R::optim, &OptimConfig::grad_clip, "global norm (0 = off)"),
        make_key("optim.state_format", &R::optim, &OptimConfig::state_format,
                 "moments stored as fp32 | bf16 | int8 | int4 (blocks with fp32 scales)"),
        make_key("optim.step_in_backward", &R::optim, &OptimConfig::step_in_backward,
                 "update each unit in the last backward (no gradient buffer)"),
        make_key("optim.step_in_backward_clip", &R::optim, &OptimConfig::step_in_backward_clip,
                 "its clipping: norm-pass (exact, one more forward and backward) | previous-norm "
                 "(the previous step's norm, no pass)"),
        make_key("optim.master", &R::optim, &OptimConfig::master,
                 "fp32 | none (bf16 weights, stochastic rounding)"),
        make_key("optim.schedule", &R::optim, &OptimConfig::schedule,
                 "constant | cosine | linear | wsd"),
        make_key("optim.warmup_steps", &R::optim, &OptimConfig::warmup_steps, "linear warmup"),
        make_key("optim.decay_fraction", &R::optim, &OptimConfig::decay_fraction,
                 "wsd: cooldown share of steps"),
        make_key("optim.cooldown", &R::optim, &OptimConfig::cooldown, "wsd: linear | 1-sqrt"),
        make_key("optim.lr_scaling", &R::optim, &OptimConfig::lr_scaling,
                 "none | linear | sqrt batch-size rule"),
        make_key("optim.lr_reference_batch", &R::optim, &OptimConfig::lr_reference_batch,
                 "tokens per step the lr was tuned for"),
        make_key("optim.loss_scale", &R::optim, &OptimConfig::loss_scale,
                 "fp16: initial dynamic loss scale"),
        make_key("optim.loss_scale_window", &R::optim, &OptimConfig::loss_scale_window,
                 "fp16: clean steps before the loss scale doubles"),
        make_key("data.train", &R::data, &DataConfig::train, "training token shard"),
        make_key("data.val", &R::data, &DataConfig::val, "validation token shard"),
        make_key("data.tokenizer", &R::data, &DataConfig::tokenizer, "tokenizer for samples"),
        make_key("io.out_dir", &R::io, &IoConfig::out_dir, "checkpoints and metrics"),
        make_key("io.checkpoint_every", &R::io, &IoConfig::checkpoint_every,
                 "steps between checkpoints (0 = final only)"),
        make_key("io.save_final", &R::io, &IoConfig::save_final, "checkpoint at the end"),
        make_key("io.keep_last", &R::io, &IoConfig::keep_last,
                 "checkpoints kept: the newest K (0 = all), besides io.keep_every's and those "
                 "holding a file named keep"),
        make_key("io.keep_every", &R::io, &IoConfig::keep_every,
                 "with io.keep_last: checkpoints at multiples of this many steps are kept too"),
        make_key("io.metrics", &R::io, &IoConfig::metrics, "JSONL metrics file in out_dir"),
        make_key("sample.prompt", &R::sample, &SampleConfig::prompt, "sample after training"),
        make_key("sample.max_tokens", &R::sample, &SampleConfig::max_tokens, "0 = no sample"),
        make_key("sample.temperature", &R::sample, &SampleConfig::temperature, "softmax temp"),
        make_key("sample.top_k", &R::sample, &SampleConfig::top_k, "0 = whole vocabulary"),
        make_key("guard.enabled", &R::guard, &GuardConfig::enabled,
                 "undo non-finite, spiking or exploding steps (roll back, skip the batch)"),
        make_key("guard.window", &R::guard, &GuardConfig::window,
                 "clean steps the loss median and spread are taken over"),
        make_key("guard.min_history", &R::guard, &GuardConfig::min_history,
                 "clean steps before spikes are judged"),
        make_key("guard.spike_z", &R::guard, &GuardConfig::spike_z,
                 "loss spike: robust z-score above the window's median"),
        make_key("guard.norm_factor", &R::guard, &GuardConfig::norm_factor,
                 "gradient norm explosion: multiple of the window's median norm"),
        make_key("guard.snapshot_every", &R::guard, &GuardConfig::snapshot_every,
                 "steps between rollback snapshots (out_dir/guard_snapshots)"),
        make_key("guard.lr_factor", &R::guard, &GuardConfig::lr_factor,
                 "a repeat within the window lowers the learning rate by this factor"),
        make_key("guard.cooldown", &R::guard, &GuardConfig::cooldown,
                 "steps at the lowered learning rate"),
        make_key("guard.max_rollbacks", &R::guard, &GuardConfig::max_rollbacks,
                 "rollbacks before the guard gives up"),
        make_key("lora.rank", &R::lora, &LoraConfig::rank,
                 "LoRA adapters of this rank, base frozen (0 = full-parameter training)"),
        make_key("lora.alpha", &R::lora, &LoraConfig::alpha, "adapter output scaled by alpha/rank"),
        make_key("lora.dropout", &R::lora, &LoraConfig::dropout, "on the adapter input"),
        make_key("lora.targets", &R::lora, &LoraConfig::targets,
                 "attn | all | comma-separated module suffixes (c_attn, q_proj, mlp.c_proj...)"),
        make_key("lora.base", &R::lora, &LoraConfig::base,
                 "frozen base storage: fp32 | int8 | int4 | nf4 (QLoRA)"),
        make_key("lora.base_group", &R::lora, &LoraConfig::base_group,
                 "int4 base: inputs per scale"),
    };
    return keys;
}

std::size_t edit_distance(const std::string& a, const std::string& b) {
    std::vector<std::size_t> prev(b.size() + 1), cur(b.size() + 1);
    for (std::size_t j = 0; j <= b.size(); j++) prev[j] = j;
    for (std::size_t i = 1; i <= a.size(); i++) {
        cur[0] = i;
        for (std::size_t j = 1; j <= b.size(); j++) {
            std::size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
            cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
        }
        std::swap(prev, cur);
    }
    return prev[b.size()];
}

std::string section_of(const std::string& name) {
    auto dot = name.find('.');
    return dot == std::string::npos ? std::string() : name.substr(0, dot);
}

std::string leaf_of(const std::string& name) {
    auto dot = name.find('.');
    return dot == std::string::npos ? name : name.substr(dot + 1);
}

const std::vector<std::string>& sections() {
    static const std::vector<std::string> out = [] {
        std::vector<std::string> v;
        for (const auto& k : registry())
            if (v.empty() || v.back() != section_of(k.name)) v.push_back(section_of(k.name));
        return v;
    }();
    return out;
}

bool is_section(const std::string& sec) {
    return std::find(sections().begin(), sections().end(), sec) != sections().end();
}

// The registered section a misspelt or longer one means ("trian", "optimizer", "training"), or
// "" when none is near.
std::string nearest_section(const std::string& sec) {
    std::string best;
    std::size_t best_d = SIZE_MAX;
    for (const auto& s : sections()) {
        std::size_t d = edit_distance(sec, s);
        // A prefix ("optim" of "optimizer", "train" of "training") is as good as a typo.
        if (sec.size() > s.size() && sec.compare(0, s.size(), s) == 0)
            d = std::min<std::size_t>(d, 1);
        if (d < best_d) {
            best_d = d;
            best = s;
        }
    }
    return best_d <= std::max<std::size_t>(2, sec.size() / 2) ? best : std::string();
}

// How far a key's name after the section is from what the user wrote: 0 the same, 1 when one
// holds the other ("steps" in "max_steps"), else the edit distance.
std::size_t leaf_cost(const std::string& a, const std::string& b) {
    if (a == b) return 0;
    if (std::min(a.size(), b.size()) >= 3 &&
        (a.find(b) != std::string::npos || b.find(a) != std::string::npos))
        return 1;
    return edit_distance(a, b);
}

// What users of other trainers type (Hugging Face's TrainingArguments, DeepSpeed's JSON,
// nanoGPT's train.py, Megatron's flags), by the name after any section: memtrain's key, and how
// it differs where it is not the same quantity.
struct PeerKey {
    const char* theirs;
    const char* ours;
    const char* note;
};
constexpr PeerKey kPeerKeys[] = {
    {"gradient_accumulation_steps", "train.micro_batch_size",
     "memtrain derives accumulation: train.batch_size / (train.micro_batch_size x data-parallel "
     "ranks)"},
    {"per_device_train_batch_size", "train.micro_batch_size", ""},
    {"train_micro_batch_size_per_gpu", "train.micro_batch_size", ""},
    {"train_batch_size", "train.batch_size", "sequences per optimizer step, all ranks together"},
    {"global_batch_size", "train.batch_size", ""},
    {"learning_rate", "optim.lr", ""},
    {"max_iters", "train.max_steps", ""},
    {"train_iters", "train.max_steps", ""},
    {"num_train_epochs", "train.max_steps", "memtrain counts optimizer steps, not epochs"},
    {"warmup_iters", "optim.warmup_steps", ""},
    {"lr_warmup_iters", "optim.warmup_steps", ""},
    {"lr_scheduler_type", "optim.schedule", ""},
    {"lr_decay_style", "optim.schedule", ""},
    {"max_grad_norm", "optim.grad_clip", ""},
    {"gradient_clipping", "optim.grad_clip", ""},
    {"clip_grad", "optim.grad_clip", ""},
    {"adam_beta1", "optim.beta1", ""},
    {"adam_beta2", "optim.beta2", ""},
    {"adam_epsilon", "optim.eps", ""},
    {"adam_eps", "optim.eps", ""},
    {"output_dir", "io.out_dir", ""},
    {"save_steps", "io.checkpoint_every", ""},
    {"save_interval", "io.checkpoint_every", ""},
    {"save_total_limit", "io.keep_last", ""},
    {"eval_steps", "train.eval_every", ""},
    {"eval_interval", "train.eval_every", ""},
    {"eval_iters", "train.eval_batches", ""},
    {"logging_steps", "train.log_every", ""},
    {"log_interval", "train.log_every", ""},
    {"bf16", "train.precision", "train.precision = \"bf16\""},
    {"fp16", "train.precision", "train.precision = \"fp16\""},
    {"dtype", "train.precision", "fp32, bf16 or fp16"},
    {"gradient_checkpointing", "train.remat", "train.remat = \"full\", or a schedule"},
    {"activations_checkpoint_method", "train.remat", ""},
    {"tensor_model_parallel_size", "train.tp", ""},
    {"pipeline_model_parallel_size", "train.pp", ""},
    {"num_layers", "model.n_layer", ""},
    {"hidden_size", "model.n_embd", ""},
    {"num_attention_heads", "model.n_head", ""},
    {"max_position_embeddings", "model.block_size", ""},
    {"seq_length", "train.seq_len", ""},
    {"max_seq_length", "train.seq_len", ""},
    {"dropout", "model.dropout", "one probability for every site (lora.dropout is LoRA's)"},
    {"attn_pdrop", "model.dropout", "one probability for attention, residual and embedding"},
    {"resid_pdrop", "model.dropout", "one probability for attention, residual and embedding"},
    {"embd_pdrop", "model.dropout", "one probability for attention, residual and embedding"},
    {"hidden_dropout", "model.dropout", ""},
    {"attention_dropout", "model.dropout", ""},
};

std::string unknown_key_message(const std::string& name, const std::string& src) {
    const std::string sec = section_of(name), leaf = leaf_of(name);
    for (const PeerKey& p : kPeerKeys) {
        if (leaf != p.theirs) continue;
        const std::string note = *p.note ? fmt::format(" ({})", p.note) : std::string();
        if (!*p.ours) return fmt::format("{}: unknown config key '{}'{}", src, name, note);
        return fmt::format("{}: unknown config key '{}'; memtrain's is '{}'{}", src, name, p.ours,
                           note);
    }
    const bool known_section = is_section(sec);
    const std::string meant_section = known_section ? sec
                                      : sec.empty() ? std::string()
                                                    : nearest_section(sec);
    // The nearest key over every section: the same name in another section ([train] lr means
    // optim.lr) costs one more than in the section meant, so the section only breaks ties.
    const Key* best = nullptr;
    std::size_t best_d = SIZE_MAX;
    for (const auto& k : registry()) {
        std::size_t d =
            leaf_cost(leaf, leaf_of(k.name)) + (section_of(k.name) == meant_section ? 0 : 1);
        if (d < best_d) {
            best_d = d;
            best = &k;
        }
    }
    const bool near = best && best_d <= std::max<std::size_t>(3, leaf.size() / 3 + 1);
    std::string why;
    if (sec.empty())
        why = " (keys go under a [section])";
    else if (!known_section)
        why = meant_section.empty()
                  ? fmt::format(" (there is no section [{}])", sec)
                  : fmt::format(" (there is no section [{}]; the section is [{}])", sec,
                                meant_section);
    else if (near && section_of(best->name) != sec && leaf_of(best->name) == leaf)
        why = fmt::format(" ({} is a key of [{}], not of [{}])", leaf, section_of(best->name), sec);
    if (near)
        return fmt::format("{}: unknown config key '{}'; did you mean '{}'?{}", src, name,
                           best->name, why);
    return fmt::format(
        "{}: unknown config key '{}'{} (see `memtrain train --help-keys` for the "
        "list)",
        src, name, why);
}

[[noreturn]] void unknown_key(const std::string& name, const std::string& src) {
    fail("{}", unknown_key_message(name, src));
}

const Key* lookup_key(const std::string& name) {
    for (const auto& k : registry())
        if (k.name == name) return &k;
    return nullptr;
}

const Key& find_key(const std::string& name, const std::string& src) {
    if (const Key* k = lookup_key(name)) return *k;
    unknown_key(name, src);
}

// `set` receives the names of the keys the table set.
void apply_table(RunConfig& cfg, const toml::table& root, const std::string& src,
                 std::vector<std::string>* set = nullptr) {
    // Every unknown key of the file at once, one line each (a user fixing a converted config
    // should not meet them one run at a time).
    std::vector<std::string> unknown;
    for (const auto& [sec_key, sec_node] : root) {
        std::string sec(sec_key.str());
        if (!sec_node.is_table()) {
            // A top-level key is always unknown (every key lives in a section). A quoted
            // "io.save_final" is one key whose name holds a dot, not save_final in [io]: it
            // names a registered key, so say how to write it (found by fuzz_config; it went on
            // to bind a reference to the null table below).
            for (const auto& k : registry())
                if (k.name == sec)
                    fail(
                        "{}: \"{}\" is quoted as one key name at the top level; write {} = ... "
                        "without the quotes, or {} = ... under [{}]",
                        src, sec, sec, leaf_of(sec), section_of(sec));
            unknown.push_back(unknown_key_message(sec, src));
            continue;
        }
        const toml::table& table = *sec_node.as_table();
        // An unknown section holding no keys would otherwise pass unnoticed.
        if (table.empty() && !is_section(sec)) {
            std::string meant = nearest_section(sec);
            fail("{}: unknown config section [{}]{}", src, sec,
                 meant.empty() ? std::string(" (see `memtrain train --help-keys` for the list)")
                               : fmt::format("; did you mean [{}]?", meant));
        }
        for (const auto& [key, node] : table) {
            std::string name = sec + "." + std::string(key.str());
            const Key* k = lookup_key(name);
            if (!k) {
                unknown.push_back(unknown_key_message(name, src));
                continue;
            }
            k->from_toml(cfg, node, src);
            if (set) set->push_back(name);
        }
    }
    if (unknown.size() == 1) fail("{}", unknown[0]);
    if (!unknown.empty())
        fail("{} unknown config keys (see `memtrain train --help-keys` for the list):\n  {}",
             unknown.size(), fmt::join(unknown, "\n  "));
}

// Paths in a config file are relative to that file, so a config works from any directory.
void resolve_relative(std::string& path, const std::filesystem::path& base) {
    if (!path.empty() && std::filesystem::path(path).is_relative())
        path = (base / path).lexically_normal().string();
}

// The field of a path key, or null.
std::string* path_field(RunConfig& c, const std::string& name) {
    if (name == "data.train") return &c.data.train;
    if (name == "data.val") return &c.data.val;
    if (name == "data.tokenizer") return &c.data.tokenizer;
    if (name == "model.init_from") return &c.model.init_from;
    return nullptr;
}

// Defaults (or `base`), then the TOML text, then the overrides, each over the one before. With
// `file_dir`, relative paths the text sets are taken from the file's directory and those the
// overrides set from the working directory, both made absolute, so the config a checkpoint saves
// resumes from any directory.
RunConfig parse_layers(const std::string& text, const std::string& src,
                       const std::vector<std::string>& overrides, const RunConfig* base,
                       const std::filesystem::path* file_dir, std::vector<std::string>* given) {
    RunConfig cfg = base ? *base : RunConfig{};
    check_toml_text(text, src);
    toml::table root;
    try {
        root = toml::parse(text, src);
    } catch (const toml::parse_error& e) {
        fail("{}:{}:{}: invalid TOML: {}", src, e.source().begin.line, e.source().begin.column,
             toml_error_text(e.description()));
    }
    std::vector<std::string> from_file, from_sets;
    apply_table(cfg, root, src, &from_file);
    for (const auto& o : overrides) {
        auto eq = o.find('=');
        if (eq == std::string::npos || eq == 0)
            fail("--set {}: expected section.key=value, e.g. --set train.max_steps=100", o);
        std::string name = o.substr(0, eq);
        find_key(name, "--set").from_text(cfg, o.substr(eq + 1));
        from_sets.push_back(name);
    }
    if (file_dir) {
        // An override of a path the file also set wins, relative to the working directory.
        const auto file_base = file_dir->empty() ? std::filesystem::current_path()
                                                 : std::filesystem::absolute(*file_dir);
        for (const auto& name : from_file)
            if (std::string* p = path_field(cfg, name);
                p && !std::count(from_sets.begin(), from_sets.end(), name))
                resolve_relative(*p, file_base);
        for (const auto& name : from_sets)
            if (std::string* p = path_field(cfg, name))
                resolve_relative(*p, std::filesystem::current_path());
    }
    auto set_here = [&](const char* name) {
        return std::count(from_file.begin(), from_file.end(), name) +
                   std::count(from_sets.begin(), from_sets.end(), name) >
               0;
    };
    // Over a base, a batch_size given here replaces the base's batch_tokens, which would
    // otherwise recompute batch_size below.
    if (base && set_here("train.batch_size") && !set_here("train.batch_tokens"))
        cfg.train.batch_tokens = 0;
    if (cfg.train.batch_tokens != 0) {
        if (cfg.train.batch_tokens < 0 || cfg.train.seq_len <= 0 ||
            cfg.train.batch_tokens % cfg.train.seq_len != 0)
            fail("train.batch_tokens = {} must be a positive multiple of train.seq_len = {}",
                 cfg.train.batch_tokens, cfg.train.seq_len);
        const int64_t sequences = cfg.train.batch_tokens / cfg.train.seq_len;
        if (sequences > INT32_MAX)
            fail(
                "train.batch_tokens = {} is {} sequences of train.seq_len = {}: more than the {} "
                "a step holds at most",
                cfg.train.batch_tokens, sequences, cfg.train.seq_len, INT32_MAX);
        cfg.train.batch_size = (int)sequences;
    }
    if (given) {
        *given = from_file;
        given->insert(given->end(), from_sets.begin(), from_sets.end());
    }
    return cfg;
}

}  // namespace

void check_toml_text(std::string_view text, const std::string& src) {
    if (text.size() > kMaxConfigBytes)
        fail("{} is {} bytes, more than the {} bytes a config may be", src, text.size(),
             kMaxConfigBytes);
    // toml++ recurses once per part of a dotted key or table name, and once per level of
    // nested arrays and inline tables, so a 100 KB file of a.a.a... overflows the stack. Keys
    // here have two parts; the scan bounds both before the parser sees the text. Outside
    // strings and comments, the dots between two of = , [ ] { } and a newline are one key's
    // parts (a number or a date has at most one).
    constexpr int kMaxParts = 32, kMaxNesting = 32;
    int dots = 0, nesting = 0, line = 1;
    std::size_t i = 0;
    const std::size_t n = text.size();
    auto starts = [&](std::size_t at, std::string_view s) {
        return text.substr(at, s.size()) == s;
    };
    // TOML allows no raw control character but tab and the line ends, in strings and comments
    // too (toml++ asserts on some of them in its key parser).
    auto control = [&](char ch) {
        if (((unsigned char)ch < 0x20 && ch != '\t' && ch != '\n' && ch != '\r') || ch == 0x7f)
            fail("{}:{}: a control character (byte 0x{:02x}) is not allowed in TOML", src, line,
                 (unsigned)(unsigned char)ch);
    };
    // At the start of a line, a '[' opens a table header. toml++'s key parser assumes the
    // header's first character starts a key (an assertion in its debug builds, an assumption
    // the optimizer may act on in clang-built ones), so that is checked here.
    bool line_start = true;
    auto header_start = [&](std::size_t at) {
        auto skip_blank = [&] {
            while (at < n && (text[at] == ' ' || text[at] == '\t')) at++;
        };
        at++;  // the '['
        skip_blank();
        if (at < n && text[at] == '[') {
            at++;
            skip_blank();
        }
        const char k = at < n ? text[at] : '\0';
        if (!(std::isalnum((unsigned char)k) || k == '_' || k == '-' || k == '"' || k == '\''))
            fail("{}:{}: a table name must start with a letter, a digit, _, - or a quote", src,
                 line);
    };
    while (i < n) {
        const char c = text[i];
        control(c);
        // Outside strings and comments TOML is ASCII (bare keys, numbers, whitespace); toml++
        // classifies other characters there with a table that reaches __builtin_unreachable
        // for some (U+0360, for one).
        if ((unsigned char)c >= 0x80)
            fail("{}:{}: a non-ASCII character outside a string or a comment", src, line);
        if (c == '[' && line_start && nesting == 0) header_start(i);
        if (c != ' ' && c != '\t') line_start = c == '\n';
        if (c == '#') {  // a comment, to the end of the line
            while (i < n && text[i] != '\n') control(text[i++]);
            continue;
        }
        if (c == '"' || c == '\'') {
            const bool multi = starts(i, c == '"' ? "\"\"\"" : "'''");
            const std::string_view close =
                multi ? (c == '"' ? "\"\"\"" : "'''") : std::string_view(&text[i], 1);
            i += multi ? 3 : 1;
            bool closed = false;
            while (i < n) {
                if (starts(i, close)) {
                    closed = true;
                    break;
                }
                control(text[i]);
                if (text[i] == '\n') {
                    if (!multi) break;  // an unterminated string: the parser reports it
                    line++;
                }
                if (c == '"' && text[i] == '\\') i++;  // an escape: skip the escaped character
                i++;
            }
            if (closed) i += close.size();
            continue;
        }
        switch (c) {
            case '\n':
                line++;
                [[fallthrough]];
            case '=':
            case ',':
                dots = 0;
                break;
            case '[':
            case '{':
                dots = 0;
                if (++nesting > kMaxNesting)
                    fail("{}:{}: arrays, tables or inline tables nested more than {} deep", src,
                         line, kMaxNesting);
                break;
            case ']':
            case '}':
                dots = 0;
                nesting = std::max(0, nesting - 1);
                break;
            case '.':
                if (++dots >= kMaxParts)
                    fail(
                        "{}:{}: a key or table name of more than {} dotted parts; memtrain's keys "
                        "have two (section.key)",
                        src, line, kMaxParts);
                break;
            default:
                break;
        }
        i++;
    }
}

RunConfig parse_run_config(const std::string& text, const std::string& src,
                           const std::vector<std::string>& overrides, const RunConfig* base) {
    return parse_layers(text, src, overrides, base, nullptr, nullptr);
}

RunConfig read_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const RunConfig* base, std::vector<std::string>* given) {
    std::string text;
    if (!path.empty()) {
        std::error_code ec;
        const auto st = std::filesystem::status(path, ec);
        if (std::filesystem::is_directory(st)) {
            const auto p = std::filesystem::path(path);
            const bool run_dir = std::filesystem::exists(p / "latest", ec) ||
                                 std::filesystem::exists(p / "model.safetensors", ec);
            fail(
                "config {} is a directory; memtrain train expects a TOML file (e.g. "
                "configs/demo.toml){}",
                path,
                run_dir ? fmt::format(". To continue the run saved there: memtrain train "
                                      "--resume {}",
                                      path)
                        : std::string());
        }
        // A FIFO or /dev/zero is refused before it is opened; a config is a few KB.
        text = read_regular_file(path, kMaxConfigBytes, "config file");
    }
    const auto dir = std::filesystem::path(path).parent_path();
    return parse_layers(text, path.empty() ? "<defaults>" : path, overrides, base, &dir, given);
}

std::string to_toml(const RunConfig& cfg) {
    std::string out = "# memtrain resolved config\n";
    std::string section;
    for (const auto& k : registry()) {
        std::string sec = k.name.substr(0, k.name.find('.'));
        if (sec != section) {
            out += fmt::format("\n[{}]\n", sec);
            section = sec;
        }
        out += fmt::format("{} = {}\n", k.name.substr(sec.size() + 1), k.to_text(cfg));
    }
    return out;
}

std::string format_table(const RunConfig& cfg, int width) {
    // One block per section, key=value pairs wrapped to `width` columns: every value of the run
    // in a dozen lines (the TOML form, one key a line, is to_toml).
    const std::size_t indent = 7;  // "sample "
    std::string out, line;
    std::string section;
    auto flush = [&]() {
        if (!line.empty()) out += line + "\n";
        line.clear();
    };
    for (const auto& k : registry()) {
        const std::string sec = section_of(k.name);
        std::string value = k.to_text(cfg);
        // Quotes only where a string needs them to be read (empty, or with spaces).
        if (value.size() > 2 && (value.front() == '"' || value.front() == '\'') &&
            value.find_first_of(" \\'\"=", 1) == value.size() - 1)
            value = value.substr(1, value.size() - 2);
        const std::string item = leaf_of(k.name) + "=" + value;
        if (sec != section) {
            flush();
            section = sec;
            line = fmt::format("{:<{}}{}", sec, indent, item);
        } else if (line.size() + 1 + item.size() > (std::size_t)width) {
            flush();
            line = std::string(indent, ' ') + item;
        } else {
            line += " " + item;
        }
    }
    flush();
    return out;
}

std::string config_value(const RunConfig& cfg, const std::string& key) {
    return find_key(key, "config_value").to_text(cfg);
}

std::vector<std::string> config_keys() {
    std::vector<std::string> names;
    for (const auto& k : registry()) names.push_back(k.name + "  (" + k.type + ")  " + k.doc);
    return names;
}

}  // namespace memtrain
