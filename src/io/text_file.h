// Whole-file text reads and writes with errors that name the file: the small files beside
// checkpoints and reports (config.json, memtrain.toml, latest, memory.json, report.html).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "core/regular_file.h"

namespace memtrain::io {

// Refuses what is not a regular file before opening it, and files over max_bytes.
std::string read_text_file(const std::filesystem::path& path,
                           std::size_t max_bytes = kMaxSmallFileBytes);
// Writes and fsyncs: once it returns, the bytes survive a power cut (the directory entry of a
// new file needs the directory synced too: sync_directory).
void write_text_file(const std::filesystem::path& path, const std::string& text);
// Through a temporary name of this process's own in the same directory, renamed into place and
// the directory synced: readers never see half a file, a failure leaves the old one, and two
// writers never share a temporary file.
void write_text_file_atomically(const std::filesystem::path& path, const std::string& text);
// fsync of a directory, so the renames and new entries in it are durable; errors are ignored
// (some file systems refuse fsync on a directory; the data itself was synced).
void sync_directory(const std::filesystem::path& dir);

}  // namespace memtrain::io
