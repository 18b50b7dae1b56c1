// LoRA and QLoRA on the CUDA engine (on a GPU, or on cudasim where there is none): the packed
// base's device decoders give the host decoder's bits; with B = 0 the adapted model's loss is the
// base model's; fp32 training tracks the CPU LoRA engine (GPT-2 and Llama-style, with dropout,
// fp32 and nf4/int8/int4 bases); bf16 tracks fp32; the device memory is what the engine predicts;
// checkpoints resume bitwise on the GPU and load on the CPU; unsupported combinations are refused.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "cuda/cuda_test_util.h"
#include "cuda/device_fit_util.h"
#include "io/safetensors.h"
#include "model/gpt.h"
#include "model/weights.h"
#include "quant/quantized_store.h"
#include "test_util.h"
#include "train/trainer.h"

#if MEMTRAIN_HAVE_CUDA

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include "model/cuda_lora.h"
#include "quant/device_base.h"

using namespace memtrain;
namespace fs = std::filesystem;

namespace {

using test::quiet;

// tests/train/lora_train_test.cpp's run, on `device` in `precision`.
RunConfig lora_run(const std::string& dir, int steps, const std::string& device,
                   const std::string& precision, const std::string& base = "fp32") {
    RunConfig c = test::tiny_run(dir, steps);
    c.model.n_embd = 32;  // int4/nf4 groups of 32 divide every block matrix's inputs
    c.lora.rank = 4;
    c.lora.alpha = 8;
    c.lora.targets = "all";
    c.lora.dropout = 0.1;
    c.lora.base = base;
    c.lora.base_group = 32;
    c.optim.lr = 1e-2;
    c.optim.weight_decay = 0;
    c.train.device = device;
    c.train.precision = precision;
    return c;
}

RunConfig llama_style(RunConfig c) {
    c.model.norm = "rmsnorm";
    c.model.activation = "swiglu";
    c.model.positions = "rope";
    c.model.n_head = 4;
    c.model.n_kv_head = 2;
    c.model.tied_embeddings = false;
    c.model.bias = false;
    return c;
}

// Every adapter tensor of a checkpoint, in file order.
std::vector<float> adapters_of(const std::string& ckpt) {
    const io::SafetensorsFile f = io::SafetensorsFile::open(ckpt + "/adapter_model.safetensors");
    std::vector<float> out;
    for (const io::TensorInfo& t : f.tensors()) {
        std::size_t n = 1;
        for (int64_t d : t.shape) n *= (std::size_t)d;
        std::vector<float> v(n);
        f.read_f32(t, v, t.name, t.shape);
        out.insert(out.end(), v.begin(), v.end());
    }
    return out;
}

}  // namespace

TEST(CudaLora, DeviceDecodersGiveTheHostDecodersBits) {
    REQUIRE_GPU();
    ModelConfig cfg;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.n_embd = 64;
    cfg.block_size = 16;
    cfg.vocab_size = 50;
    GPT full(cfg);
    init_gpt2_weights(full.weights(), 7);
    for (const char* f : {"int8", "int4", "nf4"}) {
        SCOPED_TRACE(f);
        const quant::BaseQuant q = quant::parse_base_quant(f, std::string(f) == "int8" ? 0 : 32);
        quant::QuantizedParamStore host(full.weights(), q);
        QuantizedDeviceBase<float> dev(host, nullptr);
        QuantizedDeviceBase<__nv_bfloat16> dev16(host, nullptr);
        const auto predicted = QuantizedDeviceBase<float>::predicted_bytes(cfg, q);
        EXPECT_GT(predicted.params, 0u);
        for (int u = 0; u < (int)host.layout().units.size(); u++) {
            const std::size_t n = host.layout().units[(std::size_t)u].size();
            const float* want = host.acquire(u);
            std::vector<float> h(want, want + n), got(n);
            host.release(u);
            const float* d = dev.acquire_params(u);
            device_synchronize();
            copy_to_host(got.data(), d, n * sizeof(float));
            dev.release_params(u);
            test::expect_bitwise("unit " + std::to_string(u), got, h);
            std::vector<__nv_bfloat16> got16(n);
            const __nv_bfloat16* d16 = dev16.acquire_params(u);
            device_synchronize();
            copy_to_host(got16.data(), d16, n * sizeof(__nv_bfloat16));
            dev16.release_params(u);
            std::size_t bad = 0;
            for (std::size_t i = 0; i < n; i++) {
                const __nv_bfloat16 w = cuda::to_storage<__nv_bfloat16>(h[i]);
                bad += std::memcmp(&w, &got16[i], sizeof(w)) != 0;
            }
            EXPECT_EQ(bad, 0u) << "bf16 unit " << u;
        }
        // Two slots, least recently used first: blocks 0, 1, 0 decode twice, not three times.
        const int64_t before = dev.decodes();
        for (int u : {1, 2, 1}) {
            dev.acquire_params(u);
            dev.release_params(u);
        }
        EXPECT_EQ(dev.decodes() - before, 0) << "blocks 1 and 2 were already in the slots";
    }
}

