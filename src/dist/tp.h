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

#include "dist/communicator.h"
#include "model/config.h"
#include "model/param_layout.h"

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
// The config of one of `ranks` shards (cfg with tp = ranks and sequence_parallel), validated.
ModelConfig tp_shard_config(const ModelConfig& cfg, int ranks, bool sequence_parallel = false);
TpLayout make_tp_layout(const ModelConfig& cfg, int ranks, int rank);

// Copies this rank's piece of tensor i from the whole tensor `whole` into `local`, or writes the
// whole tensor from every rank's pieces (rank r's local tensor at pieces + r x stride: its
// all-gathered unit or flat buffer).
void tp_slice(const TpLayout& l, std::size_t i, const float* whole, float* local);
void tp_assemble(const TpLayout& l, std::size_t i, const float* pieces, std::size_t stride,
                 float* whole);

// Where a tensor-parallel collective sits, for the counters.
enum class TpSite : int {
    Embedding,       // forward: the vocabulary-parallel lookup (g)
    RowForward,      // forward: after each row-parallel GEMM (g)
    ColumnBackward,  // backward: the input gradient of each column-parallel GEMM (f)
    LossMax,         // forward: the vocabulary-parallel cross-entropy's logit max (doubles)
    LossSum,         // forward: its sum of exps and target logit
    HeadBackward,    // backward: the input gradient of the vocabulary-parallel classifier (f)
    Gather,          // logits for sampling, weights and optimizer state for checkpoints
    // Sequence parallelism (the header's second table).
    SpEmbedding,        // forward: reduce-scatter of the vocabulary-parallel lookup
    SpRowScatter,       // forward: reduce-scatter after each row-parallel GEMM
    SpColumnGather,     // forward: all-gather of the norm output before each column-parallel GEMM
    SpHeadGather,       // forward: all-gather of ln_f's output before the classifier
    SpHeadScatter,      // backward: reduce-scatter of the classifier's input gradient
    SpRowGather,        // backward: all-gather of d(output) before each row-parallel GEMM
    SpColumnScatter,    // backward: reduce-scatter of each column-parallel GEMM's input gradient
    SpRegather,         // backward: all-gather of the saved norm shard for the weight gradient
    SpEmbeddingGather,  // backward: all-gather of d(embedding output)
    SpNormGrads,        // step: all-reduce of the norm weights' partial gradients
};
inline constexpr int kTpSites = 17;
const char* tp_site_name(TpSite s);
enum class TpOp : int { AllReduce, ReduceScatter, AllGather };
TpOp tp_site_op(TpSite s);
// The tensors whose gradients each rank computes from its sequence shard only under sequence
// parallelism (the norm weights and biases), summed over the group once per step.
bool sp_partial_grad(const std::string& name);

// The tensor-parallel group: every rank of `comm` holds one shard. Counts each collective and
// its elements by site.
class TpGroup {
  public:
    explicit TpGroup(Communicator& comm) : comm_(&comm) {}
    Communicator& comm() const { return *comm_; }
    int rank() const { return comm_->rank(); }
    int size() const { return comm_->size(); }
    void all_reduce(TpSite site, float* data, int64_t n);
    void all_reduce_max(TpSite site, double* data, int64_t n);
    // Every rank's n floats, rank r's at out + r n.
    void all_gather(TpSite site, const float* in, float* out, int64_t n);
    // Sequence parallelism's pair, n the whole buffer (divisible by size()), each counted as n
    // elements: `in` (n floats on every rank) summed, rank r keeping its n / size() floats
    // [r n / size(), ..) in `out`; and every rank's n / size() floats `in` gathered into `out`
    // (n floats, rank r's at r n / size()).
    void reduce_scatter(TpSite site, const float* in, float* out, int64_t n);
    void all_gather_shards(TpSite site, const float* in, float* out, int64_t n);

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

// Vocabulary-parallel embedding forward: out (N,C) = the rows of `wte_local` (Vl,C) for the
// tokens in [v0, v0 + Vl), zero for the others, all-reduced, then + wpe[t] when wpe is not null.
// With `sp_scratch` (N,C) (sequence parallelism) the lookup goes there and is reduce-scattered:
// `out` receives this rank's N / size() rows only, each + wpe at its global position.
void vocab_parallel_embedding(TpGroup& tp, float* out, const int32_t* inp, const float* wte_local,
                              const float* wpe, int B, int T, int C, int v0, int Vl,
                              float* sp_scratch = nullptr);
// Its backward: dwte_local += dout rows of the owned tokens; dwpe += dout (every rank the same).
void vocab_parallel_embedding_backward(float* dwte_local, float* dwpe, const float* dout,
                                       const int32_t* inp, int B, int T, int C, int v0, int Vl);

// cpu::classifier_loss over the vocabulary slice [v0, v0 + Vl) of each rank (wte_local (Vl,C)),
// never gathering the logits: the row max, sum of exps and target logit are combined across the
// group. Returns the sum of the rows' losses (the same on every rank). With dx, also the
// backward: dx (N,C) overwritten with the all-reduced input gradient, dwte_local accumulated;
// with `dx_rows` too (sequence parallelism), dx is reduce-scattered instead: dx_rows receives
// this rank's N / size() rows of the sum (it may alias x, which is read before).
double vocab_parallel_loss(TpGroup& tp, float* dx, float* dwte_local, float* logits_buf,
                           const float* x, const float* wte_local, const int32_t* targets, int N,
                           int C, int V, int v0, int Vl, int chunk, float grad_scale,
                           float* dx_rows = nullptr);
// The full logits (N,V) for sampling: each rank's slice (rank r's from r x Vl), all-gathered.
void vocab_parallel_logits(TpGroup& tp, float* out, const float* x, const float* wte_local, int N,
                           int C, int V, int Vl);

}  // namespace memtrain::dist
