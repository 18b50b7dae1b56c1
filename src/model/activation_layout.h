// Where every activation and workspace tensor of a training step lives, for the CPU and the CUDA
// models alike: one function (plan_arena) sizes the arenas, places each block's saved fields
// under its recompute plan, and lists the regions with their bytes, so the model allocates
// exactly what the memory report predicts and the remat solver prices (STYLE lesson 2).
//
// The saved fields of a block, with QKV = ModelConfig::qkv_dim(), F = fc_dim(), H = mlp_hidden():
//   ln_1 (B,T,C), ln_1 mean (B,T) [layernorm only], ln_1 rstd (B,T), qkv (B,T,QKV),
//   attention: the probabilities (B,NH,T,T) on the CPU, the row log-sum-exp (B,NH,T) with the
//   GPU's fused attention, attention out (B,T,C), residual mid (B,T,C), ln_2 and its
//   statistics as ln_1's, mlp fc (B,T,F), mlp activation (B,T,H).
// Activations are stored in the format's element type; statistics (mean, rstd, log-sum-exp) are
// always fp32.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "model/config.h"

namespace memtrain {

// What one block keeps through the forward. Dropped pieces are recomputed in backward, into one
// shared scratch block, by the same kernels the forward used (bitwise-identical gradients).
//   All:       every saved field.
//   Selective: all but ln_1, ln_2 and the mlp activation (cheap to recompute from the kept
//              statistics, the residual input, residual mid and mlp fc; for GPT-2 6 BTC of the
//              block's ~16 BTC).
//   Input:     nothing beyond the residual-stream input (always kept); the whole block is
//              recomputed before its backward.
//   Offload:   as Input, and the residual-stream input itself waits in pinned host memory: it
//              is copied out on a side stream during the forward and prefetched back before the
//              block's backward (the CUDA engine). The inputs of a plan's Offload blocks share a
//              ring of min(count, kOffloadSlots) device slots, so each Offload block beyond the
//              first kOffloadSlots saves one residual stream of device memory.
//   Segment:   as Input, and the residual-stream input is not kept either (Chen et al.'s
//              segments, train.remat = chen:K): at the first backward that needs it, the
//              forward re-runs from the nearest input below that is kept (or held), and the
//              inputs of the Segment blocks it passes are held until each one's backward.
//   Dropped:   as Segment, but the rebuilt input is never held: each Dropped block's backward
//              re-runs the forward from the nearest available input below it (the lecture's
//              memory-poor strategy, train.remat = memory-poor: O(n^2) block forwards, O(1)
//              residual streams). The CPU engine (one process, data and tensor parallelism,
//              and each pipeline chunk on its own); the first block always keeps its input.
enum class BlockKeep : uint8_t { All, Selective, Input, Offload, Segment, Dropped };
// Whether a block's residual-stream input is rebuilt in the backward instead of kept.
inline bool rebuilds_input(BlockKeep k) {
    return k == BlockKeep::Segment || k == BlockKeep::Dropped;
}
constexpr int kOffloadSlots = 3;
const char* keep_name(BlockKeep k);
// One letter per keep, for plans printed as a row: a s i o g (segment) d (dropped).
char keep_letter(BlockKeep k);
inline constexpr const char* kKeepLetters =
    "a all, s selective, i input only, o input in host memory, g segment, d dropped input";
// One BlockKeep per block (empty = every block keeps All), and for the blocks whose input is
// rebuilt and held (Segment), which rebuild holds it.
struct RematPlan : std::vector<BlockKeep> {
    using std::vector<BlockKeep>::vector;
    // Per block, empty or n entries: the block whose backward's rebuild holds this Segment
    // block's input (that rebuild's forward writes it into a hold slot instead of a temporary,
    // and it stays there until its own backward); -1 for the other blocks. Empty: each Segment
    // input is held by the first rebuild that passes it (chen:K). The joint solver's schedules
    // (remat::solve_rebuild) set it: a rebuild that passes an input another, later rebuild holds
    // leaves it in a temporary, as Griewank's binomial schedules do.
    std::vector<int> hold_by;
    bool operator==(const RematPlan& o) const {
        return static_cast<const std::vector<BlockKeep>&>(*this) ==
                   static_cast<const std::vector<BlockKeep>&>(o) &&
               hold_by == o.hold_by;
    }
};

enum class SavedField : uint8_t {
    Ln1,
    Ln1Mean,
    Ln1Rstd,
    Qkv,
    Att,  // probabilities (CPU) or log-sum-exp (fused attention)
    Atty,
    ResidMid,
    Ln2,
    Ln2Mean,
    Ln2Rstd,
    Fch,
    FchAct,
};
constexpr int kSavedFields = 12;

// How a backend stores a step's tensors.
struct ActFormat {
    int elem_bytes = 4;            // activations: 4 (fp32) or 2 (bf16, fp16)
    bool fused_attention = false;  // keeps the (B,NH,T) log-sum-exp, not (B,NH,T,T) probabilities
    bool cuda = false;             // the CUDA model's workspace (kernel scratch, cuBLASLt)
    int loss_chunk = 256;          // rows of logits alive at once
    std::size_t align = 4;         // every region starts at a multiple of this many bytes
    // The CPU model's bf16 GEMMs (ModelConfig::cpu_bf16): the workspace holds the bf16 copies
    // of one GEMM's operands at a time (bf16_gemm_elems).
    bool bf16_gemm = false;
    // The CPU model's compressed saved fields (ModelConfig::saved_activations, bf16 or int8):
    // each block keeps its saved activations in that form (statistics in fp32), and one fp32
    // working block, where the recompute scratch would be, holds the block the forward or
    // backward is in (ArenaPlan::work).
    SavedStore saved = SavedStore::fp32;
    bool compressed() const { return saved != SavedStore::fp32; }
    // The CPU model's MLP over row tiles (ModelConfig::mlp_tile; 0: all rows): the recompute
    // scratch holds one tile of the MLP's activations (c_fc's output and the activation's).
    int mlp_tile = 0;

