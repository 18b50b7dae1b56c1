// Runs a Python reference script with the system interpreter (/usr/bin/python3, where Debian's
// python3-regex lives) for the tokenizer tests; a missing `regex` module is a failure, not a skip.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "test_util.h"

namespace memtrain::data::testing {

// Exit status the scripts use when `import regex` fails.
inline constexpr int kNoRegexModule = 3;

// Writes `script` into `dir`, runs it with `args`, and returns its stdout; fails the test on a
// non-zero exit.
inline std::string run_python(const std::filesystem::path& dir, const std::string& script,
                              const std::string& args) {
    const auto path = dir / "reference.py";
    write_file(path, script);
    // stderr stays apart (it reaches the test's output) so that a warning cannot corrupt the
    // lines the test parses.
    const std::string cmd = "/usr/bin/python3 " + path.string() + " " + args;
    std::FILE* p = popen(cmd.c_str(), "r");
    if (!p) {
        ADD_FAILURE() << "cannot run " << cmd;
        return {};
    }
    std::string out;
    std::array<char, 1 << 16> buf;
    while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
    const int status = pclose(p);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == kNoRegexModule) {
        ADD_FAILURE() << "/usr/bin/python3 has no `regex` module: install python3-regex "
                         "(bash scripts/deps.sh)";
        return {};
    }
    if (code != 0) {
        ADD_FAILURE() << cmd << " exited with " << code << " (its stderr is above)";
        return {};
    }
    return out;
}

}  // namespace memtrain::data::testing
