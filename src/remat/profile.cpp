// The profiling pass behind measured recompute costs (see profile.h).
#include "remat/profile.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <vector>

#include "core/rng.h"
#include "kernels/cpu/ops.h"

namespace memtrain::remat {

namespace {

int64_t fastest_ns(int reps, const std::function<void()>& f) {
    f();  // warm-up: first touch of the buffers, thread pool start
    int64_t best = INT64_MAX;
    for (int i = 0; i < reps; i++) {
        auto t0 = std::chrono::steady_clock::now();
        f();
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now() - t0)
                      .count();
        best = std::min<int64_t>(best, ns);
    }
    return best;
}

std::vector<float> random_buffer(std::size_t n, Rng& rng, float scale) {
    std::vector<float> v(n);
    for (auto& x : v) x = (float)(rng.normal() * scale);
    return v;
}

}  // namespace

BlockFlops measure_block(const ModelConfig& cfg, int B, int T, int reps) {
    const int N = B * T, C = cfg.n_embd, QKV = cfg.qkv_dim(), F = cfg.fc_dim(),
              H = cfg.mlp_hidden(), NH = cfg.n_head;
    const std::size_t n = (std::size_t)N;
    Rng rng(7);
    // The block's inputs and weights (values only need to be finite and typical).
    auto x = random_buffer(n * C, rng, 1.0f);
    auto w_norm = std::vector<float>(C, 1.0f), b_norm = std::vector<float>(C, 0.0f);
    auto w_qkv = random_buffer((std::size_t)C * QKV, rng, 0.02f);
    auto w_proj = random_buffer((std::size_t)C * C, rng, 0.02f);
    auto w_fc = random_buffer((std::size_t)C * F, rng, 0.02f);
    auto w_fcp = random_buffer((std::size_t)H * C, rng, 0.02f);
    std::vector<float> bias(std::max({QKV, F, C}), 0.0f);
    std::vector<float> ln(n * C), mean(n), rstd(n), qkv(n * QKV), att(n * NH * (std::size_t)T),
        atty(n * C), resid(n * C), fch(n * F), act(n * H), out(n * C);

    BlockFlops t;
    t.ln = fastest_ns(reps, [&] {
        if (cfg.rmsnorm())
            cpu::rmsnorm_forward(ln.data(), rstd.data(), x.data(), w_norm.data(), N, C,
                                 (float)cfg.norm_eps);
        else
            cpu::layernorm_forward(ln.data(), mean.data(), rstd.data(), x.data(), w_norm.data(),
                                   b_norm.data(), N, C, (float)cfg.norm_eps);
    });
    t.qkv = fastest_ns(reps, [&] {
        cpu::matmul_forward(qkv.data(), ln.data(), w_qkv.data(), bias.data(), N, C, QKV);
        if (cfg.rope())
            cpu::rope_forward(qkv.data(), B, T, NH, cfg.kv_heads(), cfg.head_dim(),
                              (float)cfg.rope_theta);
    });
    t.attention = fastest_ns(reps, [&] {
        cpu::attention_forward(atty.data(), att.data(), qkv.data(), B, T, C, NH, cfg.kv_heads());
    });
    t.proj = fastest_ns(reps, [&] {
        std::memcpy(resid.data(), x.data(), sizeof(float) * n * C);
        cpu::matmul_forward(resid.data(), atty.data(), w_proj.data(), bias.data(), N, C, C, 1.0f);
    });
    t.fc = fastest_ns(reps, [&] {
        cpu::matmul_forward(fch.data(), ln.data(), w_fc.data(), bias.data(), N, C, F);
    });
    t.gelu = fastest_ns(reps, [&] {
        if (cfg.swiglu())
            cpu::swiglu_forward(act.data(), fch.data(), N, H);
        else
            cpu::gelu_forward(act.data(), fch.data(), (int64_t)N * H);
    });
    t.fc_proj = fastest_ns(reps, [&] {
        std::memcpy(out.data(), resid.data(), sizeof(float) * n * C);
        cpu::matmul_forward(out.data(), act.data(), w_fcp.data(), bias.data(), N, H, C, 1.0f);
    });
    return t;
}

double estimated_step_ns(const ModelConfig& cfg, int B, int T, const BlockFlops& measured) {
    const double blocks_flops = 3.0 * cfg.n_layer * (double)block_flops(cfg, B, T).forward();
    const double ratio = (double)step_flops(cfg, B, T) / blocks_flops;
    return 3.0 * cfg.n_layer * (double)measured.forward() * ratio;
}

MeasuredStep measure_step(const ModelConfig& cfg, int B, int T, const RematPlan& plan, int steps) {
    GPT m(cfg);
    m.set_remat(plan);
    m.init_weights(1);
    Rng rng(11);
    std::vector<int32_t> x((std::size_t)B * T), y((std::size_t)B * T);
    for (auto& v : x) v = (int32_t)(rng.next_u64() % cfg.vocab_size);
    for (auto& v : y) v = (int32_t)(rng.next_u64() % cfg.vocab_size);
    const float scale = 1.0f / (float)(B * T);
    MeasuredStep r;
    r.seconds = 1e-9 * (double)fastest_ns(steps, [&] {
                    m.zero_grads();
                    m.forward_backward(x.data(), y.data(), B, T, scale);
                });
    r.activation_bytes = host_memory().snapshot()[MemCategory::Activations];
    return r;
}

}  // namespace memtrain::remat
