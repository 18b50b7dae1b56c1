// Llama 3 tokenizer.json support: the hand-written Llama 3 pre-tokenizer against Python's `regex`
// module, a Llama-3-layout file (specials at high ids, ignore_merges, BOS template) against a
// Python BPE reference, save/load round trips, and errors for pre-tokenizers memtrain lacks.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer.h"
#include "io/hf_weights.h"
#include "llama3_layout.h"
#include "python_ref.h"
#include "test_util.h"

namespace memtrain::data {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::kLlama3Pattern;
using testing::llama3_layout;
using testing::Llama3Layout;
using testing::scratch_dir;
using testing::write_file;
using Ids = std::vector<uint32_t>;

// The text files of Debian's fortunes package, when installed (symlinks and .dat indexes left
// out); `max_bytes` cuts each at a line end.
std::vector<std::string> fortune_texts(size_t max_bytes = std::string::npos) {
    const fs::path dir = "/usr/share/games/fortunes";
    std::vector<fs::path> files;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
        if (e.is_symlink() || !e.is_regular_file() || e.path().extension() == ".dat") continue;
        files.push_back(e.path());
    }
    std::sort(files.begin(), files.end());
    std::vector<std::string> texts;
    for (const auto& f : files) {
        std::ifstream in(f, std::ios::binary);
        std::string t((std::istreambuf_iterator<char>(in)), {});
        if (t.size() > max_bytes) t.resize(t.rfind('\n', max_bytes) + 1);
        texts.push_back(std::move(t));
    }
    return texts;
}

// Strings aimed at each alternative of the Llama 3 pattern.
const std::vector<std::string> kCrafted = {
    "I'M here, we'Ll see; THEY'RE 'S 'x 'LL 'Ve 'd it's I've you'D",
    "1234567 12 1 0001 3.14159 1,000,000 x2024y",
    "café naïve é 中文 ٣٤٥ ½ ² Ω жук Ελληνικά",
    "hello!!!\r\n\r\nworld...\n\n\n  end",
    "   leading spaces and  two  spaces   before words",
    "\ttabs\t\tand\t \tmixed\t",
    "trailing whitespace   ",
    "trailing newline spaces \n  ",
    "lines\n\nwith\r\n\r\n  indented\n    code();\n",
    "(parens) [brackets] {braces} \"quotes\" 'single' --dashes-- ... ?!\n",
    "emoji 😀🎉 after, and—dash “quotes”",
    "\u00a0nbsp\u2003em space\u3000ideographic \u00a0\u00a0x",
    "combining e\u0301 a\u0308 \u0301x",
    "<|begin_of_text|>special<|eot_id|> tokens <|end_of_text|><|reserved_special_token_7|>",
    "",
    " ",
    "\n",
    "a",
    "'",
    "''s",
    "x\u0085y\v\fz \x1c\x1f",
    "$100 #tag @user a+b=c 50% ~/path/to_file.txt",
};

// Invalid UTF-8: each bad byte is one "other" character, which is how Python's surrogateescape
// decoding (a lone surrogate per byte, category Cs) sees it.
const std::vector<std::string> kInvalid = {
    "invalid \xff\xfe bytes \xc3( and \xed\xa0\x80 surrogate and \xf4\x90\x80\x80 too big",
    "\xe6\x97 truncated \xe6\x97",
    "word\xffword \xff\xffword\n\xc0\xaf overlong",
};

// Random strings over snippets from every class; deterministic (raw mt19937 output).
std::vector<std::string> random_texts(int count, bool with_invalid) {
    std::vector<std::string> alphabet = {
        "a",   "b",   "Z", "q", "é",  "ß",   "Ω",  "ж",    "中",     "文",     "٣",      "7",
        "0",   "½",   "²", " ", "  ", "\t",  "\n", "\r\n", "\r",     "'",      "'s",     "'T",
        "'ll", "'RE", "!", "?", ".",  ",",   "—",  "😀",    "\u00a0", "\u3000", "\u0301", "\v",
        "-",   "_",   "(", ")", "x'", "I'M", "99", "word", " the"};
    if (with_invalid) alphabet.insert(alphabet.end(), {"\xff", "\xc3", "\xed\xa0\x80"});
    std::mt19937 rng(20240425);
    std::vector<std::string> out;
    for (int i = 0; i < count; ++i) {
        std::string s;
        const uint32_t len = rng() % 40;
        for (uint32_t k = 0; k < len; ++k) s += alphabet[rng() % alphabet.size()];
        out.push_back(std::move(s));
    }
    return out;
}

