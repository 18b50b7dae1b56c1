// Builds a Llama-3-layout tokenizer.json from a vocab Tokenizer::train made, for the tokenizer,
// CLI and shard-check tests.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "data/tokenizer.h"

namespace memtrain::data::testing {

using nlohmann::json;
namespace fs = std::filesystem;

inline const char* kLlama3Pattern =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

inline const char* kSpecialNames[] = {"<|begin_of_text|>",
                                      "<|end_of_text|>",
                                      "<|reserved_special_token_0|>",
                                      "<|reserved_special_token_1|>",
                                      "<|reserved_special_token_2|>",
                                      "<|reserved_special_token_3|>",
                                      "<|start_header_id|>",
                                      "<|end_header_id|>",
                                      "<|reserved_special_token_4|>",
                                      "<|eot_id|>"};

inline std::string special_name(int k) {
    if (k < 10) return kSpecialNames[k];
    return "<|reserved_special_token_" + std::to_string(k - 5) + "|>";
}

// A vocab trained by Tokenizer::train, reshaped into Llama 3's tokenizer.json layout: the BPE
// vocab first (plus " zqxjk", a whole word no merge sequence builds), then 256 added specials,
// the Split + ByteLevel pre-tokenizer, ignore_merges, and a BOS template.
struct Llama3Layout {
    json file;
    uint32_t first_special = 0;  // <|begin_of_text|>
    uint32_t whole_word = 0;     // " zqxjk"
};

inline Llama3Layout llama3_layout(const Tokenizer& trained, const fs::path& dir,
                                  bool ignore_merges) {
    trained.save((dir / "trained.json").string());
    std::ifstream in(dir / "trained.json");
    Llama3Layout l;
    l.file = json::parse(in);
    json& vocab = l.file["model"]["vocab"];
    vocab.erase("<|endoftext|>");
    l.whole_word = static_cast<uint32_t>(vocab.size());
    vocab["Ġzqxjk"] = l.whole_word;
    l.first_special = l.whole_word + 1;
    l.file["model"]["ignore_merges"] = ignore_merges;
    json added = json::array();
    for (int k = 0; k < 256; ++k) {
        added.push_back({{"id", l.first_special + k},
                         {"content", special_name(k)},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", true}});
    }
    l.file["added_tokens"] = added;
    l.file["pre_tokenizer"] = {{"type", "Sequence"},
                               {"pretokenizers",
                                {{{"type", "Split"},
                                  {"pattern", {{"Regex", kLlama3Pattern}}},
                                  {"behavior", "Isolated"},
                                  {"invert", false}},
                                 {{"type", "ByteLevel"},
                                  {"add_prefix_space", false},
                                  {"trim_offsets", true},
                                  {"use_regex", false}}}}};
    const json bos = {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 0}}}};
    l.file["post_processor"] = {
        {"type", "Sequence"},
        {"processors",
         {{{"type", "ByteLevel"},
           {"add_prefix_space", true},
           {"trim_offsets", false},
           {"use_regex", true}},
          {{"type", "TemplateProcessing"},
           {"single", {bos, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
           {"pair",
            {bos,
             {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
             {{"SpecialToken", {{"id", "<|begin_of_text|>"}, {"type_id", 1}}}},
             {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
           {"special_tokens",
            {{"<|begin_of_text|>",
              {{"id", "<|begin_of_text|>"},
               {"ids", {l.first_special}},
               {"tokens", {"<|begin_of_text|>"}}}}}}}}}};
    l.file["decoder"] = {{"type", "ByteLevel"},
                         {"add_prefix_space", true},
                         {"trim_offsets", true},
                         {"use_regex", true}};
    return l;
}

}  // namespace memtrain::data::testing
