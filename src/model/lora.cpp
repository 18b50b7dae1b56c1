// LoRA adapters: their layout, initialisation, arithmetic and merge (see lora.h).
#include "model/lora.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"
#include "kernels/dropout_mask.h"

namespace memtrain {

void LoraConfig::validate() const {
    if (rank < 0) fail("lora.rank = {} must be >= 0 (0: no LoRA)", rank);
    if (!enabled()) return;
    if (!(alpha > 0) || !std::isfinite(alpha)) fail("lora.alpha = {} must be > 0", alpha);
    if (!(dropout >= 0 && dropout < 1)) fail("lora.dropout = {} must be in [0, 1)", dropout);
    if (base != "fp32" && base != "int8" && base != "int4" && base != "nf4")
        fail("lora.base = \"{}\": expected fp32, int8, int4 or nf4", base);
    if (base_group < 1) fail("lora.base_group = {} must be >= 1", base_group);
    if (targets.empty()) fail("lora.targets is empty: use attn, all or module names");
}

namespace {

// One adaptable module of a block: its suffix after the block's prefix and where it sits.
struct Module {
    std::string suffix;  // "attn.c_attn", "self_attn.q_proj"
    BlockLinear linear;
    int64_t in, col0, out, linear_out;
    bool attention;
};

// The modules of a block under the names the model's Hugging Face files use (io/hf_weights.h:
// Llama names for models that are exactly Llama, GPT-2's otherwise).
std::vector<Module> block_modules(const ModelConfig& cfg) {
    const int64_t C = cfg.n_embd, QKV = cfg.qkv_dim(), F = cfg.fc_dim(), H = cfg.mlp_hidden(),
                  KV = (int64_t)cfg.kv_heads() * cfg.head_dim();
    using L = BlockLinear;
    if (!cfg.is_llama())
        return {{"attn.c_attn", L::Qkv, C, 0, QKV, QKV, true},
                {"attn.c_proj", L::Proj, C, 0, C, C, true},
                {"mlp.c_fc", L::Fc, C, 0, F, F, false},
                {"mlp.c_proj", L::FcProj, H, 0, C, C, false}};
    return {{"self_attn.q_proj", L::Qkv, C, 0, C, QKV, true},
            {"self_attn.k_proj", L::Qkv, C, C, KV, QKV, true},
            {"self_attn.v_proj", L::Qkv, C, C + KV, KV, QKV, true},
            {"self_attn.o_proj", L::Proj, C, 0, C, C, true},
            {"mlp.gate_proj", L::Fc, C, 0, H, F, false},
            {"mlp.up_proj", L::Fc, C, H, H, F, false},
            {"mlp.down_proj", L::FcProj, H, 0, C, C, false}};
}

std::string block_prefix(const ModelConfig& cfg, int l) {
    return cfg.is_llama() ? fmt::format("model.layers.{}.", l) : fmt::format("h.{}.", l);
}

bool suffix_matches(const std::string& module, const std::string& pattern) {
    return module == pattern || (module.size() > pattern.size() && module.ends_with(pattern) &&
                                 module[module.size() - pattern.size() - 1] == '.');
}

std::vector<std::string> split_targets(const std::string& s) {
    std::vector<std::string> out;
    std::size_t i = 0;
    while (i <= s.size()) {
        std::size_t j = s.find(',', i);
        if (j == std::string::npos) j = s.size();
        std::string t = s.substr(i, j - i);
        t.erase(0, t.find_first_not_of(' '));
        t.erase(t.find_last_not_of(' ') + 1);
        if (!t.empty()) out.push_back(t);
        i = j + 1;
    }
    return out;
}

}  // namespace

std::vector<std::string> lora_module_suffixes(const ModelConfig& cfg) {
    std::vector<std::string> out;
    for (const Module& m : block_modules(cfg)) out.push_back(m.suffix);
    return out;
}

LoraLayout make_lora_layout(const ModelConfig& cfg, const LoraConfig& lora) {
    lora.validate();
    if (!lora.enabled()) fail("internal: make_lora_layout with lora.rank = 0");
    const std::vector<Module> modules = block_modules(cfg);
    std::vector<bool> chosen(modules.size(), false);
    if (lora.targets == "attn" || lora.targets == "all") {
        for (std::size_t i = 0; i < modules.size(); i++)
            chosen[i] = lora.targets == "all" || modules[i].attention;
    } else {
        for (const std::string& p : split_targets(lora.targets)) {
            bool any = false;
            for (std::size_t i = 0; i < modules.size(); i++)
                if (suffix_matches(modules[i].suffix, p)) chosen[i] = any = true;
            if (!any) {
                std::string names;
                for (const Module& m : modules) names += (names.empty() ? "" : ", ") + m.suffix;
                fail(
                    "lora.targets: '{}' matches no module of a block; this model's are {} (or "
                    "attn, all)",
                    p, names);
            }
        }
    }
    // A rank above a module's smaller side adds parameters and no expressiveness (the update
    // B A has rank at most min(in, out)); the bound also keeps every size below in 64 bits.
    for (std::size_t i = 0; i < modules.size(); i++)
        if (chosen[i] && lora.rank > std::min(modules[i].in, modules[i].out))
            fail("lora.rank = {} is more than {}'s smaller side ({} x {}): at most {}", lora.rank,
                 modules[i].suffix, modules[i].in, modules[i].out,
                 std::min(modules[i].in, modules[i].out));
    LoraLayout out;
    out.rank = lora.rank;
    const int64_t r = lora.rank;
    std::size_t at = 0;
    for (int l = 0; l < cfg.n_layer; l++) {
        // Modules come in linear order (q, k, v before o, gate and up before down), so each
        // (block, linear) pair's sites are contiguous.
        for (int k = 0; k < 4; k++) {
            out.first.push_back(out.sites.size());
            for (std::size_t i = 0; i < modules.size(); i++)
                if (chosen[i] && (int)modules[i].linear < k) out.first.back()++;
        }
        ParamUnit unit;
        unit.name = fmt::format("h.{}", l);
        unit.begin = at;
        unit.first_tensor = out.params.tensors.size();
        for (std::size_t i = 0; i < modules.size(); i++) {
            if (!chosen[i]) continue;
            const Module& m = modules[i];
            LoraSite s;
            s.block = l;
            s.linear = m.linear;
            s.module = block_prefix(cfg, l) + m.suffix;
            s.in = m.in;
            s.out = m.out;
            s.col0 = m.col0;
            s.linear_out = m.linear_out;
            s.a = at - unit.begin;
            out.params.tensors.push_back(
                {s.module + ".lora_A.weight", {r, m.in}, at, (std::size_t)(r * m.in), true});
            at += (std::size_t)(r * m.in);
            s.b = at - unit.begin;
            out.params.tensors.push_back(
                {s.module + ".lora_B.weight", {m.out, r}, at, (std::size_t)(m.out * r), true});
            at += (std::size_t)(m.out * r);
            out.sites.push_back(s);
            out.max_in = std::max(out.max_in, m.in);
            if (l == 0) out.names.push_back(m.suffix);
        }
        unit.end = at;
        unit.last_tensor = out.params.tensors.size();
        out.params.units.push_back(unit);
    }
    out.params.total = at;
    out.first.push_back(out.sites.size());
    return out;
}

void init_lora_weights(WeightWindow& store, const LoraLayout& layout, uint64_t seed) {
    const double std = 1.0 / layout.rank;
    for (int u = 0; u < (int)layout.params.units.size(); u++) {
        const ParamUnit& unit = layout.params.units[u];
        float* base = store.acquire(u, true);
        for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
            const ParamSpec& t = layout.params.tensors[i];
            float* w = base + (t.offset - unit.begin);
            const bool is_a = t.name.ends_with(".lora_A.weight");
            if (is_a)
                fill_normal(w, t.numel, std, seed ^ 0x10AA0000ull, t.name);
            else
                std::fill(w, w + t.numel, 0.0f);
        }
        store.release(u);
    }
}

