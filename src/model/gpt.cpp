// GPT-2 (or Llama-style, per ModelConfig) forward and backward on the CPU, block by block, over
// the kernels in kernels/cpu.
#include "model/gpt.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <utility>

#include "core/error.h"
#include "core/phase_clock.h"
#include "kernels/cpu/act_int8.h"
#include "kernels/cpu/ops.h"
#include "model/tp_comm.h"
#include "model/vocab_parallel.h"

namespace memtrain {

namespace {

// BlockSaved's members in SavedField order (model/activation_layout.h).
constexpr float* BlockSaved::*kMembers[kSavedFields] = {
    &BlockSaved::ln1,      &BlockSaved::ln1_mean, &BlockSaved::ln1_rstd,  &BlockSaved::qkv,
    &BlockSaved::att,      &BlockSaved::atty,     &BlockSaved::resid_mid, &BlockSaved::ln2,
    &BlockSaved::ln2_mean, &BlockSaved::ln2_rstd, &BlockSaved::fch,       &BlockSaved::fch_act,
};
static_assert(sizeof(BlockSaved) == kSavedFields * sizeof(float*),
              "every BlockSaved field must be listed in kMembers");

}  // namespace

FullUnitStore::FullUnitStore(const ParamLayout& layout)
    : layout_(&layout), params_(layout.total, MemCategory::Parameters) {}

float* FullUnitStore::full_grads() {
    if (grads_.size() == 0) grads_ = Buffer<float>(layout_->total, MemCategory::Gradients);
    return grads_.data();
}

void FullUnitStore::zero_grads() {
    std::memset(full_grads(), 0, grads_.bytes());
}

GPT::GPT(const ModelConfig& cfg, UnitStore* store) : GPT(cfg, store, 0, cfg.n_layer) {}

GPT::GPT(const ModelConfig& cfg, UnitStore* store, int first_block, int end_block) : cfg_(cfg) {
    cfg_.validate();
    if (first_block < 0 || end_block > cfg_.n_layer || first_block >= end_block)
        fail("internal: stage blocks [{}, {}) of a model of {} blocks", first_block, end_block,
             cfg_.n_layer);
    b0_ = first_block;
    b1_ = end_block;
    layout_ = make_param_layout(cfg_);
    if (!store) {
        own_store_ = std::make_unique<FullUnitStore>(layout_);
        store = own_store_.get();
    }
    store_ = store;
    walk_ = make_unit_walk(layout_, cfg_.n_layer, cfg_.tied_embeddings, b0_, b1_, plan_);
}

float* GPT::params() {
    float* p = store_->full_params();
    if (!p) fail("internal: the parameters are sharded (ZeRO-3); use the model's store per unit");
    return p;
}

const float* GPT::params() const {
    return const_cast<GPT*>(this)->params();
}

float* GPT::grads() {
    float* g = store_->full_grads();
    if (!g) fail("internal: the gradients are sharded (ZeRO-2/3); use the model's store per unit");
    return g;
}

void GPT::init_weights(uint64_t seed) {
    init_gpt2_weights(weights(), seed);
}

void GPT::set_remat(const RematPlan& plan) {
    if (!plan.empty() && plan.size() != (std::size_t)blocks())
        fail("remat plan has {} entries but the model runs {} blocks", plan.size(), blocks());
    for (BlockKeep k : plan)
        if (k == BlockKeep::Offload)
            fail(
                "train.remat = offload keeps block inputs in pinned host memory beside a GPU: "
                "use train.device = \"cuda\" (on the CPU, `full` keeps the same)");
    const InputRebuild rebuild = input_rebuild(plan);  // (a plan no block can rebuild from fails)
    if (rebuild.any && split_)
        fail("train.remat = {} rebuilds block inputs, which a split backward (zb-h1) does not yet",
             "memory-poor or chen:K");
    plan_ = plan;
    rebuild_ = rebuild;
    walk_ = make_unit_walk(layout_, cfg_.n_layer, cfg_.tied_embeddings, b0_, b1_, plan_);
    arena_B_ = arena_T_ = 0;  // re-carve (and re-size) at the next forward
}

void GPT::set_slots(int k) {
    if (k < 1) fail("internal: a stage holds at least one micro-batch, not {}", k);
    if (k == nslots_) return;
    nslots_ = k;
    arena_B_ = arena_T_ = 0;
}

void GPT::set_split_backward(bool on) {
    if (on && lora_) fail("LoRA does not run with a split backward (zb-h1) yet");
    if (on && tp_) fail("internal: tensor parallelism runs without a split backward");
    if (on && rebuild_.any) fail("a split backward (zb-h1) with a plan that rebuilds block inputs");
    if (on == split_) return;
    split_ = on;
    arena_B_ = arena_T_ = 0;
}

std::size_t GPT::wgrad_floats(int B, int T) const {
    return memtrain::split_backward_floats(cfg_, B, T);
}

std::size_t GPT::split_backward_bytes(int B, int T) const {
    return split_ ? memtrain::split_backward_bytes(cfg_, blocks(), B, T) : 0;
}

ArenaPlan GPT::stage_arena(int B, int T) const {
    return plan_stage_arena(cfg_, blocks(), B, T, plan_, arena_format());
}

// A batch's token rows are ints in the kernels (N = B * T): the shape is checked before any of
// its B * T tokens is read.
static void check_batch(int B, int T) {
    if (B < 1 || T < 1 || (int64_t)B * T > INT32_MAX)
        fail("a batch of {} x {} tokens: the model runs 1 to {} tokens at once", B, T, INT32_MAX);
}

void GPT::ensure_arena(int B, int T) {
    if (T > cfg_.block_size)
        fail("sequence length {} exceeds model.block_size {}", T, cfg_.block_size);
    check_batch(B, T);
    if (B == arena_B_ && T == arena_T_) return;
    // One slot's arena is the layout of a model of this stage's blocks (the whole model's when
    // the stage is the whole model).
    const ArenaPlan p = stage_arena(B, T);
    const std::size_t nact = p.activation_bytes / sizeof(float);
    const std::size_t nwork = p.workspace_bytes / sizeof(float);
    // Exactly the layout's size (free first: no transient double peak), so measured == predicted.
    const std::size_t nw = split_backward_bytes(B, T) / sizeof(float);
    bool same = slots_.size() == (std::size_t)nslots_;
    for (const Slot& s : slots_) same = same && s.acts.size() == nact && s.wgrad.size() == nw;
    if (!same) {
        slots_.clear();
        slots_.resize(nslots_);
        for (Slot& s : slots_) {
            s.acts = Buffer<float>(nact, MemCategory::Activations);
            if (nw) s.wgrad = Buffer<float>(nw, MemCategory::Activations);
        }
    }
    if (nwork != work_.size()) {
        work_.reset();
        work_ = Buffer<float>(nwork, MemCategory::Workspace);
    }
    arena_B_ = B;
    arena_T_ = T;

    const int nb = blocks();
    const ActFormat fmt = arena_format();
    ActFormat fp32 = fmt;
    fp32.saved = SavedStore::fp32;
    for (int i = 0; i < kSavedFields; i++)
        field_elems_[i] = saved_field_bytes(SavedField(i), cfg_, B, T, fp32) / sizeof(float);
    for (Slot& s : slots_) {
        auto act = [&](std::size_t at) { return s.acts.data() + at / sizeof(float); };
        s.resid.resize(nb + 1);
        for (int l = 0; l <= nb; l++) s.resid[l] = act(p.resid[l]);
        s.held.clear();
        for (std::size_t at : p.held) s.held.push_back(act(at));
        s.saved.assign(nb, BlockSaved{});
        s.stored.assign(fmt.compressed() ? nb : 0, {});
        for (int l = 0; l < nb; l++)
            for (int i = 0; i < kSavedFields; i++) {
                const std::size_t at = p.block[l][i];
                if (!fmt.compressed()) {
                    if (at != kNoOffset) s.saved[l].*kMembers[i] = act(at);
                } else if (is_statistic(SavedField(i), fmt) && at != kNoOffset) {
                    s.saved[l].*kMembers[i] = act(at);  // a kept statistic: fp32, its own
                } else if (p.work[i] != kNoOffset) {
                    s.saved[l].*kMembers[i] = act(p.work[i]);
                    if (at != kNoOffset)  // a kept activation (kept statistics are above)
                        s.stored[l][i] = reinterpret_cast<char*>(s.acts.data()) + at;
                }
            }
        s.lnf = act(p.lnf);
        s.lnf_mean = p.lnf_mean == kNoOffset ? nullptr : act(p.lnf_mean);
        s.lnf_rstd = act(p.lnf_rstd);
    }
    auto wrk = [&](std::size_t at) { return work_.data() + at / sizeof(float); };
    dres_ = wrk(p.dres);
    dln_ = wrk(p.dln);
    dbig_ = wrk(p.dbig);
    dact_ = p.dact == kNoOffset ? nullptr : wrk(p.dact);
    logits_ = wrk(p.logits);
    gemm_ = {};
    if (p.gemm_bf16 != kNoOffset)
        gemm_ = {reinterpret_cast<uint16_t*>(wrk(p.gemm_bf16)),
                 bf16_gemm_elems(cfg_, (int64_t)B * T, kLossChunk)};
    sp_ = p.sp_gather == kNoOffset ? nullptr : wrk(p.sp_gather);
}

void GPT::norm_forward(float* out, float* mean, float* rstd, const float* inp, const float* w,
                       const float* b, int N) const {
    if (cfg_.rmsnorm())
        cpu::rmsnorm_forward(out, rstd, inp, w, N, cfg_.n_embd, (float)cfg_.norm_eps);
    else
        cpu::layernorm_forward(out, mean, rstd, inp, w, b, N, cfg_.n_embd, (float)cfg_.norm_eps);
}

void GPT::norm_backward(float* dinp, float* dw, float* db, const float* dout, const float* inp,
                        const float* w, const float* mean, const float* rstd, int N) const {
    if (cfg_.rmsnorm())
        cpu::rmsnorm_backward(dinp, dw, dout, inp, w, rstd, N, cfg_.n_embd);
    else
        cpu::layernorm_backward(dinp, dw, db, dout, inp, w, mean, rstd, N, cfg_.n_embd);
}

void GPT::act_forward(float* out, const float* inp, int N) const {
    if (cfg_.swiglu())
        cpu::swiglu_forward(out, inp, N, cfg_.local_hidden());
    else
        cpu::gelu_forward(out, inp, (int64_t)N * cfg_.local_hidden());
}

void GPT::set_tp(TpComm* tp) {
    if (tp && tp->size() != cfg_.tp)
        fail("internal: a shard of {} tensor-parallel ranks over a group of {}", cfg_.tp,
             tp->size());
    if (!tp && cfg_.tp != 1) fail("internal: a tensor-parallel shard needs its group");
    if (tp && (lora_ || split_))
        fail("internal: tensor parallelism runs without LoRA or a split backward");
    tp_ = tp;
}

int GPT::vocab_begin() const {
    return tp_ ? tp_->rank() * cfg_.local_vocab() : 0;
}

void GPT::add_residual_bias(float* out, const float* resid, const float* bias, int N) const {
    const int C = cfg_.n_embd;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float* o = out + (int64_t)n * C;
        const float* r = resid + (int64_t)n * C;
        if (bias)
            for (int i = 0; i < C; i++) o[i] = r[i] + (o[i] + bias[i]);
        else
            for (int i = 0; i < C; i++) o[i] += r[i];
    }
}

