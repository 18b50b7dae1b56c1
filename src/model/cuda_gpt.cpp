// The GPT model on the GPU (see cuda_gpt.h): the CPU model's block forward and backward, kernel
// for kernel, over kernels/cuda, with the linear layers' bias, residual and GELU fused into the
// cuBLASLt epilogues.
#include "model/cuda_gpt.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/token_buckets.h"
#include "model/cuda_lora.h"

namespace memtrain {

template <typename T>
ActFormat CudaGPT<T>::arena_format(const ModelConfig& cfg, int B, int T_) {
    return cuda_arena_format(cfg, (int)sizeof(T), B, T_);
}

template <typename T>
std::size_t CudaGPT<T>::token_bytes(int B, int T_) {
    const std::size_t N = (std::size_t)B * T_;
    return (5 * N + 1) * sizeof(int32_t);  // inputs, targets, plan (at most 3N + 1)
}

template <typename T>
CudaGPT<T>::CudaGPT(const ModelConfig& cfg, cudaStream_t stream, std::size_t padded_total,
                    DeviceUnitStore<T>* units, CudaLora<T>* lora, DeviceGradStore<T>* grads)
    : cfg_(cfg),
      layout_(make_param_layout(cfg)),
      stream_(stream),
      units_(units),
      grad_units_(units ? units : grads),
      lora_(lora) {
    cfg_.validate();
    if (units && grads) fail("internal: CudaGPT takes a unit store or a gradient store, not both");
    b1_ = cfg_.n_layer;
    slots_.resize(1);
    if (!units_) {
        const std::size_t n = std::max(padded_total, layout_.total);
        params_ = DeviceBuffer<T>(n, MemCategory::Parameters);
        if (!frozen() && !grad_units_) grads_ = DeviceBuffer<T>(n, MemCategory::Gradients);
    }
    for (int l = 0; l < cfg_.n_layer; l++) block_off_.push_back(block_offsets(layout_, l));
    const int emb = ParamLayout::embedding_unit(), head = layout_.head_unit();
    off_wte_ = unit_tensor_offset(layout_, emb, "wte.weight");
    off_wpe_ = unit_tensor_offset(layout_, emb, "wpe.weight");
    off_lnf_w_ = unit_tensor_offset(layout_, head, "ln_f.weight");
    off_lnf_b_ = unit_tensor_offset(layout_, head, "ln_f.bias");
    off_lm_ = unit_tensor_offset(layout_, head, "lm_head.weight");
    lm_unit_ = head;
    if (off_lm_ == SIZE_MAX) {  // tied: the output embedding is wte
        off_lm_ = off_wte_;
        lm_unit_ = emb;
    }
    for (auto& e : copied_) MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    graph_loss_buf_ = DeviceBuffer<double>(1, MemCategory::Workspace);
    graph_loss_ = graph_loss_buf_.data();
    make_walk();
}

template <typename T>
void CudaGPT<T>::make_walk() {
    const RematPlan stage = stage_plan();
    walk_ = make_unit_walk(layout_, cfg_.n_layer, cfg_.tied_embeddings, b0_, b1_, stage);
    // The rebuilds of dropped block inputs, each within blocks [b0_, b1_) (a pipeline stage's
    // first input arrives from the stage before and stays), indexed by model block.
    rebuild_ = stage.empty() ? InputRebuild{} : input_rebuild(stage);
    if (stage.empty() || b0_ == 0) return;
    auto by_model_block = [&](const std::vector<int>& local, bool is_block) {
        std::vector<int> out((std::size_t)cfg_.n_layer, -1);
        for (std::size_t j = 0; j < local.size(); j++)
            out[(std::size_t)b0_ + j] = is_block && local[j] >= 0 ? local[j] + b0_ : local[j];
        return out;
    };
    rebuild_.from = by_model_block(rebuild_.from, true);
    rebuild_.slot = by_model_block(rebuild_.slot, false);
    rebuild_.holder = by_model_block(rebuild_.holder, true);
}

template <typename T>
CudaGPT<T>::~CudaGPT() {
    drop_graph();
    if (copy_stream_) cudaStreamSynchronize(copy_stream_);
    for (auto* v : {&produced_, &to_host_, &consumed_, &to_device_})
        for (auto& e : *v) cudaEventDestroy(e);
    if (host_resid_) {
        cudaFreeHost(host_resid_);
        host_memory().on_free(MemCategory::Activations, offload_bytes_, offload_bytes_);
    }
    if (copy_stream_) cudaStreamDestroy(copy_stream_);
    for (auto& e : copied_)
        if (e) cudaEventDestroy(e);
    for (auto& p : pinned_)
        if (p) cudaFreeHost(p);
}

template <typename T>
void CudaGPT<T>::set_remat(const RematPlan& plan) {
    if (!plan.empty() && plan.size() != (std::size_t)cfg_.n_layer)
        fail("remat plan has {} entries but model.n_layer is {}", plan.size(), cfg_.n_layer);
    input_rebuild(plan);  // (a plan no block can rebuild from fails)
    if (staged_)
        for (BlockKeep k : plan)
            if (k == BlockKeep::Offload)
                fail(
                    "train.remat = offload is not built for a pipeline stage on the GPU: choose "
                    "none, selective, full or a budget without +offload");
    plan_ = plan;
    make_walk();
    arena_B_ = arena_T_ = 0;  // re-carved at the next forward
}

template <typename T>
void CudaGPT<T>::set_stage(int first_block, int end_block, int slots) {
    if (first_block < 0 || end_block > cfg_.n_layer || first_block >= end_block || slots < 1)
        fail("internal: a stage of blocks [{}, {}) of {} with {} slots", first_block, end_block,
             cfg_.n_layer, slots);
    if (!units_) fail("internal: a pipeline stage reaches its units through a store");
    wait("queued work on the old arenas");
    b0_ = first_block;
    b1_ = end_block;
    staged_ = true;
    make_walk();
    slots_.clear();
    slots_.resize(slots);
    arena_B_ = arena_T_ = 0;
}

template <typename T>
ArenaPlan CudaGPT<T>::stage_arena(int B, int T_) const {
    return plan_stage_arena(cfg_, b1_ - b0_, B, T_, stage_plan(), arena_format(cfg_, B, T_));
}

template <typename T>
void CudaGPT<T>::use_slot(int k) {
    Slot& s = slots_.at(k);
    cur_ = k;
    resid_ = s.resid;
    saved_ = s.saved;
    lnf_ = s.lnf;
    lnf_mean_ = s.lnf_mean;
    lnf_rstd_ = s.lnf_rstd;
    tok_ = s.tokens.data();
    unique_ = s.unique;
}

template <typename T>
void CudaGPT<T>::zero_grads() {
    if (grads_.size()) MT_CUDA_CHECK(cudaMemsetAsync(grads_.data(), 0, grads_.bytes(), stream_));
}

template <typename T>
void CudaGPT<T>::unit_grads_done(int u) {
    if (grad_units_)
        grad_units_->grads_done(u);
    else if (grads_done_)
        grads_done_(u);
}

template <typename T>
void CudaGPT<T>::ensure_arena(int B, int T_) {
    if (T_ > cfg_.block_size)
        fail("sequence length {} exceeds model.block_size {}", T_, cfg_.block_size);
    // Token rows are ints in the kernels, and the embedding's backward sorts 2N of them.
    if (B < 1 || (int64_t)B * T_ > INT32_MAX / 2)
        fail("a batch of {} x {} tokens: the GPU model runs 1 to {} tokens at once", B, T_,
             INT32_MAX / 2);
    if (B == arena_B_ && T_ == arena_T_) return;
    const ActFormat fmt = arena_format(cfg_, B, T_);
    const ArenaPlan p = stage_arena(B, T_);
    wait("queued work on the old arenas");
    drop_graph();  // a captured step points into the arenas
    // Exactly the plan's sizes (free first: no transient double peak), so measured == predicted.
    const std::size_t nt = token_bytes(B, T_) / sizeof(int32_t);
    for (Slot& sl : slots_) {
        if (p.activation_bytes != sl.acts.size()) {
            sl.acts.reset();
            sl.acts = DeviceBuffer<unsigned char>(p.activation_bytes, MemCategory::Activations);
        }
        if (sl.tokens.size() != nt) {
            sl.tokens.reset();
            sl.tokens = DeviceBuffer<int32_t>(nt, MemCategory::Workspace);
        }
    }
    if (p.workspace_bytes != work_.size()) {
        work_.reset();
        work_ = DeviceBuffer<unsigned char>(p.workspace_bytes, MemCategory::Workspace);
    }
    if (pinned_ints_ < nt) {
        for (int i = 0; i < 2; i++) {
            if (pinned_[i]) {
                MT_CUDA_CHECK(cudaEventSynchronize(copied_[i]));
                MT_CUDA_CHECK(cudaFreeHost(pinned_[i]));
            }
            MT_CUDA_CHECK(
                cudaMallocHost(reinterpret_cast<void**>(&pinned_[i]), nt * sizeof(int32_t)));
        }
        pinned_ints_ = nt;
    }
    // The kernels' fixed-order partial sums grow the process-wide scratch to the plan's size
    // once, here, rather than in the middle of a step.
    device_scratch(cuda_kernel_scratch_bytes(cfg_, B, T_));
    arena_B_ = B;
    arena_T_ = T_;
    chunk_ = fmt.loss_chunk;

    unsigned char* w = work_.data();
    auto at = [](unsigned char* base, std::size_t off) -> void* {
        return off == kNoOffset ? nullptr : base + off;
    };
    // Each slot's arena: the plan's streams and blocks j = 0.. are the model's b0_ + j.
    for (Slot& sl : slots_) {
        unsigned char* a = sl.acts.data();
        sl.resid.assign(cfg_.n_layer + 1, nullptr);
        for (int j = 0; j <= b1_ - b0_; j++) sl.resid[b0_ + j] = static_cast<T*>(at(a, p.resid[j]));
        sl.held.clear();
        for (std::size_t off : p.held) sl.held.push_back(static_cast<T*>(at(a, off)));
        sl.saved.assign(cfg_.n_layer, Saved{});
        for (int j = 0; j < b1_ - b0_; j++) {
            auto f = [&](SavedField field) { return at(a, p.block[j][static_cast<int>(field)]); };
            Saved& s = sl.saved[b0_ + j];
            s.ln1 = static_cast<T*>(f(SavedField::Ln1));
            s.ln1_mean = static_cast<float*>(f(SavedField::Ln1Mean));
            s.ln1_rstd = static_cast<float*>(f(SavedField::Ln1Rstd));
            s.qkv = static_cast<T*>(f(SavedField::Qkv));
            s.lse = static_cast<float*>(f(SavedField::Att));
            s.atty = static_cast<T*>(f(SavedField::Atty));
            s.resid_mid = static_cast<T*>(f(SavedField::ResidMid));
            s.ln2 = static_cast<T*>(f(SavedField::Ln2));
            s.ln2_mean = static_cast<float*>(f(SavedField::Ln2Mean));
            s.ln2_rstd = static_cast<float*>(f(SavedField::Ln2Rstd));
            s.fch = static_cast<T*>(f(SavedField::Fch));
            s.fch_act = static_cast<T*>(f(SavedField::FchAct));
        }
        sl.lnf = static_cast<T*>(at(a, p.lnf));
        sl.lnf_mean = static_cast<float*>(at(a, p.lnf_mean));
        sl.lnf_rstd = static_cast<float*>(at(a, p.lnf_rstd));
    }
    use_slot(0);
    dres_ = static_cast<T*>(at(w, p.dres));
    dln_ = static_cast<T*>(at(w, p.dln));
    dbig_ = static_cast<T*>(at(w, p.dbig));
    dact_ = static_cast<T*>(at(w, p.dact));
    logits_ = static_cast<T*>(at(w, p.logits));
    row_loss_ = static_cast<float*>(at(w, p.row_loss));
    att_delta_ = static_cast<float*>(at(w, p.att_delta));

    // Offload: pinned host room for the block inputs that leave the ring, counted as host
    // activations, a side stream and the per-block events.
    offloaded_.clear();
    off_index_.assign(cfg_.n_layer, -1);
    for (int l = 0; l < cfg_.n_layer; l++) {
        if (keep(l) != BlockKeep::Offload) continue;
        off_index_[l] = (int)offloaded_.size();
        offloaded_.push_back(l);
    }
    ring_ = std::min((int)offloaded_.size(), kOffloadSlots);
    if (host_resid_ && offload_bytes_ != p.offloaded_bytes) {
        MT_CUDA_CHECK(cudaStreamSynchronize(copy_stream_));
        MT_CUDA_CHECK(cudaFreeHost(host_resid_));
        host_memory().on_free(MemCategory::Activations, offload_bytes_, offload_bytes_);
        host_resid_ = nullptr;
    }
    offload_bytes_ = p.offloaded_bytes;
    if (offload_bytes_ > 0 && !host_resid_) {
        MT_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_resid_), offload_bytes_));
        host_memory().on_alloc(MemCategory::Activations, offload_bytes_, offload_bytes_);
    }
    if (offloads() && !copy_stream_) {
        MT_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
        for (auto* v : {&produced_, &to_host_, &consumed_, &to_device_}) {
            v->resize(cfg_.n_layer);
            for (auto& e : *v) MT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        }
    }
}

