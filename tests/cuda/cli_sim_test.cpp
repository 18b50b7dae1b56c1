// The command line on cudasim (memtrain_sim): `memtrain train` with train.device = "cuda" end to
// end, in each precision, and its errors. Built into the simulator's tests only (on a GPU the same
// run is `memtrain train`, which bench/gpu_device.sh exercises).
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "cli/cli_util.h"
#include "data/shard.h"
#include "test_util.h"

#if MT_CUDA_SIM_TESTS

namespace {

using Result = memtrain::test::CliResult;

Result run_sim(const std::string& args, const std::string& env = "") {
    return memtrain::test::run_command(env + " timeout -k 5 300 " + std::string(MT_BINARY_DIR) +
                                       "/memtrain_sim " + args);
}

// A tiny config over freshly written shards; returns its path.
std::string tiny_config(const std::string& dir) {
    using memtrain::test::patterned_tokens;
    memtrain::data::write_shard(dir + "/train.bin", patterned_tokens(4096, 50, 1), 50);
    memtrain::data::write_shard(dir + "/val.bin", patterned_tokens(1024, 50, 2), 50);
    std::ofstream f(dir + "/run.toml");
    f << "[model]\nn_layer = 2\nn_head = 2\nn_embd = 16\nblock_size = 16\nvocab_size = 50\n"
         "vocab_pad = 16\n[train]\nseq_len = 8\nbatch_size = 4\nmicro_batch_size = 2\n"
         "max_steps = 4\neval_every = 2\n[optim]\nlr = 3e-3\nwarmup_steps = 1\n[data]\n"
         "train = \"train.bin\"\nval = \"val.bin\"\n[io]\nout_dir = \"out\"\n[sample]\n"
         "max_tokens = 0\n";
    return dir + "/run.toml";
}

}  // namespace

