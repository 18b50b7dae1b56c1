// `memtrain tokenizer decode/info/encode` and `memtrain tokenize` with a Llama 3 tokenizer, run
// through the built binary: output, exit codes, stdin input, and the fingerprint in the shards.
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "cli/cli_util.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "llama3_layout.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;

// memtrain ARGS, with `stdin_text` (if any) on its standard input.
test::CliResult run_with_stdin(const std::string& args, const std::string& stdin_text = "") {
    if (stdin_text.empty()) return test::run_memtrain(args);
    return test::run_command("printf '%s' '" + stdin_text + "' | timeout -k 5 120 " +
                             std::string(MT_BINARY_DIR) + "/memtrain " + args);
}

std::string fortune_corpus() {
    std::string s;
    for (int i = 0; i < 80; ++i) {
        s += "Fortune " + std::to_string(i) + ": the early bird gets the worm, it's said.\n%\n";
    }
    return s;
}

std::vector<uint32_t> shard_tokens(const TokenShard& s) {
    std::vector<uint32_t> out(s.size());
    if (!out.empty()) s.read(0, out.size(), out.data());
    return out;
}

TEST(TokenizerCliCommands, EncodeDecodeInfo) {
    const auto dir = testing::scratch_dir();
    testing::write_file(dir / "corpus.txt", fortune_corpus());
    const std::string tok_path = (dir / "tok.json").string();
    auto r =
        run_with_stdin(fmt::format("tokenizer train --vocab-size 300 --doc-separator % --out {} {}",
                                   tok_path, (dir / "corpus.txt").string()));
    ASSERT_EQ(r.code, 0) << r.output;
    const Tokenizer tok = Tokenizer::load(tok_path);

    r = run_with_stdin(fmt::format("tokenizer encode --tokenizer {} \"the early bird\"", tok_path));
    ASSERT_EQ(r.code, 0) << r.output;
    std::string expected_ids;
    for (uint32_t id : tok.encode("the early bird")) {
        if (!expected_ids.empty()) expected_ids += ' ';
        expected_ids += std::to_string(id);
    }
    EXPECT_EQ(r.output, expected_ids + "\n");

    // Ids as arguments, then the same on stdin (any whitespace between them).
    r = run_with_stdin(fmt::format("tokenizer decode --tokenizer {} {}", tok_path, expected_ids));
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output, "the early bird\n");
    std::string stdin_ids = expected_ids;
    for (char& c : stdin_ids) {
        if (c == ' ') c = '\n';
    }
    r = run_with_stdin(fmt::format("tokenizer decode --tokenizer {}", tok_path),
                       "  " + stdin_ids + "\n");
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output, "the early bird\n");

    r = run_with_stdin(fmt::format("tokenizer decode --tokenizer {} 5 12x 7", tok_path));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("'12x' is not a token id"), std::string::npos) << r.output;
    r = run_with_stdin(fmt::format("tokenizer decode --tokenizer {} 5 300", tok_path));
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("token id 300 is out of range; the vocab size is 300"),
              std::string::npos)
        << r.output;
    r = run_with_stdin(fmt::format("tokenizer decode --tokenizer {}", tok_path), "1 -2");
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("'-2'"), std::string::npos) << r.output;

    r = run_with_stdin(fmt::format("tokenizer info --tokenizer {}", tok_path));
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string& line :
         {std::string("vocab size    300\n"), fmt::format("merges        {}\n", tok.num_merges()),
          std::string("pre-tokenizer gpt2\n"), std::string("end of text   299 \"<|endoftext|>\"\n"),
          std::string("BOS           none\n"), std::string("added tokens  1\n"),
          fmt::format("fingerprint   {:016x}\n", tok.fingerprint())}) {
        EXPECT_NE(r.output.find(line), std::string::npos) << line << "\nin:\n" << r.output;
    }
    r = run_with_stdin(
        fmt::format("tokenizer info --tokenizer {}", (dir / "missing.json").string()));
    EXPECT_EQ(r.code, 1) << r.output;
    fs::remove_all(dir);
}

// With a Llama 3 tokenizer, `tokenize` frames every document as <|begin_of_text|> ... then
// <|end_of_text|>, and both shards carry the tokenizer's fingerprint.
TEST(TokenizerCliCommands, TokenizeWithLlama3Tokenizer) {
    const auto dir = testing::scratch_dir();
    testing::write_file(dir / "corpus.txt", fortune_corpus());
    std::vector<std::string> docs;
    for (int i = 0; i < 80; ++i) {
        docs.push_back("Fortune " + std::to_string(i) +
                       ": the early bird gets the worm, it's said.\n");
    }
    const Tokenizer trained = Tokenizer::train(docs, 320);
    const auto layout = testing::llama3_layout(trained, dir, true);
    const std::string tok_path = (dir / "llama3.json").string();
    testing::write_file(tok_path, layout.file.dump());
    const Tokenizer tok = Tokenizer::load(tok_path);
    const uint32_t bos = layout.first_special, eot = bos + 1;

    auto r = run_with_stdin(fmt::format("tokenizer info --tokenizer {}", tok_path));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("pre-tokenizer llama3 (ignore_merges)\n"), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(fmt::format("BOS           {} \"<|begin_of_text|>\"\n", bos)),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find(fmt::format("end of text   {} \"<|end_of_text|>\"\n", eot)),
              std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("added tokens  256\n"), std::string::npos) << r.output;

    std::string ids;
    for (uint32_t id : tok.encode("the early bird", true)) {
        if (!ids.empty()) ids += ' ';
        ids += std::to_string(id);
    }
    r = run_with_stdin(fmt::format(
        "tokenizer encode --add-special-tokens --tokenizer {} \"the early bird\"", tok_path));
    EXPECT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output, ids + '\n');
    EXPECT_EQ(r.output.substr(0, r.output.find(' ')), std::to_string(bos));

    const auto out = dir / "shards";
    r = run_with_stdin(
        fmt::format("tokenize --tokenizer {} --out {} --doc-separator % --val-fraction 0.2 {}",
                    tok_path, out.string(), (dir / "corpus.txt").string()));
    ASSERT_EQ(r.code, 0) << r.output;
    size_t total_docs = 0;
    for (const char* split : {"train.bin", "val.bin"}) {
        const TokenShard shard((out / split).string());
        EXPECT_EQ(shard.tokenizer_fingerprint(), tok.fingerprint());
        EXPECT_EQ(shard.vocab_size(), static_cast<uint32_t>(tok.vocab_size()));
        const auto tokens = shard_tokens(shard);
        ASSERT_GE(tokens.size(), 2u);
        EXPECT_EQ(tokens.front(), bos);
        EXPECT_EQ(tokens.back(), eot);
        // Every document: BOS, its text, EOT.
        size_t start = 0;
        for (size_t k = 0; k < tokens.size(); ++k) {
            if (tokens[k] != eot) continue;
            ASSERT_EQ(tokens[start], bos);
            const std::vector<uint32_t> text(tokens.begin() + start + 1, tokens.begin() + k);
            const std::string decoded = tok.decode(text);
            EXPECT_NE(std::find(docs.begin(), docs.end(), decoded), docs.end()) << decoded;
            ++total_docs;
            start = k + 1;
        }
        EXPECT_EQ(start, tokens.size());
    }
    EXPECT_EQ(total_docs, docs.size());
    fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain::data
