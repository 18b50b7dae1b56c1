// The optimizer on the GPU: the clipping / skipping decision from the gradient norm, and AdamW and
// SGD as multi-tensor kernels (one block per TensorChunk) that read their constants from a
// device-side StepScalars.
//
// Bitwise agreement with the CPU optimizer (optim/optimizer.cpp) needs the same float operations
// with the same roundings. GCC compiles that file at -O2 and above with its default
// -ffp-contract=fast and an FMA-capable -march, and then fuses these multiply-adds (read off its
// x86-64-v3 assembly, GCC 12):
//   AdamW: m = fma(b1, m, (1 - b1) * g); v = fma(b2, v, ((1 - b2) * g) * g);
//          p = fma(p, decay, -((step_size * m) / (sqrt(v) / bc2_sqrt + eps)))
//   SGD:   g' = fma(wd, p, g); b = first ? g' : fma(mu, b, g'); d = nesterov ? fma(b, mu, g') : b;
//          p = fma(-lr, d, p)
// The kernels spell exactly these out with explicitly rounded operations (never contracted
// further by nvcc), so the GPU result does not depend on nvcc's contraction choices. A CPU build
// that does not fuse (GCC at -O0, the sanitizer build) differs from both in the last bits.
#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/optimizer_math.cuh"

namespace memtrain::cuda {

constexpr int kThreads = 256;

// ---- gradient norm -> clip coefficient, skip flag ----------------------------------------------
// clip_grad_norm's coefficient in double: max_norm / (norm + 1e-6) when clipping is on and that
// is below 1, else 1; the norm is s.clip_norm where given (the previous step's), else `norm`.
static __device__ double clip_coefficient(const StepScalars& s, double norm) {
    if (s.clip_norm > 0.0) norm = s.clip_norm;
    if (s.max_norm <= 0.0f) return 1.0;
    const double c = (double)s.max_norm / (norm + 1e-6);
    return c < 1.0 ? c : 1.0;
}

static __global__ void finish_grad_norm_kernel(StepScalars* s, const double* sumsq) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    // clip_grad_norm's arithmetic: the norm and the coefficient in double, the scale applied in
    // float. The stored gradients are loss_scale x the true ones.
    const double norm = sqrt(*sumsq) / (double)s->loss_scale;
    s->grad_norm = (float)norm;
    s->skip = isfinite(norm) ? 0 : 1;
    s->grad_scale = (float)(clip_coefficient(*s, norm) / (double)s->loss_scale);
}

// An update queued before its step's norm is known (optim.step_in_backward without a norm pass):
// clipped by s->clip_norm when given, never skipped.
static __global__ void scale_before_norm_kernel(StepScalars* s) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    s->skip = 0;
    s->grad_scale = (float)(clip_coefficient(*s, 0.0) / (double)s->loss_scale);
}

void finish_grad_norm(StepScalars* s, const double* sumsq, cudaStream_t stream) {
    if (!s || !sumsq) fail("cuda::finish_grad_norm: null scalars or sum of squares");
    MT_LAUNCH(finish_grad_norm_kernel, 1, 32, 0, stream, s, sumsq);
}

void scale_before_norm(StepScalars* s, cudaStream_t stream) {
    if (!s) fail("cuda::scale_before_norm: null scalars");
    MT_LAUNCH(scale_before_norm_kernel, 1, 32, 0, stream, s);
}

// ---- moments in fp32 or bf16 ---------------------------------------------------------------
// One chunk's moment: read as float, written back in its store's format.
struct MomentRef {
    float* f32;
    __nv_bfloat16* b16;
    __device__ __forceinline__ float load(int i) const { return f32 ? f32[i] : to_float(b16[i]); }
    __device__ __forceinline__ void store(int i, float x) const {
        if (f32)
            f32[i] = x;
        else
            b16[i] = from_float<__nv_bfloat16>(x);
    }
};

