// Byte-level BPE: file loading (GPT-2 encoder.json/vocab.bpe, Hugging Face tokenizer.json), the
// GPT-2 pre-tokenizer written by hand over UTF-8, rank-ordered merging with a shared cache, and
// a BPE trainer that updates pair counts incrementally.
#include "data/tokenizer.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <queue>
#include <sstream>
#include <system_error>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/regular_file.h"
#include "data/unicode_class.h"

namespace memtrain::data {

namespace fs = std::filesystem;

namespace {

constexpr const char* kEot = "<|endoftext|>";
// Llama 3's end of a document. Its <|eot_id|> ends a chat turn, not a document, so it is not the
// end-of-text token.
constexpr const char* kEndOfText = "<|end_of_text|>";

// ---- GPT-2's byte <-> unicode mapping -------------------------------------------------------
// Printable bytes map to themselves; the others to code points from 256 up, so every token is
// printable text in the vocab files.

struct ByteLevel {
    std::array<uint32_t, 256> byte_to_cp{};
    std::array<int, 324> cp_to_byte{};  // code points used are < 256 + 68
    ByteLevel() {
        cp_to_byte.fill(-1);
        int n = 0;
        for (int b = 0; b < 256; ++b) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
            byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : static_cast<uint32_t>(256 + n++);
            cp_to_byte[byte_to_cp[b]] = b;
        }
    }
};

const ByteLevel& byte_level() {
    static const ByteLevel table;
    return table;
}

void append_utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | (cp >> 6));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | (cp >> 12));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | (cp >> 18));
        out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
        out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

// Decodes one code point at s[i]. Invalid, overlong or truncated sequences yield one byte with
// ok=false, so arbitrary bytes still tokenize (each such byte is its own "other" character).
struct Decoded {
    uint32_t cp;
    int len;
    bool ok;
};

