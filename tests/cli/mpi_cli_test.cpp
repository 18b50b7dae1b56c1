// `mpirun -np 2 memtrain train`: a start-up error every rank meets is printed once, SIGTERM
// sent to one rank stops every rank after the same step with one checkpoint that resumes
// exactly, and a pipeline trains from the command line as one process does. Run by CTest as
// cli_mpi_np2 (CMakeLists.txt), not by the plain test discovery.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

const std::string kEnv = "OMP_NUM_THREADS=1 MEMTRAIN_COMM_TIMEOUT_S=30 ";
const std::string kMpirun = std::string(MT_MPIEXEC) +
                            " --oversubscribe --allow-run-as-root -np 2 " + MT_BINARY_DIR +
                            "/memtrain ";

using memtrain::test::CliResult;
using memtrain::test::count_occurrences;
using memtrain::test::read_file;
using memtrain::test::slow_config;
using memtrain::test::write_file;

CliResult run_mpi(const std::string& args) {
    return memtrain::test::run_command(kEnv + "timeout -k 5 120 " + kMpirun + args);
}

// The same on 4 ranks.
CliResult run_mpi4(const std::string& args) {
    return memtrain::test::run_command(kEnv + "timeout -k 5 180 " + std::string(MT_MPIEXEC) +
                                       " --oversubscribe --allow-run-as-root -np 4 " +
                                       MT_BINARY_DIR + "/memtrain " + args);
}

std::map<int, std::string> losses(const std::string& metrics) {
    std::map<int, std::string> out;
    static const std::regex line(R"(\{"step": (\d+), "loss": ([-0-9.e]+),)");
    std::istringstream in(read_file(metrics));
    for (std::string l; std::getline(in, l);) {
        std::smatch m;
        if (std::regex_search(l, m, line)) out[std::stoi(m[1])] = m[2];
    }
    return out;
}

// Waits (at most 60 s) until `file` contains `what` at least `n` times.
bool wait_for_count(const std::string& file, const std::string& what, int n) {
    auto end = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < end) {
        if (count_occurrences(read_file(file), what) >= n) return true;
        std::this_thread::sleep_for(2ms);
    }
    return false;
}

// The process below `root` (mpirun) whose environment says it is rank `rank`, or -1.
pid_t find_rank(pid_t root, int rank) {
    const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
    for (const auto& e : fs::directory_iterator("/proc")) {
        const std::string name = e.path().filename().string();
        if (name.find_first_not_of("0123456789") != std::string::npos) continue;
        // Walk up the parents: the rank may sit below a helper process of the launcher.
        pid_t p = std::stoi(name);
        bool below = false;
        for (int depth = 0; depth < 4 && p > 1 && !below; depth++) {
            std::istringstream st(read_file("/proc/" + std::to_string(p) + "/stat"));
            std::string pid, comm, state;
            pid_t ppid = 0;
            st >> pid >> comm >> state >> ppid;
            below = ppid == root;
            p = ppid;
        }
        if (!below) continue;
        std::string env = read_file(e.path().string() + "/environ");
        for (std::size_t at = 0; at < env.size(); at = env.find('\0', at) + 1) {
            if (env.compare(at, want.size() + 1, want + '\0') == 0) return std::stoi(name);
            if (env.find('\0', at) == std::string::npos) break;
        }
    }
    return -1;
}

}  // namespace