// The chunk this CUDA block updates and where its moments are: chunks[b] itself, or (st.grid:
// int8 / int4) quantization block k of the chunk whose grid blocks hold b, its span, first code
// byte and scale computed as MomentBuffer::span and code_offset give them.
struct BlockChunk {
    TensorChunk c;
    StateChunk a;  // meaningful where st.at is given
};
__device__ __forceinline__ BlockChunk block_chunk(const MomentStores& st, const TensorChunk* chunks,
                                                  int nchunks) {
    const int b = (int)blockIdx.x;
    if (!st.grid) return {chunks[b], st.at ? st.at[b] : StateChunk{0, 0, 0}};
    int lo = 0, hi = nchunks - 1;  // the last chunk whose first grid block is at most b
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (st.grid[mid].first_block <= b)
            lo = mid;
        else
            hi = mid - 1;
    }
    BlockChunk r{chunks[lo], st.at[lo]};
    const int first_len = st.grid[lo].first_len;
    if (first_len == 0) return r;  // one piece, one CUDA block
    const int k = b - st.grid[lo].first_block, B = st.bits == 8 ? 256 : 128;
    const int start = k == 0 ? 0 : first_len + (k - 1) * B;
    const int rest = r.c.n - start;
    r.c.begin += start;
    r.c.n = k == 0 ? first_len : (rest < B ? rest : B);
    r.a.at +=
        st.bits == 8 ? start : (k == 0 ? 0 : (first_len + 1) / 2 + (int64_t)(k - 1) * (B / 2));
    r.a.scale += k;
    return r;
}

// Chunk c's m and v (a: where they are): indexed like the parameters when st.at is null.
__device__ __forceinline__ void chunk_moments(const MomentStores& st, const TensorChunk& c,
                                              const StateChunk& a, MomentRef* m, MomentRef* v) {
    if (!st.at) {
        *m = {st.m32 + c.begin, nullptr};
        *v = {st.v32 ? st.v32 + c.begin : nullptr, nullptr};
        return;
    }
    if (a.fp32) {
        *m = {st.m32 + a.at, nullptr};
        *v = {st.v32 ? st.v32 + a.at : nullptr, nullptr};
    } else {
        *m = {nullptr, st.m16 + a.at};
        *v = {nullptr, st.v16 ? st.v16 + a.at : nullptr};
    }
}

// ---- block-quantized moments (int8, int4) ----------------------------------------------------
// The code of x / scale, exactly as optim/state_format.cpp's encode_scaled and Encoder give it.
__device__ __forceinline__ uint32_t encode_code_dev(const QuantMap& q, float x, float scale) {
    const float a = scale > 0 ? div_rn(fabsf(x), scale) : 0.0f;
    const float y = mul_rn(a, q.to_map);
    uint32_t c;
    if (y < q.min_normal) {
        c = (uint32_t)rint_rn(mul_rn(y, q.sub_scale));
    } else {
        uint32_t u = __float_as_uint(y);
        const int shift = 23 - q.m;
        u += (1u << (shift - 1)) - 1 + ((u >> shift) & 1u);
        const int exp = (int)(u >> 23) - 127 + q.bias;
        c = ((uint32_t)exp << q.m) | ((u >> shift) & ((1u << q.m) - 1));
    }
    if (!q.is_signed) return c == 0 && a > 0 ? 1u : c;
    if (c == 0) return 0;
    return sign_bit(x) ? c | (1u << (q.bits - 1)) : c;
}

// Element i's code of the block whose codes start at byte `at`.
__device__ __forceinline__ uint32_t load_code(const uint8_t* codes, int64_t at, int i, int bits) {
    if (bits == 8) return codes[at + i];
    return (codes[at + i / 2] >> (4 * (i % 2))) & 0xfu;
}

// The block's scale for the values x of its n threads (the others pass in = false): its largest
// magnitude, NaN when a value is not finite (MomentBuffer::store). A barrier-ending collective.
__device__ float block_scale(float x, bool in, float* shared) {
    const bool bad = in && !isfinite(x);
    float v = in && !bad ? fabsf(x) : 0.0f;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    float r = lane < nwarps ? shared[lane] : 0.0f;
    r = warp_max(r);
    __syncthreads();
    const float nbad = block_sum(bad ? 1.0f : 0.0f, shared);
    return nbad > 0 ? __int_as_float(0x7fc00000) : r;
}

