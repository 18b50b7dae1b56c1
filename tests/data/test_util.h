// Helpers shared by the data tests: a per-test scratch directory and the GPT-2 file location.
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include <gtest/gtest.h>
#include <unistd.h>

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

inline std::string gpt2_dir() {
    return std::string(MT_SOURCE_DIR) + "/third_party/gpt2";
}

}  // namespace memtrain::data::testing
