// Tokenizer tests: GPT-2 encodings known from OpenAI's tokenizer, round trips, training,
// save/load identity (ids and fingerprint) and clear errors for bad tokenizer files.
#include "data/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

using testing::scratch_dir;
using testing::write_file;
namespace fs = std::filesystem;

using Ids = std::vector<uint32_t>;

const char* kTexts[] = {
    "Hello world",
    "naïve café — 日本語 123 it's",
    "  leading spaces, trailing spaces   \n\n\tand tabs\t\r\n",
    "It's we'll they're I'd you've I'm don't ''s 'x",
    "numbers 3.14159 and 1,000,000 and ½ ²",
    "emoji 😀🎉 and mixed Ελληνικά Русский العربية हिन्दी",
    "<|endoftext|>between<|endoftext|><|endoftext|> done",
    "",
    "x",
    "invalid utf8 \xff\xfe\xc3 end",
};

class TokenizerGpt2 : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        if (fs::exists(testing::gpt2_dir() + "/encoder.json") &&
            fs::exists(testing::gpt2_dir() + "/vocab.bpe")) {
            tok_ = new Tokenizer(Tokenizer::load(testing::gpt2_dir()));
        }
    }
    static void TearDownTestSuite() {
        delete tok_;
        tok_ = nullptr;
    }
    void SetUp() override {
        ASSERT_NE(tok_, nullptr) << "GPT-2 tokenizer files missing in " << testing::gpt2_dir()
                                 << "; run `bash scripts/deps.sh` to fetch them";
    }
    static Tokenizer* tok_;
};
Tokenizer* TokenizerGpt2::tok_ = nullptr;

TEST_F(TokenizerGpt2, KnownEncodings) {
    EXPECT_EQ(tok_->vocab_size(), 50257);
    EXPECT_EQ(tok_->eot_token(), 50256u);
    EXPECT_EQ(tok_->encode("Hello world"), (Ids{15496, 995}));
    EXPECT_EQ(tok_->encode(" Hello"), (Ids{18435}));
    EXPECT_EQ(tok_->encode("<|endoftext|>"), (Ids{50256}));
    EXPECT_EQ(tok_->encode("Hello world<|endoftext|>"), (Ids{15496, 995, 50256}));
    EXPECT_EQ(tok_->encode(""), Ids{});
}

TEST_F(TokenizerGpt2, RoundTrip) {
    for (const char* text : kTexts) {
        const Ids ids = tok_->encode(text);
        EXPECT_EQ(tok_->decode(ids), text) << text;
    }
}

TEST_F(TokenizerGpt2, LoadsEncoderJsonPathAndSavesIdentically) {
    const Tokenizer by_file = Tokenizer::load(testing::gpt2_dir() + "/encoder.json");
    const auto dir = scratch_dir();
    by_file.save((dir / "tokenizer.json").string());
    const Tokenizer hf = Tokenizer::load((dir / "tokenizer.json").string());
    EXPECT_EQ(hf.vocab_size(), 50257);
    EXPECT_EQ(hf.eot_token(), 50256u);
    EXPECT_EQ(hf.fingerprint(), tok_->fingerprint());  // the same tokenizer, whatever the files
    EXPECT_EQ(hf.pre_tokenizer(), PreTokenizer::kGpt2);
    EXPECT_FALSE(hf.ignore_merges());
    EXPECT_EQ(hf.bos_token(), std::nullopt);
    for (const char* text : kTexts) EXPECT_EQ(hf.encode(text), tok_->encode(text)) << text;
    // The directory form picks tokenizer.json.
    EXPECT_EQ(Tokenizer::load(dir.string()).encode("Hello world"), (Ids{15496, 995}));
    fs::remove_all(dir);
}

TEST_F(TokenizerGpt2, DecodeRejectsOutOfRangeIds) {
    const Ids bad{50257};
    EXPECT_THROW(tok_->decode(bad), Error);
}

TEST(TokenizerPreTokenize, MatchesGpt2Regex) {
    using V = std::vector<std::string_view>;
    EXPECT_EQ(Tokenizer::pre_tokenize("Hello world"), (V{"Hello", " world"}));
    EXPECT_EQ(Tokenizer::pre_tokenize("it's 42!!  ok\n\nx"),
              (V{"it", "'s", " 42", "!!", " ", " ok", "\n", "\n", "x"}));
    EXPECT_EQ(Tokenizer::pre_tokenize("a   b  "), (V{"a", "  ", " b", "  "}));
    EXPECT_EQ(Tokenizer::pre_tokenize("we'll 'x"), (V{"we", "'ll", " '", "x"}));
    EXPECT_EQ(Tokenizer::pre_tokenize("café 日本"), (V{"café", " 日本"}));
}