void GPT::set_lora(LoraAdapters* lora) {
    if (lora && split_)
        fail("LoRA does not run with a split backward (zb-h1) yet: choose another schedule");
    if (lora && tp_) fail("internal: tensor parallelism runs without LoRA");
    lora_ = lora;
}

void GPT::lora_forward(int l, BlockLinear linear, const float* adapter, const float* x, float* y,
                       int N, int64_t row0) {
    if (!lora_) return;
    for (const LoraSite& s : lora_->layout().sites_of(l, linear))
        lora_->forward(s, adapter, x, y, N, row0);
}

void GPT::lora_backward(int l, BlockLinear linear, const float* adapter, float* grads,
                        const float* x, const float* dy, float* dx, int N, int64_t row0) {
    if (!lora_) return;
    for (const LoraSite& s : lora_->layout().sites_of(l, linear))
        lora_->backward(s, adapter, grads, x, dy, dx, N, row0);
}

void GPT::block_forward(const BlockParams& p, int l, const float* adapter, const float* x,
                        float* out, Slot& sl, int B, int T, bool mlp) {
    BlockSaved& s = sl.saved[l - b0_];
    // A kept field in bf16 or int8: stored as it is rounded, in the same pass.
    void* const* st = sl.stored.empty() ? nullptr : sl.stored[l - b0_].data();
    // A tensor-parallel shard's sizes (parallel/tensor/tp.h; the whole model's without TP): A is
    // the width of this rank's attention heads. Under sequence parallelism x, out and the norm
    // fields hold this rank's n of the N token rows; the GEMMs and attention see all N, gathered
    // into sp_.
    const int N = B * T, C = cfg_.n_embd, QKV = cfg_.local_qkv_dim(), F = cfg_.local_fc_dim(),
              H = cfg_.local_hidden(), A = cfg_.attn_dim();
    const int NH = cfg_.local_heads(), NKV = cfg_.local_kv_heads();
    const bool seq = sp(N);
    const int n = seq ? (int)cfg_.sp_rows(N) : N;
    // A norm output's shards all-gathered for a column-parallel GEMM (g: all-gather forward).
    auto gathered = [&](const float* shard) {
        if (!seq) return shard;
        tp_->all_gather_shards(TpSite::SpColumnGather, shard, sp_, (int64_t)N * C);
        return (const float*)sp_;
    };
    if (cfg_.mlp_tile > 0) {  // ln_1 and c_attn a tile of rows at a time (as the MLP below)
        for (int r0 = 0; r0 < N; r0 += cfg_.mlp_tile) {
            const int rows = std::min(cfg_.mlp_tile, N - r0);
            const float* ln1 = ln1_tile(p, l, sl, x, r0, rows, true);
            float* qkv = s.qkv + (int64_t)r0 * QKV;
            cpu::matmul_forward(qkv, ln1, p.qkv_w, p.qkv_b, rows, C, QKV, 0.0f, bf16());
            lora_forward(l, BlockLinear::Qkv, adapter, ln1, qkv, rows, r0);
        }
    } else {
        norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, n);
        round_saved(s, SavedField::Ln1, st);
        const float* ln1 = gathered(s.ln1);
        cpu::matmul_forward(s.qkv, ln1, p.qkv_w, p.qkv_b, N, C, QKV, 0.0f, bf16());
        lora_forward(l, BlockLinear::Qkv, adapter, ln1, s.qkv, N);
    }
    // Rotating in place means qkv holds what attention reads (and backward needs); c_attn's
    // backward reads ln1, not qkv, so the unrotated values are never needed again. Every row of
    // the micro-batch is here, so row b*T + t is rotated by its position t in its sequence.
    if (cfg_.rope())
        cpu::rope_forward(s.qkv, B, T, NH, NKV, cfg_.head_dim(), (float)cfg_.rope_theta);
    round_saved(s, SavedField::Qkv, st);
    DropoutMask m;
    // s.att holds the probabilities, or under lse_attention their log-sum-exp.
    const bool lse = cfg_.lse_attention;
    cpu::attention_forward(s.atty, lse ? nullptr : s.att, s.qkv, B, T, A, NH, NKV,
                           dropout_at(sl, m, 1 + 3 * l), lse ? s.att : nullptr, cfg_.cpu_bf16);
    round_saved(s, SavedField::Att, st);
    round_saved(s, SavedField::Atty, st);
    // Row-parallel c_proj: this rank's heads' share, summed over the group (g: an all-reduce, or
    // a reduce-scatter to this rank's rows), then the residual and the bias once.
    auto row_parallel_sum = [&](float* partial_or_out, float* out_rows) {
        if (seq)
            tp_->reduce_scatter(TpSite::SpRowScatter, partial_or_out, out_rows, (int64_t)N * C);
        else
            tp_->all_reduce(TpSite::RowForward, partial_or_out, (int64_t)N * C);
    };
    // Under dropout (never with TP) each branch is formed alone, LoRA's share included, and then
    // dropped and added to the residual.
    if (tp_) {
        float* partial = seq ? sp_ : s.resid_mid;
        cpu::matmul_forward(partial, s.atty, p.proj_w, nullptr, N, A, C, 0.0f, bf16());
        row_parallel_sum(partial, s.resid_mid);
        add_residual_bias(s.resid_mid, x, p.proj_b, n);
        lora_forward(l, BlockLinear::Proj, adapter, s.atty, s.resid_mid, N);
    } else if (dropout_at(sl, m, 2 + 3 * l)) {
        cpu::matmul_forward(s.resid_mid, s.atty, p.proj_w, p.proj_b, N, C, C, 0.0f, bf16());
        lora_forward(l, BlockLinear::Proj, adapter, s.atty, s.resid_mid, N);
        cpu::dropout_residual(s.resid_mid, x, m, B, T, C);
    } else {
        std::memcpy(s.resid_mid, x, sizeof(float) * N * C);
        cpu::matmul_forward(s.resid_mid, s.atty, p.proj_w, p.proj_b, N, C, C, 1.0f, bf16());
        lora_forward(l, BlockLinear::Proj, adapter, s.atty, s.resid_mid, N);
    }
    round_saved(s, SavedField::ResidMid, st);
    if (cfg_.mlp_tile > 0) {  // ln_2 too goes tile by tile (a redo leaves it to the backward)
        if (mlp) mlp_forward_tiled(p, l, adapter, s, out, sl, B, T);
        return;
    }
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, n);
    round_saved(s, SavedField::Ln2, st);
    const float* ln2 = gathered(s.ln2);
    cpu::matmul_forward(s.fch, ln2, p.fc_w, p.fc_b, N, C, F, 0.0f, bf16());
    lora_forward(l, BlockLinear::Fc, adapter, ln2, s.fch, N);
    round_saved(s, SavedField::Fch, st);
    act_forward(s.fch_act, s.fch, N);
    round_saved(s, SavedField::FchAct, st);
    if (tp_) {  // row-parallel mlp.c_proj, as c_proj above
        float* partial = seq ? sp_ : out;
        cpu::matmul_forward(partial, s.fch_act, p.fcp_w, nullptr, N, H, C, 0.0f, bf16());
        row_parallel_sum(partial, out);
        add_residual_bias(out, s.resid_mid, p.fcp_b, n);
        lora_forward(l, BlockLinear::FcProj, adapter, s.fch_act, out, N);
    } else if (dropout_at(sl, m, 3 + 3 * l)) {
        cpu::matmul_forward(out, s.fch_act, p.fcp_w, p.fcp_b, N, H, C, 0.0f, bf16());
        lora_forward(l, BlockLinear::FcProj, adapter, s.fch_act, out, N);
        cpu::dropout_residual(out, s.resid_mid, m, B, T, C);
    } else {
        std::memcpy(out, s.resid_mid, sizeof(float) * N * C);
        cpu::matmul_forward(out, s.fch_act, p.fcp_w, p.fcp_b, N, H, C, 1.0f, bf16());
        lora_forward(l, BlockLinear::FcProj, adapter, s.fch_act, out, N);
    }
}

