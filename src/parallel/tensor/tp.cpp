// Tensor parallelism: the cut of each tensor, the counted group, and the vocabulary-parallel
// embedding and cross-entropy (see tp.h).
#include "parallel/tensor/tp.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string_view>
#include <utility>

#include "core/allocator.h"
#include "core/error.h"
#include "kernels/cpu/ops.h"

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
        const ParamSpec& f = l.full.tensors[i];
        ParamSpec& s = l.local.tensors[i];
        l.shards.push_back(shard_of(cfg, f.name));
        const std::size_t want = l.shards.back().split() ? f.numel / ranks : f.numel;
        if (f.name != s.name || s.numel != want)
            fail("internal: shard tensor {} ({} floats) does not match {} ({} / {})", s.name,
                 s.numel, f.name, f.numel, ranks);
        s.whole_numel = f.numel;
        s.whole_shape = f.shape;
    }
    return l;
}

namespace {

// Rank r's runs of tensor i: fn(e, le, len) for each, e and le where the run starts in the whole
// tensor and in the rank's piece of it, in the piece's order. A cut tensor has a run per piece of
// a segment for each index of the dimensions before the cut; a whole one is one run. Stops and
// returns false where fn does.
template <class Fn>
bool for_each_run(const TpLayout& l, std::size_t i, std::size_t r, Fn fn) {
    const ParamSpec& f = l.full.tensors[i];
    const TpShard& sh = l.shards[i];
    if (!sh.split()) return fn(std::size_t{0}, std::size_t{0}, f.numel);
    const std::size_t along = (std::size_t)f.shape[(std::size_t)sh.dim], T = (std::size_t)l.ranks;
    std::size_t inner = 1;
    for (std::size_t d = (std::size_t)sh.dim + 1; d < f.shape.size(); d++)
        inner *= (std::size_t)f.shape[d];
    const std::size_t outer = f.numel / (along * inner);
    for (std::size_t o = 0; o < outer; o++) {
        std::size_t start = 0, local_start = 0;
        for (int64_t seg : sh.segments) {
            const std::size_t piece = (std::size_t)seg / T;
            if (!fn((o * along + start + r * piece) * inner,
                    (o * (along / T) + local_start) * inner, piece * inner))
                return false;
            start += (std::size_t)seg;
            local_start += piece;
        }
    }
    return true;
}

}  // namespace

std::vector<IndexRun> tp_index_runs(const TpLayout& l) {
    std::vector<IndexRun> runs;
    for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
        const std::size_t global = l.full.tensors[i].offset, local = l.local.tensors[i].offset;
        for_each_run(l, i, (std::size_t)l.rank, [&](std::size_t e, std::size_t le, std::size_t n) {
            IndexRun* last = runs.empty() ? nullptr : &runs.back();
            if (n == 0) return true;
            if (last && last->local + last->n == local + le && last->global + last->n == global + e)
                last->n += n;
            else
                runs.push_back({local + le, global + e, n});
            return true;
        });
    }
    return runs;
}

std::string tp_block_misfit(const ModelConfig& cfg, int ranks, StateFormat format) {
    const std::size_t B = block_size(format);
    if (B == 0 || ranks <= 1) return "";
    // Every rank's shard has the same layout; a tensor is a sequence of runs (for_each_run), each
    // contiguous in the whole tensor and in its rank's. The cells inside a run map one to one
    // where the run starts and ends on both grids and the two grids agree inside it.
    const TpLayout l = make_tp_layout(cfg, ranks, 0);
    for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
        const ParamSpec& f = l.full.tensors[i];
        const ParamSpec& s = l.local.tensors[i];
        if (keeps_fp32(format, s)) continue;
        auto fits = [&](std::size_t e, std::size_t le, std::size_t len) {
            auto edge = [&](std::size_t off, std::size_t x, std::size_t n) {
                return x == 0 || x == n || (off + x) % B == 0;
            };
            return edge(f.offset, e, f.numel) && edge(f.offset, e + len, f.numel) &&
                   edge(s.offset, le, s.numel) && edge(s.offset, le + len, s.numel) &&
                   (f.offset + e) % B == (s.offset + le) % B;
        };
        for (std::size_t r = 0; r < (std::size_t)ranks; r++)
            if (!for_each_run(l, i, r, fits)) return f.name;
    }
    return "";
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

void TpTensorGather::gather(std::size_t tensor, const float* piece, float* whole) {
    const std::size_t n = l_.local.tensors.at(tensor).numel;
    pieces_.resize(n * (std::size_t)l_.ranks);
    const std::vector<int64_t> counts((std::size_t)l_.ranks, (int64_t)n);
    group_.all_gather(piece, pieces_.data(), counts);
    tp_assemble(l_, tensor, pieces_.data(), n, whole);
}

void TpTensorGather::pick(std::size_t tensor, const float* whole, float* piece) {
    tp_slice(l_, tensor, whole, piece);
}

bool sp_partial_grad(const std::string& name) {
    for (const char* n :
         {"ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "ln_f.weight", "ln_f.bias"})
        if (name.ends_with(n)) return true;
    return false;
}

void sum_sequence_partial_grads(TpGroup& group, const ParamLayout& layout,
                                const std::vector<UnitGrads>& ranges) {
    std::vector<std::pair<float*, std::size_t>> at;  // each tensor's gradients and size
    std::size_t n = 0;
    for (const UnitGrads& r : ranges)
        for (int u = r.first_unit; u <= r.last_unit; u++)
            for (std::size_t i = layout.units[u].first_tensor; i < layout.units[u].last_tensor;
                 i++) {
                const ParamSpec& t = layout.tensors[i];
                if (!sp_partial_grad(t.name)) continue;
                at.emplace_back(r.grads + (t.offset - layout.units[r.first_unit].begin), t.numel);
                n += t.numel;
            }
    if (n == 0) return;
    Buffer<float> packed(n, MemCategory::Communication);
    std::size_t k = 0;
    for (const auto& [g, len] : at) {
        std::memcpy(packed.data() + k, g, sizeof(float) * len);
        k += len;
    }
    group.all_reduce(TpSite::SpNormGrads, packed.data(), (int64_t)n);
    k = 0;
    for (const auto& [g, len] : at) {
        std::memcpy(g, packed.data() + k, sizeof(float) * len);
        k += len;
    }
}

double tp_grad_norm(const TpLayout& l, const float* grads, TpGroup& group) {
    double whole = 0, cut = 0;
    for (std::size_t i = 0; i < l.local.tensors.size(); i++) {
        const ParamSpec& t = l.local.tensors[i];
        (l.shards[i].split() ? cut : whole) += cpu::sum_squares(grads + t.offset, (int64_t)t.numel);
    }
    std::vector<double> all((std::size_t)group.size());
    group.comm().all_gather_bytes(&cut, all.data(), sizeof(double));
    double sq = whole;
    for (double x : all) sq += x;
    return std::sqrt(sq);
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

}  // namespace memtrain::dist
