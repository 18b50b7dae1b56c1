// AdamW and SGD-with-momentum updates, parallel over each tensor of the layout.
#include "optim/optimizer.h"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

// A state write of floats [begin, begin + n) of an optimizer's `count`.
void check_state_write(std::size_t begin, std::size_t n, std::size_t count) {
    if (begin > count || n > count - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             count);
}

// Whether tensor t lies wholly inside [offset, offset + count), and whether the range cuts it
// (holds part of it): the optimizers that step whole tensors refuse a cut.
bool inside_range(const ParamSpec& t, std::size_t offset, std::size_t count) {
    return t.offset >= offset && t.offset + t.numel <= offset + count;
}
bool cut_by_range(const ParamSpec& t, std::size_t offset, std::size_t count) {
    const bool out = t.offset + t.numel <= offset || t.offset >= offset + count;
    return !inside_range(t, offset, count) && !out;
}

}  // namespace

Optimizer::Optimizer(const ParamLayout& layout, std::size_t offset, std::size_t count,
                     StateFormat format)
    : layout_(layout), offset_(offset), count_(count), format_(format) {
    if (offset > layout.total || count > layout.total - offset)
        fail("optimizer range [{}, {} + {}) is outside the {} parameters", offset, offset, count,
             layout.total);
    check_whole_blocks(format, layout, offset, count);
}

std::size_t Optimizer::state_bytes() {
    std::size_t b = 0;
    for (auto& [name, m] : moments()) b += m->bytes();
    return b;
}

std::vector<std::string> Optimizer::state_names() {
    std::vector<std::string> names;
    for (auto& [name, m] : moments()) names.push_back(name);
    return names;
}

MomentBuffer& Optimizer::moment(const std::string& name) {
    for (auto& [n, m] : moments())
        if (n == name) return *m;
    fail("internal: optimizer has no state tensor '{}'", name);
}

const float* Optimizer::host_state(const std::string& name) {
    return moment(name).whole_fp32();
}

void Optimizer::read_state(const std::string& name, float* dst) {
    moment(name).read(dst);
}

void Optimizer::write_state(const std::string& name, std::size_t begin, std::size_t n,
                            const float* src) {
    check_state_write(begin, n, count_);
    MomentBuffer& m = moment(name);
    if (const float* whole = m.whole_fp32()) {
        std::copy(src, src + n, const_cast<float*>(whole) + begin);
        return;
    }
    auto it = std::find_if(staged_.begin(), staged_.end(),
                           [&](const auto& p) { return p.first == name; });
    if (it == staged_.end()) {
        staged_.emplace_back(name, std::vector<float>(count_));
        it = staged_.end() - 1;
        m.read(it->second.data());  // what no write covers keeps its value
    }
    std::copy(src, src + n, it->second.data() + begin);
}

void Optimizer::finish_writes() {
    for (auto& [name, floats] : staged_) moment(name).write(floats.data());
    staged_.clear();
}

std::size_t Optimizer::stored_bytes(const std::string& name) {
    return moment(name).bytes();
}

void Optimizer::save_stored(const std::string& name, uint8_t* dst) {
    moment(name).save_stored(dst);
}

void Optimizer::load_stored(const std::string& name, const uint8_t* src) {
    moment(name).load_stored(src);
}

bool Optimizer::compact() {
    for (const std::string& name : state_names())
        if (stored_bytes(name) < count_ * sizeof(float)) return true;
    return false;
}

// Whether Adafactor factors tensor t's second moment: a matrix of at least 2 x 2 (the factors
// then fit inside the tensor's own floats, which is how the state is laid out for checkpoints).
bool adafactor_factors(const ParamSpec& t) {
    const std::vector<int64_t>& s = t.global_shape();
    return s.size() == 2 && s[0] >= 2 && s[1] >= 2;
}
// The floats of t's state: rows + cols when factored, else numel.
std::size_t adafactor_floats(const ParamSpec& t) {
    const std::vector<int64_t>& s = t.global_shape();
    return adafactor_factors(t) ? (std::size_t)(s[0] + s[1]) : t.global_numel();
}

