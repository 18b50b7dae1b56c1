// Activation checkpointing: every policy gives the same bits as keeping everything, the budget
// DP matches exhaustive search, predicted bytes are the allocator's measured bytes, and a
// checkpointed training run resumes exactly. Policy parsing and its errors.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "core/allocator.h"
#include "core/error.h"
#include "core/rng.h"
#include "model/gpt.h"
#include "remat/cost.h"
#include "remat/policy.h"
#include "remat/profile.h"
#include "remat/solver.h"
#include "remat/trace.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train/validate.h"

namespace memtrain::remat {
namespace {

struct LossAndGrads {
    float loss;
    std::vector<float> grads;
};

// Two micro-batches with accumulation, so stale scratch contents would show.
LossAndGrads two_micro_batches(const ModelConfig& c, const RematPlan& plan) {
    GPT m(c);
    m.init_weights(11);
    m.set_remat(plan);
    m.zero_grads();
    const int B = 2, T = 8;
    auto x = test::random_tokens(2 * B * T, c.vocab_size, 5),
         y = test::random_tokens(2 * B * T, c.vocab_size, 6);
    m.set_dropout_seed(21);  // (model.dropout > 0 only)
    m.set_dropout_rows(0);
    float loss = m.forward_backward(x.data(), y.data(), B, T, 1.0f / 32);
    m.set_dropout_rows(B);
    loss += m.forward_backward(x.data() + B * T, y.data() + B * T, B, T, 1.0f / 32);
    return {loss, std::vector<float>(m.grads(), m.grads() + m.num_params())};
}

std::vector<std::string> policies_for(const ModelConfig& c) {
    std::vector<std::string> p = {"none",    "full",   "sqrt",   "selective",  "every:2",
                                  "every:3", "chen:2", "chen:3", "memory-poor"};
    Chain ch = make_chain(c, 2, 8, cpu_arena_format(c));
    std::size_t lo = min_feasible_bytes(ch),
                hi = peak_bytes(ch, RematPlan(c.n_layer, BlockKeep::All));
    for (int i = 0; i <= 4; i++) p.push_back(fmt::format("budget:{}", lo + (hi - lo) * i / 4));
    if (c.n_layer > 1) {
        // Below the knapsack's floor: the joint solver's schedules, and the binomial ones.
        const std::size_t floor = rebuild_floor(ch);
        for (int i = 0; i < 3; i++)
            p.push_back(fmt::format("budget:{}", floor + (lo - floor) * i / 3));
        for (int s = 0; s <= 2; s++) p.push_back(fmt::format("revolve:{}", s));
    }
    return p;
}

// The schedule's predicted activation bytes are what the layout lists and what one
// forward/backward allocates (current and peak), and workspace matches the layout too.
void expect_measured_bytes(const ModelConfig& c, const Solution& s, const std::string& what) {
    auto lay = activation_layout(c, 2, 8, s.plan);
    EXPECT_EQ(s.peak_bytes, arena_bytes(lay, MemCategory::Activations)) << what;
    auto before = host_memory().snapshot();
    host_memory().reset_peak();
    GPT m(c);
    m.init_weights(1);
    m.set_remat(s.plan);
    auto x = test::random_tokens(16, c.vocab_size, 3), y = test::random_tokens(16, c.vocab_size, 4);
    m.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
    auto now = host_memory().snapshot();
    EXPECT_EQ(now[MemCategory::Activations] - before[MemCategory::Activations], s.peak_bytes)
        << what;
    EXPECT_EQ(now.peak(MemCategory::Activations) - before[MemCategory::Activations], s.peak_bytes)
        << what;
    EXPECT_EQ(now[MemCategory::Workspace] - before[MemCategory::Workspace],
              arena_bytes(lay, MemCategory::Workspace))
        << what;
}

}  // namespace

TEST(Remat, EveryPolicyGivesBitwiseIdenticalLossAndGradients) {
    for (int L : {1, 3, 4}) {
        ModelConfig c = test::tiny_model(L);
        LossAndGrads ref = two_micro_batches(c, {});
        for (const auto& text : policies_for(c)) {
            Solution s = solve_policy(parse_policy(text), c, 2, 8);
            LossAndGrads r = two_micro_batches(c, s.plan);
            EXPECT_EQ(r.loss, ref.loss) << text << " L=" << L;
            EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4))
                << text << " L=" << L;
        }
        // Mixed plans the named policies do not produce.
        if (L >= 3) {
            RematPlan mixed(L, BlockKeep::Selective);
            mixed[0] = BlockKeep::Input;
            mixed[L - 1] = BlockKeep::All;
            LossAndGrads r = two_micro_batches(c, mixed);
            EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4));
        }
    }
}

// model.dropout's masks are hashes asked again by every recompute: each policy still gives the
// bits of keeping everything, and the bytes the layout (which has no masks) predicts.
TEST(Remat, DropoutKeepsEveryPolicyBitwiseAndItsPredictedBytes) {
    for (bool llama : {false, true}) {
        ModelConfig c = llama ? test::tiny_llama(3) : test::tiny_model(3);
        c.dropout = 0.25;
        LossAndGrads ref = two_micro_batches(c, {});
        ModelConfig plain = c;
        plain.dropout = 0;
        EXPECT_NE(ref.loss, two_micro_batches(plain, {}).loss) << "dropout changed nothing";
        for (const auto& text : policies_for(c)) {
            Solution s = solve_policy(parse_policy(text), c, 2, 8);
            LossAndGrads r = two_micro_batches(c, s.plan);
            EXPECT_EQ(r.loss, ref.loss) << text << " llama=" << llama;
            EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4))
                << text << " llama=" << llama;
            expect_measured_bytes(c, s, text + " with dropout");
        }
    }
}

