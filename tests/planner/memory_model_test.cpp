// Hand-worked checks of the memory formulas: ZeRO paper model states (16 bytes per parameter,
// 1.5B GPT-2 -> 24 GB, 16 Psi / N_d under ZeRO-3) and Korthikanti et al.'s activation terms.
#include <gtest/gtest.h>

#include <cstdlib>

#include "core/error.h"
#include "model/gpt.h"
#include "parallel/pipeline/schedule.h"
#include "planner/memory_model.h"
#include "planner/model_shape.h"
#include "planner/report.h"
#include "planner/search.h"

namespace memtrain::plan {

namespace {
RunSpec base_run() {
    RunSpec r;
    r.fragmentation = 0;
    return r;
}
}  // namespace

TEST(PlanParams, Gpt2XlMatchesHandCount) {
    ModelSpec m = load_model("gpt2-xl");
    // per layer 12 h^2 + 13 h = 30,740,800; x48; + wte 50257x1600 + wpe 1024x1600 + ln_f 3200
    EXPECT_EQ(m.layer_params(), 30'740'800);
    EXPECT_EQ(m.total_params(), 1'557'611'200);
}

TEST(PlanParams, Llama2_7bMatchesPublishedCount) {
    EXPECT_EQ(load_model("llama2-7b").total_params(), 6'738'415'616);
}

TEST(PlanMemory, MixedPrecisionAdamIs16BytesPerParam) {
    ModelSpec m = load_model("gpt2-xl");
    MemoryEstimate e = estimate_memory(m, base_run());
    const int64_t psi = m.total_params();
    EXPECT_EQ(e.bytes("parameters"), 2 * psi);
    EXPECT_EQ(e.bytes("gradients"), 2 * psi);
    EXPECT_EQ(e.bytes("optimizer states"), 12 * psi);
    EXPECT_EQ(e.model_states(), 16 * psi);  // 24.9 GB: the lecture's "1.5B -> 24 GB"
    EXPECT_NEAR(e.model_states() / 1e9, 24.9, 0.05);
}

// --runtime prices a peer's state layout and buffers at its defaults (issue 26): torch.amp's fp32
// parameters and gradients, autocast's weight casts and DDP's bucket copy of the gradients;
// DeepSpeed's reduce and all-gather buckets of 5e8 elements and its fp32 gradient shard;
// Megatron's fp32 main_grad. The lecture's example follows: GPT-2 1.5B does not fit a 32 GB GPU
// under PyTorch, and fits as memtrain prices it.
TEST(PlanMemory, RuntimeProfilesPriceThePeersBuffers) {
    const ModelSpec m = load_model("gpt2-xl");
    const int64_t psi = m.total_params();
    RunSpec r = base_run();
    r.dp = 8;
    const MemoryEstimate own = estimate_memory(m, r);
    EXPECT_EQ(own.bytes("runtime buffers"), 0);
    r.runtime = Runtime::pytorch;
    const MemoryEstimate pt = estimate_memory(m, r);
    EXPECT_EQ(pt.bytes("parameters"), 4 * psi);
    EXPECT_EQ(pt.bytes("gradients"), 4 * psi);
    EXPECT_EQ(pt.bytes("optimizer states"), 8 * psi);
    EXPECT_EQ(pt.bytes("runtime buffers"), 2 * psi);   // bf16 weight casts
    EXPECT_EQ(pt.bytes("gradient buckets"), 4 * psi);  // DDP's copy of every gradient
    EXPECT_GT(pt.total, 32e9);
    EXPECT_LT(own.total, 32e9);
    r.runtime = Runtime::deepspeed;
    r.zero = 2;
    const MemoryEstimate ds = estimate_memory(m, r);
    EXPECT_EQ(ds.bytes("gradient buckets"), 1'000'000'000);  // 5e8 bf16 elements
    const int64_t shard = (psi + 7) / 8;
    EXPECT_NEAR((double)ds.bytes("runtime buffers"), 4.0 * psi / 8 + 1e9, 4.0 * 8 + 1);
    EXPECT_LE(std::abs(ds.bytes("gradients") - 2 * shard), 16);
    r.runtime = Runtime::megatron;
    r.zero = 1;
    const MemoryEstimate mg = estimate_memory(m, r);
    EXPECT_EQ(mg.bytes("gradients"), 4 * psi);
    EXPECT_EQ(mg.bytes("gradient buckets"), 0);
    // What each runtime does not run is refused by name.
    auto refused = [&](Runtime rt, int zero, const char* what) {
        RunSpec x = base_run();
        x.dp = 8, x.zero = zero, x.runtime = rt;
        try {
            estimate_memory(m, x);
            ADD_FAILURE() << what;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    refused(Runtime::pytorch, 1, "--runtime pytorch prices DDP");
    refused(Runtime::deepspeed, 0, "--runtime deepspeed prices ZeRO 1-3");
    refused(Runtime::megatron, 2, "--runtime megatron shards the optimizer state at most");
    EXPECT_EQ(parse_runtime("deepspeed"), Runtime::deepspeed);
    EXPECT_THROW(parse_runtime("jax"), Error);
}

// Muon keeps one moment on the blocks' 2-D matrices and AdamW's two elsewhere (issue 30): its
// optimizer row sits between SGD's and AdamW's by the matrices' share of the parameters.
TEST(PlanMemory, MuonKeepsOneMomentOnTheMatrices) {
    const ModelSpec m = load_model("gpt2-xl");
    const int64_t psi = m.total_params();
    const double f = muon_matrix_fraction(m);
    // The blocks' matrices: 12 h^2 per layer of 48, of 1.558B.
    EXPECT_NEAR(f, 48.0 * 12 * 1600 * 1600 / (double)psi, 1e-9);
    RunSpec r = base_run();
    r.precision = Precision::fp32;
    r.optimizer = Optimizer::muon;
    const MemoryEstimate e = estimate_memory(m, r);
    EXPECT_NEAR((double)e.bytes("optimizer states"), 4.0 * (2 - f) * psi, 2.0);
    r.optimizer = Optimizer::adamw;
    EXPECT_LT(e.bytes("optimizer states"), estimate_memory(m, r).bytes("optimizer states"));
    EXPECT_EQ(parse_optimizer("muon"), Optimizer::muon);
    // On a GPU the Newton-Schulz scratch lives for the run: two copies of the largest block
    // matrix (4C x C) and two of its Gram matrix (C x C), fp32, and a norm.
    r.optimizer = Optimizer::muon;
    r.device_optimizer = true;
    const double scratch = 4.0 * 2 * (6400.0 * 1600 + 1600.0 * 1600) + 8;
    EXPECT_EQ(muon_scratch_bytes(m), scratch);
    EXPECT_NEAR((double)estimate_memory(m, r).bytes("optimizer states"),
                (double)e.bytes("optimizer states") + scratch, 2.0);
}

TEST(PlanMemory, ZeroStagesShardOverDp) {
    ModelSpec m = load_model("gpt2-xl");
    const double psi = static_cast<double>(m.total_params());
    RunSpec r = base_run();
    r.dp = 64;
    r.zero = 1;  // 2 + 2 + 12/64
    EXPECT_NEAR(estimate_memory(m, r).model_states(), psi * (4 + 12.0 / 64), 2);
    r.zero = 2;  // 2 + 14/64
    EXPECT_NEAR(estimate_memory(m, r).model_states(), psi * (2 + 14.0 / 64), 2);
    r.zero = 3;  // 16/64
    EXPECT_NEAR(estimate_memory(m, r).model_states(), psi * 16 / 64, 3);
}

TEST(PlanMemory, Fp32AdamWIs4Plus4Plus8) {
    ModelSpec m = load_model("gpt2");
    RunSpec r = base_run();
    r.precision = memtrain::Precision::fp32;
    MemoryEstimate e = estimate_memory(m, r);
    const int64_t psi = m.total_params();
    EXPECT_EQ(e.bytes("parameters"), 4 * psi);
    EXPECT_EQ(e.bytes("gradients"), 4 * psi);
    EXPECT_EQ(e.bytes("optimizer states"), 8 * psi);
}

TEST(PlanMemory, OptimizerAndPrecisionVariants) {
    EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::bf16, true, Optimizer::sgd).optim,
                     8);  // master + momentum
    // 8-bit Adam is the trainer's int8 moments: a byte each plus an fp32 scale per 256.
    EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::bf16, true, Optimizer::adamw8bit).optim,
                     4 + 2 * (1 + 4.0 / 256));
    for (auto [f, moment] : {std::pair{StateFormat::Fp32, 4.0}, std::pair{StateFormat::Bf16, 2.0},
                             std::pair{StateFormat::Int8, 1 + 4.0 / 256},
                             std::pair{StateFormat::Int4, 0.5 + 4.0 / 128}}) {
        EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::bf16, true, Optimizer::adamw, f).optim,
                         4 + 2 * moment);
        EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::fp32, true, Optimizer::sgd, f).optim,
                         moment);
    }
    // bf16 weights without a master (optim.master = "none"): the moments as their format says
    // (`--precision bf16-only` asks for bf16 moments unless --state-format is given).
    EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::bf16, false, Optimizer::adamw).optim, 8);
    EXPECT_DOUBLE_EQ(
        state_bytes(memtrain::Precision::bf16, false, Optimizer::adamw, StateFormat::Bf16).optim,
        4);
    EXPECT_DOUBLE_EQ(state_bytes(memtrain::Precision::fp32, true, Optimizer::sgd).optim, 4);
    // fp32 compute over bf16-stored weights (the CPU engine's optim.master = "none").
    const auto bf16w = state_bytes(memtrain::Precision::fp32, false, Optimizer::adamw);
    EXPECT_DOUBLE_EQ(bf16w.param, 2);
    EXPECT_DOUBLE_EQ(bf16w.grad, 4);
    EXPECT_DOUBLE_EQ(bf16w.optim, 8);
}