Decoded decode_utf8(std::string_view s, size_t i) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) return {b0, 1, true};
    int len = 0;
    uint32_t cp = 0, min = 0;
    if ((b0 & 0xE0) == 0xC0) {
        len = 2, cp = b0 & 0x1F, min = 0x80;
    } else if ((b0 & 0xF0) == 0xE0) {
        len = 3, cp = b0 & 0x0F, min = 0x800;
    } else if ((b0 & 0xF8) == 0xF0) {
        len = 4, cp = b0 & 0x07, min = 0x10000;
    } else {
        return {b0, 1, false};
    }
    if (i + len > s.size()) return {b0, 1, false};
    for (int k = 1; k < len; ++k) {
        const auto b = static_cast<unsigned char>(s[i + k]);
        if ((b & 0xC0) != 0x80) return {b0, 1, false};
        cp = (cp << 6) | (b & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return {b0, 1, false};
    return {cp, len, true};
}

// Byte-level token text (as in vocab files) -> raw bytes; nullopt if a character is outside the
// 256-character byte-level alphabet.
std::optional<std::string> bytelevel_to_bytes(std::string_view token) {
    const auto& bl = byte_level();
    std::string out;
    out.reserve(token.size());
    for (size_t i = 0; i < token.size();) {
        Decoded d = decode_utf8(token, i);
        if (!d.ok || d.cp >= bl.cp_to_byte.size() || bl.cp_to_byte[d.cp] < 0) return std::nullopt;
        out += static_cast<char>(bl.cp_to_byte[d.cp]);
        i += d.len;
    }
    return out;
}

std::string bytes_to_bytelevel(std::string_view bytes) {
    const auto& bl = byte_level();
    std::string out;
    for (unsigned char b : bytes) append_utf8(out, bl.byte_to_cp[b]);
    return out;
}

// Printable form of a token for error messages.
std::string shown_token(std::string_view s) {
    // `replace`: a message about a corrupt file must not itself throw on invalid UTF-8.
    return nlohmann::json(std::string(s))
        .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Tokenizer files are at most kMaxTokenizerBytes (64 MiB; Llama 3's tokenizer.json is 9 MB): a
// FIFO, /dev/zero or a 10 GB file is refused before it is read.
std::string read_text_file(const std::string& path, const char* what) {
    return read_regular_file(path, kMaxTokenizerBytes, what);
}

// A parse error names the byte, not the text there: the file may not be a tokenizer at all.
nlohmann::json parse_json(const std::string& path, const std::string& text) {
    check_json_nesting(text, 64, path);
    try {
        return nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
        fail("{}: malformed JSON (parse error at byte {})", path, e.byte);
    } catch (const nlohmann::json::exception&) {  // a number out of range (1e999)
        fail("{}: malformed JSON (a number out of range)", path);
    }
}

// Ids in files are bounded so that a corrupt file cannot make us allocate gigabytes.
uint32_t checked_id(const nlohmann::json& v, const std::string& path, std::string_view token,
                    size_t num_entries) {
    if (!v.is_number_unsigned()) {
        fail("{}: token {} has id {}; expected a non-negative integer", path, shown_token(token),
             v.dump());
    }
    const uint64_t id = v.get<uint64_t>();
    if (id >= num_entries + 1024) {
        fail("{}: token {} has id {}, far beyond the {} entries in the file", path,
             shown_token(token), id, num_entries);
    }
    return static_cast<uint32_t>(id);
}

void put_vocab(std::vector<std::optional<std::string>>& vocab, uint32_t id, std::string bytes,
               const std::string& path, std::string_view token) {
    if (vocab.size() <= id) vocab.resize(id + 1);
    if (vocab[id])
        fail("{}: id {} is used by two tokens (one is {})", path, id, shown_token(token));
    vocab[id] = std::move(bytes);
}

std::string vocab_token_bytes(const std::string& path, const std::string& token) {
    auto bytes = bytelevel_to_bytes(token);
    if (!bytes) {
        fail(
            "{}: vocab token {} has a character outside GPT-2's byte-level alphabet; only "
            "byte-level BPE tokenizers are supported",
            path, shown_token(token));
    }
    return *bytes;
}

// A merge names two byte-level tokens; unknown characters make it name an unknown token, which
// build() reports with the merge's rank.
std::pair<std::string, std::string> merge_bytes(const std::string& left, const std::string& right) {
    auto l = bytelevel_to_bytes(left), r = bytelevel_to_bytes(right);
    // A character outside the alphabet cannot be in the vocab: keep it as a marker build() rejects.
    return {l ? *l : std::string("\xff\xfe") + left, r ? *r : std::string("\xff\xfe") + right};
}

}  // namespace

// ---- cache ------------------------------------------------------------------------------------

struct Tokenizer::Cache {
    static constexpr size_t kShards = 32;
    static constexpr size_t kMaxPerShard = 1 << 14;
    struct Shard {
        std::mutex mutex;
        std::unordered_map<std::string, std::vector<uint32_t>> map;
    };
    std::array<Shard, kShards> shards;
};

// ---- pre-tokenizer ----------------------------------------------------------------------------

namespace {

struct Cp {
    uint32_t cp;
    size_t offset;
    CharClass cls;
};

// An invalid UTF-8 byte becomes one character of class "other" (the class of the lone surrogate
// Python's surrogateescape would make of it).
std::vector<Cp> code_points(std::string_view text) {
    std::vector<Cp> cps;
    cps.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
        Decoded d = decode_utf8(text, i);
        cps.push_back({d.cp, i, d.ok ? char_class(d.cp) : CharClass::kOther});
        i += d.len;
    }
    return cps;
}

// Llama 3's pattern
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// by scanning classes, first matching alternative at each position, as the regex does.
std::vector<std::string_view> pre_tokenize_llama3(std::string_view text) {
    const std::vector<Cp> cps = code_points(text);
    const size_t n = cps.size();
    auto offset = [&](size_t k) { return k < n ? cps[k].offset : text.size(); };
    auto cls = [&](size_t k) { return cps[k].cls; };
    auto is_rn = [&](size_t k) { return cps[k].cp == '\r' || cps[k].cp == '\n'; };
    auto lower = [&](size_t k) { return k < n && cps[k].cp < 0x80 ? cps[k].cp | 0x20 : 0u; };
    auto run = [&](size_t k, CharClass c) {
        while (k < n && cls(k) == c) ++k;
        return k;
    };
    std::vector<std::string_view> pieces;
    size_t i = 0;
    while (i < n) {
        size_t j = 0;
        // `| 0x20` lowers ASCII letters; the quote and the other characters never collide.
        const uint32_t c1 = lower(i + 1), c2 = lower(i + 2);
        if (cps[i].cp == '\'' && (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')) {
            j = i + 2;
        } else if (cps[i].cp == '\'' && ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
                                         (c1 == 'l' && c2 == 'l'))) {
            j = i + 3;
        } else if (cls(i) == CharClass::kLetter) {
            j = run(i, CharClass::kLetter);
        } else if (cls(i) != CharClass::kNumber && !is_rn(i) && i + 1 < n &&
                   cls(i + 1) == CharClass::kLetter) {
            j = run(i + 1, CharClass::kLetter);  // one non-letter, non-digit may lead a word
        } else if (cls(i) == CharClass::kNumber) {
            j = std::min(run(i, CharClass::kNumber), i + 3);
        } else if (cls(i) == CharClass::kOther ||
                   (cps[i].cp == ' ' && i + 1 < n && cls(i + 1) == CharClass::kOther)) {
            j = run(cls(i) == CharClass::kOther ? i : i + 1, CharClass::kOther);
            while (j < n && is_rn(j)) ++j;
        } else {
            // Whitespace. \s*[\r\n]+ ends after the run's last line break; else \s+(?!\S) leaves
            // the run's last character to lead the next word; a single one is \s+.
            const size_t e = run(i, CharClass::kSpace);
            size_t last_rn = e;
            for (size_t k = i; k < e; ++k) {
                if (is_rn(k)) last_rn = k;
            }
            if (last_rn < e) {
                j = last_rn + 1;
            } else if (e == n || e - 1 == i) {
                j = e;
            } else {
                j = e - 1;
            }
        }
        pieces.push_back(text.substr(offset(i), offset(j) - offset(i)));
        i = j;
    }
    return pieces;
}

}  // namespace

const char* pre_tokenizer_name(PreTokenizer kind) {
    return kind == PreTokenizer::kLlama3 ? "llama3" : "gpt2";
}

std::vector<std::string_view> Tokenizer::pre_tokenize(std::string_view text, PreTokenizer kind) {
    return kind == PreTokenizer::kLlama3 ? pre_tokenize_llama3(text) : pre_tokenize(text);
}

// Implements 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+ by
// scanning classes: at each position the first alternative that matches wins, as in the regex.
std::vector<std::string_view> Tokenizer::pre_tokenize(std::string_view text) {
    const std::vector<Cp> cps = code_points(text);
    const size_t n = cps.size();
    auto offset = [&](size_t k) { return k < n ? cps[k].offset : text.size(); };
    std::vector<std::string_view> pieces;
    size_t i = 0;
    while (i < n) {
        size_t j = i + 1;
        const uint32_t c0 = cps[i].cp;
        const uint32_t c1 = i + 1 < n ? cps[i + 1].cp : 0, c2 = i + 2 < n ? cps[i + 2].cp : 0;
        if (c0 == '\'' && (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd')) {
            j = i + 2;
        } else if (c0 == '\'' && ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') ||
                                  (c1 == 'l' && c2 == 'l'))) {
            j = i + 3;
        } else {
            // ` ?X+` for X in letters, numbers, other: an ASCII space may lead the run.
            size_t start = i;
            if (c0 == ' ' && i + 1 < n && cps[i + 1].cls != CharClass::kSpace) start = i + 1;
            const CharClass cls = cps[start].cls;
            if (cls != CharClass::kSpace) {
                j = start + 1;
                while (j < n && cps[j].cls == cls) ++j;
            } else {
                // \s+(?!\S): a whitespace run, leaving its last character to lead the next word;
                // a single whitespace character before a word falls through to \s+.
                j = i;
                while (j < n && cps[j].cls == CharClass::kSpace) ++j;
                if (j < n && j - 1 > i) --j;
            }
        }
        pieces.push_back(text.substr(offset(i), offset(j) - offset(i)));
        i = j;
    }
    return pieces;
}

// ---- encode / decode --------------------------------------------------------------------------

// Merges one piece: repeatedly apply the lowest-ranked adjacent pair, leftmost first (a heap over
// a linked list, so long pieces stay O(n log n)).
void Tokenizer::encode_piece(std::string_view piece, std::vector<uint32_t>& out) const {
    if (piece.size() == 1) {
        out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
        return;
    }
    // ignore_merges (Llama 3): a piece that is itself a vocab token is that token, even where the
    // merge ranks would segment it differently.
    if (ignore_merges_) {
        if (auto it = bytes_to_id_.find(std::string(piece)); it != bytes_to_id_.end()) {
            out.push_back(it->second);
            return;
        }
    }
    const bool cacheable = cache_ && piece.size() <= 64;
    Cache::Shard* shard = nullptr;
    if (cacheable) {
        shard = &cache_->shards[std::hash<std::string_view>{}(piece) % Cache::kShards];
        std::lock_guard lock(shard->mutex);
        auto it = shard->map.find(std::string(piece));
        if (it != shard->map.end()) {
            out.insert(out.end(), it->second.begin(), it->second.end());
            return;
        }
    }
    struct Sym {
        uint32_t id;
        int prev, next;
        bool alive;
    };
    struct Cand {
        uint32_t rank, pos, left, right, merged;
        bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    const int n = static_cast<int>(piece.size());
    std::vector<Sym> syms(n);
    for (int k = 0; k < n; ++k) {
        syms[k] = {byte_id_[static_cast<unsigned char>(piece[k])], k - 1, k + 1 < n ? k + 1 : -1,
                   true};
    }
    std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
    auto consider = [&](int l, int r) {
        auto it = merges_.find((uint64_t{syms[l].id} << 32) | syms[r].id);
        if (it == merges_.end()) return;
        heap.push({static_cast<uint32_t>(it->second >> 32), static_cast<uint32_t>(l), syms[l].id,
                   syms[r].id, static_cast<uint32_t>(it->second)});
    };
    for (int k = 0; k + 1 < n; ++k) consider(k, k + 1);
    while (!heap.empty()) {
        const Cand c = heap.top();
        heap.pop();
        Sym& left = syms[c.pos];
        if (!left.alive || left.id != c.left || left.next < 0) continue;
        Sym& right = syms[left.next];
        if (right.id != c.right) continue;
        left.id = c.merged;
        right.alive = false;
        left.next = right.next;
        if (left.next >= 0) syms[left.next].prev = static_cast<int>(c.pos);
        if (left.prev >= 0) consider(left.prev, static_cast<int>(c.pos));
        if (left.next >= 0) consider(static_cast<int>(c.pos), left.next);
    }
    const size_t first = out.size();
    for (int k = 0; k >= 0; k = syms[k].next) out.push_back(syms[k].id);
    if (cacheable) {
        std::lock_guard lock(shard->mutex);
        if (shard->map.size() >= Cache::kMaxPerShard) shard->map.clear();
        shard->map.emplace(std::string(piece),
                           std::vector<uint32_t>(out.begin() + first, out.end()));
    }
}

void Tokenizer::encode_ordinary(std::string_view text, std::vector<uint32_t>& out) const {
    for (std::string_view piece : pre_tokenize(text, pre_)) encode_piece(piece, out);
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text) const {
    std::vector<uint32_t> out;
    out.reserve(text.size() / 3 + 1);
    // Next occurrence of each special token at or after `pos`, refreshed only when passed, so
    // scanning stays linear in the text.
    std::vector<size_t> next(specials_.size(), 0);
    std::vector<bool> fresh(specials_.size(), false);
    size_t pos = 0;
    while (pos < text.size()) {
        size_t best = std::string_view::npos, best_k = 0;
        for (size_t k = 0; k < specials_.size(); ++k) {
            if (!fresh[k] || (next[k] != std::string_view::npos && next[k] < pos)) {
                next[k] = text.find(specials_[k].first, pos);
                fresh[k] = true;
            }
            // specials_ is sorted longest first, so on a tie the longest token wins.
            if (next[k] < best) best = next[k], best_k = k;
        }
        if (best == std::string_view::npos) {
            encode_ordinary(text.substr(pos), out);
            break;
        }
        encode_ordinary(text.substr(pos, best - pos), out);
        out.push_back(specials_[best_k].second);
        pos = best + specials_[best_k].first.size();
    }
    return out;
}

std::vector<uint32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
    if (!add_special) return encode(text);
    if (!unsupported_post_.empty()) {
        fail(
            "tokenizer: its post-processor {} is not interpreted by memtrain, so the special "
            "tokens it adds are unknown; only TemplateProcessing (alone or in a Sequence) is",
            unsupported_post_);
    }
    std::vector<uint32_t> out = prefix_;
    const std::vector<uint32_t> ids = encode(text);
    out.insert(out.end(), ids.begin(), ids.end());
    out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
}

std::optional<uint32_t> Tokenizer::token_id(std::string_view token) const {
    for (const auto& [content, id] : specials_) {
        if (content == token) return id;
    }
    if (auto it = bytes_to_id_.find(std::string(token)); it != bytes_to_id_.end())
        return it->second;
    return std::nullopt;
}

uint64_t Tokenizer::fingerprint() const {
    // FNV-1a over a length-prefixed serialization, so that no two different tables feed the same
    // byte stream; then a splitmix64 finalizer to spread FNV's weak high bits.
    uint64_t h = 0xcbf29ce484222325ull;
    auto bytes = [&](const void* p, size_t n) {
        const auto* c = static_cast<const unsigned char*>(p);
        for (size_t i = 0; i < n; ++i) h = (h ^ c[i]) * 0x100000001b3ull;
    };
    auto u64 = [&](uint64_t v) {
        unsigned char b[8];
        for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(v >> (8 * i));
        bytes(b, 8);
    };
    auto str = [&](std::string_view v) {
        u64(v.size());
        bytes(v.data(), v.size());
    };
    str("memtrain-tokenizer-v1");
    u64(id_to_bytes_.size());
    for (size_t id = 0; id < id_to_bytes_.size(); ++id) {
        u64(in_vocab_[id] ? 1 : 0);
        str(id_to_bytes_[id]);
    }
    u64(merge_list_.size());
    for (const auto& [a, b] : merge_list_) u64((uint64_t{a} << 32) | b);
    auto specials = specials_;
    std::sort(specials.begin(), specials.end(),
              [](const auto& x, const auto& y) { return x.second < y.second; });
    u64(specials.size());
    for (const auto& [content, id] : specials) {
        u64(id);
        str(content);
    }
    str(pre_tokenizer_name(pre_));
    u64(ignore_merges_ ? 1 : 0);
    for (const auto* list : {&prefix_, &suffix_}) {
        u64(list->size());
        for (uint32_t id : *list) u64(id);
    }
    uint64_t z = h + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z == 0 ? 1 : z;
}

std::string Tokenizer::decode(std::span<const uint32_t> ids) const {
    std::string out;
    for (uint32_t id : ids) {
        if (id >= id_to_bytes_.size()) {
            fail("tokenizer decode: token id {} is out of range for vocab size {}", id,
                 id_to_bytes_.size());
        }
        out += id_to_bytes_[id];
    }
    return out;
}

// ---- building the tables ----------------------------------------------------------------------

void Tokenizer::build(std::string_view source, std::vector<std::optional<std::string>> vocab,
                      const std::vector<std::pair<std::string, std::string>>& merges,
                      const std::vector<std::pair<std::string, uint32_t>>& specials) {
    for (const auto& [content, id] : specials) {
        if (content.empty()) fail("{}: added token {} has empty content", source, id);
        if (vocab.size() <= id) vocab.resize(id + 1);
    }
    id_to_bytes_.assign(vocab.size(), std::string());
    in_vocab_.assign(vocab.size(), false);
    bytes_to_id_.clear();
    for (size_t id = 0; id < vocab.size(); ++id) {
        if (!vocab[id]) continue;
        auto [it, inserted] = bytes_to_id_.emplace(*vocab[id], static_cast<uint32_t>(id));
        if (!inserted) {
            fail("{}: tokens {} and {} are the same bytes {}", source, it->second, id,
                 shown_token(bytes_to_bytelevel(*vocab[id])));
        }
        id_to_bytes_[id] = *vocab[id];
        in_vocab_[id] = true;
    }
    for (int b = 0; b < 256; ++b) {
        auto it = bytes_to_id_.find(std::string(1, static_cast<char>(b)));
        if (it == bytes_to_id_.end()) {
            fail(
                "{}: the vocab has no token for byte 0x{:02x}; only byte-level BPE vocabularies "
                "(all 256 bytes present) are supported",
                source, b);
        }
        byte_id_[b] = it->second;
    }
    merges_.clear();
    merge_list_.clear();
    for (size_t rank = 0; rank < merges.size(); ++rank) {
        const auto& [l, r] = merges[rank];
        auto lookup = [&](const std::string& bytes) {
            auto it = bytes_to_id_.find(bytes);
            if (it == bytes_to_id_.end()) {
                const std::string shown =
                    bytes.starts_with("\xff\xfe") ? bytes.substr(2) : bytes_to_bytelevel(bytes);
                fail("{}: merge {} ({} {}) names token {}, which is not in the vocab", source, rank,
                     shown_token(bytes_to_bytelevel(l)), shown_token(bytes_to_bytelevel(r)),
                     shown_token(shown));
            }
            return it->second;
        };
        const uint32_t a = lookup(l), b = lookup(r), c = lookup(l + r);
        const uint64_t key = (uint64_t{a} << 32) | b;
        if (merges_.count(key)) continue;  // a repeated merge never applies again
        merges_.emplace(key, (uint64_t{static_cast<uint32_t>(merge_list_.size())} << 32) | c);
        merge_list_.emplace_back(a, b);
    }
    specials_.clear();
    eot_.reset();
    for (const auto& [content, id] : specials) {
        if (in_vocab_[id] && id_to_bytes_[id] != content) {
            fail("{}: added token {} has id {}, which the vocab gives to {}", source,
                 shown_token(content), id, shown_token(bytes_to_bytelevel(id_to_bytes_[id])));
        }
        if (!in_vocab_[id] && !id_to_bytes_[id].empty() && id_to_bytes_[id] != content) {
            fail("{}: id {} is given to two added tokens", source, id);
        }
        id_to_bytes_[id] = content;
        specials_.emplace_back(content, id);
        if (content == kEot || (content == kEndOfText && !eot_)) eot_ = id;
    }
    std::stable_sort(specials_.begin(), specials_.end(),
                     [](const auto& x, const auto& y) { return x.first.size() > y.first.size(); });
    cache_ = std::make_shared<Cache>();
}

// ---- loading ----------------------------------------------------------------------------------

namespace {

// A special token the post-processor adds: its content, and its id when the file states it.
using TemplateToken = std::pair<std::string, std::optional<uint32_t>>;

struct Parsed {
    std::vector<std::optional<std::string>> vocab;
    std::vector<std::pair<std::string, std::string>> merges;
    std::vector<std::pair<std::string, uint32_t>> specials;
    PreTokenizer pre = PreTokenizer::kGpt2;
    bool ignore_merges = false;
    std::vector<TemplateToken> prefix, suffix;
    std::string post_processor;  // kept for save(); empty for none or a plain ByteLevel
    std::string unsupported_post;
};

constexpr std::string_view kGpt2Pattern =
    R"re('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)re";
constexpr std::string_view kLlama3Pattern =
    R"re((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)re";

// A JSON value for an error message, cut short: a pre-tokenizer can be a long object.
std::string shown_json(const nlohmann::json& v) {
    std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    if (s.size() > 300) s = s.substr(0, 300) + "...";
    return s;
}

std::string json_type(const nlohmann::json& v) {
    return v.is_object() && v.contains("type") && v["type"].is_string()
               ? v["type"].get<std::string>()
               : std::string();
}

bool json_bool(const nlohmann::json& v, const char* key, bool fallback) {
    if (!v.contains(key) || v[key].is_null()) return fallback;
    return v[key].is_boolean() ? v[key].get<bool>() : !fallback;  // a non-bool is "unexpected"
}

// Which hand-written pre-tokenizer reproduces the file's: GPT-2's ByteLevel (use_regex true), or
// a Split with exactly GPT-2's or Llama 3's pattern followed by ByteLevel (use_regex false).
PreTokenizer detect_pre_tokenizer(const std::string& path, const nlohmann::json& j) {
    const char* supported =
        "memtrain implements ByteLevel (GPT-2's pattern) and Split with Llama 3's pattern + "
        "ByteLevel without regex";
    if (!j.contains("pre_tokenizer") || j["pre_tokenizer"].is_null()) {
        fail("{}: no pre_tokenizer; {}", path, supported);
    }
    const nlohmann::json& pt = j["pre_tokenizer"];
    std::vector<nlohmann::json> steps;
    if (json_type(pt) == "Sequence" && pt.contains("pretokenizers") &&
        pt["pretokenizers"].is_array()) {
        steps.assign(pt["pretokenizers"].begin(), pt["pretokenizers"].end());
    } else {
        steps.push_back(pt);
    }
    auto byte_level = [&](const nlohmann::json& b, bool use_regex) {
        return json_type(b) == "ByteLevel" && !json_bool(b, "add_prefix_space", false) &&
               json_bool(b, "use_regex", true) == use_regex;
    };
    if (steps.size() == 1 && byte_level(steps[0], true)) return PreTokenizer::kGpt2;
    if (steps.size() == 2 && json_type(steps[0]) == "Split" && byte_level(steps[1], false)) {
        const nlohmann::json& split = steps[0];
        const bool has_regex = split.contains("pattern") && split["pattern"].is_object() &&
                               split["pattern"].contains("Regex") &&
                               split["pattern"]["Regex"].is_string();
        const std::string behavior = split.contains("behavior") && split["behavior"].is_string()
                                         ? split["behavior"].get<std::string>()
                                         : std::string();
        if (!has_regex || behavior != "Isolated" || json_bool(split, "invert", false)) {
            fail(
                "{}: pre_tokenizer Split {} is not supported: expected a \"Regex\" pattern, "
                "behavior \"Isolated\" and invert false; {}",
                path, shown_json(split), supported);
        }
        const std::string pattern = split["pattern"]["Regex"].get<std::string>();
        if (pattern == kLlama3Pattern) return PreTokenizer::kLlama3;
        if (pattern == kGpt2Pattern) return PreTokenizer::kGpt2;
        fail(
            "{}: pre_tokenizer Split pattern {} is not supported; memtrain implements exactly "
            "Llama 3's pattern {} and GPT-2's {}",
            path, shown_token(pattern), shown_token(kLlama3Pattern), shown_token(kGpt2Pattern));
    }
    fail("{}: pre_tokenizer {} is not supported; {}", path, shown_json(pt), supported);
}

// The special tokens a TemplateProcessing puts around a single sequence ("single": specials,
// then {"Sequence": {"id": "A"}}, then specials). Other post-processors are recorded so that
// encode(text, true) can refuse them; ByteLevel only adjusts offsets and is ignored.
void parse_post_processor(const std::string& path, const nlohmann::json& j, Parsed& p) {
    if (!j.contains("post_processor") || j["post_processor"].is_null()) return;
    const nlohmann::json& pp = j["post_processor"];
    std::vector<nlohmann::json> steps;
    if (json_type(pp) == "Sequence" && pp.contains("processors") && pp["processors"].is_array()) {
        steps.assign(pp["processors"].begin(), pp["processors"].end());
    } else {
        steps.push_back(pp);
    }
    bool has_template = false;
    for (const nlohmann::json& step : steps) {
        const std::string type = json_type(step);
        if (type == "ByteLevel") continue;
        if (type != "TemplateProcessing" || has_template) {
            p.unsupported_post = type.empty() ? shown_json(step) : shown_token(type);
            continue;
        }
        has_template = true;
        if (!step.contains("single") || !step["single"].is_array()) {
            fail("{}: post_processor TemplateProcessing has no \"single\" list", path);
        }
        bool seen_text = false;
        for (const nlohmann::json& item : step["single"]) {
            if (item.contains("Sequence") && item["Sequence"].is_object() &&
                item["Sequence"].value("id", std::string()) == "A" && !seen_text) {
                seen_text = true;
            } else if (item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                       item["SpecialToken"].contains("id") &&
                       item["SpecialToken"]["id"].is_string()) {
                const std::string name = item["SpecialToken"]["id"].get<std::string>();
                const nlohmann::json* entry = nullptr;
                if (step.contains("special_tokens") && step["special_tokens"].is_object() &&
                    step["special_tokens"].contains(name)) {
                    entry = &step["special_tokens"][name];
                }
                auto& dst = seen_text ? p.suffix : p.prefix;
                if (entry && entry->contains("ids") && (*entry)["ids"].is_array()) {
                    for (const auto& id : (*entry)["ids"]) {
                        dst.emplace_back(name, checked_id(id, path, name, p.vocab.size() + 1024));
                    }
                } else {
                    dst.emplace_back(name, std::nullopt);  // resolved by content after build
                }
            } else {
                fail(
                    "{}: post_processor template item {} is not supported; expected "
                    "SpecialToken entries around one {{\"Sequence\": {{\"id\": \"A\"}}}}",
                    path, shown_json(item));
            }
        }
        if (!seen_text) fail("{}: post_processor template has no {{\"Sequence\": ...}}", path);
    }
    if (!(steps.size() == 1 && json_type(pp) == "ByteLevel")) p.post_processor = pp.dump();
}

Parsed parse_gpt2(const std::string& encoder_path, const std::string& bpe_path) {
    Parsed p;
    const nlohmann::json enc =
        parse_json(encoder_path, read_text_file(encoder_path, "encoder.json"));
    if (!enc.is_object() || enc.empty()) {
        fail("{}: expected a JSON object mapping tokens to ids", encoder_path);
    }
    for (const auto& [token, v] : enc.items()) {
        const uint32_t id = checked_id(v, encoder_path, token, enc.size());
        put_vocab(p.vocab, id, vocab_token_bytes(encoder_path, token), encoder_path, token);
        if (token == kEot) p.specials.emplace_back(token, id);
    }
    const std::string bpe = read_text_file(bpe_path, "vocab.bpe");
    std::istringstream lines(bpe);
    std::string line;
    size_t line_no = 0;
    while (std::getline(lines, line)) {
        ++line_no;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.empty() || line.starts_with("#version")) continue;
        const size_t space = line.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == line.size() ||
            line.find(' ', space + 1) != std::string::npos) {
            fail("{}:{}: merge line is {}; expected two tokens separated by one space", bpe_path,
                 line_no, shown_token(line));
        }
        p.merges.push_back(merge_bytes(line.substr(0, space), line.substr(space + 1)));
    }
    return p;
}