template <typename T>
void CudaGPT<T>::upload_tokens(const int32_t* inputs, const int32_t* targets, int B, int T_) {
    const int N = B * T_;
    for (int i = 0; i < N; i++) {
        if (inputs[i] < 0 || inputs[i] >= cfg_.vocab_size)
            fail("input token {} at position {} is outside the vocabulary [0, {})", inputs[i], i,
                 cfg_.vocab_size);
        if (targets && (targets[i] < 0 || targets[i] >= cfg_.vocab_size))
            fail("target token {} at position {} is outside the vocabulary [0, {})", targets[i], i,
                 cfg_.vocab_size);
    }
    // The embedding backward's token order, from the host ids (no copy back from the GPU).
    unique_ = targets ? cuda::bucket_tokens(inputs, N, plan_host_) : 0;
    slots_[cur_].unique = unique_;
    const std::size_t n = 2 * (std::size_t)N + (targets ? plan_host_.size() : 0);
    // Reuse the pinned buffer whose last copy has completed.
    const int k = next_pinned_;
    next_pinned_ ^= 1;
    MT_CUDA_CHECK(cudaEventSynchronize(copied_[k]));
    int32_t* h = pinned_[k];
    std::memcpy(h, inputs, N * sizeof(int32_t));
    if (targets) {
        std::memcpy(h + N, targets, N * sizeof(int32_t));
        std::memcpy(h + 2 * (std::size_t)N, plan_host_.data(), plan_host_.size() * sizeof(int32_t));
    }
    MT_CUDA_CHECK(cudaMemcpyAsync(tok_, h, n * sizeof(int32_t), cudaMemcpyHostToDevice, stream_));
    MT_CUDA_CHECK(cudaEventRecord(copied_[k], stream_));
}