// Recomputes what Selective dropped (ln1, ln2, fch_act) with the same kernel calls, on the same
// inputs, as block_forward: the kernels are deterministic, so the bits are those of the forward.
// The norm kernels also rewrite the kept mean/rstd, with identical values.
void GPT::recompute_selective(const BlockParams& p, const float* x, BlockSaved& s, int B, int T) {
    if (cfg_.mlp_tile > 0) return;  // the tiled backward makes each tile's norms and activation
    const int N = B * T, n = (int)cfg_.sp_rows(N);  // the norms' rows (sequence parallelism)
    norm_forward(s.ln1, s.ln1_mean, s.ln1_rstd, x, p.ln1_w, p.ln1_b, n);
    round_saved(s, SavedField::Ln1);
    norm_forward(s.ln2, s.ln2_mean, s.ln2_rstd, s.resid_mid, p.ln2_w, p.ln2_b, n);
    round_saved(s, SavedField::Ln2);
    act_forward(s.fch_act, s.fch, N);
    round_saved(s, SavedField::FchAct);
}

template <class Make>
float* GPT::tile_field(const Slot& sl, int l, SavedField f, float* field, int width, int r0,
                       int rows, bool forward, Make make) const {
    const int i = l - b0_;
    void* store = sl.stored.empty() ? nullptr : sl.stored[i][static_cast<int>(f)];
    const bool kept = keeps(keep(l), f);
    // A kept field in fp32 is written in place; a compressed one (its store) passes through the
    // working block's tile: stored after the forward makes it, read back before the backward.
    float* t = kept && !store ? field + (int64_t)r0 * width : field;
    const std::size_t begin = (std::size_t)r0 * width, n = (std::size_t)rows * width;
    if (forward || !kept) {
        make(t);
        if (forward && store)
            round_store_part(t, store, f, begin, n);
        else
            round_part(t, n);
    } else if (store) {
        load_part(t, store, f, begin, n);
    }
    return t;
}