TEST(CudaLora, ZeroBGivesTheBaseModelsLoss) {
    REQUIRE_GPU();
    auto d = test::temp_dir("cuda_lora_b0");
    std::vector<int32_t> x = test::random_tokens(16, 50, 1), y = test::random_tokens(16, 50, 2);
    for (const char* targets : {"attn", "all"}) {
        SCOPED_TRACE(targets);
        RunConfig base = lora_run(d, 1, "cuda", "fp32");
        base.lora.rank = 0;
        base.lora.dropout = 0;
        RunConfig lora = lora_run(d, 1, "cuda", "fp32");
        lora.lora.targets = targets;
        Trainer a(base, quiet()), b(lora, quiet());
        const double la = a.engine().forward_loss(x.data(), y.data(), 2, 8);
        const double lb = b.engine().forward_loss(x.data(), y.data(), 2, 8);
        if (std::string(targets) == "attn") {
            EXPECT_EQ(la, lb);  // the same kernels, plus exact zeros
        } else {
            // c_fc's adapter unfuses the GELU epilogue: one more rounding at most.
            EXPECT_NEAR(la, lb, 1e-6 * std::fabs(la));
        }
    }
}

TEST(CudaLora, Fp32TracksTheCpuLoraEngine) {
    REQUIRE_GPU();
    for (const char* variant : {"gpt2", "llama"}) {
        for (const char* base : {"fp32", "nf4", "int8", "int4"}) {
            if (std::string(variant) == "llama" && std::string(base) != "fp32" &&
                std::string(base) != "nf4")
                continue;
            SCOPED_TRACE(std::string(variant) + " " + base);
            auto dc = test::temp_dir(std::string("lora_track_cpu_") + variant + base);
            auto dg = test::temp_dir(std::string("lora_track_gpu_") + variant + base);
            RunConfig cpu = lora_run(dc, 8, "cpu", "fp32", base);
            RunConfig gpu = lora_run(dg, 8, "cuda", "fp32", base);
            if (std::string(variant) == "llama") {
                cpu = llama_style(cpu);
                gpu = llama_style(gpu);
            }
            gpu.train.remat = "selective";  // recompute runs the adapters again
            auto sc = Trainer(cpu, quiet()).run();
            auto sg = Trainer(gpu, quiet()).run();
            ASSERT_EQ(sc.losses.size(), sg.losses.size());
            EXPECT_LT(sg.losses.back(), sg.losses.front()) << "the GPU run did not learn";
            for (std::size_t i = 0; i < sc.losses.size(); i++)
                EXPECT_NEAR(sg.losses[i], sc.losses[i], 2e-4 * std::fabs(sc.losses[i])) << i;
            test::expect_close("adapters", adapters_of(gpu.io.out_dir + "/ckpt_000008"),
                               adapters_of(cpu.io.out_dir + "/ckpt_000008"), 2e-4, 2e-3);
        }
    }
}

