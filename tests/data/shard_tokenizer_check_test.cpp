// The trainer refuses token shards made with another tokenizer than data.tokenizer (by the
// fingerprint `memtrain tokenize` records, or by vocab size for shards without one) and shards
// whose vocabulary exceeds the model's; it accepts shards from the same tokenizer.
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <CLI/CLI.hpp>

#include "../test_util.h"
#include "cli/commands.h"
#include "core/error.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "test_util.h"
#include "train/trainer.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;

using test::quiet;
using testing::run_cli;

std::vector<std::string> docs(const std::string& word) {
    std::vector<std::string> out;
    for (int i = 0; i < 120; ++i) {
        out.push_back(
            fmt::format("The {} number {} jumps over {} dogs, it's said.\n", word, i, i * 3));
    }
    return out;
}

// Two tokenizers of one vocab size, trained on different text, and shards from the first.
struct Fixture {
    std::string dir, tok_a, tok_b, corpus;
    RunConfig cfg;
};

Fixture make_fixture(const std::string& name) {
    Fixture s;
    s.dir = test::temp_dir(name);
    s.tok_a = s.dir + "/a.json";
    s.tok_b = s.dir + "/b.json";
    Tokenizer::train(docs("fox"), 300).save(s.tok_a);
    Tokenizer::train(docs("cat"), 300).save(s.tok_b);
    std::string text;
    for (const auto& d : docs("fox")) text += d + "%\n";
    s.corpus = s.dir + "/corpus.txt";
    testing::write_file(s.corpus, text);
    run_cli(fmt::format("tokenize --tokenizer {} --out {} --doc-separator % --val-fraction 0.2 {}",
                        s.tok_a, s.dir, s.corpus));
    s.cfg = test::tiny_run_config(s.dir, 2);
    s.cfg.model.vocab_size = 300;
    return s;
}

// The message of the Error constructing a Trainer for `cfg` throws ("" if none).
std::string trainer_error(const RunConfig& cfg) {
    try {
        Trainer t(cfg, quiet());
    } catch (const Error& e) {
        return e.what();
    }
    return "";
}

TEST(TokenizerShardCheck, SameTokenizerTrains) {
    Fixture s = make_fixture("shard_check_same");
    s.cfg.data.tokenizer = s.tok_a;
    Trainer t(s.cfg, quiet());
    EXPECT_EQ(t.run().steps_done, 2);
    // A copy saved elsewhere is the same tokenizer: same fingerprint.
    const std::string copy = s.dir + "/copy.json";
    Tokenizer::load(s.tok_a).save(copy);
    s.cfg.data.tokenizer = copy;
    EXPECT_EQ(trainer_error(s.cfg), "");
}

TEST(TokenizerShardCheck, OtherTokenizerIsRefused) {
    Fixture s = make_fixture("shard_check_other");
    s.cfg.data.tokenizer = s.tok_b;
    const std::string m = trainer_error(s.cfg);
    ASSERT_NE(m, "");
    EXPECT_NE(m.find(s.dir + "/train.bin"), std::string::npos) << m;
    EXPECT_NE(m.find(s.tok_b), std::string::npos) << m;
    EXPECT_NE(m.find("different tokenizer"), std::string::npos) << m;
    EXPECT_NE(m.find("memtrain tokenize --tokenizer " + s.tok_b), std::string::npos) << m;
}

// Shards without a fingerprint (written before it existed): the vocab size still tells a
// different tokenizer; without data.tokenizer, the model's vocab size bounds the shard's.
TEST(TokenizerShardCheck, OldShardsAreCheckedByVocabSize) {
    Fixture s = make_fixture("shard_check_old");
    std::vector<uint32_t> tokens(400);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 300);
    write_shard(s.dir + "/train.bin", tokens, 300);
    write_shard(s.dir + "/val.bin", tokens, 300);
    s.cfg.data.tokenizer = s.tok_b;  // same vocab size: cannot be told apart, accepted
    EXPECT_EQ(trainer_error(s.cfg), "");

    const std::string big = s.dir + "/big.json";
    Tokenizer::train(docs("fox"), 310).save(big);
    s.cfg.model.vocab_size = 320;
    s.cfg.data.tokenizer = big;
    std::string m = trainer_error(s.cfg);
    EXPECT_NE(m.find("vocab size 300"), std::string::npos) << m;
    EXPECT_NE(m.find(big), std::string::npos) << m;
    EXPECT_NE(m.find("memtrain tokenize"), std::string::npos) << m;

    s.cfg.data.tokenizer.clear();
    s.cfg.model.vocab_size = 200;
    m = trainer_error(s.cfg);
    EXPECT_NE(m.find("larger than model.vocab_size"), std::string::npos) << m;
}

}  // namespace
}  // namespace memtrain::data