// Encodes the block's values x (thread i < n holds element i) with its scale into the codes at
// byte `at` (int4: two a byte, low nibble first; `staged` holds a code per thread).
__device__ void store_block(uint8_t* codes, int64_t at, int n, const QuantMap& q, float x,
                            float scale, uint8_t* staged) {
    const int i = threadIdx.x;
    const uint32_t c = i < n ? encode_code_dev(q, x, scale) : 0u;
    if (q.bits == 8) {
        if (i < n) codes[at + i] = (uint8_t)c;
        return;
    }
    staged[i] = (uint8_t)c;
    __syncthreads();
    if (i < n && i % 2 == 0)
        codes[at + i / 2] = (uint8_t)(staged[i] | (i + 1 < n ? staged[i + 1] << 4 : 0));
    __syncthreads();
}

// ---- AdamW -------------------------------------------------------------------------------------
// One block per chunk; threads stride over the chunk's floats (coalesced). params[j] is read from
// the master copy when there is one.
template <typename T>
static __global__ void adamw_kernel(T* params, float* master, MomentStores st, const T* grads,
                                    const TensorChunk* chunks, int nchunks, const StepScalars* s,
                                    ParamRounding round) {
    if (s->skip) return;
    const BlockChunk bc = block_chunk(st, chunks, nchunks);
    const TensorChunk c = bc.c;
    const float b1 = s->beta1, b2 = s->beta2, eps = s->eps, step_size = s->step_size,
                bc2_sqrt = s->bc2_sqrt, scale = s->grad_scale;
    const float decay = c.decay ? s->decay_factor : 1.0f;
    const float one_b1 = 1.0f - b1, one_b2 = 1.0f - b2;
    if (st.bits && !bc.a.fp32) {
        // One quantization block, a thread per element: decode, the same update, re-encode.
        __shared__ float shared[32];
        __shared__ uint8_t staged[kThreads];
        const StateChunk a = bc.a;
        const int i = threadIdx.x;
        float mi = 0.0f, vi = 0.0f;
        if (i < c.n) {
            const int64_t j = c.begin + i;
            const float g = mul_rn(to_float(grads[j]), scale);
            const float m0 = mul_rn(st.table_m[load_code(st.mq, a.at, i, st.bits)], st.ms[a.scale]);
            const float v0 = mul_rn(st.table_v[load_code(st.vq, a.at, i, st.bits)], st.vs[a.scale]);
            mi = fma_rn(b1, m0, mul_rn(one_b1, g));
            vi = fma_rn(b2, v0, mul_rn(mul_rn(one_b2, g), g));
            const float denom = add_rn(div_rn(sqrt_rn(vi), bc2_sqrt), eps);
            const float p = master ? master[j] : to_float(params[j]);
            const float pn = fma_rn(p, decay, -div_rn(mul_rn(step_size, mi), denom));
            if (master) master[j] = pn;
            params[j] = round_param<T>(pn, round, s->step, j);
        }
        // Every thread has read its codes and scale before any is written.
        const float ms = block_scale(mi, i < c.n, shared);
        const float vs = block_scale(vi, i < c.n, shared);
        store_block(st.mq, a.at, c.n, st.qm, mi, ms, staged);
        store_block(st.vq, a.at, c.n, st.qv, vi, vs, staged);
        if (i == 0) {
            st.ms[a.scale] = ms;
            st.vs[a.scale] = vs;
        }
        return;
    }
    MomentRef m, v;
    chunk_moments(st, c, bc.a, &m, &v);
    for (int i = threadIdx.x; i < c.n; i += blockDim.x) {
        const int64_t j = c.begin + i;
        const float g = mul_rn(to_float(grads[j]), scale);
        const float mi = fma_rn(b1, m.load(i), mul_rn(one_b1, g));
        const float vi = fma_rn(b2, v.load(i), mul_rn(mul_rn(one_b2, g), g));
        m.store(i, mi);
        v.store(i, vi);
        const float denom = add_rn(div_rn(sqrt_rn(vi), bc2_sqrt), eps);
        const float p = master ? master[j] : to_float(params[j]);
        const float pn = fma_rn(p, decay, -div_rn(mul_rn(step_size, mi), denom));
        if (master) master[j] = pn;
        params[j] = round_param<T>(pn, round, s->step, j);
    }
}

