// The prompt the samplers (`memtrain sample`, the trainer's end-of-run sample) feed the model:
// BOS first for a Llama 3 tokenizer, as Hugging Face's tokenizer(text) gives it; GPT-2's
// end-of-text as the document start for an empty prompt.
#include <gtest/gtest.h>

#include "core/error.h"
#include "data/llama3_layout.h"
#include "test_util.h"
#include "train/sample.h"

namespace memtrain {
namespace {

TEST(Sample, PromptTokensFollowTheTokenizer) {
    const std::string dir = test::temp_dir("sample_prompt");
    std::vector<std::string> docs(50, "the cat sat on the mat, and the dog sat on the log. ");
    auto gpt2 = data::Tokenizer::train(docs, 270);
    const auto text = gpt2.encode("the cat");
    auto ids = prompt_tokens(gpt2, "the cat");
    EXPECT_EQ(std::vector<uint32_t>(ids.begin(), ids.end()), text);
    EXPECT_EQ(prompt_tokens(gpt2, ""), std::vector<int32_t>{(int32_t)*gpt2.eot_token()});

    auto layout = data::testing::llama3_layout(gpt2, dir, true);
    { std::ofstream(dir + "/llama3.json") << layout.file.dump(); }
    auto llama3 = data::Tokenizer::load(dir + "/llama3.json");
    ASSERT_TRUE(llama3.bos_token());
    EXPECT_EQ(*llama3.bos_token(), layout.first_special);
    ids = prompt_tokens(llama3, "the cat");
    ASSERT_GE(ids.size(), 2u);
    EXPECT_EQ(ids[0], (int32_t)layout.first_special);
    EXPECT_EQ(prompt_tokens(llama3, ""), std::vector<int32_t>{(int32_t)layout.first_special});
}

}  // namespace
}  // namespace memtrain