std::vector<std::string> training_docs() {
    std::vector<std::string> docs;
    for (int i = 0; i < 200; ++i) {
        docs.push_back("The quick brown fox jumps over the lazy dog " + std::to_string(i) +
                       " times. It's the fox's " + std::to_string(i * 7) +
                       "th jump; naïve café — 日本語.\n");
    }
    return docs;
}

TEST(TokenizerTrain, ExactVocabRoundTripAndSaveLoadIdentity) {
    const Tokenizer tok = Tokenizer::train(training_docs(), 300);
    EXPECT_EQ(tok.vocab_size(), 300);
    EXPECT_EQ(tok.eot_token(), 299u);
    for (const char* text : kTexts) EXPECT_EQ(tok.decode(tok.encode(text)), text) << text;
    // Merges make common words short.
    EXPECT_LT(tok.encode(" quick brown fox").size(), 8u);

    const auto dir = scratch_dir();
    const std::string path = (dir / "tokenizer.json").string();
    tok.save(path);
    const Tokenizer back = Tokenizer::load(path);
    EXPECT_EQ(back.vocab_size(), 300);
    EXPECT_EQ(back.eot_token(), 299u);
    EXPECT_EQ(back.fingerprint(), tok.fingerprint());
    EXPECT_NE(Tokenizer::train(training_docs(), 301).fingerprint(), tok.fingerprint());
    for (const char* text : kTexts) EXPECT_EQ(back.encode(text), tok.encode(text)) << text;
    for (const auto& doc : training_docs()) ASSERT_EQ(back.encode(doc), tok.encode(doc));
    // Saving the loaded tokenizer reproduces the file byte for byte.
    const std::string again = (dir / "again.json").string();
    back.save(again);
    std::ifstream a(path), b(again);
    const std::string sa((std::istreambuf_iterator<char>(a)), {});
    const std::string sb((std::istreambuf_iterator<char>(b)), {});
    EXPECT_EQ(sa, sb);
    fs::remove_all(dir);
}

TEST(TokenizerTrain, Deterministic) {
    const Tokenizer a = Tokenizer::train(training_docs(), 280);
    const Tokenizer b = Tokenizer::train(training_docs(), 280);
    const std::string text = training_docs()[17];
    EXPECT_EQ(a.encode(text), b.encode(text));
}

TEST(TokenizerTrain, RejectsImpossibleSizes) {
    EXPECT_THROW(Tokenizer::train(training_docs(), 100), Error);
    // "ab" has one pair: at most one merge can be learned.
    EXPECT_THROW(Tokenizer::train({"ab"}, 260), Error);
}

TEST(TokenizerLoad, BadFilesThrow) {
    const auto dir = scratch_dir();
    EXPECT_THROW(Tokenizer::load((dir / "missing.json").string()), Error);
    EXPECT_THROW(Tokenizer::load(dir.string()), Error);  // empty directory

    const auto malformed = dir / "malformed.json";
    write_file(malformed, "{\"model\": {\"type\": \"BPE\", ");
    EXPECT_THROW(Tokenizer::load(malformed.string()), Error);

    const auto wordpiece = dir / "wordpiece.json";
    write_file(wordpiece, R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})");
    try {
        Tokenizer::load(wordpiece.string());
        ADD_FAILURE() << "expected an error for a WordPiece model";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("BPE"), std::string::npos) << e.what();
    }

    // A valid tokenizer, then the same with a merge naming an unknown token.
    const Tokenizer tok = Tokenizer::train(training_docs(), 260);
    const auto good = dir / "good.json";
    tok.save(good.string());
    std::ifstream in(good);
    nlohmann::json j = nlohmann::json::parse(in);
    j["model"]["merges"].push_back("zzzq Ġ");
    const auto bad_merge = dir / "bad_merge.json";
    write_file(bad_merge, j.dump());
    EXPECT_THROW(Tokenizer::load(bad_merge.string()), Error);
    j["model"]["merges"].back() = nlohmann::json::array({"Ġ", "nonexistent"});
    write_file(bad_merge, j.dump());
    EXPECT_THROW(Tokenizer::load(bad_merge.string()), Error);

    // Ids of the wrong type, a vocab missing bytes, and an encoder.json without vocab.bpe.
    nlohmann::json k = j;
    k["model"]["merges"] = nlohmann::json::array();
    k["model"]["vocab"]["Ġ"] = "zero";
    write_file(bad_merge, k.dump());
    EXPECT_THROW(Tokenizer::load(bad_merge.string()), Error);
    write_file(dir / "tiny.json", R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})");
    EXPECT_THROW(Tokenizer::load((dir / "tiny.json").string()), Error);
    fs::create_directories(dir / "gpt2");
    write_file(dir / "gpt2" / "encoder.json", "{\"a\": 0}");
    EXPECT_THROW(Tokenizer::load((dir / "gpt2").string()), Error);
    fs::remove_all(dir);
}

}  // namespace
}  // namespace memtrain::data
