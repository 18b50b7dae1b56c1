// The run config's checks across keys (see validate.h).
#include "train/validate.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>

#include <fmt/format.h>

#include "core/cuda_backend.h"
#include "core/device.h"
#include "core/error.h"
#include "io/model_source.h"
#include "kernels/cpu/act_int8.h"
#include "kernels/cpu/gemm.h"
#include "model/lora.h"
#include "optim/state_format.h"
#include "parallel/pipeline/schedule.h"
#include "parallel/tensor/tp.h"
#include "remat/policy.h"

namespace memtrain {

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides,
                          const RunConfig* base) {
    std::vector<std::string> given;
    RunConfig cfg = read_run_config(path, overrides, base, &given);
    // A new run from model.init_from that describes no model takes the source's architecture
    // (a resume has its checkpoint's); model.dropout is a training choice, not architecture.
    const bool model_given = std::any_of(given.begin(), given.end(), [](const std::string& k) {
        return k.rfind("model.", 0) == 0 && k != "model.init_from" && k != "model.init_partial" &&
               k != "model.dropout";
    });
    if (!base && !cfg.model.init_from.empty() && !model_given)
        cfg.model = init_source_model(cfg.model);
    // So that `--set train.pp=2` or `train.dp_mode=ps` is not refused for want of ranks a file
    // cannot know about.
    cfg.world = cfg.min_world();
    validate_config(cfg);
    cfg.world = 1;
    return cfg;
}

std::vector<std::string> config_warnings(const RunConfig& cfg) {
    std::vector<std::string> out;
    if (cfg.train.max_steps > 0 && cfg.optim.warmup_steps >= cfg.train.max_steps)
        out.push_back(fmt::format(
            "optim.warmup_steps = {} is not below train.max_steps = {}: the learning rate warms up "
            "for the whole run and never reaches optim.lr = {}",
            cfg.optim.warmup_steps, cfg.train.max_steps, cfg.optim.lr));
    const int64_t mb = (int64_t)cfg.micro_batch() * cfg.dp();
    if (cfg.train.pp > 1 && mb > 0 && cfg.train.batch_size / mb < cfg.train.pp) {
        const int64_t m = cfg.train.batch_size / mb;
        out.push_back(fmt::format(
            "train.pp = {} stages with {} micro-batch{} per step: the pipeline never fills and "
            "idles at least {:.0f}% of the step ((p - 1) / (m + p - 1)); raise train.batch_size "
            "or lower train.micro_batch_size to give it at least {} micro-batches",
            cfg.train.pp, m, m == 1 ? "" : "es",
            100.0 * (cfg.train.pp - 1) / (double)(m + cfg.train.pp - 1), cfg.train.pp));
    }
    if (cfg.lora.enabled() && cfg.model.init_from.empty())
        out.push_back(fmt::format(
            "LoRA (lora.rank = {}) without model.init_from: the adapters train over a randomly "
            "initialised base model; set model.init_from to the pretrained weights",
            cfg.lora.rank));
    if (cfg.optim.name == "adafactor" && cfg.optim.lr < 5e-3)
        out.push_back(fmt::format(
            "optim.name = \"adafactor\" with optim.lr = {}: Adafactor's step is relative (min(lr, "
            "1/sqrt(t)) times each tensor's RMS), so an AdamW-sized learning rate barely moves "
            "the weights; PyTorch's default is 1e-2 and the demo trains at 3e-2 "
            "(docs/training.md, \"Adafactor\")",
            cfg.optim.lr));
    return out;
}

void resolve_config(RunConfig& cfg) {
    if (cfg.train.device == "auto") cfg.train.device = cuda_available() ? "cuda" : "cpu";
    if (cfg.train.precision == "auto")
        cfg.train.precision = cfg.train.device == "cuda" || cpu::cpu_has_bf16() ? "bf16" : "fp32";
    cfg.model.lse_attention = cfg.train.cpu_attention == "lse";
    cfg.model.mlp_tile = cfg.train.device == "cpu" ? cfg.train.mlp_tile : 0;
    set_cpu_bf16(cfg);
}

SavedStore cpu_saved_activations(const TrainConfig& train, const std::string& precision) {
    if (train.cpu_activations == "int8") return SavedStore::int8;
    if (train.cpu_activations == "bf16" || (train.cpu_activations == "auto" && precision == "bf16"))
        return SavedStore::bf16;
    return SavedStore::fp32;
}

void set_cpu_bf16(RunConfig& cfg) {
    const bool cpu = cfg.train.device == "cpu";
    cfg.model.cpu_bf16 = cpu && cfg.train.precision == "bf16";
    cfg.model.saved_activations =
        cpu ? cpu_saved_activations(cfg.train, cfg.train.precision) : SavedStore::fp32;
}

