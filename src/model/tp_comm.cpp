// The names and kinds of the tensor-parallel sites (model/tp_comm.h).
#include "model/tp_comm.h"

namespace memtrain {

const char* tp_site_name(TpSite s) {
    static constexpr const char* kNames[kTpSites] = {
        "embedding (fwd)",
        "row-parallel (fwd)",
        "column-parallel (bwd)",
        "loss max (fwd)",
        "loss sums (fwd)",
        "classifier (bwd)",
        "gather",
        "sp embedding reduce-scatter (fwd)",
        "sp row-parallel reduce-scatter (fwd)",
        "sp column-parallel all-gather (fwd)",
        "sp ln_f all-gather (fwd)",
        "sp classifier reduce-scatter (bwd)",
        "sp row-parallel all-gather (bwd)",
        "sp column-parallel reduce-scatter (bwd)",
        "sp norm re-gather (bwd)",
        "sp embedding all-gather (bwd)",
        "sp norm gradients all-reduce (step)",
    };
    return kNames[(int)s];
}

TpOp tp_site_op(TpSite s) {
    switch (s) {
        case TpSite::Gather:
        case TpSite::SpColumnGather:
        case TpSite::SpHeadGather:
        case TpSite::SpRowGather:
        case TpSite::SpRegather:
        case TpSite::SpEmbeddingGather:
            return TpOp::AllGather;
        case TpSite::SpEmbedding:
        case TpSite::SpRowScatter:
        case TpSite::SpHeadScatter:
        case TpSite::SpColumnScatter:
            return TpOp::ReduceScatter;
        default:
            return TpOp::AllReduce;
    }
}

}  // namespace memtrain
