// Data parallelism of the CUDA engine under mpirun, one GPU per rank with NCCL between them (or,
// where no GPU answers, cudasim's NCCL over MPI: the memtrain_sim_dist_tests binary): N ranks
// with micro-batch b train the same model as one process with micro-batch N*b, for DDP (stage 0,
// gradients all-reduced unit by unit during the backward) and ZeRO stages 1-3 (optimizer state,
// then gradients, then parameters sharded); each rank holds exactly its shards; ZeRO-3 gathers
// units ahead of their use; a checkpoint saved by N ranks under ZeRO-1 or 3 resumes in one
// process, and one saved under ZeRO-Offload resumes at the same world size bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "comm/device_communicator.h"
#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "engine/cuda/cuda_engine.h"
#include "engine/cuda/device_optimizer.h"
#include "kernels/cuda/ops.h"
#include "model/lora.h"
#include "mpi/dist_runs.h"
#include "optim/device_update.h"
#include "parallel/data/device_shard_gather.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "test_util.h"

namespace memtrain::dist {
namespace {

// One GPU per rank (NCCL refuses two ranks on one GPU); cudasim's ranks share its device.
#define REQUIRE_GPU_DP()                                                                    \
    do {                                                                                    \
        if (!::memtrain::test::on_cudasim() && (!cuda_available() || !MEMTRAIN_HAVE_NCCL || \
                                                cuda_device_count() < comm().local_size())) \
            GTEST_SKIP() << "needs one CUDA device per rank and NCCL";                      \
    } while (0)

RunConfig shared_cuda_run(const std::string& name, int steps, const std::string& precision) {
    RunConfig c = shared_tiny_run_config(name, steps);
    c.train.device = "cuda";
    c.train.precision = precision;
    c.io.save_final = false;
    return c;
}

using test::quiet;

// N ranks against one process with the whole global micro-batch, fp32: losses, final parameters,
// and each rank's bytes of parameters, gradients and optimizer state (its shards, exactly).
void check_ranks_match_one_process(int stage, const std::string& name,
                                   void (*adjust)(RunConfig&) = nullptr) {
    const int N = comm().size(), b = 2, K = 2, steps = 8;
    {
        RunConfig c = shared_cuda_run(name, steps, "fp32");
        if (adjust) adjust(c);
        c.train.batch_size = N * b * K;
        // The reference: every rank alone, with the whole global micro-batch.
        RunConfig ref_cfg = c;
        ref_cfg.train.micro_batch_size = N * b;
        ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
        TrainSummary ref_sum;
        std::vector<float> ref_params;
        {
            Trainer ref(ref_cfg, quiet());
            ref_sum = ref.run();
            ref_params = ref.params();
        }
        c.train.micro_batch_size = b;
        c.train.zero_stage = stage;
        const MemoryStats before = device_memory().snapshot();
        const MemoryStats host_before = host_memory().snapshot();
        Trainer t(c, quiet(), &comm());
        const MemoryStats after = device_memory().snapshot();
        const MemoryStats host_after = host_memory().snapshot();
        auto grew = [&](MemCategory k) { return after[k] - before[k]; };
        TrainSummary sum = t.run();
        ASSERT_EQ(sum.losses.size(), ref_sum.losses.size());
        // The rows split over ranks and a rank sum change the summation order: fp32 agrees to
        // rounding, amplified a little by Adam over the steps.
        for (std::size_t i = 0; i < sum.losses.size(); i++)
            EXPECT_NEAR(sum.losses[i], ref_sum.losses[i], 2e-5 * std::abs(ref_sum.losses[i]))
                << "step " << i + 1;
        const std::vector<float> params = t.params();
        double worst = 0;
        for (std::size_t i = 0; i < params.size(); i++)
            worst = std::max(worst, (double)std::abs(params[i] - ref_params[i]));
        EXPECT_LT(worst, 1e-4);
        // Adam's m and v (fp32, no master copy): whole at stage 0, this rank's shard from stage
        // 1; the gradients (fp32) a padded shard of N from stage 2, the parameters from stage 3.
        const std::size_t psi = t.engine().weights().layout.total;
        const std::size_t shard = (psi + N - 1) / N;
        const std::size_t mine =
            stage == 0 ? psi
                       : std::min(shard, psi - std::min(psi, (std::size_t)comm().rank() * shard));
        // (ZeRO-Offload: none of the optimizer on the device; the host holds this rank's range.)
        const bool offload = c.train.offload_optimizer;
        const std::size_t dev_opt = offload ? 0 : 8 * mine;
        EXPECT_GE(grew(MemCategory::OptimizerState), dev_opt);
        EXPECT_LT(grew(MemCategory::OptimizerState), dev_opt + 64 * 1024)
            << "beyond the chunk table";
        EXPECT_EQ(t.engine().optimizer().count(), mine);
        EXPECT_EQ(grew(MemCategory::Gradients), 4 * (stage >= 2 ? shard : N * shard));
        EXPECT_EQ(grew(MemCategory::Parameters), 4 * (stage >= 3 ? shard : N * shard));
        // The planner (memtrain estimate) predicts these bytes, up to the padding of the shards
        // (an element per rank) and the optimizer's chunk table.
        plan::RunSpec r;
        r.precision = Precision::fp32;
        r.optimizer = plan::Optimizer::adamw;
        r.dp = N;
        r.zero = stage;
        r.micro_batch = b;
        r.seq = c.train.seq_len;
        r.offload = offload ? plan::Offload::optimizer : plan::Offload::none;
        const auto est = plan::estimate_memory(plan::model_from_config(c.model), r);
        EXPECT_NEAR((double)est.bytes("parameters"), (double)grew(MemCategory::Parameters), 4 * N);
        EXPECT_NEAR((double)est.bytes("gradients"), (double)grew(MemCategory::Gradients), 4 * N);
        EXPECT_NEAR((double)est.bytes("optimizer states"),
                    (double)grew(MemCategory::OptimizerState), 64 * 1024);
        if (offload) {
            // On the host: this rank's fp32 master, moments and gradients, and the pinned
            // transfer buffer (an element of padding per rank; the optimizer's small tables).
            double host = 0;
            for (MemCategory k :
                 {MemCategory::OptimizerState, MemCategory::Gradients, MemCategory::Communication})
                host += (double)(host_after[k] - host_before[k]);
            EXPECT_GT(host, 0);
            EXPECT_NEAR((double)est.cpu_bytes, host, 20.0 * N + 4096);
        }
        // Stage 3 prefetches: apart from the first forward, units are gathered before they are
        // acquired (or are still in their slot from the forward).
        const auto [gathers, on_demand] = zero_gathers_for_test(t.engine());
        if (stage == 3) {
            EXPECT_GT(gathers, 0);
            EXPECT_LE(on_demand, 2) << "of " << gathers << " gathers";
        } else {
            EXPECT_EQ(gathers, 0);
        }
    }
}

TEST(CudaDp, RanksTrainTheSameModelAsOneProcess) {
    REQUIRE_GPU_DP();
    for (int stage : {0, 1, 2, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        check_ranks_match_one_process(stage, "cuda_dp_" + std::to_string(stage));
    }
}

// `c` trained over comm(): its summary, final parameters, this rank's optimizer range and the
// device bytes its optimizer allocated, which must be the engine's predicted row (whose formula
// is returned too).
struct OptimizerRun {
    TrainSummary sum;
    std::vector<float> params;
    std::size_t offset = 0, count = 0, bytes = 0;
    std::string formula;
};
OptimizerRun run_measuring_optimizer(const RunConfig& c) {
    OptimizerRun r;
    const MemoryStats before = device_memory().snapshot();
    Trainer t(c, quiet(), &comm());
    r.bytes = device_memory().snapshot()[MemCategory::OptimizerState] -
              before[MemCategory::OptimizerState];
    r.sum = t.run();
    r.params = t.params();
    r.offset = t.engine().optimizer().offset();
    r.count = t.engine().optimizer().count();
    for (const MemoryPrediction& row :
         t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
        if (row.category == MemCategory::OptimizerState) {
            EXPECT_EQ(r.bytes, row.bytes) << row.formula;
            r.formula = row.formula;
        }
    return r;
}

// The optimizer state formats under NCCL's ZeRO: every rank's shard is padded to the format's
// 256-element grain (so no quantization block falls between ranks), its rows are the plan's,
// and the run tracks one process with the same format (int8's tolerance on the CPU engine: a
// moment on a code boundary may round the other way when the gradient sums' order differs).
TEST(CudaDp, StateFormatsUnderZeroTrainAsOneProcess) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), b = 2, steps = 6;
    struct Case {
        const char* format;
        int stage;
        bool offload;  // the moments in the format on the host (ZeRO-Offload)
    };
    for (const Case k : {Case{"bf16", 1, false}, Case{"bf16", 3, false}, Case{"int8", 1, false},
                         Case{"int8", 3, false}, Case{"int4", 1, false}, Case{"int4", 3, false},
                         Case{"int8", 2, true}}) {
        const char* format = k.format;
        const int stage = k.stage;
        const std::string what =
            std::string(format) + " zero" + std::to_string(stage) + (k.offload ? " offload" : "");
        SCOPED_TRACE(what);
        RunConfig c = shared_cuda_run(
            "cuda_sf_" + what.substr(0, 4) + std::to_string(stage) + (k.offload ? "o" : ""), steps,
            "fp32");
        c.train.offload_optimizer = k.offload;
        c.model.n_embd = 64;  // matrices of 4096 elements or more: stored in the format
        c.model.n_head = 4;
        c.optim.state_format = format;
        c.train.batch_size = N * b;
        RunConfig ref_cfg = c;
        ref_cfg.train.micro_batch_size = N * b;
        ref_cfg.train.offload_optimizer = false;
        ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
        const TrainSummary ref = Trainer(ref_cfg, quiet()).run();
        c.train.micro_batch_size = b;
        c.train.zero_stage = stage;
        const OptimizerRun r = run_measuring_optimizer(c);
        ASSERT_EQ(r.sum.losses.size(), ref.losses.size());
        for (std::size_t i = 0; i < r.sum.losses.size(); i++)
            EXPECT_NEAR(r.sum.losses[i], ref.losses[i], 1e-4 * std::abs(ref.losses[i]))
                << "step " << i + 1;
        const std::size_t grain = std::string(format) == "bf16" ? 1 : 256;
        EXPECT_EQ(r.offset % grain, 0u);
    }
}

// The optimizer over NCCL's ZeRO shards (dist::DeviceShardGather) for the tensors it steps whole:
// each rank steps its shard of the same parameters from the same gradients, the tensors the
// shard edges cut gathered whole (Muon's Nesterov directions, Adafactor's gradients and weights),
// and its weights and state are bitwise the slice of one optimizer stepping the whole model on
// the same rank; unit by unit (the step inside the backward's parts, every rank walking every
// unit in backward order) as well. Then the state as checkpoints see it, written into a fresh
// shard optimizer in two pieces and finished (Adafactor's cut tensors' state gathered among
// their holders), reads back the same and takes the next step bitwise too.
template <typename T>
void shards_case(const char* name, const char* format, bool by_unit, bool master) {
    const int N = comm().size(), r = comm().rank();
    SCOPED_TRACE(std::string(name) + " " + test::type_name<T>() + " " + format +
                 (master ? " master" : "") + (by_unit ? " by unit" : ""));
    ModelConfig mc;
    mc.n_layer = 2;
    mc.n_head = 2;
    mc.n_embd = 64;  // matrices of 4096 elements and more: stored in the format
    mc.block_size = 8;
    mc.vocab_size = 70;
    mc.vocab_pad = 8;
    const ParamLayout layout = make_param_layout(mc);
    const std::size_t psi = layout.total;
    OptimConfig cfg;
    cfg.name = name;
    cfg.weight_decay = 0.1;
    cfg.grad_clip = 1.0;
    cfg.state_format = format;
    if (!std::is_same_v<T, float> && !master) cfg.master = "none";
    const std::vector<ShardRange> shards =
        padded_shard_ranges((int64_t)psi, N, (int64_t)shard_grain(cfg));
    auto dcomm = make_nccl_communicator(
        HostLink{r, N, [](void* d, int64_t b) { comm().broadcast(d, b, 0); }});
    DeviceShardGather gather(layout, shards, whole_step_tensors(cfg, layout), *dcomm);
    if (N > 1) {
        EXPECT_GT(gather.cuts().size(), 0u) << "no tensor cut: the test would test nothing";
    }
    const std::size_t lo = (std::size_t)shards[(std::size_t)r].offset;
    const std::size_t n = (std::size_t)shards[(std::size_t)r].count;
    auto wait = [](const char*) { device_synchronize(); };
    DeviceOptimizer<T> whole(cfg, layout, 0, psi, nullptr, wait, 7);
    DeviceOptimizer<T> mine(cfg, layout, lo, n, nullptr, wait, 7, by_unit, &gather);
    std::vector<float> p0 = test::randn(psi, 31, 0.5f);
    if (!std::is_same_v<T, float>) p0 = test::rounded<T>(p0);
    ASSERT_EQ(whole.master() != nullptr, master);
    if (master) {
        copy_to_device(whole.master(), p0.data(), psi * sizeof(float));
        copy_to_device(mine.master(), p0.data() + lo, n * sizeof(float));
    }
    DeviceBuffer<T> p_whole = test::upload_as<T>(p0), p_mine = test::upload_as<T>(p0);
    DeviceBuffer<cuda::StepScalars> d_s(1, MemCategory::Other);
    DeviceBuffer<double> d_sumsq(1, MemCategory::Other);
    auto step = [&](DeviceOptimizer<T>& shard, DeviceBuffer<T>& p_shard, int k) {
        const DeviceBuffer<T> g = test::upload_as<T>(test::randn(psi, 40 + k, 0.1f));
        cuda::sum_squares<T>(d_sumsq.data(), g.data(), (int64_t)psi);
        const cuda::StepScalars host = cuda::make_step_scalars(cfg, 2e-2, k);
        copy_to_device(d_s.data(), &host, sizeof host);
        cuda::finish_grad_norm(d_s.data(), d_sumsq.data());
        whole.step(p_whole.data(), g.data(), d_s.data(), nullptr);
        if (!by_unit) {
            shard.step(p_shard.data() + lo, g.data() + lo, d_s.data(), nullptr);
            return;
        }
        for (int u = (int)layout.units.size(); u-- > 0;) {
            const ParamUnit& unit = layout.units[(std::size_t)u];
            const std::size_t a = std::max(unit.begin, lo), b = std::min(unit.end, lo + n);
            shard.step_unit(u, a, a < b ? b - a : 0, p_shard.data() + lo, g.data() + a, d_s.data(),
                            nullptr);
        }
    };
    auto expect_slice = [&](DeviceOptimizer<T>& shard, DeviceBuffer<T>& p_shard,
                            const std::string& when) {
        device_synchronize();
        const std::vector<float> got = test::download_float(p_shard),
                                 want = test::download_float(p_whole);
        test::expect_bitwise("the shard's weights " + when,
                             {got.begin() + (long)lo, got.begin() + (long)(lo + n)},
                             {want.begin() + (long)lo, want.begin() + (long)(lo + n)});
        std::vector<float> sw(psi), sm(n);
        for (const std::string& s : whole.state_names()) {
            whole.read_state(s, sw.data());
            shard.read_state(s, sm.data());
            test::expect_bitwise(s + " " + when, sm,
                                 {sw.begin() + (long)lo, sw.begin() + (long)(lo + n)});
        }
    };
    for (int k = 1; k <= 3; k++) step(mine, p_mine, k);
    expect_slice(mine, p_mine, "after 3 steps");
    // A fresh shard optimizer loaded from the whole one's floats, as a checkpoint loads.
    DeviceOptimizer<T> again(cfg, layout, lo, n, nullptr, wait, 7, by_unit, &gather);
    again.set_steps_taken(whole.steps_taken());
    // (Split on the 256-value grain, as the shard files of any world size are: the device
    // optimizer encodes int8 blocks as each write arrives.)
    const std::size_t half = n / 2 / 256 * 256;
    std::vector<float> sw(psi);
    for (const std::string& s : whole.state_names()) {
        whole.read_state(s, sw.data());
        again.write_state(s, 0, half, sw.data() + lo);
        again.write_state(s, half, n - half, sw.data() + lo + half);
    }
    again.finish_writes();
    if (master) {
        std::vector<float> m(psi);
        copy_to_host(m.data(), whole.master(), psi * sizeof(float));
        copy_to_device(again.master(), m.data() + lo, n * sizeof(float));
    }
    expect_slice(again, p_mine, "loaded");
    step(again, p_mine, 4);
    expect_slice(again, p_mine, "after a step from the loaded state");
}

TEST(CudaDp, ShardsGatherTheTensorsTheyCutBitwise) {
    REQUIRE_GPU_DP();
    // Every storage stepped whole; unit by unit, one per optimizer and kind of weights.
    for (bool by_unit : {false, true}) {
        shards_case<float>("muon", "fp32", by_unit, false);
        shards_case<__nv_bfloat16>("adafactor", "fp32", by_unit, true);
        if (by_unit) continue;
        shards_case<float>("muon", "int8", by_unit, false);
        shards_case<__nv_bfloat16>("muon", "fp32", by_unit, false);
        shards_case<float>("adafactor", "fp32", by_unit, false);
        shards_case<__nv_bfloat16>("adafactor", "fp32", by_unit, false);
    }
}

// optim.name = "adafactor" and "muon" under DDP and ZeRO 1-3 on the GPU: under DDP every rank
// steps the whole model's tensors from the same reduced gradients with the same kernels; under
// ZeRO each rank steps its shard, gathering the tensors its edges cut. Its optimizer row is the
// plan's (Muon's Newton-Schulz scratch sized for the model's largest matrix, Adafactor's gather
// scratch for the largest cut tensor and the whole state of the ones it holds), and the run
// tracks one process with the whole global micro-batch; bf16 with a master under DDP, bf16
// weights without one at stage 3.
TEST(CudaDp, AdafactorAndMuonRanksTrainAsOneProcess) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), b = 2, steps = 6;
    for (const auto& [name, lr] : {std::pair{"muon", 1e-2}, std::pair{"adafactor", 0.2}})
        for (const auto& [stage, precision, master] :
             {std::tuple{0, "fp32", "fp32"}, std::tuple{0, "bf16", "fp32"},
              std::tuple{1, "fp32", "fp32"}, std::tuple{2, "fp32", "fp32"},
              std::tuple{3, "fp32", "fp32"}, std::tuple{3, "bf16", "none"}}) {
            SCOPED_TRACE(std::string(name) + " stage " + std::to_string(stage) + " " + precision +
                         " master " + master);
            RunConfig c = shared_cuda_run(
                std::string("cuda_") + name + "_zero" + std::to_string(stage) + precision, steps,
                precision);
            c.optim.name = name;
            c.optim.lr = lr;
            c.optim.master = master;
            c.train.batch_size = N * b;
            RunConfig ref_cfg = c;
            ref_cfg.train.micro_batch_size = N * b;
            ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
            const TrainSummary ref = Trainer(ref_cfg, quiet()).run();
            c.train.micro_batch_size = b;
            c.train.zero_stage = stage;
            const OptimizerRun r = run_measuring_optimizer(c);
            EXPECT_NE(r.formula.find(name[0] == 'm' ? "Muon" : "Adafactor"), std::string::npos)
                << r.formula;
            if (stage == 0) {
                EXPECT_EQ(r.count, r.params.size()) << "every tensor on every rank";
            } else if (N > 1) {
                EXPECT_LT(r.count, r.params.size()) << "a shard";
                // The shard edges cut tensors stepped whole (else the gather would go untested).
                const ParamLayout layout = make_param_layout(c.model);
                const auto shards =
                    padded_shard_ranges((int64_t)layout.total, N, (int64_t)shard_grain(c.optim));
                EXPECT_GT(cut_tensors(layout, shards, whole_step_tensors(c.optim, layout)).size(),
                          0u);
            }
            ASSERT_EQ(r.sum.losses.size(), ref.losses.size());
            const double tol = std::string(precision) == "fp32" ? 1e-4 : 1e-2;
            for (std::size_t i = 0; i < r.sum.losses.size(); i++)
                EXPECT_NEAR(r.sum.losses[i], ref.losses[i], tol * std::abs(ref.losses[i]))
                    << "step " << i + 1;
        }
}

