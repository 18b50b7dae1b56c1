// End-to-end test of `memtrain tokenizer train` and `memtrain tokenize` through CLI11: document
// splitting, binary and symlink skipping, the train/val split, and reproducible output.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;

using testing::read_file;
using testing::run_cli;

std::vector<uint32_t> all_tokens(const fs::path& p) {
    TokenShard s(p.string());
    std::vector<uint32_t> out(s.size());
    if (!out.empty()) s.read(0, out.size(), out.data());
    return out;
}

TEST(TokenizerCli, TrainAndTokenizeCorpus) {
    const auto dir = testing::scratch_dir();
    const auto corpus = dir / "corpus";
    fs::create_directories(corpus);
    std::string text;
    std::vector<std::string> docs;
    for (int i = 0; i < 60; ++i) {
        docs.push_back("Fortune number " + std::to_string(i) + ": the early bird gets the worm.\n" +
                       "  -- proverb " + std::to_string(i * i) + "\n");
        text += docs.back() + "%\n";
    }
    testing::write_file(corpus / "fortunes", text);
    testing::write_file(corpus / "fortunes.dat", std::string("\0\0\0\2binary", 10));
    fs::create_symlink(corpus / "fortunes", corpus / "fortunes.u8");

    const auto tok_path = dir / "tok.json";
    run_cli(fmt::format("tokenizer train --vocab-size 300 --out {} --doc-separator % {}",
                        tok_path.string(), corpus.string()));
    const Tokenizer tok = Tokenizer::load(tok_path.string());
    ASSERT_EQ(tok.vocab_size(), 300);
    const uint32_t eot = *tok.eot_token();

    const auto out = dir / "out";
    const std::string cmd = fmt::format(
        "tokenize --tokenizer {} --out {} --doc-separator % --val-fraction 0.3 --seed 5 {}",
        tok_path.string(), out.string(), corpus.string());
    run_cli(cmd);
    const auto train = all_tokens(out / "train.bin"), val = all_tokens(out / "val.bin");
    // Every document is preceded by eot; the symlink and the binary file add nothing.
    std::vector<std::string> got;
    for (const auto* split : {&train, &val}) {
        ASSERT_FALSE(split->empty());
        ASSERT_EQ(split->front(), eot);
        for (uint32_t t : *split) {
            if (t == eot) {
                got.emplace_back();
            } else {
                got.back() += tok.decode(std::vector<uint32_t>{t});
            }
        }
    }
    ASSERT_EQ(got.size(), docs.size());
    std::sort(got.begin(), got.end());
    std::sort(docs.begin(), docs.end());
    EXPECT_EQ(got, docs);

    // Same inputs and seed: the same bytes.
    const std::string train_bytes = read_file(out / "train.bin");
    run_cli(cmd);
    EXPECT_EQ(read_file(out / "train.bin"), train_bytes);

    EXPECT_THROW(run_cli(fmt::format("tokenize --tokenizer {} --out {} {}", tok_path.string(),
                                     out.string(), (dir / "missing.txt").string())),
                 Error);
    fs::remove_all(dir);
}

// One text file without separators (nanoGPT's input.txt): its tokens are split, the last
// --val-fraction of them to val.bin, train.bin + val.bin being the whole document.
TEST(TokenizerCli, OneDocumentIsSplitByTokens) {
    const fs::path dir = testing::scratch_dir();
    std::string text;
    for (int i = 0; i < 200; i++) text += "First Citizen: we are accounted poor citizens.\n";
    testing::write_file(dir / "input.txt", text);
    const auto tok_path = dir / "tok.json";
    run_cli(fmt::format("tokenizer train --vocab-size 280 --out {} {}", tok_path.string(),
                        (dir / "input.txt").string()));
    const Tokenizer tok = Tokenizer::load(tok_path.string());
    run_cli(fmt::format("tokenize --tokenizer {} --out {} --val-fraction 0.1 {}", tok_path.string(),
                        (dir / "out").string(), (dir / "input.txt").string()));
    const auto train = all_tokens(dir / "out" / "train.bin"),
               val = all_tokens(dir / "out" / "val.bin");
    std::vector<uint32_t> whole = train;
    whole.insert(whole.end(), val.begin(), val.end());
    std::vector<uint32_t> want{*tok.eot_token()};
    const auto encoded = tok.encode(text);
    want.insert(want.end(), encoded.begin(), encoded.end());
    EXPECT_EQ(whole, want);
    EXPECT_EQ(val.size(), (std::size_t)std::llround(0.1 * (double)want.size()));
    fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain::data
