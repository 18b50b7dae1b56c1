// The reliability trial of 2026-11-26 (shared/research/reliability-trial-2026-11-26.md) as
// tests through the binary: hostile inputs give one line and exit 1 (never a crash, a hang or
// unbounded memory), one run owns an out_dir, paths read from files stay inside it, outputs are
// replaced without a window where neither exists, and no bad state is kept. Every command runs
// under `timeout`, every wait is bounded, nothing depends on the machine's speed.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli/cli_util.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace memtrain {
namespace {

using test::Child;
using test::CliResult;
using test::count_occurrences;
using test::read_file;
using test::write_file;

const std::string kBin = std::string(MT_BINARY_DIR) + "/memtrain";

// memtrain ARGS to completion (at most 120 s), one thread; stdout and stderr together.
CliResult run_with_env(const std::string& args, const std::string& env = "") {
    return test::run_command(env + " OMP_NUM_THREADS=1 timeout -k 5 120 " + kBin + " " + args);
}

// Waits (at most 90 s) until `file` contains `what`.
bool wait_for(const std::string& file, const std::string& what) {
    const auto end = std::chrono::steady_clock::now() + 90s;
    while (std::chrono::steady_clock::now() < end) {
        if (read_file(file).find(what) != std::string::npos) return true;
        std::this_thread::sleep_for(5ms);
    }
    return false;
}

// A tiny run's TOML in dir/run.toml over dir/train.bin (vocabulary 50), out_dir dir/out.
std::string one_layer_config(const std::string& dir, int steps = 4, const std::string& extra = "") {
    data::write_shard(dir + "/train.bin", test::patterned_tokens(1 << 14, 50, 1), 50);
    write_file(dir + "/run.toml",
               "[model]\nn_layer = 1\nn_head = 2\nn_embd = 16\nblock_size = 16\n"
               "vocab_size = 50\nvocab_pad = 16\n"
               "[train]\ndevice = \"cpu\"\nseq_len = 8\nbatch_size = 2\nmax_steps = " +
                   std::to_string(steps) +
                   "\neval_every = 0\nthreads = 1\n[optim]\nlr = 3e-3\nwarmup_steps = 1\n"
                   "[data]\ntrain = \"train.bin\"\n[io]\nout_dir = \"" +
                   dir + "/out\"\n[sample]\nmax_tokens = 0\n" + extra);
    return dir + "/run.toml";
}

// Every file under `dir` (but the lock file, which each run that takes the lock rewrites) with
// a hash of its bytes, to show that a refused command touched nothing.
// ------------------------------------------------------------------------------------------
// Crashes

TEST(HardeningCli, DeepTomlIsOneLineNotACrash) {
    const std::string dir = test::temp_dir("hard_deep_toml");
    const std::string cfg = one_layer_config(dir, 2);
    std::string dotted, tables = "[";
    for (int i = 0; i < 50000; i++) dotted += i ? ".a" : "a";
    for (int i = 0; i < 60000; i++) tables += i ? ".t" : "t";
    write_file(dir + "/deep.toml", dotted + " = 1\n");
    write_file(dir + "/deeptab.toml", tables + "]\n");
    for (const char* f : {"/deep.toml", "/deeptab.toml"}) {
        auto r = run_with_env("train " + dir + f + " --print-config");
        EXPECT_EQ(r.code, 1) << f << ": " << r.output;
        EXPECT_NE(r.output.find("dotted parts"), std::string::npos) << r.output;
    }
    // The same key in a checkpoint's memtrain.toml: sample, resume and quantize refuse it.
    auto r = run_with_env("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string toml = dir + "/out/ckpt_000002/memtrain.toml";
    write_file(toml, dotted + " = 1\n" + read_file(toml));
    for (const std::string& args :
         {"sample " + dir + "/out --max-tokens 2", "train --resume " + dir + "/out",
          "quantize " + dir + "/out --method rtn --bits 4 --out " + dir + "/q"}) {
        r = run_with_env(args);
        EXPECT_EQ(r.code, 1) << args << ": " << r.output;
        EXPECT_NE(r.output.find("memtrain.toml"), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("dotted parts"), std::string::npos) << r.output;
    }
    // A config of more than 1 MiB (a 2 MiB sample.prompt) is refused before it is parsed.
    write_file(dir + "/big.toml", "[sample]\nprompt = \"" + std::string(2 << 20, 'x') + "\"\n");
    r = run_with_env("train " + dir + "/big.toml --print-config");
    EXPECT_EQ(r.code, 1) << r.output.substr(0, 300);
    EXPECT_NE(r.output.find("more than the 1048576 bytes"), std::string::npos)
        << r.output.substr(0, 300);
    EXPECT_LT(r.output.size(), 1000u);
}

// ffn_hidden = 1431655766 with SwiGLU made fc_dim() = 2 H wrap in an int: the parameter buffer
// was sized for ~300 k floats and init_gpt2_weights wrote past it (under the sanitizer build
// this test is a heap-buffer-overflow report on today's main). Now a bound, before any layout.
TEST(HardeningCli, HugeModelDimensionsAreRefusedBeforeAnyLayout) {
    const std::string dir = test::temp_dir("hard_ffn");
    const std::string cfg = one_layer_config(dir, 1);
    auto r = run_with_env("train " + cfg +
                          " --set model.n_layer=1 model.n_embd=64 model.n_head=2 train.seq_len=2 "
                          "model.block_size=2 train.batch_size=1 model.activation=swiglu "
                          "model.ffn_hidden=1431655766 model.bias=false");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("model.ffn_hidden = 1431655766 is more than memtrain supports"),
              std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/out/metrics.jsonl"));
    // A config.json of 10^9 layers: refused at once, not a layout grown to gigabytes.
    fs::create_directories(dir + "/hf");
    write_file(dir + "/hf/config.json",
               R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1000000000,
                   "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 50})");
    for (const std::string& cmd :
         {"sample " + dir + "/hf --max-tokens 1",
          "quantize " + dir + "/hf --method rtn --bits 4 --out " + dir + "/q",
          "estimate " + dir + "/hf"}) {
        r = run_with_env(cmd);
        EXPECT_EQ(r.code, 1) << cmd << ": " << r.output;
        EXPECT_NE(r.output.find("1000000000 is more than memtrain supports"), std::string::npos)
            << cmd << ": " << r.output;
    }
}

// ------------------------------------------------------------------------------------------
// Untrusted files: FIFOs and /dev/zero, everywhere a file is read

TEST(HardeningCli, FifoAndDevZeroAreRefusedBeforeTheyAreRead) {
    const std::string dir = test::temp_dir("hard_fifo");
    const std::string cfg = one_layer_config(dir, 1);
    const std::string fifo = dir + "/fifo";
    ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
    // A model directory whose files are links to the special files (a cloned repo can hold
    // such links).
    auto r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/ck");
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string& special : {fifo, std::string("/dev/zero")}) {
        SCOPED_TRACE(special);
        const auto t0 = std::chrono::steady_clock::now();
        std::vector<std::string> cmds = {
            "train " + special + " --print-config",
            "train " + cfg + " --set data.train=" + special,
            "train " + cfg + " --set data.tokenizer=" + special,
            "tokenizer encode --tokenizer " + special + " hello",
        };
        const std::string hf = dir + "/hf_" + fs::path(special).filename().string();
        fs::create_directories(hf);
        fs::create_symlink(special, hf + "/config.json");
        cmds.push_back("sample " + hf + " --max-tokens 1");
        for (const auto& c : cmds) {
            r = run_with_env(c);
            EXPECT_EQ(r.code, 1) << c << ": " << r.output;
            EXPECT_NE(r.output.find("not a regular file"), std::string::npos)
                << c << ": " << r.output;
        }
        // None waited for a writer or read until memory ran out (each would take the whole
        // 120 s timeout; all of them together take a few seconds).
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 100s);
    }
}