// optim.name = "adafactor" and "muon" on LoRA's adapters (whole tensors in the adapters' range;
// Muon orthogonalizes the blocks' 2-D adapters, rank x in and out x rank): the GPU tracks the CPU
// LoRA engine with the same optimizer, its optimizer row as predicted.
TEST(CudaLora, AdafactorAndMuonTrackTheCpuLoraEngine) {
    REQUIRE_GPU();
    for (const auto& [name, lr] : {std::pair{"adafactor", 0.2}, std::pair{"muon", 1e-2}}) {
        SCOPED_TRACE(name);
        RunConfig cpu =
            lora_run(test::temp_dir(std::string("lora_wt_cpu_") + name), 8, "cpu", "fp32", "nf4");
        cpu.optim.name = name;
        cpu.optim.lr = lr;
        RunConfig gpu = cpu;
        gpu.train.device = "cuda";
        gpu.io.out_dir = test::temp_dir(std::string("lora_wt_gpu_") + name) + "/out";
        const TrainSummary sc = Trainer(cpu, quiet()).run();
        const MemoryStats before = device_memory().snapshot();
        Trainer t(gpu, quiet());
        const TrainSummary sg = t.run();
        const std::size_t grew = device_memory().snapshot()[MemCategory::OptimizerState] -
                                 before[MemCategory::OptimizerState];
        for (const auto& row : t.engine().predicted_memory(gpu.micro_batch(), gpu.train.seq_len))
            if (row.category == MemCategory::OptimizerState) {
                EXPECT_EQ(grew, row.bytes) << row.formula;
            }
        ASSERT_EQ(sc.losses.size(), sg.losses.size());
        EXPECT_LT(sg.losses.back(), sg.losses.front()) << "the GPU run did not learn";
        for (std::size_t i = 0; i < sc.losses.size(); i++)
            EXPECT_NEAR(sg.losses[i], sc.losses[i], 2e-4 * std::fabs(sc.losses[i])) << i;
    }
}

// optim.step_in_backward with LoRA on the GPU: the adapters' gradients are one small buffer
// (0.3% of the base here), so the update runs after the backward, bitwise the two-phase step;
// clipping by the previous step's norm still clips each step with the last one's norm, which
// tracks the CPU LoRA engine (whose adapters do step inside the backward).
TEST(CudaLora, StepInBackwardKeepsTheTwoPhaseStepAndItsClipping) {
    REQUIRE_GPU();
    RunConfig c = lora_run(test::temp_dir("lora_sib_two"), 6, "cuda", "fp32");
    c.train.micro_batch_size = c.train.batch_size;
    Trainer two(c, quiet());
    const TrainSummary s_two = two.run();
    RunConfig sib = c;
    sib.optim.step_in_backward = true;
    sib.io.out_dir = test::temp_dir("lora_sib_in") + "/out";
    const MemoryStats before = device_memory().snapshot();
    Trainer in(sib, quiet());
    const TrainSummary s_in = in.run();
    const std::size_t grew = device_memory().snapshot()[MemCategory::OptimizerState] -
                             before[MemCategory::OptimizerState];
    for (const auto& row : in.engine().predicted_memory(sib.micro_batch(), sib.train.seq_len))
        if (row.category == MemCategory::OptimizerState) {
            EXPECT_EQ(grew, row.bytes) << row.formula;
        }
    EXPECT_EQ(s_in.losses, s_two.losses);
    EXPECT_EQ(s_in.val_losses, s_two.val_losses);
    RunConfig lag = sib;
    lag.optim.step_in_backward_clip = "previous-norm";
    lag.optim.grad_clip = 0.05;  // binds on every step
    lag.io.out_dir = test::temp_dir("lora_sib_lag") + "/out";
    const TrainSummary s_lag = Trainer(lag, quiet()).run();
    EXPECT_NE(s_lag.losses, s_two.losses);
    RunConfig cpu = lag;
    cpu.train.device = "cpu";
    cpu.io.out_dir = test::temp_dir("lora_sib_cpu") + "/out";
    const TrainSummary s_cpu = Trainer(cpu, quiet()).run();
    ASSERT_EQ(s_cpu.losses.size(), s_lag.losses.size());
    for (std::size_t i = 0; i < s_cpu.losses.size(); i++)
        EXPECT_NEAR(s_lag.losses[i], s_cpu.losses[i], 2e-4 * std::fabs(s_cpu.losses[i])) << i;
}