// optim.step_in_backward with one micro-batch per step: under DDP each unit's gradient is
// all-reduced on the compute stream as soon as the backward finishes it, measured and updated
// from its bucket; under ZeRO-2/3 the unit's bucket is reduced to its pieces' owners and each
// rank updates its piece. The run is bitwise the two-phase step at the same stage (the same
// reductions, the norm summed per unit piece and over the ranks in both), with and without
// clipping, for AdamW in int8, Muon and Adafactor (under ZeRO their cut tensors gathered as each
// unit is updated, every rank walking every unit); each rank holds two unit buckets of gradients
// instead of the whole buffer (DDP) or no gradient shard (ZeRO-2/3), as predicted.
TEST(CudaDp, StepInBackwardRanksAreTheTwoPhaseStepBitwise) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), b = 2, steps = 5;
    // (name, ZeRO stage): DDP for AdamW and Muon; ZeRO-2 and 3 for AdamW, whose pieces of each
    // unit are updated as the bucket's reduction hands them over, with no gradient shard.
    for (const auto& [name, stage] :
         {std::pair{"adamw", 0}, std::pair{"muon", 0}, std::pair{"adamw", 2}, std::pair{"adamw", 3},
          std::pair{"muon", 2}, std::pair{"muon", 3}, std::pair{"adafactor", 3}})
        for (double clip : {1.0, 0.0}) {
            SCOPED_TRACE(std::string(name) + " stage " + std::to_string(stage) +
                         (clip > 0 ? " clipped" : " unclipped"));
            RunConfig c = shared_cuda_run(std::string("cuda_sib_dp_") + name +
                                              std::to_string(stage) + (clip > 0 ? "_clip" : ""),
                                          steps, "bf16");
            c.train.zero_stage = stage;
            c.optim.name = name;
            c.optim.lr = std::string(name) == "adafactor" ? 0.2 : 1e-2;
            c.optim.grad_clip = clip;
            if (std::string(name) == "adamw") c.optim.state_format = "int8";
            c.train.batch_size = N * b;
            c.train.micro_batch_size = b;
            auto run = [&](bool in_backward, std::size_t* grads) {
                RunConfig r = c;
                r.optim.step_in_backward = in_backward;
                r.io.out_dir += in_backward ? "_sib" : "_two";
                const MemoryStats before = device_memory().snapshot();
                Trainer t(r, quiet(), &comm());
                *grads = device_memory().snapshot()[MemCategory::Gradients] -
                         before[MemCategory::Gradients];
                for (const auto& row : t.engine().predicted_memory(b, r.train.seq_len))
                    if (row.category == MemCategory::Gradients) {
                        EXPECT_EQ(*grads, row.bytes) << row.formula;
                    }
                const TrainSummary s = t.run();
                return std::pair{s.losses, t.params()};
            };
            std::size_t two_grads = 0, sib_grads = 0;
            const auto two = run(false, &two_grads);
            const auto sib = run(true, &sib_grads);
            EXPECT_EQ(sib.first, two.first);
            EXPECT_EQ(sib.second, two.second);
            EXPECT_LT(sib_grads, two_grads);
            if (stage >= 2) {
                EXPECT_EQ(sib_grads, 0u) << "no gradient shard";
            }
        }
}

