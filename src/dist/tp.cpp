// Tensor parallelism: the cut of each tensor, the counted group, and the vocabulary-parallel
// embedding and cross-entropy (see tp.h).
#include "dist/tp.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

#include "core/error.h"

namespace memtrain::dist {

namespace {

// The cut of the whole model's tensor `name` (see tp.h's table).
TpShard shard_of(const ModelConfig& c, std::string_view name) {
    const int64_t C = c.n_embd, KV = (int64_t)c.kv_heads() * c.head_dim(), H = c.mlp_hidden();
    auto ends = [&](std::string_view s) { return name.ends_with(s); };
    if (name == "wte.weight" || name == "lm_head.weight") return {0, {c.padded_vocab()}};
    if (ends("attn.c_attn.weight")) return {1, {C, KV, KV}};
    if (ends("attn.c_attn.bias")) return {0, {C, KV, KV}};
    if (ends("attn.c_proj.weight")) return {0, {C}};
    const std::vector<int64_t> fc = c.swiglu() ? std::vector<int64_t>{H, H} : std::vector{H};
    if (ends("mlp.c_fc.weight")) return {1, fc};
    if (ends("mlp.c_fc.bias")) return {0, fc};
    if (ends("mlp.c_proj.weight")) return {0, {H}};
    return {};
}

// Which rank holds element e of the whole tensor `spec` cut by `sh` over T ranks, and where in
// that rank's local tensor.
std::pair<int, int64_t> locate(const ParamSpec& spec, const TpShard& sh, int T, int64_t e) {
    if (!sh.split()) return {-1, e};
    const int64_t along = spec.shape[sh.dim];
    int64_t inner = 1;
    for (std::size_t d = sh.dim + 1; d < spec.shape.size(); d++) inner *= spec.shape[d];
    const int64_t o = e / (along * inner), a = (e / inner) % along, in = e % inner;
    int64_t start = 0, local_start = 0;
    for (int64_t s : sh.segments) {
        const int64_t piece = s / T;
        if (a < start + s) {
            const int r = (int)((a - start) / piece);
            const int64_t la = local_start + (a - start) % piece;
            return {r, (o * (along / T) + la) * inner + in};
        }
        start += s;
        local_start += piece;
    }
    fail("internal: element {} of {} lies outside its segments", e, spec.name);
}

}  // namespace

ModelConfig tp_shard_config(const ModelConfig& cfg, int ranks, bool sequence_parallel) {
    ModelConfig c = cfg;
    c.tp = ranks;
    c.sequence_parallel = sequence_parallel;
    c.validate();
    return c;
}

TpLayout make_tp_layout(const ModelConfig& cfg, int ranks, int rank) {
    if (cfg.tp != 1) fail("internal: make_tp_layout takes the whole model's config");
    TpLayout l;
    l.ranks = ranks;
    l.rank = rank;
    l.full = make_param_layout(cfg);
    l.local = make_param_layout(tp_shard_config(cfg, ranks));
    if (l.full.tensors.size() != l.local.tensors.size())
        fail("internal: the shard layout has {} tensors, the model {}", l.local.tensors.size(),
             l.full.tensors.size());
    for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
        const ParamSpec &f = l.full.tensors[i], &s = l.local.tensors[i];
        l.shards.push_back(shard_of(cfg, f.name));
        const std::size_t want = l.shards.back().split() ? f.numel / ranks : f.numel;
        if (f.name != s.name || s.numel != want)
            fail("internal: shard tensor {} ({} floats) does not match {} ({} / {})", s.name,
                 s.numel, f.name, f.numel, ranks);
    }
    return l;
}

int64_t TpLayout::local_index(std::size_t i, int64_t e) const {
    const auto [r, li] = locate(full.tensors[i], shards[i], ranks, e);
    return r < 0 || r == rank ? li : -1;
}

std::size_t TpLayout::replicated_floats() const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < shards.size(); i++)
        if (!shards[i].split()) n += local.tensors[i].numel;
    return n;
}

std::size_t TpLayout::sharded_floats() const {
    return local.total - replicated_floats();
}

void tp_slice(const TpLayout& l, std::size_t i, const float* whole, float* local) {
    const ParamSpec& f = l.full.tensors[i];
    if (!l.shards[i].split()) {
        std::memcpy(local, whole, sizeof(float) * f.numel);
        return;
    }
    for (int64_t e = 0; e < (int64_t)f.numel; e++) {
        const auto [r, li] = locate(f, l.shards[i], l.ranks, e);
        if (r == l.rank) local[li] = whole[e];
    }
}

