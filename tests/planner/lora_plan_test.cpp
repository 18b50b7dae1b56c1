// LoRA and QLoRA in the planner: adapter counts per target set (the numbers Hugging Face PEFT
// prints for the same models), plans that use a given LoRA everywhere, the fallback from full
// fine-tuning to LoRA and QLoRA when nothing else fits, and host memory that is always checked.
#include <gtest/gtest.h>

#include <string>

#include "core/error.h"
#include "planner/memory_model.h"
#include "planner/report.h"
#include "planner/search.h"

namespace memtrain::plan {

namespace {

ClusterSpec one_node(const std::string& gpu, int gpus) {
    ClusterSpec c;
    c.gpu = gpu_preset(gpu);
    c.gpus = gpus;
    return c;
}

bool contains(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
}

}  // namespace

// r x (fan_in + fan_out) per adapted linear layer. GPT-2 124M: c_attn 768 -> 2304 and c_proj
// 768 -> 768; with `all` also c_fc 768 -> 3072 and mlp.c_proj 3072 -> 768.
TEST(PlanLora, AdapterCountsGpt2) {
    const ModelSpec m = load_model("gpt2");
    ASSERT_FALSE(m.is_llama());
    EXPECT_EQ(lora_params_per_layer(m, 16, LoraTargets::attn), 16 * ((768 + 2304) + (768 + 768)));
    EXPECT_EQ(12 * lora_params_per_layer(m, 16, LoraTargets::attn), 884'736);
    EXPECT_EQ(12 * lora_params_per_layer(m, 16, LoraTargets::all), 2'359'296);
    EXPECT_EQ(12 * lora_params_per_layer(m, 8, LoraTargets::attn), 442'368);
}

// Llama-2-7B: q, k, v, o are 4096 -> 4096 each; gate and up 4096 -> 11008, down 11008 -> 4096.
// Llama-3-8B (GQA): k and v are 4096 -> 8 x 128 = 1024, the MLP 14336 wide.
TEST(PlanLora, AdapterCountsLlama) {
    const ModelSpec l2 = load_model("llama2-7b");
    ASSERT_TRUE(l2.is_llama());
    EXPECT_EQ(lora_params_per_layer(l2, 16, LoraTargets::attn), 16 * 4 * (4096 + 4096));
    EXPECT_EQ(32 * lora_params_per_layer(l2, 16, LoraTargets::attn), 16'777'216);
    EXPECT_EQ(32 * lora_params_per_layer(l2, 16, LoraTargets::all), 39'976'960);
    const ModelSpec l3 = load_model("llama3-8b");
    ASSERT_EQ(l3.kv_dim(), 1024);
    EXPECT_EQ(lora_params_per_layer(l3, 16, LoraTargets::attn),
              16 * (2 * (4096 + 4096) + 2 * (4096 + 1024)));
    EXPECT_EQ(32 * lora_params_per_layer(l3, 16, LoraTargets::attn), 13'631'488);
    EXPECT_EQ(32 * lora_params_per_layer(l3, 16, LoraTargets::all), 41'943'040);
}

TEST(PlanLora, LlamaOneAndItsThirtyBillion) {
    const ModelSpec m = load_model("llama-30b");
    EXPECT_EQ(m.n_layer, 60);
    EXPECT_EQ(m.n_embd, 6656);
    EXPECT_EQ(m.ffn(), 17920);
    EXPECT_NEAR(m.total_params() / 1e9, 32.5, 0.05);
    EXPECT_NEAR(load_model("llama-65b").total_params() / 1e9, 65.3, 0.05);
}

// --lora-rank given: every plan is that LoRA, labelled as such.
TEST(PlanLora, GivenLoraIsUsedInEveryPlan) {
    SearchSpec s;
    s.global_batch = 64;
    s.lora_rank = 8;
    s.frozen_bits = 4;
    s.lora_targets = LoraTargets::all;
    s.lora_fallback = true;  // ignored: the method is given
    const SearchResult r = search_plans(load_model("llama2-7b"), one_node("h100-80gb", 8), s);
    ASSERT_FALSE(r.plans.empty());
    ASSERT_EQ(r.methods.size(), 1u);
    EXPECT_EQ(r.methods[0].name, "QLoRA 4-bit r=8");
    EXPECT_FALSE(r.lora_instead_of_full);
    for (const auto& p : r.plans) {
        EXPECT_EQ(p.run.lora_rank, 8);
        EXPECT_EQ(p.run.frozen_bits, 4);
        EXPECT_EQ(p.run.lora_targets, LoraTargets::all);
        EXPECT_TRUE(contains(describe(p.run), "QLoRA 4-bit r=8 targets=all")) << describe(p.run);
    }
    const std::string text = format_plans(r, 3, 3, one_node("h100-80gb", 8));
    EXPECT_TRUE(contains(text, "LoRA was asked for: these plans are QLoRA 4-bit r=8")) << text;
    EXPECT_TRUE(contains(text, "not the same job")) << text;
    // Without a frozen width, a given rank keeps 16-bit weights: plain LoRA.
    s.frozen_bits = 0;
    EXPECT_EQ(
        search_plans(load_model("gpt2"), one_node("h100-80gb", 1), s).plans[0].run.frozen_bits, 16);
}

// The case: a 30B Llama on one 80 GB GPU of a 128 GB host. Full fine-tuning fits
// neither the GPU (2 + 2 bytes of bf16 weights and gradients per parameter alone are 130 GB)
// nor, offloaded, the host (650 GB); LoRA r=16 with bf16 frozen weights (65 GB) does.
TEST(PlanLora, ThirtyBillionOnOneGpuFallsBackToLora) {
    const ModelSpec m = load_model("llama-30b");
    ClusterSpec c = one_node("h100-80gb", 1);
    c.host_memory_bytes = 128e9;
    SearchSpec s;
    s.global_batch = 64;
    s.seq = 2048;
    s.lora_fallback = true;
    const SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_TRUE(r.lora_instead_of_full);
    for (const auto& p : r.plans) {
        EXPECT_GT(p.run.lora_rank, 0) << describe(p.run);
        EXPECT_LE(p.memory.total, c.gpu.memory_bytes);
        EXPECT_TRUE(host_fits(p.memory, c));
    }
    EXPECT_EQ(r.plans[0].run.lora_rank, 16);
    EXPECT_EQ(r.plans[0].run.frozen_bits, 16);  // the least-compromised method that fits
    ASSERT_EQ(r.methods.size(), 2u);
    EXPECT_EQ(r.methods[0].fitting, 0);
    EXPECT_EQ(r.methods[0].trainable_params, m.total_params());
    EXPECT_EQ(r.methods[1].trainable_params, 60 * 16 * 4 * (6656 + 6656));
    // The first rejection is full-parameter training as a whole, naming the GPU, the host and LoRA.
    ASSERT_FALSE(r.rejected.empty());
    const Rejection& full = r.rejected[0];
    EXPECT_EQ(full.method, "full-parameter training");
    EXPECT_EQ(full.label(), "full-parameter training");
    EXPECT_TRUE(contains(full.reason, "> 80.0 GB")) << full.reason;
    EXPECT_TRUE(contains(full.reason, "host memory per node > 128.0 GB")) << full.reason;
    EXPECT_TRUE(contains(full.reason, "LoRA r=16 fits")) << full.reason;
    // Every full-parameter family is rejected.
    int families = 0;
    for (const auto& rej : r.rejected)
        if (rej.method == "full-parameter training" && !rej.family.empty()) ++families;
    EXPECT_EQ(families, 3);  // ZeRO-0, ZeRO-0 + optimizer offload, ZeRO-3 + param offload
    const std::string text = format_plans(r, 5, 12, c);
    EXPECT_TRUE(contains(text,
                         "full-parameter training does not fit (see rejected), so these plans are "
                         "LoRA r=16"))
        << text;
    EXPECT_TRUE(contains(text, "LoRA r=16 (attn) x 2 B")) << text;  // the memory breakdown
    // Without the fallback nothing fits, and that is all.
    s.lora_fallback = false;
    const SearchResult no = search_plans(m, c, s);
    EXPECT_TRUE(no.plans.empty());
    EXPECT_TRUE(contains(no.rejected[0].reason, "nothing fits")) << no.rejected[0].reason;
    EXPECT_FALSE(contains(no.rejected[0].reason, "LoRA")) << no.rejected[0].reason;
}

// QLoRA's own example: a 65B model on one 48 GB GPU (with a 16 GB host). LoRA over bf16 weights
// (130 GB) and over int8 (65 GB) fit neither the GPU nor, offloaded, the host; 4-bit NF4 with
// double quantization (33 GB of frozen matrices) fits the GPU.
TEST(PlanLora, SixtyFiveBillionOnA48GbGpuNeedsFourBits) {
    const ModelSpec m = load_model("llama-65b");
    ClusterSpec c = one_node("h100-80gb", 1);
    c.gpu.memory_bytes = 48e9;
    c.host_memory_bytes = 16e9;
    SearchSpec s;
    s.global_batch = 16;
    s.lora_fallback = true;
    const SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    ASSERT_EQ(r.methods.size(), 4u);
    EXPECT_EQ(r.methods[3].name, "QLoRA 4-bit r=16");
    for (const auto& p : r.plans) EXPECT_EQ(p.run.frozen_bits, 4);
    EXPECT_TRUE(contains(r.rejected[1].reason, "QLoRA 8-bit r=16 does not fit either"))
        << r.rejected[1].reason;
    EXPECT_TRUE(contains(r.rejected[2].reason, "QLoRA 4-bit r=16 fits")) << r.rejected[2].reason;
    // --frozen-bits 8 without a rank: only that rung of the ladder, which does not fit.
    s.frozen_bits = 8;
    const SearchResult eight = search_plans(m, c, s);
    EXPECT_TRUE(eight.plans.empty());
    ASSERT_EQ(eight.methods.size(), 2u);
    EXPECT_EQ(eight.methods[1].name, "QLoRA 8-bit r=16");
}

// A 70B model on one DGX H100 node (8 x 80 GB, 2 TB of host memory by default): full
// fine-tuning fits only by offloading the optimizer states (18 bytes per parameter, 1.24 TB);
// with a 512 GB host the plans are LoRA.
TEST(PlanLora, SeventyBillionOnOneNodeOffloadsOrUsesLora) {
    const ModelSpec m = load_model("llama2-70b");
    ClusterSpec c = one_node("h100-80gb", 8);
    SearchSpec s;
    s.global_batch = 64;
    s.lora_fallback = true;
    SearchResult r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_FALSE(r.lora_instead_of_full);
    for (const auto& p : r.plans) {
        EXPECT_EQ(p.run.lora_rank, 0);
        EXPECT_NE(p.run.offload, Offload::none) << describe(p.run);
        EXPECT_LE(p.memory.cpu_bytes * 8.0, 2048e9);
    }
    c.host_memory_bytes = 512e9;
    r = search_plans(m, c, s);
    ASSERT_FALSE(r.plans.empty());
    EXPECT_TRUE(r.lora_instead_of_full);
    for (const auto& p : r.plans) EXPECT_EQ(describe_method(p.run), "LoRA r=16");
}

// Host memory is never unlimited: by default the node of the GPU's datasheet system.
TEST(PlanLora, DefaultHostMemoryIsATypicalNodeAndIsEnforced) {
    EXPECT_DOUBLE_EQ(one_node("h100-80gb", 8).host_memory(), 2048e9);
    EXPECT_DOUBLE_EQ(one_node("h200", 8).host_memory(), 2048e9);
    EXPECT_DOUBLE_EQ(one_node("a100-80gb", 8).host_memory(), 2048e9);
    EXPECT_DOUBLE_EQ(one_node("a100-40gb", 8).host_memory(), 1024e9);
    ClusterSpec four = one_node("h100-80gb", 4);
    four.gpus_per_node = 4;  // 256 GB per GPU
    EXPECT_DOUBLE_EQ(four.host_memory(), 1024e9);
    EXPECT_TRUE(contains(gpu_preset("h100-80gb").host_memory_source, "DGX H100"));

    // GPT-2 1.5B on a 20 GB GPU needs ZeRO-Offload; a 1 GB host rejects every offloaded layout.
    ClusterSpec c = one_node("h100-80gb", 1);
    c.gpu.memory_bytes = 20e9;
    SearchSpec s;
    s.global_batch = 8;
    ASSERT_FALSE(search_plans(load_model("gpt2-xl"), c, s).plans.empty());
    c.host_memory_bytes = 1e9;
    const SearchResult r = search_plans(load_model("gpt2-xl"), c, s);
    EXPECT_TRUE(r.plans.empty());
    int host_rejections = 0;
    for (const auto& rej : r.rejected)
        if (contains(rej.reason, "of host memory per node > 1.0 GB")) ++host_rejections;
    EXPECT_GE(host_rejections, 2) << format_plans(r, 0, 20, c);
}

TEST(PlanLora, BadLoraSpecsAreRefused) {
    const ModelSpec m = load_model("gpt2");
    const ClusterSpec c = one_node("h100-80gb", 1);
    SearchSpec s;
    s.frozen_bits = 5;
    s.lora_rank = 8;
    EXPECT_THROW(search_plans(m, c, s), memtrain::Error);
    s.frozen_bits = 4, s.lora_rank = -1;
    EXPECT_THROW(search_plans(m, c, s), memtrain::Error);
    s.lora_rank = 0, s.lora_fallback = false;  // 4-bit weights with nothing to train
    try {
        search_plans(m, c, s);
        FAIL() << "expected an error";
    } catch (const memtrain::Error& e) {
        EXPECT_TRUE(contains(e.what(), "need LoRA")) << e.what();
    }
    ClusterSpec no_host = c;
    no_host.host_memory_bytes = 0;
    EXPECT_THROW(search_plans(m, no_host, {}), memtrain::Error);
    RunSpec r;
    r.frozen_bits = 4;  // estimate: quantized weights without adapters
    EXPECT_THROW(estimate_memory(m, r), memtrain::Error);
}

}  // namespace memtrain::plan