// optim.step_in_backward with one micro-batch: the gradients are the largest unit's (with a tied
// embedding, the embedding's beside the largest other unit's), none under ZeRO 2-3; with
// accumulation the two-phase step's.
TEST(PlanMemory, StepInBackwardPricesTheOpenUnitsOnly) {
    ModelSpec m = load_model("gpt2");
    RunSpec r = base_run();
    r.precision = memtrain::Precision::fp32;
    const int64_t psi = m.total_params();
    r.step_in_backward = true;
    const MemoryEstimate e = estimate_memory(m, r);
    // 4 B x (wte + wpe + one block): 186 MB, under half the two-phase step's 4 B x 124M.
    EXPECT_LT(e.bytes("gradients"), 2 * psi);
    EXPECT_GT(e.bytes("gradients"), 4 * (m.vocab_size * (int64_t)m.n_embd));
    r.zero = 2;
    r.dp = 2;
    EXPECT_EQ(estimate_memory(m, r).bytes("gradients"), 0);
    r.zero = 0;
    r.dp = 1;
    r.micro_batches = 2;
    EXPECT_EQ(estimate_memory(m, r).bytes("gradients"), 4 * psi);
}

// ZeRO-Offload as the engine runs it: the bf16 parameters and gradients stay on the GPU (their
// shards from ZeRO-3 / ZeRO-2), the host holds the fp32 master, Adam's moments, fp32 gradients
// and a pinned transfer buffer: 4 + 8 + 4 + 2 = 18 bytes per parameter of the rank's shard.
TEST(PlanMemory, OffloadMovesStatesToHost) {
    ModelSpec m = load_model("gpt2-xl");
    const int64_t psi = m.total_params();
    RunSpec r = base_run();
    r.offload = Offload::optimizer;  // one GPU, ZeRO-0
    MemoryEstimate e = estimate_memory(m, r);
    EXPECT_EQ(e.bytes("optimizer states"), 0);
    EXPECT_EQ(e.bytes("parameters"), 2 * psi);
    EXPECT_EQ(e.bytes("gradients"), 2 * psi);
    EXPECT_EQ(e.cpu_bytes, 18 * psi);
    EXPECT_NE(
        e.lines[2].detail.find("fp32 master 4 + moments 8 + fp32 grads 4 + pinned transfer 2"),
        std::string::npos)
        << e.lines[2].detail;
    // fp32 training has no separate master on the GPU, but the host update keeps one.
    r.precision = memtrain::Precision::fp32;
    EXPECT_EQ(estimate_memory(m, r).cpu_bytes, (4 + 8 + 4 + 4) * psi);
    // 4 ranks under ZeRO-2: the host holds a quarter, the GPU a quarter of the gradients.
    r.precision = memtrain::Precision::bf16;
    r.dp = 4, r.zero = 2;
    e = estimate_memory(m, r);
    EXPECT_EQ(e.cpu_bytes, 18 * ((psi + 3) / 4));
    EXPECT_NEAR((double)e.bytes("gradients"), 2.0 * psi / 4, 2);
    EXPECT_EQ(e.bytes("optimizer states"), 0);
}

