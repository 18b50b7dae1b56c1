// `memtrain train` as a new user meets it: resume from a checkpoint alone, SIGINT/SIGTERM stopping
// with a checkpoint, clear errors for unwritable out_dirs, directories and misplaced keys,
// --version and the short config printout. Every wait is bounded; no test can hang.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <thread>

#include "cli/cli_util.h"
#include "io/checkpoint.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

using memtrain::test::Child;
using memtrain::test::CliResult;
using memtrain::test::read_file;
using memtrain::test::slow_config;
using memtrain::test::write_file;

// Runs memtrain to completion (at most 120 s), in `cwd` if given, on one thread.
CliResult run_in_dir(const std::string& args, const std::string& cwd = "") {
    return memtrain::test::run_command((cwd.empty() ? "" : "cd " + cwd + " && ") +
                                       "OMP_NUM_THREADS=1 timeout -k 5 120 " + MT_BINARY_DIR +
                                       "/memtrain " + args);
}

// step -> the loss as metrics.jsonl prints it (the text, so equal means the same bits printed);
// a step logged twice fails the test.
std::map<int, std::string> losses_logged_once(const std::string& metrics) {
    std::map<int, std::string> out;
    static const std::regex line(R"(\{"step": (\d+), "loss": ([-0-9.e]+),)");
    std::istringstream in(read_file(metrics));
    for (std::string l; std::getline(in, l);) {
        std::smatch m;
        if (std::regex_search(l, m, line)) {
            EXPECT_EQ(out.count(std::stoi(m[1])), 0u) << "step logged twice: " << l;
            out[std::stoi(m[1])] = m[2];
        }
    }
    return out;
}

// Waits (at most 60 s) until `file` holds at least `n` lines containing `what`.
bool wait_for_lines(const std::string& file, const std::string& what, int n) {
    auto end = std::chrono::steady_clock::now() + 60s;
    while (std::chrono::steady_clock::now() < end) {
        std::istringstream in(read_file(file));
        int k = 0;
        for (std::string l; std::getline(in, l);) k += l.find(what) != std::string::npos;
        if (k >= n) return true;
        std::this_thread::sleep_for(2ms);
    }
    return false;
}

}  // namespace