// Under a mode of the arenas (format f): every policy of policies_for gives `ref`'s loss and
// gradients bitwise (two_micro_batches), its solution's peak is the layout's, and a model running
// it allocates exactly that many activation bytes.
static void expect_every_policy_bitwise_in_its_bytes(const ModelConfig& c, const ActFormat& f,
                                                     const LossAndGrads& ref,
                                                     const std::string& what) {
    for (const auto& text : policies_for(c)) {
        Solution s = solve_policy(parse_policy(text), c, 2, 8, nullptr, f);
        LossAndGrads r = two_micro_batches(c, s.plan);
        EXPECT_EQ(r.loss, ref.loss) << text << " " << what;
        EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4))
            << text << " " << what;
        auto lay = activation_layout(c, 2, 8, s.plan, f);
        EXPECT_EQ(s.peak_bytes, arena_bytes(lay, MemCategory::Activations)) << text;
        auto before = host_memory().snapshot();
        GPT m(c);
        m.init_weights(1);
        m.set_remat(s.plan);
        auto x = test::random_tokens(16, c.vocab_size, 3),
             y = test::random_tokens(16, c.vocab_size, 4);
        m.forward_backward(x.data(), y.data(), 2, 8, 1.0f / 16);
        EXPECT_EQ(
            host_memory().snapshot()[MemCategory::Activations] - before[MemCategory::Activations],
            s.peak_bytes)
            << text << " " << what;
    }
}

// train.cpu_attention = "lse": every policy still gives the bits of keeping everything (the
// recompute and the backward recompute the probabilities alike), the bytes the layout predicts
// are those allocated, and the layout holds (B,NH,T) log-sum-exps where it held (B,NH,T,T).
TEST(Remat, LogSumExpAttentionKeepsEveryPolicyBitwiseAndItsPredictedBytes) {
    for (bool llama : {false, true}) {
        ModelConfig c = llama ? test::tiny_llama(3) : test::tiny_model(3);
        c.lse_attention = true;
        const ActFormat f = cpu_arena_format(c);
        EXPECT_TRUE(f.fused_attention);
        LossAndGrads ref = two_micro_batches(c, {});
        ModelConfig probs = c;
        probs.lse_attention = false;
        LossAndGrads p = two_micro_batches(probs, {});
        EXPECT_NEAR(ref.loss, p.loss, 1e-6);
        for (std::size_t i = 0; i < ref.grads.size(); i++)
            ASSERT_NEAR(ref.grads[i], p.grads[i], 1e-6 + 1e-4 * std::abs(p.grads[i])) << i;
        const std::size_t heads = (std::size_t)c.n_head, B = 2, T = 8;
        EXPECT_EQ(
            plan_arena(probs, 2, 8).activation_bytes - plan_arena(c, 2, 8, {}, f).activation_bytes,
            3 * B * heads * T * (T - 1) * sizeof(float));
        expect_every_policy_bitwise_in_its_bytes(c, f, ref, llama ? "lse llama" : "lse gpt2");
    }
}

// train.mlp_tile: the MLP over row tiles (here 5 of the 16 rows: tiles of 5, 5, 5 and 1). Every
// policy gives the bits of keeping everything in the same mode, with and without dropout (the
// recompute makes each tile's c_fc output and activation with the forward's calls); a block
// whose MLP activations are recomputed holds one tile of them, so the scratch shrinks by the
// MLP's other rows, and the bytes predicted are those allocated. Against the untiled MLP the
// weight gradients are summed tile by tile: the same to rounding. Saved fields in bf16 or int8
// too: a kept MLP field is stored and read back a tile at a time through the working block's
// tile (int8 in tiles of 12 rows of a 64-wide model, whose values are whole 256-value blocks;
// the last tile short).
TEST(Remat, TiledMlpKeepsEveryPolicyBitwiseAndItsPredictedBytes) {
    for (SavedStore store : {SavedStore::fp32, SavedStore::bf16, SavedStore::int8})
        for (bool llama : {false, true})
            for (double dropout : {0.0, 0.1}) {
                const std::string what = std::string(llama ? "llama" : "gpt2") +
                                         (dropout > 0 ? " dropout" : "") + " saved " +
                                         (store == SavedStore::fp32   ? "fp32"
                                          : store == SavedStore::bf16 ? "bf16"
                                                                      : "int8");
                ModelConfig c = llama ? test::tiny_llama(3) : test::tiny_model(3);
                if (store == SavedStore::int8) {  // tiles of 12 rows: whole 256-value blocks
                    c.n_embd = 64;
                    if (llama) c.ffn_hidden = 64;
                }
                c.dropout = dropout;
                c.saved_activations = store;
                ModelConfig whole = c;
                const int tile = store == SavedStore::int8 ? 12 : 5;
                c.mlp_tile = tile;
                const ActFormat f = cpu_arena_format(c);
                EXPECT_EQ(f.mlp_tile, tile);
                LossAndGrads ref = two_micro_batches(c, {});
                if (dropout == 0) {
                    const LossAndGrads w = two_micro_batches(whole, {});
                    EXPECT_NEAR(ref.loss, w.loss, 1e-6) << what;
                    for (std::size_t i = 0; i < ref.grads.size(); i++)
                        ASSERT_NEAR(ref.grads[i], w.grads[i], 1e-6 + 1e-5 * std::abs(w.grads[i]))
                            << what << " " << i;
                }
                // `full`'s scratch (or working block) holds a tile of the 16 rows of ln_1's, ln_2's
                // output, c_fc's output and the activation.
                const RematPlan full(3, BlockKeep::Input);
                const std::size_t mlp_rows =
                    scratch_bytes(whole, 2, 8, BlockKeep::Input, cpu_arena_format(whole)) -
                    scratch_bytes(c, 2, 8, BlockKeep::Input, f);
                EXPECT_EQ(mlp_rows, (std::size_t)(16 - tile) *
                                        (2 * c.n_embd + c.fc_dim() + c.mlp_hidden()) *
                                        sizeof(float))
                    << what;
                EXPECT_EQ(plan_arena(whole, 2, 8, full).activation_bytes -
                              plan_arena(c, 2, 8, full, f).activation_bytes,
                          mlp_rows)
                    << what;
                expect_every_policy_bitwise_in_its_bytes(c, f, ref, what);
            }
}