std::string hex(std::string_view bytes) {
    static const char* digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

// Writes texts as dir/00000.txt, ...: raw bytes, so invalid UTF-8 reaches Python unchanged.
void write_texts(const fs::path& dir, const std::vector<std::string>& texts) {
    fs::create_directories(dir);
    for (size_t i = 0; i < texts.size(); ++i) {
        char name[32];
        std::snprintf(name, sizeof(name), "%05zu.txt", i);
        write_file(dir / name, texts[i]);
    }
}

// One output line per text: "NAME item item ...", in text order.
std::vector<std::vector<std::string>> parse_lines(const std::string& out, size_t expected) {
    std::vector<std::vector<std::string>> lines;
    std::istringstream in(out);
    std::string line;
    while (std::getline(in, line)) {
        std::istringstream words(line);
        std::vector<std::string> items;
        std::string w;
        words >> w;  // the file name
        while (words >> w) items.push_back(w);
        lines.push_back(std::move(items));
    }
    EXPECT_EQ(lines.size(), expected) << out.substr(0, 2000);
    return lines;
}

const char* kSplitScript = R"py(
import os, sys
try:
    import regex
except ImportError:
    sys.exit(3)
PATTERNS = {
    'llama3': r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    'gpt2': r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
}
P = regex.compile(PATTERNS[sys.argv[2]])
d = sys.argv[1]
for name in sorted(os.listdir(d)):
    text = open(os.path.join(d, name), 'rb').read().decode('utf-8', 'surrogateescape')
    pieces = P.findall(text)
    print(name, ' '.join(p.encode('utf-8', 'surrogateescape').hex() for p in pieces))
)py";

// Strings of code points drawn from all of Unicode (every plane, unassigned ones included, no
// surrogates), so that the class table is checked well beyond the scripts picked above.
std::vector<std::string> random_code_point_texts(int count) {
    std::mt19937 rng(7);
    std::vector<std::string> out;
    for (int i = 0; i < count; ++i) {
        std::string s;
        const uint32_t len = 1 + rng() % 24;
        for (uint32_t k = 0; k < len; ++k) {
            const uint32_t limits[] = {0x80, 0x800, 0x10000, 0x110000};
            uint32_t cp = rng() % limits[rng() % 4];
            if (cp >= 0xD800 && cp <= 0xDFFF) cp = ' ';
            if (rng() % 4 == 0) cp = " 'a1\n"[rng() % 5];  // keep the ASCII alternatives in play
            if (cp < 0x80) {
                s += static_cast<char>(cp);
            } else if (cp < 0x800) {
                s += static_cast<char>(0xC0 | (cp >> 6));
                s += static_cast<char>(0x80 | (cp & 0x3F));
            } else if (cp < 0x10000) {
                s += static_cast<char>(0xE0 | (cp >> 12));
                s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                s += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
                s += static_cast<char>(0xF0 | (cp >> 18));
                s += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
                s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
                s += static_cast<char>(0x80 | (cp & 0x3F));
            }
        }
        out.push_back(std::move(s));
    }
    return out;
}