template <typename T>
void CudaGPT<T>::norm_forward(T* out, float* mean, float* rstd, const T* inp, const T* w,
                              const T* b, int N) {
    const float eps = (float)cfg_.norm_eps;
    if (cfg_.rmsnorm())
        cuda::rmsnorm_forward<T>(out, rstd, inp, w, N, cfg_.n_embd, eps, stream_);
    else
        cuda::layernorm_forward<T>(out, mean, rstd, inp, w, b, N, cfg_.n_embd, eps, stream_);
}

template <typename T>
void CudaGPT<T>::norm_backward(T* dinp, T* dw, T* db, const T* dout, const T* inp, const T* w,
                               const float* mean, const float* rstd, int N) {
    if (cfg_.rmsnorm())
        cuda::rmsnorm_backward<T>(dinp, dw, dout, inp, w, rstd, N, cfg_.n_embd, stream_);
    else
        cuda::layernorm_backward<T>(dinp, dw, db, dout, inp, w, mean, rstd, N, cfg_.n_embd,
                                    stream_);
}

template <typename T>
bool CudaGPT<T>::adapted(int l, BlockLinear k) const {
    return lora_ && lora_->adapts(l, k);
}

template <typename T>
void CudaGPT<T>::lora_forward(int l, BlockLinear k, const T* x, T* y, int N) {
    if (adapted(l, k)) lora_->forward(l, k, x, y, N);
}

