// Token shard writing and memory-mapped reading. Fields are assembled byte by byte so the
// format is little-endian on every host; a file is validated completely when opened, so a
// corrupt or truncated shard fails at start-up with its name rather than mid-training.
#include "data/shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/regular_file.h"

namespace memtrain::data {

namespace {

void put_u32(unsigned char* p, uint32_t v) {
    for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
void put_u64(unsigned char* p, uint64_t v) {
    for (int i = 0; i < 8; ++i) p[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint32_t get_u32(const unsigned char* p) {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{p[i]} << (8 * i);
    return v;
}
uint64_t get_u64(const unsigned char* p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
    return v;
}

// Header layout (offsets in bytes).
constexpr size_t kOffMagic = 0, kOffVersion = 8, kOffBytesPerToken = 12, kOffNumTokens = 16,
                 kOffVocab = 24, kOffFingerprint = 32, kOffReservedV1 = 28, kOffReservedV2 = 40;

inline uint32_t token_at(const unsigned char* p, uint32_t bytes_per_token, size_t i) {
    return bytes_per_token == 2 ? uint32_t{p[2 * i]} | (uint32_t{p[2 * i + 1]} << 8)
                                : get_u32(p + 4 * i);
}

}  // namespace

void write_shard(const std::string& path, std::span<const uint32_t> tokens, uint32_t vocab_size,
                 uint64_t tokenizer_fingerprint) {
    if (vocab_size == 0) fail("write_shard '{}': vocab size must be positive", path);
    for (size_t i = 0; i < tokens.size(); ++i) {
        if (tokens[i] >= vocab_size) {
            fail("write_shard '{}': token {} at index {} is not below the vocab size {}", path,
                 tokens[i], i, vocab_size);
        }
    }
    const uint32_t bpt = shard_bytes_per_token(vocab_size);
    unsigned char header[kShardHeaderBytes] = {};
    std::memcpy(header + kOffMagic, kShardMagic, sizeof(kShardMagic));
    put_u32(header + kOffVersion, kShardVersion);
    put_u32(header + kOffBytesPerToken, bpt);
    put_u64(header + kOffNumTokens, tokens.size());
    put_u32(header + kOffVocab, vocab_size);
    put_u64(header + kOffFingerprint, tokenizer_fingerprint);

    // This process's own temporary name: two writers of one path never share it.
    const std::string tmp = path + "." + std::to_string(::getpid()) + ".tmp";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) fail("cannot write token shard '{}': {}", tmp, std::strerror(errno));
    bool ok = std::fwrite(header, 1, sizeof(header), f) == sizeof(header);
    std::vector<unsigned char> buf;
    constexpr size_t kChunk = 1 << 16;
    for (size_t start = 0; ok && start < tokens.size(); start += kChunk) {
        const size_t n = std::min(kChunk, tokens.size() - start);
        buf.assign(n * bpt, 0);
        for (size_t i = 0; i < n; ++i) {
            const uint32_t t = tokens[start + i];
            for (uint32_t k = 0; k < bpt; ++k)
                buf[i * bpt + k] = static_cast<unsigned char>(t >> (8 * k));
        }
        ok = std::fwrite(buf.data(), 1, buf.size(), f) == buf.size();
    }
    ok = (std::fflush(f) == 0) && ok;
    ok = (fsync(fileno(f)) == 0) && ok;
    const int saved_errno = errno;
    ok = (std::fclose(f) == 0) && ok;
    if (!ok) {
        std::remove(tmp.c_str());
        fail("cannot write token shard '{}': {}", tmp, std::strerror(saved_errno));
    }
    std::error_code ec;
    std::filesystem::rename(tmp, path, ec);
    if (ec) {
        std::remove(tmp.c_str());
        fail("cannot rename '{}' to '{}': {}", tmp, path, ec.message());
    }
}

TokenShard::TokenShard(const std::string& path) : path_(path) {
    // A shard beside the marker of an interrupted `memtrain tokenize` may be half of a pair
    // whose other half came from another run (tokenize_cmd.cpp replaces the two as a pair).
    const auto marker = std::filesystem::path(path).parent_path() / kTokenizeIncomplete;
    std::error_code ec;
    if (std::filesystem::exists(marker, ec))
        fail(
            "token shard '{}': a `memtrain tokenize` into {} was interrupted while replacing "
            "train.bin and val.bin ({} is there), so the two may come from different runs; run "
            "memtrain tokenize again",
            path, marker.parent_path().string(), marker.filename().string());
    // A FIFO (which would block the open) or a device is refused before it is opened.
    const int fd = open_regular_file(path, "token shard");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        const int e = errno;
        ::close(fd);
        fail("cannot stat token shard '{}': {}", path, std::strerror(e));
    }
    const auto file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < kShardHeaderBytes) {
        ::close(fd);
        fail("token shard '{}' is truncated: {} bytes, smaller than the {}-byte header", path,
             file_size, kShardHeaderBytes);
    }
    void* p = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    ::close(fd);  // the mapping stays valid without the descriptor
    if (p == MAP_FAILED) fail("cannot mmap token shard '{}': {}", path, std::strerror(map_errno));
    data_ = static_cast<const unsigned char*>(p);
    mapped_bytes_ = file_size;