// ------------------------------------------------------------------------------------------
// One writer per output

TEST(HardeningCli, TwoConcurrentRunsOfOneOutDirTheSecondFailsFast) {
    const std::string dir = test::temp_dir("hard_lock");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    // Run A resumes and keeps going (until signalled); B resumes the same out_dir meanwhile.
    Child a("train --resume " + dir + "/out --set train.max_steps=1000000 io.checkpoint_every=1",
            dir + "/a.log");
    ASSERT_TRUE(wait_for(dir + "/a.log", "step     3/")) << read_file(dir + "/a.log");
    const auto before = read_file(dir + "/out/metrics.jsonl");
    r = run_with_env("train --resume " + dir + "/out --set optim.lr=5e-4 train.max_steps=1000000");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is in use by pid " + std::to_string(a.pid)), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("resumed from"), std::string::npos) << r.output;
    // A new run into it (even with --overwrite) fails the same way and removes nothing.
    r = run_with_env("train " + cfg + " --overwrite");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("is in use by pid"), std::string::npos) << r.output;
    kill(a.pid, SIGTERM);
    const int status = a.wait(90s);
    ASSERT_TRUE(WIFEXITED(status)) << status << read_file(dir + "/a.log");
    EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_file(dir + "/a.log");
    // Only A wrote: its metrics are one run's (no step twice), and every checkpoint has A's lr.
    const std::string metrics = read_file(dir + "/out/metrics.jsonl");
    EXPECT_EQ(metrics.rfind(before, 0), 0u) << "the metrics written before B started changed";
    for (int s = 1; s < 20; s++)
        EXPECT_LE(count_occurrences(metrics, "{\"step\": " + std::to_string(s) + ", \"loss\""), 1)
            << s;
    for (const auto& e : fs::directory_iterator(dir + "/out")) {
        const std::string name = e.path().filename().string();
        if (name.rfind("ckpt_", 0) == 0) {
            EXPECT_NE(read_file(e.path().string() + "/memtrain.toml").find("lr = 0.003\n"),
                      std::string::npos)
                << name;
        }
        EXPECT_EQ(name.find(".tmp"), std::string::npos) << name;
    }
    // Once A is gone the lock is free again.
    r = run_with_env("train --resume " + dir + "/out --stop-after 1");
    EXPECT_EQ(r.code, 0) << r.output;
}