template <typename T>
void CudaGPT<T>::lora_backward(int l, BlockLinear k, const T* x, const T* dy, T* dx, int N) {
    if (adapted(l, k)) lora_->backward(l, k, x, dy, dx, N);
}

// Adapters (LoRA) add their share to each linear's output right after it, as on the CPU
// (GPT::block_forward); c_fc's GELU epilogue is then unfused, since the adapter adds to its input.
template <typename T>
void CudaGPT<T>::block_forward(const Block& p, int l, const T* x, T* out, const Saved& s, int B,
                               int T_) {
    const int N = B * T_, C = cfg_.n_embd, QKV = cfg_.qkv_dim(), F = cfg_.fc_dim(),
              H = cfg_.mlp_hidden();
    norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N);
    cuda::matmul_forward<T>(s.qkv, s.ln1, p.qkv_w, p.qkv_b, N, C, QKV, nullptr, stream_);
    lora_forward(l, BlockLinear::Qkv, s.ln1, s.qkv, N);
    if (cfg_.rope())
        cuda::rope_forward<T>(s.qkv, B, T_, cfg_.n_head, cfg_.kv_heads(), cfg_.head_dim(),
                              (float)cfg_.rope_theta, stream_);
    cuda::attention_forward<T>(s.atty, s.lse, s.qkv, B, T_, C, cfg_.n_head, cfg_.kv_heads(),
                               stream_);
    // The residual adds ride in the projections' epilogues (cuBLASLt's C input).
    cuda::matmul_forward<T>(s.resid_mid, s.atty, p.proj_w, p.proj_b, N, C, C, x, stream_);
    lora_forward(l, BlockLinear::Proj, s.atty, s.resid_mid, N);
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N);
    if (cfg_.swiglu() || adapted(l, BlockLinear::Fc)) {
        cuda::matmul_forward<T>(s.fch, s.ln2, p.fc_w, p.fc_b, N, C, F, nullptr, stream_);
        lora_forward(l, BlockLinear::Fc, s.ln2, s.fch, N);
        if (cfg_.swiglu())
            cuda::swiglu_forward<T>(s.fch_act, s.fch, N, H, stream_);
        else
            cuda::gelu_forward<T>(s.fch_act, s.fch, (int64_t)N * H, stream_);
    } else {
        cuda::matmul_forward_gelu<T>(s.fch_act, s.fch, s.ln2, p.fc_w, p.fc_b, N, C, F, stream_);
    }
    cuda::matmul_forward<T>(out, s.fch_act, p.fcp_w, p.fcp_b, N, H, C, s.resid_mid, stream_);
    lora_forward(l, BlockLinear::FcProj, s.fch_act, out, N);
}

