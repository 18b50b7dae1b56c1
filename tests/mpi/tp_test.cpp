// Tensor parallelism under mpirun (train.tp = the world size, 2 and 4): a tensor-parallel run
// starts from exactly the single-process weights, gives its loss and gradients within 1e-5
// relative and trains 10 steps as one process does (GPT-2 and Llama-style with grouped-query
// attention); the whole tensors' gradients and weights are bitwise the same on every rank; the
// group's collectives are exactly 2 all-reduces forward and 2 backward per block plus the
// embedding's and the loss's; checkpoints reshard between tp = T and one process; bad layouts
// are refused before training.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/error.h"
#include "engine/cpu/cpu_engine.h"
#include "mpi/dist_runs.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"
#include "parallel/data/zero_store.h"
#include "parallel/tensor/tp.h"
#include "test_util.h"
#include "train/measured_run.h"
#include "train/validate.h"

namespace memtrain::dist {
namespace {

// The tiny run with heads, kv heads, MLP and vocabulary divisible by 4 ranks: GPT-2 (8 heads of
// 4, MLP 128, vocabulary 64 = 50 real + padding) or Llama-style (8 query heads sharing 4 kv
// heads, SwiGLU of hidden 64, untied head).
RunConfig tp_run(const std::string& name, bool llama, int steps) {
    RunConfig c = shared_tiny_run_config(name + (llama ? "_llama" : "_gpt2"), steps);
    c.model.n_head = 8;
    c.model.n_embd = 32;
    c.model.n_layer = 2;
    c.io.save_final = false;
    c.train.eval_every = 5;
    if (llama) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.tied_embeddings = false;
        c.model.bias = false;
        c.model.n_kv_head = 4;
        c.model.ffn_hidden = 64;
    }
    return c;
}

RunConfig with_tp(RunConfig c) {
    c.train.tp = comm().size();
    return c;
}

// The same with Megatron sequence parallelism (B x T = 2 x 8 token rows: 8 or 4 per rank).
RunConfig with_sp(RunConfig c) {
    c = with_tp(c);
    c.train.sequence_parallel = true;
    return c;
}

CpuEngine& tp_engine(Trainer& t) {
    auto* e = dynamic_cast<CpuEngine*>(&t.engine());
    if (!e) fail("the trainer does not run the tensor-parallel engine: {}", t.engine().describe());
    return *e;
}

// Largest |a - b| over a tensor against its largest |b|: the relative error of the tensor.
struct Worst {
    double diff = 0, scale = 0;
    void add(double a, double b) {
        diff = std::max(diff, std::abs(a - b));
        scale = std::max(scale, std::abs(b));
    }
    double rel() const { return scale > 0 ? diff / scale : diff; }
};

// This rank's shard against the whole tensors of one process: every element it holds.
void expect_shard_near(const TpLayout& l, const float* local, const std::vector<float>& whole,
                       double tol, const std::string& what, double abs_tol = 0) {
    for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
        const ParamSpec &f = l.full.tensors[i], &s = l.local.tensors[i];
        Worst w;
        for (int64_t e = 0; e < (int64_t)f.numel; e++) {
            const int64_t li = l.local_index(i, e);
            if (li >= 0) w.add(local[s.offset + li], whole[f.offset + e]);
        }
        EXPECT_LE(w.diff, tol * w.scale + abs_tol)
            << what << " " << f.name << " (max diff " << w.diff << ", largest " << w.scale << ")";
    }
}

// The whole (replicated) tensors of this rank's shard are bitwise those of rank 0.
void expect_whole_tensors_same_on_every_rank(const TpLayout& l, const float* local,
                                             const std::string& what) {
    std::vector<float> mine;
    for (std::size_t i = 0; i < l.shards.size(); i++)
        if (!l.shards[i].split())
            mine.insert(mine.end(), local + l.local.tensors[i].offset,
                        local + l.local.tensors[i].offset + l.local.tensors[i].numel);
    std::vector<float> all(mine.size() * comm().size());
    comm().all_gather(mine.data(), all.data(),
                      std::vector<int64_t>(comm().size(), (int64_t)mine.size()));
    std::size_t diff = 0;
    for (int r = 1; r < comm().size(); r++)
        for (std::size_t j = 0; j < mine.size(); j++) diff += all[r * mine.size() + j] != all[j];
    EXPECT_EQ(diff, 0u) << what;
}

TEST(TpLayout, SlicesAndAssemblesEveryTensor) {
    const int P = comm().size();
    for (bool llama : {false, true}) {
        RunConfig c = tp_run("tp_layout", llama, 1);
        std::vector<TpLayout> ls;
        for (int r = 0; r < P; r++) ls.push_back(make_tp_layout(c.model, P, r));
        const TpLayout& l0 = ls[0];
        EXPECT_EQ(l0.local.total, l0.replicated_floats() + l0.sharded_floats());
        EXPECT_EQ(l0.local.total * P,
                  l0.replicated_floats() * P + (l0.full.total - l0.replicated_floats()));
        for (std::size_t i = 0; i < l0.full.tensors.size(); i++) {
            const ParamSpec& f = l0.full.tensors[i];
            std::vector<float> whole(f.numel), back(f.numel, -1.0f);
            for (std::size_t e = 0; e < f.numel; e++) whole[e] = (float)e;
            const std::size_t n = l0.local.tensors[i].numel;
            std::vector<float> pieces(n * P);
            for (int r = 0; r < P; r++) tp_slice(ls[r], i, whole.data(), pieces.data() + r * n);
            tp_assemble(l0, i, pieces.data(), n, back.data());
            EXPECT_EQ(back, whole) << f.name;
        }
        // Rank 1 holds the second heads' query columns of c_attn: column C / P of the whole.
        std::size_t qkv = 0;
        while (l0.full.tensors[qkv].name != "h.0.attn.c_attn.weight") qkv++;
        EXPECT_EQ(ls[1].local_index(qkv, c.model.n_embd / P), 0);
        EXPECT_EQ(ls[0].local_index(qkv, c.model.n_embd / P), -1);
    }
}

