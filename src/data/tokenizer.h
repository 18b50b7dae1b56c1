// Byte-level BPE tokenizer (GPT-2 and Llama 3 style): loads OpenAI's encoder.json + vocab.bpe or a
// Hugging Face tokenizer.json, encodes and decodes text, and trains a new vocabulary. Text is split
// by the file's pre-tokenizer (GPT-2's or Llama 3's), each piece is merged by rank; special tokens
// such as <|endoftext|> written in the text are encoded as their own id.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace memtrain::data {

// The pre-tokenizers memtrain implements (by hand, see docs/data.md).
enum class PreTokenizer : uint8_t { kGpt2, kLlama3 };
const char* pre_tokenizer_name(PreTokenizer kind);  // "gpt2" or "llama3"

class Tokenizer {
  public:
    // `path` is a directory holding encoder.json + vocab.bpe or tokenizer.json, a tokenizer.json
    // file, or an encoder.json file with vocab.bpe beside it.
    static Tokenizer load(const std::string& path);
    // Trains a byte-level BPE vocabulary of exactly `vocab_size` ids: the 256 bytes (id = byte
    // value), then one id per merge, then "<|endoftext|>" as the last id.
    static Tokenizer train(const std::vector<std::string>& documents, int vocab_size);
    // Writes a Hugging Face tokenizer.json (BPE model, the pre-tokenizer it was loaded with,
    // its template post-processor if any, ByteLevel decoder); load() gives the same tokenizer.
    void save(const std::string& tokenizer_json_path) const;

    // Thread-safe: encode may be called concurrently on one tokenizer. The ids of the text alone,
    // without the post-processor's BOS.
    std::vector<uint32_t> encode(std::string_view text) const;
    // With add_special, wrapped in the post-processor's special tokens as Hugging Face's
    // `tokenizer(text)` does (Llama 3: <|begin_of_text|> first). Throws if the file's
    // post-processor is one memtrain does not interpret.
    std::vector<uint32_t> encode(std::string_view text, bool add_special) const;
    std::string decode(std::span<const uint32_t> ids) const;

    int vocab_size() const { return static_cast<int>(id_to_bytes_.size()); }
    // <|endoftext|> (GPT-2) or <|end_of_text|> (Llama 3), when the tokenizer has one.
    std::optional<uint32_t> eot_token() const { return eot_; }
    // The single special token the post-processor puts before the text, if any.
    std::optional<uint32_t> bos_token() const {
        return prefix_.size() == 1 ? std::optional<uint32_t>(prefix_[0]) : std::nullopt;
    }
    size_t num_merges() const { return merge_list_.size(); }
    size_t num_added_tokens() const { return specials_.size(); }
    PreTokenizer pre_tokenizer() const { return pre_; }
    bool ignore_merges() const { return ignore_merges_; }
    // The id of an added token or vocab token spelled exactly `token` (raw bytes).
    std::optional<uint32_t> token_id(std::string_view token) const;
    // A 64-bit hash of everything that decides the ids: the bytes of every id, the merges, the
    // added tokens, the pre-tokenizer, ignore_merges and the post-processor's tokens. Identical
    // for a tokenizer and its save()/load() copy; never 0.
    uint64_t fingerprint() const;

    // The GPT-2 pre-tokenizer: splits UTF-8 text into the pieces BPE merges within. Exposed for
    // tests and for training.
    static std::vector<std::string_view> pre_tokenize(std::string_view text);
    // The pre-tokenizer `kind`; invalid UTF-8 bytes are each one character of class "other".
    static std::vector<std::string_view> pre_tokenize(std::string_view text, PreTokenizer kind);

  private:
    struct Cache;

    Tokenizer() = default;  // only load() and train() make one, always complete

    // Builds the lookup tables from raw-byte tokens. `vocab` maps id -> raw bytes (nullopt for
    // ids only present as added tokens), `merges` are (left id, right id) pairs by rank.
    void build(std::string_view source, std::vector<std::optional<std::string>> vocab,
               const std::vector<std::pair<std::string, std::string>>& merges,
               const std::vector<std::pair<std::string, uint32_t>>& specials);
    void encode_piece(std::string_view piece, std::vector<uint32_t>& out) const;
    void encode_ordinary(std::string_view text, std::vector<uint32_t>& out) const;

    std::vector<std::string> id_to_bytes_;  // raw bytes of every id
    std::vector<bool> in_vocab_;            // false: id exists only as an added token
    std::unordered_map<std::string, uint32_t> bytes_to_id_;  // vocab tokens by raw bytes
    std::array<uint32_t, 256> byte_id_{};                    // id of each single byte
    std::unordered_map<uint64_t, uint64_t> merges_;  // (left << 32 | right) -> (rank << 32 | id)
    std::vector<std::pair<uint32_t, uint32_t>> merge_list_;   // by rank
    std::vector<std::pair<std::string, uint32_t>> specials_;  // added tokens matched in text
    std::optional<uint32_t> eot_;
    PreTokenizer pre_ = PreTokenizer::kGpt2;
    bool ignore_merges_ = false;
    std::vector<uint32_t> prefix_, suffix_;  // the template post-processor's specials
    std::string post_processor_;    // its JSON, written back by save(); empty: plain ByteLevel
    std::string unsupported_post_;  // a post-processor type encode(text, true) cannot honour
    std::shared_ptr<Cache> cache_;  // shared by copies: the tables it caches are immutable
};

}  // namespace memtrain::data