// A node's host memory holds the offloaded states of all its GPUs: `memtrain plan` rejects a
// layout whose states exceed it, naming the numbers, and `estimate` says whether it fits.
TEST(PlanMemory, HostMemoryBoundsOffload) {
    ModelSpec m = load_model("gpt2-xl");
    RunSpec r = base_run();
    r.offload = Offload::optimizer;
    const MemoryEstimate e = estimate_memory(m, r);  // 28.0 GB of host memory
    ClusterSpec c;
    c.gpus = c.gpus_per_node = 1;
    EXPECT_TRUE(host_fits(e, c)) << "not given: the GPU's typical node, 256 GB per GPU";
    c.host_memory_bytes = 16e9;  // always checked: there is no unlimited host
    EXPECT_FALSE(host_fits(e, c));
    c.host_memory_bytes = 32e9;
    EXPECT_TRUE(host_fits(e, c));
    EXPECT_NE(format_memory_table(e, &c).find("host: fits in 32.00 GB per node"),
              std::string::npos);
    c.gpus = c.gpus_per_node = 2;  // two GPUs share the node's 32 GB
    EXPECT_FALSE(host_fits(e, c));
    EXPECT_NE(format_memory_table(e, &c).find("host: does NOT fit in 32.00 GB per node"),
              std::string::npos)
        << format_memory_table(e, &c);
}