Parsed parse_hf(const std::string& path) {
    Parsed p;
    const nlohmann::json j = parse_json(path, read_text_file(path, "tokenizer.json"));
    try {
        if (!j.is_object() || !j.contains("model") || !j["model"].is_object()) {
            fail("{}: no \"model\" object; expected a Hugging Face tokenizer.json", path);
        }
        const auto& model = j["model"];
        if (model.contains("type")) {
            if (!model["type"].is_string() || model["type"].get<std::string>() != "BPE") {
                fail("{}: model.type is {}; only \"BPE\" (byte-level) tokenizers are supported",
                     path, model["type"].dump());
            }
        }
        if (!model.contains("vocab") || !model["vocab"].is_object()) {
            fail("{}: model.vocab is missing or not an object of token -> id", path);
        }
        if (!model.contains("merges") || !model["merges"].is_array()) {
            fail("{}: model.merges is missing or not an array", path);
        }
        if (model.contains("ignore_merges") && !model["ignore_merges"].is_null()) {
            if (!model["ignore_merges"].is_boolean()) {
                fail("{}: model.ignore_merges is {}; expected true or false", path,
                     model["ignore_merges"].dump());
            }
            p.ignore_merges = model["ignore_merges"].get<bool>();
        }
        p.pre = detect_pre_tokenizer(path, j);
        const auto& vocab = model["vocab"];
        const size_t added = j.contains("added_tokens") && j["added_tokens"].is_array()
                                 ? j["added_tokens"].size()
                                 : 0;
        for (const auto& [token, v] : vocab.items()) {
            const uint32_t id = checked_id(v, path, token, vocab.size() + added);
            put_vocab(p.vocab, id, vocab_token_bytes(path, token), path, token);
        }
        size_t rank = 0;
        for (const auto& m : model["merges"]) {
            if (m.is_string()) {
                const std::string s = m.get<std::string>();
                const size_t space = s.find(' ');
                if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
                    fail("{}: merge {} is {}; expected \"left right\"", path, rank, shown_token(s));
                }
                p.merges.push_back(merge_bytes(s.substr(0, space), s.substr(space + 1)));
            } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
                p.merges.push_back(merge_bytes(m[0].get<std::string>(), m[1].get<std::string>()));
            } else {
                fail("{}: merge {} is {}; expected \"left right\" or [\"left\", \"right\"]", path,
                     rank, m.dump());
            }
            ++rank;
        }
        if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
            if (!j["added_tokens"].is_array()) fail("{}: added_tokens is not an array", path);
            for (const auto& t : j["added_tokens"]) {
                if (!t.is_object() || !t.contains("content") || !t["content"].is_string() ||
                    !t.contains("id")) {
                    fail("{}: added token {} needs a string \"content\" and an \"id\"", path,
                         t.dump());
                }
                const std::string content = t["content"].get<std::string>();
                p.specials.emplace_back(content,
                                        checked_id(t["id"], path, content, vocab.size() + added));
            }
        }
        parse_post_processor(path, j, p);
    } catch (const nlohmann::json::exception& e) {
        fail("{}: unexpected tokenizer.json structure: {}", path, e.what());
    }
    return p;
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& path) {
    std::error_code ec;
    Tokenizer t;
    if (fs::is_directory(path, ec)) {
        const fs::path dir(path);
        if (fs::exists(dir / "tokenizer.json")) return load((dir / "tokenizer.json").string());
        if (fs::exists(dir / "encoder.json")) return load((dir / "encoder.json").string());
        fail("tokenizer directory '{}' holds neither tokenizer.json nor encoder.json + vocab.bpe",
             path);
    }
    if (!fs::exists(path, ec)) {
        fail(
            "tokenizer '{}' not found; expected a tokenizer.json, an encoder.json (with vocab.bpe "
            "beside it) or a directory holding them",
            path);
    }
    Parsed p;
    if (fs::path(path).filename() == "encoder.json") {
        const std::string bpe = (fs::path(path).parent_path() / "vocab.bpe").string();
        if (!fs::exists(bpe, ec)) fail("{}: expected vocab.bpe beside it at '{}'", path, bpe);
        p = parse_gpt2(path, bpe);
    } else {
        p = parse_hf(path);
    }
    t.build(path, std::move(p.vocab), p.merges, p.specials);
    t.pre_ = p.pre;
    t.ignore_merges_ = p.ignore_merges;
    t.post_processor_ = std::move(p.post_processor);
    t.unsupported_post_ = std::move(p.unsupported_post);
    for (auto [list, dst] : {std::pair{&p.prefix, &t.prefix_}, std::pair{&p.suffix, &t.suffix_}}) {
        for (const auto& [content, id] : *list) {
            const std::optional<uint32_t> resolved = id ? id : t.token_id(content);
            if (!resolved || *resolved >= static_cast<uint32_t>(t.vocab_size())) {
                fail(
                    "{}: post_processor adds special token {}, which is not in the vocab or "
                    "added_tokens",
                    path, shown_token(content));
            }
            dst->push_back(*resolved);
        }
    }
    return t;
}