TEST(HardeningCli, ANewRunIntoAnotherRunsOutDirIsRefusedUnlessOverwrite) {
    const std::string dir = test::temp_dir("hard_newrun");
    const std::string cfg = one_layer_config(dir, 4);
    auto r = run_with_env("train " + cfg + " --set io.checkpoint_every=2");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto old = test::dir_snapshot(dir + "/out");
    r = run_with_env("train " + cfg + " --set train.seed=99 train.max_steps=2");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("holds another run"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--overwrite"), std::string::npos) << r.output;
    EXPECT_EQ(test::dir_snapshot(dir + "/out"), old) << "the refused run changed the out_dir";
    // A fork: a resume into another directory that holds a run is refused too; into a new
    // directory it is fine.
    r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/other");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("train --resume " + dir + "/out --set io.out_dir=" + dir + "/other");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("holds another run"), std::string::npos) << r.output;
    r = run_with_env("train --resume " + dir + "/out/ckpt_000002 --set io.out_dir=" + dir +
                     "/fork");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir + "/fork/ckpt_000004/model.safetensors"));
    // --overwrite replaces the old run whole: no checkpoint of it stays beside the new ones.
    r = run_with_env("train " + cfg + " --set train.seed=99 train.max_steps=2 --overwrite");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(dir + "/out/ckpt_000002"));
    EXPECT_FALSE(fs::exists(dir + "/out/ckpt_000004"));
    EXPECT_EQ(read_file(dir + "/out/latest"), "ckpt_000002\n");
    EXPECT_EQ(count_occurrences(read_file(dir + "/out/metrics.jsonl"), "\"loss\""), 2);
}

TEST(HardeningCli, PathsReadFromFilesStayInsideTheOutDir) {
    const std::string dir = test::temp_dir("hard_paths");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/victim");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/myrun");
    ASSERT_EQ(r.code, 0) << r.output;
    const auto victim = test::dir_snapshot(dir + "/victim");
    // `latest` naming another run's checkpoint.
    write_file(dir + "/myrun/latest", "../victim/ckpt_000002\n");
    r = run_with_env("train --resume " + dir + "/myrun --set train.max_steps=4");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("does not name a checkpoint"), std::string::npos) << r.output;
    EXPECT_EQ(test::dir_snapshot(dir + "/victim"), victim);
    write_file(dir + "/myrun/latest", "ckpt_000002\n");
    // io.metrics as a path: from --set, and from a checkpoint's memtrain.toml on resume.
    write_file(dir + "/precious.txt", "precious user data\n");
    r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/x io.metrics=../precious.txt");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("must be a plain file name"), std::string::npos) << r.output;
    r = run_with_env("train " + cfg + " --set io.out_dir=" + dir + "/x io.metrics=" + dir +
                     "/precious.txt");
    EXPECT_EQ(r.code, 1) << r.output;
    const std::string toml = dir + "/myrun/ckpt_000002/memtrain.toml";
    std::string t = read_file(toml);
    const auto at = t.find("metrics = 'metrics.jsonl'");
    ASSERT_NE(at, std::string::npos) << t;
    t.replace(at, 25, "metrics = '" + dir + "/precious.txt'");
    write_file(toml, t);
    r = run_with_env("train --resume " + dir + "/myrun --set train.max_steps=3");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("must be a plain file name"), std::string::npos) << r.output;
    EXPECT_EQ(read_file(dir + "/precious.txt"), "precious user data\n");
    EXPECT_EQ(test::dir_snapshot(dir + "/victim"), victim);
}