// ZeRO-3 on a Llama-style model with an untied head (the head unit holds lm_head) and every
// block recomputed from its input, so units are gathered again inside the backward.
TEST(CudaDp, Zero3LlamaUntiedWithFullRecompute) {
    REQUIRE_GPU_DP();
    check_ranks_match_one_process(3, "cuda_dp_llama", [](RunConfig& c) {
        c.model.norm = "rmsnorm";
        c.model.activation = "swiglu";
        c.model.positions = "rope";
        c.model.n_kv_head = 1;
        c.model.tied_embeddings = false;
        c.train.remat = "full";
    });
}

// ZeRO-3 under memory-poor remat: each block's input is rebuilt in the backward by re-running
// the blocks below, whose units are gathered again for it.
TEST(CudaDp, Zero3RebuildsDroppedBlockInputs) {
    REQUIRE_GPU_DP();
    check_ranks_match_one_process(3, "cuda_dp_memory_poor", [](RunConfig& c) {
        c.model.n_layer = 4;
        c.train.remat = "memory-poor";
    });
}

// ZeRO-2 with the block inputs offloaded to pinned host memory (train.remat = offload): the
// activation copies' stream and the collectives' stream run beside the compute stream together.
TEST(CudaDp, Zero2WithOffloadedActivations) {
    REQUIRE_GPU_DP();
    check_ranks_match_one_process(2, "cuda_dp_remat_offload", [](RunConfig& c) {
        c.model.n_layer = 5;  // more blocks than the device's ring of block inputs
        c.train.remat = "offload";
    });
}