// One step: the loss and every gradient of the shard within 1e-5 relative of one process, from
// bitwise the single-process weights; then 10 steps of training.
// With `sp`, under sequence parallelism: the norm gradients, summed over the group, are then
// bitwise the same on every rank too.
void check_tp_matches_single_process(bool llama, bool sp = false) {
    const int r = comm().rank();
    TrainOptions quiet;
    quiet.quiet = true;
    for (int steps : {1, 10}) {
        RunConfig c = tp_run(fmt::format("{}_match{}", sp ? "sp" : "tp", steps), llama, steps);
        RunConfig ref_cfg = c;
        ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(r);
        TrainSummary ref_sum;
        std::vector<float> ref_init, ref_params, ref_grads;
        {
            Trainer ref(ref_cfg, quiet);
            ref_init = ref.params();
            ref_sum = ref.run();
            ref_params = ref.params();
            ref_grads.assign(ref.model().grads(), ref.model().grads() + ref.model().num_params());
        }
        Trainer t(sp ? with_sp(c) : with_tp(c), quiet, &comm());
        CpuEngine& e = tp_engine(t);
        const TpLayout& l = e.tp_layout();
        EXPECT_EQ(t.params(), ref_init) << "initial weights";
        const TrainSummary sum = t.run();
        const std::string what = fmt::format("{} tp={}{} {} steps", llama ? "llama" : "gpt2",
                                             comm().size(), sp ? " sp" : "", steps);
        ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
        for (std::size_t i = 0; i < sum.losses.size(); i++)
            EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 1e-5 * std::abs(ref_sum.losses[i]))
                << what << " step " << i + 1;
        ASSERT_EQ(sum.val_losses.size(), ref_sum.val_losses.size());
        for (std::size_t i = 0; i < sum.val_losses.size(); i++)
            EXPECT_NEAR(sum.val_losses[i].second, ref_sum.val_losses[i].second,
                        1e-5 * std::abs(ref_sum.val_losses[i].second))
                << what;
        // The last step's gradients (after clipping, as the single process clipped them).
        expect_shard_near(l, e.local_grads(), ref_grads, steps == 1 ? 1e-5 : 1e-4,
                          what + " gradient");
        // Parameters: Adam turns a gradient that is zero but for rounding (the key bias's, to
        // which softmax is invariant) into a step of about the learning rate either way, so
        // beside 1e-5 of the tensor they may differ by 1e-3 of the (peak) learning rate per
        // step.
        expect_shard_near(l, e.local_params(), ref_params, 1e-5, what + " parameter",
                          1e-3 * c.optim.lr * steps);
        expect_whole_tensors_same_on_every_rank(l, e.local_grads(), what + " whole gradients");
        expect_whole_tensors_same_on_every_rank(l, e.local_params(), what + " whole weights");
        EXPECT_EQ(t.params().size(), ref_params.size());
    }
}

TEST(TpTrain, Gpt2MatchesSingleProcess) {
    check_tp_matches_single_process(false);
}

TEST(TpTrain, LlamaGqaMatchesSingleProcess) {
    check_tp_matches_single_process(true);
}

// Activation checkpointing under TP (and SP): a block recomputed in backward runs its forward's
// collectives again, on the same inputs, and so does every rebuild of a dropped block input
// (memory-poor, chen:K, revolve:S: the same blocks re-run on every rank, in the same order), so
// each run is bitwise the one that kept everything; each rank's activations are what its plan
// predicted, and memory-poor holds less than `full`.
void check_remat_recomputes_bitwise(RunConfig c) {
    c.model.n_layer = 5;
    TrainSummary keep;
    std::vector<float> keep_params;
    {
        Trainer t(c, test::quiet(), &comm());
        keep = t.run();
        keep_params = t.params();
    }
    std::size_t full_bytes = 0;
    std::vector<std::string> policies = {"full", "selective", "memory-poor", "chen:2", "revolve:1"};
    for (std::size_t i = 0; i < policies.size(); i++) {
        const std::string remat = policies[i];
        RunConfig r = c;
        r.train.remat = remat;
        r.io.out_dir = c.io.out_dir + "_" + std::to_string(i);
        const MemoryStats before = host_memory().snapshot();
        Trainer t(r, test::quiet(), &comm());
        EXPECT_EQ(t.run().losses, keep.losses) << remat;
        EXPECT_EQ(t.params(), keep_params) << remat;
        const std::size_t act =
            host_memory().snapshot()[MemCategory::Activations] - before[MemCategory::Activations];
        for (const MemoryPrediction& m :
             t.engine().predicted_memory(r.micro_batch(), r.train.seq_len))
            if (m.category == MemCategory::Activations) {
                EXPECT_EQ(m.bytes, act) << remat << ": " << m.formula;
            }
        EXPECT_EQ(t.plan().remat.peak_bytes, act) << remat << ": the schedule priced on the shard";
        if (remat == "full") {
            // A rank's budget one byte below full's own bytes: the joint solver rebuilds inputs.
            full_bytes = act;
            policies.push_back(fmt::format("budget:{}", act - 1));
        }
        if (remat == "memory-poor" || i + 1 == policies.size()) {
            EXPECT_LT(act, full_bytes) << remat;
        }
    }
}

TEST(TpTrain, RematRecomputesBitwise) {
    check_remat_recomputes_bitwise(with_tp(tp_run("tp_remat", true, 2)));
}

// train.mlp_tile under tensor parallelism: the norms and each shard's column-parallel GEMMs go
// tile by tile, the row-parallel mlp.c_proj sums every tile's partial rows in the one all-reduce,
// and c_attn's and c_fc's partial input gradients are all-reduced after the last tile, as
// untiled. Every policy stays bitwise within the mode, in its predicted bytes; the run follows
// the untiled one (the weight gradients are summed tile by tile).
TEST(TpTrain, TiledNormsAndMlpRecomputeBitwise) {
    for (bool llama : {false, true}) {
        SCOPED_TRACE(llama ? "llama" : "gpt2");
        RunConfig c = with_tp(tp_run("tp_tiled", llama, 2));
        RunConfig whole = c;
        whole.io.out_dir += "_whole";
        c.train.mlp_tile = 5;  // tiles of 5, 5, 5 and 1 of the 16 rows
        check_remat_recomputes_bitwise(c);
        whole.model.n_layer = 5;
        RunConfig tiled = c;
        tiled.model.n_layer = 5;
        tiled.io.out_dir += "_tiled";
        const std::vector<float> a = Trainer(whole, test::quiet(), &comm()).run().losses;
        const std::vector<float> b = Trainer(tiled, test::quiet(), &comm()).run().losses;
        ASSERT_EQ(a.size(), b.size());
        for (std::size_t i = 0; i < a.size(); i++)
            EXPECT_NEAR(b[i], a[i], 1e-5 * std::abs(a[i])) << "step " << i + 1;
    }
}

