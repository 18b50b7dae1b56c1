// What the model asks of its tensor-parallel group: the collectives Megatron inserts between the
// shards (parallel/tensor/tp.h has the cut and the tables), each named by the site that calls it.
// The model holds this interface only; parallel/tensor's TpGroup implements it over a
// communicator and counts every call.
#pragma once

#include <cstdint>

namespace memtrain {

// Where a tensor-parallel collective sits (parallel/tensor/tp.h has the tables), for the counters.
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
class TpComm {
  public:
    virtual ~TpComm() = default;
    virtual int rank() const = 0;
    virtual int size() const = 0;
    virtual void all_reduce(TpSite site, float* data, int64_t n) = 0;
    virtual void all_reduce_max(TpSite site, double* data, int64_t n) = 0;
    // Every rank's n floats, rank r's at out + r n.
    virtual void all_gather(TpSite site, const float* in, float* out, int64_t n) = 0;
    // Sequence parallelism's pair, n the whole buffer (divisible by size()), each counted as n
    // elements: `in` (n floats on every rank) summed, rank r keeping its n / size() floats
    // [r n / size(), ..) in `out`; and every rank's n / size() floats `in` gathered into `out`
    // (n floats, rank r's at r n / size()).
    virtual void reduce_scatter(TpSite site, const float* in, float* out, int64_t n) = 0;
    virtual void all_gather_shards(TpSite site, const float* in, float* out, int64_t n) = 0;
};

}  // namespace memtrain