// memory-poor and chen:K drop block inputs too: below `full` by the residual streams they do not
// keep (less two temporaries and chen's hold slots), at the rebuild's forwards (memory-poor
// O(n^2), chen one per segment block), and bitwise (EveryPolicyGivesBitwiseIdentical...).
TEST(Remat, RebuiltInputsGoBelowFullToTheMemoryPoorFloor) {
    const ModelConfig c = test::tiny_model(8);
    const std::size_t stream = resid_bytes(c, 2, 8, ActFormat::cpu());
    const Solution full = solve_policy(parse_policy("full"), c, 2, 8);
    const Solution poor = solve_policy(parse_policy("memory-poor"), c, 2, 8);
    const Solution chen = solve_policy(parse_policy("chen:3"), c, 2, 8);
    EXPECT_EQ(poor.plan[0], BlockKeep::Input);
    EXPECT_EQ(std::count(poor.plan.begin(), poor.plan.end(), BlockKeep::Dropped), 7);
    EXPECT_EQ(chen.plan, RematPlan({BlockKeep::Input, BlockKeep::Segment, BlockKeep::Segment,
                                    BlockKeep::Input, BlockKeep::Segment, BlockKeep::Segment,
                                    BlockKeep::Input, BlockKeep::Segment}));
    // 7 streams not kept, 2 temporaries; 5 not kept, 2 temporaries and 2 held.
    EXPECT_EQ(full.peak_bytes - poor.peak_bytes, 5 * stream);
    EXPECT_EQ(full.peak_bytes - chen.peak_bytes, 1 * stream);
    const InputRebuild rp = input_rebuild(poor.plan), rc = input_rebuild(chen.plan);
    EXPECT_EQ(rp.forwards, 1 + 2 + 3 + 4 + 5 + 6 + 7);
    EXPECT_EQ(rp.slots, 0);
    EXPECT_EQ(rc.forwards, 2 + 2 + 1);
    EXPECT_EQ(rc.slots, 2);
    const int64_t block = block_flops(c, 2, 8).forward();
    EXPECT_EQ(poor.recompute_flops - full.recompute_flops, 28 * block);
    EXPECT_EQ(chen.recompute_flops - full.recompute_flops, 5 * block);
    // Under a tiled MLP a block's own redo skips mlp.c_proj; a rebuild runs the whole forward.
    {
        ModelConfig t = c;
        t.mlp_tile = 4;
        const Chain ch = make_chain(t, 2, 8, cpu_arena_format(t));
        const BlockFlops f = block_flops(t, 2, 8);
        EXPECT_EQ(option(ch, 0, BlockKeep::Input).recompute_flops, f.forward() - f.fc_proj);
        EXPECT_EQ(rebuild_flops(ch, 3), f.forward());
        EXPECT_EQ(recompute_flops(ch, poor.plan), 8 * (f.forward() - f.fc_proj) + 28 * f.forward());
        EXPECT_EQ(recompute_flops(ch, chen.plan), 8 * (f.forward() - f.fc_proj) + 5 * f.forward());
        EXPECT_EQ(solve_policy(parse_policy("memory-poor"), t, 2, 8, nullptr, cpu_arena_format(t))
                      .recompute_flops,
                  recompute_flops(ch, poor.plan));
    }
    // At 32 blocks: full keeps 33 streams, chen:6 6 + 1 + 2 + 5 = 14, memory-poor 4.
    const ModelConfig deep = test::tiny_model(32);
    const std::size_t f32 = solve_policy(parse_policy("full"), deep, 2, 8).peak_bytes;
    EXPECT_EQ(f32 - solve_policy(parse_policy("chen:6"), deep, 2, 8).peak_bytes, 19 * stream);
    EXPECT_EQ(f32 - solve_policy(parse_policy("memory-poor"), deep, 2, 8).peak_bytes, 29 * stream);
    // budget:BYTES below `full` (the knapsack's floor) solves to the least-recompute plan that
    // rebuilds inputs and fits, down to memory-poor's floor; below that it names the floor. The
    // GPU layout never rebuilds.
    const Chain ch = make_chain(deep, 2, 8);
    const std::size_t lo = min_feasible_bytes(ch), floor = rebuild_floor(ch);
    EXPECT_EQ(floor, solve_policy(parse_policy("memory-poor"), deep, 2, 8).peak_bytes);
    const Solution mid =
        solve_policy(parse_policy(fmt::format("budget:{}", (lo + floor) / 2)), deep, 2, 8);
    EXPECT_LE(mid.peak_bytes, (lo + floor) / 2);
    EXPECT_TRUE(std::any_of(mid.plan.begin(), mid.plan.end(), rebuilds_input));
    for (const RematPlan& p : rebuild_plans(32)) {
        const Solution s = evaluate(ch, p);
        if (s.peak_bytes <= (lo + floor) / 2) {
            EXPECT_GE(s.recompute_flops, mid.recompute_flops);
        }
    }
    EXPECT_EQ(solve_policy(parse_policy(fmt::format("budget:{}", floor)), deep, 2, 8).plan,
              solve_policy(parse_policy("memory-poor"), deep, 2, 8).plan);
    EXPECT_NE(
        test::error_of([&] {
            solve_policy(parse_policy(fmt::format("budget:{}", floor - 1)), deep, 2, 8);
        }).find(fmt::format("smallest feasible peak activation memory {}", format_bytes(floor))),
        std::string::npos);
    // The GPU layout rebuilds too: below its keeping floor down to its own memory-poor floor.
    const ActFormat gpu = cuda_arena_format(deep, 2, 2, 8);
    const Chain gch = make_chain(deep, 2, 8, gpu);
    const std::size_t gpu_lo = min_feasible_bytes(gch), gpu_floor = rebuild_floor(gch);
    ASSERT_LT(gpu_floor, gpu_lo);
    const Solution on_gpu =
        solve_policy(parse_policy(fmt::format("budget:{}", gpu_lo - 1)), deep, 2, 8, nullptr, gpu);
    EXPECT_LE(on_gpu.peak_bytes, gpu_lo - 1);
    EXPECT_TRUE(std::any_of(on_gpu.plan.begin(), on_gpu.plan.end(), rebuilds_input));
    EXPECT_THROW(solve_policy(parse_policy(fmt::format("budget:{}", gpu_floor - 1)), deep, 2, 8,
                              nullptr, gpu),
                 Error);
    // The first block keeps its input: a plan that drops it is refused.
    RematPlan bad(3, BlockKeep::Dropped);
    EXPECT_NE(test::error_of([&] { input_rebuild(bad); }).find("no block below keeps one"),
              std::string::npos);
    for (const char* k : {"chen:0", "chen:x", "chen:"})
        EXPECT_NE(test::error_of([&] { parse_policy(k); }).find("has a bad K"), std::string::npos);
}