// The hand-written split of `kind` gives exactly the pieces of the regex in Python's `regex`
// module, on fortunes, the crafted strings, invalid UTF-8 and random strings.
void expect_split_matches_python(PreTokenizer kind) {
    std::vector<std::string> texts = fortune_texts();
    const size_t fortunes = texts.size();
    texts.insert(texts.end(), kCrafted.begin(), kCrafted.end());
    texts.insert(texts.end(), kInvalid.begin(), kInvalid.end());
    for (auto& t : random_texts(400, true)) texts.push_back(std::move(t));
    for (auto& t : random_code_point_texts(1000)) texts.push_back(std::move(t));
    const auto dir = scratch_dir();
    write_texts(dir / "in", texts);
    const std::string out = testing::run_python(
        dir, kSplitScript, (dir / "in").string() + " " + pre_tokenizer_name(kind));
    ASSERT_FALSE(out.empty());
    const auto expected = parse_lines(out, texts.size());
    ASSERT_EQ(expected.size(), texts.size());
    size_t pieces = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
        const auto got = Tokenizer::pre_tokenize(texts[i], kind);
        std::vector<std::string> got_hex;
        std::string joined;
        for (auto p : got) {
            got_hex.push_back(hex(p));
            joined += p;
        }
        ASSERT_EQ(joined, texts[i]) << "pieces must cover text " << i;
        pieces += got.size();
        if (got_hex == expected[i]) continue;
        size_t k = 0;
        while (k < got_hex.size() && k < expected[i].size() && got_hex[k] == expected[i][k]) ++k;
        ADD_FAILURE() << "text " << i << (i < fortunes ? " (a fortunes file)" : "") << ": piece "
                      << k << " is " << (k < got_hex.size() ? got_hex[k] : "<end>")
                      << ", Python's is " << (k < expected[i].size() ? expected[i][k] : "<end>")
                      << " (hex of the UTF-8 bytes)";
    }
    EXPECT_GT(pieces, texts.size());
    fs::remove_all(dir);
}

TEST(TokenizerGpt2Split, MatchesPythonRegex) {
    expect_split_matches_python(PreTokenizer::kGpt2);
}

TEST(TokenizerLlama3Split, MatchesPythonRegex) {
    expect_split_matches_python(PreTokenizer::kLlama3);
    // Spot checks a reader can follow without running Python.
    using V = std::vector<std::string_view>;
    auto split = [](std::string_view s) {
        return Tokenizer::pre_tokenize(s, PreTokenizer::kLlama3);
    };
    EXPECT_EQ(split("I'M we'Ll"), (V{"I", "'M", " we", "'Ll"}));
    EXPECT_EQ(split("1234567"), (V{"123", "456", "7"}));
    EXPECT_EQ(split("x  hi\t\ty \n\n  z"), (V{"x", " ", " hi", "\t", "\ty", " \n\n", " ", " z"}));
    EXPECT_EQ(split("ok!!\r\n"), (V{"ok", "!!\r\n"}));
    EXPECT_EQ(split("(hello end  "), (V{"(hello", " end", "  "}));
}

// Training text: a slice of every fortunes file, or generated sentences without the package.
std::vector<std::string> training_texts() {
    std::vector<std::string> docs = fortune_texts(4000);
    if (docs.empty()) {
        for (int i = 0; i < 200; ++i) {
            docs.push_back("The quick brown fox jumps over the lazy dog " + std::to_string(i) +
                           " times. It's the fox's " + std::to_string(i * 7) + "th jump.\n");
        }
    }
    return docs;
}

class TokenizerLlama3 : public ::testing::Test {
  protected:
    static void SetUpTestSuite() {
        trained_ = new Tokenizer(Tokenizer::train(training_texts(), 700));
    }
    static void TearDownTestSuite() {
        delete trained_;
        trained_ = nullptr;
    }
    void SetUp() override { dir_ = scratch_dir(); }
    void TearDown() override { fs::remove_all(dir_); }
    // Writes the Llama 3 layout and loads it.
    Tokenizer load_layout(bool ignore_merges, Llama3Layout* layout = nullptr,
                          const std::string& name = "llama3.json") {
        Llama3Layout l = llama3_layout(*trained_, dir_, ignore_merges);
        write_file(dir_ / name, l.file.dump(1));
        if (layout) *layout = l;
        return Tokenizer::load((dir_ / name).string());
    }
    static Tokenizer* trained_;
    fs::path dir_;
};
Tokenizer* TokenizerLlama3::trained_ = nullptr;