// Per step of K micro-batches of N = B x T tokens through L blocks: 2 L K all-reduces of N x C
// forward and 2 L K backward, K of the embedding and K of the classifier's input gradient, and
// per micro-batch (N <= 256 rows: one loss chunk) one max of N doubles and one sum of 2N floats.
TEST(TpTrain, CountsTwoAllReducesEachWayPerBlock) {
    RunConfig c = with_tp(tp_run("tp_counts", false, 2));
    c.model.n_layer = 3;
    Trainer t(c, test::quiet(), &comm());
    t.run();
    const TpGroup::Counts& n = tp_engine(t).last_step_counts();
    const int64_t L = 3, K = c.accum_steps(), N = (int64_t)c.micro_batch() * c.train.seq_len,
                  C = c.model.n_embd;
    ASSERT_EQ(K, 2);
    EXPECT_EQ(n.calls_at(TpSite::RowForward), 2 * L * K);
    EXPECT_EQ(n.elements_at(TpSite::RowForward), 2 * L * K * N * C);
    EXPECT_EQ(n.calls_at(TpSite::ColumnBackward), 2 * L * K);
    EXPECT_EQ(n.elements_at(TpSite::ColumnBackward), 2 * L * K * N * C);
    EXPECT_EQ(n.calls_at(TpSite::Embedding), K);
    EXPECT_EQ(n.elements_at(TpSite::Embedding), K * N * C);
    EXPECT_EQ(n.calls_at(TpSite::HeadBackward), K);
    EXPECT_EQ(n.elements_at(TpSite::HeadBackward), K * N * C);
    EXPECT_EQ(n.calls_at(TpSite::LossMax), K);
    EXPECT_EQ(n.elements_at(TpSite::LossMax), K * N);
    EXPECT_EQ(n.calls_at(TpSite::LossSum), K);
    EXPECT_EQ(n.elements_at(TpSite::LossSum), K * 2 * N);
    EXPECT_EQ(n.calls_at(TpSite::Gather), 0);
    EXPECT_EQ(n.bytes(), 4 * ((4 * L + 2) * K * N * C + 2 * K * N) + 8 * K * N);
}

TEST(TpSequenceParallel, Gpt2MatchesSingleProcess) {
    check_tp_matches_single_process(false, true);
}

TEST(TpSequenceParallel, LlamaGqaMatchesSingleProcess) {
    check_tp_matches_single_process(true, true);
}

// Under sequence parallelism the recomputes and rebuilds run their all-gathers and
// reduce-scatters again.
TEST(TpSequenceParallel, RematRecomputesBitwise) {
    check_remat_recomputes_bitwise(with_sp(tp_run("sp_remat", true, 2)));
}

// Per step of K micro-batches of N = B x T tokens through L blocks, each collective over a
// buffer of N x C: forward 1 reduce-scatter (embedding), per block 2 all-gathers and 2
// reduce-scatters, 1 all-gather of ln_f; backward 1 reduce-scatter (classifier), per block 2
// all-gathers of d(output), 2 re-gathers of the norm shards and 2 reduce-scatters, 1 all-gather
// (embedding); the loss's max and sums as without SP; once per step 1 all-reduce of the norm
// gradients. No all-reduce of N x C at all, and the ring traffic is TP's plus the re-gathers and
// the norm gradients'.
TEST(TpSequenceParallel, CountsGathersAndScattersPerBlock) {
    const int P = comm().size();
    RunConfig c = tp_run("sp_counts", false, 2);
    c.model.n_layer = 3;
    TpGroup::Counts tp;
    {
        Trainer t(with_tp(c), test::quiet(), &comm());
        t.run();
        tp = tp_engine(t).last_step_counts();
    }
    RunConfig s = with_sp(c);
    s.io.out_dir += "_sp";
    Trainer t(s, test::quiet(), &comm());
    t.run();
    const TpGroup::Counts& n = tp_engine(t).last_step_counts();
    const int64_t L = 3, K = c.accum_steps(), N = (int64_t)c.micro_batch() * c.train.seq_len,
                  C = c.model.n_embd;
    ASSERT_EQ(K, 2);
    auto expect_site = [&](TpSite site, int64_t calls, int64_t elements) {
        EXPECT_EQ(n.calls_at(site), calls) << tp_site_name(site);
        EXPECT_EQ(n.elements_at(site), elements) << tp_site_name(site);
    };
    for (TpSite gone :
         {TpSite::Embedding, TpSite::RowForward, TpSite::ColumnBackward, TpSite::HeadBackward})
        expect_site(gone, 0, 0);
    expect_site(TpSite::SpEmbedding, K, K * N * C);
    expect_site(TpSite::SpRowScatter, 2 * L * K, 2 * L * K * N * C);
    expect_site(TpSite::SpColumnGather, 2 * L * K, 2 * L * K * N * C);
    expect_site(TpSite::SpHeadGather, K, K * N * C);
    expect_site(TpSite::SpHeadScatter, K, K * N * C);
    expect_site(TpSite::SpRowGather, 2 * L * K, 2 * L * K * N * C);
    expect_site(TpSite::SpColumnScatter, 2 * L * K, 2 * L * K * N * C);
    expect_site(TpSite::SpRegather, 2 * L * K, 2 * L * K * N * C);
    expect_site(TpSite::SpEmbeddingGather, K, K * N * C);
    expect_site(TpSite::LossMax, K, K * N);
    expect_site(TpSite::LossSum, K, K * 2 * N);
    // LayerNorm weight and bias of ln_1 and ln_2 per block and of ln_f.
    const int64_t norms = (2 * L + 1) * 2 * C;
    expect_site(TpSite::SpNormGrads, 1, norms);
    expect_site(TpSite::Gather, 0, 0);
    // The only all-reduces: the loss's two per micro-batch and the norm gradients'.
    EXPECT_EQ(n.calls_of(TpOp::AllReduce), 2 * K + 1);
    EXPECT_EQ(n.calls_of(TpOp::ReduceScatter), (4 * L + 2) * K);
    EXPECT_EQ(n.calls_of(TpOp::AllGather), (6 * L + 2) * K);
    // Korthikanti et al.: an all-gather plus a reduce-scatter carry what one all-reduce does;
    // what SP adds is the re-gathers and the norm gradients.
    const double share = (double)(P - 1) / P;
    EXPECT_DOUBLE_EQ(n.ring_bytes(P),
                     tp.ring_bytes(P) + 4 * share * (2 * L * K * N * C + 2 * norms));
    EXPECT_EQ(tp.calls_of(TpOp::AllReduce), (4 * L + 4) * K);
}