    // From here on, errors must unmap: the destructor does not run for a throwing constructor.
    try {
        if (std::memcmp(data_ + kOffMagic, kShardMagic, sizeof(kShardMagic)) != 0) {
            fail("'{}' is not a memtrain token shard: bad magic (expected \"MTTOKENS\")", path);
        }
        const uint32_t version = get_u32(data_ + kOffVersion);
        if (version != 1 && version != kShardVersion) {
            fail("token shard '{}' has format version {}; this build reads versions 1 to {}", path,
                 version, kShardVersion);
        }
        vocab_size_ = get_u32(data_ + kOffVocab);
        if (vocab_size_ == 0) fail("token shard '{}' has vocab size 0", path);
        bytes_per_token_ = get_u32(data_ + kOffBytesPerToken);
        if (bytes_per_token_ != shard_bytes_per_token(vocab_size_)) {
            fail("token shard '{}' has {} bytes per token; expected {} for vocab size {}", path,
                 bytes_per_token_, shard_bytes_per_token(vocab_size_), vocab_size_);
        }
        if (version >= 2) {
            if (get_u32(data_ + kOffReservedV1) != 0) {
                fail("token shard '{}': reserved header bytes 28-31 are not 0", path);
            }
            fingerprint_ = get_u64(data_ + kOffFingerprint);
        }
        for (size_t i = version >= 2 ? kOffReservedV2 : kOffReservedV1; i < kShardHeaderBytes;
             ++i) {
            if (data_[i] != 0) {
                fail("token shard '{}': reserved header byte {} is {}; expected 0", path, i,
                     data_[i]);
            }
        }
        const uint64_t n = get_u64(data_ + kOffNumTokens);
        const uint64_t max_tokens = (UINT64_MAX - kShardHeaderBytes) / bytes_per_token_;
        if (n > max_tokens) {
            fail("token shard '{}' claims {} tokens, more than any file can hold", path, n);
        }
        const uint64_t expected = kShardHeaderBytes + n * bytes_per_token_;
        if (expected != file_size) {
            fail(
                "token shard '{}' is {}: the header says {} tokens, so {} bytes are expected, "
                "but the file has {}",
                path, file_size < expected ? "truncated" : "too long", n, expected, file_size);
        }
        num_tokens_ = static_cast<size_t>(n);
        const unsigned char* body = data_ + kShardHeaderBytes;
        for (size_t i = 0; i < num_tokens_; ++i) {
            const uint32_t t = token_at(body, bytes_per_token_, i);
            if (t >= vocab_size_) {
                fail("token shard '{}': token {} at index {} is not below the vocab size {}", path,
                     t, i, vocab_size_);
            }
        }
    } catch (...) {
        unmap();
        throw;
    }
}

TokenShard::~TokenShard() {
    unmap();
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      mapped_bytes_(std::exchange(other.mapped_bytes_, 0)),
      num_tokens_(std::exchange(other.num_tokens_, 0)),
      vocab_size_(std::exchange(other.vocab_size_, 0)),
      bytes_per_token_(std::exchange(other.bytes_per_token_, 0)),
      fingerprint_(std::exchange(other.fingerprint_, 0)) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
    if (this != &other) {
        unmap();
        path_ = std::move(other.path_);
        data_ = std::exchange(other.data_, nullptr);
        mapped_bytes_ = std::exchange(other.mapped_bytes_, 0);
        num_tokens_ = std::exchange(other.num_tokens_, 0);
        vocab_size_ = std::exchange(other.vocab_size_, 0);
        bytes_per_token_ = std::exchange(other.bytes_per_token_, 0);
        fingerprint_ = std::exchange(other.fingerprint_, 0);
    }
    return *this;
}

void TokenShard::unmap() {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), mapped_bytes_);
    data_ = nullptr;
    mapped_bytes_ = 0;
}

void TokenShard::read(size_t start, size_t count, uint32_t* out) const {
    if (start > num_tokens_ || count > num_tokens_ - start) {
        fail("token shard '{}': read of tokens [{}, {}) is outside its {} tokens", path_, start,
             start + count, num_tokens_);
    }
    const unsigned char* body = data_ + kShardHeaderBytes;
    if (bytes_per_token_ == 2) {
        for (size_t i = 0; i < count; ++i) out[i] = token_at(body, 2, start + i);
    } else {
        for (size_t i = 0; i < count; ++i) out[i] = token_at(body, 4, start + i);
    }
}

void check_shard_tokenizer(const TokenShard& shard, const std::string& tokenizer_path,
                           uint64_t tokenizer_fingerprint, uint32_t tokenizer_vocab_size) {
    const auto fp = shard.tokenizer_fingerprint();
    if (fp && *fp != tokenizer_fingerprint) {
        fail(
            "token shard '{}' was made with a different tokenizer than data.tokenizer '{}' "
            "(tokenizer fingerprint {:016x} in the shard, {:016x} for '{}'); re-run `memtrain "
            "tokenize --tokenizer {}` to make the shards with it",
            shard.path(), tokenizer_path, *fp, tokenizer_fingerprint, tokenizer_path,
            tokenizer_path);
    }
    if (!fp && shard.vocab_size() != tokenizer_vocab_size) {
        fail(
            "token shard '{}' has vocab size {} but data.tokenizer '{}' has {}, so the shard was "
            "made with another tokenizer; re-run `memtrain tokenize --tokenizer {}` to make the "
            "shards with it",
            shard.path(), shard.vocab_size(), tokenizer_path, tokenizer_vocab_size, tokenizer_path);
    }
}

}  // namespace memtrain::data