TEST(CliMpi, StartupErrorEveryRankMeetsIsPrintedOnce) {
    auto dir = memtrain::test::temp_dir("cli_mpi_once");
    write_file(dir + "/bad.toml", "[train]\nlr = 1e-3\n");
    auto r = run_mpi("train " + dir + "/bad.toml");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "unknown config key 'train.lr'"), 1) << r.output;
    EXPECT_NE(r.output.find("memtrain: error: " + dir + "/bad.toml: unknown config key"),
              std::string::npos)
        << r.output;
    // A value every rank rejects (the batch over 2 ranks), named with the key and the value.
    r = run_mpi("train " + slow_config(dir, 2) + " --set train.batch_size=3");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "train.batch_size = 3"), 1) << r.output;
    // The micro-batch the user never set is said to be unset, and the rank count whence it came.
    EXPECT_NE(r.output.find("2 data-parallel ranks (the processes of mpirun -np 2)"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("train.micro_batch_size not set"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("train.micro_batch_size ("), std::string::npos) << r.output;
}

TEST(CliMpi, SigtermOnOneRankStopsEveryRankAtTheSameStep) {
    auto dir = memtrain::test::temp_dir("cli_mpi_sigterm");
    const std::string cfg = slow_config(dir, 40);
    auto r = run_mpi("train " + cfg + " --set io.out_dir=" + dir + "/full");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string log = dir + "/log.txt";
    pid_t mpirun = fork();
    if (mpirun == 0) {
        std::string cmd = kEnv + "exec " + kMpirun + "train " + cfg + " > " + log + " 2>&1";
        execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
        _exit(127);
    }
    ASSERT_TRUE(wait_for_count(dir + "/out/metrics.jsonl", "\"loss\"", 3)) << read_file(log);
    const pid_t rank1 = find_rank(mpirun, 1);
    EXPECT_GT(rank1, 0);
    if (rank1 > 0) kill(rank1, SIGTERM);
    int status = 0;
    bool ended = false;
    for (auto end = std::chrono::steady_clock::now() + 60s;
         !ended && std::chrono::steady_clock::now() < end;) {
        ended = waitpid(mpirun, &status, WNOHANG) == mpirun;
        if (!ended) std::this_thread::sleep_for(10ms);
    }
    if (!ended) {
        kill(mpirun, SIGKILL);
        waitpid(mpirun, nullptr, 0);
        FAIL() << "mpirun did not end\n" << read_file(log);
    }
    const std::string out = read_file(log);
    ASSERT_TRUE(WIFEXITED(status)) << out;
    EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << out;
    EXPECT_EQ(count_occurrences(out, "stopped by SIGTERM after step"), 1) << out;
    EXPECT_NE(out.find("mpirun -np 2 memtrain train --resume " + dir + "/out"), std::string::npos)
        << out;
    const auto first = losses(dir + "/out/metrics.jsonl");
    ASSERT_LT(first.size(), 40u) << "the run ended before the signal";
    r = run_mpi("train --resume " + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(losses(dir + "/out/metrics.jsonl"), losses(dir + "/full/metrics.jsonl"));
}

// `mpirun -np 2 memtrain train --set train.pp=2` from the command line: the losses are one
// process's, the end-of-run report has the measured bubble and the per-stage table, the last
// step's timeline is drawn, and a layout the model cannot take is refused once.
TEST(CliMpi, PipelineTrainsFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_pipeline");
    const std::string cfg = slow_config(dir, 6);
    const std::string sets =
        " --set train.micro_batch_size=2 model.tied_embeddings=false io.out_dir=";
    auto one = memtrain::test::run_memtrain("train " + cfg + sets + dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    ASSERT_EQ(losses(dir + "/one/metrics.jsonl").size(), 6u);
    for (const std::string sched : {"1f1b", "zb-h1"}) {
        const std::string out = dir + "/" + sched;
        auto r = run_mpi("train " + cfg + sets + out + " train.pp=2 train.pp_schedule=" + sched);
        ASSERT_EQ(r.code, 0) << r.output;
        EXPECT_EQ(count_occurrences(r.output, "pipeline of 2 stages (" + sched + " schedule)"), 1)
            << r.output;
        EXPECT_EQ(count_occurrences(r.output, "pipeline bubble: measured"), 1) << r.output;
        EXPECT_EQ(count_occurrences(r.output, "  stage 1: model states"), 1) << r.output;
        EXPECT_EQ(read_file(out + "/pipeline_timeline.svg").rfind("<svg", 0), 0u);
        EXPECT_EQ(losses(out + "/metrics.jsonl"), losses(dir + "/one/metrics.jsonl")) << sched;
    }
    auto r = run_mpi("train " + cfg + " --set train.pp=3");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "train.pp = 3 stages for model.n_layer = 2 blocks"), 1)
        << r.output;
}

// The interleaved schedule from the command line: 4 blocks as 2 ranks x 2 chunks, the losses one
// process's, and pp_virtual without the interleaved schedule refused once.
TEST(CliMpi, InterleavedPipelineTrainsFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_interleaved");
    const std::string cfg = slow_config(dir, 4);
    const std::string sets =
        " --set train.micro_batch_size=2 model.n_layer=4 model.tied_embeddings=false io.out_dir=";
    auto one = memtrain::test::run_memtrain("train " + cfg + sets + dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    const std::string out = dir + "/interleaved";
    auto r = run_mpi("train " + cfg + sets + out +
                     " train.pp=2 train.pp_schedule=interleaved train.pp_virtual=2");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output,
                                "pipeline of 2 stages (interleaved schedule, 2 chunks per rank)"),
              1)
        << r.output;
    EXPECT_EQ(count_occurrences(r.output, "pipeline bubble: measured"), 1) << r.output;
    EXPECT_EQ(read_file(out + "/pipeline_timeline.svg").rfind("<svg", 0), 0u);
    EXPECT_EQ(losses(out + "/metrics.jsonl"), losses(dir + "/one/metrics.jsonl"));
    r = run_mpi("train " + cfg + " --set model.n_layer=4 train.pp=2 train.pp_virtual=2");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output,
                                "train.pp_virtual = 2 needs train.pp_schedule = \"interleaved\""),
              1)
        << r.output;
}