void validate_pipeline(const RunConfig& cfg) {
    if (cfg.train.pp < 1) fail("train.pp = {} must be >= 1 (1: no pipeline)", cfg.train.pp);
    if (cfg.train.pp > cfg.model.n_layer)
        fail("train.pp = {} stages for model.n_layer = {} blocks: every stage needs a block",
             cfg.train.pp, cfg.model.n_layer);
    const pp::Kind kind = pp::parse_kind(cfg.train.pp_schedule);  // names the valid ones
    if (cfg.train.pp_virtual < 1)
        fail("train.pp_virtual = {} must be >= 1 (1: one chunk of the model per rank)",
             cfg.train.pp_virtual);
    if (cfg.train.pp_virtual > 1 && kind != pp::Kind::Interleaved)
        fail(
            "train.pp_virtual = {} needs train.pp_schedule = \"interleaved\", not \"{}\" (set "
            "train.pp_virtual = 1)",
            cfg.train.pp_virtual, cfg.train.pp_schedule);
    if (cfg.train.pp_virtual > 1 && cfg.train.pp == 1)
        fail("train.pp_virtual = {} needs a pipeline: set train.pp > 1", cfg.train.pp_virtual);
    if ((int64_t)cfg.train.pp * cfg.train.pp_virtual > cfg.model.n_layer)
        fail(
            "train.pp x train.pp_virtual = {} x {} virtual stages for model.n_layer = {} blocks: "
            "every stage needs a block",
            cfg.train.pp, cfg.train.pp_virtual, cfg.model.n_layer);
    if (cfg.train.pp == 1) return;
    if (cfg.world % cfg.train.pp != 0)
        fail("train.pp = {} does not divide the {} ranks: start mpirun -np {} (or a multiple)",
             cfg.train.pp, cfg.world, cfg.train.pp);
    // (The micro-batch arithmetic itself is checked after this.)
    const int64_t mb = (int64_t)cfg.micro_batch() * cfg.dp();
    const bool whole_batches = mb > 0 && cfg.train.batch_size % mb == 0;  // accum_steps() is exact
    if (kind == pp::Kind::PipeDream || kind == pp::Kind::PipeDream2BW) {
        if (kind == pp::Kind::PipeDream && cfg.model.tied_embeddings)
            fail(
                "train.pp_schedule = \"pipedream\" updates each stage at its own backward, so a "
                "tied embedding would be two versions on the first and last stage: set "
                "model.tied_embeddings = false (or use \"pipedream-2bw\")");
        if (kind == pp::Kind::PipeDream && cfg.optim.grad_clip > 0)
            fail(
                "train.pp_schedule = \"pipedream\" updates each stage at its own backward, before "
                "the other stages have that micro-batch's gradient: set optim.grad_clip = 0 (now "
                "{})",
                cfg.optim.grad_clip);
        if (kind == pp::Kind::PipeDream2BW && whole_batches && cfg.accum_steps() < cfg.train.pp - 1)
            fail(
                "train.pp_schedule = \"pipedream-2bw\" needs at least train.pp - 1 = {} "
                "micro-batches per step (train.batch_size / train.micro_batch_size = {}) to keep "
                "two weight versions",
                cfg.train.pp - 1, cfg.accum_steps());
    }
    if (kind == pp::Kind::Interleaved && whole_batches && cfg.accum_steps() % cfg.train.pp != 0)
        fail(
            "train.pp_schedule = \"interleaved\" needs the micro-batches per step "
            "(train.batch_size "
            "/ train.micro_batch_size = {}) to be a multiple of train.pp = {}",
            cfg.accum_steps(), cfg.train.pp);
    if (cfg.train.zero_stage > 1)
        fail(
            "train.zero_stage = {} with train.pp = {}: across pipelines only ZeRO-1 is built "
            "(each stage's gradients and parameters stay whole, its optimizer state is sharded); "
            "set train.zero_stage = 0 or 1",
            cfg.train.zero_stage, cfg.train.pp);
    if (cfg.train.zero_stage == 1 && cfg.train.pp_virtual > 1)
        fail(
            "train.zero_stage = 1 with train.pp_virtual = {}: ZeRO-1 across pipelines shards one "
            "chunk per rank; set train.zero_stage = 0 (gradients all-reduced across pipelines) or "
            "train.pp_virtual = 1",
            cfg.train.pp_virtual);
    if (cfg.train.device == "cuda") validate_cuda_pipeline(cfg);
}