// ZeRO-Offload over several ranks (ZeRO-2 + Offload, as DeepSpeed pairs them): each rank keeps its
// shard's master weights, moments and update on its host.
TEST(CudaDp, OffloadedShardsTrainTheSameModel) {
    REQUIRE_GPU_DP();
    for (int stage : {1, 2, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        check_ranks_match_one_process(stage, "cuda_dp_offload_" + std::to_string(stage),
                                      [](RunConfig& c) { c.train.offload_optimizer = true; });
    }
}

// `c` trained whole over comm() (its summary and final parameters), then again into
// out_dir + "_split", stopped after `cut` steps (a checkpoint for a resume to continue).
struct WholeAndCut {
    TrainSummary full;
    std::vector<float> full_params;
    RunConfig split;
};
WholeAndCut train_whole_and_cut(const RunConfig& c, int cut) {
    WholeAndCut w;
    {
        Trainer t(c, quiet(), &comm());
        w.full = t.run();
        w.full_params = t.params();
    }
    w.split = c;
    w.split.io.out_dir = c.io.out_dir + "_split";
    {
        TrainOptions o = quiet();
        o.stop_after = cut;
        Trainer t(w.split, o, &comm());
        t.run();
    }
    comm().barrier();
    return w;
}

// `c` (6 steps) trained whole and stopped after 3, then resumed at the same world size: the
// last 3 losses and the final parameters are the unbroken run's, bit for bit.
void expect_resume_is_bitwise(const RunConfig& c) {
    const WholeAndCut w = train_whole_and_cut(c, 3);
    TrainOptions o = quiet();
    o.resume = w.split.io.out_dir;
    Trainer t(w.split, o, &comm());
    const TrainSummary rest = t.run();
    ASSERT_EQ(rest.losses.size(), 3u);
    for (int i = 0; i < 3; i++) EXPECT_EQ(rest.losses[i], w.full.losses[3 + i]) << "step " << 4 + i;
    EXPECT_EQ(t.params(), w.full_params);
}

// ZeRO-Offload over several ranks, bf16, stopped after 3 of 6 steps and resumed at the same
// world size: the checkpoint's weights (each rank's piece of its host master weights, gathered
// into whole units; on resume written back into the pieces and rounded into the device's
// parameters, ZeRO-3's piece of them) and the host optimizer's shard come back exactly, so the
// curve and the parameters are the unbroken run's, bit for bit.
TEST(CudaDp, OffloadedShardsResumeBitForBit) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), steps = 6;
    for (int stage : {1, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        RunConfig c =
            shared_cuda_run("cuda_dp_offload_resume_" + std::to_string(stage), steps, "bf16");
        c.train.batch_size = N * 2;
        c.train.micro_batch_size = 2;
        c.train.zero_stage = stage;
        c.train.offload_optimizer = true;
        expect_resume_is_bitwise(c);
    }
}