namespace {

// Calls f(segment, lo, hi) for the part [lo, hi) (segment-relative) of each segment of `m`
// inside [begin, begin + n) of the range.
template <typename F>
void for_each_segment(const MomentBuffer& m, std::size_t begin, std::size_t n, F&& f) {
    for (const MomentBuffer::Segment& s : m.segments()) {
        const std::size_t lo = std::max(s.begin, begin), hi = std::min(s.begin + s.n, begin + n);
        if (lo < hi) f(s, lo - s.begin, hi - s.begin);
    }
}

// The blocks of a stored segment inside [lo, hi), which must not cut one.
std::pair<std::size_t, std::size_t> whole_blocks(const MomentBuffer& m,
                                                 const MomentBuffer::Segment& s, std::size_t lo,
                                                 std::size_t hi) {
    std::size_t k0 = s.blocks, k1 = 0;
    for (std::size_t k = 0; k < s.blocks; k++) {
        const auto [start, len] = m.block_span(s, k);
        const bool in = start >= lo && start + len <= hi;
        if (!in && start < hi && start + len > lo)
            fail("internal: an optimizer update of [{}, {}) cuts a state block", lo, hi);
        if (in) k0 = std::min(k0, k), k1 = k + 1;
    }
    return {k0, std::max(k0, k1)};
}

// The largest block a MomentBuffer hands load()/store() (int8's 256, bf16's loop chunk).
constexpr std::size_t kMaxBlock = 256;

// An element-wise update over the segments of K moments laid out alike (ms[0]'s segmentation)
// inside [begin, begin + count) of the range: update(s, p, g, state, n) on fp32 segments in place,
// in parallel chunks of 4096, and on stored ones a block at a time, decoded and encoded again.
template <std::size_t K, typename F>
void update_segments(const std::array<MomentBuffer*, K>& ms, float* params, const float* grads,
                     std::size_t begin, std::size_t count, F&& update) {
    for_each_segment(*ms[0], begin, count, [&](const auto& s, std::size_t lo, std::size_t hi) {
        // params and grads point at float `begin` of the range; the segment's float lo is at
        // s.begin + lo - begin from there (never before it: lo is inside [begin, begin + count)).
        float* p = params + (s.begin + lo - begin);
        const float* g = grads + (s.begin + lo - begin);
        if (s.direct) {
            const int64_t chunk = 4096, n = (int64_t)(hi - lo);
#pragma omp parallel for schedule(static)
            for (int64_t c = 0; c < n; c += chunk) {
                const int64_t i = (int64_t)lo + c;
                std::array<float*, K> st;
                for (std::size_t j = 0; j < K; j++) st[j] = ms[j]->direct(s) + i;
                update(s, p + c, g + c, st, std::min(chunk, n - c));
            }
            return;
        }
        const auto [k0, k1] = whole_blocks(*ms[0], s, lo, hi);
#pragma omp parallel for schedule(static)
        for (std::size_t k = k0; k < k1; k++) {
            float blocks[K][kMaxBlock];
            std::array<float*, K> st;
            const auto [start, len] = ms[0]->block_span(s, k);
            for (std::size_t j = 0; j < K; j++) {
                st[j] = blocks[j];
                ms[j]->load(s, k, st[j]);
            }
            update(s, p + (start - lo), g + (start - lo), st, (int64_t)len);
            for (std::size_t j = 0; j < K; j++) ms[j]->store(s, k, st[j]);
        }
    });
}

std::vector<char> complement(const std::vector<char>& mask) {
    std::vector<char> c(mask.size());
    for (std::size_t i = 0; i < mask.size(); i++) c[i] = !mask[i];
    return c;
}

// AdamW's step over moments in any format: the constants of step t (t_ + 1) and learning rate
// lr, and the update of a range's segments, fp32 arrays in place or blocks decoded and encoded.
struct AdamStep {
    float b1, b2, eps, step_size, bc2_sqrt, decay_on;
    AdamStep(const OptimConfig& cfg, double lr, int64_t step)
        : b1((float)cfg.beta1),
          b2((float)cfg.beta2),
          eps((float)cfg.eps),
          step_size((float)(lr / (1.0 - std::pow(cfg.beta1, (double)step)))),
          bc2_sqrt((float)std::sqrt(1.0 - std::pow(cfg.beta2, (double)step))),
          decay_on((float)(1.0 - lr * cfg.weight_decay)) {}
    // One update of n floats; every format runs this arithmetic on fp32 moments.
    void update(float* p, const float* g, float* m, float* v, int64_t n, float decay) const {
        const float b1_ = b1, b2_ = b2, eps_ = eps, ss = step_size, bc = bc2_sqrt;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            float gi = g[i];
            float mi = b1_ * m[i] + (1.0f - b1_) * gi;
            float vi = b2_ * v[i] + (1.0f - b2_) * gi * gi;
            m[i] = mi;
            v[i] = vi;
            float denom = std::sqrt(vi) / bc + eps_;
            p[i] = p[i] * decay - ss * mi / denom;
        }
    }
    // The segments of m (and v, laid out alike) inside [begin, begin + count) of the range.
    void run(const ParamLayout& layout, MomentBuffer& m, MomentBuffer& v, float* params,
             const float* grads, std::size_t begin, std::size_t count) const {
        update_segments<2>({&m, &v}, params, grads, begin, count,
                           [&](const MomentBuffer::Segment& s, float* p, const float* g,
                               const std::array<float*, 2>& st, int64_t n) {
                               const float decay = layout.tensors[s.tensor].decay ? decay_on : 1.0f;
                               update(p, g, st[0], st[1], n, decay);
                           });
    }
};