const float* GPT::ln1_tile(const BlockParams& p, int l, const Slot& sl, const float* x, int r0,
                           int rows, bool forward) const {
    const BlockSaved& s = sl.saved[l - b0_];
    const int C = cfg_.n_embd;
    // (The rows' statistics are written too: the same bits again where the block keeps them.)
    return tile_field(sl, l, SavedField::Ln1, s.ln1, C, r0, rows, forward, [&](float* ln1) {
        norm_forward(ln1, s.ln1_mean ? s.ln1_mean + r0 : nullptr, s.ln1_rstd + r0,
                     x + (int64_t)r0 * C, p.ln1_w, p.ln1_b, rows);
    });
}

GPT::MlpTile GPT::mlp_tile(const BlockParams& p, int l, const float* adapter, const Slot& sl,
                           int r0, int rows, bool forward) {
    const int C = cfg_.n_embd, F = cfg_.local_fc_dim(), H = cfg_.local_hidden();
    const BlockSaved& s = sl.saved[l - b0_];
    MlpTile t{};
    // ln_2's rows write their statistics too (the same bits again where the block keeps them;
    // the norm's backward reads them after the last tile).
    t.ln2 = tile_field(sl, l, SavedField::Ln2, s.ln2, C, r0, rows, forward, [&](float* ln2) {
        norm_forward(ln2, s.ln2_mean ? s.ln2_mean + r0 : nullptr, s.ln2_rstd + r0,
                     s.resid_mid + (int64_t)r0 * C, p.ln2_w, p.ln2_b, rows);
    });
    t.fch = tile_field(sl, l, SavedField::Fch, s.fch, F, r0, rows, forward, [&](float* fch) {
        cpu::matmul_forward(fch, t.ln2, p.fc_w, p.fc_b, rows, C, F, 0.0f, bf16());
        lora_forward(l, BlockLinear::Fc, adapter, t.ln2, fch, rows, r0);
    });
    t.act = tile_field(sl, l, SavedField::FchAct, s.fch_act, H, r0, rows, forward,
                       [&](float* act) { act_forward(act, t.fch, rows); });
    return t;
}

void GPT::mlp_forward_tiled(const BlockParams& p, int l, const float* adapter, BlockSaved& s,
                            float* out, Slot& sl, int B, int T) {
    const int N = B * T, C = cfg_.n_embd, H = cfg_.local_hidden();
    DropoutMask m;
    const bool drop = dropout_at(sl, m, 3 + 3 * l);
    if (tp_) {
        // Row-parallel mlp.c_proj (never with dropout or sequence parallelism): each tile's
        // partial rows, then the group's one all-reduce of them all and the residual and bias.
        for (int r0 = 0; r0 < N; r0 += cfg_.mlp_tile) {
            const int rows = std::min(cfg_.mlp_tile, N - r0);
            cpu::matmul_forward(out + (int64_t)r0 * C,
                                mlp_tile(p, l, adapter, sl, r0, rows, true).act, p.fcp_w, nullptr,
                                rows, H, C, 0.0f, bf16());
        }
        tp_->all_reduce(TpSite::RowForward, out, (int64_t)N * C);
        add_residual_bias(out, s.resid_mid, p.fcp_b, N);
        return;
    }
    for (int r0 = 0; r0 < N; r0 += cfg_.mlp_tile) {
        const int rows = std::min(cfg_.mlp_tile, N - r0);
        const float* act = mlp_tile(p, l, adapter, sl, r0, rows, true).act;
        float* o = out + (int64_t)r0 * C;
        if (!drop) std::memcpy(o, s.resid_mid + (int64_t)r0 * C, sizeof(float) * rows * C);
        cpu::matmul_forward(o, act, p.fcp_w, p.fcp_b, rows, H, C, drop ? 0.0f : 1.0f, bf16());
        lora_forward(l, BlockLinear::FcProj, adapter, act, o, rows, r0);
    }
    if (drop) cpu::dropout_residual(out, s.resid_mid, m, B, T, C);
}

void GPT::mlp_backward_tiled(const BlockParams& p, BlockParams& g, int l, const float* adapter,
                             float* adapter_grads, const Slot& sl, const float* dout, int N) {
    const int C = cfg_.n_embd, F = cfg_.local_fc_dim(), H = cfg_.local_hidden();
    float* dfch = dbig_;
    for (int r0 = 0; r0 < N; r0 += cfg_.mlp_tile) {
        const int rows = std::min(cfg_.mlp_tile, N - r0);
        // What the block dropped, made again by the forward's own function: the same bits.
        const MlpTile t = mlp_tile(p, l, adapter, sl, r0, rows, false);
        const float *ln2 = t.ln2, *fch = t.fch, *act = t.act;
        const float* dy = dout + (int64_t)r0 * C;
        float* dact = cfg_.swiglu() ? dact_ : dfch;
        cpu::matmul_backward(dact, g.fcp_w, g.fcp_b, dy, act, p.fcp_w, rows, H, C, 0.0f, bf16());
        lora_backward(l, BlockLinear::FcProj, adapter, adapter_grads, act, dy, dact, rows, r0);
        if (cfg_.swiglu())
            cpu::swiglu_backward(dfch, fch, dact_, rows, H);
        else
            cpu::gelu_backward(dfch, fch, dfch, (int64_t)rows * H);
        // d(ln_2) of these rows: dout's rows of this tile were read above (dropout's d(branch)
        // may sit in dln_ itself).
        float* dln2 = dln_ + (int64_t)r0 * C;
        cpu::matmul_backward(dln2, g.fc_w, g.fc_b, dfch, ln2, p.fc_w, rows, C, F, 0.0f, bf16());
        lora_backward(l, BlockLinear::Fc, adapter, adapter_grads, ln2, dfch, dln2, rows, r0);
    }
}

void GPT::round_saved(const BlockSaved& s, SavedField f, void* const* stored) const {
    if (is_statistic(f, arena_format())) return;
    const int k = static_cast<int>(f);
    void* store = stored ? stored[k] : nullptr;
    if (store)
        round_store_part(s.*kMembers[k], store, f, 0, field_elems_[k]);
    else
        round_part(s.*kMembers[k], field_elems_[k]);
}