// A Llama checkpoint's config.json names the ids `generate` starts and stops with, as Meta's does:
// bos <|begin_of_text|>, eos <|end_of_text|>.
TEST_F(TokenizerLlama3, ConfigJsonCarriesItsBosAndEosIds) {
    Llama3Layout l;
    (void)load_layout(true, &l);
    ModelConfig m;
    m.norm = "rmsnorm";
    m.activation = "swiglu";
    m.positions = "rope";
    m.bias = false;
    const json config = json::parse(hf_config_json(m, (dir_ / "llama3.json").string()));
    EXPECT_EQ(config["model_type"], "llama");
    EXPECT_EQ(config["bos_token_id"], l.first_special) << config.dump();
    EXPECT_EQ(config["eos_token_id"], l.first_special + 1) << config.dump();
    EXPECT_FALSE(json::parse(hf_config_json(m, "")).contains("bos_token_id"));
}

TEST_F(TokenizerLlama3, LoadsEncodesAndRoundTrips) {
    Llama3Layout l;
    const Tokenizer tok = load_layout(true, &l);
    const uint32_t bos = l.first_special;
    EXPECT_EQ(tok.pre_tokenizer(), PreTokenizer::kLlama3);
    EXPECT_TRUE(tok.ignore_merges());
    EXPECT_EQ(tok.vocab_size(), static_cast<int>(bos + 256));
    EXPECT_EQ(tok.num_added_tokens(), 256u);
    EXPECT_EQ(tok.bos_token(), bos);
    EXPECT_EQ(tok.eot_token(), bos + 1);  // <|end_of_text|>, not <|eot_id|>
    EXPECT_EQ(tok.token_id("<|eot_id|>"), bos + 9);
    EXPECT_EQ(tok.token_id("<|reserved_special_token_250|>"), bos + 255);

    std::vector<std::string> texts = kCrafted;
    texts.insert(texts.end(), kInvalid.begin(), kInvalid.end());
    for (const auto& t : texts) {
        const Ids ids = tok.encode(t);
        EXPECT_EQ(tok.decode(ids), t);
        Ids with_bos{bos};
        with_bos.insert(with_bos.end(), ids.begin(), ids.end());
        EXPECT_EQ(tok.encode(t, true), with_bos);
        EXPECT_EQ(tok.encode(t, false), ids);
    }
    EXPECT_EQ(tok.encode("<|begin_of_text|>hi<|eot_id|>").front(), bos);
    EXPECT_EQ(tok.encode("<|begin_of_text|>hi<|eot_id|>").back(), bos + 9);

    // ignore_merges: the whole word is one id, although no merge sequence reaches it; the same
    // file without ignore_merges segments it by the merges.
    EXPECT_EQ(tok.encode(" zqxjk"), (Ids{l.whole_word}));
    const Ids in_text = tok.encode("say zqxjk twice: zqxjk!");
    EXPECT_EQ(std::count(in_text.begin(), in_text.end(), l.whole_word), 2);
    const Tokenizer merges_only = load_layout(false, nullptr, "merges_only.json");
    EXPECT_FALSE(merges_only.ignore_merges());
    EXPECT_GT(merges_only.encode(" zqxjk").size(), 1u);
    EXPECT_EQ(merges_only.decode(merges_only.encode(" zqxjk")), " zqxjk");
    EXPECT_NE(merges_only.fingerprint(), tok.fingerprint());
    EXPECT_NE(trained_->fingerprint(), tok.fingerprint());

    // save/load keeps the pre-tokenizer, ignore_merges and the template: the same tokenizer.
    const std::string saved = (dir_ / "saved.json").string();
    tok.save(saved);
    const Tokenizer back = Tokenizer::load(saved);
    EXPECT_EQ(back.fingerprint(), tok.fingerprint());
    EXPECT_EQ(back.pre_tokenizer(), PreTokenizer::kLlama3);
    EXPECT_TRUE(back.ignore_merges());
    EXPECT_EQ(back.bos_token(), bos);
    EXPECT_EQ(back.eot_token(), bos + 1);
    for (const auto& t : texts) EXPECT_EQ(back.encode(t, true), tok.encode(t, true)) << t;
    for (const auto& t : training_texts()) ASSERT_EQ(back.encode(t), tok.encode(t));
    std::ifstream a(saved);
    const json j = json::parse(a);
    EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"], kLlama3Pattern);
    EXPECT_EQ(j["model"]["ignore_merges"], true);
    // And saving again gives the same bytes.
    const std::string again = (dir_ / "again.json").string();
    back.save(again);
    std::ifstream sa(saved), sb(again);
    EXPECT_EQ(std::string((std::istreambuf_iterator<char>(sa)), {}),
              std::string((std::istreambuf_iterator<char>(sb)), {}));
}