void validate_tp(const RunConfig& cfg) {
    if (cfg.train.tp < 1)
        fail("train.tp = {} must be >= 1 (1: no tensor parallelism)", cfg.train.tp);
    if (cfg.train.sequence_parallel && cfg.train.tp == 1)
        fail(
            "train.sequence_parallel = true needs train.tp > 1: it shards the tensor-parallel "
            "group's norm regions over its ranks");
    if (cfg.train.tp == 1) return;
    cfg.model.validate_tp(cfg.train.tp);
    if (cfg.train.sequence_parallel &&
        ((int64_t)cfg.micro_batch() * cfg.train.seq_len) % cfg.train.tp != 0)
        fail(
            "train.sequence_parallel with train.tp = {} needs the micro-batch's tokens (micro "
            "batch {} x train.seq_len {}) divisible by {}: each rank holds as many token rows",
            cfg.train.tp, cfg.micro_batch(), cfg.train.seq_len, cfg.train.tp);

    // What tensor parallelism does not compose with yet: refused by name before training.
    auto refuse = [&](const char* keys, const char* why) {
        fail("train.tp = {} does not run with {} yet ({}): {}", cfg.train.tp, keys, why,
             "tensor parallelism composes with train.pp (naive, gpipe, 1f1b) and data "
             "parallelism (gradients all-reduced, or ZeRO-1) so far");
    };
    if (cfg.ps()) refuse("train.dp_mode = \"ps\"", "the parameter server");
    if (cfg.train.zero_stage > 1)
        fail(
            "train.zero_stage = {} with train.tp = {}: with tensor parallelism only ZeRO-1 is "
            "built (each shard's optimizer state split over the data group; its gradients and "
            "parameters stay whole); set train.zero_stage = 0 or 1",
            cfg.train.zero_stage, cfg.train.tp);
    if (cfg.lora.enabled()) refuse("lora.rank > 0", "LoRA adapters");
    if (cfg.train.device == "cuda") refuse("train.device = \"cuda\"", "the CPU engine only");
    if (cfg.train.pp_virtual > 1) refuse("train.pp_virtual > 1", "interleaved chunks");
    const pp::Kind kind = pp::parse_kind(cfg.train.pp_schedule);
    if (cfg.train.pp > 1 && kind != pp::Kind::Naive && kind != pp::Kind::GPipe &&
        kind != pp::Kind::OneFOneB)
        refuse(cfg.train.pp_schedule == "zb-h1" ? "train.pp_schedule = \"zb-h1\""
                                                : "an asynchronous train.pp_schedule",
               "a split backward or weight versions");
    const int64_t mesh = (int64_t)cfg.train.tp * cfg.train.pp;
    if (cfg.world % mesh != 0)
        fail(
            "train.tp x train.pp = {} x {} = {} ranks per replica does not divide the {} ranks: "
            "start mpirun -np {} (or a multiple)",
            cfg.train.tp, cfg.train.pp, mesh, cfg.world, mesh);
}

void validate_ps(const RunConfig& cfg) {
    if (cfg.train.dp_mode != "allreduce" && cfg.train.dp_mode != "ps")
        fail("train.dp_mode = \"{}\" must be \"allreduce\" or \"ps\" (parameter server)",
             cfg.train.dp_mode);
    if (!cfg.ps()) return;
    const int units = cfg.model.n_layer + 2;  // embedding, blocks, head (model/param_layout.h)
    if (cfg.train.ps_servers < 1 || cfg.train.ps_servers > units)
        fail(
            "train.ps_servers = {} must be in [1, {}]: each server holds at least one unit (the "
            "embedding, a block or the head) of the model's {}",
            cfg.train.ps_servers, units, units);
    if (cfg.train.ps_staleness < 0 || cfg.train.ps_staleness > 65536)
        fail("train.ps_staleness = {} must be in [0, 65536] (0: synchronous)",
             cfg.train.ps_staleness);
    if (cfg.world < cfg.train.ps_servers + 1)
        fail(
            "train.dp_mode = \"ps\" with train.ps_servers = {} needs at least {} ranks (the "
            "servers and a worker), the run has {}: start mpirun -np {} or more",
            cfg.train.ps_servers, cfg.train.ps_servers + 1, cfg.world, cfg.train.ps_servers + 1);
    if (cfg.train.pp != 1)
        fail(
            "train.dp_mode = \"ps\" with train.pp = {}: a parameter server serves whole "
            "replicas, set train.pp = 1",
            cfg.train.pp);
    if (cfg.train.zero_stage != 0)
        fail(
            "train.dp_mode = \"ps\" with train.zero_stage = {}: the servers already hold the "
            "optimizer state (sharded over train.ps_servers), set train.zero_stage = 0",
            cfg.train.zero_stage);
    if (cfg.train.device == "cuda")
        fail(
            "train.dp_mode = \"ps\" runs on the CPU engine only so far: set train.device = "
            "\"cpu\"");
}

