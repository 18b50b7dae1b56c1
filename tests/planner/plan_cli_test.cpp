// `memtrain estimate | plan | scale` through the binary: impossible numbers and unsupported
// model configs are refused with one line naming the flag (or model_type) and exit code 1, and
// a config.json directory counts the parameters its tensors have.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "config/run_config.h"
#include "model/param_layout.h"
#include "planner/model_shape.h"
#include "test_util.h"
#include "train/trainer.h"
#include "train/validate.h"

namespace {

using Outcome = memtrain::test::CliResult;
using memtrain::test::read_file;
using memtrain::test::write_file;

Outcome memtrain_cli(const std::string& args) {
    return memtrain::test::run_memtrain(args);
}

// Exit code 1 and a single line holding every piece of `expect`.
void expect_refusal(const std::string& args, const std::vector<std::string>& expect) {
    const Outcome o = memtrain_cli(args);
    EXPECT_EQ(o.code, 1) << args << "\n" << o.output;
    EXPECT_EQ(std::count(o.output.begin(), o.output.end(), '\n'), 1) << args << "\n" << o.output;
    for (const auto& e : expect)
        EXPECT_NE(o.output.find(e), std::string::npos) << args << "\n" << o.output;
}

}  // namespace

TEST(PlanCli, RefusesImpossibleNumbersNamingTheFlag) {
    struct Case {
        std::string args;
        std::vector<std::string> expect;
    };
    const Case cases[] = {
        {"estimate gpt2 --gpu-mem-gb -80", {"--gpu-mem-gb", "-80"}},
        {"estimate gpt2 --gpu-mem-gb 0", {"--gpu-mem-gb", "0"}},
        {"estimate gpt2 --gpu-tflops 0", {"--gpu-tflops", "positive"}},
        {"estimate gpt2 --hbm-bw-gbs -1", {"--hbm-bw-gbs", "-1"}},
        {"estimate gpt2 --intra-bw-gbs 0", {"--intra-bw-gbs"}},
        {"estimate gpt2 --efficiency 1.5", {"--efficiency", "1.5", "(0, 1]"}},
        {"estimate gpt2 --efficiency 0", {"--efficiency", "(0, 1]"}},
        {"estimate gpt2 --host-mem-gb -2", {"--host-mem-gb", "-2"}},
        {"estimate gpt2 --dp 0", {"--dp", "0"}},
        {"estimate gpt2 --tp -2", {"--tp", "-2"}},
        {"estimate gpt2 --micro-batch 0", {"--micro-batch", "0"}},
        {"estimate gpt2 --global-batch -8", {"--global-batch", "-8"}},
        {"estimate gpt2 --seq 0", {"--seq", "0"}},
        {"estimate gpt2 --zero 4", {"--zero", "4"}},
        {"estimate gpt2 --gpus-per-node 0", {"--gpus-per-node", "0"}},
        {"plan gpt2 --gpus 0", {"--gpus", "0"}},
        {"plan gpt2 --gpus -8", {"--gpus", "-8"}},
        {"plan gpt2 --nodes 0", {"--nodes", "0"}},
        {"plan gpt2 --gpus 8 --global-batch 0", {"--global-batch", "0"}},
        {"plan gpt2 --gpus 8 --seq -1", {"--seq", "-1"}},
        {"plan gpt2 --gpus 8 --inter-bw-gbs -3", {"--inter-bw-gbs", "-3"}},
        {"plan gpt2 --gpus 8 --efficiency 2", {"--efficiency", "2"}},
        {"scale --flops -1e21", {"--flops", "-1e+21"}},
        {"scale --flops 1e21 --mfu 0", {"--mfu", "0"}},
        {"scale --flops 1e21 --mfu 1.2", {"--mfu", "1.2"}},
        {"scale --gpus 0 --days 3", {"--gpus", "0"}},
        {"scale --gpus 8 --days -1", {"--days", "-1"}},
        {"scale --flops 1e21 --gpu-mem-gb -1", {"--gpu-mem-gb", "-1"}},
        {"plan gpt2 --gpus 1 --host-mem-gb 0", {"--host-mem-gb", "0"}},
        {"plan gpt2 --gpus 1 --frozen-bits 5", {"--frozen-bits", "16, 8 or 4", "5"}},
        {"plan gpt2 --gpus 1 --lora-rank -1", {"--lora-rank", "-1"}},
        {"plan gpt2 --gpus 1 --lora-rank 0", {"--lora-rank", "at least 1", "0"}},
        {"plan gpt2 --gpus 1 --lora-targets mlp", {"--lora-targets", "attn", "all", "mlp"}},
        {"plan gpt2 --gpus 1 --no-lora --frozen-bits 4", {"--frozen-bits 4", "--no-lora"}},
        {"plan gpt2 --gpus 1 --no-lora --lora-rank 8", {"--lora-rank 8", "--no-lora"}},
        {"estimate gpt2 --frozen-bits 5 --lora-rank 8", {"--frozen-bits", "5"}},
        {"estimate gpt2 --frozen-bits 4", {"--frozen-bits 4", "--lora-rank"}},
        {"estimate gpt2 --lora-rank -1", {"--lora-rank", "-1"}},
        {"estimate gpt2 --lora-targets all", {"--lora-targets", "--lora-rank"}},
        {"estimate gpt2 --state-format int9", {"--state-format", "int9", "int8"}},
        {"plan gpt2 --gpus 1 --state-format fp8", {"--state-format", "fp8"}},
    };
    for (const auto& c : cases) expect_refusal(c.args, c.expect);
}