void GPT::round_store_part(float* x, void* store, SavedField f, std::size_t begin,
                           std::size_t n) const {
    if (cfg_.saved_activations == SavedStore::bf16)
        cpu::round_to_bf16(x, (int64_t)n, static_cast<uint16_t*>(store) + begin);
    else
        cpu::qdq_int8_store(x, store, field_elems_[static_cast<int>(f)], begin, n);
}

void GPT::round_part(float* x, std::size_t n) const {
    const SavedStore store = cfg_.saved_activations;
    if (store == SavedStore::bf16)
        cpu::round_to_bf16(x, (int64_t)n);
    else if (store == SavedStore::int8)
        cpu::qdq_int8(x, n);
}

void GPT::load_part(float* x, const void* src, SavedField f, std::size_t begin,
                    std::size_t n) const {
    if (cfg_.saved_activations == SavedStore::bf16)
        cpu::from_bf16(x, static_cast<const uint16_t*>(src) + begin, (int64_t)n);
    else
        cpu::from_int8_part(x, src, field_elems_[static_cast<int>(f)], begin, n);
}

// A kept field's store is written where the forward rounds it (round_saved, tile_field); before
// the block's backward the untiled ones come back whole into the working block (the tiled
// fields a tile at a time, by tile_field).
void GPT::unstash(Slot& sl, int i) const {
    if (sl.stored.empty()) return;
    for (int f = 0; f < kSavedFields; f++)
        if (sl.stored[i][f] && !(cfg_.mlp_tile > 0 && is_tiled_field(SavedField(f))))
            load_part(sl.saved[i].*kMembers[f], sl.stored[i][f], SavedField(f), 0, field_elems_[f]);
}

// On entry dres holds d(block output); on exit d(block input).
// Where a block's deferred output gradients sit in its part of a slot's wgrad buffer.
struct DeferredGrads {
    float *fcp, *fc, *proj, *qkv;  // (N,C), (N,F), (N,C), (N,QKV)
};
static DeferredGrads deferred_grads(float* base, int N, int C, int F) {
    const std::size_t n = (std::size_t)N;
    return {base, base + n * C, base + n * (C + F), base + n * (2 * C + F)};
}

void GPT::block_backward(const BlockParams& p, BlockParams& g, int l, const float* adapter,
                         float* adapter_grads, float* dres, const float* x, const Slot& sl, int B,
                         int T, float* defer) {
    const BlockSaved& s = sl.saved[l - b0_];
    // A tensor-parallel shard's sizes (parallel/tensor/tp.h; the whole model's without TP): A is
    // the width of this rank's attention heads.
    const int N = B * T, C = cfg_.n_embd, QKV = cfg_.local_qkv_dim(), F = cfg_.local_fc_dim(),
              H = cfg_.local_hidden(), A = cfg_.attn_dim();
    const int NH = cfg_.local_heads(), NKV = cfg_.local_kv_heads();
    // Sequence parallelism: dres, x and the norm fields hold this rank's n rows. Before each
    // row-parallel GEMM's backward d(output) is all-gathered into sp_ (the conjugate of its
    // forward reduce-scatter); each column-parallel GEMM re-gathers its saved norm shard for its
    // weight gradient and reduce-scatters its input gradient to this rank's rows (the conjugate
    // of its forward all-gather), which the norm's backward then reads from sp_.
    const bool seq = sp(N);
    const int n = seq ? (int)cfg_.sp_rows(N) : N;
    auto gather = [&](TpSite site, const float* rows) {
        if (!seq) return rows;
        tp_->all_gather_shards(site, rows, sp_, (int64_t)N * C);
        return (const float*)sp_;
    };
    auto column_input_grad = [&]() -> const float* {
        if (seq) {
            tp_->reduce_scatter(TpSite::SpColumnScatter, dln_, sp_, (int64_t)N * C);
            return sp_;
        }
        if (tp_) tp_->all_reduce(TpSite::ColumnBackward, dln_, (int64_t)N * C);  // f
        return dln_;
    };
    // Without `defer` each GEMM's weight half runs with its input half; with it, only the input
    // halves run here and each weight half's output gradient is kept for block_weight_grads.
    // Under LoRA `g` is all null (the base is frozen) and each GEMM's adapters add their share
    // to its input gradient right after it.
    auto lora = [&](BlockLinear k, const float* in, const float* dout, float* din) {
        lora_backward(l, k, adapter, adapter_grads, in, dout, din, N);
    };
    const DeferredGrads d = defer ? deferred_grads(defer, N, C, F) : DeferredGrads{};
    auto keep = [&](float* dst, const float* src, std::size_t count) {
        if (defer) std::memcpy(dst, src, sizeof(float) * count);
    };
    auto w = [&](float* grad) { return defer ? nullptr : grad; };
    float* dfch = dbig_;
    const float* dout = gather(TpSite::SpRowGather, dres);
    // Dropout (never with TP): d(branch) = drop(d(output)), in dln_ (free until c_fc's input
    // gradient) for the MLP and in dbig_ (free until attention's) for attention.
    DropoutMask m;
    if (dropout_at(sl, m, 3 + 3 * l)) {
        cpu::dropout(dln_, dres, m, B, T, C);
        dout = dln_;
    }
    keep(d.fcp, dout, (std::size_t)N * C);
    if (cfg_.mlp_tile > 0) {
        mlp_backward_tiled(p, g, l, adapter, adapter_grads, sl, dout, N);  // (never SP or split)
    } else {
        if (cfg_.swiglu()) {
            // d(product) (N,H) and d(fch) (N,2H) cannot share rows, so the product's gradient
            // has its own workspace.
            cpu::matmul_backward(dact_, w(g.fcp_w), w(g.fcp_b), dout, s.fch_act, p.fcp_w, N, H, C,
                                 0.0f, bf16());
            lora(BlockLinear::FcProj, s.fch_act, dout, dact_);
            cpu::swiglu_backward(dfch, s.fch, dact_, N, H);
        } else {
            cpu::matmul_backward(dfch, w(g.fcp_w), w(g.fcp_b), dout, s.fch_act, p.fcp_w, N, H, C,
                                 0.0f, bf16());
            lora(BlockLinear::FcProj, s.fch_act, dout, dfch);
            cpu::gelu_backward(dfch, s.fch, dfch, (int64_t)N * H);
        }
        keep(d.fc, dfch, (std::size_t)N * F);
        const float* ln2 = gather(TpSite::SpRegather, s.ln2);
        cpu::matmul_backward(dln_, w(g.fc_w), w(g.fc_b), dfch, ln2, p.fc_w, N, C, F, 0.0f, bf16());
        lora(BlockLinear::Fc, ln2, dfch, dln_);
    }
    // Column-parallel c_fc: each rank has its columns' share of d(ln_2 output); summed (f).
    norm_backward(dres, g.ln2_w, g.ln2_b, column_input_grad(), s.resid_mid, p.ln2_w, s.ln2_mean,
                  s.ln2_rstd, n);
    float* datty = dln_;
    dout = gather(TpSite::SpRowGather, dres);
    if (dropout_at(sl, m, 2 + 3 * l)) {
        cpu::dropout(dbig_, dres, m, B, T, C);
        dout = dbig_;
    }
    keep(d.proj, dout, (std::size_t)N * C);
    cpu::matmul_backward(datty, w(g.proj_w), w(g.proj_b), dout, s.atty, p.proj_w, N, A, C, 0.0f,
                         bf16());
    lora(BlockLinear::Proj, s.atty, dout, datty);
    float* dqkv = dbig_;
    const bool lse = cfg_.lse_attention;
    cpu::attention_backward(dqkv, datty, s.qkv, lse ? nullptr : s.att, B, T, A, NH, NKV,
                            dropout_at(sl, m, 1 + 3 * l), lse ? s.att : nullptr, cfg_.cpu_bf16);
    round_saved(s, SavedField::Att);
    round_saved(s, SavedField::Atty);
    if (cfg_.rope())
        cpu::rope_backward(dqkv, B, T, NH, NKV, cfg_.head_dim(), (float)cfg_.rope_theta);
    keep(d.qkv, dqkv, (std::size_t)N * QKV);
    if (cfg_.mlp_tile > 0) {  // each tile's ln_1 read where kept, else made again
        for (int r0 = 0; r0 < N; r0 += cfg_.mlp_tile) {
            const int rows = std::min(cfg_.mlp_tile, N - r0);
            const float* ln1 = ln1_tile(p, l, sl, x, r0, rows, false);
            float *dln1 = dln_ + (int64_t)r0 * C, *dq = dqkv + (int64_t)r0 * QKV;
            cpu::matmul_backward(dln1, g.qkv_w, g.qkv_b, dq, ln1, p.qkv_w, rows, C, QKV, 0.0f,
                                 bf16());
            lora_backward(l, BlockLinear::Qkv, adapter, adapter_grads, ln1, dq, dln1, rows, r0);
        }
    } else {
        const float* ln1 = gather(TpSite::SpRegather, s.ln1);
        cpu::matmul_backward(dln_, w(g.qkv_w), w(g.qkv_b), dqkv, ln1, p.qkv_w, N, C, QKV, 0.0f,
                             bf16());
        lora(BlockLinear::Qkv, ln1, dqkv, dln_);
    }
    // c_attn's f, as c_fc's
    norm_backward(dres, g.ln1_w, g.ln1_b, column_input_grad(), x, p.ln1_w, s.ln1_mean, s.ln1_rstd,
                  n);
}