TEST(CudaLora, Bf16TracksFp32AndResumesBitwise) {
    REQUIRE_GPU();
    auto d32 = test::temp_dir("lora_gpu_fp32"), d16 = test::temp_dir("lora_gpu_bf16"),
         dr = test::temp_dir("lora_gpu_resume");
    auto s32 = Trainer(lora_run(d32, 10, "cuda", "fp32", "nf4"), quiet()).run();
    RunConfig c16 = lora_run(d16, 10, "cuda", "bf16", "nf4");
    auto s16 = Trainer(c16, quiet()).run();
    for (std::size_t i = 0; i < s32.losses.size(); i++)
        EXPECT_NEAR(s16.losses[i], s32.losses[i], 0.02 * std::fabs(s32.losses[i])) << i;
    TrainSummary resumed;
    test::train_stop_and_resume(lora_run(dr, 10, "cuda", "bf16", "nf4"), 4, resumed);
    ASSERT_EQ(resumed.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(resumed.losses[i], s16.losses[4 + i]) << i;
    // The GPU's checkpoint is the CPU's format: a CPU LoRA run resumes from it.
    RunConfig cpu = c16;
    cpu.train.device = "cpu";
    cpu.train.precision = "fp32";
    cpu.train.max_steps = 12;
    auto sc = Trainer(cpu, quiet(c16.io.out_dir)).run();
    ASSERT_EQ(sc.losses.size(), 2u);
    EXPECT_TRUE(std::isfinite(sc.losses.back()));
}

// optim.master = "none" on the GPU's adapters: the bf16 adapters are the weights (no fp32
// master: the optimizer row loses exactly 4 bytes per adapter parameter, as predicted), each
// update rounds stochastically into them, the curve follows the fp32 master's, and a resume
// through a checkpoint (the adapters decoded, rounded to nearest back) is bitwise.
TEST(CudaLora, Bf16AdaptersWithoutAMasterTrackTheMasterAndResumeBitwise) {
    REQUIRE_GPU();
    auto run = [](const RunConfig& c, std::size_t* opt_bytes) {
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, quiet());
        const TrainSummary s = t.run();
        *opt_bytes = device_memory().snapshot()[MemCategory::OptimizerState] -
                     before[MemCategory::OptimizerState];
        for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len))
            if (row.category == MemCategory::OptimizerState) {
                EXPECT_EQ(*opt_bytes, row.bytes) << row.formula;
            }
        return s;
    };
    RunConfig c = lora_run(test::temp_dir("lora_gpu_bw_m"), 10, "cuda", "bf16", "nf4");
    std::size_t with_master = 0, without = 0;
    const TrainSummary a = run(c, &with_master);
    RunConfig n = c;
    n.io.out_dir = test::temp_dir("lora_gpu_bw_n");
    n.optim.master = "none";
    const TrainSummary b = run(n, &without);
    const std::size_t adapters = make_lora_layout(c.model, c.lora).params.total;
    EXPECT_EQ(with_master - without, 4 * adapters);
    ASSERT_EQ(b.losses.size(), a.losses.size());
    for (std::size_t i = 0; i < a.losses.size(); i++)
        EXPECT_NEAR(b.losses[i], a.losses[i], 0.02 * std::fabs(a.losses[i])) << i;
    EXPECT_NE(b.losses, a.losses);
    RunConfig r = n;
    r.io.out_dir = test::temp_dir("lora_gpu_bw_r");
    TrainSummary resumed;
    test::train_stop_and_resume(r, 4, resumed);
    ASSERT_EQ(resumed.losses.size(), 6u);
    for (int i = 0; i < 6; i++) EXPECT_EQ(resumed.losses[i], b.losses[4 + i]) << i;
}