void Tokenizer::save(const std::string& tokenizer_json_path) const {
    using nlohmann::json;
    // Written by hand, one vocab entry and one merge per line in id / rank order: nlohmann's
    // ordered_json inserts in linear time, which is quadratic for a 50k vocab.
    auto specials = specials_;
    std::sort(specials.begin(), specials.end(),
              [](const auto& x, const auto& y) { return x.second < y.second; });
    json added = json::array();
    for (const auto& [content, id] : specials) {
        added.push_back({{"id", id},
                         {"content", content},
                         {"single_word", false},
                         {"lstrip", false},
                         {"rstrip", false},
                         {"normalized", false},
                         {"special", true}});
    }
    const std::string byte_level =
        R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, )"
        R"("use_regex": true})";
    std::string text =
        "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n";
    text += "  \"added_tokens\": [";
    for (size_t i = 0; i < added.size(); ++i) {
        text += (i ? ",\n    " : "\n    ") + added[i].dump();
    }
    text += added.empty() ? "],\n" : "\n  ],\n";
    text += "  \"normalizer\": null,\n";
    std::string pre = byte_level;
    if (pre_ == PreTokenizer::kLlama3) {
        pre = R"({"type": "Sequence", "pretokenizers": [{"type": "Split", "pattern": {"Regex": )" +
              json(std::string(kLlama3Pattern)).dump() +
              R"(}, "behavior": "Isolated", "invert": false}, {"type": "ByteLevel", )"
              R"("add_prefix_space": false, "trim_offsets": true, "use_regex": false}]})";
    }
    text += "  \"pre_tokenizer\": " + pre + ",\n";
    text +=
        "  \"post_processor\": " + (post_processor_.empty() ? byte_level : post_processor_) + ",\n";
    text += "  \"decoder\": " + byte_level + ",\n";
    text +=
        "  \"model\": {\n    \"type\": \"BPE\",\n    \"dropout\": null,\n    \"unk_token\": "
        "null,\n";
    text += "    \"continuing_subword_prefix\": \"\",\n    \"end_of_word_suffix\": \"\",\n";
    text += "    \"fuse_unk\": false,\n    \"byte_fallback\": false,\n";
    if (ignore_merges_) text += "    \"ignore_merges\": true,\n";
    text += "    \"vocab\": {";
    bool first = true;
    for (size_t id = 0; id < id_to_bytes_.size(); ++id) {
        if (!in_vocab_[id]) continue;
        text += first ? "\n      " : ",\n      ";
        text += json(bytes_to_bytelevel(id_to_bytes_[id])).dump() + ": " + std::to_string(id);
        first = false;
    }
    text += "\n    },\n    \"merges\": [";
    for (size_t r = 0; r < merge_list_.size(); ++r) {
        const auto& [a, b] = merge_list_[r];
        text += r ? ",\n      " : "\n      ";
        text +=
            json(bytes_to_bytelevel(id_to_bytes_[a]) + " " + bytes_to_bytelevel(id_to_bytes_[b]))
                .dump();
    }
    text += merge_list_.empty() ? "]\n  }\n}\n" : "\n    ]\n  }\n}\n";
    // Written beside the target and renamed, so a crash never leaves half a file.
    const std::string tmp = tokenizer_json_path + ".tmp";
    {
        std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
        if (!out) fail("cannot write tokenizer '{}': {}", tmp, std::strerror(errno));
        out << text;
        out.flush();
        if (!out) fail("cannot write tokenizer '{}': write failed", tmp);
    }
    std::error_code ec;
    fs::rename(tmp, tokenizer_json_path, ec);
    if (ec) fail("cannot rename '{}' to '{}': {}", tmp, tokenizer_json_path, ec.message());
}