class AdamW final : public Optimizer {
  public:
    AdamW(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset, std::size_t count,
          MemCategory category)
        : Optimizer(layout, offset, count, parse_state_format(cfg.state_format)),
          cfg_(cfg),
          m_(format_, true, layout, offset, count, {}, category),
          v_(format_, false, layout, offset, count, {}, category) {}

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t count) override {
        AdamStep(cfg_, lr, t_ + 1).run(layout_, m_, v_, params, grads, begin, count);
    }

    std::vector<std::pair<std::string, MomentBuffer*>> moments() override {
        return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
    }

  private:
    OptimConfig cfg_;
    MomentBuffer m_, v_;
};

class Sgd final : public Optimizer {
  public:
    Sgd(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset, std::size_t count,
        MemCategory category)
        : Optimizer(layout, offset, count, parse_state_format(cfg.state_format)),
          cfg_(cfg),
          buf_(format_, true, layout, offset, count, {}, category) {}

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t count) override {
        const float mu = (float)cfg_.momentum, flr = (float)lr;
        const bool first = t_ == 0, nesterov = cfg_.nesterov;
        auto update = [=](float* p, const float* g, float* b, int64_t n, float wd) {
#pragma omp simd
            for (int64_t i = 0; i < n; i++) {
                float gi = g[i] + wd * p[i];
                float bi = first ? gi : mu * b[i] + gi;
                b[i] = bi;
                float d = nesterov ? gi + mu * bi : bi;
                p[i] -= flr * d;
            }
        };
        update_segments<1>({&buf_}, params, grads, begin, count,
                           [&](const MomentBuffer::Segment& s, float* p, const float* g,
                               const std::array<float*, 1>& st, int64_t n) {
                               const bool decays = layout_.tensors[s.tensor].decay;
                               update(p, g, st[0], n, decays ? (float)cfg_.weight_decay : 0.0f);
                           });
    }

    std::vector<std::pair<std::string, MomentBuffer*>> moments() override {
        return {{"momentum_buffer", &buf_}};
    }

  private:
    OptimConfig cfg_;
    MomentBuffer buf_;
};