TEST(CudaLora, DeviceMemoryIsWhatTheEnginePredicts) {
    REQUIRE_GPU();
    for (const char* base : {"fp32", "nf4", "int8"}) {
        SCOPED_TRACE(base);
        auto d = test::temp_dir(std::string("lora_gpu_mem_") + base);
        RunConfig c = lora_run(d, 2, "cuda", "bf16", base);
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, quiet());
        t.run();
        const MemoryStats after = device_memory().snapshot();
        auto grew = [&](MemCategory cat) { return after[cat] - before[cat]; };
        for (const auto& row : t.engine().predicted_memory(c.micro_batch(), c.train.seq_len)) {
            SCOPED_TRACE(category_name(row.category));
            if (row.category == MemCategory::Workspace)
                EXPECT_LE(grew(row.category), row.bytes);  // process-wide scratch may exist
            else
                EXPECT_EQ(grew(row.category), row.bytes);
        }
        // Only the adapters have gradients and optimizer state.
        const std::size_t adapters = make_lora_layout(c.model, c.lora).params.total;
        EXPECT_EQ(grew(MemCategory::Gradients), 2 * adapters);
        EXPECT_LT(grew(MemCategory::OptimizerState), 12 * adapters + 4096);
    }
}

// The plan prices LoRA and QLoRA on the GPU before the engine exists (engine/device_memory.h):
// the engine allocates exactly the plan's rows (the Trainer checks that its own rows are the
// plan's), and a base too large for the device is refused before anything is allocated.
TEST(CudaLora, ThePlanPredictsTheDeviceMemoryAndRefusesWhatDoesNotFit) {
    REQUIRE_GPU();
    dist::LocalCommunicator one;
    for (const char* base : {"fp32", "nf4"}) {
        SCOPED_TRACE(base);
        auto d = test::temp_dir(std::string("lora_gpu_plan_") + base);
        RunConfig c = lora_run(d, 2, "cuda", "bf16", base);
        const RunPlan plan = test::plan_of(c, one);
        ASSERT_EQ(plan.engine, EngineKind::CudaLora);
        ASSERT_EQ(plan.memory.size(), 5u);
        const MemoryStats before = device_memory().snapshot();
        Trainer t(c, quiet());
        t.run();
        const MemoryStats after = device_memory().snapshot();
        for (const MemoryPrediction& row : plan.memory) {
            SCOPED_TRACE(std::string(category_name(row.category)) + ": " + row.formula);
            if (row.category == MemCategory::Workspace)  // process-wide scratch may exist
                EXPECT_LE(after[row.category] - before[row.category], row.bytes);
            else
                EXPECT_EQ(after[row.category] - before[row.category], row.bytes);
        }
    }
    auto d = test::temp_dir("lora_gpu_too_large");
    const std::string m = test::refused_before_allocating(
        test::too_large_for_device(lora_run(d, 1, "cuda", "bf16")), quiet());
    EXPECT_NE(m.find("lora.base = nf4"), std::string::npos) << m;
}

TEST(CudaLora, UnsupportedCombinationsAreRefused) {
    REQUIRE_GPU();
    auto d = test::temp_dir("lora_gpu_refused");
    auto refused = [&](RunConfig c, const std::string& word) {
        try {
            Trainer t(c, quiet());
            ADD_FAILURE() << "accepted";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(word), std::string::npos) << e.what();
        }
    };
    RunConfig g = lora_run(d, 1, "cuda", "bf16");
    g.train.cuda_graphs = true;
    refused(g, "train.cuda_graphs");
    RunConfig o = lora_run(d, 1, "cuda", "bf16");
    o.train.offload_optimizer = true;
    refused(o, "train.offload_optimizer");
}

#endif  // MEMTRAIN_HAVE_CUDA
