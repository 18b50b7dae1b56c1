// AdamW and SGD-with-momentum updates, parallel over each tensor of the layout.
#include "optim/optimizer.h"

#include <cmath>

#include "kernels/cpu/ops.h"

namespace memtrain {

namespace {

class AdamW final : public Optimizer {
  public:
    AdamW(const OptimConfig& cfg, const ParamLayout& layout)
        : cfg_(cfg),
          layout_(layout),
          m_(layout.total, MemCategory::OptimizerState),
          v_(layout.total, MemCategory::OptimizerState) {}

    void step(float* params, const float* grads, double lr) override {
        t_++;
        const float b1 = (float)cfg_.beta1, b2 = (float)cfg_.beta2, eps = (float)cfg_.eps;
        const double bc1 = 1.0 - std::pow(cfg_.beta1, (double)t_);
        const double bc2 = 1.0 - std::pow(cfg_.beta2, (double)t_);
        const float step_size = (float)(lr / bc1);
        const float bc2_sqrt = (float)std::sqrt(bc2);
        for (const auto& t : layout_.tensors) {
            const float decay = t.decay ? (float)(1.0 - lr * cfg_.weight_decay) : 1.0f;
            float* p = params + t.offset;
            const float* g = grads + t.offset;
            float* m = m_.data() + t.offset;
            float* v = v_.data() + t.offset;
            const int64_t n = (int64_t)t.numel;
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
        }
    }

    std::vector<std::pair<std::string, Buffer<float>*>> state() override {
        return {{"exp_avg", &m_}, {"exp_avg_sq", &v_}};
    }

  private:
    OptimConfig cfg_;
    ParamLayout layout_;
    Buffer<float> m_, v_;
};

class Sgd final : public Optimizer {
  public:
    Sgd(const OptimConfig& cfg, const ParamLayout& layout)
        : cfg_(cfg), layout_(layout), buf_(layout.total, MemCategory::OptimizerState) {}

    void step(float* params, const float* grads, double lr) override {
        t_++;
        const float mu = (float)cfg_.momentum, flr = (float)lr;
        const bool first = t_ == 1;
        for (const auto& t : layout_.tensors) {
            const float wd = t.decay ? (float)cfg_.weight_decay : 0.0f;
            float* p = params + t.offset;
            const float* g = grads + t.offset;
            float* b = buf_.data() + t.offset;
            const int64_t n = (int64_t)t.numel;
#pragma omp parallel for simd schedule(static)
            for (int64_t i = 0; i < n; i++) {
                float gi = g[i] + wd * p[i];
                float bi = first ? gi : mu * b[i] + gi;
                b[i] = bi;
                float d = cfg_.nesterov ? gi + mu * bi : bi;
                p[i] -= flr * d;
            }
        }
    }

    std::vector<std::pair<std::string, Buffer<float>*>> state() override {
        return {{"momentum_buffer", &buf_}};
    }

  private:
    OptimConfig cfg_;
    ParamLayout layout_;
    Buffer<float> buf_;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimConfig& cfg, const ParamLayout& layout) {
    cfg.validate();
    if (cfg.name == "sgd") return std::make_unique<Sgd>(cfg, layout);
    return std::make_unique<AdamW>(cfg, layout);
}

double clip_grad_norm(float* grads, std::size_t n, double max_norm) {
    double norm = std::sqrt(cpu::sum_squares(grads, (int64_t)n));
    if (max_norm > 0) {
        double coef = max_norm / (norm + 1e-6);
        if (coef < 1.0) cpu::scale_inplace(grads, (float)coef, (int64_t)n);
    }
    return norm;
}

}  // namespace memtrain