TEST(HardeningCli, ADanglingLatestFallsBackToTheNewestCompleteCheckpoint) {
    const std::string dir = test::temp_dir("hard_dangling");
    const std::string cfg = one_layer_config(dir, 3);
    auto r = run_with_env("train " + cfg + " --set io.checkpoint_every=1");
    ASSERT_EQ(r.code, 0) << r.output;
    // As after a power cut between the rename of ckpt_000004 and the sync: latest names it.
    write_file(dir + "/out/latest", "ckpt_000004\n");
    r = run_with_env("train --resume " + dir + "/out --set train.max_steps=4");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("latest names ckpt_000004, which is missing; using ckpt_000003"),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("at step 3"), std::string::npos) << r.output;
    EXPECT_EQ(read_file(dir + "/out/latest"), "ckpt_000004\n");
    // An empty latest (the rename's data lost): the same.
    write_file(dir + "/out/latest", "");
    r = run_with_env("eval " + dir + "/out --data " + dir +
                     "/train.bin --seq-len 8 --max-batches 1");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("latest is empty; using ckpt_000004"), std::string::npos) << r.output;
}

// ------------------------------------------------------------------------------------------
// Replacing outputs: quantize --out, lora merge --out, tokenize --out

// quantize (or lora merge) killed -9 inside the replace window (a test pause there): --out is
// the old output or the new one, whole, and the next run works.
void kill_in_replace_window(const std::string& dir, const std::string& command,
                            const std::string& out, const std::string& marker) {
    const std::string pause = "MEMTRAIN_TEST_PAUSE_AT=replace-output";
    Child c(command, dir + "/pause.log", pause);
    ASSERT_TRUE(wait_for(dir + "/pause.log", "test pause at replace-output"))
        << read_file(dir + "/pause.log");
    kill(c.pid, SIGKILL);
    c.wait(30s);
    ASSERT_TRUE(fs::exists(out + "/" + marker)) << command;
    ASSERT_TRUE(fs::exists(out + "/model.safetensors")) << command;
    EXPECT_NO_THROW(io::SafetensorsFile::open(out + "/model.safetensors"));
    auto r =
        run_with_env("eval " + out + " --data " + dir + "/train.bin --seq-len 8 --max-batches 1");
    EXPECT_EQ(r.code, 0) << r.output;
    r = run_with_env(command);
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_TRUE(fs::exists(out + "/" + marker));
}

TEST(HardeningCli, QuantizeReplacesItsOutputWithoutAWindowAndKeepsForeignTemporaries) {
    const std::string dir = test::temp_dir("hard_quant");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string q = dir + "/q";
    // An OUT.tmp memtrain did not make stays; a trailing slash is the same --out.
    fs::create_directories(q + ".tmp");
    write_file(q + ".tmp/keep.txt", "mine\n");
    r = run_with_env("quantize " + dir + "/out --method rtn --bits 4 --out " + q + "/");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("quantize " + dir + "/out --method rtn --bits 8 --out " + q + "/");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(read_file(q + "/quantization.json").find("\"bits\": 8"), std::string::npos);
    EXPECT_EQ(read_file(q + ".tmp/keep.txt"), "mine\n");
    kill_in_replace_window(dir, "quantize " + dir + "/out --method rtn-asym --bits 4 --out " + q, q,
                           "quantization.json");
    EXPECT_EQ(read_file(q + ".tmp/keep.txt"), "mine\n");
}

TEST(HardeningCli, LoraMergeReplacesItsOutputWithoutAWindow) {
    const std::string dir = test::temp_dir("hard_merge");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg + " --set lora.rank=2 io.out_dir=" + dir + "/lora");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("lora merge " + dir + "/lora --out " + dir + "/m/");
    ASSERT_EQ(r.code, 0) << r.output;
    kill_in_replace_window(dir, "lora merge " + dir + "/lora --out " + dir + "/m", dir + "/m",
                           "lora_merge.json");
}