// Muon (Jordan et al. 2024, as modded-nanogpt and nanochat run it) for the blocks' matrices: a
// momentum buffer, updated as buf = lerp(buf, g, 1 - mu); the Nesterov direction
// u = lerp(g, buf, mu); u orthogonalized by five quintic Newton-Schulz steps (newton_schulz5);
// decoupled weight decay and a step of lr_muon x sqrt(max(1, fan_out / fan_in)). Every other
// tensor (embeddings, gains, biases, an untied head) takes AdamW's step at the schedule's lr.
// lr_muon follows the schedule too: optim.muon_lr x (lr / optim.lr).
// A matrix the range holds only part of (a ZeRO shard's edge) is completed through the
// TensorGather: every holder updates its piece of the buffer and of u, gathers u whole,
// orthogonalizes it (the same bits on every holder: the same input and code) and keeps its piece
// of the result, which is therefore bitwise what one process computes.
class Muon final : public Optimizer {
  public:
    Muon(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset, std::size_t count,
         MemCategory category, TensorGather* gather)
        : Optimizer(layout, offset, count, parse_state_format(cfg.state_format)),
          cfg_(cfg),
          matrix_(muon_matrices(layout)),
          rest_(complement(matrix_)),
          m_(format_, true, layout, offset, count, rest_, category),
          v_(format_, false, layout, offset, count, rest_, category),
          buf_(format_, true, layout, offset, count, matrix_, category),
          gather_(gather) {}

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t count) override {
        AdamStep(cfg_, lr, t_ + 1).run(layout_, m_, v_, params, grads, begin, count);
        const float mu = (float)cfg_.muon_momentum;
        const double lr_muon = cfg_.muon_lr * (lr / cfg_.lr);
        // Replicas sharing the orthogonalizations (DDP): each updates every momentum, computes
        // the matrices it owns first, then every matrix's result comes from its owner, in order,
        // so no rank waits for another's Newton-Schulz while it could run its own.
        std::map<std::size_t, std::vector<float>> owned;
        const bool shared = gather_ && has_owners(begin, count);
        for_each_segment(buf_, begin, count, [&](const auto& s, std::size_t lo, std::size_t hi) {
            const ParamSpec& t = layout_.tensors[s.tensor];
            if (lo != 0 || hi != s.n)
                fail("internal: a Muon update of part of {} ([{}, {}) of {})", t.name, lo, hi, s.n);
            // The range's piece of the matrix: all of it, or (a shard's edge) part of it, or
            // (tensor parallelism) the rank's slice of a larger matrix.
            const bool cut = s.n != t.numel || t.sliced();
            if (cut && !gather_)
                fail(
                    "optim.name = \"muon\" orthogonalizes whole matrices, and this optimizer's "
                    "range [{}, {}) holds part of {} with no way to gather the rest",
                    offset_, offset_ + count_, t.name);
            float* p = params + (s.begin - begin);  // (lo == 0: s.begin >= begin)
            const float* g = grads + (s.begin - begin);
            // The momentum buffer, whole and in fp32 for the step.
            std::vector<float> stored;
            float* buf = s.direct ? buf_.direct(s) : nullptr;
            if (!buf) {
                stored.resize(s.n);
                buf = stored.data();
                buf_.load_segment(s, buf);
            }
            std::vector<float> u(s.n);
            const int64_t n = (int64_t)s.n;
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) {
                const float b = buf[i] + (1.0f - mu) * (g[i] - buf[i]);
                buf[i] = b;
                u[i] = g[i] + mu * (b - g[i]);
            }
            if (!s.direct) buf_.store_segment(s, buf);
            const int rows = (int)t.global_shape()[0], cols = (int)t.global_shape()[1];
            if (shared) {
                const int own = gather_->owner(s.tensor);
                if (gather_->is_me(own)) {
                    newton_schulz5(u.data(), rows, cols);
                    owned[s.tensor] = std::move(u);
                }
                return;
            }
            std::vector<float> whole;
            float* x = u.data();
            if (cut) {
                whole.resize(t.global_numel());
                gather_->gather(s.tensor, u.data(), whole.data());
                x = whole.data();
            }
            newton_schulz5(x, rows, cols);
            const float* mine = cut ? x + (offset_ + s.begin - t.offset) : x;
            if (t.sliced()) {  // the rank's slice of the orthogonalized matrix
                gather_->pick(s.tensor, x, u.data());
                mine = u.data();
            }
            apply(t, p, mine, n, rows, cols, lr_muon);
        });
        if (!shared) return;
        std::vector<float> x;
        for_each_segment(buf_, begin, count, [&](const auto& s, std::size_t, std::size_t) {
            const ParamSpec& t = layout_.tensors[s.tensor];
            const int own = gather_->owner(s.tensor);
            auto it = owned.find(s.tensor);
            float* o = nullptr;
            if (it != owned.end()) {
                o = it->second.data();
            } else {
                x.resize(s.n);
                o = x.data();
            }
            gather_->share(s.tensor, o, own);
            apply(t, params + (s.begin - begin), o, (int64_t)s.n, (int)t.global_shape()[0],
                  (int)t.global_shape()[1], lr_muon);
        });
    }

    // W = W (1 - lr_muon wd) - lr_muon sqrt(max(1, cols / rows)) O over a matrix's n floats.
    void apply(const ParamSpec& t, float* p, const float* o, int64_t n, int rows, int cols,
               double lr_muon) const {
        const float decay = t.decay ? (float)(1.0 - lr_muon * cfg_.weight_decay) : 1.0f;
        const float step = (float)(lr_muon * std::sqrt(std::max(1.0, (double)cols / (double)rows)));
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; i++) p[i] = p[i] * decay - step * o[i];
    }

    // Whether a matrix of [begin, begin + count) has an owner (the gather shares them).
    bool has_owners(std::size_t begin, std::size_t count) const {
        bool any = false;
        for_each_segment(buf_, begin, count, [&](const auto& s, std::size_t, std::size_t) {
            any = any || gather_->owner(s.tensor) >= 0;
        });
        return any;
    }

    std::vector<std::pair<std::string, MomentBuffer*>> moments() override {
        return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}, {"momentum_buffer", &buf_}};
    }

  private:
    OptimConfig cfg_;
    std::vector<char> matrix_, rest_;
    MomentBuffer m_, v_, buf_;
    TensorGather* gather_;
};