// Korthikanti et al. 2022, GPT-3 175B layer: s=2048, b=1, h=12288, a=96, t=8.
TEST(PlanActivations, KorthikantiTableForGpt3Layer) {
    ModelSpec m = load_model("gpt3-175b");
    RunSpec r = base_run();
    r.tp = 8, r.seq = 2048, r.micro_batch = 1, r.flash_attention = false;
    const int64_t sbh = 2048LL * 12288;
    // no recompute, no SP: sbh (10 + 24/t + 5as/(ht)) = 23 sbh
    EXPECT_EQ(layer_activation_bytes(m, r).saved, 23 * sbh);
    // SP + selective: 34 sbh / t
    r.sequence_parallel = true;
    r.recompute = Recompute::selective;
    EXPECT_EQ(layer_activation_bytes(m, r).saved, 34 * sbh / 8);
    // full recompute without SP: only the 2sbh layer input
    r.sequence_parallel = false;
    r.recompute = Recompute::full;
    EXPECT_EQ(layer_activation_bytes(m, r).saved, 2 * sbh);
    // no TP, no recompute, no flash: sbh (34 + 5as/h)
    r.tp = 1, r.recompute = Recompute::none;
    EXPECT_EQ(layer_activation_bytes(m, r).saved, sbh * 34 + 5LL * 96 * 2048 * 2048);
    // flash attention drops the s^2 term, keeping a fp32 log-sum-exp per head and token
    r.flash_attention = true;
    EXPECT_EQ(layer_activation_bytes(m, r).saved, sbh * 34 + 4LL * 96 * 2048);
}