// Activation bytes per rank, measured (the arena's Buffer) and predicted (the engine's memory
// rows, from plan_arena of the shard's config): equal, with and without SP, kept or recomputed.
// Under SP the sequence-sharded part (residual streams, ln_1, residual mid, ln_2, ln_f and their
// statistics) is exactly 1/T of TP's, and the rest is the same; the workspace holds d(residual)
// for this rank's rows and one gather buffer of all N rows.
TEST(TpSequenceParallel, ActivationBytesPerRankAreTheSequenceShard) {
    const int64_t P = comm().size();
    for (const char* remat : {"none", "selective"}) {
        RunConfig c = tp_run(fmt::format("sp_memory_{}", remat), true, 1);
        c.train.remat = remat;
        std::size_t act[2] = {}, work[2] = {};
        for (bool sp : {false, true}) {
            RunConfig r = sp ? with_sp(c) : with_tp(c);
            r.io.out_dir += sp ? "_sp" : "_tp";
            const MemoryStats before = host_memory().snapshot();
            Trainer t(r, test::quiet(), &comm());
            t.run();
            const MemoryStats after = host_memory().snapshot();
            act[sp] = after[MemCategory::Activations] - before[MemCategory::Activations];
            work[sp] = after[MemCategory::Workspace] - before[MemCategory::Workspace];
            const ArenaPlan plan = plan_arena(tp_engine(t).model().config(), r.micro_batch(),
                                              r.train.seq_len, t.engine().remat_plan());
            EXPECT_EQ(act[sp], plan.activation_bytes) << remat << " sp " << sp;
            EXPECT_EQ(work[sp], plan.workspace_bytes) << remat << " sp " << sp;
            for (const MemoryPrediction& m :
                 t.engine().predicted_memory(r.micro_batch(), r.train.seq_len)) {
                if (m.category == MemCategory::Activations) {
                    EXPECT_EQ(m.bytes, act[sp]) << m.formula;
                }
                if (m.category == MemCategory::Workspace) {
                    EXPECT_EQ(m.bytes, work[sp]) << m.formula;
                }
            }
        }
        // RMSNorm keeps rstd only. Kept per block: ln_1 and ln_2 (unless selective), their
        // rstd, residual mid; L + 1 residual streams, ln_f and its rstd; selective's scratch
        // holds one block's ln_1 and ln_2.
        const int64_t L = c.model.n_layer, N = (int64_t)c.micro_batch() * c.train.seq_len,
                      C = c.model.n_embd;
        const bool sel = std::string(remat) == "selective";
        const int64_t per_block = (sel ? 0 : 2 * N * C) + 2 * N + N * C;
        const int64_t seq_floats =
            L * per_block + (L + 1) * N * C + N * C + N + (sel ? 2 * N * C : 0);
        EXPECT_EQ((int64_t)(act[0] - act[1]), 4 * seq_floats / P * (P - 1)) << remat;
        // d(residual) shrinks to N / P rows; the gather buffer adds N rows.
        EXPECT_EQ((int64_t)work[1] - (int64_t)work[0], 4 * (N * C - N * C / P * (P - 1))) << remat;
    }
}

// Logits for sampling: a prompt whose length the ranks do not divide runs without SP (all
// reduces), one they do with it; both are one process's logits to rounding.
TEST(TpSequenceParallel, LogitsOfAnyLengthMatchOneProcess) {
    const int r = comm().rank();
    RunConfig c = tp_run("sp_logits", true, 1);
    RunConfig ref_cfg = c;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(r);
    Trainer ref(ref_cfg, test::quiet());
    Trainer t(with_sp(c), test::quiet(), &comm());
    const int V = c.model.vocab_size;
    for (int T : {5, 8}) {
        std::vector<int32_t> x(T);
        for (int i = 0; i < T; i++) x[i] = (7 * i + 3) % V;
        std::vector<float> want((std::size_t)T * V), got(want.size());
        ref.engine().forward_logits(x.data(), 1, T, want.data());
        t.engine().forward_logits(x.data(), 1, T, got.data());
        Worst w;
        for (std::size_t i = 0; i < want.size(); i++) w.add(got[i], want[i]);
        EXPECT_LE(w.diff, 1e-5 * w.scale) << "T = " << T;
        const TpGroup::Counts& n = tp_engine(t).tp_group().counts();
        EXPECT_EQ(n.calls_at(TpSite::SpHeadGather) > 0, T % comm().size() == 0) << T;
        tp_engine(t).tp_group().reset_counts();
    }
}

TEST(TpSequenceParallel, RefusesWithoutTpOrIndivisibleTokens) {
    const int P = comm().size();
    const RunConfig good = with_sp(tp_run("sp_refuse", false, 1));
    {
        RunConfig bad = good;
        bad.train.tp = 1;
        expect_refused(bad, "train.sequence_parallel = true needs train.tp > 1");
    }
    {
        RunConfig bad = good;
        bad.train.micro_batch_size = 1;
        bad.train.seq_len = 2 * P + 1;
        expect_refused(bad, fmt::format("needs the micro-batch's tokens (micro batch 1 x "
                                        "train.seq_len {}) divisible by {}",
                                        2 * P + 1, P));
    }
}

// Parameters, gradients and optimizer state per rank are the whole tensors plus 1/T of the cut
// ones, as allocated and as predicted.
TEST(TpTrain, PerRankModelStatesAreTheShard) {
    const int P = comm().size();
    RunConfig c = with_tp(tp_run("tp_memory", true, 1));
    const MemoryStats before = host_memory().snapshot();
    Trainer t(c, test::quiet(), &comm());
    t.run();
    const MemoryStats after = host_memory().snapshot();
    const TpLayout& l = tp_engine(t).tp_layout();
    const std::size_t psi = l.replicated_floats() + (l.full.total - l.replicated_floats()) / P;
    EXPECT_EQ(l.local.total, psi);
    EXPECT_LT(psi, l.full.total);
    EXPECT_EQ(after[MemCategory::Parameters] - before[MemCategory::Parameters], 4 * psi);
    EXPECT_EQ(after[MemCategory::Gradients] - before[MemCategory::Gradients], 4 * psi);
    EXPECT_EQ(after[MemCategory::OptimizerState] - before[MemCategory::OptimizerState], 8 * psi);
    for (const MemoryPrediction& m :
         t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
        if (m.category == MemCategory::Parameters || m.category == MemCategory::Gradients) {
            EXPECT_EQ(m.bytes, 4 * psi) << m.formula;
        }
        if (m.category == MemCategory::OptimizerState) {
            EXPECT_EQ(m.bytes, 8 * psi) << m.formula;
        }
    }
}