// The weight halves block_backward deferred, in its order, on the same inputs: the same bits.
void GPT::block_weight_grads(BlockParams& g, const BlockSaved& s, const float* deferred, int B,
                             int T) {
    // A tensor-parallel shard's sizes (parallel/tensor/tp.h; the whole model's without TP): A is
    // the width of this rank's attention heads.
    const int N = B * T, C = cfg_.n_embd, QKV = cfg_.local_qkv_dim(), F = cfg_.local_fc_dim(),
              H = cfg_.local_hidden(), A = cfg_.attn_dim();
    const DeferredGrads d = deferred_grads(const_cast<float*>(deferred), N, C, F);
    cpu::matmul_backward(nullptr, g.fcp_w, g.fcp_b, d.fcp, s.fch_act, nullptr, N, H, C, 0.0f,
                         bf16());
    cpu::matmul_backward(nullptr, g.fc_w, g.fc_b, d.fc, s.ln2, nullptr, N, C, F, 0.0f, bf16());
    cpu::matmul_backward(nullptr, g.proj_w, g.proj_b, d.proj, s.atty, nullptr, N, A, C, 0.0f,
                         bf16());
    cpu::matmul_backward(nullptr, g.qkv_w, g.qkv_b, d.qkv, s.ln1, nullptr, N, C, QKV, 0.0f, bf16());
}

static void check_tokens(const int32_t* tokens, int B, int T, int vocab, const char* what) {
    check_batch(B, T);
    const std::size_t n = (std::size_t)B * T;
    for (std::size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= vocab)
            fail("{} token {} at position {} is outside the vocabulary [0, {})", what, tokens[i], i,
                 vocab);
    }
}

void GPT::set_activation_histograms(ActivationHistograms* h) {
    act_hist_ = h;
    if (h) {
        h->outputs.assign((std::size_t)cfg_.n_layer, Log2Histogram{});
        h->input_grads.assign((std::size_t)cfg_.n_layer, Log2Histogram{});
    }
}

void GPT::stage_forward(int slot, const int32_t* inputs, int B, int T) {
    if (cfg_.tp != 1 && !tp_) fail("internal: a tensor-parallel shard runs with set_tp");
    ensure_arena(B, T);
    if (lora_) lora_->prepare(B * T);  // (a tiled block's adapters run on tiles of these rows)
    Slot& sl = slots_.at(slot);
    const int N = B * T, C = cfg_.n_embd;
    if (has_embedding()) check_tokens(inputs, B, T, cfg_.vocab_size, "input");
    sl.drop = DropoutMask{};
    const bool training = std::exchange(train_pass_, false);
    if (training && cfg_.dropout > 0) {
        if (tp_) fail("internal: model.dropout with tensor parallelism");
        sl.drop = DropoutMask{cfg_.dropout, drop_seed_, drop_first_, 0};
    }
    // The shared schedule (model/unit_walk.h): each part acquires its unit, announces the next
    // (UnitStore::prefetch, so ZeRO-3 gathers it meanwhile) and runs.
    for (const UnitVisit& v : walk_.forward) {
        float* w = store_->acquire(v.unit);
        announce(v.prefetch);
        switch (v.part) {
            case UnitVisit::Part::Embedding: {
                const EmbeddingParams e = embedding_view(layout_, w);
                if (tp_)  // under sequence parallelism reduce-scattered to this rank's rows
                    vocab_parallel_embedding(*tp_, sl.resid[0], inputs, e.wte, e.wpe, B, T, C,
                                             vocab_begin(), cfg_.local_vocab(),
                                             sp(N) ? sp_ : nullptr);
                else
                    cpu::embedding_forward(sl.resid[0], inputs, e.wte, e.wpe, B, T, C);
                DropoutMask m;
                if (dropout_at(sl, m, 0)) cpu::dropout(sl.resid[0], sl.resid[0], m, B, T, C);
                break;
            }
            case UnitVisit::Part::Block: {
                const int l = v.block, i = l - b0_;
                const float* ad = lora_ ? lora_->store().acquire(l) : nullptr;
                block_forward(block_view(layout_, l, w), l, ad, sl.resid[i], sl.resid[i + 1], sl, B,
                              T);
                if (act_hist_ && training)
                    act_hist_->outputs[(std::size_t)l].add(sl.resid[i + 1],
                                                           (std::size_t)cfg_.sp_rows(N) * C);
                if (lora_) lora_->store().release(l);
                break;
            }
            case UnitVisit::Part::Head: {
                // The head unit stays acquired until stage_backward or stage_loss releases it.
                const HeadParams h = head_view(layout_, w);
                norm_forward(sl.lnf, sl.lnf_mean, sl.lnf_rstd, sl.resid.back(), h.lnf_w, h.lnf_b,
                             (int)cfg_.sp_rows(N));
                continue;
            }
        }
        store_->release(v.unit);
    }
}