TEST(PlanActivations, PipelineMicroBatchesInFlight) {
    ModelSpec m = load_model("gpt3-175b");
    RunSpec r = base_run();
    r.tp = 8, r.pp = 8, r.micro_batches = 16, r.recompute = Recompute::full;
    MemoryEstimate first = estimate_stage_memory(m, r, 0);
    EXPECT_EQ(first.in_flight, 8);  // 1F1B: p micro-batches on the first stage
    EXPECT_EQ(estimate_stage_memory(m, r, 7).in_flight, 1);
    r.schedule = memtrain::pp::Kind::GPipe;
    EXPECT_EQ(estimate_stage_memory(m, r, 0).in_flight, 16);  // GPipe: all m
    EXPECT_EQ(first.layers_on_stage, 12);
}

TEST(PlanMemory, LinesAreSeparateAndSumToTotal) {
    ModelSpec m = load_model("gpt2-xl");
    RunSpec r;
    r.dp = 8, r.zero = 1, r.micro_batch = 4, r.reserve_bytes = 1'000'000'000;
    MemoryEstimate e = estimate_memory(m, r);
    int64_t sum = 0;
    for (const auto& l : e.lines) sum += l.bytes;
    EXPECT_EQ(sum, e.total);
    EXPECT_GT(e.bytes("logits and loss"), 0);
    EXPECT_GT(e.bytes("gradient buckets"), 0);
    EXPECT_GT(e.bytes("fragmentation margin"), 0);
    EXPECT_EQ(e.bytes("runtime reserve"), 1'000'000'000);
    // logits: 4 x 1024 tokens x 50257 vocab x (2 + 4 + 4) bytes
    EXPECT_EQ(e.bytes("logits and loss"), 4LL * 1024 * 50257 * 10);
    EXPECT_FALSE(e.not_included.empty());
}

TEST(PlanMemory, LoraWithFourBitBaseWeights) {
    ModelSpec m = load_model("llama2-7b");
    RunSpec r = base_run();
    r.lora_rank = 16;
    r.frozen_bits = 4;
    MemoryEstimate e = estimate_memory(m, r);
    // Frozen matrices in NF4 with double-quantized scales (4.127 bits), the embedding, head and
    // norms in bf16: well under the 2 bytes/param of bf16 weights.
    const int64_t h = 4096, f = 11008, v = 32000;
    const int64_t matrices = 32LL * (4 * h * h + 3 * h * f), rest = m.total_params() - matrices;
    // Adapters on q, k, v, o (the default targets): 16 x (h + h) each, 32 layers.
    const int64_t lora = 32LL * 16 * 4 * (h + h);
    EXPECT_EQ(rest, 2 * v * h + 65 * h);
    const double nf4_dq_bits = 4 + 8.0 / 64 + 32.0 / (64 * 256);  // 4.127
    EXPECT_NEAR((double)e.bytes("parameters"), matrices * nf4_dq_bits / 8 + (rest + lora) * 2.0, 1);
    EXPECT_EQ(e.bytes("gradients"), 2 * lora);
    EXPECT_EQ(e.bytes("optimizer states"), 12 * lora);
    // On every linear layer: + gate, up, down, 16 x (h + f) each.
    r.lora_targets = LoraTargets::all;
    EXPECT_EQ(estimate_memory(m, r).bytes("gradients"), 2 * (lora + 32LL * 16 * 3 * (h + f)));
    // 8 bits: one byte per frozen matrix weight; 16: bf16.
    r.lora_targets = LoraTargets::attn, r.frozen_bits = 8;
    EXPECT_EQ(estimate_memory(m, r).bytes("parameters"), matrices + (rest + lora) * 2);
    r.frozen_bits = 16;
    EXPECT_EQ(estimate_memory(m, r).bytes("parameters"), (matrices + rest + lora) * 2);
}

TEST(PlanErrors, BadLayoutsExplainThemselves) {
    ModelSpec m = load_model("gpt2-xl");  // 25 heads
    RunSpec r;
    r.tp = 2;
    try {
        estimate_memory(m, r);
        FAIL() << "expected an error";
    } catch (const memtrain::Error& e) {
        EXPECT_NE(std::string(e.what()).find("does not divide the 25 attention heads"),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("1, 5, 25"), std::string::npos) << e.what();
    }
    r.tp = 1, r.pp = 49;
    EXPECT_THROW(estimate_memory(m, r), memtrain::Error);
    r.pp = 1, r.zero = 4;
    EXPECT_THROW(estimate_memory(m, r), memtrain::Error);
    // Offloading the optimizer of several ranks needs their shards (one GPU needs none).
    r.zero = 0, r.offload = Offload::optimizer, r.dp = 2;
    try {
        estimate_memory(m, r);
        FAIL() << "expected an error";
    } catch (const memtrain::Error& e) {
        EXPECT_NE(std::string(e.what()).find("dp=2 needs ZeRO >= 1"), std::string::npos)
            << e.what();
    }
    r.dp = 1;
    EXPECT_NO_THROW(estimate_memory(m, r));
}

// ZB-H1 (memtrain estimate --pp P --schedule zb-h1): the output gradients each stage keeps for
// its deferred weight-gradient pass are exactly what the CPU executor allocates per slot
// (GPT::split_backward_bytes) times the micro-batches its list holds until W, with or without
// recomputation.
TEST(PlanMemory, ZeroBubbleWGradientsAreTheExecutorsBytes) {
    using namespace memtrain;
    ModelConfig cfg;
    cfg.n_layer = 4;
    cfg.n_head = 4;
    cfg.n_embd = 64;
    cfg.block_size = 32;
    cfg.vocab_size = 100;
    for (bool llama : {false, true}) {
        if (llama) {
            cfg.norm = "rmsnorm";
            cfg.activation = "swiglu";
            cfg.positions = "rope";
            cfg.n_kv_head = 2;
        }
        plan::RunSpec r;
        r.precision = memtrain::Precision::fp32;
        r.pp = 2;
        r.schedule = memtrain::pp::Kind::ZbH1;
        r.micro_batch = 2;
        r.seq = 32;
        r.micro_batches = 6;
        const plan::ModelSpec spec = plan::model_from_config(cfg);
        for (int stage = 0; stage < 2; stage++) {
            const auto est = plan::estimate_stage_memory(spec, r, stage);
            GPT stage_model(cfg, nullptr, 2 * stage, 2 * stage + 2);
            stage_model.set_split_backward(true);
            const double slots = pp::uniform_in_flight(memtrain::pp::Kind::ZbH1, 2, 6)[stage];
            EXPECT_EQ((double)est.bytes("zero-bubble W gradients"),
                      slots * (double)stage_model.split_backward_bytes(2, 32))
                << "stage " << stage << (llama ? " llama" : " gpt2");
        }
        r.schedule = memtrain::pp::Kind::OneFOneB;
        EXPECT_EQ(plan::estimate_memory(spec, r).bytes("zero-bubble W gradients"), 0);
    }
    // With recompute the W gradients are the same bytes (W recomputes the dropped inputs).
    plan::RunSpec full;
    full.pp = 2;
    full.schedule = memtrain::pp::Kind::ZbH1;
    full.recompute = plan::Recompute::full;
    EXPECT_NO_THROW(plan::validate_run(plan::model_from_config(cfg), full));
}

}  // namespace memtrain::plan