// bf16 moments under tensor parallelism: each element rounds on its own, so a shard's moments
// follow one process's, and the fp32 rule for small tensors reads the whole tensor (a cut matrix
// whose piece is under 4096 elements keeps bf16 moments as its whole does). The rank's optimizer
// bytes are the rule's, measured as predicted, and the run tracks one process with bf16 moments.
TEST(TpTrain, Bf16MomentsFollowTheWholeTensorsRule) {
    for (bool sp : {false, true}) {
        RunConfig c = tp_run(sp ? "tp_bf16m_sp" : "tp_bf16m", true, 6);
        c.optim.state_format = "bf16";
        RunConfig ref_cfg = c;
        ref_cfg.io.out_dir += "_ref" + std::to_string(comm().rank());
        std::vector<float> ref;
        {
            Trainer t(ref_cfg, test::quiet());
            ref = t.run().losses;
        }
        const MemoryStats before = host_memory().snapshot();
        Trainer t(sp ? with_sp(c) : with_tp(c), test::quiet(), &comm());
        const std::vector<float> losses = t.run().losses;
        const std::size_t state = host_memory().snapshot()[MemCategory::OptimizerState] -
                                  before[MemCategory::OptimizerState];
        ASSERT_EQ(losses.size(), ref.size());
        for (std::size_t i = 0; i < ref.size(); i++)
            EXPECT_NEAR(losses[i], ref[i], 1e-4 * std::abs(ref[i])) << "step " << i + 1;
        const TpLayout& l = tp_engine(t).tp_layout();
        std::size_t expect = 0, cut_below = 0;
        for (const ParamSpec& p : l.local.tensors) {
            expect += 2 * p.numel * (p.whole_numel >= kKeepFp32Below ? 2 : 4);
            cut_below += p.numel < kKeepFp32Below && p.whole_numel >= kKeepFp32Below;
        }
        EXPECT_GT(cut_below, 0u) << "a cut tensor whose piece alone would keep fp32 moments";
        EXPECT_EQ(state, expect);
        for (const MemoryPrediction& m :
             t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
            if (m.category == MemCategory::OptimizerState) {
                EXPECT_EQ(m.bytes, expect) << m.formula;
            }
    }
}

// A model wide enough for int8 / int4 blocks under tp = 2 and 4: every slice's runs (C / T of
// c_attn's columns, the vocabulary and c_proj rows) and every tensor's offset on the 128 and 256
// grids (int8 at T = 4 would need C / T = 256: refused, the test below).
RunConfig block_run(const std::string& name, int steps) {
    RunConfig c = tp_run(name, false, steps);
    c.model.n_embd = 512;
    c.model.n_layer = 1;
    return c;
}

// int8 and int4 moments under tensor parallelism: the blocks lie over the whole tensor, and where
// each falls whole in one rank's slice as a whole cell of the shard's grid (dist::tp_block_misfit),
// a rank quantizes exactly one process's blocks. From the same gradients (the whole model's,
// sliced) every rank's moments and weights are bitwise the slice of one process's after 3 steps;
// a model whose blocks would cross the slices is refused naming the tensor.
// The cell-by-cell reading of tp_block_misfit: every block of every whole tensor, located on
// each rank (TpLayout::local_index), held whole by one rank as one cell of its grid.
bool blocks_fit_cell_by_cell(const ModelConfig& m, int P, StateFormat f) {
    const std::size_t B = block_size(f);
    for (int rank = 0; rank < P; rank++) {
        const TpLayout l = make_tp_layout(m, P, rank);
        for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
            const ParamSpec& w = l.full.tensors[i];
            const ParamSpec& s = l.local.tensors[i];
            if (keeps_fp32(f, s)) continue;
            auto edge = [&](int64_t li) {
                return li == 0 || li == (int64_t)s.numel || (s.offset + (std::size_t)li) % B == 0;
            };
            for (std::size_t e0 = 0; e0 < w.numel;) {
                const std::size_t e1 = std::min(w.numel, e0 + B - (w.offset + e0) % B);
                const int64_t a = l.local_index(i, (int64_t)e0);
                const int64_t b = l.local_index(i, (int64_t)e1 - 1);
                if (!((a < 0 && b < 0) ||
                      (a >= 0 && b - a == (int64_t)(e1 - 1 - e0) && edge(a) && edge(b + 1))))
                    return false;
                e0 = e1;
            }
        }
    }
    return true;
}

TEST(TpLayout, BlockMisfitIsTheCellByCellCheck) {
    const int P = comm().size();
    std::vector<ModelConfig> models;
    for (bool llama : {false, true}) {
        RunConfig c = tp_run("tp_misfit", llama, 1);
        models.push_back(c.model);
        c.model.n_embd = 512;
        models.push_back(c.model);
        c.model.n_embd = 768;
        c.model.n_head = 12;
        if (llama) c.model.n_kv_head = 4;
        models.push_back(c.model);
    }
    int fit = 0, misfit = 0;
    for (const ModelConfig& m : models)
        for (StateFormat f : {StateFormat::Int8, StateFormat::Int4}) {
            const bool fast = tp_block_misfit(m, P, f).empty();
            EXPECT_EQ(fast, blocks_fit_cell_by_cell(m, P, f))
                << "n_embd " << m.n_embd << " " << m.norm << " " << state_format_name(f);
            (fast ? fit : misfit)++;
        }
    EXPECT_GT(fit, 0);
    EXPECT_GT(misfit, 0);
    EXPECT_EQ(tp_block_misfit(models[0], P, StateFormat::Bf16), "");
}

// This rank's slices of a whole model's flat buffer (l.full's), in l.local's layout.
std::vector<float> slice_of(const TpLayout& l, const std::vector<float>& full) {
    std::vector<float> local(l.local.total);
    for (std::size_t t = 0; t < l.full.tensors.size(); t++)
        tp_slice(l, t, full.data() + l.full.tensors[t].offset,
                 local.data() + l.local.tensors[t].offset);
    return local;
}

// One process's optimizer over the whole layout and this rank's over its slices (with `gather`
// where the optimizer steps sliced tensors whole), three steps from the same weights and
// gradients (the whole model's, sliced): the rank's weights and every state tensor must be
// bitwise the slices of one process's.
void expect_steps_are_slices(const OptimConfig& cfg, const TpLayout& l,
                             TensorGather* gather = nullptr) {
    auto whole = make_optimizer(cfg, l.full);
    auto mine = make_optimizer(cfg, l.local, 0, SIZE_MAX, MemCategory::OptimizerState, gather);
    auto slice = [&](const std::vector<float>& full) { return slice_of(l, full); };
    std::vector<float> w(l.full.total), g(l.full.total);
    for (std::size_t i = 0; i < w.size(); i++) w[i] = 0.05f * std::sin(0.37f * (float)i);
    std::vector<float> lw = slice(w);
    for (int step = 1; step <= 3; step++) {
        for (std::size_t i = 0; i < g.size(); i++)
            g[i] = 0.01f * std::cos(0.11f * (float)i * (float)step) / (1.0f + (float)(i % 7));
        std::vector<float> lg = slice(g);
        whole->step(w.data(), g.data(), cfg.lr);
        mine->step(lw.data(), lg.data(), cfg.lr);
    }
    EXPECT_EQ(slice(w), lw) << "weights of rank " << comm().rank();
    for (const std::string& name : whole->state_names()) {
        std::vector<float> a(l.full.total), b(l.local.total);
        whole->read_state(name, a.data());
        mine->read_state(name, b.data());
        EXPECT_EQ(slice(a), b) << name << " of rank " << comm().rank();
    }
}