TEST(PlanCli, CustomGpuNeedsItsNumbers) {
    expect_refusal("estimate gpt2 --gpu custom",
                   {"--gpu custom", "--gpu-mem-gb", "--gpu-tflops", "--hbm-bw-gbs"});
    // Only the missing ones are named; several GPUs also need the NVLink bandwidth, several
    // nodes the network's, offload PCIe's.
    const std::string some = "--gpu custom --gpu-mem-gb 24 --gpu-tflops 165 --hbm-bw-gbs 1000";
    Outcome o = memtrain_cli("estimate gpt2 " + some);
    EXPECT_EQ(o.code, 0) << o.output;
    EXPECT_NE(o.output.find("GPU custom"), std::string::npos) << o.output;
    o = memtrain_cli("estimate gpt2 " + some + " --dp 2");
    EXPECT_EQ(o.code, 1) << o.output;
    EXPECT_NE(o.output.find("--intra-bw-gbs"), std::string::npos) << o.output;
    EXPECT_EQ(o.output.find("--gpu-mem-gb"), std::string::npos) << o.output;
    EXPECT_EQ(o.output.find("--inter-bw-gbs"), std::string::npos) << o.output;
    expect_refusal("plan gpt2 --gpus 16 --gpus-per-node 8 " + some,
                   {"--intra-bw-gbs", "--inter-bw-gbs", "--pcie-bw-gbs", "--host-mem-gb"});
    expect_refusal("estimate gpt2 --precision fp32 " + some, {"--gpu-fp32-tflops"});
    o = memtrain_cli("plan gpt2 --gpus 16 --no-offload " + some +
                     " --intra-bw-gbs 300 --inter-bw-gbs 25");
    EXPECT_EQ(o.code, 0) << o.output;
}

TEST(PlanCli, UnsupportedArchitecturesAreRefused) {
    const auto dir = memtrain::test::temp_dir("plan_cli_arch");
    write_file(dir + "/mixtral.json",
               R"({"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32,
                   "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2})");
    expect_refusal("estimate " + dir + "/mixtral.json",
                   {"mixtral.json", "model_type \"mixtral\"", "mixture-of-experts",
                    "gpt2, llama, mistral, memtrain-llama-style"});
    write_file(dir + "/bert.json",
               R"({"model_type": "bert", "hidden_size": 768, "num_attention_heads": 12,
                   "num_hidden_layers": 12, "intermediate_size": 3072, "vocab_size": 30522})");
    expect_refusal("plan " + dir + "/bert.json --gpus 8",
                   {"model_type \"bert\" is not supported", "gpt2, llama"});
}

TEST(PlanCli, CheckpointConfigDirectoryCountsItsTensors) {
    // A Llama checkpoint's config.json, read through its directory as `memtrain estimate` is
    // given one: 2 layers, width 64, 8 heads of which 2 KV heads, SwiGLU 176, untied.
    const auto dir = memtrain::test::temp_dir("plan_cli_ckpt");
    write_file(dir + "/config.json",
               R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 64, "intermediate_size": 176, "num_attention_heads": 8,
                   "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 300,
                   "max_position_embeddings": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                   "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false})");
    const Outcome o = memtrain_cli("estimate " + dir + " --json");
    ASSERT_EQ(o.code, 0) << o.output;
    const auto j = nlohmann::json::parse(o.output);
    // embed 300x64, per layer q 64x64 + k,v 16x64 + o 64x64 + 3 x 176x64 + 2 norms, norm, head.
    const int64_t layer = 64 * 64 + 2 * 16 * 64 + 64 * 64 + 3 * 176 * 64 + 2 * 64;
    EXPECT_EQ(j["params"].get<int64_t>(), 300 * 64 + 2 * layer + 64 + 300 * 64);
}

// Host memory is stated and always checked: the GPU preset's typical node unless given.
TEST(PlanCli, HostMemoryIsStated) {
    Outcome o = memtrain_cli("plan gpt2 --gpus 8 --global-batch 64 --top 1");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_NE(o.output.find("host memory: 2048 GB per node (default for h100-80gb, as in a DGX "
                            "H100: 2048 GB for 8 GPUs; --host-mem-gb to change)"),
              std::string::npos)
        << o.output;
    o = memtrain_cli("plan gpt2 --gpus 8 --global-batch 64 --top 1 --gpu a100-40gb");
    EXPECT_NE(o.output.find("host memory: 1024 GB per node (default for a100-40gb"),
              std::string::npos)
        << o.output;
    o = memtrain_cli("plan gpt2 --gpus 8 --global-batch 64 --top 1 --host-mem-gb 512 --json");
    ASSERT_EQ(o.code, 0) << o.output;
    const auto j = nlohmann::json::parse(o.output);
    EXPECT_EQ(j["host_memory_bytes"].get<double>(), 512e9);
    EXPECT_FALSE(j["host_memory_default"].get<bool>());
    // gpt2-xl on a 20 GB GPU needs ZeRO-Offload: a 1 GB host refuses it.
    o = memtrain_cli("estimate gpt2-xl --gpu-mem-gb 20 --offload optimizer --host-mem-gb 1");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_NE(o.output.find("host: does NOT fit in 1.00 GB per node"), std::string::npos)
        << o.output;
}

// The issue's example through the binary: fine-tuning a 30B Llama on one 80 GB GPU of a
// 128 GB host. Full fine-tuning fits nowhere, so the plans are LoRA, said as much, with the
// memory breakdown, and the rejected list starts with full-parameter training naming LoRA.
TEST(PlanCli, ThirtyBillionOnOneGpuProposesLora) {
    Outcome o = memtrain_cli("plan llama-30b --gpus 1 --host-mem-gb 128 --global-batch 64");
    ASSERT_EQ(o.code, 0) << o.output;
    for (const char* part :
         {"llama-30b: 32.529B parameters on 1 x h100-80gb (80 GB)",
          "host memory: 128 GB per node (--host-mem-gb)",
          "full-parameter training does not fit (see rejected), so these plans are LoRA r=16",
          "not the same job as training every weight", "  1 LoRA r=16 ",
          "best plan, per-GPU memory:", "LoRA r=16 (attn) x 2 B",
          "rejected:\n  full-parameter training: nothing fits: without offload"})
        EXPECT_NE(o.output.find(part), std::string::npos) << part << "\n" << o.output;
    EXPECT_NE(o.output.find("; LoRA r=16 fits\n"), std::string::npos) << o.output;
    o = memtrain_cli(
        "plan llama-30b --gpus 1 --host-mem-gb 128 --global-batch 64 --top 100 --json");
    ASSERT_EQ(o.code, 0) << o.output;
    const auto j = nlohmann::json::parse(o.output);
    EXPECT_TRUE(j["lora_instead_of_full"].get<bool>());
    ASSERT_FALSE(j["plans"].empty());
    for (const auto& p : j["plans"]) {
        EXPECT_EQ(p["method"], "LoRA r=16");
        EXPECT_EQ(p["lora_targets"], "attn");
        EXPECT_LE(p["memory"]["total_bytes"].get<double>(), 80e9);
    }
    // --no-lora: nothing fits; the command still explains why, and exits 1 so a script knows.
    o = memtrain_cli("plan llama-30b --gpus 1 --host-mem-gb 128 --global-batch 64 --no-lora");
    EXPECT_EQ(o.code, 1) << o.output;
    EXPECT_NE(o.output.find("no layout fits in 80.00 GB per GPU"), std::string::npos) << o.output;
    EXPECT_NE(
        o.output.find("memtrain: no layout of llama-30b that the trainer runs fits 1 x h100-80gb "
                      "(exit 1)"),
        std::string::npos)
        << o.output;
    EXPECT_EQ(o.output.find("LoRA"), std::string::npos) << o.output;
    o = memtrain_cli(
        "plan llama-30b --gpus 1 --host-mem-gb 128 --global-batch 64 --no-lora --json");
    EXPECT_EQ(o.code, 1) << o.output;
    EXPECT_TRUE(nlohmann::json::parse(o.output)["plans"].empty());
}