// The joint solver (budget:BYTES on the CPU model): over random chains of 2..7 blocks, at every
// budget of a grid, the least recompute (then the least peak) that exhaustive search finds over
// every plan: each block keeps its input with one of its three options, or (past the first)
// rebuilds it, held by the rebuild of any later block or never held.
TEST(Remat, JointSolverMatchesExhaustiveSearch) {
    Rng r(17);
    for (int trial = 0; trial < 24; trial++) {
        const int n = 2 + trial % 6;
        const bool alike = trial % 4 == 3;  // every block the same (the solver's uniform path)
        Chain ch;
        ch.resid_bytes = 64 * (2 + r.next_u64() % 6);
        ch.fixed_bytes = (n + 1) * ch.resid_bytes + 64 * (1 + r.next_u64() % 4);
        // Every other trial, a rebuild's whole forward costs more than Input's redo (as under
        // the tiled MLP, whose redo skips mlp.c_proj).
        const bool dearer = trial % 2 == 1;
        std::array<Option, 3> o{};
        int64_t forward = 0;
        for (int l = 0; l < n; l++) {
            if (l == 0 || !alike) {
                o[0] = {64 * (6 + r.next_u64() % 20), 0, 0};
                o[1] = {64 * (2 + r.next_u64() % 8), 64 * (1 + r.next_u64() % 4),
                        (int64_t)(1 + r.next_u64() % 30)};
                o[2] = {0, 64 * (5 + r.next_u64() % 10), (int64_t)(20 + r.next_u64() % 100)};
                forward = o[2].recompute_flops + (int64_t)(r.next_u64() % 200);
            }
            ch.blocks.push_back(o);
            if (dearer) ch.forward_flops.push_back(forward);
        }
        // Every plan, its peak and recompute.
        std::vector<std::pair<std::size_t, int64_t>> all;
        std::vector<int> choice(n, 0);
        const auto options = [&](int l) { return l == 0 ? 3 : 3 + 1 + (n - 1 - l); };
        while (true) {
            RematPlan plan(n);
            plan.hold_by.assign(n, -1);
            for (int l = 0; l < n; l++) {
                const int k = choice[l];
                plan[l] = k < 3    ? static_cast<BlockKeep>(k)
                          : k == 3 ? BlockKeep::Dropped
                                   : BlockKeep::Segment;
                if (k > 3) plan.hold_by[l] = l + (k - 3);  // a later block's rebuild
            }
            bool valid = true;
            try {
                input_rebuild(plan);
            } catch (const Error&) {
                valid = false;  // the named rebuild does not pass the block
            }
            if (valid) all.push_back({peak_bytes(ch, plan), recompute_flops(ch, plan)});
            int l = 0;
            while (l < n && ++choice[l] == options(l)) choice[l++] = 0;
            if (l == n) break;
        }
        std::sort(all.begin(), all.end());
        const std::size_t lo = all.front().first, hi = all.back().first;
        const std::size_t step = std::max<std::size_t>(1, (hi - lo) / 40);
        std::optional<std::pair<int64_t, std::size_t>> best;  // (recompute, peak)
        std::size_t i = 0;
        for (std::size_t budget = lo - 1; budget <= hi + step; budget += step) {
            for (; i < all.size() && all[i].first <= budget; i++)
                if (!best || all[i].second < best->first) best = {{all[i].second, all[i].first}};
            const auto got = solve_joint(ch, budget);
            const std::string what = fmt::format("trial {} (n {}) budget {}", trial, n, budget);
            ASSERT_EQ(best.has_value(), got.has_value()) << what;
            if (!got) continue;
            EXPECT_EQ(got->recompute_flops, best->first) << what;
            EXPECT_EQ(got->peak_bytes, best->second) << what;
            EXPECT_EQ(evaluate(ch, got->plan).peak_bytes, got->peak_bytes) << what;
            EXPECT_EQ(evaluate(ch, got->plan).recompute_flops, got->recompute_flops) << what;
        }
    }
}

// revolve:S on a chain of blocks that cost alike: the rebuild forwards of Griewank's binomial
// bound for n blocks and S + 1 snapshots (the kept first input and S slots), never more than S
// inputs held at once; S = 0 is memory-poor, and S >= n - 2 rebuilds each input once.
TEST(Remat, BinomialScheduleMeetsGriewanksBound) {
    // Closed-form values: t(l, s) for s = 1 is l(l-1)/2; for s = 2 and l = 6, 3*6 - beta(3, 2).
    EXPECT_EQ(binomial_forwards(6, 0), 15);
    EXPECT_EQ(binomial_forwards(6, 1), 3 * 6 - 10);
    EXPECT_EQ(binomial_forwards(10, 2), 3 * 10 - 15);
    for (int n = 2; n <= 40; n++) {
        const Chain ch = make_chain(test::tiny_model(n), 2, 8);
        const int64_t forward = option(ch, 0, BlockKeep::Input).recompute_flops;
        for (int S = 0; S <= 6; S++) {
            const RematPlan plan = binomial_plan(ch, S);
            const InputRebuild rb = input_rebuild(plan);
            EXPECT_EQ(rb.forwards, binomial_forwards(n, S)) << n << " blocks, " << S << " slots";
            EXPECT_LE(rb.slots, S);
            EXPECT_EQ(recompute_flops(ch, plan), (n + rb.forwards) * forward);
            if (S == 0) {
                EXPECT_EQ(plan, memory_poor_plan(n));
            }
            if (S >= n - 2) {
                EXPECT_EQ(rb.forwards, n - 1);
            }
        }
    }
    EXPECT_NE(test::error_of([] { parse_policy("revolve:-1"); }).find("has a bad S"),
              std::string::npos);
    EXPECT_NE(test::error_of([] { parse_policy("revolve:x"); }).find("has a bad S"),
              std::string::npos);
}

