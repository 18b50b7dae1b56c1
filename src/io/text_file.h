// Whole-file text reads and writes with errors that name the file: the small files beside
// checkpoints and reports (config.json, memtrain.toml, latest, memory.json, report.html).
#pragma once

#include <filesystem>
#include <string>

namespace memtrain::io {

std::string read_text_file(const std::filesystem::path& path);
void write_text_file(const std::filesystem::path& path, const std::string& text);
// Through a temporary name in the same directory, renamed into place: readers never see half a
// file, and a failure leaves the old one.
void write_text_file_atomically(const std::filesystem::path& path, const std::string& text);

}  // namespace memtrain::io