// A plain Python implementation of what Hugging Face's tokenizers do with such a file: added
// tokens matched first (longest at the leftmost position), the Split regex, GPT-2's byte to
// unicode map, ignore_merges, then the lowest-ranked leftmost merge until none applies; the
// template's specials around the text.
const char* kBpeScript = R"py(
import json, os, sys
try:
    import regex
except ImportError:
    sys.exit(3)
tok = json.load(open(sys.argv[1], encoding='utf-8'))
model = tok['model']
vocab = model['vocab']
ignore = model.get('ignore_merges', False)
ranks = {}
for r, m in enumerate(model['merges']):
    a, b = m.split(' ') if isinstance(m, str) else m
    ranks.setdefault((a, b), r)
pattern = regex.compile(tok['pre_tokenizer']['pretokenizers'][0]['pattern']['Regex'])
bs = list(range(ord('!'), ord('~') + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
cs = bs[:]
n = 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
b2u = {b: chr(c) for b, c in zip(bs, cs)}
added = sorted(tok['added_tokens'], key=lambda t: -len(t['content']))
added_id = {t['content']: t['id'] for t in added}
special = regex.compile('|'.join(regex.escape(t['content']) for t in added))
prefix, suffix = [], []
pp = tok['post_processor']
for p in (pp['processors'] if pp['type'] == 'Sequence' else [pp]):
    if p['type'] != 'TemplateProcessing':
        continue
    seen = False
    for item in p['single']:
        if 'Sequence' in item:
            seen = True
        else:
            (suffix if seen else prefix).extend(p['special_tokens'][item['SpecialToken']['id']]['ids'])

def bpe(word):
    if ignore and word in vocab:
        return [vocab[word]]
    syms = list(word)
    while len(syms) > 1:
        best = None
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best[0]):
                best = (r, i)
        if best is None:
            break
        i = best[1]
        syms[i:i + 2] = [syms[i] + syms[i + 1]]
    return [vocab[s] for s in syms]

def ordinary(text):
    ids = []
    for piece in pattern.findall(text):
        ids += bpe(''.join(b2u[b] for b in piece.encode('utf-8')))
    return ids

def encode(text):
    ids, pos = list(prefix), 0
    for m in special.finditer(text):
        ids += ordinary(text[pos:m.start()])
        ids.append(added_id[m.group()])
        pos = m.end()
    return ids + ordinary(text[pos:]) + suffix

d = sys.argv[2]
for name in sorted(os.listdir(d)):
    text = open(os.path.join(d, name), 'rb').read().decode('utf-8')
    print(name, ' '.join(map(str, encode(text))))
)py";