// The joint solver's schedules on GPT-2 and Llama-style models of 7 blocks: bitwise the loss and
// gradients of keeping everything, the arena the plan predicts, and among them schedules whose
// rebuilds pass an input that a later rebuild holds (it waits in a temporary the first time).
TEST(Remat, JointSchedulesAreBitwiseAndTheirPredictedBytes) {
    for (bool llama : {false, true}) {
        const ModelConfig c = llama ? test::tiny_llama(7) : test::tiny_model(7);
        const LossAndGrads ref = two_micro_batches(c, {});
        const Chain ch = make_chain(c, 2, 8, cpu_arena_format(c));
        const std::size_t floor = rebuild_floor(ch), lo = min_feasible_bytes(ch);
        std::vector<std::string> policies;
        for (int s = 1; s <= 3; s++) policies.push_back(fmt::format("revolve:{}", s));
        for (int i = 1; i < 6; i++)
            policies.push_back(fmt::format("budget:{}", floor + (lo - floor) * i / 6));
        bool held_later = false;
        for (const auto& text : policies) {
            const Solution s = solve_policy(parse_policy(text), c, 2, 8);
            const InputRebuild rb = input_rebuild(s.plan);
            for (int i = 0; i < 7; i++)
                for (int m = rb.from[i] + 1; rb.from[i] >= 0 && m < i; m++)
                    held_later = held_later || (rb.holder[m] >= 0 && rb.holder[m] < i);
            const LossAndGrads got = two_micro_batches(c, s.plan);
            EXPECT_EQ(got.loss, ref.loss) << text;
            EXPECT_EQ(0, std::memcmp(got.grads.data(), ref.grads.data(), ref.grads.size() * 4))
                << text;
            expect_measured_bytes(c, s, text);
        }
        EXPECT_TRUE(held_later);
    }
}

// The step's schedule event by event (memtrain remat --animate): one forward and one backward
// per block, a recompute per block that drops fields, every rebuild forward the plan's
// input_rebuild counts; the live bytes never above the arena, equal to it when everything is
// kept, and nothing held at the end.
TEST(Remat, TraceFollowsThePlanAndStaysInsideTheArena) {
    const ModelConfig c = test::tiny_model(6);
    const Chain chain = make_chain(c, 2, 8);
    for (const auto& text : policies_for(c)) {
        const Solution s = solve_policy(parse_policy(text), c, 2, 8);
        const std::vector<TraceEvent> ev = trace_step(chain, s.plan);
        const auto count = [&](TraceEvent::Kind k) {
            return std::count_if(ev.begin(), ev.end(),
                                 [&](const TraceEvent& e) { return e.kind == k; });
        };
        EXPECT_EQ(count(TraceEvent::Kind::Forward), 6) << text;
        EXPECT_EQ(count(TraceEvent::Kind::Backward), 6) << text;
        EXPECT_EQ(count(TraceEvent::Kind::Recompute),
                  6 - std::count(s.plan.begin(), s.plan.end(), BlockKeep::All))
            << text;
        EXPECT_EQ(count(TraceEvent::Kind::Rebuild), input_rebuild(s.plan).forwards) << text;
        std::size_t most = 0;
        for (const TraceEvent& e : ev) most = std::max(most, e.live_bytes);
        EXPECT_LE(most, s.peak_bytes) << text;
        if (text == "none") {
            EXPECT_EQ(most, s.peak_bytes);
            EXPECT_EQ(ev[5].state, "AAAAAA");
        }
        EXPECT_EQ(ev.back().state, "......") << text;
        const std::string svg = trace_svg(ev, chain, s.plan, text);
        EXPECT_EQ(svg.rfind("<svg", 0), 0u);
        EXPECT_NE(svg.find("</svg>"), std::string::npos);
        EXPECT_NE(svg.find("backward 0"), std::string::npos);
    }
    // memory-poor: block i's backward re-runs blocks 0 .. i-1, so 15 rebuilds at 6 blocks, and
    // a held input never appears; chen:3 holds the inputs of its segments.
    const auto poor = trace_step(chain, solve_policy(parse_policy("memory-poor"), c, 2, 8).plan);
    EXPECT_EQ(
        std::count_if(poor.begin(), poor.end(),
                      [](const TraceEvent& e) { return e.kind == TraceEvent::Kind::Rebuild; }),
        15);
    for (const TraceEvent& e : poor) EXPECT_EQ(e.state.find('h'), std::string::npos);
    const auto chen = trace_step(chain, solve_policy(parse_policy("chen:3"), c, 2, 8).plan);
    EXPECT_TRUE(std::any_of(chen.begin(), chen.end(), [](const TraceEvent& e) {
        return e.state.find('h') != std::string::npos;
    }));
}

TEST(Remat, PredictedBytesAreMeasuredBytes) {
    for (int L : {1, 3, 4}) {
        ModelConfig c = test::tiny_model(L);
        for (const auto& text : policies_for(c)) {
            Solution s = solve_policy(parse_policy(text), c, 2, 8);
            expect_measured_bytes(c, s, text + " L=" + std::to_string(L));
        }
    }
}

TEST(Remat, SetRematResizesTheArenaExactly) {
    ModelConfig c = test::tiny_model(3);
    GPT m(c);
    m.init_weights(1);
    auto x = test::random_tokens(16, c.vocab_size, 3), y = test::random_tokens(16, c.vocab_size, 4);
    auto before = host_memory().snapshot();
    for (const char* p : {"none", "full", "selective", "none"}) {
        Solution s = solve_policy(parse_policy(p), c, 2, 8);
        m.set_remat(s.plan);
        m.forward_loss(x.data(), y.data(), 2, 8);
        EXPECT_EQ(
            host_memory().snapshot()[MemCategory::Activations] - before[MemCategory::Activations],
            s.peak_bytes)
            << p;
    }
    EXPECT_THROW(m.set_remat(RematPlan(2, BlockKeep::Input)), Error);
}