// ---- one moment: SGD's momentum, Muon's ---------------------------------------------------------
// The CUDA block's chunk of a one-moment update: each element's new moment b = update(c, j, old)
// (c: its chunk, j: the range's index; `update` also writes whatever else the element's step
// writes), stored
// in its format: a quantization block (a thread per element) re-encoded with its new largest
// magnitude, fp32 or bf16 element by element.
template <typename F>
__device__ void update_one_moment(const MomentStores& st, const TensorChunk* chunks, int nchunks,
                                  F update) {
    const BlockChunk bc = block_chunk(st, chunks, nchunks);
    const TensorChunk c = bc.c;
    if (st.bits && !bc.a.fp32) {
        __shared__ float shared[32];
        __shared__ uint8_t staged[kThreads];
        const StateChunk a = bc.a;
        const int i = threadIdx.x;
        float b = 0.0f;
        if (i < c.n)
            b = update(c, c.begin + i,
                       mul_rn(st.table_m[load_code(st.mq, a.at, i, st.bits)], st.ms[a.scale]));
        // Every thread has read its code and the scale before any is written.
        const float bs = block_scale(b, i < c.n, shared);
        store_block(st.mq, a.at, c.n, st.qm, b, bs, staged);
        if (i == 0) st.ms[a.scale] = bs;
        return;
    }
    MomentRef buf, unused;
    chunk_moments(st, c, bc.a, &buf, &unused);
    for (int i = threadIdx.x; i < c.n; i += blockDim.x)
        buf.store(i, update(c, c.begin + i, buf.load(i)));
}

// SGD with momentum.
template <typename T>
static __global__ void sgd_kernel(T* params, float* master, MomentStores st, const T* grads,
                                  const TensorChunk* chunks, int nchunks, const StepScalars* s,
                                  ParamRounding round) {
    if (s->skip) return;
    const float mu = s->momentum, lr = s->lr, scale = s->grad_scale;
    const bool first = s->first_step != 0, nesterov = s->nesterov != 0;
    const int64_t step = s->step;
    const float weight_decay = s->weight_decay;
    update_one_moment(st, chunks, nchunks, [&](const TensorChunk& c, int64_t j, float b0) {
        const float wd = c.decay ? weight_decay : 0.0f;
        const float p = master ? master[j] : to_float(params[j]);
        const float g = fma_rn(wd, p, mul_rn(to_float(grads[j]), scale));
        const float b = first ? g : fma_rn(mu, b0, g);
        const float d = nesterov ? fma_rn(b, mu, g) : b;
        const float pn = fma_rn(-lr, d, p);
        if (master) master[j] = pn;
        params[j] = round_param<T>(pn, round, step, j);
        return b;
    });
}

// Muon's momentum over one matrix's chunks: buf = lerp(buf, g, 1 - mu) stored in its format, and
// the Nesterov direction u = lerp(g, buf, mu) written to u[j - u_begin] in fp32.
template <typename T>
static __global__ void muon_momentum_kernel(float* u, int64_t u_begin, MomentStores st,
                                            const T* grads, const TensorChunk* chunks, int nchunks,
                                            const StepScalars* s) {
    if (s->skip) return;
    const float mu = s->muon_momentum, one_mu = 1.0f - mu, scale = s->grad_scale;
    update_one_moment(st, chunks, nchunks, [&](const TensorChunk&, int64_t j, float b0) {
        const float g = mul_rn(to_float(grads[j]), scale);
        const float b = fma_rn(one_mu, add_rn(g, -b0), b0);
        u[j - u_begin] = fma_rn(mu, add_rn(b, -g), g);
        return b;
    });
}