// `scale` takes the budget as FLOPs or as GPU-days, not both.
TEST(PlanCli, ScaleRefusesTwoBudgets) {
    expect_refusal("scale --flops 1e23 --gpus 8 --days 3",
                   {"--flops 1e+23 and --days 3 both set the compute budget"});
    const Outcome o = memtrain_cli("scale --flops 1e21");
    EXPECT_EQ(o.code, 0) << o.output;
}

// `memtrain plan --emit-config` on two GPUs small enough that the best plan shards with ZeRO: the
// file carries the layout as the trainer's keys (zero stage, precision, offload, tp, pp,
// micro-batch) and validates at the plan's world size. (Training it: PlanGrid.* under mpirun.)
namespace {

// `memtrain plan --emit-config` of a small model on two GPUs of `gpu_gb` each (fp32, 8 x 16
// tokens per step) into `dir`: the command's output and the emitted file, as text and as the
// trainer's config on the CPU.
struct Emitted {
    Outcome run;
    std::string text;
    memtrain::RunConfig config;
};
Emitted emit_plan(const std::string& dir, const char* gpu_gb, int global_batch = 8) {
    write_file(dir + "/m.toml",
               "[model]\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 50\n"
               "vocab_pad = 16\n");
    const std::string out = dir + "/plan.toml";
    Emitted e;
    e.run = memtrain_cli("plan " + dir + "/m.toml --gpus 2 --gpu-mem-gb " + gpu_gb +
                         " --reserve-gb 0 --precision fp32 --no-flash --global-batch " +
                         std::to_string(global_batch) +
                         " --seq 16 --no-offload --no-lora --emit-config " + out);
    if (e.run.code != 0) return e;
    e.config = memtrain::load_run_config(out, {"train.device=cpu"});
    std::ifstream f(out);
    e.text.assign((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    return e;
}

}  // namespace

TEST(PlanCli, EmittedConfigCarriesTheLayout) {
    // 32 sequences: micro-batches of 256 tokens fill the GEMMs' tiles, so data parallelism
    // (sharded: the 2 MB do not hold replicas) beats a pipeline's bubble.
    const Emitted e = emit_plan(memtrain::test::temp_dir("plan_cli_emit"), "0.002", 32);
    const Outcome& o = e.run;
    ASSERT_EQ(o.code, 0) << o.output;
    memtrain::RunConfig c = e.config;
    EXPECT_GT(c.train.zero_stage, 0) << o.output;
    EXPECT_EQ(c.train.precision, "fp32");
    EXPECT_EQ(c.train.tp, 1);
    EXPECT_EQ(c.train.pp, 1);
    EXPECT_FALSE(c.train.offload_optimizer);
    EXPECT_EQ(c.train.batch_size, 32);
    EXPECT_EQ(c.train.seq_len, 16);
    EXPECT_GT(c.train.micro_batch_size, 0);
    EXPECT_EQ(c.model.n_layer, 4);
    c.world = 2;
    EXPECT_NO_THROW(validate_config(c));
    // The header says how to launch it.
    const std::string& text = e.text;
    EXPECT_NE(text.find("mpirun -np 2"), std::string::npos) << text;
    EXPECT_NE(text.find("zero_stage = "), std::string::npos) << text;
}

// With less memory the best plan on two GPUs splits the model (tp = 2), and the search turns
// sequence parallelism on with it: the file carries train.sequence_parallel, and the trainer
// accepts the layout at the plan's world size. (Training it:
// PlanGrid.EmittedConfigTrainsAsPlanned.)
TEST(PlanCli, EmittedConfigCarriesSequenceParallelism) {
    const Emitted e = emit_plan(memtrain::test::temp_dir("plan_cli_emit_sp"), "0.0008");
    const Outcome& o = e.run;
    ASSERT_EQ(o.code, 0) << o.output;
    memtrain::RunConfig c = e.config;
    EXPECT_EQ(c.train.tp, 2) << o.output;
    EXPECT_TRUE(c.train.sequence_parallel) << o.output;
    c.world = 2;
    EXPECT_NO_THROW(validate_config(c));
    const std::string& text = e.text;
    EXPECT_NE(text.find("sequence_parallel = true"), std::string::npos) << text;
    EXPECT_EQ(text.find("not built"), std::string::npos) << text;
}

// `memtrain estimate` says whether a layout was priced by the engines' layout functions (a model
// the trainer expresses, a layout it runs, the tp x pp mesh and sequence parallelism included) or
// by the formulas (GPT-2's dropout masks).
TEST(PlanCli, EstimateSaysWhereItsNumbersComeFrom) {
    const auto dir = memtrain::test::temp_dir("plan_cli_source");
    write_file(dir + "/m.toml", "[model]\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\n");
    const std::string engine = "priced by the engines' layout functions";
    const std::string formulas = "priced by the formulas";
    for (const char* layout :
         {"", " --tp 2", " --pp 2", " --dp 2 --zero 3", " --tp 2 --pp 2",
          " --tp 2 --sequence-parallel", " --tp 2 --pp 2 --sequence-parallel"}) {
        const Outcome o = memtrain_cli("estimate " + dir + "/m.toml" + layout);
        ASSERT_EQ(o.code, 0) << layout << "\n" << o.output;
        EXPECT_NE(o.output.find(engine), std::string::npos) << layout << "\n" << o.output;
    }
    for (const std::string& args : {std::string("gpt2"), std::string("gpt2 --tp 2 --pp 2")}) {
        const Outcome o = memtrain_cli("estimate " + args);
        ASSERT_EQ(o.code, 0) << args << "\n" << o.output;
        EXPECT_NE(o.output.find(formulas), std::string::npos) << args << "\n" << o.output;
    }
}

// The presets a user outside DGX racks has (issue 26): every one plans, a card without NVLink
// talks over PCIe, and Volta, which has no bf16, plans fp16 unless bf16 is asked for by name.
TEST(PlanCli, EveryGpuPresetPlansAndVoltaHasNoBf16) {
    for (const char* gpu : {"v100-16gb", "v100-32gb", "a10g", "l4", "l40s", "rtx-4090", "mi300x"}) {
        const Outcome o = memtrain_cli(std::string("estimate gpt2 --dp 2 --json --gpu ") + gpu);
        ASSERT_EQ(o.code, 0) << gpu << "\n" << o.output;
        const auto j = nlohmann::json::parse(o.output);
        EXPECT_GT(j["tokens_per_s"].get<double>(), 0) << gpu;
    }
    Outcome o = memtrain_cli("plan gpt2 --gpus 8 --global-batch 64 --top 1 --gpu v100-32gb");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_NE(o.output.find("precision: fp16 with loss scaling (v100-32gb has no bf16 tensor "
                            "cores; --precision to change)"),
              std::string::npos)
        << o.output;
    o = memtrain_cli("estimate gpt2 --gpu v100-16gb --json");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_EQ(nlohmann::json::parse(o.output)["precision"], "fp16");
    expect_refusal("plan gpt2 --gpus 8 --gpu v100-32gb --precision bf16",
                   {"--precision bf16", "v100-32gb has no bf16", "fp16"});
    expect_refusal("estimate gpt2 --gpu v100-32gb --precision bf16-only",
                   {"--precision bf16-only", "no bf16"});
    o = memtrain_cli("estimate gpt2 --gpu v100-32gb --precision fp32");
    EXPECT_EQ(o.code, 0) << o.output;
    // A Volta host holds 512 GB for 8 GPUs, an AWS g6e (8 x L40S) 1536.
    o = memtrain_cli("plan gpt2 --gpus 8 --global-batch 64 --top 1 --gpu l40s");
    EXPECT_NE(o.output.find("1536 GB per node (default for l40s, as in a AWS g6e.48xlarge"),
              std::string::npos)
        << o.output;
    // A model wide enough to fill the GPUs is faster on an H100 than on an L4, and slower than on
    // an MI300X (GPT-2 124M's GEMMs leave most of an MI300X's 304 CUs idle).
    auto tps = [](const char* gpu) {
        const Outcome r =
            memtrain_cli(std::string("estimate llama3-8b --micro-batch 4 --json --gpu ") + gpu);
        return nlohmann::json::parse(r.output)["tokens_per_s"].get<double>();
    };
    EXPECT_LT(tps("l4"), tps("h100-80gb"));
    EXPECT_LT(tps("h100-80gb"), tps("mi300x"));
}

// --emit-config writes exactly the planned model, every key of it, and the source config's
// optimizer, data and io sections; a preset's model keys are its own (Llama 3's rope_theta and
// GQA) (issue 26).
TEST(PlanCli, EmittedConfigIsTheWholeSourceConfig) {
    const auto dir = memtrain::test::temp_dir("plan_cli_emit_whole");
    write_file(dir + "/m.toml",
               "[model]\nn_layer = 4\nn_head = 4\nn_kv_head = 2\nn_embd = 32\nblock_size = 16\n"
               "vocab_size = 50\nvocab_pad = 16\nffn_hidden = 96\nnorm = \"rmsnorm\"\n"
               "activation = \"swiglu\"\npositions = \"rope\"\ntied_embeddings = false\n"
               "bias = false\nnorm_eps = 1e-6\nrope_theta = 50000.0\ninit_std = 0.01\n"
               "[optim]\nlr = 0.0042\nweight_decay = 0.03\nwarmup_steps = 7\n"
               "[data]\ntrain = \"shards/train.bin\"\nval = \"shards/val.bin\"\n"
               "[io]\nout_dir = \"runs/a\"\ncheckpoint_every = 9\nkeep_last = 3\n");
    const std::string out = dir + "/plan.toml";
    const Outcome o = memtrain_cli("plan " + dir +
                                   "/m.toml --gpus 2 --gpu-mem-gb 0.002 --reserve-gb 0 --precision "
                                   "fp32 --no-flash --global-batch 8 --seq 16 --no-offload "
                                   "--no-lora --emit-config " +
                                   out);
    ASSERT_EQ(o.code, 0) << o.output;
    const memtrain::RunConfig src = memtrain::read_run_config(dir + "/m.toml", {});
    const memtrain::RunConfig got = memtrain::read_run_config(out, {});
    const memtrain::ModelConfig &a = src.model, &b = got.model;
    EXPECT_EQ(b.n_layer, a.n_layer);
    EXPECT_EQ(b.n_head, a.n_head);
    EXPECT_EQ(b.n_kv_head, 2);
    EXPECT_EQ(b.n_embd, a.n_embd);
    EXPECT_EQ(b.block_size, a.block_size);
    EXPECT_EQ(b.vocab_size, 50);
    EXPECT_EQ(b.vocab_pad, 16);
    EXPECT_EQ(b.ffn_hidden, 96);
    EXPECT_EQ(b.norm, "rmsnorm");
    EXPECT_EQ(b.activation, "swiglu");
    EXPECT_EQ(b.positions, "rope");
    EXPECT_FALSE(b.tied_embeddings);
    EXPECT_FALSE(b.bias);
    EXPECT_EQ(b.norm_eps, 1e-6);
    EXPECT_EQ(b.rope_theta, 50000.0);
    EXPECT_EQ(b.init_std, 0.01);
    EXPECT_EQ(got.optim.lr, 0.0042);
    EXPECT_EQ(got.optim.weight_decay, 0.03);
    EXPECT_EQ(got.optim.warmup_steps, 7);
    // Paths are the source's files, wherever the emitted config is read from.
    EXPECT_EQ(got.data.train, src.data.train);
    EXPECT_EQ(got.data.val, src.data.val);
    EXPECT_EQ(got.io.out_dir, src.io.out_dir);
    EXPECT_EQ(got.io.checkpoint_every, 9);
    EXPECT_EQ(got.io.keep_last, 3);
    // The planner priced the model the file holds (no biases, the SwiGLU width): the same
    // parameters as the trainer allocates for it.
    const auto e = memtrain_cli("estimate " + dir + "/m.toml --json");
    ASSERT_EQ(e.code, 0) << e.output;
    EXPECT_EQ(nlohmann::json::parse(e.output)["params"].get<int64_t>(),
              (int64_t)memtrain::make_param_layout(a).total);

    // A preset: Llama 3 8B's own keys.
    const Outcome l =
        memtrain_cli("plan llama3-8b --gpus 8 --top 1 --emit-config " + dir + "/llama.toml");
    ASSERT_EQ(l.code, 0) << l.output;
    const memtrain::RunConfig lc = memtrain::read_run_config(dir + "/llama.toml", {});
    EXPECT_EQ(lc.model.rope_theta, 500000.0);
    EXPECT_EQ(lc.model.n_kv_head, 8);
    EXPECT_EQ(lc.model.ffn_hidden, 14336);
    EXPECT_EQ(lc.model.vocab_size, 128256);
    EXPECT_FALSE(lc.model.bias);
    EXPECT_FALSE(lc.model.tied_embeddings);
    EXPECT_EQ(lc.model.norm, "rmsnorm");
    EXPECT_EQ(memtrain::plan::model_from_config(lc.model).total_params(),
              memtrain::plan::load_model("llama3-8b").total_params());
    // A CPU source planned in bf16 for GPUs: the device becomes "auto", and the header says so.
    write_file(dir + "/cpu.toml",
               "[model]\nn_layer = 4\nn_head = 4\nn_embd = 64\nblock_size = 64\n"
               "[train]\ndevice = \"cpu\"\n");
    const Outcome g =
        memtrain_cli("plan " + dir + "/cpu.toml --gpus 1 --emit-config " + dir + "/gpu.toml");
    ASSERT_EQ(g.code, 0) << g.output;
    const memtrain::RunConfig gc = memtrain::read_run_config(dir + "/gpu.toml", {});
    EXPECT_EQ(gc.train.device, "auto");
    EXPECT_EQ(gc.train.precision, "bf16");
    EXPECT_EQ(gc.optim.master, "fp32");
    // bf16-only: bf16 weights without a master (optim.master = "none", which the GPU trainer runs
    // as planned, so no header line) and bf16 moments, priced as the trainer allocates them.
    const Outcome bw = memtrain_cli("plan " + dir + "/cpu.toml --gpus 1 --precision bf16-only " +
                                    "--top 1 --emit-config " + dir + "/bw.toml");
    ASSERT_EQ(bw.code, 0) << bw.output;
    memtrain::RunConfig bc = memtrain::read_run_config(dir + "/bw.toml", {});
    EXPECT_EQ(bc.optim.master, "none");
    EXPECT_EQ(bc.optim.state_format, "bf16");
    EXPECT_EQ(read_file(dir + "/bw.toml").find("has no trainer"), std::string::npos);
    bc.train.device = "cuda";
    EXPECT_NO_THROW(memtrain::validate_optimizer_layout(bc));
    // model.dropout is kept, and the header says where the trainer does not run it yet.
    write_file(dir + "/drop.toml",
               "[model]\nn_layer = 4\nn_head = 4\nn_embd = 64\nblock_size = 64\ndropout = 0.1\n");
    const Outcome d =
        memtrain_cli("plan " + dir + "/drop.toml --gpus 1 --emit-config " + dir + "/dgpu.toml");
    ASSERT_EQ(d.code, 0) << d.output;
    EXPECT_EQ(memtrain::read_run_config(dir + "/dgpu.toml", {}).model.dropout, 0.1);
    EXPECT_NE(read_file(dir + "/dgpu.toml").find("# model.dropout = 0.1 runs on the CPU engine"),
              std::string::npos);
}

// Parameter offload, which the trainer does not run, is marked in the table, ranks after every
// plan the trainer runs, never stops the search's fallbacks and is never emitted (issue 26).
TEST(PlanCli, ParameterOffloadIsMarkedAndNeverEmitted) {
    const auto dir = memtrain::test::temp_dir("plan_cli_offload_params");
    // gpt2-xl on one 6 GB GPU: of full-parameter training only the parameters' offload fits.
    const std::string only = "plan gpt2-xl --gpus 1 --gpu-mem-gb 6 --global-batch 8 --no-lora";
    Outcome o = memtrain_cli(only + " --top 20 --json");
    EXPECT_EQ(o.code, 1) << o.output;  // nothing the trainer runs fits
    const auto j = nlohmann::json::parse(o.output.substr(0, o.output.rfind("}") + 1));
    ASSERT_FALSE(j["plans"].empty()) << o.output;
    for (const auto& p : j["plans"]) {
        EXPECT_FALSE(p["trainer_runs"].get<bool>()) << p.dump();
        EXPECT_EQ(p["offload"], "params");
    }
    o = memtrain_cli(only + " --top 3");
    EXPECT_EQ(o.code, 1) << o.output;
    EXPECT_NE(o.output.find("no layout memtrain's trainer runs fits"), std::string::npos)
        << o.output;
    EXPECT_NE(o.output.find("params*"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("* parameter offload: priced for comparison"), std::string::npos)
        << o.output;
    EXPECT_NE(o.output.find("closest plan, per-GPU memory"), std::string::npos) << o.output;
    o = memtrain_cli(only + " --emit-config " + dir + "/x.toml");
    EXPECT_EQ(o.code, 1) << o.output;
    EXPECT_NE(o.output.find("no plan the trainer runs fits"), std::string::npos) << o.output;
    EXPECT_FALSE(std::filesystem::exists(dir + "/x.toml"));
    // With the fallbacks on, the search goes past offloaded parameters to what the trainer runs
    // (here LoRA), and says why.
    o = memtrain_cli(
        "plan gpt2-xl --gpus 1 --gpu-mem-gb 6 --global-batch 8 --top 1 --reasons 3 "
        "--emit-config " +
        dir + "/y.toml");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_EQ(o.output.find("params*"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("full-parameter training: only parameter offload fits, which "
                            "memtrain's trainer does not run yet; full-parameter training, int8 "
                            "moments does not fit either"),
              std::string::npos)
        << o.output;
    EXPECT_GT(memtrain::read_run_config(dir + "/y.toml", {}).lora.rank, 0);
}

// `estimate --device cpu` prices the CPU engine on any machine (issue 26): every rank's rows are
// the engine's own, so a run of the same layout measures them, for the trainer's remat policies
// (every:K here); GPU-only flags are refused by name, and the host check says whether it fits.
TEST(PlanCli, CpuEstimateIsWhatTheTrainerAllocates) {
    const std::string dir = memtrain::test::temp_dir("plan_cli_cpu");
    memtrain::RunConfig c = memtrain::test::tiny_run(dir, 1);
    c.model.n_layer = 4;
    c.train.remat = "every:2";
    c.optim.state_format = "int8";
    c.io.save_final = false;
    // fp32, and bf16 GEMMs (their operand scratch in the workspace) from the TOML's precision.
    for (const char* precision : {"fp32", "bf16"}) {
        c.train.precision = precision;
        write_file(dir + "/run.toml", memtrain::to_toml(c));
        const Outcome o = memtrain_cli("estimate " + dir + "/run.toml --device cpu --json");
        ASSERT_EQ(o.code, 0) << o.output;
        const auto j = nlohmann::json::parse(o.output);
        ASSERT_EQ(j["ranks"].size(), 1u) << o.output;
        memtrain::TrainOptions opts;
        opts.quiet = true;
        memtrain::Trainer t(c, opts);
        t.run();
        const memtrain::MemoryStats s = t.engine().memory().snapshot();
        int compared = 0;
        for (const auto& row : j["ranks"][0]["rows"]) {
            const std::string cat = row["category"];
            for (memtrain::MemCategory k :
                 {memtrain::MemCategory::Parameters, memtrain::MemCategory::Gradients,
                  memtrain::MemCategory::OptimizerState, memtrain::MemCategory::Activations,
                  memtrain::MemCategory::Workspace})
                if (cat == memtrain::category_name(k)) {
                    EXPECT_EQ(row["bytes"].get<std::size_t>(), s.peak(k)) << precision << cat;
                    compared++;
                }
        }
        EXPECT_EQ(compared, 5) << o.output;
    }
    c.train.precision = "fp32";
    write_file(dir + "/run.toml", memtrain::to_toml(c));
    // Two ranks at ZeRO-2: each holds half the gradients and optimizer state.
    const auto z = nlohmann::json::parse(
        memtrain_cli("estimate " + dir + "/run.toml --device cpu --dp 2 --zero 2 --json").output);
    ASSERT_EQ(z["ranks"].size(), 2u);
    EXPECT_TRUE(z["fits"].get<bool>());
    expect_refusal("estimate gpt2 --device cpu --offload optimizer", {"--offload", "--device cpu"});
    expect_refusal("estimate gpt2 --device cpu --precision fp16", {"--precision fp16", "bf16"});
    expect_refusal("estimate gpt2 --device tpu", {"--device tpu", "gpu or cpu"});
    expect_refusal("estimate gpt2 --device cpu --recompute every:0", {"every:0"});
    const Outcome small =
        memtrain_cli("estimate " + dir + "/run.toml --device cpu --host-mem-gb 0.0001");
    EXPECT_NE(small.output.find("(--host-mem-gb): does NOT fit"), std::string::npos)
        << small.output;
}

// estimate's --recompute takes the trainer's per-block policies (issue 26), solved on the
// engines' layout: every:2 and a budget lie between full and none in bytes and in speed, a budget
// is met, and a model priced by the formulas (GPT-2's dropout) refuses them by name.
TEST(PlanCli, EstimateTakesTheTrainersRematPolicies) {
    const auto dir = memtrain::test::temp_dir("plan_cli_policies");
    write_file(dir + "/m.toml",
               "[model]\nn_layer = 8\nn_head = 8\nn_embd = 512\nblock_size = 512\n"
               "vocab_size = 8000\n");
    auto run = [&](const std::string& policy) {
        const Outcome o = memtrain_cli("estimate " + dir + "/m.toml --micro-batch 8 --json " +
                                       "--recompute " + policy);
        EXPECT_EQ(o.code, 0) << policy << "\n" << o.output;
        const auto j = nlohmann::json::parse(o.output);
        double act = 0;
        for (const auto& line : j["lines"])
            if (line["name"] == "activations") act = line["bytes"].get<double>();
        return std::make_pair(act, j["tokens_per_s"].get<double>());
    };
    const auto none = run("none"), full = run("full"), every = run("every:2");
    EXPECT_LT(full.first, every.first);
    EXPECT_LT(every.first, none.first);
    EXPECT_LT(full.second, every.second);
    EXPECT_LT(every.second, none.second);
    const auto budget = run("budget:300MiB");
    EXPECT_LE(budget.first, 300.0 * 1048576);
    EXPECT_GT(budget.first, full.first);
    expect_refusal("estimate gpt2 --recompute every:2", {"--recompute every:2", "formulas"});
    expect_refusal("estimate " + dir + "/m.toml --recompute every:x", {"every:x"});
}

// The lecture's example through the binary (issue 26): GPT-2 1.5B on 8 x V100 32 GB fits as
// memtrain prices it and not as PyTorch's DDP with torch.amp holds it; plan searches only what
// the runtime runs, and never emits memtrain's config for another runtime.
TEST(PlanCli, RuntimeProfiles) {
    Outcome o = memtrain_cli("estimate gpt2-xl --gpu v100-32gb --dp 8 --runtime pytorch");
    ASSERT_EQ(o.code, 0) << o.output;
    EXPECT_NE(o.output.find("priced as pytorch runs it"), std::string::npos) << o.output;
    EXPECT_NE(o.output.find("does NOT fit in 32.00 GB"), std::string::npos) << o.output;
    o = memtrain_cli("estimate gpt2-xl --gpu v100-32gb --dp 8");
    EXPECT_NE(o.output.find("fits in 32.00 GB"), std::string::npos) << o.output;
    o = memtrain_cli("plan gpt2-xl --gpus 8 --global-batch 64 --runtime deepspeed --top 50 --json");
    ASSERT_EQ(o.code, 0) << o.output;
    const auto j = nlohmann::json::parse(o.output);
    ASSERT_FALSE(j["plans"].empty());
    for (const auto& p : j["plans"]) EXPECT_GE(p["zero"].get<int>(), 1) << p.dump();
    expect_refusal("plan gpt2 --gpus 8 --runtime megatron --emit-config x.toml",
                   {"--emit-config", "--runtime megatron"});
    expect_refusal("estimate gpt2 --runtime jax", {"runtime", "jax"});
    expect_refusal("estimate gpt2 --dp 2 --zero 3 --runtime pytorch", {"--runtime pytorch"});
}

// `memtrain plan --device cpu --json` of run config `c` (written to dir/run.toml) with more
// arguments: its exit code and its JSON.
static auto cpu_plan_of(const std::string& dir, const memtrain::RunConfig& c) {
    write_file(dir + "/run.toml", memtrain::to_toml(c));
    const std::string plan = "plan " + dir + "/run.toml --device cpu --json";
    return [plan](const std::string& args) {
        const Outcome o = memtrain_cli(plan + args);
        const auto a = o.output.find('{'), b = o.output.rfind('}');
        return std::make_pair(o.code, nlohmann::json::parse(o.output.substr(a, b - a + 1)));
    };
}

// Between memory-poor's floor and the last lever that keeps every block input, the plan's last
// lever is the joint remat solver's budget: the largest the host leaves, so the least recompute
// that fits, not memory-poor's O(n^2). Its emitted config trains and allocates what it said.
TEST(PlanCli, CpuPlanDropsBlockInputsOnlyAsFarAsTheHostNeeds) {
    const std::string dir = memtrain::test::temp_dir("plan_cli_cpu_rebuild");
    memtrain::RunConfig c = memtrain::test::tiny_run(dir, 1);
    c.model.n_layer = 8;
    c.model.block_size = c.train.seq_len = 64;  // streams that outweigh a block's weights
    c.io.save_final = false;
    const auto steps_of = cpu_plan_of(dir, c);
    auto [code, none] = steps_of(" --host-mem-gb 0.000001");
    ASSERT_EQ(code, 1);
    const auto& ts = none["steps"];
    ASSERT_GE(ts.size(), 3u);
    ASSERT_EQ(ts.back()["lever"], "train.remat = memory-poor");
    const double floor = ts.back()["bytes_all_ranks"].get<double>();
    double kept = 0;  // the last lever before it that was tried
    for (std::size_t i = 0; i + 1 < ts.size(); i++)
        if (ts[i]["skipped"].get<std::string>().empty())
            kept = ts[i]["bytes_all_ranks"].get<double>();
    ASSERT_LT(floor, kept);
    const double host = (floor + kept) / 2;
    auto [code2, mid] =
        steps_of(fmt::format(" --host-mem-gb {:.9f} --emit-config {}/fit.toml", host / 1e9, dir));
    ASSERT_EQ(code2, 0) << mid.dump();
    // (A last step may give the fields their source's format back where that recomputes no
    // more: the budget's step is then the one before.)
    const auto& ms = mid["steps"];
    const bool undone = ms.back()["lever"].get<std::string>().starts_with("train.cpu_activations");
    EXPECT_TRUE(ms[ms.size() - (undone ? 2 : 1)]["lever"].get<std::string>().starts_with(
        "train.remat = budget:"))
        << ms;
    const auto& last = ms.back();
    EXPECT_TRUE(last["fits"].get<bool>());
    EXPECT_LE(last["bytes_all_ranks"].get<double>(), host);
    EXPECT_GT(last["bytes_all_ranks"].get<double>(), floor);  // more than memory-poor's, used
    memtrain::RunConfig fit = memtrain::read_run_config(dir + "/fit.toml", {});
    EXPECT_TRUE(fit.train.remat.starts_with("budget:"));
    memtrain::TrainOptions opts;
    opts.quiet = true;
    memtrain::Trainer t(fit, opts);
    t.run();
    EXPECT_EQ((double)t.engine().memory().snapshot().peak_total_used,
              last["bytes_per_rank"].get<double>());
    const memtrain::RematPlan& p = t.engine().remat_plan();
    EXPECT_TRUE(std::any_of(p.begin(), p.end(), memtrain::rebuilds_input));
    EXPECT_FALSE(std::all_of(p.begin() + 1, p.end(), [](memtrain::BlockKeep k) {
        return k == memtrain::BlockKeep::Dropped;
    })) << "memory-poor itself";
}

// `plan --device cpu` fits the CPU engine's run into the host lever by lever (issues 26 and 30):
// each step is the last one's config with one more lever, the first that fits is chosen and
// emitted, and a run of the emitted config allocates what the step said, within the budget.
TEST(PlanCli, CpuPlanFitsTheHostLeverByLever) {
    const std::string dir = memtrain::test::temp_dir("plan_cli_cpu_plan");
    memtrain::RunConfig c = memtrain::test::tiny_run(dir, 1);
    c.model.n_layer = 4;
    c.model.n_embd = 64;  // int8 fields: tiles of 4 rows hold whole 256-value blocks
    c.io.save_final = false;
    const auto steps_of = cpu_plan_of(dir, c);
    auto [code, roomy] = steps_of(" --host-mem-gb 100");
    ASSERT_EQ(code, 0);
    ASSERT_EQ(roomy["steps"].size(), 1u);  // as configured
    const double plain = roomy["steps"][0]["bytes_all_ranks"].get<double>();
    // One byte less than the plain run: the levers start, and the first that fits is kept.
    const std::string budget = fmt::format(" --host-mem-gb {:.9f}", (plain - 1) / 1e9);
    auto [code2, tight] = steps_of(budget + " --emit-config " + dir + "/fit.toml");
    ASSERT_EQ(code2, 0) << tight.dump();
    const auto& steps = tight["steps"];
    ASSERT_GE(steps.size(), 2u);
    EXPECT_FALSE(steps[0]["fits"].get<bool>());
    EXPECT_TRUE(steps.back()["fits"].get<bool>());
    EXPECT_LE(steps.back()["bytes_all_ranks"].get<double>(), plain - 1);
    // The emitted config trains, allocating the bytes the step predicted.
    memtrain::RunConfig fit = memtrain::read_run_config(dir + "/fit.toml", {});
    memtrain::TrainOptions opts;
    opts.quiet = true;
    memtrain::Trainer t(fit, opts);
    t.run();
    EXPECT_EQ((double)t.engine().memory().snapshot().peak_total_used,
              steps.back()["bytes_per_rank"].get<double>());
    // Two ranks: ZeRO is a lever; nothing fits a tiny host, which exits 1 and writes nothing.
    auto [code3, two] =
        steps_of(" --ranks 2 --host-mem-gb 0.000001 --emit-config " + dir + "/no.toml");
    EXPECT_EQ(code3, 1);
    EXPECT_FALSE(two["fits"].get<bool>());
    EXPECT_EQ(two["steps"][1]["lever"], "ZeRO-1");
    // The levers drop attention probabilities, and last block inputs: where even memory-poor's
    // floor (4 streams against full's 5) does not fit, memory-poor is the last step.
    const auto& ts = two["steps"];
    const std::size_t k = ts.size();
    ASSERT_GE(k, 3u);
    EXPECT_EQ(ts[k - 1]["lever"], "train.remat = memory-poor");
    double before = 0;  // the last lever tried before it (skipped ones have no bytes)
    for (std::size_t i = 0; i + 1 < k; i++)
        if (ts[i]["skipped"].get<std::string>().empty())
            before = ts[i]["bytes_per_rank"].get<double>();
    EXPECT_LT(ts[k - 1]["bytes_per_rank"].get<double>(), before);
    bool lse = false;
    for (const auto& s : ts)
        lse = lse || s["lever"].get<std::string>().starts_with("train.cpu_attention");
    EXPECT_TRUE(lse);
    // Compression before recompute: after selective, the saved fields in int8 (bf16 first where
    // they were fp32), each shrinking the step's bytes, before sqrt and full.
    std::vector<std::string> levers;
    for (const auto& s : ts) levers.push_back(s["lever"].get<std::string>());
    const auto at = [&](const std::string& prefix) {
        for (std::size_t i = 0; i < levers.size(); i++)
            if (levers[i].starts_with(prefix)) return i;
        ADD_FAILURE() << "no step " << prefix;
        return levers.size();
    };
    const std::size_t int8 = at("train.cpu_activations = int8");
    ASSERT_LT(int8, k);
    EXPECT_LT(at("train.remat = selective"), int8);
    EXPECT_LT(int8, at("train.remat = full"));
    EXPECT_EQ(ts[int8]["skipped"], "");
    EXPECT_LT(ts[int8]["bytes_per_rank"].get<double>(),
              ts[int8 - 1]["bytes_per_rank"].get<double>());
    // A host that `full` fits: `full` keeps only block inputs, which int8 does not compress, so
    // the chosen run gets its source's lossless fields back in one more step that still fits.
    const double at_full = ts[at("train.remat = full")]["bytes_all_ranks"].get<double>();
    auto [code4, full] = steps_of(fmt::format(" --ranks 2 --host-mem-gb {:.9f} --emit-config {}",
                                              at_full / 1e9, dir + "/full.toml"));
    ASSERT_EQ(code4, 0) << full.dump();
    const auto& fs = full["steps"];
    ASSERT_GE(fs.size(), 2u);
    EXPECT_EQ(fs[fs.size() - 2]["lever"], "train.remat = full");
    EXPECT_TRUE(fs.back()["lever"].get<std::string>().starts_with("train.cpu_activations = "))
        << fs.back()["lever"];
    EXPECT_TRUE(fs.back()["fits"].get<bool>());
    EXPECT_LE(fs.back()["bytes_all_ranks"].get<double>(), at_full);
    EXPECT_NE(memtrain::read_run_config(dir + "/full.toml", {}).train.cpu_activations, "int8");
    // The norms and the MLP in tiles (a quarter of the micro-batch's 16 rows) shrink `full`'s
    // recompute scratch.
    for (std::size_t i = 1; i < k; i++)
        if (ts[i]["lever"].get<std::string>().starts_with("train.mlp_tile")) {
            EXPECT_EQ(ts[i]["lever"], "train.mlp_tile = 4 (norms and MLP in row tiles)");
            EXPECT_EQ(ts[i]["skipped"], "");
            EXPECT_LT(ts[i]["bytes_per_rank"].get<double>(),
                      ts[i - 1]["bytes_per_rank"].get<double>());
            break;
        } else {
            EXPECT_LT(i + 1, k) << "no train.mlp_tile step";
        }
    EXPECT_FALSE(std::filesystem::exists(dir + "/no.toml"));
    expect_refusal("plan gpt2 --device cpu --gpus 8", {"--gpus", "--device cpu"});
    expect_refusal("plan gpt2 --ranks 2", {"--ranks", "--device cpu"});
}