// Random heterogeneous chains of 1..6 blocks (All keeps most and recomputes nothing, Input the
// reverse; with `offload`, residual streams the ring can free): at many budgets the solver must
// find what exhaustive search over all 3^n (4^n with Offload) plans finds, least recompute then
// least peak.
void check_solver_against_exhaustive(uint64_t seed, int trials, bool offload) {
    Rng r(seed);
    const int options = offload ? 4 : 3;
    for (int trial = 0; trial < trials; trial++) {
        const int n = 1 + trial % 6;
        Chain ch;
        if (offload) {
            ch.resid_bytes = 64 * (4 + r.next_u64() % 12);
            ch.fixed_bytes = (n + 1) * ch.resid_bytes + 64 * (1 + r.next_u64() % 4);
            ch.allow_offload = true;
        } else {
            ch.fixed_bytes = 64 * (1 + r.next_u64() % 10);
        }
        for (int l = 0; l < n; l++) {
            std::array<Option, 3> o;
            o[0] = {64 * (20 + r.next_u64() % 20), 0, 0};
            o[1] = {64 * (5 + r.next_u64() % 15), 64 * (1 + r.next_u64() % 8),
                    (int64_t)(1 + r.next_u64() % 50)};
            o[2] = {0, 64 * (10 + r.next_u64() % 20), (int64_t)(50 + r.next_u64() % 200)};
            ch.blocks.push_back(o);
        }
        const std::size_t lo = min_feasible_bytes(ch);
        if (offload) {
            Chain no = ch;
            no.allow_offload = false;
            EXPECT_LE(lo, min_feasible_bytes(no));
            // Offloading every input frees all but the ring's streams.
            EXPECT_LE(lo + (n - std::min(n, kOffloadSlots)) * ch.resid_bytes,
                      peak_bytes(no, RematPlan(n, BlockKeep::Input)));
        }
        const std::size_t hi = peak_bytes(ch, RematPlan(n, BlockKeep::All)) + 128;
        int total = 1;
        for (int i = 0; i < n; i++) total *= options;
        const std::size_t step = (offload ? 96 : 64) + trial;
        for (std::size_t budget = lo > 200 ? lo - 200 : 0; budget <= hi; budget += step) {
            std::optional<Solution> best;
            RematPlan plan(n);
            for (int code = 0; code < total; code++) {
                for (int i = 0, c = code; i < n; i++, c /= options)
                    plan[i] = static_cast<BlockKeep>(c % options);
                Solution s = evaluate(ch, plan);
                if (s.peak_bytes > budget) continue;
                if (!best || s.recompute_flops < best->recompute_flops ||
                    (s.recompute_flops == best->recompute_flops && s.peak_bytes < best->peak_bytes))
                    best = s;
            }
            auto got = solve_budget(ch, budget);
            ASSERT_EQ(best.has_value(), got.has_value())
                << "trial " << trial << " budget " << budget;
            if (!best) {
                EXPECT_LT(budget, lo);
                continue;
            }
            EXPECT_GE(budget, lo);
            EXPECT_EQ(got->recompute_flops, best->recompute_flops) << "trial " << trial;
            EXPECT_EQ(got->peak_bytes, best->peak_bytes) << "trial " << trial;
            EXPECT_EQ(evaluate(ch, got->plan).peak_bytes, got->peak_bytes);
            EXPECT_LE(got->peak_bytes, budget);
        }
    }
}

TEST(Remat, SolverMatchesExhaustiveSearch) {
    check_solver_against_exhaustive(7, 60, false);
}

// budget:BYTES+offload: Offload is a fourth option (Input's recompute and scratch, its input in
// host memory; the plan's offloaded inputs share a ring of up to kOffloadSlots streams). The
// solver must match exhaustive search over all 4^n plans, with the peak of each plan equal to
// the arena the CUDA model allocates for it.
TEST(Remat, SolverWithOffloadMatchesExhaustiveSearch) {
    check_solver_against_exhaustive(11, 40, true);
    // The chain's peak of a mixed plan is the CUDA arena's activation bytes.
    const ModelConfig cfg = test::tiny_model(6);
    const ActFormat fmt = ActFormat::cuda_model(2, 64);
    const Chain ch = make_chain(cfg, 2, 16, fmt);
    using K = BlockKeep;
    for (const RematPlan& plan :
         {RematPlan{K::Offload, K::All, K::Offload, K::Offload, K::Selective, K::Offload},
          RematPlan{K::Input, K::Offload, K::Offload, K::Offload, K::Offload, K::Offload},
          RematPlan{K::All, K::All, K::All, K::All, K::Offload, K::Input},
          RematPlan(6, K::Offload)}) {
        const ArenaPlan a = plan_arena(cfg, 2, 16, plan, fmt);
        EXPECT_EQ(peak_bytes(ch, plan), a.activation_bytes);
        const std::size_t n = std::count(plan.begin(), plan.end(), K::Offload);
        EXPECT_EQ(a.offloaded_bytes,
                  (n - std::min<std::size_t>(n, kOffloadSlots)) * 2 * 16 * cfg.n_embd * 2);
    }
}