// optim.master = "none" under NCCL's data parallelism: each rank updates its range of the bf16
// parameters (everything under DDP, its shard from ZeRO-1, ZeRO-3's shard being all it keeps) and
// rounds each element with the draw of its global index, so every stage ends on DDP's weights
// (bitwise on cudasim, whose collectives sum in rank order; NCCL's reduce-scatter may sum in
// another order than its all-reduce on a GPU). Each rank's optimizer row is its shard's moments
// only, as predicted, and a ZeRO-3 run stopped halfway resumes bitwise.
TEST(CudaDp, Bf16WeightsUnderZeroAreDdpsAndResumeBitwise) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), steps = 6;
    TrainSummary ddp;
    std::vector<float> ddp_params;
    for (int stage : {0, 1, 2, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        RunConfig c = shared_cuda_run("cuda_dp_bw_" + std::to_string(stage), steps, "bf16");
        c.optim.master = "none";
        c.train.batch_size = N * 2;
        c.train.micro_batch_size = 2;
        c.train.zero_stage = stage;
        const OptimizerRun r = run_measuring_optimizer(c);
        const TrainSummary& sum = r.sum;
        const std::vector<float>& params = r.params;
        EXPECT_EQ(r.formula.find("master"), std::string::npos) << r.formula;
        EXPECT_LT(r.bytes, 8 * r.count + 64 * 1024);
        if (stage == 0) {
            ddp = sum;
            ddp_params = params;
            continue;
        }
        ASSERT_EQ(sum.losses.size(), ddp.losses.size());
        if (test::on_cudasim()) {
            EXPECT_EQ(sum.losses, ddp.losses);
            EXPECT_EQ(params, ddp_params);
        } else {
            for (std::size_t i = 0; i < sum.losses.size(); i++)
                EXPECT_NEAR(sum.losses[i], ddp.losses[i], 0.02 * ddp.losses[i]) << i;
        }
    }
    // The offloaded optimizer over ZeRO-2 shards (int8 moments, their blocks cut nowhere by the
    // host's update chunks) follows DDP on the device.
    {
        RunConfig dev = shared_cuda_run("cuda_dp_bw_int8", steps, "bf16");
        // Blocks of more than 2^18 floats (the host update's chunk) starting off the 256 grid:
        // the chunks must still be cut on it.
        dev.model.n_embd = 168;
        dev.model.n_head = 4;
        dev.model.n_layer = 2;
        dev.optim.master = "none";
        dev.optim.state_format = "int8";
        dev.train.batch_size = N * 2;
        dev.train.micro_batch_size = 2;
        RunConfig off = dev;
        off.io.out_dir = shared_cuda_run("cuda_dp_bw_int8_off", steps, "bf16").io.out_dir;
        off.train.zero_stage = 2;
        off.train.offload_optimizer = true;
        const TrainSummary a = Trainer(dev, quiet(), &comm()).run();
        const TrainSummary b = Trainer(off, quiet(), &comm()).run();
        ASSERT_EQ(b.losses.size(), a.losses.size());
        for (std::size_t i = 0; i < a.losses.size(); i++)
            EXPECT_NEAR(b.losses[i], a.losses[i], 0.02 * a.losses[i]) << "offloaded, step " << i;
    }
    RunConfig c = shared_cuda_run("cuda_dp_bw_resume", steps, "bf16");
    c.optim.master = "none";
    c.train.batch_size = N * 2;
    c.train.micro_batch_size = 2;
    c.train.zero_stage = 3;
    expect_resume_is_bitwise(c);
}

