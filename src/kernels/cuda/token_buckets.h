// Host half of the deterministic embedding backward on the GPU (kernels/cuda/embedding.cu): the
// B*T token positions grouped by id with a stable counting sort, so one GPU block per distinct id
// can sum its positions' gradients in (b, t) order without atomics. Plain C++, built everywhere.
#pragma once

#include <cstdint>
#include <vector>

namespace memtrain::cuda {

// Fills `plan` with three arrays back to back, for the N ids of `ids` and U distinct ids:
//   order (N): every position, sorted by (id, position);
//   seg (U + 1): run u of `order` is [seg[u], seg[u + 1]); seg[U] = N;
//   uniq (U): the id of run u, increasing.
// Returns U. Fails (memtrain::Error) on a negative id or one of 2^28 or more.
int bucket_tokens(const int32_t* ids, int N, std::vector<int32_t>& plan);

}  // namespace memtrain::cuda
