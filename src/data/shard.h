// Token shards: a 64-byte little-endian header followed by the tokens as u16 or u32, the on-disk
// form `memtrain tokenize` writes and the loader reads (format table in docs/data.md).
// TokenShard maps the file read-only and checks everything before any token is used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace memtrain::data {

inline constexpr char kShardMagic[8] = {'M', 'T', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

// 2 bytes per token when every id fits in u16, else 4.
inline uint32_t shard_bytes_per_token(uint32_t vocab_size) {
    return vocab_size <= 65536 ? 2 : 4;
}

// Writes `path` atomically (path + ".tmp", then rename). Every token must be < vocab_size.
void write_shard(const std::string& path, std::span<const uint32_t> tokens, uint32_t vocab_size);

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
};

}  // namespace memtrain::data