// What Selective dropped (ln_1, ln_2, the mlp activation), recomputed from what it kept.
template <typename T>
void CudaGPT<T>::recompute_selective(const Block& p, const T* x, const Saved& s, int B, int T_) {
    const int N = B * T_, H = cfg_.mlp_hidden();
    norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, N);
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, N);
    if (cfg_.swiglu())
        cuda::swiglu_forward<T>(s.fch_act, s.fch, N, H, stream_);
    else
        cuda::gelu_forward<T>(s.fch_act, s.fch, (int64_t)N * H, stream_);
}

// On entry dres_ holds d(block output); on exit d(block input). Under LoRA `g` is all null (the
// base is frozen) and each linear's adapters add their share to its input gradient right after
// it, as on the CPU (GPT::block_backward).
template <typename T>
void CudaGPT<T>::block_backward(const Block& p, const Block& g, int l, const T* x, const Saved& s,
                                int B, int T_) {
    const int N = B * T_, C = cfg_.n_embd, QKV = cfg_.qkv_dim(), F = cfg_.fc_dim(),
              H = cfg_.mlp_hidden();
    T* dfch = dbig_;
    if (cfg_.swiglu()) {
        cuda::matmul_backward<T>(dact_, g.fcp_w, g.fcp_b, dres_, s.fch_act, p.fcp_w, N, H, C,
                                 nullptr, stream_);
        lora_backward(l, BlockLinear::FcProj, s.fch_act, dres_, dact_, N);
        cuda::swiglu_backward<T>(dfch, s.fch, dact_, N, H, stream_);
    } else if (adapted(l, BlockLinear::FcProj)) {
        cuda::matmul_backward<T>(dfch, g.fcp_w, g.fcp_b, dres_, s.fch_act, p.fcp_w, N, H, C,
                                 nullptr, stream_);
        lora_backward(l, BlockLinear::FcProj, s.fch_act, dres_, dfch, N);
        cuda::gelu_backward<T>(dfch, s.fch, dfch, (int64_t)N * H, stream_);
    } else {
        // d(fch) = (dres @ W^T) * gelu'(fch): the GELU backward rides in the GEMM's epilogue.
        cuda::matmul_backward<T>(dfch, g.fcp_w, g.fcp_b, dres_, s.fch_act, p.fcp_w, N, H, C, s.fch,
                                 stream_);
    }
    cuda::matmul_backward<T>(dln_, g.fc_w, g.fc_b, dfch, s.ln2, p.fc_w, N, C, F, nullptr, stream_);
    lora_backward(l, BlockLinear::Fc, s.ln2, dfch, dln_, N);
    norm_backward(dres_, g.ln2_w, g.ln2_b, dln_, s.resid_mid, p.ln2_w, s.ln2_mean, s.ln2_rstd, N);
    T* datty = dln_;
    cuda::matmul_backward<T>(datty, g.proj_w, g.proj_b, dres_, s.atty, p.proj_w, N, C, C, nullptr,
                             stream_);
    lora_backward(l, BlockLinear::Proj, s.atty, dres_, datty, N);
    T* dqkv = dbig_;
    cuda::attention_backward<T>(dqkv, att_delta_, datty, s.qkv, s.atty, s.lse, B, T_, C,
                                cfg_.n_head, cfg_.kv_heads(), stream_);
    if (cfg_.rope())
        cuda::rope_backward<T>(dqkv, B, T_, cfg_.n_head, cfg_.kv_heads(), cfg_.head_dim(),
                               (float)cfg_.rope_theta, stream_);
    cuda::matmul_backward<T>(dln_, g.qkv_w, g.qkv_b, dqkv, s.ln1, p.qkv_w, N, C, QKV, nullptr,
                             stream_);
    lora_backward(l, BlockLinear::Qkv, s.ln1, dqkv, dln_, N);
    norm_backward(dres_, g.ln1_w, g.ln1_b, dln_, x, p.ln1_w, s.ln1_mean, s.ln1_rstd, N);
}