// torch.lerp's arithmetic: a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w).
inline float lerp_torch(float a, float b, float w) {
    return std::abs(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// A tensor the range holds only part of (a ZeRO shard's edge) is stepped whole through the
// TensorGather: every holder gathers its gradient and weights, steps the whole tensor (the same
// bits on each) and keeps its piece; each holder keeps the tensor's whole state (rows + cols
// floats), so the step is bitwise one process's. Checkpoints see that state as the parameters'
// layout does (R and C at the tensor's start), which gives the floats to the first holder only:
// a load (finish_writes) gathers the pattern among the holders so each has it whole again.
class Adafactor final : public Optimizer {
  public:
    Adafactor(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset,
              std::size_t count, MemCategory category, TensorGather* gather)
        : Optimizer(layout, offset, count, StateFormat::Fp32), cfg_(cfg), gather_(gather) {
        std::size_t at = 0;
        for (std::size_t i = 0; i < layout.tensors.size(); i++) {
            const ParamSpec& t = layout.tensors[i];
            const bool cut =
                cut_by_range(t, offset, count) || (t.sliced() && inside_range(t, offset, count));
            if (!cut && !inside_range(t, offset, count)) continue;
            pieces_.push_back({i, at, cut});
            at += adafactor_floats(t);
        }
        if (at) {
            state_ = Buffer<float>(at, category);
            std::fill(state_.data(), state_.data() + at, 0.0f);
        }
    }

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t n) override {
        const double t = (double)(t_ + 1);
        const float w = (float)std::pow(t, cfg_.adafactor_beta2_decay);  // 1 - beta2_t
        const double rho = std::min(lr, 1.0 / std::sqrt(t));
        const std::size_t lo = offset_ + begin, hi = lo + n;
        for (const Piece& pc : pieces_) {
            const ParamSpec& ts = layout_.tensors[pc.tensor];
            if (ts.offset + ts.numel <= lo || ts.offset >= hi) continue;
            // The range's piece of the tensor (all of it unless cut) must be inside the update.
            const auto [a, b] = mine(ts);
            if (a < lo || b > hi) fail("internal: an Adafactor update of part of {}", ts.name);
            float* p = params + (a - lo);
            const float* g = grads + (a - lo);
            const bool factored = adafactor_factors(ts);
            const int64_t rows = factored ? ts.global_shape()[0] : 1;
            const int64_t cols = factored ? ts.global_shape()[1] : (int64_t)ts.global_numel();
            if (!pc.cut) {
                step_tensor(p, g, state_.data() + pc.at, rows, cols, factored, ts.decay, lr, rho,
                            w);
                continue;
            }
            if (!gather_)
                fail(
                    "optim.name = \"adafactor\" steps whole tensors (their RMS and their "
                    "factored second moment), and this optimizer's range [{}, {}) holds part of "
                    "{} with no way to gather the rest",
                    offset_, offset_ + count_, ts.name);
            std::vector<float> whole_p(ts.global_numel()), whole_g(ts.global_numel());
            gather_->gather(pc.tensor, g, whole_g.data());
            gather_->gather(pc.tensor, p, whole_p.data());
            step_tensor(whole_p.data(), whole_g.data(), state_.data() + pc.at, rows, cols, factored,
                        ts.decay, lr, rho, w);
            if (ts.sliced())
                gather_->pick(pc.tensor, whole_p.data(), p);
            else
                std::copy(whole_p.data() + (a - ts.offset), whole_p.data() + (b - ts.offset), p);
        }
    }

    std::vector<std::pair<std::string, MomentBuffer*>> moments() override { return {}; }
    std::size_t state_bytes() override { return state_.bytes(); }
    // Its stored form: the pieces' factors and vectors back to back.
    std::size_t stored_bytes(const std::string& name) override {
        check_name(name);
        return state_.bytes();
    }
    void save_stored(const std::string& name, uint8_t* dst) override {
        check_name(name);
        if (state_.bytes()) std::memcpy(dst, state_.data(), state_.bytes());
    }
    void load_stored(const std::string& name, const uint8_t* src) override {
        check_name(name);
        if (state_.bytes()) std::memcpy(state_.data(), src, state_.bytes());
    }

    // For checkpoints the state is laid out like the range: each tensor's floats hold its
    // second moment whole, or its row factors then its column factors followed by zeros.
    std::vector<std::string> state_names() override { return {"variance"}; }
    const float* host_state(const std::string&) override { return nullptr; }
    void read_state(const std::string& name, float* dst) override {
        check_name(name);
        std::fill(dst, dst + count_, 0.0f);
        for (const Piece& pc : pieces_) {
            // The tensor's floats [t.offset, t.offset + k) inside the range.
            const ParamSpec& t = layout_.tensors[pc.tensor];
            if (t.sliced()) {
                // The whole tensor's floats (its state at the start), this rank's slice of them.
                std::vector<float> whole(t.global_numel(), 0.0f);
                std::copy_n(state_.data() + pc.at, adafactor_floats(t), whole.data());
                gather_->pick(pc.tensor, whole.data(), dst + (t.offset - offset_));
                continue;
            }
            const std::size_t a = std::max(t.offset, offset_);
            const std::size_t b = std::min(t.offset + adafactor_floats(t), offset_ + count_);
            if (a < b)
                std::copy(state_.data() + pc.at + (a - t.offset),
                          state_.data() + pc.at + (b - t.offset), dst + (a - offset_));
        }
    }
    void write_state(const std::string& name, std::size_t begin, std::size_t n,
                     const float* src) override {
        check_name(name);
        check_state_write(begin, n, count_);
        if (staged_whole_.empty()) {
            staged_whole_.resize(count_);
            read_state(name, staged_whole_.data());  // what no write covers keeps its value
        }
        std::copy(src, src + n, staged_whole_.data() + begin);
    }
    void finish_writes() override {
        // A cut tensor's holders gather their pieces of its floats whole, staged or not (every
        // holder calls each gather, in layout order); the others take their floats as staged.
        if (staged_whole_.empty() && !gather_) return;
        std::vector<float> floats;
        if (staged_whole_.empty()) {
            floats.resize(count_);
            read_state("variance", floats.data());
        }
        const float* range = staged_whole_.empty() ? floats.data() : staged_whole_.data();
        for (const Piece& pc : pieces_) {
            const ParamSpec& t = layout_.tensors[pc.tensor];
            const std::size_t k = adafactor_floats(t);
            if (!pc.cut) {
                const float* from = range + (t.offset - offset_);
                std::copy(from, from + k, state_.data() + pc.at);
                continue;
            }
            if (!gather_) fail("internal: loading part of {}'s Adafactor state", t.name);
            const auto [a, b] = mine(t);
            std::vector<float> whole(t.global_numel());
            gather_->gather(pc.tensor, range + (a - offset_), whole.data());
            std::copy(whole.data(), whole.data() + k, state_.data() + pc.at);
        }
        staged_whole_.clear();
        staged_whole_.shrink_to_fit();
    }

  private:
    struct Piece {
        std::size_t tensor, at;  // the layout's tensor; where its state starts in state_
        bool cut;                // the range holds part of the tensor (a ZeRO shard's edge)
    };
    // [a, b) of the flat buffer: the range's piece of tensor t.
    std::pair<std::size_t, std::size_t> mine(const ParamSpec& t) const {
        return {std::max(t.offset, offset_), std::min(t.offset + t.numel, offset_ + count_)};
    }
    static void check_name(const std::string& name) {
        if (name != "variance") fail("internal: Adafactor has no state tensor '{}'", name);
    }

    // One tensor: rows x cols (a whole tensor is 1 x numel, unfactored), its state at s (rows
    // then cols floats when factored, else numel). Every sum goes row by row in double, each
    // row's by one thread and the rows' in order: the same bits at any thread count.
    void step_tensor(float* p, const float* g, float* s, int64_t rows, int64_t cols, bool factored,
                     bool decays, double lr, double rho, float w) const {
        const float eps1 = std::numeric_limits<float>::epsilon(), eps1_sq = eps1 * eps1;
        const int64_t n = rows * cols;
        std::vector<double> part((std::size_t)rows);
        auto ordered_sum = [&]() {
            double sum = 0;
            for (double v : part) sum += v;
            return sum;
        };
        // alpha from the weights before the decay.
#pragma omp parallel for schedule(static) if (rows > 1)
        for (int64_t i = 0; i < rows; i++) {
            double a = 0;
            for (int64_t j = 0; j < cols; j++) a += (double)p[i * cols + j] * p[i * cols + j];
            part[(std::size_t)i] = a;
        }
        const double alpha = std::max(1e-3, std::sqrt(ordered_sum() / (double)n)) * rho;
        if (decays && cfg_.weight_decay != 0) {
            const float keep = (float)(1.0 - lr * cfg_.weight_decay);
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) p[i] *= keep;
        }
        float* R = s;
        float* C = s + rows;
        float inv_mean_r = 0;
        if (factored) {
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < rows; i++) {
                double a = 0;
                for (int64_t j = 0; j < cols; j++) a += (double)g[i * cols + j] * g[i * cols + j];
                R[i] = lerp_torch(R[i], (float)(a / (double)cols), w);
            }
            constexpr int64_t kCols = 256;
#pragma omp parallel for schedule(static)
            for (int64_t j0 = 0; j0 < cols; j0 += kCols) {
                const int64_t j1 = std::min(cols, j0 + kCols);
                double acc[kCols] = {};
                for (int64_t i = 0; i < rows; i++)
                    for (int64_t j = j0; j < j1; j++)
                        acc[j - j0] += (double)g[i * cols + j] * g[i * cols + j];
                for (int64_t j = j0; j < j1; j++)
                    C[j] = lerp_torch(C[j], (float)(acc[j - j0] / (double)rows), w);
            }
            double sum_r = 0;
            for (int64_t i = 0; i < rows; i++) sum_r += R[i];
            inv_mean_r = 1.0f / std::max((float)(sum_r / (double)rows), eps1);
        } else {
            for (int64_t j = 0; j < cols; j++) s[j] = lerp_torch(s[j], g[j] * g[j], w);
        }
        // U = G / sqrt(max(V, eps1^2)), computed twice: once for its RMS, once to step.
        auto u = [&](int64_t i, int64_t j) {
            const float v = factored ? (R[i] * C[j]) * inv_mean_r : s[j];
            return g[i * cols + j] * (1.0f / std::sqrt(std::max(v, eps1_sq)));
        };
#pragma omp parallel for schedule(static) if (rows > 1)
        for (int64_t i = 0; i < rows; i++) {
            double a = 0;
            for (int64_t j = 0; j < cols; j++) {
                const float x = u(i, j);
                a += (double)x * x;
            }
            part[(std::size_t)i] = a;
        }
        const double rms_u = std::sqrt(ordered_sum() / (double)n);
        const float step = (float)(-alpha / std::max(1.0, rms_u / cfg_.adafactor_clip));
#pragma omp parallel for schedule(static) if (rows > 1)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < cols; j++) p[i * cols + j] += step * u(i, j);
    }

    OptimConfig cfg_;
    TensorGather* gather_;
    std::vector<Piece> pieces_;
    Buffer<float> state_;              // the pieces' state, back to back
    std::vector<float> staged_whole_;  // write_state's floats until finish_writes()
};

}  // namespace

