// Running the `memtrain` binary from tests: its exit code and everything it printed.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <string>

namespace memtrain::test {

struct CliResult {
    int code;
    std::string output;  // stdout and stderr together
};

inline CliResult run_memtrain(const std::string& args, const std::string& binary = "memtrain") {
    std::string cmd = std::string(MT_BINARY_DIR) + "/" + binary + " " + args + " 2>&1";
    std::FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    std::array<char, 4096> buf;
    while (std::size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
    int status = pclose(p);
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
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

}  // namespace memtrain::test
