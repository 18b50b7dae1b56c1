// Token shard tests: round trips at both token widths, the exact header layout, and a clear
// error for each kind of corrupt file.
#include "data/shard.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;
using testing::read_file;
using testing::scratch_dir;
using testing::write_file;

// Expects construction to throw memtrain::Error whose message contains `needle`.
void expect_error(const fs::path& p, const std::string& needle) {
    try {
        TokenShard s(p.string());
        ADD_FAILURE() << "expected an error containing '" << needle << "'";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
}

TEST(Shard, RoundTripU16) {
    const auto dir = scratch_dir();
    const std::vector<uint32_t> tokens{0, 1, 50256, 65535, 7, 42};
    const auto path = dir / "a.bin";
    write_shard(path.string(), tokens, 65536);
    for (const auto& e : fs::directory_iterator(dir))  // (the temporary is a.bin.PID.tmp)
        EXPECT_FALSE(e.path().filename().string().ends_with(".tmp")) << e.path();
    EXPECT_EQ(fs::file_size(path), 64u + 2 * tokens.size());
    TokenShard s(path.string());
    EXPECT_EQ(s.size(), tokens.size());
    EXPECT_EQ(s.vocab_size(), 65536u);
    EXPECT_EQ(s.bytes_per_token(), 2u);
    std::vector<uint32_t> out(tokens.size());
    s.read(0, tokens.size(), out.data());
    EXPECT_EQ(out, tokens);
    s.read(2, 2, out.data());
    EXPECT_EQ(out[0], 50256u);
    EXPECT_EQ(out[1], 65535u);
    EXPECT_THROW(s.read(5, 2, out.data()), Error);
    // Moving keeps the mapping alive in the new owner.
    TokenShard moved = std::move(s);
    moved.read(0, 1, out.data());
    EXPECT_EQ(out[0], 0u);
    fs::remove_all(dir);
}

TEST(Shard, RoundTripU32AndHeaderLayout) {
    const auto dir = scratch_dir();
    const std::vector<uint32_t> tokens{0, 65536, 100000, 3};
    const auto path = dir / "b.bin";
    write_shard(path.string(), tokens, 100001, 0x0123456789abcdefull);
    const std::string bytes = read_file(path);
    ASSERT_EQ(bytes.size(), 64u + 4 * tokens.size());
    EXPECT_EQ(bytes.substr(0, 8), "MTTOKENS");
    auto u32 = [&](size_t off) {
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i)
            v |= uint32_t{static_cast<unsigned char>(bytes[off + i])} << (8 * i);
        return v;
    };
    EXPECT_EQ(u32(8), 2u);        // version
    EXPECT_EQ(u32(12), 4u);       // bytes per token
    EXPECT_EQ(u32(16), 4u);       // num_tokens, low half
    EXPECT_EQ(u32(20), 0u);       // num_tokens, high half
    EXPECT_EQ(u32(24), 100001u);  // vocab size
    for (size_t i = 28; i < 32; ++i) EXPECT_EQ(bytes[i], 0) << i;
    EXPECT_EQ(u32(32), 0x89abcdefu);  // tokenizer fingerprint, low half
    EXPECT_EQ(u32(36), 0x01234567u);
    for (size_t i = 40; i < 64; ++i) EXPECT_EQ(bytes[i], 0) << i;
    EXPECT_EQ(u32(64 + 4), 65536u);
    TokenShard s(path.string());
    EXPECT_EQ(s.tokenizer_fingerprint(), 0x0123456789abcdefull);
    std::vector<uint32_t> out(tokens.size());
    s.read(0, tokens.size(), out.data());
    EXPECT_EQ(out, tokens);
    fs::remove_all(dir);
}

TEST(Shard, EmptyShardIsValid) {
    const auto dir = scratch_dir();
    write_shard((dir / "e.bin").string(), {}, 10);
    TokenShard s((dir / "e.bin").string());
    EXPECT_EQ(s.size(), 0u);
    fs::remove_all(dir);
}