void TensorGather::pick(std::size_t tensor, const float*, float*) {
    fail("internal: layout tensor {} is a slice, and this gather cannot pick it", tensor);
}

void TensorGather::share(std::size_t tensor, float*, int) {
    fail("internal: layout tensor {} has an owner, and this gather cannot share it", tensor);
}

std::size_t adafactor_state_floats(const ParamLayout& layout, std::size_t offset,
                                   std::size_t count) {
    std::size_t n = 0;
    for (const ParamSpec& t : layout.tensors)
        if (inside_range(t, offset, count) || cut_by_range(t, offset, count))
            n += adafactor_floats(t);
    return n;
}

std::vector<char> muon_matrices(const ParamLayout& layout) {
    std::vector<char> m(layout.tensors.size());
    for (std::size_t i = 0; i < m.size(); i++) {
        const ParamSpec& t = layout.tensors[i];
        m[i] = t.shape.size() == 2 && t.name.rfind("h.", 0) == 0;
    }
    return m;
}

std::vector<char> whole_step_tensors(const OptimConfig& cfg, const ParamLayout& layout) {
    if (cfg.name == "muon") return muon_matrices(layout);
    return std::vector<char>(layout.tensors.size(), cfg.name == "adafactor");
}

void newton_schulz5(float* x, int rows, int cols) {
    // Orthogonalize the wide orientation (r <= c): the result of the tall one is its transpose.
    const bool tall = rows > cols;
    const int r = tall ? cols : rows, c = tall ? rows : cols;
    const std::size_t n = (std::size_t)r * c;
    std::vector<float> X(n), Y(n), A((std::size_t)r * r), B((std::size_t)r * r);
    if (tall) {
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++) X[(std::size_t)j * c + i] = x[(std::size_t)i * cols + j];
    } else {
        std::copy(x, x + n, X.data());
    }
    const float inv = (float)(1.0 / (std::sqrt(cpu::sum_squares(X.data(), (int64_t)n)) + 1e-7));
    cpu::scale_inplace(X.data(), inv, (int64_t)n);
    const float a = 3.4445f, b = -4.7750f, cq = 2.0315f;
    for (int k = 0; k < 5; k++) {
        // A = X X^T; B = b A + c A A; X = a X + B X.
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, r, r, c, 1.0f, X.data(), c, X.data(),
                    c, 0.0f, A.data(), r);
        B = A;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, r, r, cq, A.data(), r, A.data(),
                    r, b, B.data(), r);
        Y = X;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, r, c, r, 1.0f, B.data(), r, X.data(),
                    c, a, Y.data(), c);
        std::swap(X, Y);
    }
    if (tall) {
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++) x[(std::size_t)i * cols + j] = X[(std::size_t)j * c + i];
    } else {
        std::copy(X.begin(), X.end(), x);
    }
}

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                          std::size_t offset, std::size_t count,
                                          MemCategory category, TensorGather* gather) {
    cfg.validate();
    if (offset > layout.total)
        fail("optimizer range starts at {}, past the {} parameters", offset, layout.total);
    count = std::min(count, layout.total - offset);
    if (cfg.name == "sgd") return std::make_unique<Sgd>(cfg, layout, offset, count, category);
    if (cfg.name == "muon")
        return std::make_unique<Muon>(cfg, layout, offset, count, category, gather);
    if (cfg.name == "adafactor")
        return std::make_unique<Adafactor>(cfg, layout, offset, count, category, gather);
    return std::make_unique<AdamW>(cfg, layout, offset, count, category);
}

