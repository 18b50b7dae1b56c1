// Running memtrain's binaries from tests: the exit code and everything a command printed, and
// small file helpers. Every command runs under `timeout`, so a hung binary fails its test
// instead of hanging the suite.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

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