void tp_assemble(const TpLayout& l, std::size_t i, const float* pieces, std::size_t stride,
                 float* whole) {
    const ParamSpec& f = l.full.tensors[i];
    if (!l.shards[i].split()) {
        std::memcpy(whole, pieces, sizeof(float) * f.numel);  // rank 0's copy
        return;
    }
    for (int64_t e = 0; e < (int64_t)f.numel; e++) {
        const auto [r, li] = locate(f, l.shards[i], l.ranks, e);
        whole[e] = pieces[r * stride + li];
    }
}

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

bool sp_partial_grad(const std::string& name) {
    for (const char* n :
         {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias"})
        if (name.ends_with(n)) return true;
    return false;
}

template <typename F>
void TpGroup::counted(TpSite s, int64_t n, F&& run) {
    counts_.calls[(int)s]++;
    counts_.elements[(int)s] += n;
    const auto t0 = std::chrono::steady_clock::now();
    run();
    counts_.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void TpGroup::all_reduce(TpSite site, float* data, int64_t n) {
    counted(site, n, [&] { comm_->all_reduce_sum(data, n); });
}

void TpGroup::all_reduce_max(TpSite site, double* data, int64_t n) {
    counted(site, n, [&] { comm_->all_reduce_max(data, n); });
}

void TpGroup::all_gather(TpSite site, const float* in, float* out, int64_t n) {
    const std::vector<int64_t> counts((std::size_t)size(), n);
    counted(site, n, [&] { comm_->all_gather(in, out, counts); });
}

void TpGroup::reduce_scatter(TpSite site, const float* in, float* out, int64_t n) {
    if (n % size() != 0) fail("internal: a reduce-scatter of {} floats over {} ranks", n, size());
    const std::vector<int64_t> counts((std::size_t)size(), n / size());
    counted(site, n, [&] { comm_->reduce_scatter_sum(in, out, counts); });
}

void TpGroup::all_gather_shards(TpSite site, const float* in, float* out, int64_t n) {
    if (n % size() != 0) fail("internal: an all-gather of {} floats over {} ranks", n, size());
    const std::vector<int64_t> counts((std::size_t)size(), n / size());
    counted(site, n, [&] { comm_->all_gather(in, out, counts); });
}

double TpGroup::Counts::ring_bytes(int ranks) const {
    double b = 0;
    const double share = (double)(ranks - 1) / ranks;
    for (int s = 0; s < kTpSites; s++) {
        const double bytes = (double)elements[s] * (s == (int)TpSite::LossMax ? 8 : 4);
        if (s == (int)TpSite::Gather)
            b += bytes * (ranks - 1);  // counted per rank: every other rank's piece arrives
        else
            b += bytes * share * (tp_site_op((TpSite)s) == TpOp::AllReduce ? 2 : 1);
    }
    return b;
}

int64_t TpGroup::Counts::calls_of(TpOp op) const {
    int64_t n = 0;
    for (int s = 0; s < kTpSites; s++)
        if (tp_site_op((TpSite)s) == op) n += calls[s];
    return n;
}

int64_t TpGroup::Counts::bytes() const {
    int64_t b = 0;
    for (int s = 0; s < kTpSites; s++)
        b += elements[s] * (s == (int)TpSite::LossMax ? (int64_t)sizeof(double) : 4);
    return b;
}

void vocab_parallel_embedding(TpGroup& tp, float* out, const int32_t* inp, const float* wte_local,
                              const float* wpe, int B, int T, int C, int v0, int Vl,
                              float* sp_scratch) {
    const int64_t N = (int64_t)B * T;
    float* lookup = sp_scratch ? sp_scratch : out;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float* o = lookup + n * C;
        const int32_t v = inp[n] - v0;
        if (v >= 0 && v < Vl)
            std::memcpy(o, wte_local + (int64_t)v * C, sizeof(float) * C);
        else
            std::memset(o, 0, sizeof(float) * C);
    }
    // This rank's rows [row0, row0 + rows) of the sum: all of them, or its sequence shard.
    int64_t row0 = 0, rows = N;
    if (sp_scratch) {
        rows = N / tp.size();
        row0 = rows * tp.rank();
        tp.reduce_scatter(TpSite::SpEmbedding, sp_scratch, out, N * C);
    } else {
        tp.all_reduce(TpSite::Embedding, out, N * C);
    }
    if (!wpe) return;
        // The same sum as cpu::embedding_forward's (the other ranks added exact zeros), at each
        // row's position in its sequence.
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        float* o = out + n * C;
        const float* p = wpe + ((row0 + n) % T) * C;
        for (int i = 0; i < C; i++) o[i] += p[i];
    }
}

void vocab_parallel_embedding_backward(float* dwte_local, float* dwpe, const float* dout,
                                       const int32_t* inp, int B, int T, int C, int v0, int Vl) {
    // As cpu::embedding_backward: threads split the channels, every element summed in (b, t)
    // order.
    constexpr int kBlock = 32;
    const int nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
    for (int blk = 0; blk < nblocks; blk++) {
        const int i0 = blk * kBlock, i1 = std::min(C, i0 + kBlock);
        for (int64_t n = 0; n < (int64_t)B * T; n++) {
            const float* d = dout + n * C;
            const int32_t v = inp[n] - v0;
            if (v >= 0 && v < Vl) {
                float* e = dwte_local + (int64_t)v * C;
                for (int i = i0; i < i1; i++) e[i] += d[i];
            }
            if (dwpe) {
                float* p = dwpe + (n % T) * C;
                for (int i = i0; i < i1; i++) p[i] += d[i];
            }
        }
    }
}

double vocab_parallel_loss(TpGroup& tp, float* dx, float* dwte_local, float* logits_buf,
                           const float* x, const float* wte_local, const int32_t* targets, int N,
                           int C, int V, int v0, int Vl, int chunk, float grad_scale,
                           float* dx_rows) {
    // Columns of this slice inside the real vocabulary (the rest are padding rows).
    const int real = std::clamp(V - v0, 0, Vl);
    double total = 0.0;
    std::vector<double> maxv(chunk);
    std::vector<float> sums(2 * (std::size_t)chunk);
    for (int r0 = 0; r0 < N; r0 += chunk) {
        const int R = std::min(chunk, N - r0);
        const float* xr = x + (int64_t)r0 * C;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, R, Vl, C, 1.0f, xr, C, wte_local, C,
                    0.0f, logits_buf, Vl);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < R; r++) {
            const float* l = logits_buf + (int64_t)r * Vl;
            float m = -INFINITY;
            for (int v = 0; v < real; v++) m = std::max(m, l[v]);
            maxv[r] = m;
        }
        tp.all_reduce_max(TpSite::LossMax, maxv.data(), R);
#pragma omp parallel for schedule(static)
        for (int r = 0; r < R; r++) {
            const float* l = logits_buf + (int64_t)r * Vl;
            const float m = (float)maxv[r];
            double s = 0.0;
            for (int v = 0; v < real; v++) s += std::exp((double)(l[v] - m));
            const int y = targets[r0 + r] - v0;
            sums[r] = (float)s;
            sums[R + r] = y >= 0 && y < real ? l[y] : 0.0f;
        }
        tp.all_reduce(TpSite::LossSum, sums.data(), 2 * (int64_t)R);
        for (int r = 0; r < R; r++) {
            const double lse = (float)maxv[r] + std::log((double)sums[r]);
            total += lse - sums[R + r];
            if (!dx) continue;
            // dlogits = (softmax - onehot) * grad_scale; padded columns get no gradient.
            float* l = logits_buf + (int64_t)r * Vl;
            for (int v = 0; v < real; v++) l[v] = (float)(std::exp(l[v] - lse) * grad_scale);
            for (int v = real; v < Vl; v++) l[v] = 0.0f;
            const int y = targets[r0 + r] - v0;
            if (y >= 0 && y < real) l[y] -= grad_scale;
        }
        if (dx) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, R, C, Vl, 1.0f, logits_buf, Vl,
                        wte_local, C, 0.0f, dx + (int64_t)r0 * C, C);
            if (dwte_local)
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Vl, C, R, 1.0f, logits_buf, Vl,
                            xr, C, 1.0f, dwte_local, C);
        }
    }
    if (dx && dx_rows)
        tp.reduce_scatter(TpSite::SpHeadScatter, dx, dx_rows, (int64_t)N * C);
    else if (dx)
        tp.all_reduce(TpSite::HeadBackward, dx, (int64_t)N * C);
    return total;
}

void vocab_parallel_logits(TpGroup& tp, float* out, const float* x, const float* wte_local, int N,
                           int C, int V, int Vl) {
    std::vector<float> mine((std::size_t)N * Vl), all((std::size_t)N * Vl * tp.size());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, Vl, C, 1.0f, x, C, wte_local, C, 0.0f,
                mine.data(), Vl);
    tp.all_gather(TpSite::Gather, mine.data(), all.data(), (int64_t)N * Vl);
    for (int64_t n = 0; n < N; n++)
        for (int v = 0; v < V; v++) out[n * V + v] = all[((int64_t)(v / Vl) * N + n) * Vl + v % Vl];
}

}  // namespace memtrain::dist