TEST(TrainCli, ResumeWithTheCheckpointsOwnConfig) {
    auto dir = memtrain::test::temp_dir("train_cli_resume");
    const std::string cfg = slow_config(dir, 6, 16);
    auto r = run_in_dir("train " + cfg + " --set io.out_dir=" + dir + "/full");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_in_dir("train " + cfg + " --stop-after 3");
    ASSERT_EQ(r.code, 0) << r.output;
    // No CONFIG: the checkpoint's saved config (its paths absolute: any working directory).
    fs::create_directories(dir + "/elsewhere");
    r = run_in_dir("train --resume " + dir + "/out", dir + "/elsewhere");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from"), std::string::npos) << r.output;
    auto want = losses_logged_once(dir + "/full/metrics.jsonl"),
         got = losses_logged_once(dir + "/out/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    EXPECT_EQ(got, want);
    // --set over the checkpoint's config extends the run.
    r = run_in_dir("train --resume " + dir + "/out --set train.max_steps=8");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("step     8/8"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::exists(dir + "/out/ckpt_000008/model.safetensors"));
    // A config file given too overrides the checkpoint's keys it sets, then --set.
    write_file(dir + "/more.toml", "[train]\nmax_steps = 9\nlog_every = 3\n");
    r = run_in_dir("train " + dir + "/more.toml --resume " + dir + "/out --print-config");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("max_steps = 9\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("n_embd = 16\n"), std::string::npos) << r.output;
    r = run_in_dir("train " + dir + "/more.toml --resume " + dir +
                   "/out --set train.max_steps=10 --print-config");
    EXPECT_NE(r.output.find("max_steps = 10\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("log_every = 3\n"), std::string::npos) << r.output;
}

// model.dropout from the command line: the run trains with it, a stopped run resumed from its
// checkpoint alone (which keeps the key) logs the uninterrupted run's losses, the masks change the
// losses, and a bad probability or an engine without dropout is one clear line.
TEST(TrainCli, DropoutTrainsAndResumesExactly) {
    auto dir = memtrain::test::temp_dir("train_cli_dropout");
    const std::string cfg = slow_config(dir, 6, 16);
    auto r = run_in_dir("train " + cfg + " --set model.dropout=0.1 io.out_dir=" + dir + "/full");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("dropout=0.1"), std::string::npos) << "config printed: " << r.output;
    r = run_in_dir("train " + cfg + " --set io.out_dir=" + dir + "/plain");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_in_dir("train " + cfg + " --set model.dropout=0.1 --stop-after 3");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_in_dir("train --resume " + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    auto want = losses_logged_once(dir + "/full/metrics.jsonl");
    ASSERT_EQ(want.size(), 6u);
    EXPECT_EQ(losses_logged_once(dir + "/out/metrics.jsonl"), want);
    EXPECT_NE(losses_logged_once(dir + "/plain/metrics.jsonl"), want);
    r = run_in_dir("train " + cfg + " --set model.dropout=1.5 io.out_dir=" + dir + "/bad");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("model.dropout = 1.5 must be in [0, 1)"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/bad"));
    r = run_in_dir("train " + cfg + " --set model.dropout=0.1 train.tp=2 io.out_dir=" + dir +
                   "/tp");
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("model.dropout = 0.1 does not run with train.tp = 2 yet"),
              std::string::npos)
        << r.output;
}

// Nothing to train (a finished run resumed, --stop-after 0, train.max_steps = 0): one line that
// says so and how to train longer, exit 0, and no file written (a finished run's memory.json
// once came back with zero activations).
TEST(TrainCli, NothingToTrainSaysSoAndChangesNoFile) {
    auto dir = memtrain::test::temp_dir("train_cli_complete");
    const std::string cfg = slow_config(dir, 3, 16);
    auto r = run_in_dir("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    ASSERT_TRUE(fs::exists(dir + "/out/memory.json"));
    const auto before = memtrain::test::dir_snapshot(dir + "/out", /*with_mtime=*/true);
    r = run_in_dir("train --resume " + dir + "/out");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("already complete at step 3 (train.max_steps = 3): nothing to train, "
                            "no file changed. To train longer: memtrain train --resume " +
                            dir + "/out --set train.max_steps=6"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("tok/s"), std::string::npos) << "it trained: " << r.output;
    r = run_in_dir("train --resume " + dir + "/out --set train.max_steps=6 --stop-after 0");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("--stop-after 0: nothing to train (the run stays at step 3)"),
              std::string::npos)
        << r.output;
    EXPECT_EQ(memtrain::test::dir_snapshot(dir + "/out", true), before);
    // A new run of no steps writes nothing either.
    r = run_in_dir("train " + cfg + " --set train.max_steps=0 io.out_dir=" + dir + "/zero");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("train.max_steps = 0: nothing to train"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/zero"));
    // A negative count is refused, naming the flag.
    r = run_in_dir("train " + cfg + " --stop-after -2 --set io.out_dir=" + dir + "/neg");
    EXPECT_NE(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("--stop-after"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + "/neg"));
}

// io.keep_last = 2 keeps the newest two checkpoints, besides io.keep_every's, those a user marked
// with a file named `keep`, and (a resume of an older one) those after the step saved.
TEST(TrainCli, KeepLastRemovesOlderCheckpointsButTheMarkedOnes) {
    auto dir = memtrain::test::temp_dir("train_cli_keep");
    const std::string cfg = slow_config(dir, 3, 16);
    auto r = run_in_dir("train " + cfg + " --set io.checkpoint_every=1");
    ASSERT_EQ(r.code, 0) << r.output;
    write_file(dir + "/out/ckpt_000001/keep", "");
    r = run_in_dir("train --resume " + dir +
                   "/out --set train.max_steps=7 io.keep_last=2 io.keep_every=3 train.log_every=1");
    ASSERT_EQ(r.code, 0) << r.output;
    // (Step lines say how long this process has trained and the rest at its mean step; the
    // metrics lines carry the time.)
    EXPECT_NE(r.output.find("step     4/7 |"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("s, eta "), std::string::npos) << r.output;
    EXPECT_NE(read_file(dir + "/out/metrics.jsonl").find(", \"time\": 1"), std::string::npos);
    EXPECT_NE(r.output.find("checkpoint: removed ckpt_000002 (io.keep_last = 2)"),
              std::string::npos)
        << r.output;
    auto left = [&] {
        std::vector<std::string> names;
        for (const auto& e : fs::directory_iterator(dir + "/out"))
            if (e.is_directory()) names.push_back(e.path().filename().string());
        std::sort(names.begin(), names.end());
        return names;
    };
    EXPECT_EQ(left(), (std::vector<std::string>{"ckpt_000001", "ckpt_000003", "ckpt_000006",
                                                "ckpt_000007"}));
    // Resumed from step 3 again: steps 4 and 5 are saved anew and pruned; 6 and 7, after the
    // step saved, belong to the other branch and stay.
    r = run_in_dir("train --resume " + dir +
                   "/out/ckpt_000003 --set train.max_steps=5 io.keep_last=1 io.keep_every=3 "
                   "io.checkpoint_every=1");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(left(), (std::vector<std::string>{"ckpt_000001", "ckpt_000003", "ckpt_000005",
                                                "ckpt_000006", "ckpt_000007"}));
    EXPECT_EQ(read_file(dir + "/out/latest"), "ckpt_000005\n");
    r = run_in_dir("train " + cfg + " --set io.keep_last=-1 io.out_dir=" + dir + "/bad");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("io.keep_last = -1 is out of range"), std::string::npos) << r.output;
}

// train.device = "auto" is what the user wrote: --print-config and the checkpoint's memtrain.toml
// keep it (a resume on a machine with a GPU resolves it there); the start-up table shows what
// runs here.
TEST(TrainCli, DeviceAutoStaysAutoInPrintedAndSavedConfigs) {
    auto dir = memtrain::test::temp_dir("train_cli_auto");
    const std::string cfg = slow_config(dir, 1, 16);
    auto r =
        run_in_dir("train " + cfg + " --set train.device=auto train.precision=auto --print-config");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("device = 'auto'\n"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("precision = 'auto'\n"), std::string::npos) << r.output;
    r = run_in_dir("train " + cfg + " --set train.device=auto train.precision=auto");
    ASSERT_EQ(r.code, 0) << r.output;
    // (One step after two of warmup: said at the start.)
    EXPECT_NE(r.output.find("memtrain: warning: optim.warmup_steps = 2 is not below "
                            "train.max_steps = 1"),
              std::string::npos)
        << r.output;
    EXPECT_TRUE(r.output.find("device=cpu ") != std::string::npos ||
                r.output.find("device=cuda ") != std::string::npos)
        << r.output;
    const std::string saved = read_file(dir + "/out/ckpt_000001/memtrain.toml");
    EXPECT_NE(saved.find("device = 'auto'\n"), std::string::npos) << saved;
    EXPECT_NE(saved.find("precision = 'auto'\n"), std::string::npos) << saved;
    // --print-config makes training's checks with "auto" resolved: on a machine whose device is
    // the CPU (no GPU visible), fp16 is refused there as training would refuse it.
    r = memtrain::test::run_command("CUDA_VISIBLE_DEVICES= timeout -k 5 120 " +
                                    std::string(MT_BINARY_DIR) + "/memtrain train " + cfg +
                                    " --set train.device=auto train.precision=fp16 --print-config");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("train.precision = \"fp16\" on the CPU"), std::string::npos)
        << r.output;
}

// --reset-data: a resume on new data reads it from its start, keeping the weights, optimizer
// state and step (without it another shard is refused as another run).
TEST(TrainCli, ResetDataResumesOnNewDataFromItsStart) {
    auto dir = memtrain::test::temp_dir("train_cli_reset_data");
    const std::string cfg = slow_config(dir, 2, 16);
    auto r = run_in_dir("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    memtrain::data::write_shard(dir + "/new.bin", memtrain::test::patterned_tokens(1 << 15, 50, 7),
                                50);
    const std::string more = " --set train.max_steps=4 data.train=" + dir + "/new.bin";
    r = run_in_dir("train --resume " + dir + "/out" + more);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("a data.train of 32768 tokens (was 65536)"), std::string::npos)
        << r.output;
    r = run_in_dir("train --resume " + dir + "/out --reset-data" + more);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("resumed from " + dir + "/out/ckpt_000002 at step 2, reading " + dir +
                            "/new.bin from its start (--reset-data)"),
              std::string::npos)
        << r.output;
    // Two steps into new.bin: where two steps into the first shard were.
    const auto first = memtrain::checkpoint_state(dir + "/out/ckpt_000002");
    const auto now = memtrain::checkpoint_state(dir + "/out/ckpt_000004");
    EXPECT_EQ(now.step, 4);
    EXPECT_EQ(now.data_epoch, first.data_epoch);
    EXPECT_EQ(now.data_cursor, first.data_cursor);
    EXPECT_EQ(now.data_tokens, 32768u);
    r = run_in_dir("train " + cfg + " --reset-data --set io.out_dir=" + dir + "/x");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("--reset-data needs --resume"), std::string::npos) << r.output;
}

TEST(TrainCli, SigtermStopsWithACheckpointAndResumesExactly) {
    auto dir = memtrain::test::temp_dir("train_cli_sigterm");
    const std::string cfg = slow_config(dir, 60);
    auto r = run_in_dir("train " + cfg + " --set io.out_dir=" + dir + "/full");
    ASSERT_EQ(r.code, 0) << r.output;
    {
        Child c("train " + cfg, dir + "/log.txt");
        ASSERT_TRUE(wait_for_lines(dir + "/out/metrics.jsonl", "\"loss\"", 3))
            << read_file(dir + "/log.txt");
        kill(c.pid, SIGTERM);
        int status = c.wait(60s);
        const std::string log = read_file(dir + "/log.txt");
        ASSERT_TRUE(WIFEXITED(status)) << status << "\n" << log;
        EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << log;
        EXPECT_NE(log.find("stopped by SIGTERM after step"), std::string::npos) << log;
        EXPECT_NE(log.find("memtrain train --resume " + dir + "/out"), std::string::npos) << log;
        EXPECT_EQ(log.find("memory breakdown"), std::string::npos) << log;
    }
    auto first = losses_logged_once(dir + "/out/metrics.jsonl");
    ASSERT_LT(first.size(), 60u) << "the run ended before the signal";
    const std::string latest = read_file(dir + "/out/latest");
    EXPECT_EQ(latest, "ckpt_" + std::string(6 - std::to_string(first.size()).size(), '0') +
                          std::to_string(first.size()) + "\n");
    r = run_in_dir("train --resume " + dir + "/out");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(losses_logged_once(dir + "/out/metrics.jsonl"),
              losses_logged_once(dir + "/full/metrics.jsonl"));
}

TEST(TrainCli, SecondSignalExitsAtOnceWithoutACheckpoint) {
    auto dir = memtrain::test::temp_dir("train_cli_sigterm2");
    // Steps of tens of milliseconds: the second signal lands while the first step still runs.
    const std::string cfg = slow_config(dir, 100000, 256);
    Child c("train " + cfg, dir + "/log.txt");
    ASSERT_TRUE(wait_for_lines(dir + "/out/metrics.jsonl", "\"loss\"", 1))
        << read_file(dir + "/log.txt");
    kill(c.pid, SIGINT);
    ASSERT_TRUE(wait_for_lines(dir + "/log.txt", "signal received", 1));
    const auto t0 = std::chrono::steady_clock::now();
    kill(c.pid, SIGINT);
    int status = c.wait(60s);
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
    ASSERT_NE(status, -1) << "still running after the second signal";
    ASSERT_TRUE(WIFSIGNALED(status)) << status << "\n" << read_file(dir + "/log.txt");
    EXPECT_EQ(WTERMSIG(status), SIGINT);
    // Nothing promoted: no checkpoint directory, no `latest`.
    for (const auto& e : fs::directory_iterator(dir + "/out"))
        EXPECT_NE(e.path().filename().string().rfind("ckpt_", 0), 0u) << e.path();
    EXPECT_FALSE(fs::exists(dir + "/out/latest"));
}

TEST(TrainCli, ClearErrorsForConfigMistakes) {
    auto dir = memtrain::test::temp_dir("train_cli_errors");
    const std::string cfg = slow_config(dir, 2, 16);
    // No CONFIG and no --resume.
    auto r = run_in_dir("train");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("needs a CONFIG"), std::string::npos) << r.output;
    // A directory as CONFIG; one holding a run points at --resume.
    r = run_in_dir("train " + dir);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is a directory; memtrain train expects a TOML file"),
              std::string::npos)
        << r.output;
    ASSERT_EQ(run_in_dir("train " + cfg).code, 0);
    r = run_in_dir("train " + dir + "/out");
    EXPECT_NE(r.output.find("memtrain train --resume " + dir + "/out"), std::string::npos)
        << r.output;
    // io.out_dir that cannot be created or written: the key, the path and the reason.
    write_file(dir + "/afile", "x");
    r = run_in_dir("train " + cfg + " --set io.out_dir=" + dir + "/afile/out");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("io.out_dir = \"" + dir + "/afile/out\": cannot create the directory"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("Not a directory"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("internal error"), std::string::npos) << r.output;
    r = run_in_dir("train " + cfg + " --set io.out_dir=/proc/memtrain_out");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("io.out_dir = \"/proc/memtrain_out\""), std::string::npos) << r.output;
    // Keys in the wrong section, or a misspelt section.
    write_file(dir + "/lr.toml", "[train]\nlr = 1e-3\n");
    r = run_in_dir("train " + dir + "/lr.toml");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("unknown config key 'train.lr'; did you mean 'optim.lr'?"),
              std::string::npos)
        << r.output;
    write_file(dir + "/optimizer.toml", "[optimizer]\nlr = 1e-3\n");
    r = run_in_dir("train " + dir + "/optimizer.toml");
    EXPECT_NE(r.output.find("did you mean 'optim.lr'?"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("[optim]"), std::string::npos) << r.output;
    write_file(dir + "/empty_section.toml", "[optimizer]\n");
    r = run_in_dir("train " + dir + "/empty_section.toml");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("unknown config section [optimizer]; did you mean [optim]?"),
              std::string::npos)
        << r.output;
    r = run_in_dir("train " + cfg + " --set trian.steps=3");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("did you mean 'train.max_steps'?"), std::string::npos) << r.output;
}

