// Megatron tensor parallelism (Shoeybi et al. 2019) on the CPU model: how each parameter of the
// whole model is cut over T ranks, the group that runs the conjugate f/g all-reduces and counts
// them, and the vocabulary-parallel embedding and cross-entropy.
//
// Layout over ranks t = 0..T-1 (C = n_embd, hs = head_dim, Vp = padded vocabulary):
//   wte.weight, lm_head.weight  rows [t Vp/T, (t+1) Vp/T)                  (vocabulary-parallel)
//   attn.c_attn.weight/bias     columns of heads [t NH/T, ..) of q, and of kv heads
//                               [t NKV/T, ..) of k and of v                (column-parallel)
//   attn.c_proj.weight          rows of the same query heads               (row-parallel)
//   mlp.c_fc.weight/bias        columns [t H/T, ..) (SwiGLU: of gate and of up) (column-parallel)
//   mlp.c_proj.weight           rows [t H/T, ..)                           (row-parallel)
//   everything else (wpe, norms, the two row-parallel biases) whole on every rank.
// A rank's shard is the model of ModelConfig::tp = T (its local_* sizes), so the kernels run
// unchanged on it; GPT inserts the collectives (model/gpt.cpp).
//
// Collectives per micro-batch of N = B x T tokens, all in place over the TP group:
//   forward   embedding: 1 all-reduce of N x C (g after the masked lookup);
//             per block: 2 all-reduces of N x C (g after attn.c_proj and mlp.c_proj);
//             loss, per chunk of R <= GPT::kLossChunk rows: 1 all-reduce max of R doubles
//             (the logit max) and 1 all-reduce sum of 2R floats (sum of exps, target logit)
//   backward  loss: 1 all-reduce of N x C (f before the vocabulary-parallel classifier);
//             per block: 2 all-reduces of N x C (f before c_attn and c_fc)
// The gradients of the whole (replicated) tensors come out the same on every rank: every input
// they are computed from is the same there, so they need no reduction.
//
// Sequence parallelism (Korthikanti et al. 2022; ModelConfig::sequence_parallel, needs
// N % T == 0): rank t holds the contiguous token rows [t N/T, (t+1) N/T) of the residual stream
// and of the norm regions (ln_1, ln_2, ln_f and their statistics); the tensor-parallel regions
// between them still see all N rows. The conjugate pairs replace the all-reduces:
//   forward   embedding: 1 reduce-scatter of N x C (the masked lookup's partial sums, to this
//             rank's rows; wpe added there at the rows' global positions);
//             per block: 2 all-gathers of N x C (the ln_1 / ln_2 shards before c_attn / c_fc)
//             and 2 reduce-scatters of N x C (after attn.c_proj / mlp.c_proj);
//             head: 1 all-gather of N x C (ln_f's shards before the vocabulary-parallel loss,
//             which then runs as without SP, on every row)
//   backward  head: 1 reduce-scatter of N x C (the classifier's input gradient, to ln_f's rows);
//             per block: 2 all-gathers of N x C (d(block output) and d(resid_mid) before the
//             row-parallel GEMMs' backward), 2 all-gathers of N x C re-gathering the saved
//             ln_2 / ln_1 shards for the column-parallel weight gradients (Megatron keeps only
//             the shard), 2 reduce-scatters of N x C (the column-parallel input gradients);
//             embedding: 1 all-gather of N x C (d(embedding output), for the vocabulary rows)
//   per step  1 all-reduce of the norm weights' gradients (sp_partial_grad): each rank summed
//             only its rows'. The row-parallel biases and wpe get theirs from all-gathered
//             output gradients, so they stay whole and equal on every rank.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "model/config.h"
#include "model/param_layout.h"
#include "model/tp_comm.h"
#include "model/vocab_parallel.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"