template <typename T>
void CudaGPT<T>::forward(int B, int T_, bool offload_inputs) {
    const int N = B * T_, L = cfg_.n_layer;
    offload_inputs = offload_inputs && offloads();
    const std::size_t stream_bytes = (std::size_t)N * cfg_.n_embd * sizeof(T);
    // Block input l leaves the device when the ring will reuse its slot.
    auto copy_out = [&](int l) {
        if (!offload_inputs || !leaves_device(l)) return;
        MT_CUDA_CHECK(cudaEventRecord(produced_[l], stream_));
        MT_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, produced_[l], 0));
        MT_CUDA_CHECK(cudaMemcpyAsync(host_resid_ + (std::size_t)off_index_[l] * stream_bytes,
                                      resid_[l], stream_bytes, cudaMemcpyDeviceToHost,
                                      copy_stream_));
        MT_CUDA_CHECK(cudaEventRecord(to_host_[l], copy_stream_));
    };
    // The shared schedule (model/unit_walk.h): each part acquires its unit, announces the next
    // (ZeRO-3 gathers it meanwhile) and runs; the head announces the output embedding for the
    // classifier.
    for (const UnitVisit& v : walk_.forward) {
        T* w = unit_params(v.unit);
        prefetch(v.prefetch);
        switch (v.part) {
            case UnitVisit::Part::Embedding:
                cuda::embedding_forward<T>(resid_[0], tok_, tensor_at(w, off_wte_),
                                           tensor_at(w, off_wpe_), B, T_, cfg_.n_embd, stream_);
                unit_params_done(v.unit);
                copy_out(0);
                break;
            case UnitVisit::Part::Block: {
                // Block l writes input l + 1 into a ring slot: the copy of the slot's previous
                // input must be out.
                const int l = v.block;
                const int evicted = l + 1 < L ? slot_before(l + 1) : -1;
                if (offload_inputs && evicted >= 0)
                    MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, to_host_[evicted], 0));
                block_forward(block_at(block_off_[l], w), l, resid_[l], resid_[l + 1], saved_[l], B,
                              T_);
                unit_params_done(v.unit);
                if (l + 1 < L) copy_out(l + 1);
                break;
            }
            case UnitVisit::Part::Head:
                norm_forward(lnf_, lnf_mean_, lnf_rstd_, resid_[L], tensor_at(w, off_lnf_w_),
                             tensor_at(w, off_lnf_b_), N);
                unit_params_done(v.unit);
                break;
        }
    }
}

template <typename T>
void CudaGPT<T>::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T_,
                                  float grad_scale, double* loss_sum) {
    ensure_arena(B, T_);
    upload_tokens(inputs, targets, B, T_);
    if (!graphs_) {
        step_body(B, T_, grad_scale, loss_sum);
    } else {
        // The body reads only fixed device buffers, so one capture replays for every micro-batch
        // of this shape and gradient scale (the token upload above and the embedding backward
        // below stay outside: the copy's source and the backward's grid change every time).
        // The first micro-batch runs eagerly, so lazily created state (cuBLASLt's handle, plans
        // and workspace) exists before anything is captured.
        if (graph_exec_ && (graph_B_ != B || graph_T_ != T_ || graph_scale_ != grad_scale))
            drop_graph();
        if (!graph_exec_ && warmed_up_) {
            cudaGraph_t graph = nullptr;
            MT_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeGlobal));
            step_body(B, T_, grad_scale, graph_loss_);
            MT_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
            MT_CUDA_CHECK(cudaGraphInstantiate(&graph_exec_, graph, 0));
            MT_CUDA_CHECK(cudaGraphDestroy(graph));
            graph_B_ = B;
            graph_T_ = T_;
            graph_scale_ = grad_scale;
        }
        if (graph_exec_) {
            MT_CUDA_CHECK(cudaGraphLaunch(graph_exec_, stream_));
            graph_replays_++;
            MT_CUDA_CHECK(cudaMemcpyAsync(loss_sum, graph_loss_, sizeof(double),
                                          cudaMemcpyDeviceToDevice, stream_));
        } else {
            step_body(B, T_, grad_scale, loss_sum);
            warmed_up_ = true;
        }
    }
    embedding_backward(B, T_);
}

template <typename T>
void CudaGPT<T>::embedding_backward(int B, int T_) {
    if (frozen()) return;  // LoRA: the embedding is frozen
    const int emb = ParamLayout::embedding_unit(), N = B * T_;
    T* eg = unit_grads(emb);
    cuda::embedding_backward<T>(tensor_at(eg, off_wte_), tensor_at(eg, off_wpe_), dres_,
                                tok_ + 2 * (std::size_t)N, unique_, B, T_, cfg_.n_embd, stream_);
    unit_grads_done(emb);
}

template <typename T>
void CudaGPT<T>::step_body(int B, int T_, float grad_scale, double* loss_sum) {
    forward(B, T_, true);
    backward(B, T_, grad_scale, loss_sum, false);
}