LoraAdapters::LoraAdapters(const LoraConfig& cfg, const LoraLayout& layout, UnitStore& store,
                           uint64_t dropout_seed)
    : cfg_(cfg), layout_(&layout), store_(&store), seed_(dropout_seed) {}

std::size_t lora_workspace_bytes(const LoraConfig& cfg, const LoraLayout& layout, int N) {
    const std::size_t r = (std::size_t)layout.rank, n = (std::size_t)N;
    const std::size_t drop = cfg.dropout > 0 ? 2 * n * (std::size_t)layout.max_in : 0;
    return sizeof(float) * (2 * n * r + drop);
}

void LoraAdapters::prepare(int N) {
    if (N == rows_) return;
    const std::size_t r = (std::size_t)layout_->rank, n = (std::size_t)N;
    h_.reset();
    dh_.reset();
    xd_.reset();
    tmp_.reset();
    h_ = Buffer<float>(n * r, MemCategory::Workspace);
    dh_ = Buffer<float>(n * r, MemCategory::Workspace);
    if (cfg_.dropout > 0) {
        xd_ = Buffer<float>(n * (std::size_t)layout_->max_in, MemCategory::Workspace);
        tmp_ = Buffer<float>(n * (std::size_t)layout_->max_in, MemCategory::Workspace);
    }
    rows_ = N;
}