// `mpirun -np 4 memtrain train --set train.pp=2`: two pipelines of two stages, ZeRO-1 across
// them; the losses are one process's to the data-parallel tolerance (printed to 6 decimals), and
// the report names every rank's stage and pipeline.
TEST(CliMpi, PipelinesSideBySideTrainFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_ppdp");
    const std::string cfg = slow_config(dir, 4);
    const std::string sets =
        " --set train.micro_batch_size=2 model.tied_embeddings=false io.out_dir=";
    auto one = memtrain::test::run_memtrain("train " + cfg +
                                            " --set train.micro_batch_size=4 "
                                            "model.tied_embeddings=false io.out_dir=" +
                                            dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    const std::string out = dir + "/ppdp";
    auto r = run_mpi4("train " + cfg + sets + out + " train.pp=2 train.zero_stage=1");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(
                  r.output, "pipeline of 2 stages (1f1b schedule) x 2 pipelines (ZeRO stage 1)"),
              1)
        << r.output;
    EXPECT_EQ(count_occurrences(r.output, "  stage 1 of pipeline 1 (rank 3): model states"), 1)
        << r.output;
    const auto want = losses(dir + "/one/metrics.jsonl"), got = losses(out + "/metrics.jsonl");
    ASSERT_EQ(got.size(), 4u);
    ASSERT_EQ(want.size(), 4u);
    for (const auto& [step, loss] : want)
        EXPECT_NEAR(std::stod(got.at(step)), std::stod(loss), 1e-5 * std::stod(loss))
            << "step " << step;
    r = run_mpi4("train " + cfg + " --set train.pp=2 train.zero_stage=2");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "across pipelines only ZeRO-1 is built"), 1) << r.output;
}

// `mpirun -np 2 memtrain train --set train.tp=2`: the losses are one process's to rounding, the
// run says it is tensor parallel and reports its collectives, and a model whose heads do not
// split is refused once.
TEST(CliMpi, TensorParallelTrainsFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_tp");
    const std::string cfg = slow_config(dir, 4);
    auto one = memtrain::test::run_memtrain("train " + cfg + " --set io.out_dir=" + dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    auto r = run_mpi("train " + cfg + " --set train.tp=2 io.out_dir=" + dir + "/tp");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "tensor parallel over 2 ranks"), 1) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "tensor parallel, last step's collectives"), 1)
        << r.output;
    const auto want = losses(dir + "/one/metrics.jsonl"), got = losses(dir + "/tp/metrics.jsonl");
    ASSERT_EQ(want.size(), 4u);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [step, loss] : want)
        EXPECT_NEAR(std::stod(got.at(step)), std::stod(loss), 1e-5 * std::stod(loss)) << step;
    r = run_mpi("train " + cfg + " --set train.tp=2 model.n_head=3 model.n_embd=24");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "train.tp = 2 must divide model.n_head = 3"), 1)
        << r.output;
    // tp 2 x pp 2 on four ranks: the same losses, to rounding, and a checkpoint that one process
    // resumes.
    r = run_mpi4("train " + cfg + " --set train.tp=2 train.pp=2 io.out_dir=" + dir + "/mesh");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output,
                                "tensor parallel over 2 ranks (heads, MLP and vocabulary split) | "
                                "pipeline of 2 stages (1f1b schedule)"),
              1)
        << r.output;
    const auto mesh = losses(dir + "/mesh/metrics.jsonl");
    ASSERT_EQ(mesh.size(), want.size());
    for (const auto& [step, loss] : want)
        EXPECT_NEAR(std::stod(mesh.at(step)), std::stod(loss), 1e-5 * std::stod(loss)) << step;
    auto resumed = memtrain::test::run_memtrain(
        "train " + cfg + " --resume " + dir +
        "/mesh --set train.tp=1 train.pp=1 train.max_steps=6 io.out_dir=" + dir + "/after");
    ASSERT_EQ(resumed.code, 0) << resumed.output;
    EXPECT_NE(resumed.output.find("step     6/6"), std::string::npos) << resumed.output;
}

