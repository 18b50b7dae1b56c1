// The KV-cache decoder (see kv_decoder.h): the block forward of model/gpt.cpp for a few new rows,
// with attention over the cached keys and values instead of a (T,T) score matrix.
#include "model/kv_decoder.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/ops.h"

namespace memtrain {

KvDecoder::KvDecoder(const ModelConfig& cfg, const ParamLayout& layout, const float* params,
                     int capacity)
    : cfg_(cfg), layout_(layout), params_(params), capacity_(capacity) {
    if (capacity <= 0 || capacity > cfg.block_size)
        fail("KV cache capacity {} must be in [1, model.block_size = {}]", capacity,
             cfg.block_size);
    const std::size_t kv = (std::size_t)cfg.kv_heads() * cfg.head_dim();
    k_.resize((std::size_t)cfg.n_layer * capacity * kv);
    v_.resize(k_.size());
}

void KvDecoder::append(std::span<const int32_t> tokens, float* last_logits) {
    const int n = (int)tokens.size(), pos0 = length_;
    if (n == 0) fail("KvDecoder::append needs at least one token");
    if (pos0 + n > capacity_)
        fail("KV cache full: {} cached + {} new positions > capacity {}", pos0, n, capacity_);
    const int C = cfg_.n_embd, NH = cfg_.n_head, NKV = cfg_.kv_heads(), hs = cfg_.head_dim(),
              QKV = cfg_.qkv_dim(), F = cfg_.fc_dim(), H = cfg_.mlp_hidden(), KV = NKV * hs,
              group = NH / NKV;
    const float eps = (float)cfg_.norm_eps;
    auto unit = [&](int u) { return const_cast<float*>(params_) + layout_.units[u].begin; };
    const EmbeddingParams emb = embedding_view(layout_, unit(ParamLayout::embedding_unit()));

    std::vector<float> x((std::size_t)n * C), ln(x.size()), atty(x.size()), mean(n), rstd(n),
        qkv((std::size_t)n * QKV), fch((std::size_t)n * F), act((std::size_t)n * H),
        scores((std::size_t)capacity_);
    for (int i = 0; i < n; i++) {
        const int32_t tok = tokens[i];
        if (tok < 0 || tok >= cfg_.vocab_size)
            fail("token id {} is outside the model's vocabulary [0, {})", tok, cfg_.vocab_size);
        const float* e = emb.wte + (std::size_t)tok * C;
        float* row = x.data() + (std::size_t)i * C;
        for (int c = 0; c < C; c++) row[c] = e[c];
        if (emb.wpe) cpu::add_inplace(row, emb.wpe + (std::size_t)(pos0 + i) * C, C);
    }
    auto norm = [&](float* out, const float* inp, const float* w, const float* b, int rows) {
        if (cfg_.rmsnorm())
            cpu::rmsnorm_forward(out, rstd.data(), inp, w, rows, C, eps);
        else
            cpu::layernorm_forward(out, mean.data(), rstd.data(), inp, w, b, rows, C, eps);
    };
    const float scale = 1.0f / std::sqrt((float)hs);
    for (int l = 0; l < cfg_.n_layer; l++) {
        const BlockParams p = block_view(layout_, l, unit(layout_.block_unit(l)));
        float* kc = k_.data() + (std::size_t)l * capacity_ * KV;
        float* vc = v_.data() + (std::size_t)l * capacity_ * KV;
        norm(ln.data(), x.data(), p.ln1_w, p.ln1_b, n);
        cpu::matmul_forward(qkv.data(), ln.data(), p.qkv_w, p.qkv_b, n, C, QKV);
        if (cfg_.rope())
            cpu::rope_forward(qkv.data(), 1, n, NH, NKV, hs, (float)cfg_.rope_theta, pos0);
        for (int i = 0; i < n; i++) {
            const float* row = qkv.data() + (std::size_t)i * QKV;
            std::memcpy(kc + (std::size_t)(pos0 + i) * KV, row + C, KV * sizeof(float));
            std::memcpy(vc + (std::size_t)(pos0 + i) * KV, row + C + KV, KV * sizeof(float));
        }
        // Causal attention of each new row over every cached position up to its own.
        for (int i = 0; i < n; i++) {
            const int last = pos0 + i;
            for (int h = 0; h < NH; h++) {
                const float* q = qkv.data() + (std::size_t)i * QKV + h * hs;
                const int kvh = h / group;
                float maxv = -INFINITY;
                for (int j = 0; j <= last; j++) {
                    const float* k = kc + (std::size_t)j * KV + kvh * hs;
                    float dot = 0.0f;
                    for (int d = 0; d < hs; d++) dot += q[d] * k[d];
                    scores[j] = dot * scale;
                    maxv = std::max(maxv, scores[j]);
                }
                float sum = 0.0f;
                for (int j = 0; j <= last; j++) {
                    scores[j] = std::exp(scores[j] - maxv);
                    sum += scores[j];
                }
                float* out = atty.data() + (std::size_t)i * C + h * hs;
                std::fill(out, out + hs, 0.0f);
                for (int j = 0; j <= last; j++) {
                    const float w = scores[j] / sum;
                    const float* v = vc + (std::size_t)j * KV + kvh * hs;
                    for (int d = 0; d < hs; d++) out[d] += w * v[d];
                }
            }
        }
        cpu::matmul_forward(x.data(), atty.data(), p.proj_w, p.proj_b, n, C, C, 1.0f);
        norm(ln.data(), x.data(), p.ln2_w, p.ln2_b, n);
        cpu::matmul_forward(fch.data(), ln.data(), p.fc_w, p.fc_b, n, C, F);
        if (cfg_.swiglu())
            cpu::swiglu_forward(act.data(), fch.data(), n, H);
        else
            cpu::gelu_forward(act.data(), fch.data(), (int64_t)n * H);
        cpu::matmul_forward(x.data(), act.data(), p.fcp_w, p.fcp_b, n, H, C, 1.0f);
    }
    length_ += n;
    const HeadParams head = head_view(layout_, unit(layout_.head_unit()));
    norm(ln.data(), x.data() + (std::size_t)(n - 1) * C, head.lnf_w, head.lnf_b, 1);
    const float* out_emb = cfg_.tied_embeddings ? emb.wte : head.lm_head;
    cpu::classifier_logits(last_logits, ln.data(), out_emb, 1, C, cfg_.vocab_size);
}

}  // namespace memtrain