std::size_t optimizer_state_bytes(const OptimConfig& cfg, const ParamLayout& layout,
                                  std::size_t offset, std::size_t count) {
    if (cfg.name == "adafactor")
        return sizeof(float) * adafactor_state_floats(layout, offset, count);
    const StateFormat f = parse_state_format(cfg.state_format);
    if (cfg.name == "muon") {
        const std::vector<char> matrices = muon_matrices(layout);
        return MomentBuffer::predicted_bytes(f, layout, offset, count, matrices) +
               2 * MomentBuffer::predicted_bytes(f, layout, offset, count, complement(matrices));
    }
    const std::size_t moments = cfg.name == "sgd" ? 1 : 2;
    return moments * MomentBuffer::predicted_bytes(f, layout, offset, count);
}

std::string describe_optimizer_state(const OptimConfig& cfg) {
    if (cfg.name == "adafactor")
        return "Adafactor second moment: row and column factors of matrices, whole else (fp32)";
    const StateFormat f = parse_state_format(cfg.state_format);
    const char* what = cfg.name == "sgd"    ? "momentum"
                       : cfg.name == "muon" ? "Muon momentum on block matrices, Adam m, v else"
                                            : "Adam m, v";
    if (f == StateFormat::Fp32) return what;
    if (f == StateFormat::Bf16)
        return fmt::format("{} in bf16; tensors < {} in fp32", what, kKeepFp32Below);
    return fmt::format("{} in {} (blocks of {}, fp32 scales); tensors < {} in fp32", what,
                       state_format_name(f), block_size(f), kKeepFp32Below);
}