// `mpirun -np 2 memtrain train --set train.tp=2 train.sequence_parallel=true`: the losses are
// one process's to rounding, the run names sequence parallelism and reports its all-gathers and
// reduce-scatters (and no block all-reduce); sequence parallelism without tp > 1, or with a
// micro-batch whose tokens the ranks do not divide, is refused once.
TEST(CliMpi, SequenceParallelTrainsFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_sp");
    const std::string cfg = slow_config(dir, 4);
    auto one = memtrain::test::run_memtrain("train " + cfg + " --set io.out_dir=" + dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    auto r = run_mpi("train " + cfg +
                     " --set train.tp=2 train.sequence_parallel=true io.out_dir=" + dir + "/sp");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "tensor parallel over 2 ranks"), 1) << r.output;
    EXPECT_EQ(
        count_occurrences(r.output, "sequence parallel: norms and residual stream split by tokens"),
        1)
        << r.output;
    EXPECT_EQ(count_occurrences(r.output, "sp row-parallel reduce-scatter (fwd)"), 1) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "sp norm gradients all-reduce (step)"), 1) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "row-parallel (fwd) x"), 0) << r.output;
    const auto want = losses(dir + "/one/metrics.jsonl"), got = losses(dir + "/sp/metrics.jsonl");
    ASSERT_EQ(want.size(), 4u);
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [step, loss] : want)
        EXPECT_NEAR(std::stod(got.at(step)), std::stod(loss), 1e-5 * std::stod(loss)) << step;
    r = run_mpi("train " + cfg + " --set train.sequence_parallel=true");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "train.sequence_parallel = true needs train.tp > 1"), 1)
        << r.output;
    r = run_mpi("train " + cfg +
                " --set train.tp=2 train.sequence_parallel=true train.micro_batch_size=1 "
                "train.seq_len=31");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "needs the micro-batch's tokens"), 1) << r.output;
}