TEST(HardeningCli, QuantizeRefusesNonFiniteWeights) {
    const std::string dir = test::temp_dir("hard_quant_nan");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    // Poison one weight of a block linear in place (its bytes in the file).
    const std::string model = dir + "/out/ckpt_000002/model.safetensors";
    std::size_t at = 0;  // the tensor's first byte in the file: 8 + header + its offset
    {
        const std::string bytes = read_file(model);
        uint64_t header = 0;
        for (int i = 0; i < 8; i++) header |= (uint64_t)(unsigned char)bytes[i] << (8 * i);
        const auto f = io::SafetensorsFile::open(model);
        at = 8 + header + f.get("h.0.attn.c_attn.weight").begin;
    }
    std::fstream io(model, std::ios::in | std::ios::out | std::ios::binary);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    io.seekp((std::streamoff)at);
    io.write(reinterpret_cast<const char*>(&nan), 4);
    io.close();
    r = run_with_env("quantize " + dir + "/out --method rtn --bits 4 --out " + dir + "/q");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("h.0.attn.c_attn.weight holds 1 non-finite values"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/q"));
}

TEST(HardeningCli, TokenizeReplacesTrainAndValAsAPair) {
    const std::string dir = test::temp_dir("hard_tokenize");
    write_file(dir + "/a.txt", test::small_corpus());
    std::string other = test::small_corpus();
    for (auto& ch : other)
        if (ch == 'e') ch = 'q';
    write_file(dir + "/b.txt", other);
    auto r = run_with_env("tokenizer train --vocab-size 300 --doc-separator % --out " + dir +
                          "/ta.json " + dir + "/a.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("tokenizer train --vocab-size 290 --doc-separator % --out " + dir +
                     "/tb.json " + dir + "/b.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string tok = " --doc-separator % --val-fraction 0.2 --out " + dir + "/data ";
    r = run_with_env("tokenize --tokenizer " + dir + "/ta.json" + tok + dir + "/a.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    // Killed between the two renames: train.bin is B's, val.bin still A's.
    {
        Child c("tokenize --tokenizer " + dir + "/tb.json" + tok + dir + "/b.txt",
                dir + "/pause.log", "MEMTRAIN_TEST_PAUSE_AT=tokenize-pair");
        ASSERT_TRUE(wait_for(dir + "/pause.log", "test pause at tokenize-pair"))
            << read_file(dir + "/pause.log");
        kill(c.pid, SIGKILL);
        c.wait(30s);
    }
    // The mixed pair is refused (even without data.tokenizer, which would catch it otherwise).
    const std::string cfg = one_layer_config(dir, 1);
    const std::string sets = " --set model.vocab_size=300 data.train=" + dir +
                             "/data/train.bin data.val=" + dir + "/data/val.bin";
    r = run_with_env("train " + cfg + sets);
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("was interrupted while replacing train.bin and val.bin"),
              std::string::npos)
        << r.output;
    r = run_with_env("tokenize --tokenizer " + dir + "/tb.json" + tok + dir + "/b.txt");
    ASSERT_EQ(r.code, 0) << r.output;
    r = run_with_env("train " + cfg + sets);
    EXPECT_EQ(r.code, 0) << r.output;
    // The killed run's temporary (of a process that is gone) was removed by the next run.
    for (const auto& e : fs::directory_iterator(dir + "/data"))
        EXPECT_EQ(e.path().filename().string().find(".new"), std::string::npos) << e.path();
}

// ------------------------------------------------------------------------------------------
// Bad state is never kept

TEST(HardeningCli, NonFiniteOptimizerKeysAreRefused) {
    const std::string dir = test::temp_dir("hard_lr_inf");
    const std::string cfg = one_layer_config(dir, 2);
    for (const char* set : {"optim.lr=inf", "optim.lr=nan", "optim.weight_decay=-inf",
                            "optim.beta2=nan", "optim.grad_clip=inf"}) {
        auto r = run_with_env("train " + cfg + " --set " + set + " io.checkpoint_every=1");
        EXPECT_EQ(r.code, 1) << set << ": " << r.output;
        EXPECT_NE(r.output.find("must be a finite number"), std::string::npos) << r.output;
    }
    std::string t = read_file(cfg);
    t.replace(t.find("lr = 3e-3"), 9, "lr = inf");
    write_file(dir + "/inf.toml", t);
    auto r = run_with_env("train " + dir + "/inf.toml");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("optim.lr = inf must be a finite number"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/out/latest"));
}

// A full disk while logging metrics: a warning, and metrics.jsonl ends in a complete line. The
// disk is a file-size limit here (it runs anywhere); MetricsFullTmpfs below uses a real tmpfs
// where the test may mount one.
void expect_metrics_survive_a_full_disk(const std::string& dir, const std::string& out_dir,
                                        rlim_t file_limit) {
    const std::string cfg = one_layer_config(dir, 400);
    // (The limit holds for the log too: one step line, at the end.)
    Child c("train " + cfg + " --set io.out_dir=" + out_dir +
                " io.save_final=false train.log_every=1000",
            dir + "/full.log", "", file_limit);
    const int status = c.wait(110s);
    const std::string log = read_file(dir + "/full.log");
    ASSERT_TRUE(WIFEXITED(status)) << status << log;
    EXPECT_EQ(WEXITSTATUS(status), 0) << log;
    EXPECT_NE(log.find("memtrain: warning: cannot write " + out_dir + "/metrics.jsonl"),
              std::string::npos)
        << log;
    EXPECT_NE(log.find("holds steps up to"), std::string::npos) << log;
    const std::string metrics = read_file(out_dir + "/metrics.jsonl");
    ASSERT_FALSE(metrics.empty());
    EXPECT_EQ(metrics.back(), '\n');
    std::istringstream in(metrics);
    int lines = 0;
    for (std::string l; std::getline(in, l); lines++) EXPECT_TRUE(nlohmann::json::accept(l)) << l;
    EXPECT_GT(lines, 0);
    EXPECT_LT(lines, 400);
    auto r = run_with_env("report " + out_dir + " --out " + dir + "/report.html");
    EXPECT_EQ(r.code, 0) << r.output;
}

TEST(HardeningCli, MetricsSurviveAFullDisk) {
    const std::string dir = test::temp_dir("hard_full_rlimit");
    expect_metrics_survive_a_full_disk(dir, dir + "/out", 6000);
}

TEST(HardeningCli, MetricsFullTmpfs) {
    const std::string dir = test::temp_dir("hard_full_tmpfs");
    const std::string mnt = dir + "/mnt";
    fs::create_directories(mnt);
    if (geteuid() != 0 || mount("tmpfs", mnt.c_str(), "tmpfs", 0, "size=64k") != 0)
        GTEST_SKIP() << "cannot mount a tmpfs here (needs root in a privileged container)";
    // Fill it to the last few KB, so the metrics reach the end after some lines.
    {
        std::ofstream fill(mnt + "/fill", std::ios::binary);
        fill << std::string(64 * 1024 - 12 * 1024, 'x');
    }
    expect_metrics_survive_a_full_disk(dir, mnt + "/run", RLIM_INFINITY);
    umount2(mnt.c_str(), MNT_DETACH);
}

TEST(HardeningCli, ReportSkipsATornLastLineAndResumedStepsOnce) {
    const std::string dir = test::temp_dir("hard_report");
    const std::string cfg = one_layer_config(dir, 6);
    auto r = run_with_env("train " + cfg + " --set io.checkpoint_every=2");
    ASSERT_EQ(r.code, 0) << r.output;
    // As a run killed after step 6 mid-line, resumed from ckpt_000004: steps 5 and 6 re-run.
    std::string m = read_file(dir + "/out/metrics.jsonl");
    write_file(dir + "/out/metrics.jsonl", m + "{\"step\": 7, \"loss\": 3.1");
    r = run_with_env("report " + dir + "/out");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("the last line is incomplete"), std::string::npos) << r.output;
    r = run_with_env("train --resume " + dir + "/out/ckpt_000004 --set train.max_steps=6");
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("ended in an incomplete line"), std::string::npos) << r.output;
    m = read_file(dir + "/out/metrics.jsonl");
    EXPECT_NE(m.find("{\"step\": 4, \"event\": \"resume\"}\n"), std::string::npos) << m;
    EXPECT_EQ(m.find("\"step\": 7"), std::string::npos) << m;
    r = run_with_env("report " + dir + "/out");
    EXPECT_EQ(r.code, 0) << r.output;
    const std::string html = read_file(dir + "/out/report.html");
    EXPECT_NE(html.find("resumed from step 4"), std::string::npos);
}

TEST(HardeningCli, AResumeOnOtherDataOrGeometryIsRefusedUnlessAccepted) {
    const std::string dir = test::temp_dir("hard_resume_changes");
    const std::string cfg = one_layer_config(dir, 2);
    auto r = run_with_env("train " + cfg);
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string set :
         {"train.seq_len=4", "train.batch_size=4", "train.seed=7", "model.norm_eps=1e-3"}) {
        r = run_with_env("train --resume " + dir + "/out --set train.max_steps=3 " + set);
        EXPECT_EQ(r.code, 1) << set << ": " << r.output;
        EXPECT_NE(r.output.find(set.substr(0, set.find('=')) + " "), std::string::npos) << r.output;
        EXPECT_NE(r.output.find("--accept-changes"), std::string::npos) << r.output;
    }
    // The same path, other tokens (a smaller shard).
    data::write_shard(dir + "/train.bin", test::patterned_tokens(1 << 12, 50, 3), 50);
    r = run_with_env("train --resume " + dir + "/out --set train.max_steps=3");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("a data.train of 4096 tokens (was 16384)"), std::string::npos)
        << r.output;
    EXPECT_FALSE(fs::exists(dir + "/out/ckpt_000003"));
    r = run_with_env("train --resume " + dir +
                     "/out --set train.max_steps=3 train.seed=7 --accept-changes");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("continuing with changes"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("train.seed 7 (was 1337)"), std::string::npos) << r.output;
    // The same tokens at another path continue the run, and the run says where they are now.
    fs::copy_file(dir + "/train.bin", dir + "/moved.bin");
    r = run_with_env("train --resume " + dir +
                     "/out --set train.max_steps=4 train.seed=7 data.train=" + dir + "/moved.bin");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("data.train is now " + dir + "/moved.bin"), std::string::npos)
        << r.output;
}