// The one line every refusal of a key below prints: "<what> does not run with <keys> yet: <why>".
namespace {
auto refuser(std::string what) {
    return [what = std::move(what)](const std::string& keys, const std::string& why) {
        fail("{} does not run with {} yet: {}", what, keys, why);
    };
}

// The data-parallel rank count as the user can check it: given by mpirun, or derived from it.
std::string dp_ranks(const RunConfig& cfg) {
    if (cfg.ps())
        return fmt::format("{} data-parallel workers (derived: {} processes - train.ps_servers {})",
                           cfg.dp(), cfg.world, cfg.train.ps_servers);
    if (cfg.train.tp > 1 || cfg.train.pp > 1)
        return fmt::format(
            "{} data-parallel ranks (derived: {} processes / (train.tp {} x train.pp {}))",
            cfg.dp(), cfg.world, std::max(1, cfg.train.tp), std::max(1, cfg.train.pp));
    if (cfg.world == 1) return "1 data-parallel rank (one process)";
    return fmt::format("{} data-parallel ranks (the processes of mpirun -np {})", cfg.dp(),
                       cfg.world);
}

// train.batch_size (the global batch) splits into micro-batches on each data-parallel rank. The
// refusal names the keys the config holds and says which numbers memtrain derived: a
// micro-batch the user never set is not shown as if they had.
void check_batch_split(const RunConfig& cfg) {
    const int B = cfg.train.batch_size, mb = cfg.train.micro_batch_size, dp = cfg.dp();
    const bool automatic = mb == TrainConfig::kAutoMicroBatch;
    if (mb < 0 && !automatic)
        fail("train.micro_batch_size = {} must be >= 0 (0: derived) or \"auto\"", mb);
    if (mb == 0 || automatic) {
        if (B % dp != 0 || B < dp)
            fail(
                "train.batch_size = {} (the global batch) does not split evenly over {}: with "
                "train.micro_batch_size {} each rank would take {} / {} sequences; give a "
                "train.batch_size that is a multiple of {}{}",
                B, dp_ranks(cfg), automatic ? "= \"auto\"" : "not set", B, dp, dp,
                automatic ? "" : ", or set train.micro_batch_size");
        return;
    }
    if ((int64_t)mb * dp > B)
        fail(
            "train.micro_batch_size = {} on each of {} is {} sequences, more than train.batch_size "
            "= {} (the global batch)",
            mb, dp_ranks(cfg), (int64_t)mb * dp, B);
    if (B % (mb * dp) != 0)
        fail(
            "train.batch_size = {} (the global batch) must be a multiple of train.micro_batch_size "
            "= {} x {} = {}, so that every step accumulates whole micro-batches",
            B, mb, dp_ranks(cfg), mb * dp);
}

}  // namespace

int64_t mlp_tile_multiple(const RunConfig& cfg) {
    if (cfg.train.device != "cpu" ||
        cpu_saved_activations(cfg.train, cfg.train.precision) != SavedStore::int8)
        return 1;
    const int64_t block = (int64_t)cpu::kInt8Block;
    const int64_t tp = std::max(1, cfg.train.tp);  // a shard's widths of the MLP
    int64_t multiple = 1;
    for (const int64_t width :
         {(int64_t)cfg.model.n_embd, cfg.model.fc_dim() / tp, cfg.model.mlp_hidden() / tp})
        multiple = std::lcm(multiple, block / std::gcd(block, width));
    return multiple;
}