template <typename T>
void CudaGPT<T>::backward(int B, int T_, float grad_scale, double* loss_sum, bool embedding) {
    // The shared schedule (model/unit_walk.h). Without the head, dres_ holds d(output),
    // received from the next stage.
    for (const UnitVisit& v : walk_.backward) {
        switch (v.part) {
            case UnitVisit::Part::Head:
                head_backward(v, B, T_, grad_scale, loss_sum);
                break;
            case UnitVisit::Part::Block:
                block_backward_part(v, B, T_);
                break;
            case UnitVisit::Part::Embedding:
                if (embedding) embedding_backward(B, T_);
                break;
        }
    }
}

template <typename T>
void CudaGPT<T>::head_backward(const UnitVisit& v, int B, int T_, float grad_scale,
                               double* loss_sum) {
    const int N = B * T_, C = cfg_.n_embd;
    const int32_t* dev_targets = tok_ + N;
    T* lm = unit_params(lm_unit_);
    T* dlm = frozen() ? nullptr : tensor_at(unit_grads(lm_unit_), off_lm_);
    cuda::classifier_loss<T>(dln_, dlm, logits_, row_loss_, lnf_, tensor_at(lm, off_lm_),
                             dev_targets, N, C, cfg_.vocab_size, cfg_.padded_vocab(), chunk_,
                             grad_scale, stream_);
    unit_params_done(lm_unit_);
    cuda::sum_floats(loss_sum, row_loss_, N, stream_);
    MT_CUDA_CHECK(cudaMemsetAsync(dres_, 0, (std::size_t)N * C * sizeof(T), stream_));
    T* h = unit_params(v.unit);
    prefetch(v.prefetch);
    T* hg = frozen() ? nullptr : unit_grads(v.unit);
    norm_backward(dres_, hg ? tensor_at(hg, off_lnf_w_) : nullptr,
                  hg ? tensor_at(hg, off_lnf_b_) : nullptr, dln_, resid_[cfg_.n_layer],
                  tensor_at(h, off_lnf_w_), lnf_mean_, lnf_rstd_, N);
    unit_params_done(v.unit);
    if (!frozen()) unit_grads_done(v.unit);
}

template <typename T>
const T* CudaGPT<T>::block_input(int l, int B, int T_) {
    if (!rebuilds_input(keep(l))) return resid_[l];
    const std::vector<T*>& held = slots_[cur_].held;
    // Where block k's input is during the backward: a hold slot (once its holder's rebuild has
    // run) or its forward stream (kept, or a temporary of its parity).
    auto at = [&](int k) { return rebuild_.slot[k] >= 0 ? held[rebuild_.slot[k]] : resid_[k]; };
    const int from = rebuild_.from[l];
    if (from < 0) return at(l);  // held since an earlier rebuild
    // Re-run the forward of blocks [from, l), each output into the next block's place (the hold
    // slot of an input this rebuild holds, else a temporary); their units are acquired again
    // (ZeRO-3 gathers them), and a block that keeps fields rewrites them with the same bits.
    T* cur = at(from);
    for (int k = from; k < l; k++) {
        const int u = layout_.block_unit(k);
        T* out = rebuild_.holder[k + 1] == l ? at(k + 1) : resid_[k + 1];
        const Block p = block_at(block_off_[k], unit_params(u));
        // Announced while this block runs: the next one the rebuild re-runs, then block l's own.
        prefetch(layout_.block_unit(k + 1));
        block_forward(p, k, cur, out, saved_[k], B, T_);
        unit_params_done(u);
        cur = out;
    }
    return cur;
}