    // The CPU model: fp32, the probabilities or (lse_attention) their log-sum-exp; bf16 GEMMs
    // and compressed saved fields as asked.
    static ActFormat cpu(bool lse_attention = false, bool bf16_gemm = false,
                         SavedStore saved = SavedStore::fp32, int mlp_tile = 0) {
        ActFormat f;
        f.fused_attention = lse_attention;
        f.bf16_gemm = bf16_gemm;
        f.saved = saved;
        f.mlp_tile = mlp_tile;
        return f;
    }
    bool operator==(const ActFormat&) const = default;
    // The CUDA model: fused attention, regions 256-byte aligned (cuBLASLt and vector loads).
    static ActFormat cuda_model(int elem_bytes, int loss_chunk) {
        return ActFormat{elem_bytes, true, true, loss_chunk, 256};
    }
};

// The CUDA model's format for a micro-batch of B x T with elem_bytes-byte activations: the
// classifier keeps at most 256 MiB of logits alive (a whole number of 64-row tiles, at least 64
// rows). No GPU is needed to ask (the planner and `memtrain remat` price the GPU layout
// anywhere).
ActFormat cuda_arena_format(const ModelConfig& cfg, int elem_bytes, int B, int T);

// The CPU model's format for a config (ModelConfig::lse_attention, cpu_bf16, saved_activations).
inline ActFormat cpu_arena_format(const ModelConfig& cfg) {
    return ActFormat::cpu(cfg.lse_attention, cfg.cpu_bf16, cfg.saved_activations, cfg.mlp_tile);
}

// The bf16 elements the CPU model's largest GEMM needs for its rounded operands, a micro-batch
// of BT token rows: over the block linears, a forward's input and weight, a backward's d(output)
// beside the larger of weight and input (cpu::matmul_backward); and the classifier's whole
// output embedding beside a chunk of inputs and of d(logits) (cpu::classifier_loss).
std::size_t bf16_gemm_elems(const ModelConfig& cfg, int64_t BT, int chunk);

// How a plan's backward rebuilds the inputs it did not keep (Segment and Dropped blocks), the one
// schedule the CPU model runs, plan_arena sizes and the solver prices. Walking the blocks from
// the last: a block whose input is neither kept nor held re-runs the forward of blocks
// [from, block) first, from the nearest block below whose input is kept or held, and holds the
// inputs of the Segment blocks in (from, block] that it is the holder of (RematPlan::hold_by;
// by default every Segment block it passes), each in a slot until its own backward. A hold_by
// naming a rebuild that does not pass the block is an error.
struct InputRebuild {
    std::vector<int> from;  // per block: the first block re-run before its backward; -1: none
    std::vector<int> slot;  // per block: the hold slot of a Segment block's input; -1: none
    // Per block: the block whose backward's rebuild holds this input (RematPlan::hold_by, or the
    // first rebuild that passes a Segment block); -1: never held.
    std::vector<int> holder;
    int slots = 0;         // hold slots alive at once (residual streams)
    int64_t forwards = 0;  // block forwards all the rebuilds of a step run
    bool any = false;      // some block rebuilds its input (two stream temporaries then)
};
InputRebuild input_rebuild(const RematPlan& plan);
// Blocks [b0, b1) of a plan as a plan of their own (a pipeline chunk's), the rebuilds that hold
// their inputs renumbered from b0; a hold by a rebuild outside the range is an error.
RematPlan slice_plan(const RematPlan& plan, int b0, int b1);
// `chunk`, a plan of the blocks after `whole`'s, appended to it: each rebuilds only within its own
// blocks. Holds become explicit (RematPlan::hold_by) once either names them.
void append_plan(RematPlan& whole, const RematPlan& chunk);

// One named region of the activation or workspace arena.
struct ArenaEntry {
    std::string name;
    std::size_t bytes;
    MemCategory category;
};

constexpr std::size_t kNoOffset = SIZE_MAX;

// The arenas of one step: the regions for reports, and the byte offset of every tensor.
struct ArenaPlan {
    std::vector<ArenaEntry> entries;
    std::size_t activation_bytes = 0, workspace_bytes = 0;
    // Activation arena: the n_layer + 1 residual streams, each block's fields (kNoOffset where
    // the field has no bytes under this config), ln_f output and statistics. A dropped field
    // points into the shared recompute scratch. The input resid[l] of the i-th Offload block is
    // ring slot i % min(offloaded blocks, kOffloadSlots), and offloaded_bytes is what waits in
    // pinned host memory (the inputs of all but the last ring-full of Offload blocks).
    std::vector<std::size_t> resid;
    std::size_t offloaded_bytes = 0;
    // Segment and Dropped blocks (InputRebuild): their inputs live in two stream temporaries
    // during the forward (resid[l] of such a block is temporary l % 2), and `held` are the hold
    // slots their rebuilt inputs wait in.
    std::vector<std::size_t> held;
    std::vector<std::array<std::size_t, kSavedFields>> block;
    // ActFormat::compressed(): the fp32 working block, one offset per field (kNoOffset where the
    // field has no bytes). block[l][i] is then field i's bf16 or int8 storage (fp32 for statistics)
    // where block l keeps it, kNoOffset where it drops it.
    std::array<std::size_t, kSavedFields> work{};
    std::size_t lnf = 0, lnf_mean = kNoOffset, lnf_rstd = 0;
    // Workspace arena: gradients flowing backward, and the backend's temporaries.
    std::size_t dres = 0;               // d(residual stream) (B,T,C)
    std::size_t dln = 0;                // d(norm output) / d(attention out) (B,T,C)
    std::size_t dbig = 0;               // d(qkv) or d(mlp fc) (B,T,max(QKV,F))
    std::size_t dact = kNoOffset;       // swiglu: d(mlp activation) (B,T,H)
    std::size_t logits = 0;             // a chunk of logits (chunk,Vp)
    std::size_t gemm_bf16 = kNoOffset;  // ActFormat::bf16_gemm: bf16_gemm_elems operands
    // Sequence parallelism (ModelConfig::sp_rows < B*T): every token row of a tensor-parallel
    // GEMM's input or output, (B,T,C). The residual streams, the norm fields and dres then hold
    // only sp_rows rows.
    std::size_t sp_gather = kNoOffset;
    // CUDA model only (kNoOffset on the CPU): per-row losses (B*T fp32) and attention
    // backward's delta (B,NH,T fp32). The entries also list the kernels' scratch and cuBLASLt's
    // workspace, which are process-wide allocations outside the arena.
    std::size_t row_loss = kNoOffset, att_delta = kNoOffset;
};

// The CUDA model's process-wide temporaries (workspace, outside the arena): cuBLASLt's GEMM
// workspace, and the room the fixed-order reductions need for their partial sums (bias,
// norm-parameter, gradient-norm and loss sums), in whole MiB as device_scratch grows.
constexpr std::size_t kCublasWorkspaceBytes = std::size_t{32} << 20;
std::size_t cuda_kernel_scratch_bytes(const ModelConfig& cfg, int B, int T);

ArenaPlan plan_arena(const ModelConfig& cfg, int B, int T, const RematPlan& plan = {},
                     const ActFormat& fmt = ActFormat::cpu());
// One pipeline stage's arena for one micro-batch in flight: plan_arena of the model cut down to
// the stage's `blocks` blocks (their residual streams, saved fields and ln_f). The CPU model
// allocates each slot with it (GPT::stage_arena) and `memtrain pipeline` prices stages with it.
ArenaPlan plan_stage_arena(const ModelConfig& cfg, int blocks, int B, int T,
                           const RematPlan& plan = {}, const ActFormat& fmt = ActFormat::cpu());
// What a zero-bubble schedule's split backward (GPT::set_split_backward) keeps per micro-batch
// between a stage's I and W: each block's output gradients of its four linear layers (fp32
// floats per block, and bytes for a stage of `blocks` blocks). Beside each slot's arena; the
// pipeline engine allocates it and the planner prices it with these.
std::size_t split_backward_floats(const ModelConfig& cfg, int B, int T);
std::size_t split_backward_bytes(const ModelConfig& cfg, int blocks, int B, int T);
// The regions of plan_arena, for reports and tests.
std::vector<ArenaEntry> activation_layout(const ModelConfig& cfg, int B, int T,
                                          const RematPlan& plan = {},
                                          const ActFormat& fmt = ActFormat::cpu());
std::size_t arena_bytes(const std::vector<ArenaEntry>& layout, MemCategory c);

// Bytes of saved fields one block keeps under `k`, and the scratch its recompute needs. The
// fields dropped by Selective are a subset of those dropped by Input, so the shared scratch of a
// plan is exactly the largest scratch_bytes over its blocks.
std::size_t kept_bytes(const ModelConfig& cfg, int B, int T, BlockKeep k,
                       const ActFormat& fmt = ActFormat::cpu());
std::size_t scratch_bytes(const ModelConfig& cfg, int B, int T, BlockKeep k,
                          const ActFormat& fmt = ActFormat::cpu());
// One residual stream (B, T, C) as the arena aligns it.
std::size_t resid_bytes(const ModelConfig& cfg, int B, int T,
                        const ActFormat& fmt = ActFormat::cpu());
// Bytes kept under every plan without Offload blocks: the n_layer + 1 residual streams and ln_f
// (output, statistics).
std::size_t fixed_bytes(const ModelConfig& cfg, int B, int T,
                        const ActFormat& fmt = ActFormat::cpu());

// The field's name in reports, its size in bytes (unaligned), and whether Selective drops it.
std::string saved_field_name(SavedField f, const ModelConfig& cfg, const ActFormat& fmt);
std::size_t saved_field_bytes(SavedField f, const ModelConfig& cfg, int B, int T,
                              const ActFormat& fmt);
// Its bytes in the fp32 recompute scratch (or working block): a tile of rows for the MLP's two
// fields under ActFormat::mlp_tile, else all of them.
std::size_t scratch_field_bytes(SavedField f, const ModelConfig& cfg, int B, int T,
                                const ActFormat& fmt);
bool keeps(BlockKeep k, SavedField f);
// Whether the field is a statistic (norm mean, rstd, the attention's log-sum-exp under fused
// or lse attention): always fp32, never rounded.
bool is_statistic(SavedField f, const ActFormat& fmt);
// ln_1's or ln_2's output, c_fc's output or the activation: the fields ActFormat::mlp_tile makes
// a tile of rows at a time (the norms' statistics stay whole: their backward reads every row's).
bool is_tiled_field(SavedField f);

}  // namespace memtrain