// Muon, optim.step_in_backward and optim.state_format other than fp32: what is built (for the
// formats: the CPU engine's whole-model and LoRA optimizers under DDP and ZeRO 0-3, and pipeline
// stages) and, by name, what is not yet.
void validate_optimizer_layout(const RunConfig& cfg) {
    if (cfg.optim.name == "muon" || cfg.optim.name == "adafactor") {
        // Muon orthogonalizes each block matrix whole, Adafactor factors each matrix's second
        // moment and scales each tensor by its RMS: every layout where one rank's optimizer holds
        // whole tensors (one process, DDP, pipeline stages, a parameter server's units), and
        // ZeRO 1-3 too, whose shards' edges gather the tensors they cut
        // (dist::ShardTensorGather).
        const bool muon = cfg.optim.name == "muon";
        const auto refuse = refuser(fmt::format("optim.name = \"{}\"", cfg.optim.name));
        const char* needs = muon ? "Newton-Schulz needs each matrix whole"
                                 : "its row and column factors and its RMS need each tensor whole";
        const bool cuda = cfg.train.device == "cuda";
        // On the GPU each rank's optimizer steps the tensors of its range whole (one GPU, DDP,
        // pipeline stages, LoRA's adapters); ZeRO's shards gather the tensors their edges cut
        // (dist::DeviceShardGather). ZeRO-Offload's host shards do not.
        if (cuda && cfg.train.offload_optimizer && cfg.dp() > 1)
            refuse(
                fmt::format("train.device = \"cuda\" and {} over {}",
                            cfg.train.offload_optimizer
                                ? std::string("train.offload_optimizer = true")
                                : fmt::format("train.zero_stage = {}", cfg.train.zero_stage),
                            dp_ranks(cfg)),
                "the offloaded optimizer's host shards cut the tensors it steps whole and do not "
                "gather them (keep the optimizer on the GPUs, whose ZeRO shards do, or use "
                "train.device = \"cpu\")");
        if (cuda && cfg.train.offload_optimizer && cfg.optim.master == "none")
            refuse("train.offload_optimizer = true and optim.master = \"none\"",
                   "the offloaded bf16 update steps the weights in pieces that cut tensors");
        // Under tp each sliced tensor is gathered over the tp group and stepped whole on every
        // rank (dist::TpTensorGather); a ZeRO-1 shard of the slices would need a second gather.
        if (cfg.train.tp > 1 && cfg.train.zero_stage > 0 && cfg.world > cfg.train.tp * cfg.train.pp)
            refuse(fmt::format("train.tp = {} with train.zero_stage = {}", cfg.train.tp,
                               cfg.train.zero_stage),
                   fmt::format("each rank holds slices of the matrices, gathered over the tp "
                               "group, and a ZeRO shard of them would cut them again (set "
                               "train.zero_stage = 0)"));
        if (cfg.train.zero_stage > 0 && cfg.world > 1 && cfg.train.pp > 1)
            refuse(fmt::format("train.zero_stage = {} with train.pp = {}", cfg.train.zero_stage,
                               cfg.train.pp),
                   fmt::format("ZeRO-1 cuts each stage's tensors between its data-parallel "
                               "ranks, and {} on one rank; the gather built for ZeRO over a "
                               "whole model is not built for stages (set train.zero_stage = 0)",
                               needs));
    }
    if (cfg.optim.step_in_backward) {
        // Built on the ZeroStore (one process, DDP, ZeRO 0-3, LoRA's adapters on the CPU) and on
        // the CUDA engine's whole model (one GPU, DDP).
        const auto refuse = refuser("optim.step_in_backward = true");
        if (cfg.train.device == "cuda") {
            if (cfg.train.zero_stage == 1)
                refuse("train.device = \"cuda\" and train.zero_stage = 1",
                       "the GPU's ZeRO-1 reduce-scatters the gradients after the backward; "
                       "ZeRO-2 reduces each unit's as the backward finishes it (set "
                       "train.zero_stage = 2, or 0 for DDP)");
            if (cfg.train.offload_optimizer)
                refuse("train.device = \"cuda\" and train.offload_optimizer = true",
                       "the offloaded optimizer steps on the host after the backward");
            if (cfg.train.cuda_graphs)
                refuse("train.device = \"cuda\" and train.cuda_graphs = true",
                       "the norm pass and the update pass run the same forward and backward to "
                       "different ends, which one captured graph cannot replay");
        }
        if (cfg.train.tp > 1)
            refuse(fmt::format("train.tp = {}", cfg.train.tp),
                   "it is built on the data-parallel store (one process, DDP, ZeRO 0-3)");
        if (cfg.train.pp > 1)
            refuse(fmt::format("train.pp = {}", cfg.train.pp),
                   "a pipeline's backward runs inside its schedule, which updates after the last "
                   "micro-batch");
        if (cfg.ps())
            refuse("train.dp_mode = \"ps\"", "the parameter server updates on the server");
        if (cfg.optim.step_in_backward_clip == "previous-norm" && cfg.train.precision == "fp16")
            refuse("optim.step_in_backward_clip = \"previous-norm\" and train.precision = \"fp16\"",
                   "fp16's overflow skip must see this step's norm before any unit is updated, "
                   "which the norm pass gives (optim.step_in_backward_clip = \"norm-pass\")");
        if (cfg.train.diagnostics == "amp")
            refuse("train.diagnostics = \"amp\"",
                   "the gradient histograms read the whole step's gradient, which no longer "
                   "exists at once");
    }
    if (cfg.optim.master == "none") {
        // bf16 weights: in the CPU engine's ZeroStore at every stage (one process, DDP, ZeRO 1-3;
        // the whole model or LoRA's adapters; a tensor-parallel shard alone); on the GPU the
        // compute parameters themselves (the whole model's under DDP and ZeRO 1-3, a pipeline
        // stage's, or LoRA's adapters).
        const auto refuse = refuser("optim.master = \"none\"");
        const bool cuda = cfg.train.device == "cuda";
        if (cuda && cfg.train.precision != "bf16")
            refuse(fmt::format("train.device = \"cuda\" and train.precision = \"{}\"",
                               cfg.train.precision),
                   "on the GPU the bf16 parameters are the weights (set train.precision = "
                   "\"bf16\")");
        // (Muon and Adafactor under ZeRO: the bf16 update hands the optimizer each cut tensor's
        // piece whole, and the optimizer completes it from its holders, dist::ShardTensorGather
        // on the CPU, dist::DeviceShardGather for the GPU's Muon.)
        if (cfg.train.tp > 1 && cuda)
            refuse(fmt::format("train.tp = {} and train.device = \"cuda\"", cfg.train.tp),
                   "the GPU's tensor-parallel shards keep fp32 master weights (the CPU engine's "
                   "take bf16 ones)");
        if (cfg.train.tp > 1 && cfg.dp() > 1 && !cuda)
            refuse(
                fmt::format("train.tp = {} with {} data-parallel groups", cfg.train.tp, cfg.dp()),
                "the CPU engine's tp x dp mesh keeps fp32 weights (tensor parallelism alone "
                "takes bf16 ones)");
        if (cfg.train.pp > 1 && !cuda)
            refuse(fmt::format("train.pp = {}", cfg.train.pp),
                   "the CPU engine's pipeline stages keep fp32 weights (the GPU's take bf16 ones)");
        if (cfg.ps()) refuse("train.dp_mode = \"ps\"", "the server keeps fp32 weights");
    }
    const StateFormat f = parse_state_format(cfg.optim.state_format);
    if (f == StateFormat::Fp32) return;
    const auto refuse = refuser(fmt::format("optim.state_format = \"{}\"", cfg.optim.state_format));
    // bf16 moments round each element on its own, so a tensor-parallel shard's (the fp32 rule
    // read on the whole tensor, ParamSpec::whole_numel) are one process's; int8 and int4 blocks
    // lie over the whole tensor, so each must fall whole in one rank's slice.
    if (cfg.train.tp > 1) {
        const std::string misfit = dist::tp_block_misfit(cfg.model, cfg.train.tp, f);
        if (!misfit.empty())
            refuse(fmt::format("train.tp = {}", cfg.train.tp),
                   fmt::format("the {}-element blocks of {} lie across the ranks' slices (a "
                               "row-parallel slice's rows and every tensor's offset must fall on "
                               "the block grid: a wider model, a smaller train.tp, or "
                               "optim.state_format = \"bf16\", which has no blocks)",
                               block_size(f), misfit));
    }
    if (cfg.ps())
        refuse("train.dp_mode = \"ps\"",
               "the parameter server's optimizer keeps fp32 moments (use train.dp_mode = "
               "\"allreduce\" with train.zero_stage for sharded state)");
}

