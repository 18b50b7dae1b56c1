// Gradients and updated pieces across replicas of a range (see replica_sync.h).
#include "parallel/data/replica_sync.h"

#include <vector>

#include "core/error.h"

namespace memtrain::dist {

ReplicaSync::ReplicaSync(Communicator* data, const ShardSpec& spec, std::size_t count,
                         std::size_t begin, int64_t grain)
    : data_(data && data->size() > 1 ? data : nullptr), count_(count) {
    if (data_ && (dist::sharded(spec.grads) || dist::sharded(spec.params)))
        fail("internal: {} across {} replicas of a range: only the optimizer state is sharded",
             describe(spec), data_->size());
    sharded_ = data_ && dist::sharded(spec.optimizer);
    if (sharded_) {
        const auto pieces =
            grain_shard_ranges((int64_t)begin, (int64_t)(begin + count), data_->size(), grain);
        owned_ = pieces[data_->rank()];
        counts_ = counts_of(pieces);
    } else {
        owned_ = ShardRange{0, (int64_t)count_};
    }
    if (sharded_) piece_ = Buffer<float>((std::size_t)owned_.count, MemCategory::Gradients);
}

float* ReplicaSync::reduce(float* grads) {
    if (!data_) return grads;
    if (!sharded_) {
        data_->all_reduce_sum(grads, (int64_t)count_);
        return grads;
    }
    data_->reduce_scatter_sum(grads, piece_.data(), counts_);
    return piece_.data();
}

void ReplicaSync::gather(float* params) {
    if (!sharded_) return;
    data_->all_gather(params + owned_.offset, params, counts_);
}

double ReplicaSync::mean(double x) {
    if (!data_) return x;
    std::vector<double> all((std::size_t)data_->size());
    data_->all_gather_bytes(&x, all.data(), sizeof(double));
    double sum = 0;
    for (double v : all) sum += v;  // in replica order: the same bits on every rank
    return sum / data_->size();
}

}  // namespace memtrain::dist
