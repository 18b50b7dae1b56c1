// Stable counting sort of token positions by id (see token_buckets.h).
#include "kernels/cuda/token_buckets.h"

#include "core/error.h"

namespace memtrain::cuda {

int bucket_tokens(const int32_t* ids, int N, std::vector<int32_t>& plan) {
    int32_t max_id = 0;
    for (int p = 0; p < N; p++) {
        if (ids[p] < 0) fail("embedding backward: token id {} at position {}", ids[p], p);
        if (ids[p] > max_id) max_id = ids[p];
    }
    // The table has max_id + 2 entries; an id this large is corrupt input, not a vocabulary.
    if (max_id >= (1 << 28)) fail("embedding backward: token id {} is out of range", max_id);
    std::vector<int32_t> start((std::size_t)max_id + 2, 0);
    for (int p = 0; p < N; p++) start[ids[p] + 1]++;
    int U = 0;
    for (int32_t id = 0; id <= max_id; id++) U += start[id + 1] > 0;
    for (int32_t id = 0; id <= max_id; id++) start[id + 1] += start[id];  // start[id]: run start

    plan.assign((std::size_t)N + 2 * U + 1, 0);
    int32_t* order = plan.data();
    int32_t* seg = order + N;
    int32_t* uniq = seg + U + 1;
    std::vector<int32_t> next(start.begin(), start.end() - 1);
    for (int p = 0; p < N; p++) order[next[ids[p]]++] = p;  // positions ascending: stable
    int u = 0;
    for (int32_t id = 0; id <= max_id; id++) {
        if (start[id + 1] > start[id]) {
            seg[u] = start[id];
            uniq[u] = id;
            u++;
        }
    }
    seg[U] = N;
    return U;
}

}  // namespace memtrain::cuda