const float* GPT::head_input(const Slot& sl, int N) {
    if (!sp(N)) return sl.lnf;
    tp_->all_gather_shards(TpSite::SpHeadGather, sl.lnf, sp_, (int64_t)N * cfg_.n_embd);
    return sp_;
}

const float* GPT::acquire_output_embedding(const HeadParams& head) {
    if (!cfg_.tied_embeddings) return head.lm_head;
    return embedding_view(layout_, store_->acquire(ParamLayout::embedding_unit())).wte;
}

void GPT::release_output_embedding() {
    if (cfg_.tied_embeddings) store_->release(ParamLayout::embedding_unit());
}

float GPT::stage_backward(int slot, const int32_t* inputs, const int32_t* targets, int B, int T,
                          float grad_scale) {
    return backward_pass(slot, inputs, targets, B, T, grad_scale, false);
}

float GPT::stage_backward_input(int slot, const int32_t* inputs, const int32_t* targets, int B,
                                int T, float grad_scale) {
    if (!split_) fail("internal: stage_backward_input without set_split_backward(true)");
    return backward_pass(slot, inputs, targets, B, T, grad_scale, true);
}

void GPT::stage_backward_weight(int slot, int B, int T) {
    if (!split_) fail("internal: stage_backward_weight without set_split_backward(true)");
    Slot& sl = slots_.at(slot);
    // Blocks in the backward's order, so each unit's gradient sees the same sequence of adds.
    // A block under remat kept only part of its activations: the GEMM inputs the weight halves
    // read (ln_1, the attention output, ln_2, the MLP activation) are recomputed again here, with
    // the calls I made (the same bits), into the same scratch.
    for (const UnitVisit& v : walk_.backward) {
        if (v.part != UnitVisit::Part::Block) continue;
        const int i = v.block - b0_;
        unstash(sl, i);  // the working block holds another block's fields by now
        if (v.redo != Redo::Nothing) {
            const ScopedPhase recompute(Phase::recompute);
            redo(v, block_view(layout_, v.block, store_->acquire(v.unit)), nullptr, sl.resid[i], sl,
                 B, T);
            store_->release(v.unit);
        }
        BlockParams g = block_view(layout_, v.block, store_->unit_grads(v.unit));
        block_weight_grads(g, sl.saved[i], sl.wgrad.data() + i * wgrad_floats(B, T), B, T);
        store_->grads_done(v.unit);
    }
}

void GPT::redo(const UnitVisit& v, const BlockParams& p, const float* adapter, const float* x,
               Slot& sl, int B, int T) {
    const int i = v.block - b0_;
    switch (v.redo) {
        case Redo::Nothing:
            return;
        case Redo::Selective:
            return recompute_selective(p, x, sl.saved[i], B, T);
        case Redo::Block:
            // The block's output rewrites resid[i + 1] with the same bits, which nothing reads
            // any more (for a rebuilt input, the temporary of the other parity: never x). A tiled
            // MLP is left to the backward, which recomputes it tile by tile anyway.
            return block_forward(p, v.block, adapter, x, sl.resid[i + 1], sl, B, T,
                                 cfg_.mlp_tile == 0);
        case Redo::BlockFromHost:
            break;
    }
    fail("internal: block {} offloads its input on the CPU", v.block);
}

float GPT::backward_pass(int slot, const int32_t* inputs, const int32_t* targets, int B, int T,
                         float grad_scale, bool split) {
    Slot& sl = slots_.at(slot);
    double loss = 0;
    // The shared schedule (model/unit_walk.h). Without the head, dres_ holds d(output),
    // received from the next stage.
    for (const UnitVisit& v : walk_.backward) {
        switch (v.part) {
            case UnitVisit::Part::Head:
                loss = head_backward(v, sl, targets, B, T, grad_scale);
                break;
            case UnitVisit::Part::Block:
                block_backward_part(v, sl, B, T, split);
                break;
            case UnitVisit::Part::Embedding:
                embedding_backward(v, sl, inputs, B, T);
                break;
        }
    }
    return (float)(loss / (B * T));
}

double GPT::head_backward(const UnitVisit& v, Slot& sl, const int32_t* targets, int B, int T,
                          float grad_scale) {
    const int N = B * T, C = cfg_.n_embd;
    const int E = ParamLayout::embedding_unit(), H = v.unit;
    check_tokens(targets, B, T, cfg_.vocab_size, "target");
    // The head unit is still acquired from stage_forward: this is the same pointer.
    const HeadParams h = head_view(layout_, store_->acquire(H));
    store_->release(H);
    // A frozen base (LoRA) has no gradients: null pointers skip them in the kernels.
    HeadParams hg{};
    float* dwout = nullptr;
    if (!frozen_base()) {
        hg = head_view(layout_, store_->unit_grads(H));
        dwout =
            cfg_.tied_embeddings ? embedding_view(layout_, store_->unit_grads(E)).wte : hg.lm_head;
    }
    const float* wout = acquire_output_embedding(h);
    announce(v.prefetch);  // gathered during the classifier
    // Sequence parallelism: the loss reads ln_f's all-gathered rows (in sp_) and its input
    // gradient comes back reduce-scattered to this rank's rows, into sp_ again.
    const bool seq = sp(N);
    const int n = (int)cfg_.sp_rows(N);
    const double loss =
        tp_ ? vocab_parallel_loss(*tp_, dln_, dwout, logits_, head_input(sl, N), wout, targets, N,
                                  C, cfg_.vocab_size, vocab_begin(), cfg_.local_vocab(), kLossChunk,
                                  grad_scale, seq ? sp_ : nullptr, bf16())
            : cpu::classifier_loss(dln_, dwout, logits_, sl.lnf, wout, targets, N, C,
                                   cfg_.vocab_size, cfg_.padded_vocab(), kLossChunk, grad_scale,
                                   bf16());
    release_output_embedding();
    std::memset(dres_, 0, sizeof(float) * n * C);
    norm_backward(dres_, hg.lnf_w, hg.lnf_b, seq ? sp_ : dln_, sl.resid.back(), h.lnf_w,
                  sl.lnf_mean, sl.lnf_rstd, n);
    if (!frozen_base()) store_->grads_done(H);
    store_->release(H);
    return loss;
}