TEST(TrainCli, VersionAndShortConfigPrintout) {
    auto r = run_in_dir("--version");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(std::regex_search(
        r.output,
        std::regex(
            R"(^memtrain \d+\.\d+\.\d+ \(git ([0-9a-f]{4,}|unknown), \w+, CUDA (on|off)\)\n$)")))
        << r.output;
    auto dir = memtrain::test::temp_dir("train_cli_table");
    slow_config(dir, 1, 16);
    // The table prints the run's paths whole, so the run reads them through a short link: the
    // checkout's own path (a CI clone 150 characters deep) must not decide the table's width.
    const std::string link = "/tmp/memtrain-table-" + std::to_string(::getpid());
    fs::remove(link);
    fs::create_directory_symlink(dir, link);
    r = run_in_dir("train " + link + "/run.toml --set io.out_dir=" + link + "/out");
    fs::remove(link);
    ASSERT_EQ(r.code, 0) << r.output;
    // The config printout: a few lines per section, at most 100 columns, every key there.
    const auto begin = r.output.find("config (");
    const auto end = r.output.find("\ndevice: ");
    ASSERT_NE(begin, std::string::npos) << r.output;
    ASSERT_NE(end, std::string::npos) << r.output;
    const std::string table = r.output.substr(begin, end - begin);
    int lines = 0;
    std::istringstream in(table);
    for (std::string l; std::getline(in, l); lines++) EXPECT_LE(l.size(), 100u) << l;
    EXPECT_LE(lines, 22) << table;
    for (const char* key : {"n_layer=2", "max_steps=1", "lr=0.003", "out_dir=", "top_k=40"})
        EXPECT_NE(table.find(key), std::string::npos) << key << "\n" << table;
    r = run_in_dir("train " + dir + "/run.toml --print-config");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("[model]\nn_layer = 2\n"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("step "), std::string::npos) << "--print-config does not train";
}

// On a CPU without bf16 instructions (oneDNN told so by DNNL_MAX_CPU_ISA, as on an AVX2 machine):
// "auto" trains in fp32, and an explicit bf16 still runs, its GEMMs on fp32 FMAs over widened
// operands, and says so.
TEST(TrainCli, CpuBf16WithoutBf16InstructionsSaysSoAndAutoIsFp32) {
    auto dir = memtrain::test::temp_dir("train_cli_no_bf16");
    const std::string cfg = slow_config(dir, 1, 16);
    const std::string bin = "DNNL_MAX_CPU_ISA=AVX2 timeout -k 5 120 " + std::string(MT_BINARY_DIR) +
                            "/memtrain train " + cfg;
    auto r = memtrain::test::run_command(bin + " --set train.precision=auto io.out_dir=" + dir +
                                         "/auto");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("device: cpu (fp32)"), std::string::npos) << r.output;
    r = memtrain::test::run_command(bin + " --set train.precision=bf16 io.out_dir=" + dir +
                                    "/bf16");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("fp32 FMAs: no bf16 instructions on this CPU"), std::string::npos)
        << r.output;
}
