// AdamW and SGD-with-momentum updates, parallel over each tensor of the layout.
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

Optimizer::Optimizer(const ParamLayout& layout, std::size_t offset, std::size_t count)
    : layout_(layout), offset_(offset), count_(count) {
    if (offset > layout.total || count > layout.total - offset)
        fail("optimizer range [{}, {} + {}) is outside the {} parameters", offset, offset, count,
             layout.total);
}

std::vector<std::string> Optimizer::state_names() {
    std::vector<std::string> names;
    for (auto& [name, buf] : state()) names.push_back(name);
    return names;
}

const float* Optimizer::host_state(const std::string& name) {
    for (auto& [n, buf] : state())
        if (n == name) return buf->data();
    fail("internal: optimizer has no state tensor '{}'", name);
}

void Optimizer::read_state(const std::string& name, float* dst) {
    std::copy(host_state(name), host_state(name) + count_, dst);
}

void Optimizer::write_state(const std::string& name, std::size_t begin, std::size_t n,
                            const float* src) {
    if (begin > count_ || n > count_ - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             count_);
    float* dst = const_cast<float*>(host_state(name));
    std::copy(src, src + n, dst + begin);
}

namespace {

class AdamW final : public Optimizer {
  public:
    AdamW(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset, std::size_t count)
        : Optimizer(layout, offset, count),
          cfg_(cfg),
          m_(count, MemCategory::OptimizerState),
          v_(count, MemCategory::OptimizerState) {}

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t count) override {
        const int64_t step = t_ + 1;
        const float b1 = (float)cfg_.beta1, b2 = (float)cfg_.beta2, eps = (float)cfg_.eps;
        const double bc1 = 1.0 - std::pow(cfg_.beta1, (double)step);
        const double bc2 = 1.0 - std::pow(cfg_.beta2, (double)step);
        const float step_size = (float)(lr / bc1);
        const float bc2_sqrt = (float)std::sqrt(bc2);
        for_each_piece(begin, count, [&](const ParamSpec& t, std::size_t at, int64_t n) {
            const float decay = t.decay ? (float)(1.0 - lr * cfg_.weight_decay) : 1.0f;
            float* p = params + at;
            const float* g = grads + at;
            float* m = m_.data() + at;
            float* v = v_.data() + at;
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) {
                float gi = g[i];
                float mi = b1 * m[i] + (1.0f - b1) * gi;
                float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
                m[i] = mi;
                v[i] = vi;
                float denom = std::sqrt(vi) / bc2_sqrt + eps;
                p[i] = p[i] * decay - step_size * mi / denom;
            }
        });
    }

    std::vector<std::pair<std::string, Buffer<float>*>> state() override {
        return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
    }

  private:
    OptimConfig cfg_;
    Buffer<float> m_, v_;
};

class Sgd final : public Optimizer {
  public:
    Sgd(const OptimConfig& cfg, const ParamLayout& layout, std::size_t offset, std::size_t count)
        : Optimizer(layout, offset, count), cfg_(cfg), buf_(count, MemCategory::OptimizerState) {}

    void step_part(float* params, const float* grads, double lr, std::size_t begin,
                   std::size_t count) override {
        const float mu = (float)cfg_.momentum, flr = (float)lr;
        const bool first = t_ == 0;
        for_each_piece(begin, count, [&](const ParamSpec& t, std::size_t at, int64_t n) {
            const float wd = t.decay ? (float)cfg_.weight_decay : 0.0f;
            float* p = params + at;
            const float* g = grads + at;
            float* b = buf_.data() + at;
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) {
                float gi = g[i] + wd * p[i];
                float bi = first ? gi : mu * b[i] + gi;
                b[i] = bi;
                float d = cfg_.nesterov ? gi + mu * bi : bi;
                p[i] -= flr * d;
            }
        });
    }

    std::vector<std::pair<std::string, Buffer<float>*>> state() override {
        return {{"momentum_buffer", &buf_}};
    }

  private:
    OptimConfig cfg_;
    Buffer<float> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout,
                                          std::size_t offset, std::size_t count) {
    cfg.validate();
    if (offset > layout.total)
        fail("optimizer range starts at {}, past the {} parameters", offset, layout.total);
    count = std::min(count, layout.total - offset);
    if (cfg.name == "sgd") return std::make_unique<Sgd>(cfg, layout, offset, count);
    return std::make_unique<AdamW>(cfg, layout, offset, count);
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

void RangeOptimizers::write_state(const std::string& name, std::size_t begin, std::size_t n,
                                  const float* src) {
    if (begin > count_ || n > count_ - begin)
        fail("internal: optimizer state write [{}, {}) outside its {} floats", begin, begin + n,
             count_);
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
