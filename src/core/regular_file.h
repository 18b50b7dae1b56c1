// Reading files that come from outside (configs, tokenizers, weights, shards, corpora): what is
// not a regular file is refused before it is opened (a FIFO would block the open forever,
// /dev/zero never ends, opening a device may act on it), and a whole-file read has a size cap.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace memtrain {

// Caps on whole-file reads, stated in docs/training.md and docs/data.md.
constexpr std::size_t kMaxConfigBytes = std::size_t{1} << 20;      // a run's TOML, config.json
constexpr std::size_t kMaxTokenizerBytes = std::size_t{64} << 20;  // tokenizer.json, encoder.json
constexpr std::size_t kMaxSmallFileBytes = std::size_t{16} << 20;  // index.json, memory.json, ...

// "a FIFO", "a directory", "a character device", ... for a stat mode that is not a regular file.
std::string file_kind(unsigned mode);

// Opens `path` for reading (O_CLOEXEC) and returns the descriptor. Fails with one line naming
// `what` and the path when it does not exist, is not a regular file (checked before the open,
// and again on the open descriptor), or cannot be opened.
int open_regular_file(const std::string& path, const std::string& what);

// The whole of `path`, at most max_bytes (a larger file is refused with the limit, before it is
// read). The same checks as open_regular_file.
std::string read_regular_file(const std::string& path, std::size_t max_bytes,
                              const std::string& what);

// Refuses JSON text whose arrays and objects nest more than max_depth deep, naming `what`:
// nlohmann parses without recursion, but dumping a value (in an error message) and destroying
// some trees recurse once per level, and a hostile file can nest a million deep in 1 MB.
void check_json_nesting(std::string_view text, int max_depth, const std::string& what);

// A test hook: when MEMTRAIN_TEST_PAUSE_AT names `point`, prints "memtrain: test pause at
// POINT" on stderr and sleeps (at most 10 minutes), so a test can kill the process exactly
// there (the replace windows of quantize, lora merge and tokenize). Does nothing otherwise.
void test_pause(const char* point);

}  // namespace memtrain
