// Helpers shared by the data tests: a per-test scratch directory, file helpers, the tokenize
// commands in-process and the GPT-2 file location.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include "cli/commands.h"

namespace memtrain::data::testing {

// A fresh directory under the system temp dir, named after the running test and process.
inline std::filesystem::path scratch_dir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    auto dir = std::filesystem::temp_directory_path() /
               (std::string("memtrain_") + info->test_suite_name() + "_" + info->name() + "_" +
                std::to_string(::getpid()));
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    return dir;
}

inline void write_file(const std::filesystem::path& path, const std::string& text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
}

// The whole file's bytes ("" if it cannot be read).
inline std::string read_file(const std::filesystem::path& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), {});
}

// Parses `command_line` ("tokenize ..." or "tokenizer ...") as memtrain's tokenize commands and
// runs it in this process.
inline void run_cli(const std::string& command_line) {
    CLI::App app{"memtrain"};
    app.require_subcommand(1);
    cli::register_tokenize(app);
    app.parse(command_line, false);
}

inline std::string gpt2_dir() {
    return std::string(MT_SOURCE_DIR) + "/third_party/gpt2";
}

}  // namespace memtrain::data::testing