// A bf16 run of N ranks at `stage` stops after 3 of 6 steps; every rank resumes its checkpoint
// alone with the whole global micro-batch: the shards come back together and the curve goes on.
void check_bf16_resume(int stage) {
    const int N = comm().size(), steps = 6;
    RunConfig c = shared_cuda_run("cuda_dp_bf16_" + std::to_string(stage), steps, "bf16");
    c.train.batch_size = N * 2;
    c.train.micro_batch_size = 2;
    c.train.zero_stage = stage;
    // Again, stopping after 3 steps: the checkpoint holds one optimizer file per rank.
    const WholeAndCut w = train_whole_and_cut(c, 3);
    const TrainSummary& full = w.full;
    const RunConfig& split = w.split;
    // Every rank resumes that checkpoint alone (in a directory of its own) with the whole global
    // micro-batch: the shards come back together, and the curve continues.
    RunConfig one = split;
    one.train.micro_batch_size = N * 2;
    one.io.out_dir = split.io.out_dir + "_one" + std::to_string(comm().rank());
    TrainOptions o = quiet();
    o.resume = split.io.out_dir;
    Trainer t(one, o);
    TrainSummary rest = t.run();
    ASSERT_EQ(rest.losses.size(), 3u);
    // bf16: one process and N ranks round their gradient sums differently.
    for (int i = 0; i < 3; i++) EXPECT_NEAR(rest.losses[i], full.losses[3 + i], 0.02) << i;
}