void GPT::block_backward_part(const UnitVisit& v, Slot& sl, int B, int T, bool split) {
    const int l = v.block, u = v.unit, i = l - b0_;
    // A rebuilt input first, before this block's unit is acquired: the rebuild acquires and
    // releases the units of the blocks below one at a time, so at most one block's weights are
    // decoded (optim.master = none) or gathered (ZeRO-3) beside the head's, as without it.
    const float* x = nullptr;
    {
        const ScopedPhase recompute(Phase::recompute);  // (a rebuilt input; nothing when kept)
        x = block_input(l, sl, B, T);
    }
    BlockParams p = block_view(layout_, l, store_->acquire(u));
    announce(v.prefetch);
    BlockParams g{};
    if (!frozen_base()) g = block_view(layout_, l, store_->unit_grads(u));
    const float* ad = lora_ ? lora_->store().acquire(l) : nullptr;
    float* adg = lora_ ? lora_->store().unit_grads(l) : nullptr;
    unstash(sl, i);  // after block_input: a rebuild re-runs blocks below through the working block
    if (v.redo != Redo::Nothing) {
        const ScopedPhase recompute(Phase::recompute);
        redo(v, p, ad, x, sl, B, T);
    }
    block_backward(p, g, l, ad, adg, dres_, x, sl, B, T,
                   split ? sl.wgrad.data() + i * wgrad_floats(B, T) : nullptr);
    if (act_hist_)
        act_hist_->input_grads[(std::size_t)l].add(dres_,
                                                   (std::size_t)cfg_.sp_rows(B * T) * cfg_.n_embd);
    if (lora_) {
        lora_->store().grads_done(l);
        lora_->store().release(l);
    }
    if (!split && !frozen_base()) store_->grads_done(u);
    store_->release(u);
}

const float* GPT::block_input(int l, Slot& sl, int B, int T) {
    const int i = l - b0_;
    if (!rebuilds_input(plan_.empty() ? BlockKeep::All : plan_[i])) return sl.resid[i];
    // Where block k's input is during the backward: a hold slot (Segment, once its holder's
    // rebuild has run) or its forward stream (kept, or a temporary of its parity).
    auto at = [&](int k) {
        return rebuild_.slot[k] >= 0 ? sl.held[rebuild_.slot[k]] : sl.resid[k];
    };
    const int from = rebuild_.from[i];
    if (from < 0) return at(i);  // held since an earlier rebuild
    // Re-run the forward of blocks [from, i): each output into the next block's place (the hold
    // slot of an input this rebuild holds, else a temporary), with the same kernels and inputs
    // as the step's forward (so the same bits). Their units (and LoRA adapters) are acquired
    // again; a kept block rewrites its kept fields with the same bits.
    const float* cur = at(from);
    for (int k = from; k < i; k++) {
        const int m = b0_ + k, u = layout_.block_unit(m);
        const BlockParams p = block_view(layout_, m, store_->acquire(u));
        announce(layout_.block_unit(m + 1));  // the next block re-run, then block l's own
        const float* ad = lora_ ? lora_->store().acquire(m) : nullptr;
        float* out = rebuild_.holder[k + 1] == i ? at(k + 1) : sl.resid[k + 1];
        block_forward(p, m, ad, cur, out, sl, B, T);
        if (lora_) lora_->store().release(m);
        store_->release(u);
        cur = out;
    }
    return cur;
}

void GPT::embedding_backward(const UnitVisit& v, const Slot& sl, const int32_t* inputs, int B,
                             int T) {
    if (frozen_base()) return;
    const int N = B * T, C = cfg_.n_embd;
    DropoutMask m;
    if (dropout_at(sl, m, 0)) cpu::dropout(dres_, dres_, m, B, T, C);
    EmbeddingParams eg = embedding_view(layout_, store_->unit_grads(v.unit));
    if (tp_) {
        // Sequence parallelism: every rank's rows of d(embedding output), for the vocabulary
        // rows this rank holds (the conjugate of the forward's reduce-scatter).
        const float* demb = dres_;
        if (sp(N)) {
            tp_->all_gather_shards(TpSite::SpEmbeddingGather, dres_, sp_, (int64_t)N * C);
            demb = sp_;
        }
        vocab_parallel_embedding_backward(eg.wte, eg.wpe, demb, inputs, B, T, C, vocab_begin(),
                                          cfg_.local_vocab());
    } else {
        cpu::embedding_backward(eg.wte, eg.wpe, dres_, inputs, B, T, C);
    }
    store_->grads_done(v.unit);
}

float GPT::stage_loss(int slot, const int32_t* targets, int B, int T) {
    check_tokens(targets, B, T, cfg_.vocab_size, "target");
    const Slot& sl = slots_.at(slot);
    const int N = B * T, H = layout_.head_unit();
    const HeadParams h = head_view(layout_, store_->acquire(H));
    store_->release(H);
    const float* wout = acquire_output_embedding(h);
    double loss =
        tp_ ? vocab_parallel_loss(*tp_, nullptr, nullptr, logits_, head_input(sl, N), wout, targets,
                                  N, cfg_.n_embd, cfg_.vocab_size, vocab_begin(),
                                  cfg_.local_vocab(), kLossChunk, 0.0f, nullptr, bf16())
            : cpu::classifier_loss(nullptr, nullptr, logits_, sl.lnf, wout, targets, N, cfg_.n_embd,
                                   cfg_.vocab_size, cfg_.padded_vocab(), kLossChunk, 0.0f, bf16());
    release_output_embedding();
    store_->release(H);
    return (float)(loss / N);
}

void GPT::stage_logits(int slot, int B, int T, float* out) {
    const Slot& sl = slots_.at(slot);
    const int H = layout_.head_unit();
    const HeadParams h = head_view(layout_, store_->acquire(H));
    store_->release(H);
    if (tp_)
        vocab_parallel_logits(*tp_, out, head_input(sl, B * T), acquire_output_embedding(h), B * T,
                              cfg_.n_embd, cfg_.vocab_size, cfg_.local_vocab());
    else
        cpu::classifier_logits(out, sl.lnf, acquire_output_embedding(h), B * T, cfg_.n_embd,
                               cfg_.vocab_size);
    release_output_embedding();
    store_->release(H);
}

void GPT::require_whole(const char* what) const {
    if (!has_embedding() || !has_head())
        fail("internal: {} on a pipeline stage (blocks [{}, {})); use the stage_ calls", what, b0_,
             b1_);
}

float GPT::forward_backward(const int32_t* inputs, const int32_t* targets, int B, int T,
                            float grad_scale) {
    require_whole("forward_backward");
    if (has_head()) check_tokens(targets, B, T, cfg_.vocab_size, "target");
    train_pass_ = true;  // stage_forward takes it into the slot, for the backward and recomputes
    stage_forward(0, inputs, B, T);
    return stage_backward(0, inputs, targets, B, T, grad_scale);
}

float GPT::forward_loss(const int32_t* inputs, const int32_t* targets, int B, int T) {
    require_whole("forward_loss");
    check_tokens(targets, B, T, cfg_.vocab_size, "target");
    stage_forward(0, inputs, B, T);
    return stage_loss(0, targets, B, T);
}

void GPT::forward_logits(const int32_t* inputs, int B, int T, float* out) {
    require_whole("forward_logits");
    stage_forward(0, inputs, B, T);
    stage_logits(0, B, T, out);
}

}  // namespace memtrain