// ---- training ---------------------------------------------------------------------------------

// Classic BPE training over the distinct pre-tokenized words: pair counts are kept in a map and
// updated only for the words that contain the merged pair; a lazy max-heap finds the most
// frequent pair (ties: smallest (left id, right id), so the result is deterministic).
Tokenizer Tokenizer::train(const std::vector<std::string>& documents, int vocab_size) {
    if (vocab_size < 257) {
        fail(
            "tokenizer train: vocab size {} is too small; need at least 257 (256 bytes and "
            "<|endoftext|>)",
            vocab_size);
    }
    // Count words. <|endoftext|> in a document is a boundary, never part of a word.
    std::unordered_map<std::string, int64_t> counts;
    for (const std::string& doc : documents) {
        std::string_view rest(doc);
        while (!rest.empty()) {
            const size_t at = rest.find(kEot);
            for (std::string_view piece : pre_tokenize(rest.substr(0, at))) {
                ++counts[std::string(piece)];
            }
            if (at == std::string_view::npos) break;
            rest.remove_prefix(at + std::string_view(kEot).size());
        }
    }
    std::vector<std::pair<std::string, int64_t>> sorted(counts.begin(), counts.end());
    counts.clear();
    std::sort(sorted.begin(), sorted.end());

    struct Word {
        std::vector<uint32_t> syms;
        int64_t count;
    };
    std::vector<Word> words;
    words.reserve(sorted.size());
    for (auto& [text, count] : sorted) {
        Word w{{}, count};
        for (unsigned char b : text) w.syms.push_back(b);
        words.push_back(std::move(w));
    }
    auto key_of = [](uint32_t a, uint32_t b) { return (uint64_t{a} << 32) | b; };
    std::unordered_map<uint64_t, int64_t> pair_count;
    std::unordered_map<uint64_t, std::vector<uint32_t>> where;  // may hold stale word indices
    for (uint32_t w = 0; w < words.size(); ++w) {
        const auto& s = words[w].syms;
        for (size_t k = 0; k + 1 < s.size(); ++k) {
            const uint64_t key = key_of(s[k], s[k + 1]);
            pair_count[key] += words[w].count;
            auto& list = where[key];
            if (list.empty() || list.back() != w) list.push_back(w);
        }
    }
    struct Entry {
        int64_t count;
        uint64_t key;
        bool operator<(const Entry& o) const {
            return count != o.count ? count < o.count : key > o.key;
        }
    };
    std::priority_queue<Entry> heap;
    for (const auto& [key, count] : pair_count) heap.push({count, key});

    std::vector<std::optional<std::string>> vocab;
    std::unordered_map<std::string, uint32_t> ids;
    for (int b = 0; b < 256; ++b) {
        vocab.emplace_back(std::string(1, static_cast<char>(b)));
        ids.emplace(*vocab.back(), b);
    }
    std::vector<std::pair<std::string, std::string>> merges;
    const size_t target = static_cast<size_t>(vocab_size) - 1;  // the last id is <|endoftext|>
    std::vector<uint64_t> touched;
    while (vocab.size() < target) {
        if (heap.empty()) {
            fail(
                "tokenizer train: the documents only allow {} merges, but vocab size {} needs "
                "{}; give more text or a smaller vocab size",
                merges.size(), vocab_size, target - 256);
        }
        const Entry top = heap.top();
        heap.pop();
        auto pc = pair_count.find(top.key);
        if (pc == pair_count.end() || pc->second != top.count) continue;  // stale entry
        const uint32_t a = static_cast<uint32_t>(top.key >> 32);
        const uint32_t b = static_cast<uint32_t>(top.key);
        std::string merged = *vocab[a] + *vocab[b];
        uint32_t c;
        // Two merges can spell the same bytes; like Hugging Face's trainer, reuse the id.
        if (auto it = ids.find(merged); it != ids.end()) {
            c = it->second;
        } else {
            c = static_cast<uint32_t>(vocab.size());
            ids.emplace(merged, c);
            vocab.emplace_back(merged);
        }
        merges.emplace_back(*vocab[a], *vocab[b]);
        pair_count.erase(pc);
        std::vector<uint32_t> list = std::move(where[top.key]);
        where.erase(top.key);
        std::sort(list.begin(), list.end());
        list.erase(std::unique(list.begin(), list.end()), list.end());
        touched.clear();
        for (uint32_t w : list) {
            auto& s = words[w].syms;
            const int64_t count = words[w].count;
            bool has = false;
            for (size_t k = 0; k + 1 < s.size() && !has; ++k) has = s[k] == a && s[k + 1] == b;
            if (!has) continue;
            auto adjust = [&](uint64_t key, int64_t delta) {
                if (key == top.key) return;  // already removed
                auto it = pair_count.find(key);
                if (it == pair_count.end()) it = pair_count.emplace(key, 0).first;
                it->second += delta;
                if (it->second <= 0) pair_count.erase(it);
                touched.push_back(key);
            };
            for (size_t k = 0; k + 1 < s.size(); ++k) adjust(key_of(s[k], s[k + 1]), -count);
            std::vector<uint32_t> next;
            next.reserve(s.size());
            for (size_t k = 0; k < s.size(); ++k) {
                if (k + 1 < s.size() && s[k] == a && s[k + 1] == b) {
                    next.push_back(c);
                    ++k;
                } else {
                    next.push_back(s[k]);
                }
            }
            s = std::move(next);
            for (size_t k = 0; k + 1 < s.size(); ++k) {
                const uint64_t key = key_of(s[k], s[k + 1]);
                adjust(key, count);
                if (s[k] == c || s[k + 1] == c) {
                    auto& wl = where[key];
                    if (wl.empty() || wl.back() != w) wl.push_back(w);
                }
            }
        }
        std::sort(touched.begin(), touched.end());
        touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
        for (uint64_t key : touched) {
            auto it = pair_count.find(key);
            if (it != pair_count.end()) heap.push({it->second, key});
        }
    }
    const uint32_t eot_id = static_cast<uint32_t>(vocab.size());
    vocab.emplace_back(kEot);
    Tokenizer t;
    t.build("tokenizer train", std::move(vocab), merges, {{kEot, eot_id}});
    return t;
}

}  // namespace memtrain::data