// The same tokenizer path holding another tokenizer of the same vocabulary size (trained on
// another corpus): its fingerprint differs from the one the checkpoint recorded, and the resume
// is refused. The shard records no fingerprint (0), so only the resume's check can see it.
TEST(HardeningCli, AResumeWithAnotherTokenizerIsRefused) {
    const std::string dir = test::temp_dir("hard_resume_tokenizer");
    write_file(dir + "/a.txt", test::small_corpus());
    std::string other = test::small_corpus();
    for (auto& ch : other)
        if (ch == 'e') ch = 'q';
    write_file(dir + "/b.txt", other);
    for (const char* name : {"a", "b"}) {
        auto r =
            run_with_env(std::string("tokenizer train --vocab-size 280 --doc-separator % --out ") +
                         dir + "/t" + name + ".json " + dir + "/" + name + ".txt");
        ASSERT_EQ(r.code, 0) << r.output;
    }
    const auto ta = data::Tokenizer::load(dir + "/ta.json");
    const auto tb = data::Tokenizer::load(dir + "/tb.json");
    ASSERT_EQ(ta.vocab_size(), tb.vocab_size());  // (else the shard check refuses first)
    ASSERT_NE(ta.fingerprint(), tb.fingerprint());
    const std::string cfg = one_layer_config(dir, 2);
    const uint32_t vocab = (uint32_t)ta.vocab_size();
    data::write_shard(dir + "/train.bin", test::patterned_tokens(1 << 14, vocab, 1), vocab);
    fs::copy_file(dir + "/ta.json", dir + "/tok.json");
    auto r = run_with_env("train " + cfg + " --set model.vocab_size=" + std::to_string(vocab) +
                          " data.tokenizer=" + dir + "/tok.json");
    ASSERT_EQ(r.code, 0) << r.output;
    fs::copy_file(dir + "/tb.json", dir + "/tok.json", fs::copy_options::overwrite_existing);
    r = run_with_env("train --resume " + dir + "/out --set train.max_steps=3");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("data.tokenizer of fingerprint"), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("--accept-changes"), std::string::npos) << r.output;
    EXPECT_FALSE(fs::exists(dir + "/out/ckpt_000003"));
    // The tokenizer it was trained with: the resume goes on.
    fs::copy_file(dir + "/ta.json", dir + "/tok.json", fs::copy_options::overwrite_existing);
    r = run_with_env("train --resume " + dir + "/out --set train.max_steps=3");
    EXPECT_EQ(r.code, 0) << r.output;
}
}  // namespace
}  // namespace memtrain