namespace memtrain::dist {

// How one tensor of the whole model is cut: whole (dim < 0), or along dimension `dim` whose
// extent is the concatenation of `segments` (c_attn: [q | k | v]; SwiGLU's c_fc: [gate | up]),
// each segment cut into T equal contiguous pieces; rank t keeps piece t of every segment, in
// segment order.
struct TpShard {
    int dim = -1;
    std::vector<int64_t> segments;
    bool split() const { return dim >= 0; }
};

// The whole model's tensors (make_param_layout(cfg) at cfg.tp = 1) and their cut over `ranks`;
// the shard layout is make_param_layout of tp_shard_config, with the same tensors in the same
// order.
struct TpLayout {
    int ranks = 1, rank = 0;
    ParamLayout full, local;
    std::vector<TpShard> shards;  // one per tensor, in layout order
    // The local index inside tensor i of the whole tensor's element `e`, or -1 where another
    // rank holds it.
    int64_t local_index(std::size_t i, int64_t e) const;
    // Floats of the whole tensors, and of this rank's pieces of the cut ones.
    std::size_t replicated_floats() const;
    std::size_t sharded_floats() const;
};
// The first tensor (by name) whose int8 / int4 moment blocks (`format`'s cells of block_size
// elements over the flat buffer, cut at tensor ends: optim/state_format.h) do not lie whole in
// one rank's shard as whole cells of the shard's own grid, at some rank of `ranks`; "" when every
// cell does (then each rank quantizes exactly one process's blocks: the same scales and codes).
// A row-parallel matrix needs its slice's row length, and every tensor its offset, on the grid.
// Always "" for fp32 and bf16, which have no blocks.
std::string tp_block_misfit(const ModelConfig& cfg, int ranks, StateFormat format);

// Where each element of this rank's shard (l.local's flat buffer) sits in the whole model's
// (l.full's): runs ascending in the shard, covering it, adjacent runs merged. A cut tensor gives a
// run per piece of a segment for each index of the dimensions before the cut.
std::vector<IndexRun> tp_index_runs(const TpLayout& l);

// The config of one of `ranks` shards (cfg with tp = ranks and sequence_parallel), validated.
ModelConfig tp_shard_config(const ModelConfig& cfg, int ranks, bool sequence_parallel = false);
TpLayout make_tp_layout(const ModelConfig& cfg, int ranks, int rank);

// Copies this rank's piece of tensor i from the whole tensor `whole` into `local`, or writes the
// whole tensor from every rank's pieces (rank r's local tensor at pieces + r x stride: its
// all-gathered unit or flat buffer).
void tp_slice(const TpLayout& l, std::size_t i, const float* whole, float* local);
void tp_assemble(const TpLayout& l, std::size_t i, const float* pieces, std::size_t stride,
                 float* whole);

// The TensorGather of a tensor-parallel rank's optimizer, for the optimizers that step whole
// tensors (Muon's matrices, Adafactor's factors and RMS): a sliced tensor's whole from every
// rank's slice (one all-gather over the tp group, then tp_assemble) and this rank's slice back out
// of a whole (tp_slice). Every rank then steps the same whole tensor to the same bits.
class TpTensorGather final : public TensorGather {
  public:
    TpTensorGather(const TpLayout& l, Communicator& group) : l_(l), group_(group) {}
    void gather(std::size_t tensor, const float* piece, float* whole) override;
    void pick(std::size_t tensor, const float* whole, float* piece) override;

  private:
    const TpLayout& l_;
    Communicator& group_;
    std::vector<float> pieces_;
};

// The tensors whose gradients each rank computes from its sequence shard only under sequence
// parallelism (the norm weights and biases), summed over the group once per step.
bool sp_partial_grad(const std::string& name);

class TpGroup;

// Gradients of units [first_unit, last_unit] of a layout, `grads` pointing at the first unit's
// first float (the units' floats follow one another, as in a pipeline stage's range).
struct UnitGrads {
    int first_unit, last_unit;
    float* grads;
};
// Sequence parallelism: sums the sp_partial_grad tensors' gradients of `ranges` over the group,
// once per step, in one all-reduce (site SpNormGrads) of their floats packed in layout order;
// summed, they are the whole tensors' and the same bits on every rank. A no-op without them.
void sum_sequence_partial_grads(TpGroup& group, const ParamLayout& layout,
                                const std::vector<UnitGrads>& ranges);
// The global L2 norm of a tensor-parallel model's gradients, this rank's shard `grads` in
// l.local's order: the whole tensors' squares once (every rank has the same), the cut ones'
// summed over the group in rank order (the same bits everywhere). A collective of the group.
double tp_grad_norm(const TpLayout& l, const float* grads, TpGroup& group);

// The tensor-parallel group: every rank of `comm` holds one shard; the model runs its collectives
// through it (model/tp_comm.h). Counts each collective and its elements by site.
class TpGroup final : public TpComm {
  public:
    explicit TpGroup(Communicator& comm) : comm_(&comm) {}
    Communicator& comm() const { return *comm_; }
    int rank() const override { return comm_->rank(); }
    int size() const override { return comm_->size(); }
    void all_reduce(TpSite site, float* data, int64_t n) override;
    void all_reduce_max(TpSite site, double* data, int64_t n) override;
    void all_gather(TpSite site, const float* in, float* out, int64_t n) override;
    void reduce_scatter(TpSite site, const float* in, float* out, int64_t n) override;
    void all_gather_shards(TpSite site, const float* in, float* out, int64_t n) override;

    struct Counts {
        std::array<int64_t, kTpSites> calls{}, elements{};
        double seconds = 0;  // wall time inside the collectives (waiting for peers included)
        int64_t calls_at(TpSite s) const { return calls[(int)s]; }
        int64_t elements_at(TpSite s) const { return elements[(int)s]; }
        // Bytes the group's collectives carried: each one's whole buffer (an all-reduce's data,
        // a reduce-scatter's input, an all-gather's output; Gather's per-rank piece), not a
        // ring's traffic.
        int64_t bytes() const;
        // Bytes each rank sends in a ring implementation over `ranks` ranks: (ranks - 1) / ranks
        // of the buffer per reduce-scatter or all-gather, twice that per all-reduce.
        double ring_bytes(int ranks) const;
        // Calls and elements of every site of one collective kind.
        int64_t calls_of(TpOp op) const;
    };
    const Counts& counts() const { return counts_; }
    void reset_counts() { counts_ = {}; }

  private:
    // Counts one collective of n elements at `s` and times `run` (the collective itself).
    template <typename F>
    void counted(TpSite s, int64_t n, F&& run);
    Communicator* comm_;
    Counts counts_;
};

}  // namespace memtrain::dist