// model.dropout: built in the CPU engine's whole model (one process, DDP, ZeRO 0-3, LoRA, every
// remat policy, optim.step_in_backward) and its pipeline stages (every schedule).
void validate_dropout(const RunConfig& cfg) {
    if (!(cfg.model.dropout > 0)) return;
    const auto refuse = refuser(fmt::format("model.dropout = {}", cfg.model.dropout));
    if (cfg.train.device == "cuda")
        refuse("train.device = \"cuda\"",
               "its masks are built into the CPU engine's kernels so far (set train.device = "
               "\"cpu\", or model.dropout = 0 on the GPU)");
    if (cfg.train.tp > 1)
        refuse(fmt::format("train.tp = {}", cfg.train.tp),
               "a shard's heads and rows would need the whole model's mask indices");
    if (cfg.ps())
        refuse("train.dp_mode = \"ps\"", "the parameter server's workers run the model alone");
}

void validate_lora(const RunConfig& cfg) {
    cfg.lora.validate();
    if (!cfg.lora.enabled()) {
        if (cfg.lora.base != "fp32")
            fail("lora.base = \"{}\" quantizes the frozen base of a LoRA run: set lora.rank > 0",
                 cfg.lora.base);
        return;
    }
    if (cfg.train.pp > 1 || cfg.ps())
        fail("LoRA (lora.rank = {}) runs with data parallelism and ZeRO, not with {} yet",
             cfg.lora.rank, cfg.ps() ? "a parameter server" : "pipeline stages (train.pp)");
    make_lora_layout(cfg.model, cfg.lora);  // targets that match nothing fail here
}

void validate_metrics_name(const std::string& name) {
    // A plain name, created inside io.out_dir: an absolute or ../ path (from a config, or from a
    // downloaded checkpoint's memtrain.toml on resume) would truncate a file anywhere.
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos ||
        name.find('\0') != std::string::npos)
        fail(
            "io.metrics = \"{}\" must be a plain file name (no directory, not . or ..): the log "
            "is written inside io.out_dir",
            name);
    for (const char* own : {"latest", "memory.json", ".lock", "report.html"})
        if (name == own)
            fail("io.metrics = \"{}\" is the name of a file memtrain keeps in io.out_dir", name);
}