TEST(CudaDp, Bf16ShardedOptimizerResumesInOneProcess) {
    REQUIRE_GPU_DP();
    for (int stage : {1, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        check_bf16_resume(stage);
    }
}

// fp16 with dynamic loss scaling under data parallelism: an overflow that shows in one rank's
// gradients only (from ZeRO-1 each rank checks its shard of the sum) skips the step on every
// rank. All ranks halve the scale together, keep their parameters, and stay identical; the run
// tracks one process that overflows at the same step.
TEST(CudaDp, Fp16OverflowOnOneRankSkipsTheStepOnEveryRank) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), steps = 4;
    for (int stage : {0, 1, 2, 3}) {
        SCOPED_TRACE("zero stage " + std::to_string(stage));
        RunConfig c = shared_cuda_run("cuda_dp_fp16_" + std::to_string(stage), steps, "fp16");
        c.optim.loss_scale = 1024;
        c.train.batch_size = N * 2;
        c.train.micro_batch_size = 2;
        c.train.zero_stage = stage;
        // Stage 0 all-reduces whole gradients, so an overflow reaches every rank's copy; from
        // stage 1 the last rank alone sees it (in the shard it owns, or before its
        // reduce-scatter).
        const bool inject_here = stage == 0 || comm().rank() == N - 1;
        std::vector<float> before_2, after_2;
        double scale_after_2 = 0;
        TrainOptions o = quiet();
        o.before_step = [&](int64_t step, Engine& e) {
            if (step == 2) {
                before_2 = gather_params(e.weights());  // a collective from ZeRO-1: every rank
                if (inject_here) inject_overflow_for_test(e);
            }
            if (step == 3) {
                after_2 = gather_params(e.weights());
                scale_after_2 = e.loss_scaler_state().first;
            }
        };
        Trainer t(c, o, &comm());
        const TrainSummary s = t.run();
        EXPECT_EQ(s.steps_skipped, 1);
        ASSERT_FALSE(before_2.empty());
        EXPECT_EQ(before_2, after_2) << "the skipped step changed parameters";
        EXPECT_EQ(scale_after_2, 512.0) << "the scale halves on every rank";
        // Every rank ends with the same parameters: the elementwise maximum over ranks of p and
        // of -p are p and -p.
        const std::vector<float> p = t.params();
        std::vector<double> hi(p.begin(), p.end()), lo(p.size());
        for (std::size_t i = 0; i < p.size(); i++) lo[i] = -(double)p[i];
        comm().all_reduce_max(hi.data(), (int64_t)hi.size());
        comm().all_reduce_max(lo.data(), (int64_t)lo.size());
        std::size_t differ = 0;
        for (std::size_t i = 0; i < p.size(); i++) differ += hi[i] != p[i] || -lo[i] != p[i];
        EXPECT_EQ(differ, 0u) << "parameters differ between ranks";
        // One process with the whole global micro-batch, overflowing at the same step.
        RunConfig one = c;
        one.train.micro_batch_size = N * 2;
        one.train.zero_stage = 0;
        one.io.out_dir = c.io.out_dir + "_one" + std::to_string(comm().rank());
        TrainOptions o1 = quiet();
        o1.before_step = [](int64_t step, Engine& e) {
            if (step == 2) inject_overflow_for_test(e);
        };
        Trainer ref(one, o1);
        const TrainSummary r = ref.run();
        EXPECT_EQ(r.steps_skipped, 1);
        ASSERT_EQ(s.losses.size(), r.losses.size());
        // fp16: one process and N ranks round their gradient sums differently.
        for (std::size_t i = 0; i < s.losses.size(); i++)
            EXPECT_NEAR(s.losses[i], r.losses[i], 0.02) << "step " << i + 1;
    }
}