// `memtrain plan --emit-config` for two GPUs small enough that the best plan shards with ZeRO
// (32 sequences of 16: micro-batches that fill the GEMM tiles, so no pipeline wins on shape),
// then `mpirun -np 2 memtrain train` on the emitted file unchanged but for where the data is:
// it trains, at the planned ZeRO stage, and reports the planner's per-rank estimate.
TEST(CliMpi, PlanEmittedConfigTrainsFromTheCommandLine) {
    auto dir = memtrain::test::temp_dir("cli_mpi_plan_emit");
    slow_config(dir, 2);  // the shard
    write_file(dir + "/m.toml",
               "[model]\nn_layer = 4\nn_head = 4\nn_embd = 32\nblock_size = 16\nvocab_size = 50\n"
               "vocab_pad = 16\n");
    auto p = memtrain::test::run_memtrain("plan " + dir +
                                          "/m.toml --gpus 2 --gpu-mem-gb 0.002 --reserve-gb 0 "
                                          "--precision fp32 --no-flash --global-batch 32 --seq 16 "
                                          "--no-offload --no-lora --emit-config " +
                                          dir + "/plan.toml");
    ASSERT_EQ(p.code, 0) << p.output;
    const std::string emitted = read_file(dir + "/plan.toml");
    EXPECT_EQ(count_occurrences(emitted, "zero_stage = 0"), 0) << emitted;
    EXPECT_EQ(count_occurrences(emitted, "mpirun -np 2"), 1) << emitted;
    auto r = run_mpi("train " + dir + "/plan.toml --set data.train=" + dir +
                     "/train.bin train.max_steps=2 train.eval_every=0 train.device=cpu "
                     "sample.max_tokens=0 io.save_final=false io.out_dir=" +
                     dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(losses(dir + "/out/metrics.jsonl").size(), 2u) << r.output;
    const auto at = emitted.find("zero_stage = ");
    ASSERT_NE(at, std::string::npos) << emitted;
    const std::string stage = emitted.substr(at + 13, 1);  // as planned
    EXPECT_EQ(count_occurrences(r.output, "x 2 ranks (ZeRO stage " + stage + ")"), 1) << r.output;
    EXPECT_EQ(count_occurrences(r.output, "planner estimate (per rank)"), 1) << r.output;
}

// A Llama preset's emitted config, scaled down (issue 26): plan llama3-8b on 2 GPUs picks tensor
// parallelism; the file, with the model shrunk and the data given, trains under mpirun -np 2 at
// the planned layout, the Llama architecture's keys as the preset has them.
TEST(CliMpi, LlamaPresetEmittedConfigTrainsScaledDown) {
    auto dir = memtrain::test::temp_dir("cli_mpi_llama_emit");
    slow_config(dir, 2);  // the shard
    auto p = memtrain::test::run_memtrain(
        "plan llama3-8b --gpus 2 --gpu-mem-gb 200 --precision fp32 --no-flash --global-batch 8 "
        "--seq 16 --no-offload --no-lora --emit-config " +
        dir + "/plan.toml");
    ASSERT_EQ(p.code, 0) << p.output;
    const std::string emitted = read_file(dir + "/plan.toml");
    EXPECT_EQ(count_occurrences(emitted, "tp = 2"), 1) << emitted;
    EXPECT_EQ(count_occurrences(emitted, "rope_theta = 500000"), 1) << emitted;
    auto r = run_mpi("train " + dir +
                     "/plan.toml --set model.n_layer=2 model.n_embd=64 model.n_head=4 "
                     "model.n_kv_head=2 model.ffn_hidden=128 model.vocab_size=50 "
                     "model.block_size=16 data.train=" +
                     dir +
                     "/train.bin data.val= train.max_steps=2 train.eval_every=0 "
                     "train.device=cpu sample.max_tokens=0 io.save_final=false io.out_dir=" +
                     dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(losses(dir + "/out/metrics.jsonl").size(), 2u) << r.output;
    EXPECT_NE(r.output.find("tensor parallel"), std::string::npos) << r.output;
}

namespace {

// `memtrain diagnose DIR [--baseline B] --json`, parsed.
nlohmann::json diagnose_json(const std::string& args) {
    auto r = memtrain::test::run_command(
        "timeout -k 5 60 " + std::string(MT_BINARY_DIR) + "/memtrain diagnose " + args + " --json",
        false);
    EXPECT_EQ(r.code, 0) << r.output;
    return nlohmann::json::parse(r.output);
}

}  // namespace

// `memtrain diagnose` on runs built to have the cause: a pipeline of 2 stages with one
// micro-batch per step idles half of it (the bubble), and a data-parallel rank slowed by a sleep
// in its compute keeps the other waiting in every all-reduce, which a single-process baseline
// names as the scaling regression.
TEST(CliMpi, DiagnoseNamesThePipelineBubbleAndASlowRank) {
    auto dir = memtrain::test::temp_dir("cli_mpi_diagnose");
    const std::string cfg = slow_config(dir, 5, 128);
    const std::string sets = " --set train.batch_size=32 model.tied_embeddings=false io.out_dir=";
    auto r = run_mpi("train " + cfg + sets + dir + "/pp train.pp=2");
    ASSERT_EQ(r.code, 0) << r.output;
    nlohmann::json d = diagnose_json(dir + "/pp");
    EXPECT_EQ(d.at("largest_loss"), "bubble") << d.dump(1);

    auto one = memtrain::test::run_memtrain("train " + cfg + sets + dir + "/one");
    ASSERT_EQ(one.code, 0) << one.output;
    r = memtrain::test::run_command("MEMTRAIN_TEST_SLOW_RANK=1:150 " + kEnv + "timeout -k 5 120 " +
                                    kMpirun + "train " + cfg + sets + dir + "/dp");
    ASSERT_EQ(r.code, 0) << r.output;
    d = diagnose_json(dir + "/dp --baseline " + dir + "/one");
    EXPECT_EQ(d.at("largest_loss"), "wait") << d.dump(1);
    EXPECT_EQ(d.at("slowest_rank"), 1) << d.dump(1);
    EXPECT_EQ(d.at("largest_growth"), "wait") << d.dump(1);
    ASSERT_EQ(d.at("ranks").size(), 2u);
}