// Sequence parallelism (a tensor-parallel shard with ModelConfig::sequence_parallel): the
// residual streams, the norm fields and ln_f hold B*T / tp rows, the other fields and the
// workspace's GEMM buffers all B*T, plus one gather buffer of B*T x C; the remat solver's chain
// prices exactly that arena for mixed plans. A micro-batch whose rows the ranks do not divide
// is laid out as plain tensor parallelism.
TEST(Remat, SequenceParallelArenaShardsTheNormRegions) {
    ModelConfig tp = test::tiny_model(6);
    tp.tp = 2;
    ModelConfig sp = tp;
    sp.sequence_parallel = true;
    const int B = 2, T = 8, N = B * T, C = tp.n_embd;
    const ActFormat fmt = ActFormat::cpu();
    EXPECT_EQ(resid_bytes(sp, B, T), resid_bytes(tp, B, T) / 2);
    EXPECT_EQ(fixed_bytes(sp, B, T), fixed_bytes(tp, B, T) / 2);
    for (int i = 0; i < kSavedFields; i++) {
        const SavedField f = static_cast<SavedField>(i);
        const bool seq = f == SavedField::Ln1 || f == SavedField::Ln1Mean ||
                         f == SavedField::Ln1Rstd || f == SavedField::ResidMid ||
                         f == SavedField::Ln2 || f == SavedField::Ln2Mean ||
                         f == SavedField::Ln2Rstd;
        EXPECT_EQ(saved_field_bytes(f, sp, B, T, fmt),
                  saved_field_bytes(f, tp, B, T, fmt) / (seq ? 2 : 1))
            << saved_field_name(f, sp, fmt);
    }
    const Chain ch = make_chain(sp, B, T, fmt);
    using K = BlockKeep;
    for (const RematPlan& plan :
         {RematPlan(6, K::All), RematPlan(6, K::Selective), RematPlan(6, K::Input),
          RematPlan{K::All, K::Selective, K::Input, K::All, K::Input, K::Selective}}) {
        const ArenaPlan a = plan_arena(sp, B, T, plan, fmt), b = plan_arena(tp, B, T, plan, fmt);
        EXPECT_EQ(peak_bytes(ch, plan), a.activation_bytes);
        EXPECT_LT(a.activation_bytes, b.activation_bytes);
        EXPECT_EQ(a.workspace_bytes, b.workspace_bytes - 4 * N * C / 2 + 4 * N * C);
        EXPECT_NE(a.sp_gather, kNoOffset);
        EXPECT_EQ(b.sp_gather, kNoOffset);
    }
    // 1 x 7 rows over 2 ranks: no sequence shard.
    EXPECT_EQ(plan_arena(sp, 1, 7).activation_bytes, plan_arena(tp, 1, 7).activation_bytes);
    EXPECT_EQ(plan_arena(sp, 1, 7).sp_gather, kNoOffset);
}

TEST(Remat, NamedPoliciesHaveTheDocumentedPlans) {
    ModelConfig c = test::tiny_model(4);
    auto plan = [&](const char* p) { return solve_policy(parse_policy(p), c, 2, 8).plan; };
    using K = BlockKeep;
    EXPECT_EQ(plan("none"), RematPlan(4, K::All));
    EXPECT_EQ(plan("full"), RematPlan(4, K::Input));
    EXPECT_EQ(plan("selective"), RematPlan(4, K::Selective));
    EXPECT_EQ(plan("every:3"), (RematPlan{K::All, K::Input, K::Input, K::All}));
    EXPECT_EQ(plan("sqrt"), (RematPlan{K::All, K::Input, K::All, K::Input}));
    // A budget of none's peak keeps everything; the smallest feasible budget is what full needs.
    Chain ch = make_chain(c, 2, 8);
    auto none = solve_policy(parse_policy("none"), c, 2, 8);
    EXPECT_EQ(solve_policy(parse_policy(fmt::format("budget:{}", none.peak_bytes)), c, 2, 8).plan,
              none.plan);
    EXPECT_EQ(min_feasible_bytes(ch), solve_policy(parse_policy("full"), c, 2, 8).peak_bytes);
}

TEST(Remat, ParsesPoliciesAndSizes) {
    EXPECT_EQ(parse_policy("none").kind, RematPolicy::Kind::None);
    EXPECT_EQ(parse_policy("every:4").every, 4);
    EXPECT_EQ(parse_policy("budget:200MiB").budget, 200u * 1048576);
    EXPECT_EQ(parse_policy("budget:1.5GB").budget, 1500000000u);
    EXPECT_EQ(parse_policy("budget:4096").budget, 4096u);
    EXPECT_EQ(parse_policy("budget:3KiB").budget, 3072u);
    EXPECT_EQ(parse_policy("budget:2KB").budget, 2000u);
    EXPECT_FALSE(parse_policy("budget:2KB").may_offload());
    const RematPolicy o = parse_policy("budget:6GiB+offload");
    EXPECT_EQ(o.kind, RematPolicy::Kind::Budget);
    EXPECT_EQ(o.budget, std::size_t{6} << 30);
    EXPECT_TRUE(o.budget_offload && o.may_offload());
    EXPECT_TRUE(parse_policy("offload").may_offload());
    for (const char* bad : {"", "Full", "every:", "every:0", "every:x", "every:2x",
                            "budget:", "budget:-1MiB", "budget:10TB", "budget:MiB", "sqrt:2",
                            "budget:+offload", "budget:1GiB+off", "full+offload"}) {
        try {
            parse_policy(bad);
            ADD_FAILURE() << "accepted '" << bad << "'";
        } catch (const Error& e) {
            std::string m = e.what();
            EXPECT_NE(m.find("budget:BYTES"), std::string::npos) << m;
            EXPECT_NE(m.find("every:K"), std::string::npos) << m;
        }
    }
}

TEST(Remat, ConfigKeyIsValidatedByName) {
    RunConfig c = parse_run_config("[train]\nremat = \"sqrt\"\n", "x.toml", {});
    EXPECT_EQ(c.train.remat, "sqrt");
    validate_config(c);
    RunConfig d = parse_run_config("", "x", {"train.remat=budget:10MiB"});
    EXPECT_EQ(d.train.remat, "budget:10MiB");
    validate_config(d);
    RunConfig e = parse_run_config("", "x", {"train.remat=sometimes"});
    try {
        validate_config(e);
        FAIL() << "expected an error";
    } catch (const Error& err) {
        std::string m = err.what();
        EXPECT_NE(m.find("train.remat"), std::string::npos) << m;
        EXPECT_NE(m.find("selective"), std::string::npos) << m;
    }
    EXPECT_EQ(parse_run_config(to_toml(d), "resolved", {}).train.remat, "budget:10MiB");
    // Inputs in host memory need the CUDA engine.
    RunConfig f =
        parse_run_config("", "x", {"train.device=cpu", "train.remat=budget:10MiB+offload"});
    try {
        validate_config(f);
        FAIL() << "expected an error";
    } catch (const Error& err) {
        std::string m = err.what();
        EXPECT_NE(m.find("train.remat = budget:10MiB+offload keeps block inputs in pinned host"),
                  std::string::npos)
            << m;
    }
}