template <typename T>
void CudaGPT<T>::block_backward_part(const UnitVisit& v, int B, int T_) {
    const int N = B * T_, C = cfg_.n_embd, l = v.block, u = v.unit;
    const std::size_t stream_bytes = (std::size_t)N * C * sizeof(T);
    // A rebuilt input first, before this block's unit is acquired: the rebuild acquires the
    // units below one at a time.
    const T* x = block_input(l, B, T_);
    const Block p = block_at(block_off_[l], unit_params(u));
    prefetch(v.prefetch);
    // A recomputed block re-runs its forward into the scratch; its output rewrites resid_[l + 1]
    // with the same bits (deterministic kernels), which nothing reads any more. An Offload
    // block first waits for its input to be back on the device. When the plan offloads, a
    // recompute writes its output into dbig_ (free until block_backward) instead, since
    // resid_[l + 1] may be a ring slot that holds a prefetched input by now.
    switch (v.redo) {
        case Redo::Nothing:
            break;
        case Redo::Selective:
            recompute_selective(p, x, saved_[l], B, T_);
            break;
        case Redo::Block:
            block_forward(p, l, x, offloads() ? dbig_ : resid_[l + 1], saved_[l], B, T_);
            break;
        case Redo::BlockFromHost:
            if (leaves_device(l)) MT_CUDA_CHECK(cudaStreamWaitEvent(stream_, to_device_[l], 0));
            block_forward(p, l, resid_[l], dbig_, saved_[l], B, T_);
            break;
    }
    const Block g = frozen() ? Block{} : block_at(block_off_[l], unit_grads(u));
    block_backward(p, g, l, x, saved_[l], B, T_);
    unit_params_done(u);
    if (!frozen()) unit_grads_done(u);
    // Block l's ring slot is free: prefetch the input of the Offload block that had it before
    // into it on the side stream, while the next blocks' backward runs.
    const int next = v.redo == Redo::BlockFromHost ? slot_before(l) : -1;
    if (next >= 0) {
        MT_CUDA_CHECK(cudaEventRecord(consumed_[l], stream_));
        MT_CUDA_CHECK(cudaStreamWaitEvent(copy_stream_, consumed_[l], 0));
        MT_CUDA_CHECK(cudaMemcpyAsync(resid_[next],
                                      host_resid_ + (std::size_t)off_index_[next] * stream_bytes,
                                      stream_bytes, cudaMemcpyHostToDevice, copy_stream_));
        MT_CUDA_CHECK(cudaEventRecord(to_device_[next], copy_stream_));
    }
}

template <typename T>
void CudaGPT<T>::drop_graph() {
    if (graph_exec_) cudaGraphExecDestroy(graph_exec_);
    graph_exec_ = nullptr;
}

template <typename T>
void CudaGPT<T>::set_cuda_graphs(bool on) {
    graphs_ = on;
    drop_graph();
}

template <typename T>
void CudaGPT<T>::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T_,
                              double* loss_sum) {
    ensure_arena(B, T_);
    upload_tokens(inputs, targets, B, T_);
    forward(B, T_);
    loss_only(B, T_, loss_sum);
}

template <typename T>
void CudaGPT<T>::loss_only(int B, int T_, double* loss_sum) {
    const int N = B * T_;
    T* lm = unit_params(lm_unit_);
    cuda::classifier_loss<T>(nullptr, nullptr, logits_, row_loss_, lnf_, tensor_at(lm, off_lm_),
                             tok_ + N, N, cfg_.n_embd, cfg_.vocab_size, cfg_.padded_vocab(), chunk_,
                             0.0f, stream_);
    unit_params_done(lm_unit_);
    cuda::sum_floats(loss_sum, row_loss_, N, stream_);
}

template <typename T>
void CudaGPT<T>::forward_logits(const int32_t* inputs, int B, int T_, float* out) {
    ensure_arena(B, T_);
    upload_tokens(inputs, nullptr, B, T_);
    forward(B, T_);
    logits_out(B, T_, out);
}

template <typename T>
void CudaGPT<T>::logits_out(int B, int T_, float* out) {
    const std::size_t n = (std::size_t)B * T_ * cfg_.vocab_size;
    DeviceBuffer<float> logits(n, MemCategory::Workspace);
    T* lm = unit_params(lm_unit_);
    cuda::classifier_logits<T>(logits.data(), lnf_, tensor_at(lm, off_lm_), B * T_, cfg_.n_embd,
                               cfg_.vocab_size, stream_);
    unit_params_done(lm_unit_);
    MT_CUDA_CHECK(
        cudaMemcpyAsync(out, logits.data(), n * sizeof(float), cudaMemcpyDeviceToHost, stream_));
    wait("the logits");
}

// ---- pipeline stages ---------------------------------------------------------------------------

template <typename T>
void CudaGPT<T>::stage_forward(int slot, const int32_t* inputs, const int32_t* targets, int B,
                               int T_) {
    ensure_arena(B, T_);
    use_slot(slot);
    // The first stage embeds the inputs (its embedding backward needs the plan, made from the
    // targets' presence); the last reads the targets at its backward.
    if (has_embedding() || has_head()) upload_tokens(inputs, targets, B, T_);
    forward(B, T_);
}

template <typename T>
void CudaGPT<T>::stage_backward(int slot, int B, int T_, float grad_scale, double* loss_sum) {
    use_slot(slot);
    backward(B, T_, grad_scale, loss_sum, true);
}

template <typename T>
void CudaGPT<T>::stage_loss(int slot, int B, int T_, double* loss_sum) {
    use_slot(slot);
    loss_only(B, T_, loss_sum);
}

template <typename T>
void CudaGPT<T>::stage_logits(int slot, int B, int T_, float* out) {
    use_slot(slot);
    logits_out(B, T_, out);
}

template class CudaGPT<float>;
template class CudaGPT<__nv_bfloat16>;
template class CudaGPT<__half>;

}  // namespace memtrain

#endif  // MEMTRAIN_HAVE_CUDA