RangeOptimizers::RangeOptimizers(std::vector<std::unique_ptr<Optimizer>> parts)
    : parts_(std::move(parts)) {
    if (parts_.empty()) fail("internal: RangeOptimizers without parts");
    for (std::size_t k = 0; k < parts_.size(); k++) {
        if (k > 0 && parts_[k]->offset() < parts_[k - 1]->offset() + parts_[k - 1]->count())
            fail("internal: optimizer ranges overlap or are out of order");
        count_ += parts_[k]->count();
    }
}

std::vector<OptimizerState::Range> RangeOptimizers::ranges() const {
    std::vector<Range> r;
    for (const auto& p : parts_) r.push_back({p->offset(), p->count()});
    return r;
}

void RangeOptimizers::set_steps_taken(int64_t t) {
    for (auto& p : parts_) p->set_steps_taken(t);
}

const float* RangeOptimizers::host_state(const std::string& name) {
    return parts_.size() == 1 ? parts_.front()->host_state(name) : nullptr;
}

void RangeOptimizers::read_state(const std::string& name, float* dst) {
    for (auto& p : parts_) {
        p->read_state(name, dst);
        dst += p->count();
    }
}

void RangeOptimizers::finish_writes() {
    for (auto& p : parts_) p->finish_writes();
}

void RangeOptimizers::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                  const float* src) {
    check_state_write(begin, n, count_);
    std::size_t at = 0;  // where the part starts in the concatenation
    for (auto& p : parts_) {
        const std::size_t lo = std::max(begin, at), hi = std::min(begin + n, at + p->count());
        if (lo < hi) p->write_state(name, lo - at, hi - lo, src + (lo - begin));
        at += p->count();
    }
}

double clip_grad_norm(float* grads, std::size_t n, double max_norm) {
    const double norm = std::sqrt(cpu::sum_squares(grads, (int64_t)n));
    clip_to_norm(grads, n, norm, max_norm);
    return norm;
}

void clip_to_norm(float* grads, std::size_t n, double norm, double max_norm) {
    if (max_norm <= 0) return;
    const double coef = max_norm / (norm + 1e-6);
    if (coef < 1.0) cpu::scale_inplace(grads, (float)coef, (int64_t)n);
}

}  // namespace memtrain