TEST(Remat, TooSmallBudgetNamesTheSmallestFeasibleOne) {
    ModelConfig c = test::tiny_model(3);
    std::size_t need = min_feasible_bytes(make_chain(c, 2, 8));
    try {
        solve_policy(parse_policy(fmt::format("budget:{}", need - 1)), c, 2, 8);
        FAIL() << "expected an error";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(fmt::format("budget:{}", need)), std::string::npos)
            << e.what();
    }
    EXPECT_EQ(solve_policy(parse_policy(fmt::format("budget:{}", need)), c, 2, 8).peak_bytes, need);
}

TEST(Remat, TrainerWithFullRecomputeMatchesNoneAndResumesBitwise) {
    auto d0 = test::temp_dir("remat_none"), d1 = test::temp_dir("remat_full"),
         d2 = test::temp_dir("remat_split");
    TrainOptions q;
    q.quiet = true;
    Trainer ref(test::tiny_run(d0, 12), q);
    auto sref = ref.run();
    RunConfig full = test::tiny_run(d1, 12);
    full.train.remat = "full";
    auto before = host_memory().snapshot();
    Trainer a(full, q);
    auto sa = a.run();
    EXPECT_EQ(sa.losses, sref.losses);
    // What the end-of-run memory report predicts is what the trainer's model holds.
    auto lay = activation_layout(full.model, full.micro_batch(), full.train.seq_len,
                                 a.model().remat_plan());
    EXPECT_EQ(a.model().remat_plan(), RematPlan(2, BlockKeep::Input));
    EXPECT_EQ(host_memory().snapshot()[MemCategory::Activations] - before[MemCategory::Activations],
              arena_bytes(lay, MemCategory::Activations));
    EXPECT_EQ(0, std::memcmp(a.model().params(), ref.model().params(), a.model().num_params() * 4));

    RunConfig split = test::tiny_run(d2, 12);
    split.train.remat = "full";
    TrainSummary s2;
    auto second = test::train_stop_and_resume(split, 6, s2);
    ASSERT_EQ(s2.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(s2.losses[i], sa.losses[6 + i]) << "step " << 7 + i;
    EXPECT_EQ(
        0, std::memcmp(a.model().params(), second->model().params(), a.model().num_params() * 4));
}

// The same guarantees for the Llama-style block (rmsnorm keeps no mean, swiglu a 2H
// pre-activation and an H product, rope rotates qkv in place, 2 kv heads, untied lm_head).
TEST(Remat, LlamaStyleEveryPolicyIsBitwiseAndPredictedBytesAreMeasured) {
    for (int L : {1, 3}) {
        const ModelConfig c = test::tiny_llama(L);
        LossAndGrads ref = two_micro_batches(c, {});
        for (const auto& text : policies_for(c)) {
            Solution s = solve_policy(parse_policy(text), c, 2, 8);
            LossAndGrads r = two_micro_batches(c, s.plan);
            EXPECT_EQ(r.loss, ref.loss) << text << " L=" << L;
            EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4))
                << text << " L=" << L;
            expect_measured_bytes(c, s, text + " L=" + std::to_string(L));
        }
        if (L >= 3) {
            RematPlan mixed{BlockKeep::Input, BlockKeep::Selective, BlockKeep::All};
            LossAndGrads r = two_micro_batches(c, mixed);
            EXPECT_EQ(0, std::memcmp(r.grads.data(), ref.grads.data(), ref.grads.size() * 4));
        }
    }
}

// The profiling pass: every piece of a block takes measurable time, the budget solver works on
// those nanoseconds (peak within the budget, the same as the exhaustive optimum for the measured
// chain is covered by SolverMatchesExhaustiveSearch on any costs), and a trainer configured with
// measured costs trains under the budget it was given.
TEST(Remat, MeasuredCostsDriveTheBudgetSolver) {
    ModelConfig cfg = test::tiny_model(4);
    cfg.n_embd = 64;
    cfg.n_head = 4;
    cfg.block_size = 32;
    const int B = 4, T = 32;
    const BlockFlops ns = measure_block(cfg, B, T, 2);
    for (int64_t v : {ns.ln, ns.qkv, ns.attention, ns.proj, ns.fc, ns.gelu, ns.fc_proj})
        EXPECT_GT(v, 0);
    const double step = estimated_step_ns(cfg, B, T, ns);
    EXPECT_GT(step, 3.0 * cfg.n_layer * (double)ns.forward());

    const Chain chain = make_chain(cfg, B, T, ns);
    EXPECT_EQ(chain.blocks[0][(int)BlockKeep::Input].recompute_flops, ns.forward());
    EXPECT_EQ(chain.blocks[0][(int)BlockKeep::Selective].recompute_flops, ns.selective());
    const std::size_t lo = min_feasible_bytes(chain);
    const std::size_t hi = evaluate(chain, RematPlan(cfg.n_layer, BlockKeep::All)).peak_bytes;
    const std::size_t budget = (lo + hi) / 2;
    Solution s = solve_policy(parse_policy("budget:" + std::to_string(budget)), cfg, B, T, &ns);
    EXPECT_LE(s.peak_bytes, budget);
    EXPECT_EQ(s.recompute_flops, recompute_flops(chain, s.plan));

    MeasuredStep m = measure_step(cfg, B, T, s.plan, 1);
    EXPECT_GT(m.seconds, 0);
    EXPECT_EQ(m.activation_bytes, s.peak_bytes);  // the arena is the layout, to the byte

    const std::string dir = test::temp_dir("remat_measured");
    RunConfig rc = test::tiny_run(dir, 3);
    rc.train.remat_costs = "measured";
    const Chain run_chain = make_chain(rc.model, rc.micro_batch(), rc.train.seq_len);
    rc.train.remat = "budget:" + std::to_string(min_feasible_bytes(run_chain));
    TrainOptions q;
    q.quiet = true;
    Trainer t(rc, q);
    EXPECT_EQ(t.run().steps_done, 3);
    rc.train.remat_costs = "guessed";
    EXPECT_THROW(validate_config(rc), Error);
}

}  // namespace memtrain::remat