TEST(Shard, WriteRejectsOutOfVocabTokens) {
    const auto dir = scratch_dir();
    const std::vector<uint32_t> tokens{1, 2, 10};
    EXPECT_THROW(write_shard((dir / "x.bin").string(), tokens, 10), Error);
    EXPECT_THROW(write_shard((dir / "no_such_dir" / "x.bin").string(), tokens, 100), Error);
    fs::remove_all(dir);
}

TEST(Shard, CorruptFilesGiveClearErrors) {
    const auto dir = scratch_dir();
    const auto good = dir / "good.bin";
    write_shard(good.string(), std::vector<uint32_t>{1, 2, 3, 4}, 100);
    const std::string bytes = read_file(good);
    const auto bad = dir / "bad.bin";

    expect_error(dir / "missing.bin", "does not exist");
    write_file(bad, bytes.substr(0, 10));
    expect_error(bad, "smaller than the 64-byte header");
    std::string b = bytes;
    b[0] = 'X';
    write_file(bad, b);
    expect_error(bad, "not a memtrain token shard: bad magic");
    b = bytes;
    b[8] = 3;
    write_file(bad, b);
    expect_error(bad, "version 3");
    b = bytes;
    b[30] = 1;
    write_file(bad, b);
    expect_error(bad, "reserved header bytes 28-31");
    b = bytes;
    b[12] = 4;
    write_file(bad, b);
    expect_error(bad, "4 bytes per token; expected 2");
    write_file(bad, bytes.substr(0, bytes.size() - 1));
    expect_error(
        bad, "truncated: the header says 4 tokens, so 72 bytes are expected, but the file has 71");
    write_file(bad, bytes + "xx");
    expect_error(bad, "too long");
    b = bytes;
    b[64 + 2 * 2] = 100;  // token index 2 becomes 100 == vocab size
    write_file(bad, b);
    expect_error(bad, "token 100 at index 2");
    b = bytes;
    b[16 + 7] = 0x7f;  // absurd token count
    write_file(bad, b);
    expect_error(bad, "token shard");
    b = bytes;
    b[40] = 1;
    write_file(bad, b);
    expect_error(bad, "reserved header byte 40");
    fs::remove_all(dir);
}

// Shards written before the fingerprint (version 1) still load, without a fingerprint; in a
// version 1 file the fingerprint's bytes are reserved and must be zero.
TEST(Shard, ReadsVersion1WithoutFingerprint) {
    const auto dir = scratch_dir();
    const auto path = dir / "v1.bin";
    write_shard(path.string(), std::vector<uint32_t>{5, 6, 7}, 10);
    std::string b = read_file(path);
    b[8] = 1;
    write_file(path, b);
    const TokenShard s(path.string());
    EXPECT_EQ(s.size(), 3u);
    EXPECT_EQ(s.tokenizer_fingerprint(), std::nullopt);
    b[33] = 1;
    write_file(path, b);
    expect_error(path, "reserved header byte 33");
    fs::remove_all(dir);
}

TEST(Shard, TokenizerCheckRefusesOtherTokenizers) {
    const auto dir = scratch_dir();
    const auto with = dir / "with.bin", without = dir / "without.bin";
    write_shard(with.string(), std::vector<uint32_t>{1, 2}, 300, 0xabcull);
    write_shard(without.string(), std::vector<uint32_t>{1, 2}, 300);
    const TokenShard a(with.string()), b(without.string());
    EXPECT_NO_THROW(check_shard_tokenizer(a, "tok.json", 0xabc, 300));
    EXPECT_NO_THROW(check_shard_tokenizer(b, "tok.json", 0xabc, 300));
    try {
        check_shard_tokenizer(a, "other.json", 0xdef, 300);
        ADD_FAILURE() << "expected a fingerprint mismatch";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(with.string()), std::string::npos) << m;
        EXPECT_NE(m.find("other.json"), std::string::npos) << m;
        EXPECT_NE(m.find("memtrain tokenize"), std::string::npos) << m;
    }
    try {
        check_shard_tokenizer(b, "big.json", 0xabc, 50257);
        ADD_FAILURE() << "expected a vocab size mismatch";
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find("vocab size 300"), std::string::npos) << m;
        EXPECT_NE(m.find("big.json"), std::string::npos) << m;
    }
    fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain::data