// `one` trained in one process and at tp = the world size: the curves within `tol` relative, and
// the rank's optimizer bytes its shard's (optimizer_state_bytes over the local layout), measured
// as predicted. Returns the tp trainer and its losses.
struct TpRun {
    std::unique_ptr<Trainer> trainer;
    std::vector<float> losses;
};
TpRun expect_tp_follows_one_process(const RunConfig& one, const TpLayout& l, double tol) {
    RunConfig ref_cfg = one;
    ref_cfg.io.out_dir += "_ref" + std::to_string(comm().rank());
    std::vector<float> ref;
    {
        Trainer t(ref_cfg, test::quiet());
        ref = t.run().losses;
    }
    RunConfig run = with_tp(one);
    TpRun r;
    const MemoryStats before = host_memory().snapshot();
    r.trainer = std::make_unique<Trainer>(run, test::quiet(), &comm());
    r.losses = r.trainer->run().losses;
    const std::size_t state =
        host_memory().snapshot()[MemCategory::OptimizerState] - before[MemCategory::OptimizerState];
    EXPECT_EQ(r.losses.size(), ref.size());
    for (std::size_t i = 0; i < ref.size() && i < r.losses.size(); i++)
        EXPECT_NEAR(r.losses[i], ref[i], tol * std::abs(ref[i])) << "step " << i + 1;
    EXPECT_EQ(state, optimizer_state_bytes(run.optim, l.local, 0, l.local.total));
    for (const MemoryPrediction& m :
         r.trainer->engine().predicted_memory(run.micro_batch(), run.train.seq_len))
        if (m.category == MemCategory::OptimizerState) {
            EXPECT_EQ(m.bytes, state) << m.formula;
        }
    return r;
}

// `run` (4 steps at tp) stopped after 2 and resumed: the last two losses and the final weights
// are bitwise `losses`' and `params`. Returns the stopped run's directory.
std::string expect_tp_resumes_bitwise(const RunConfig& run, const std::vector<float>& losses,
                                      const std::vector<float>& params) {
    RunConfig split = run;
    split.io.out_dir += "_split";
    TrainOptions stop = test::quiet();
    stop.stop_after = 2;
    Trainer(split, stop, &comm()).run();
    comm().barrier();
    TrainOptions resume = test::quiet();
    resume.resume = split.io.out_dir;
    Trainer again(split, resume, &comm());
    const std::vector<float> rest = again.run().losses;
    EXPECT_EQ(rest.size(), 2u);
    if (rest.size() == 2 && losses.size() == 4) {
        EXPECT_EQ(rest[0], losses[2]);
        EXPECT_EQ(rest[1], losses[3]);
    }
    EXPECT_EQ(again.params(), params);
    return split.io.out_dir;
}

TEST(TpTrain, QuantizedMomentsAreOneProcesssBlocks) {
    const int P = comm().size();
    for (const char* format : {"int8", "int4"}) {
        SCOPED_TRACE(format);
        const StateFormat f = parse_state_format(format);
        RunConfig c = block_run("tp_qm", 3);
        c.optim.state_format = format;
        if (f == StateFormat::Int8 && P == 4) {
            const std::string misfit = tp_block_misfit(c.model, P, f);
            EXPECT_NE(misfit, "");
            test::expect_refused_naming(validate_optimizer_layout, with_tp(c),
                                        "optim.state_format = \"int8\"", misfit);
            continue;
        }
        ASSERT_EQ(tp_block_misfit(c.model, P, f), "");
        const TpLayout l = make_tp_layout(c.model, P, comm().rank());
        expect_steps_are_slices(c.optim, l);
        // A run: the rank's optimizer bytes are its shard's blocks, as predicted, and the curve
        // follows one process with the same format.
        expect_tp_follows_one_process(c, l, 1e-4);
    }
    // The tiny model's 8-wide head slices cannot hold a block: refused by name.
    RunConfig narrow = with_tp(tp_run("tp_qm_narrow", false, 1));
    narrow.optim.state_format = "int4";
    test::expect_refused_naming(validate_optimizer_layout, narrow, "optim.state_format = \"int4\"",
                                "lie across the ranks' slices");
}

// Muon and Adafactor under tensor parallelism: each sliced matrix is gathered over the tp group
// and stepped whole on every rank (Newton-Schulz on the whole matrix, Adafactor's factors and RMS
// of the whole tensor), then each keeps its slice. From the same gradients every rank's weights
// and state are bitwise the slices of one process's; a run follows one process, its optimizer
// bytes are as predicted (Adafactor's factors are the whole tensor's, on every rank), and a
// checkpoint resumes bitwise.
TEST(TpTrain, MuonAndAdafactorStepWholeMatrices) {
    const int P = comm().size();
    for (const char* name : {"muon", "adafactor"}) {
        SCOPED_TRACE(name);
        RunConfig c = tp_run(std::string("tp_whole_") + name, true, 4);
        c.optim.name = name;
        if (std::string(name) == "adafactor") c.optim.lr = 1e-2;
        const TpLayout l = make_tp_layout(c.model, P, comm().rank());
        TpTensorGather gather(l, comm());
        expect_steps_are_slices(c.optim, l, &gather);
        // A run against one process, its optimizer bytes, and a resume.
        const TpRun r = expect_tp_follows_one_process(c, l, 1e-3);
        const std::vector<float>& losses = r.losses;
        const std::string split =
            expect_tp_resumes_bitwise(with_tp(c), losses, r.trainer->params());
        TrainOptions resume = test::quiet();
        resume.resume = split;
        // The tp checkpoint holds the whole model's state as one process lays it out (Adafactor's
        // factors at each whole tensor's start): one process resumes it and follows the run.
        RunConfig one = c;
        one.io.out_dir = split + "_one" + std::to_string(comm().rank());
        Trainer alone(one, resume);
        const std::vector<float> alone_rest = alone.run().losses;
        ASSERT_EQ(alone_rest.size(), 2u);
        for (int i = 0; i < 2; i++)
            EXPECT_NEAR(alone_rest[i], losses[2 + i], 1e-3 * std::abs(losses[2 + i])) << i;
    }
    RunConfig z = with_tp(tp_run("tp_whole_zero", true, 1));
    z.optim.name = "muon";
    z.world = 2 * P;
    z.train.zero_stage = 1;
    z.train.batch_size = 2 * z.train.micro_batch_size * 2;
    test::expect_refused_naming(validate_optimizer_layout, z, "optim.name = \"muon\"",
                                "train.zero_stage = 1");
}

