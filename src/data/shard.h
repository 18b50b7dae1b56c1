// Token shards: a 64-byte little-endian header followed by the tokens as u16 or u32, the on-disk
// form `memtrain tokenize` writes and the loader reads (format table in docs/data.md).
// TokenShard maps the file read-only and checks everything before any token is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>

namespace memtrain::data {

inline constexpr char kShardMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
// Version 2 adds the tokenizer's fingerprint; version 1 files (no fingerprint) are still read.
inline constexpr uint32_t kShardVersion = 2;
inline constexpr size_t kShardHeaderBytes = 64;

// 2 bytes per token when every id fits in u16, else 4.
inline uint32_t shard_bytes_per_token(uint32_t vocab_size) {
    return vocab_size <= 65536 ? 2 : 4;
}

// Left in a directory by `memtrain tokenize` while it replaces train.bin and val.bin there, and
// removed once both are in place: a shard beside it is refused (the pair may be mixed).
inline constexpr char kTokenizeIncomplete[] = ".tokenize-incomplete";

// Writes `path` atomically (path + ".<pid>.tmp", then rename). Every token must be < vocab_size.
// `tokenizer_fingerprint` is Tokenizer::fingerprint() of the tokenizer that made the tokens, 0 if
// unknown.
void write_shard(const std::string& path, std::span<const uint32_t> tokens, uint32_t vocab_size,
                 uint64_t tokenizer_fingerprint = 0);

class TokenShard {
  public:
    // Maps and validates the file: magic, version, bytes per token, exact file size and every
    // token < vocab_size. Any problem is a memtrain::Error naming the file.
    explicit TokenShard(const std::string& path);
    ~TokenShard();
    TokenShard(TokenShard&& other) noexcept;
    TokenShard& operator=(TokenShard&& other) noexcept;
    TokenShard(const TokenShard&) = delete;
    TokenShard& operator=(const TokenShard&) = delete;

    size_t size() const { return num_tokens_; }
    uint32_t vocab_size() const { return vocab_size_; }
    uint32_t bytes_per_token() const { return bytes_per_token_; }
    // The fingerprint of the tokenizer that wrote the shard; nullopt for shards written without
    // one (format version 1, or write_shard with 0).
    std::optional<uint64_t> tokenizer_fingerprint() const {
        return fingerprint_ ? std::optional<uint64_t>(fingerprint_) : std::nullopt;
    }
    const std::string& path() const { return path_; }
    // Copies tokens [start, start + count) to out; the range must lie inside the shard.
    void read(size_t start, size_t count, uint32_t* out) const;

  private:
    void unmap();

    std::string path_;
    const unsigned char* data_ = nullptr;  // whole file, header included
    size_t mapped_bytes_ = 0;
    size_t num_tokens_ = 0;
    uint32_t vocab_size_ = 0;
    uint32_t bytes_per_token_ = 0;
    uint64_t fingerprint_ = 0;
};

// Refuses (memtrain::Error) a shard that the tokenizer at `tokenizer_path` did not make: its
// fingerprint differs, or, for a shard without one, its vocab size differs. The message names
// both files and says to re-run `memtrain tokenize`.
void check_shard_tokenizer(const TokenShard& shard, const std::string& tokenizer_path,
                           uint64_t tokenizer_fingerprint, uint32_t tokenizer_vocab_size);

}  // namespace memtrain::data
