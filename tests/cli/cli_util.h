// Running memtrain's binaries from tests: the exit code and everything a command printed, and
// small file helpers. Every command runs under `timeout`, so a hung binary fails its test
// instead of hanging the suite.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "data/shard.h"
#include "test_util.h"

namespace memtrain::test {

struct CliResult {
    int code;            // exit code; -1 when killed by a signal
    std::string output;  // stdout and stderr together
};

// Runs a shell command line; its stderr is merged into the output unless merge_stderr is false.
inline CliResult run_command(const std::string& command, bool merge_stderr = true) {
    std::FILE* p = popen((merge_stderr ? command + " 2>&1" : command).c_str(), "r");
    std::string out;
    std::array<char, 4096> buf;
    while (std::size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
    int status = pclose(p);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// `binary` (memtrain, or memtrain_sim for the CUDA simulator) with `args`, at most 120 s.
inline CliResult run_memtrain(const std::string& args, const std::string& binary = "memtrain") {
    return run_command("timeout -k 5 120 " + std::string(MT_BINARY_DIR) + "/" + binary + " " +
                       args);
}

// A background `memtrain ARGS` with its output in `log`: optionally an environment prefix
// ("NAME=value ...") and a file-size limit (RLIMIT_FSIZE, with SIGXFSZ ignored so a write past
// it fails with EFBIG, as on a full disk). Killed at the end of the test if still running.
struct Child {
    pid_t pid = -1;
    std::string log;
    Child(const std::string& args, const std::string& log_path, const std::string& env = "",
          rlim_t file_limit = RLIM_INFINITY)
        : log(log_path) {
        pid = fork();
        if (pid == 0) {
            if (file_limit != RLIM_INFINITY) {
                signal(SIGXFSZ, SIG_IGN);
                struct rlimit rl {
                    file_limit, file_limit
                };
                setrlimit(RLIMIT_FSIZE, &rl);
            }
            const std::string cmd = env + " OMP_NUM_THREADS=1 exec " + std::string(MT_BINARY_DIR) +
                                    "/memtrain " + args + " > " + log + " 2>&1";
            execl("/bin/sh", "sh", "-c", cmd.c_str(), (char*)nullptr);
            _exit(127);
        }
    }
    Child(const Child&) = delete;
    Child& operator=(const Child&) = delete;
    // The wait status, or -1 if it did not end within `limit`.
    int wait(std::chrono::milliseconds limit) {
        const auto end = std::chrono::steady_clock::now() + limit;
        int status = 0;
        while (std::chrono::steady_clock::now() < end) {
            if (waitpid(pid, &status, WNOHANG) == pid) {
                pid = -1;
                return status;
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        return -1;
    }
    ~Child() {
        if (pid > 0) {
            kill(pid, SIGKILL);
            waitpid(pid, nullptr, 0);
        }
    }
};

inline std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

inline void write_file(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
}

// Every regular file under `dir` (but the out_dir's .lock) -> a hash of its bytes and, with
// `with_mtime`, of its modification time: equal snapshots mean no file was added, removed or
// changed (or, with mtimes, written at all).
inline std::map<std::string, std::size_t> dir_snapshot(const std::string& dir,
                                                       bool with_mtime = false) {
    std::map<std::string, std::size_t> out;
    for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
        if (e.is_regular_file() && e.path().filename() != ".lock") {
            std::size_t h = std::hash<std::string>{}(read_file(e.path().string()));
            if (with_mtime)
                h ^= std::hash<long long>{}(
                    (long long)e.last_write_time().time_since_epoch().count());
            out[e.path().string()] = h;
        }
    return out;
}

// How many times `what` occurs in `text` (overlapping occurrences counted).
inline int count_occurrences(const std::string& text, const std::string& what) {
    int n = 0;
    for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) n++;
    return n;
}

// A run a few milliseconds a step, long enough to be signalled in the middle; no validation.
// Writes dir/train.bin and dir/run.toml (out_dir dir/out) and returns the TOML's path.
// fp32 on every machine (the data-parallel comparisons hold fp32 tolerances).
inline std::string slow_config(const std::string& dir, int steps, int width = 64) {
    data::write_shard(dir + "/train.bin", patterned_tokens(1 << 16, 50, 1), 50);
    write_file(dir + "/run.toml",
               "[model]\nn_layer = 2\nn_head = 2\nn_embd = " + std::to_string(width) +
                   "\nblock_size = 32\nvocab_size = 50\nvocab_pad = 16\n"
                   "[train]\ndevice = \"cpu\"\nprecision = \"fp32\"\nseq_len = 32\nbatch_size = "
                   "8\nmax_steps = " +
                   std::to_string(steps) +
                   "\neval_every = 0\n[optim]\nlr = 3e-3\nwarmup_steps = 2\n"
                   "[data]\ntrain = \"train.bin\"\n[io]\nout_dir = \"" +
                   dir +
                   "/out\"\n"
                   "[sample]\nmax_tokens = 0\n");
    return dir + "/run.toml";
}

// A few hundred lines of English with `%` document separators, for tokenizer and shard tests.
inline std::string small_corpus() {
    std::string s;
    const char* lines[] = {
        "The quick brown fox jumps over the lazy dog.\n",
        "A journey of a thousand miles begins with a single step.\n",
        "All that glitters is not gold; all who wander are not lost.\n",
        "To be, or not to be, that is the question.\n",
    };
    for (int i = 0; i < 400; i++) {
        s += lines[i % 4];
        if (i % 3 == 2) s += "%\n";
    }
    return s;
}

// Writes `text` to dir/corpus.txt (documents separated by `%` lines), trains dir/tok.json with
// `vocab` tokens on it and tokenizes it into dir/train.bin and dir/val.bin (10% validation), all
// through the binary. Returns the first step that failed, else the last step's result.
inline CliResult tokenize_corpus(const std::string& dir, const std::string& text, int vocab) {
    write_file(dir + "/corpus.txt", text);
    CliResult r =
        run_memtrain("tokenizer train --vocab-size " + std::to_string(vocab) +
                     " --doc-separator % --out " + dir + "/tok.json " + dir + "/corpus.txt");
    if (r.code != 0) return r;
    return run_memtrain("tokenize --tokenizer " + dir + "/tok.json --out " + dir +
                        " --doc-separator % --val-fraction 0.1 " + dir + "/corpus.txt");
}

// The held-out loss `memtrain eval MODEL --data VAL --seq-len 16 --json` prints (NaN, and a test
// failure, when it fails).
inline double eval_loss(const std::string& model, const std::string& val) {
    auto r = run_memtrain("eval " + model + " --data " + val + " --seq-len 16 --json");
    EXPECT_EQ(r.code, 0) << r.output;
    if (r.code != 0) return NAN;
    return nlohmann::json::parse(r.output)["loss"].get<double>();
}

}  // namespace memtrain::test