// LoRA on GPUs under DDP (model/cuda_lora.h): the adapters' gradients are all-reduced once per
// step, so N ranks with micro-batch b train the adapters one process trains with micro-batch
// N b (QLoRA nf4 base, no dropout: each rank draws its own masks). ZeRO stages are refused.
TEST(CudaDp, LoraAdaptersTrainTheSameModelAsOneProcess) {
    REQUIRE_GPU_DP();
    const int N = comm().size(), b = 2, K = 2;
    RunConfig c = shared_cuda_run("cuda_dp_lora", 6, "fp32");
    c.model.n_embd = 32;
    c.lora.rank = 4;
    c.lora.targets = "all";
    c.lora.base = "nf4";
    c.lora.base_group = 32;
    c.optim.lr = 1e-2;
    c.train.batch_size = N * b * K;
    RunConfig ref_cfg = c;
    ref_cfg.train.micro_batch_size = N * b;
    ref_cfg.io.out_dir = c.io.out_dir + "_ref" + std::to_string(comm().rank());
    const TrainSummary ref = Trainer(ref_cfg, quiet()).run();
    c.train.micro_batch_size = b;
    const MemoryStats before = device_memory().snapshot();
    Trainer t(c, quiet(), &comm());
    const MemoryStats after = device_memory().snapshot();
    const TrainSummary sum = t.run();
    ASSERT_EQ(sum.losses.size(), ref.losses.size());
    EXPECT_LT(sum.losses.back(), sum.losses.front());
    for (std::size_t i = 0; i < sum.losses.size(); i++)
        EXPECT_NEAR(sum.losses[i], ref.losses[i], 2e-5 * std::abs(ref.losses[i])) << i + 1;
    ASSERT_EQ(sum.val_losses.size(), ref.val_losses.size());
    for (std::size_t i = 0; i < sum.val_losses.size(); i++)
        EXPECT_NEAR(sum.val_losses[i].second, ref.val_losses[i].second, 1e-4) << i;
    // Every rank holds the adapters' gradients whole (DDP) and nothing of the base's.
    const std::size_t adapters = make_lora_layout(c.model, c.lora).params.total;
    EXPECT_EQ(after[MemCategory::Gradients] - before[MemCategory::Gradients], 4 * adapters);
    if (N > 1) {
        RunConfig z = c;
        z.train.zero_stage = 1;
        try {
            Trainer bad(z, quiet(), &comm());
            ADD_FAILURE() << "ZeRO-1 of GPU LoRA adapters was accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("train.zero_stage"), std::string::npos)
                << e.what();
        }
    }
}

}  // namespace
}  // namespace memtrain::dist