TEST_F(TokenizerLlama3, MatchesPythonBpeReference) {
    for (bool ignore_merges : {true, false}) {
        SCOPED_TRACE(ignore_merges ? "ignore_merges" : "merges only");
        const std::string name = ignore_merges ? "im.json" : "mo.json";
        const Tokenizer tok = load_layout(ignore_merges, nullptr, name);
        std::vector<std::string> texts = fortune_texts(1500);
        texts.insert(texts.end(), kCrafted.begin(), kCrafted.end());
        for (auto& t : random_texts(200, false)) texts.push_back(std::move(t));
        texts.push_back("words from the vocab: the and of zqxjk zqxjk. zqxjk's <|eot_id|>");
        const auto in_dir = dir_ / (name + ".in");
        write_texts(in_dir, texts);
        const std::string out =
            testing::run_python(dir_, kBpeScript, (dir_ / name).string() + " " + in_dir.string());
        ASSERT_FALSE(out.empty());
        const auto expected = parse_lines(out, texts.size());
        ASSERT_EQ(expected.size(), texts.size());
        for (size_t i = 0; i < texts.size(); ++i) {
            std::vector<std::string> got;
            for (uint32_t id : tok.encode(texts[i], true)) got.push_back(std::to_string(id));
            if (got == expected[i]) continue;
            size_t k = 0;
            while (k < got.size() && k < expected[i].size() && got[k] == expected[i][k]) ++k;
            ADD_FAILURE() << "text " << i << ": id " << k << " is "
                          << (k < got.size() ? got[k] : "<end>") << ", Python's is "
                          << (k < expected[i].size() ? expected[i][k] : "<end>");
        }
    }
}

void expect_load_error(const fs::path& path, const std::vector<std::string>& needles) {
    try {
        Tokenizer::load(path.string());
        ADD_FAILURE() << "expected an error loading " << path;
    } catch (const Error& e) {
        const std::string m = e.what();
        EXPECT_NE(m.find(path.string()), std::string::npos) << m;
        for (const auto& n : needles) EXPECT_NE(m.find(n), std::string::npos) << m;
    }
}

TEST_F(TokenizerLlama3, UnsupportedPreTokenizersAreNamed) {
    const json base = llama3_layout(*trained_, dir_, true).file;
    const auto path = dir_ / "bad.json";

    json j = base;  // one character off Llama 3's pattern
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
        std::string(kLlama3Pattern).replace(std::string(kLlama3Pattern).find("{1,3}"), 5, "{1,4}");
    write_file(path, j.dump());
    expect_load_error(path, {"pattern", "{1,4}", "not supported"});

    j = base;
    j["pre_tokenizer"] = {{"type", "Whitespace"}};
    write_file(path, j.dump());
    expect_load_error(path, {"pre_tokenizer", "Whitespace", "not supported"});

    j = base;
    j["pre_tokenizer"] = nullptr;
    write_file(path, j.dump());
    expect_load_error(path, {"no pre_tokenizer"});

    j = base;  // the Llama 3 regex needs ByteLevel without its own regex after it
    j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true;
    write_file(path, j.dump());
    expect_load_error(path, {"pre_tokenizer", "not supported"});

    j = base;
    j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"use_regex", true}};
    write_file(path, j.dump());
    expect_load_error(path, {"add_prefix_space"});

    j = base;
    j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed";
    write_file(path, j.dump());
    expect_load_error(path, {"Isolated"});

    // GPT-2's pattern as a Split is GPT-2's pre-tokenizer.
    j = base;
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
        R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
    write_file(path, j.dump());
    EXPECT_EQ(Tokenizer::load(path.string()).pre_tokenizer(), PreTokenizer::kGpt2);

    // A post-processor memtrain does not interpret: plain encode works, encode with specials
    // refuses rather than guess.
    j = base;
    j["post_processor"] = {
        {"type", "RobertaProcessing"}, {"sep", {"</s>", 2}}, {"cls", {"<s>", 0}}};
    write_file(path, j.dump());
    const Tokenizer roberta = Tokenizer::load(path.string());
    EXPECT_EQ(roberta.bos_token(), std::nullopt);
    EXPECT_FALSE(roberta.encode("hi there").empty());
    EXPECT_THROW(roberta.encode("hi there", true), Error);

    // A template naming a token that does not exist.
    j = base;
    j["post_processor"]["processors"][1]["special_tokens"] = json::object();
    j["post_processor"]["processors"][1]["single"][0]["SpecialToken"]["id"] = "<|nope|>";
    write_file(path, j.dump());
    expect_load_error(path, {"<|nope|>"});
}

}  // namespace
}  // namespace memtrain::data