void validate_config(const RunConfig& cfg) {
    cfg.model.validate();
    cfg.optim.validate();
    validate_lora(cfg);
    if (cfg.train.device != "cpu" && cfg.train.device != "cuda" && cfg.train.device != "auto")
        fail("train.device = \"{}\" must be \"cpu\", \"cuda\" or \"auto\"", cfg.train.device);
    if (cfg.train.device == "cuda" && !MEMTRAIN_HAVE_CUDA)
        fail(
            "train.device = \"cuda\", but this memtrain was built without CUDA (no nvcc at "
            "build time); rebuild where the CUDA toolkit is installed, or use device = \"cpu\"");
    if (cfg.train.device == "cuda" && !cuda_available())
        fail(
            "train.device = \"cuda\", but no CUDA device answers on this machine ({}); use "
            "device = \"cpu\" or \"auto\"",
            load_cuda_backend() ? "the driver reports none" : cuda_backend_status());
    if (cfg.train.precision != "fp32" && cfg.train.precision != "bf16" &&
        cfg.train.precision != "fp16" && cfg.train.precision != "auto")
        fail("train.precision = \"{}\" must be \"fp32\", \"bf16\", \"fp16\" or \"auto\"",
             cfg.train.precision);
    if (cfg.train.device == "cpu" && cfg.train.precision == "fp16")
        fail(
            "train.precision = \"fp16\" on the CPU: the CPU engine computes in fp32 or bf16 "
            "(oneDNN 2.6 has no fp16 CPU GEMM); use \"bf16\", or train.device = \"cuda\"");
    remat::RematPolicy remat_policy;
    try {
        remat_policy = remat::parse_policy(cfg.train.remat);
    } catch (const Error& e) {
        fail("train.remat = \"{}\": {}", cfg.train.remat, e.what());
    }
    // offload and budget:BYTES+offload keep block inputs in host memory beside a GPU.
    if (remat_policy.rebuilds_inputs()) {
        // The CPU engine: one process, DDP, ZeRO 0-3, a parameter server's workers, tensor
        // parallelism and pipelines (each chunk of blocks rebuilds within itself), with LoRA and
        // dropout. The GPU engine: the whole model (one GPU, DDP, ZeRO 1-3, LoRA) and its
        // pipeline stages (each stage rebuilding within itself).
        const auto refuse = refuser(fmt::format("train.remat = {}", cfg.train.remat));
        if (cfg.train.pp > 1 && cfg.train.pp_schedule == "zb-h1")
            refuse("train.pp_schedule = \"zb-h1\"",
                   "its split backward recomputes for the weight halves from kept block inputs "
                   "(use full, selective, or another schedule)");
    }
    const bool remat_offloads = remat_policy.may_offload();
    if (remat_offloads && cfg.train.device == "cpu")
        fail(
            "train.remat = {} keeps block inputs in pinned host memory beside a GPU: use "
            "train.device = \"cuda\" (on the CPU, `full` keeps the same)",
            cfg.train.remat);
    if (remat_offloads && cfg.train.cuda_graphs)
        fail(
            "train.remat = {} copies on a second stream, which train.cuda_graphs does not "
            "capture yet: use one or the other",
            cfg.train.remat);
    if (cfg.train.offload_optimizer && cfg.train.device == "cpu")
        fail(
            "train.offload_optimizer = true moves the optimizer off the GPU to the CPU: it needs "
            "train.device = \"cuda\" (the CPU engine's optimizer is on the CPU already)");
    if (cfg.train.device == "cuda" && cfg.train.pp == 1) {  // (pipelines: validate_cuda_pipeline)
        if (cfg.train.offload_optimizer && cfg.world > 1 && cfg.train.zero_stage == 0)
            fail(
                "train.offload_optimizer with {} ranks needs train.zero_stage >= 1: each rank "
                "updates its shard on its host (at stage 0 every rank would repeat the whole "
                "update)",
                cfg.world);
        if (cfg.train.cuda_graphs && cfg.world > 1)
            fail(
                "train.cuda_graphs with {} ranks: the overlapped all-reduces run on a second "
                "stream, which the capture does not take in yet; use one or the other",
                cfg.world);
    }
    if (cfg.train.cuda_graphs && cfg.train.device == "cpu")
        fail("train.cuda_graphs = true needs train.device = \"cuda\" (or \"auto\" on a GPU)");
    if (cfg.train.cpu_attention != "probs" && cfg.train.cpu_attention != "lse")
        fail(
            "train.cpu_attention = \"{}\" must be \"probs\" (keep the attention probabilities) "
            "or \"lse\" (keep their log-sum-exp and recompute them in the backward)",
            cfg.train.cpu_attention);
    if (cfg.train.mlp_tile != 0) {
        if (cfg.train.mlp_tile < 0)
            fail("train.mlp_tile = {} must be >= 0 (token rows per MLP tile; 0 = all at once)",
                 cfg.train.mlp_tile);
        const auto refuse = refuser(fmt::format("train.mlp_tile = {}", cfg.train.mlp_tile));
        if (cfg.train.device == "cuda")
            refuse("train.device = \"cuda\"", "the tiled MLP is the CPU engine's");
        if (cfg.train.sequence_parallel)
            refuse("train.sequence_parallel = true",
                   "its norms run on a rank's rows, all-gathered before the GEMMs they feed");
        if (cfg.train.pp > 1 && cfg.train.pp_schedule == "zb-h1")
            refuse("train.pp_schedule = \"zb-h1\"",
                   "its split backward keeps the MLP's output gradients for whole micro-batches");
        // int8 saved fields: a tile's values are stored and read a block of 256 at a time, so
        // every tile but the last must end on the field's block grid.
        const int64_t multiple = mlp_tile_multiple(cfg);
        if (cfg.train.mlp_tile % multiple != 0)
            fail(
                "train.mlp_tile = {} with train.cpu_activations = \"int8\": a tile of {} rows is "
                "not a whole number of the {}-value int8 blocks of each tiled width ({}, {} and "
                "{} values a row; use a multiple of {} rows)",
                cfg.train.mlp_tile, cfg.train.mlp_tile, cpu::kInt8Block, cfg.model.n_embd,
                cfg.model.fc_dim() / std::max(1, cfg.train.tp),
                cfg.model.mlp_hidden() / std::max(1, cfg.train.tp), multiple);
    }
    if (cfg.train.cpu_activations != "auto" && cfg.train.cpu_activations != "fp32" &&
        cfg.train.cpu_activations != "bf16" && cfg.train.cpu_activations != "int8")
        fail("train.cpu_activations = \"{}\" must be \"auto\", \"fp32\", \"bf16\" or \"int8\"",
             cfg.train.cpu_activations);
    if (cfg.train.device == "cuda" && cfg.train.cpu_activations != "auto")
        fail(
            "train.cpu_activations = \"{}\" is the CPU engine's; on device = \"cuda\" the "
            "activations are stored in train.precision (set cpu_activations = \"auto\")",
            cfg.train.cpu_activations);
    if (cfg.train.device == "cuda" && cfg.train.remat_costs == "measured")
        fail(
            "train.remat_costs = \"measured\" profiles the CPU kernels; on device = \"cuda\" use "
            "\"analytic\"");
    if (!(cfg.optim.loss_scale > 0) || cfg.optim.loss_scale > 1e30)
        fail("optim.loss_scale = {} must be a positive number (e.g. 65536)", cfg.optim.loss_scale);
    if (cfg.optim.loss_scale_window < 1)
        fail("optim.loss_scale_window = {} must be >= 1", cfg.optim.loss_scale_window);
    if (cfg.train.seq_len <= 0 || cfg.train.seq_len > cfg.model.block_size)
        fail("train.seq_len = {} must be in [1, model.block_size = {}]", cfg.train.seq_len,
             cfg.model.block_size);
    if (cfg.train.batch_size <= 0)
        fail("train.batch_size must be positive, got {}", cfg.train.batch_size);
    // Token counts of a step are ints in the loaders and kernels; 2^31 tokens a step is a
    // thousand times the largest batches trained.
    if (cfg.tokens_per_step() > INT32_MAX)
        fail(
            "train.batch_size x train.seq_len = {} x {} = {} tokens a step is more than memtrain "
            "supports ({} at most)",
            cfg.train.batch_size, cfg.train.seq_len, cfg.tokens_per_step(), INT32_MAX);
    if (cfg.world < 1) fail("internal: world size {} < 1", cfg.world);
    validate_pipeline(cfg);
    validate_tp(cfg);
    validate_ps(cfg);
    validate_optimizer_layout(cfg);
    validate_dropout(cfg);
    check_batch_split(cfg);
    if (cfg.train.remat_costs != "analytic" && cfg.train.remat_costs != "measured")
        fail("train.remat_costs = \"{}\" must be \"analytic\" or \"measured\"",
             cfg.train.remat_costs);
    if (cfg.train.zero_stage < 0 || cfg.train.zero_stage > 3)
        fail("train.zero_stage = {} must be 0, 1, 2 or 3", cfg.train.zero_stage);
    if (cfg.train.max_steps < 0) fail("train.max_steps must be >= 0, got {}", cfg.train.max_steps);
    if (cfg.train.eval_every < 0)
        fail("train.eval_every must be >= 0, got {}", cfg.train.eval_every);
    if (cfg.train.eval_batches <= 0)
        fail("train.eval_batches must be positive, got {}", cfg.train.eval_batches);
    if (cfg.train.log_every <= 0)
        fail("train.log_every must be positive, got {}", cfg.train.log_every);
    if (cfg.train.threads < 0) fail("train.threads must be >= 0, got {}", cfg.train.threads);
    if (cfg.io.checkpoint_every < 0)
        fail("io.checkpoint_every must be >= 0, got {}", cfg.io.checkpoint_every);
    if (cfg.io.keep_last < 0)
        fail("io.keep_last must be >= 0 (0 keeps every checkpoint), got {}", cfg.io.keep_last);
    if (cfg.io.keep_every < 0)
        fail("io.keep_every must be >= 0 (0: none kept for its step), got {}", cfg.io.keep_every);
    validate_metrics_name(cfg.io.metrics);
    if (cfg.sample.max_tokens < 0)
        fail("sample.max_tokens must be >= 0, got {}", cfg.sample.max_tokens);
    if (!(cfg.sample.temperature >= 0))
        fail(
            "sample.temperature must be >= 0 (0 = greedy, as `memtrain sample --temperature 0`), "
            "got {}",
            cfg.sample.temperature);
    if (cfg.sample.top_k < 0) fail("sample.top_k must be >= 0, got {}", cfg.sample.top_k);
    if (cfg.train.diagnostics != "none" && cfg.train.diagnostics != "amp")
        fail("train.diagnostics = \"{}\" must be \"none\" or \"amp\"", cfg.train.diagnostics);
    if (cfg.train.diagnostics_every <= 0)
        fail("train.diagnostics_every must be positive, got {}", cfg.train.diagnostics_every);
    const GuardConfig& g = cfg.guard;
    if (g.window < 3) fail("guard.window must be >= 3 steps, got {}", g.window);
    if (g.min_history < 3 || g.min_history > g.window)
        fail("guard.min_history must be between 3 and guard.window ({}), got {}", g.window,
             g.min_history);
    if (!(g.spike_z > 0)) fail("guard.spike_z must be > 0, got {}", g.spike_z);
    if (!(g.norm_factor > 1)) fail("guard.norm_factor must be > 1, got {}", g.norm_factor);
    if (g.snapshot_every < 2)
        fail(
            "guard.snapshot_every must be >= 2 steps (a rollback goes to a snapshot older than "
            "the step before the bad one), got {}",
            g.snapshot_every);
    if (!(g.lr_factor > 0 && g.lr_factor <= 1))
        fail("guard.lr_factor must be in (0, 1], got {}", g.lr_factor);
    if (g.cooldown < 0) fail("guard.cooldown must be >= 0, got {}", g.cooldown);
    if (g.max_rollbacks < 1)
        fail("guard.max_rollbacks must be >= 1 (guard.enabled = false turns the guard off), got {}",
             g.max_rollbacks);
}

}  // namespace memtrain