float LoraAdapters::keep_scale(const LoraSite& s, std::size_t i) const {
    const uint64_t site = (uint64_t)(&s - layout_->sites.data());
    return dropout_mask::factor(dropout_mask::site_key(seed_, micro_batch_, site), i, cfg_.dropout,
                                (float)(1.0 / (1.0 - cfg_.dropout)));
}

const float* LoraAdapters::dropped(const LoraSite& s, const float* x, int N, int64_t row0) {
    if (!(training_ && cfg_.dropout > 0)) return x;
    const std::size_t n = (std::size_t)N * (std::size_t)s.in, first = (std::size_t)row0 * s.in;
    float* xd = xd_.data();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < (int64_t)n; i++) xd[i] = x[i] * keep_scale(s, first + (std::size_t)i);
    return xd;
}

void LoraAdapters::forward(const LoraSite& s, const float* unit, const float* x, float* y, int N,
                           int64_t row0) {
    if (N > rows_) prepare(N);  // (a tile of rows fits the micro-batch's workspace)
    const int r = layout_->rank, in = (int)s.in, out = (int)s.out, ld = (int)s.linear_out;
    const float* A = unit + s.a;
    const float* B = unit + s.b;
    const float* xd = dropped(s, x, N, row0);
    // h (N, r) = drop(x) A^T; y[:, col0 : col0 + out] += scale * h B^T.
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, r, in, 1.0f, xd, in, A, in, 0.0f,
                h_.data(), r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, out, r, cfg_.scale(), h_.data(), r, B,
                r, 1.0f, y + s.col0, ld);
}

void LoraAdapters::backward(const LoraSite& s, const float* unit, float* grads, const float* x,
                            const float* dy, float* dx, int N, int64_t row0) {
    if (N > rows_) prepare(N);
    const int r = layout_->rank, in = (int)s.in, out = (int)s.out, ld = (int)s.linear_out;
    const float scale = cfg_.scale();
    const float* A = unit + s.a;
    const float* B = unit + s.b;
    float* dA = grads + s.a;
    float* dB = grads + s.b;
    const float* dys = dy + s.col0;
    const float* xd = dropped(s, x, N, row0);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, r, in, 1.0f, xd, in, A, in, 0.0f,
                h_.data(), r);
    // dB (out, r) += scale * dy^T h;  dh (N, r) = scale * dy B;  dA (r, in) += dh^T drop(x).
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, r, N, scale, dys, ld, h_.data(), r,
                1.0f, dB, r);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, r, out, scale, dys, ld, B, r, 0.0f,
                dh_.data(), r);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, r, in, N, 1.0f, dh_.data(), r, xd, in,
                1.0f, dA, in);
    // dx += (dh A) * mask / (1 - p).
    if (!(training_ && cfg_.dropout > 0)) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, in, r, 1.0f, dh_.data(), r, A, in,
                    1.0f, dx, in);
        return;
    }
    float* t = tmp_.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, in, r, 1.0f, dh_.data(), r, A, in,
                0.0f, t, in);
    const int64_t n = (int64_t)N * in;
    const std::size_t first = (std::size_t)row0 * s.in;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) dx[i] += t[i] * keep_scale(s, first + (std::size_t)i);
}

void merge_lora(float* base, const ParamLayout& base_layout, const float* adapters,
                const LoraLayout& layout, float scale) {
    static const char* kWeight[] = {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                                    "mlp.c_proj.weight"};
    const int64_t r = layout.rank;
    for (const LoraSite& s : layout.sites) {
        const ParamSpec& t =
            base_layout.get(fmt::format("h.{}.{}", s.block, kWeight[(int)s.linear]));
        float* W = base + t.offset;  // (in, linear_out)
        const float* A = adapters + layout.params.units[s.block].begin + s.a;
        const float* B = adapters + layout.params.units[s.block].begin + s.b;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < s.in; i++)
            for (int64_t o = 0; o < s.out; o++) {
                double acc = 0;
                for (int64_t k = 0; k < r; k++) acc += (double)B[o * r + k] * A[k * s.in + i];
                W[i * s.linear_out + s.col0 + o] += (float)(scale * acc);
            }
    }
}

}  // namespace memtrain