#if MT_HAVE_NCCL_SIM
// `mpirun -np 2 memtrain train` on the GPU engine under ZeRO-3 (NCCL emulated over MPI): the
// ranks train, evaluate and checkpoint together (every forward gathers units), and the memory
// report shows the sharded model states and the buckets and slots, predicted to the byte.
TEST(CudaCli, MpirunTrainsUnderZero3) {
    auto dir = memtrain::test::temp_dir("cuda_cli_zero3");
    auto r = run_sim("train " + tiny_config(dir) +
                         " --set train.device=cuda train.precision=bf16 train.zero_stage=3 "
                         "sample.max_tokens=4 io.out_dir=" +
                         dir + "/out",
                     // (MPI's own allocations outlive the ranks: no leak check, as in the
                     // other mpirun tests.)
                     "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0 OMP_NUM_THREADS=1 " +
                         std::string(MT_MPIEXEC) + " --oversubscribe --allow-run-as-root -np 2");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("x 2 ranks (ZeRO stage 3)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("2 x params / 2 ranks (bf16)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("gradient buckets and gathered units"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("model states per rank (peak): rank 0"), std::string::npos) << r.output;
    EXPECT_TRUE(std::filesystem::exists(dir + "/out/ckpt_000004/model.safetensors")) << r.output;
}

// `mpirun -np 2 memtrain train --set train.pp=2` on the GPU engine: two stages in fp16 with the
// loss scale agreed between them, evaluation through both, a checkpoint, and each
// stage's memory measured against its prediction; the checkpoint then resumes in one process.
TEST(CudaCli, MpirunTrainsAPipelineOfStages) {
    auto dir = memtrain::test::temp_dir("cuda_cli_pp");
    const std::string mpi = "ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0 OMP_NUM_THREADS=1 " +
                            std::string(MT_MPIEXEC) + " --oversubscribe --allow-run-as-root -np 2";
    auto r = run_sim("train " + tiny_config(dir) +
                         " --set train.device=cuda train.precision=fp16 train.pp=2 "
                         "train.pp_schedule=gpipe sample.max_tokens=4 io.out_dir=" +
                         dir + "/out",
                     mpi);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("pipeline stage 0 of 2 (blocks 0..0, gpipe schedule)"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("2 slots x plan_stage_arena(1 blocks"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("per pipeline stage (peak, measured / predicted)"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("val loss"), std::string::npos) << r.output;
    EXPECT_TRUE(std::filesystem::exists(dir + "/out/ckpt_000004/model.safetensors")) << r.output;
    // Two more steps in one process from the pipeline's checkpoint.
    auto one =
        run_sim("train " + dir + "/run.toml --resume " + dir +
                "/out --set train.device=cuda train.precision=fp16 train.pp=1 train.max_steps=6 "
                "io.out_dir=" +
                dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    EXPECT_NE(one.output.find("step     6/6"), std::string::npos) << one.output;
}

// Pipeline stages too large for their (simulated, 8 MiB) devices: each stage's plan is refused
// before its engine allocates, naming the stage and the categories.
TEST(CudaCli, MpirunRefusesStagesTooLargeForTheDevice) {
    auto dir = memtrain::test::temp_dir("cuda_cli_pp_too_large");
    const std::string mpi =
        "MEMTRAIN_SIM_DEVICE_MIB=8 ASAN_OPTIONS=detect_leaks=0:protect_shadow_gap=0 "
        "OMP_NUM_THREADS=1 " +
        std::string(MT_MPIEXEC) + " --oversubscribe --allow-run-as-root -np 2";
    auto r = run_sim("train " + tiny_config(dir) +
                         " --set train.device=cuda train.pp=2 model.n_embd=1024 model.n_head=8 "
                         "model.n_layer=4 io.out_dir=" +
                         dir + "/out",
                     mpi);
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("out of device memory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("on pipeline stage 0 of 2 (parameters"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("the device has 8.0 MiB"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("nothing was allocated"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("train.pp"), std::string::npos) << r.output;
}
#endif

TEST(CudaCli, TrainsOnTheDeviceInEachPrecision) {
    for (const char* p : {"fp32", "bf16", "fp16"}) {
        SCOPED_TRACE(p);
        auto dir = memtrain::test::temp_dir(std::string("cuda_cli_") + p);
        auto r =
            run_sim("train " + tiny_config(dir) + " --set train.device=cuda train.precision=" + p +
                    " io.out_dir=" + dir + "/out");
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_NE(r.output.find(std::string("device: cuda: memtrain CUDA simulator (sm_90) (") + p),
                  std::string::npos)
            << r.output;
        EXPECT_NE(r.output.find("memory breakdown (device:"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("device in use"), std::string::npos) << r.output;
        const bool mixed = std::string(p) != "fp32";
        EXPECT_NE(r.output.find(mixed ? "12 x params (fp32 master, Adam m, v)"
                                      : "8 x params (Adam m, v)"),
                  std::string::npos)
            << r.output;
        EXPECT_NE(r.output.find("step     4/4 | val loss"), std::string::npos) << r.output;
        if (std::string(p) == "fp16") {
            EXPECT_NE(r.output.find("scale 65536"), std::string::npos) << r.output;
        }
    }
}

// QLoRA on the device from the command line: the memory table shows the packed base and the
// adapters' states, the checkpoint holds PEFT's files, and `lora merge` makes a model of it.
TEST(CudaCli, QLoraTrainsOnTheDeviceAndMerges) {
    auto dir = memtrain::test::temp_dir("cuda_cli_qlora");
    auto r = run_sim("train " + tiny_config(dir) +
                     " --set train.device=cuda train.precision=bf16 lora.rank=4 lora.targets=all "
                     "lora.base=nf4 lora.base_group=16 lora.dropout=0.1 io.out_dir=" +
                     dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("QLoRA r=4"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("frozen base packed nf4 (block 16)"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("adapters only"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("step     4/4 | val loss"), std::string::npos) << r.output;
    const std::string ckpt = dir + "/out/ckpt_000004";
    EXPECT_TRUE(std::filesystem::exists(ckpt + "/adapter_model.safetensors")) << r.output;
    EXPECT_FALSE(std::filesystem::exists(ckpt + "/model.safetensors")) << r.output;
    r = run_sim("lora merge " + ckpt + " --out " + dir + "/merged");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(std::filesystem::exists(dir + "/merged/model.safetensors")) << r.output;
}

// LoRA and QLoRA too large for the (simulated, 8 MiB) device: refused before anything is
// allocated, naming the categories; a base that is not packed yet is pointed at QLoRA.
TEST(CudaCli, LoraTooLargeForTheDeviceIsRefused) {
    auto dir = memtrain::test::temp_dir("cuda_cli_lora_too_large");
    const std::string cfg = tiny_config(dir);
    for (const char* base : {"fp32", "nf4"}) {
        SCOPED_TRACE(base);
        auto r = run_sim("train " + cfg +
                             " --set train.device=cuda model.n_embd=1024 model.n_head=8 "
                             "model.n_layer=4 lora.rank=4 lora.base_group=32 lora.base=" +
                             base,
                         "MEMTRAIN_SIM_DEVICE_MIB=8");
        EXPECT_EQ(r.code, 1) << r.output;
        EXPECT_NE(r.output.find("out of device memory"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("parameters"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("the device has 8.0 MiB"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("nothing was allocated"), std::string::npos) << r.output;
        if (std::string(base) == "fp32") {
            EXPECT_NE(r.output.find("lora.base = nf4"), std::string::npos) << r.output;
        }
    }
}

TEST(CudaCli, ErrorsNameTheKeyAndExitNonZero) {
    auto dir = memtrain::test::temp_dir("cuda_cli_errors");
    const std::string cfg = tiny_config(dir);
    auto r = run_sim("train " + cfg + " --set train.device=cpu train.precision=fp16");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("train.precision = \"fp16\" on the CPU"), std::string::npos)
        << r.output;
    r = run_sim("train " + cfg + " --set train.precision=fp8");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("train.precision = \"fp8\" must be"), std::string::npos) << r.output;
    // Too large for the device (the simulator reports and enforces the size it is given):
    // refused before anything is allocated, naming the categories, the device's size and what
    // would fit.
    r = run_sim("train " + cfg + " --set train.device=cuda model.n_embd=256 model.n_layer=4",
                "MEMTRAIN_SIM_DEVICE_MIB=8");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("out of device memory"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("the device has 8.0 MiB"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("nothing was allocated"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("To fit:"), std::string::npos) << r.output;
    // 14 MB of model states fit in 40 MiB; the bf16 activations of 4 x 512 tokens (33 MiB) not.
    r = run_sim("train " + cfg +
                    " --set train.device=cuda train.micro_batch_size=4 train.batch_size=4 "
                    "model.block_size=512 train.seq_len=512 model.n_embd=128 model.n_layer=4",
                "MEMTRAIN_SIM_DEVICE_MIB=40");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("for activations"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("train.remat"), std::string::npos) << r.output;
    // The same run with train.micro_batch_size = "auto" on a 70 MiB device: the largest
    // micro-batch whose predicted device memory fits the free bytes (2: 64.5 MiB; 4 would need
    // 82.7), accumulation keeping the global batch of 4.
    r = run_sim("train " + cfg +
                    " --set train.device=cuda train.micro_batch_size=auto train.batch_size=4 "
                    "model.block_size=512 train.seq_len=512 model.n_embd=128 model.n_layer=4 "
                    "train.max_steps=1 io.out_dir=" +
                    dir + "/auto",
                "MEMTRAIN_SIM_DEVICE_MIB=70");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("train.micro_batch_size = \"auto\": 2 sequences per micro-batch, 2 "
                            "micro-batches per step"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("MiB free; 4 would need"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("step     1/1"), std::string::npos) << r.output;
}

#endif  // MT_CUDA_SIM_TESTS