// ---- entries -----------------------------------------------------------------------------------
// The CUDA blocks of a step: one per chunk, or (int8 / int4) the grid's count.
static unsigned grid_blocks(const MomentStores& st, int nchunks) {
    if (!st.grid) return (unsigned)nchunks;
    if (!st.bits || !st.at || st.blocks < nchunks)
        fail("cuda: an optimizer grid of {} blocks for {} chunks without quantized moments",
             st.blocks, nchunks);
    return grid_x(st.blocks, "the optimizer's quantization blocks");
}
template <typename T>
void adamw_step(T* params, float* master, const MomentStores& st, const T* grads,
                const TensorChunk* chunks, int nchunks, const StepScalars* s, cudaStream_t stream,
                const ParamRounding& round) {
    check_step("adamw_step", params, master, grads, chunks, nchunks, s, round);
    if (nchunks == 0) return;
    if (!st.at ? (!st.m32 || !st.v32)
               : !((st.m32 && st.v32) || (st.m16 && st.v16) || (st.mq && st.vq && st.ms && st.vs)))
        fail("cuda::adamw_step: null moment buffers");
    if (st.bits && (!st.at || !st.table_m || !st.table_v))
        fail("cuda::adamw_step: block-quantized moments without their table or maps");
    MT_LAUNCH(adamw_kernel<T>, grid_blocks(st, nchunks), kThreads, 0, stream, params, master, st,
              grads, chunks, nchunks, s, round);
}

template <typename T>
void adamw_step(T* params, float* master, float* m, float* v, const T* grads,
                const TensorChunk* chunks, int nchunks, const StepScalars* s, cudaStream_t stream) {
    MomentStores st;
    st.m32 = m;
    st.v32 = v;
    adamw_step<T>(params, master, st, grads, chunks, nchunks, s, stream);
}

template <typename T>
void sgd_step(T* params, float* master, const MomentStores& st, const T* grads,
              const TensorChunk* chunks, int nchunks, const StepScalars* s, cudaStream_t stream,
              const ParamRounding& round) {
    check_step("sgd_step", params, master, grads, chunks, nchunks, s, round);
    if (nchunks == 0) return;
    if (!st.at ? !st.m32 : !(st.m32 || st.m16 || (st.mq && st.ms)))
        fail("cuda::sgd_step: null momentum buffer");
    if (st.bits && !st.table_m) fail("cuda::sgd_step: block-quantized momentum without its table");
    MT_LAUNCH(sgd_kernel<T>, grid_blocks(st, nchunks), kThreads, 0, stream, params, master, st,
              grads, chunks, nchunks, s, round);
}

template <typename T>
void sgd_step(T* params, float* master, float* momentum, const T* grads, const TensorChunk* chunks,
              int nchunks, const StepScalars* s, cudaStream_t stream) {
    MomentStores st;
    st.m32 = momentum;
    sgd_step<T>(params, master, st, grads, chunks, nchunks, s, stream);
}

template <typename T>
void muon_momentum(float* u, int64_t u_begin, const MomentStores& st, const T* grads,
                   const TensorChunk* chunks, int nchunks, const StepScalars* s,
                   cudaStream_t stream) {
    if (nchunks <= 0) fail("cuda::muon_momentum: nchunks is {}, expected > 0", nchunks);
    if (!u || !grads || !chunks || !s || !st.at) fail("cuda::muon_momentum: null argument");
    if (!(st.m32 || st.m16 || (st.mq && st.ms)) || (st.bits && !st.table_m))
        fail("cuda::muon_momentum: null momentum buffer");
    MT_LAUNCH(muon_momentum_kernel<T>, grid_blocks(st, nchunks), kThreads, 0, stream, u, u_begin,
              st, grads, chunks, nchunks, s);
}

#define MT_INSTANTIATE(T)                                                                         \
    template void muon_momentum<T>(float*, int64_t, const MomentStores&, const T*,                \
                                   const TensorChunk*, int, const StepScalars*, cudaStream_t);    \
    template void adamw_step<T>(T*, float*, float*, float*, const T*, const TensorChunk*, int,    \
                                const StepScalars*, cudaStream_t);                                \
    template void adamw_step<T>(T*, float*, const MomentStores&, const T*, const TensorChunk*,    \
                                int, const StepScalars*, cudaStream_t, const ParamRounding&);     \
    template void sgd_step<T>(T*, float*, float*, const T*, const TensorChunk*, int,              \
                              const StepScalars*, cudaStream_t);                                  \
    template void sgd_step<T>(T*, float*, const MomentStores&, const T*, const TensorChunk*, int, \
                              const StepScalars*, cudaStream_t, const ParamRounding&);
MT_INSTANTIATE(float)
MT_INSTANTIATE(__nv_bfloat16)
MT_INSTANTIATE(__half)
#undef MT_INSTANTIATE

}  // namespace memtrain::cuda