// optim.master = "none" under tensor parallelism alone: each rank keeps its shard's weights in
// bf16 (dist::ZeroStore over the shard, a world of one) and rounds each element with the draw of
// its index in the whole model (tp_index_runs, which inverts local_index). From the same weights
// and gradients the rank's bf16 weights are bitwise the slices of one process's, for AdamW and
// for Muon (its matrices gathered over the group); a run follows one process's bf16-weight run,
// allocates the parameter bytes predicted (2 per shard parameter + a decoded unit + the update's
// scratch), and resumes bitwise.
TEST(TpTrain, Bf16WeightsRoundAsOneProcess) {
    const int P = comm().size();
    for (bool llama : {false, true}) {
        const RunConfig c = tp_run("tp_bf16w_layout", llama, 1);
        const TpLayout l = make_tp_layout(c.model, P, comm().rank());
        std::vector<std::size_t> global(l.local.total, SIZE_MAX);
        for (const IndexRun& run : tp_index_runs(l))
            for (std::size_t k = 0; k < run.n; k++) global.at(run.local + k) = run.global + k;
        for (std::size_t i = 0; i < l.full.tensors.size(); i++) {
            const ParamSpec &f = l.full.tensors[i], &sh = l.local.tensors[i];
            for (int64_t e = 0; e < (int64_t)f.numel; e++) {
                const int64_t li = l.local_index(i, e);
                if (li >= 0) {
                    ASSERT_EQ(global[sh.offset + li], f.offset + e) << f.name << " " << e;
                }
            }
        }
    }
    for (const char* name : {"adamw", "muon"}) {
        SCOPED_TRACE(name);
        RunConfig c = tp_run(std::string("tp_bf16w_") + name, true, 4);
        c.optim.name = name;
        c.optim.master = "none";
        const TpLayout l = make_tp_layout(c.model, P, comm().rank());
        TpTensorGather gather(l, comm());
        // Three steps of one process's store and of this rank's, from the same weights and
        // gradients.
        LocalCommunicator self;
        auto store = [&](const ParamLayout& layout, bool shard) {
            ZeroStore::Options o;
            o.bf16_params = true;
            o.rounding_seed = bf16_rounding_seed(7);
            o.whole_tensors = whole_step_tensors(c.optim, layout);
            if (shard) o.global_index = tp_index_runs(l);
            return std::make_unique<ZeroStore>(layout, self, 0, o);
        };
        auto whole = store(l.full, false), mine = store(l.local, true);
        auto opt_whole = make_optimizer(c.optim, l.full);
        auto opt_mine =
            make_optimizer(c.optim, l.local, 0, SIZE_MAX, MemCategory::OptimizerState, &gather);
        auto slice = [&](const std::vector<float>& full) { return slice_of(l, full); };
        auto write = [](ZeroStore& z, const ParamLayout& layout, const std::vector<float>& w) {
            for (std::size_t u = 0; u < layout.units.size(); u++) {
                float* p = z.acquire((int)u, true);
                std::copy(w.begin() + layout.units[u].begin, w.begin() + layout.units[u].end, p);
                z.release((int)u);
            }
        };
        auto read = [](ZeroStore& z, const ParamLayout& layout) {
            std::vector<float> w(layout.total);
            for (std::size_t u = 0; u < layout.units.size(); u++) {
                const float* p = z.acquire((int)u);
                std::copy(p, p + layout.units[u].size(), w.begin() + layout.units[u].begin);
                z.release((int)u);
            }
            return w;
        };
        std::vector<float> w(l.full.total), g(l.full.total);
        for (std::size_t i = 0; i < w.size(); i++) w[i] = 0.05f * std::sin(0.37f * (float)i);
        write(*whole, l.full, w);
        write(*mine, l.local, slice(w));
        auto step = [&](ZeroStore& z, Optimizer& opt, const std::vector<float>& grads) {
            z.zero_grads();
            std::copy(grads.begin(), grads.end(), z.full_grads());
            z.step_units([&](float* p, float* gr, std::size_t at,
                             std::size_t n) { opt.step_part(p, gr, c.optim.lr, at, n); },
                         opt.steps_taken() + 1);
            opt.advance();
        };
        for (int k = 1; k <= 3; k++) {
            for (std::size_t i = 0; i < g.size(); i++)
                g[i] = 0.01f * std::cos(0.11f * (float)i * (float)k) / (1.0f + (float)(i % 7));
            step(*whole, *opt_whole, g);
            step(*mine, *opt_mine, slice(g));
        }
        EXPECT_EQ(slice(read(*whole, l.full)), read(*mine, l.local)) << "rank " << comm().rank();

        // A run: it follows one process with bf16 weights, allocates what the plan predicts, and
        // resumes bitwise.
        RunConfig ref_cfg = c;
        ref_cfg.io.out_dir += "_ref" + std::to_string(comm().rank());
        const std::vector<float> ref = Trainer(ref_cfg, test::quiet()).run().losses;
        RunConfig run = with_tp(c);
        host_memory().reset_peak();
        const MemoryStats before = host_memory().snapshot();
        Trainer t(run, test::quiet(), &comm());
        const std::vector<float> losses = t.run().losses;
        const MemoryStats after = host_memory().snapshot();
        ASSERT_EQ(losses.size(), ref.size());
        for (std::size_t i = 0; i < ref.size(); i++)
            EXPECT_NEAR(losses[i], ref[i], 1e-3 * std::abs(ref[i])) << "step " << i + 1;
        for (const MemoryPrediction& m : t.plan().memory)
            if (m.category == MemCategory::Parameters) {
                EXPECT_EQ(after.peak_used[(int)m.category] - before[m.category], m.bytes)
                    << m.formula;
                EXPECT_NE(m.formula.find("(bf16)"), std::string::npos) << m.formula;
            }
        expect_tp_resumes_bitwise(run, losses, t.params());
    }
}

// The communication buffers' peak (the checkpoint's gathers of the optimizer state and of each
// unit, sequence parallelism's norm-gradient pack) is the predicted row, with and without SP
// (issue 26).
TEST(TpTrain, CommunicationPeakIsPredicted) {
    for (bool sp : {false, true}) {
        RunConfig c = tp_run(sp ? "tp_comm_sp" : "tp_comm", true, 1);
        c = sp ? with_sp(c) : with_tp(c);
        c.io.save_final = true;
        Trainer t(c, test::quiet(), &comm());
        t.run();
        const std::size_t predicted = predicted_bytes(t, MemCategory::Communication);
        EXPECT_GT(predicted, 0u);
        EXPECT_EQ(t.engine().memory().snapshot().peak(MemCategory::Communication), predicted)
            << "sp " << sp;
    }
}

// A tp = T checkpoint resumes in one process with exactly its weights and optimizer state, and
// a one-process checkpoint at tp = T; a tp = T checkpoint resumed at tp = T continues bitwise.
TEST(TpCheckpoint, ReshardsBetweenTpAndOneProcess) {
    const int r = comm().rank();
    for (bool llama : {false, true}) {
        RunConfig one = tp_run("tp_ckpt", llama, 4);
        RunConfig tp = with_tp(one);
        const std::string base = one.io.out_dir;
        TrainSummary whole_run;
        {
            tp.io.out_dir = base + "_whole";
            Trainer t(tp, test::quiet(), &comm());
            whole_run = t.run();
        }
        // tp = T for 2 steps, then one process and tp = T from its checkpoint.
        tp.io.out_dir = base + "_tp";
        std::vector<float> tp_params;
        std::vector<std::vector<float>> tp_state;
        {
            Trainer t(tp, test::quiet("", 2), &comm());
            t.run();
            tp_params = t.params();
            tp_state = optimizer_state(t);
        }
        {
            RunConfig rest = one;
            rest.io.out_dir = base + "_rest" + std::to_string(r);
            Trainer t(rest, test::quiet(tp.io.out_dir));
            EXPECT_EQ(t.params(), tp_params) << "tp checkpoint in one process";
            EXPECT_EQ(optimizer_state(t), tp_state) << "tp optimizer state in one process";
        }
        {
            RunConfig rest = tp;
            rest.io.out_dir = base + "_tp_rest";
            Trainer t(rest, test::quiet(tp.io.out_dir), &comm());
            EXPECT_EQ(t.params(), tp_params);
            const TrainSummary s = t.run();
            ASSERT_EQ(s.losses.size(), 2u);
            EXPECT_EQ(s.losses[0], whole_run.losses[2]) << "resumed at tp = T";
            EXPECT_EQ(s.losses[1], whole_run.losses[3]) << "resumed at tp = T";
        }
        // One process for 2 steps (rank 0 writes), then tp = T from it.
        RunConfig first = one;
        first.io.out_dir = base + "_first";
        std::vector<float> one_params;
        std::vector<std::vector<float>> one_state;
        if (r == 0) {
            Trainer t(first, test::quiet("", 2));
            t.run();
        }
        comm().barrier();
        {
            RunConfig probe = one;
            probe.io.out_dir = base + "_probe" + std::to_string(r);
            Trainer t(probe, test::quiet(first.io.out_dir));
            one_params = t.params();
            one_state = optimizer_state(t);
        }
        {
            RunConfig rest = tp;
            rest.io.out_dir = base + "_resumed";
            Trainer t(rest, test::quiet(first.io.out_dir), &comm());
            EXPECT_EQ(t.params(), one_params) << "one-process checkpoint at tp = T";
            EXPECT_EQ(optimizer_state(t), one_state) << "one-process optimizer state at tp = T";
        }
    }
}

// Sequence parallelism changes no parameter's layout: a checkpoint written under it resumes
// under it bitwise (the run continues as if never stopped), at tp = T without it and in one
// process with exactly its weights and optimizer state.
TEST(TpSequenceParallel, CheckpointResumesWithAndWithoutSp) {
    const int r = comm().rank();
    RunConfig sp = with_sp(tp_run("sp_ckpt", true, 4));
    const std::string base = sp.io.out_dir;
    TrainSummary whole_run;
    {
        sp.io.out_dir = base + "_whole";
        Trainer t(sp, test::quiet(), &comm());
        whole_run = t.run();
    }
    sp.io.out_dir = base + "_first";
    std::vector<float> params;
    std::vector<std::vector<float>> state;
    {
        Trainer t(sp, test::quiet("", 2), &comm());
        t.run();
        params = t.params();
        state = optimizer_state(t);
    }
    {
        RunConfig rest = sp;
        rest.io.out_dir = base + "_rest";
        Trainer t(rest, test::quiet(sp.io.out_dir), &comm());
        EXPECT_EQ(t.params(), params);
        const TrainSummary s = t.run();
        ASSERT_EQ(s.losses.size(), 2u);
        EXPECT_EQ(s.losses[0], whole_run.losses[2]) << "resumed under sequence parallelism";
        EXPECT_EQ(s.losses[1], whole_run.losses[3]) << "resumed under sequence parallelism";
    }
    {
        RunConfig tp = sp;
        tp.train.sequence_parallel = false;
        tp.io.out_dir = base + "_tp";
        Trainer t(tp, test::quiet(sp.io.out_dir), &comm());
        EXPECT_EQ(t.params(), params) << "at tp = T without SP";
        EXPECT_EQ(optimizer_state(t), state) << "at tp = T without SP";
    }
    {
        RunConfig one = tp_run("sp_ckpt_one", true, 4);
        one.io.out_dir = base + "_one" + std::to_string(r);
        Trainer t(one, test::quiet(sp.io.out_dir));
        EXPECT_EQ(t.params(), params) << "in one process";
        EXPECT_EQ(optimizer_state(t), state) << "in one process";
    }
}

TEST(TpConfig, RefusesBadLayoutsAndCombinations) {
    const int P = comm().size();
    const RunConfig good = with_tp(tp_run("tp_refuse", false, 1));
    {
        RunConfig bad = good;
        bad.model.n_head = 2 * P + 1;
        bad.model.n_embd = 4 * (2 * P + 1);
        expect_refused(bad, fmt::format("must divide model.n_head = {}", 2 * P + 1));
    }
    {
        RunConfig bad = good;
        bad.model.n_kv_head = 1;
        expect_refused(bad, "must divide model.n_kv_head = 1");
    }
    {
        RunConfig bad = good;
        bad.model.ffn_hidden = 4 * P + 1;
        expect_refused(bad, "must divide the MLP hidden size");
    }
    {
        RunConfig bad = good;
        bad.train.tp = 2 * P;
        expect_refused(bad, fmt::format("ranks per replica does not divide the {} ranks", P));
    }
    {
        RunConfig bad = good;
        bad.train.zero_stage = 2;  // ZeRO-1 runs (tests/mpi/tp_mesh_test.cpp)
        expect_refused(bad, "train.zero_stage = 2 with train.tp");
    }
    {
        RunConfig bad = good;
        bad.lora.rank = 4;
        expect_refused(bad, "lora.rank");
    }
    {
        RunConfig bad = good;
        bad.train.dp_mode = "ps";
        expect_refused(bad, "train.dp_mode");
    }
    if (P == 4) {  // tp x pp runs (tests/mpi/tp_mesh_test.cpp), not with weight versions
        RunConfig bad = good;
        bad.train.tp = 2;
        bad.train.pp = 2;
        bad.train.pp_schedule = "pipedream";
        bad.model.tied_embeddings = false;
        bad.optim.grad_clip = 0;
        expect_refused(bad, "an asynchronous train.pp_schedule");
    }
}

}  // namespace
}  // namespace memtrain::dist
