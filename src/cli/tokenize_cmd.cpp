// `memtrain tokenize` turns text files into train/val token shards; `memtrain tokenizer train`
// learns a byte-level BPE vocabulary; `tokenizer encode`, `decode` and `info` are for looking at
// one. Parsing and printing only: the work is in data/tokenizer and data/shard.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/regular_file.h"
#include "core/rng.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "io/text_file.h"

namespace memtrain::cli {

namespace {

namespace fs = std::filesystem;

struct Corpus {
    std::vector<std::string> documents;
    size_t files = 0;
    size_t bytes = 0;
    std::vector<std::string> skipped;  // binary files left out
};

// A directory stands for its regular files (not symlinks, which in e.g. the fortunes package
// only duplicate other files, and not hidden files), in sorted order so runs are reproducible.
std::vector<fs::path> expand_inputs(const std::vector<std::string>& inputs) {
    std::vector<fs::path> files;
    for (const std::string& input : inputs) {
        std::error_code ec;
        if (fs::is_directory(input, ec)) {
            std::vector<fs::path> found;
            for (const auto& entry : fs::directory_iterator(input, ec)) {
                const std::string name = entry.path().filename().string();
                if (entry.is_symlink() || !entry.is_regular_file() || name.starts_with(".")) {
                    continue;
                }
                found.push_back(entry.path());
            }
            if (ec) fail("cannot list input directory '{}': {}", input, ec.message());
            std::sort(found.begin(), found.end());
            files.insert(files.end(), found.begin(), found.end());
        } else if (fs::is_regular_file(input, ec)) {
            files.emplace_back(input);
        } else {
            fail("input '{}' not found; expected a text file or a directory of text files", input);
        }
    }
    return files;
}

// Documents are whole files, or the runs of lines between lines equal to `separator` (as "%" in
// fortune files). Blank documents are dropped.
Corpus read_corpus(const std::vector<std::string>& inputs, const std::string& separator) {
    Corpus corpus;
    for (const fs::path& file : expand_inputs(inputs)) {
        // (expand_inputs keeps regular files; this refuses one that became a FIFO since.)
        const std::string text = read_regular_file(file.string(), SIZE_MAX, "input");
        if (text.find('\0') != std::string::npos) {
            corpus.skipped.push_back(file.string());  // e.g. fortune's .dat index files
            continue;
        }
        ++corpus.files;
        corpus.bytes += text.size();
        auto add = [&](std::string doc) {
            if (doc.find_first_not_of(" \t\r\n\f\v") != std::string::npos) {
                corpus.documents.push_back(std::move(doc));
            }
        };
        if (separator.empty()) {
            add(text);
            continue;
        }
        std::string doc;
        size_t pos = 0;
        while (pos < text.size()) {
            size_t end = text.find('\n', pos);
            const size_t next = end == std::string::npos ? text.size() : end + 1;
            std::string_view line(text.data() + pos,
                                  (end == std::string::npos ? text.size() : end) - pos);
            if (line.ends_with('\r')) line.remove_suffix(1);
            if (line == separator) {
                add(std::move(doc));
                doc.clear();
            } else {
                doc.append(text, pos, next - pos);
            }
            pos = next;
        }
        add(std::move(doc));
    }
    if (corpus.documents.empty()) {
        fail("the inputs hold no text documents ({} text files read, {} binary files skipped)",
             corpus.files, corpus.skipped.size());
    }
    return corpus;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Whether document `index` goes to validation: a hash of (seed, index), so the split does not
// depend on thread count or on the other documents.
bool is_validation(uint64_t seed, uint64_t index, double fraction) {
    uint64_t s = seed;
    uint64_t x = splitmix64(s) ^ (index * 0x9E3779B97F4A7C15ull);
    const double u = static_cast<double>(splitmix64(x) >> 11) * (1.0 / 9007199254740992.0);
    return u < fraction;
}

// Removes .train.bin.PID.new and .val.bin.PID.new of tokenize runs that died (their process is
// gone), so a kill leaves no lasting debris; a live run's are left alone.
void remove_dead_temporaries(const fs::path& out) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(out, ec)) {
        const std::string name = e.path().filename().string();
        for (const char* prefix : {".train.bin.", ".val.bin."}) {
            if (name.rfind(prefix, 0) != 0 || !name.ends_with(".new")) continue;
            const std::string pid =
                name.substr(std::strlen(prefix), name.size() - std::strlen(prefix) - 4);
            if (pid.empty() || pid.size() > 9 ||
                pid.find_first_not_of("0123456789") != std::string::npos)
                continue;
            if (::kill((pid_t)std::stol(pid), 0) != 0 && errno == ESRCH) fs::remove(e.path(), ec);
        }
    }
}

struct TokenizeOptions {
    std::string tokenizer, out, separator;
    double val_fraction = 0.05;
    uint64_t seed = 1337;
    std::vector<std::string> inputs;
};

void run_tokenize(const TokenizeOptions& o) {
    const auto start = std::chrono::steady_clock::now();
    if (!(o.val_fraction >= 0.0 && o.val_fraction < 1.0)) {
        fail("--val-fraction is {}; expected a value in [0, 1)", o.val_fraction);
    }
    const data::Tokenizer tok = data::Tokenizer::load(o.tokenizer);
    const Corpus corpus = read_corpus(o.inputs, o.separator);
    const auto& docs = corpus.documents;
    fmt::print("tokenize: encoding {} documents ({} bytes in {} files)...\n", docs.size(),
               corpus.bytes, corpus.files);
    std::fflush(stdout);

    std::vector<std::vector<uint32_t>> encoded(docs.size());
#pragma omp parallel for schedule(dynamic, 16)
    for (long i = 0; i < static_cast<long>(docs.size()); ++i) encoded[i] = tok.encode(docs[i]);

    // Without a BOS (GPT-2) the end-of-text token precedes every document, as GPT-2 and llm.c
    // do, so it separates documents and a sample can start from it. With one (Llama 3) a document
    // is what Hugging Face's tokenizer(text) gives, BOS first, then end-of-text, as torchtitan
    // frames documents.
    const auto bos = tok.bos_token(), eot = tok.eot_token();
    std::vector<uint32_t> train, val;
    size_t train_docs = 0, val_docs = 0, text_tokens = 0;
    // One document (nanoGPT's input.txt): no document can be drawn for val, so its tokens are
    // split instead, the last --val-fraction of them to val.bin, as nanoGPT's prepare.py does.
    const bool split_tokens = docs.size() == 1 && o.val_fraction > 0;
    for (size_t i = 0; i < docs.size(); ++i) {
        const bool to_val = !split_tokens && is_validation(o.seed, i, o.val_fraction);
        auto& dst = to_val ? val : train;
        (to_val ? val_docs : train_docs)++;
        if (bos) {
            dst.push_back(*bos);
        } else if (eot) {
            dst.push_back(*eot);
        }
        dst.insert(dst.end(), encoded[i].begin(), encoded[i].end());
        if (bos && eot) dst.push_back(*eot);
        text_tokens += encoded[i].size();
    }
    if (split_tokens) {
        const size_t n = train.size();
        const size_t n_val = std::min<size_t>(
            n - 1, std::max<size_t>(1, (size_t)std::llround((double)n * o.val_fraction)));
        if (n < 2)
            fail("the corpus is {} token{}: too few to split into train and val", n,
                 n == 1 ? "" : "s");
        val.assign(train.end() - (std::ptrdiff_t)n_val, train.end());
        train.resize(n - n_val);
    }
    if (train_docs == 0)
        fail("the train split is empty: all {} documents went to val", docs.size());
    if (o.val_fraction > 0 && val_docs == 0 && !split_tokens) {
        fail(
            "the val split is empty: none of {} documents was drawn with --val-fraction {}; raise "
            "it, add documents, or pass --val-fraction 0 to write no val.bin",
            docs.size(), o.val_fraction);
    }
    std::error_code ec;
    fs::create_directories(o.out, ec);
    if (ec) fail("cannot create output directory '{}': {}", o.out, ec.message());
    const auto vocab = static_cast<uint32_t>(tok.vocab_size());
    const uint64_t fingerprint = tok.fingerprint();
    // train.bin and val.bin are replaced as a pair: both are written under names of this
    // process's own, then a marker goes down, both are renamed into place, and the marker goes.
    // A kill between the two renames leaves the marker, and the shard reader refuses a shard
    // beside it (the pair may be mixed) until tokenize runs again.
    const fs::path out(o.out);
    const std::string stamp = std::to_string(::getpid());
    remove_dead_temporaries(out);
    const fs::path train_new = out / (".train.bin." + stamp + ".new"),
                   val_new = out / (".val.bin." + stamp + ".new");
    const bool with_val = o.val_fraction > 0;
    try {
        data::write_shard(train_new.string(), train, vocab, fingerprint);
        if (with_val) data::write_shard(val_new.string(), val, vocab, fingerprint);
    } catch (...) {
        fs::remove(train_new, ec);
        fs::remove(val_new, ec);
        throw;
    }
    const fs::path marker = out / data::kTokenizeIncomplete;
    io::write_text_file(marker, fmt::format("memtrain tokenize (pid {}) is replacing train.bin "
                                            "and val.bin here\n",
                                            stamp));
    io::sync_directory(out);
    auto move_in = [&](const fs::path& from, const char* name) {
        fs::rename(from, out / name, ec);
        if (ec)
            fail("cannot rename {} to {}: {}", from.string(), (out / name).string(), ec.message());
    };
    move_in(train_new, "train.bin");
    test_pause("tokenize-pair");
    if (with_val)
        move_in(val_new, "val.bin");
    else
        fs::remove(out / "val.bin", ec);  // a val.bin from an earlier run would no longer match
    io::sync_directory(out);
    fs::remove(marker, ec);
    io::sync_directory(out);

    size_t doc_bytes = 0;
    for (const auto& d : docs) doc_bytes += d.size();
    if (split_tokens)
        fmt::print(
            "tokenize: {} text file{} ({} binary skipped), 1 document: split by tokens, the last "
            "{:g}% to val.bin\n",
            corpus.files, corpus.files == 1 ? "" : "s", corpus.skipped.size(),
            100.0 * (double)val.size() / (double)(train.size() + val.size()));
    else
        fmt::print("tokenize: {} text files ({} binary skipped), {} documents ({} train, {} val)\n",
                   corpus.files, corpus.skipped.size(), docs.size(), train_docs, val_docs);
    fmt::print("tokenize: {}/train.bin {} tokens, {}, vocab {}, tokenizer fingerprint {:016x}\n",
               o.out, train.size(),
               o.val_fraction > 0 ? fmt::format("{}/val.bin {} tokens", o.out, val.size())
                                  : std::string("no val.bin (--val-fraction 0)"),
               vocab, fingerprint);
    fmt::print(
        "tokenize: {:.2f} bytes/token, {:.2f} s\n",
        static_cast<double>(doc_bytes) / static_cast<double>(std::max<size_t>(text_tokens, 1)),
        seconds_since(start));
}

struct TokenizerTrainOptions {
    int vocab_size = 0;
    std::string out, separator;
    std::vector<std::string> inputs;
};

void run_tokenizer_train(const TokenizerTrainOptions& o) {
    const auto start = std::chrono::steady_clock::now();
    const Corpus corpus = read_corpus(o.inputs, o.separator);
    // A first line at once: learning the merges of a few MB takes tens of seconds.
    fmt::print("tokenizer train: learning {} ids from {} documents ({} bytes in {} files)...\n",
               o.vocab_size, corpus.documents.size(), corpus.bytes, corpus.files);
    std::fflush(stdout);
    const data::Tokenizer tok = data::Tokenizer::train(corpus.documents, o.vocab_size);
    tok.save(o.out);
    fmt::print(
        "tokenizer train: vocab {} ({} merges) from {} documents, {} bytes in {} files; "
        "{:.2f} s -> {}\n",
        tok.vocab_size(), tok.num_merges(), corpus.documents.size(), corpus.bytes, corpus.files,
        seconds_since(start), o.out);
}

// Ids from the command line, or whitespace-separated on stdin when there are none.
std::vector<uint32_t> parse_ids(const std::vector<std::string>& args, int vocab_size) {
    std::vector<std::string> words = args;
    if (words.empty()) {
        std::string text, word;
        char buf[1 << 16];
        while (size_t n = std::fread(buf, 1, sizeof(buf), stdin)) text.append(buf, n);
        std::istringstream in(text);
        while (in >> word) words.push_back(word);
    }
    std::vector<uint32_t> ids;
    ids.reserve(words.size());
    for (const std::string& w : words) {
        uint32_t id = 0;
        const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), id);
        if (ec != std::errc() || end != w.data() + w.size()) {
            fail(
                "tokenizer decode: '{}' is not a token id; expected a non-negative integer below "
                "the vocab size {}",
                w, vocab_size);
        }
        if (id >= static_cast<uint32_t>(vocab_size)) {
            fail("tokenizer decode: token id {} is out of range; the vocab size is {}", id,
                 vocab_size);
        }
        ids.push_back(id);
    }
    return ids;
}

std::string shown_id(const data::Tokenizer& tok, std::optional<uint32_t> id) {
    if (!id) return "none";
    const std::vector<uint32_t> one{*id};
    return fmt::format("{} \"{}\"", *id, tok.decode(one));
}

void print_info(const std::string& path) {
    const data::Tokenizer tok = data::Tokenizer::load(path);
    fmt::print("tokenizer     {}\n", path);
    fmt::print("vocab size    {}\n", tok.vocab_size());
    fmt::print("merges        {}\n", tok.num_merges());
    fmt::print("pre-tokenizer {}{}\n", data::pre_tokenizer_name(tok.pre_tokenizer()),
               tok.ignore_merges() ? " (ignore_merges)" : "");
    fmt::print("end of text   {}\n", shown_id(tok, tok.eot_token()));
    fmt::print("BOS           {}\n", shown_id(tok, tok.bos_token()));
    fmt::print("added tokens  {}\n", tok.num_added_tokens());
    fmt::print("fingerprint   {:016x}\n", tok.fingerprint());
}

}  // namespace

void register_tokenize(CLI::App& app) {
    auto topt = std::make_shared<TokenizeOptions>();
    CLI::App* tokenize = app.add_subcommand(
        "tokenize", "Encode text files into DIR/train.bin and DIR/val.bin token shards");
    tokenize
        ->add_option("--tokenizer", topt->tokenizer,
                     "tokenizer.json, encoder.json, or a directory holding them")
        ->required();
    tokenize->add_option("--out", topt->out, "output directory")->required();
    tokenize
        ->add_option("--val-fraction", topt->val_fraction,
                     "fraction of documents drawn for val.bin (0: no val.bin); a corpus of one "
                     "document gives val.bin its last fraction of tokens instead")
        ->capture_default_str();
    tokenize->add_option("--doc-separator", topt->separator,
                         "a line equal to this ends a document (e.g. % for fortune files); "
                         "default: one document per file");
    tokenize->add_option("--seed", topt->seed, "seed of the train/val split")
        ->capture_default_str();
    tokenize->add_option("files", topt->inputs, "text files or directories")->required();
    tokenize->callback([topt] { run_tokenize(*topt); });

    CLI::App* tokenizer = app.add_subcommand("tokenizer", "Train or inspect a BPE tokenizer");
    tokenizer->require_subcommand(1);

    auto tr = std::make_shared<TokenizerTrainOptions>();
    CLI::App* train =
        tokenizer->add_subcommand("train", "Train a byte-level BPE tokenizer on text files");
    train
        ->add_option("--vocab-size", tr->vocab_size,
                     "ids in the vocab: 256 bytes + merges + <|endoftext|>")
        ->required();
    train->add_option("--out", tr->out, "tokenizer.json to write")->required();
    train->add_option("--doc-separator", tr->separator, "a line equal to this ends a document");
    train->add_option("files", tr->inputs, "text files or directories")->required();
    train->callback([tr] { run_tokenizer_train(*tr); });

    struct EncodeOptions {
        std::string tokenizer, text;
        bool add_special = false;
    };
    auto enc = std::make_shared<EncodeOptions>();
    CLI::App* encode = tokenizer->add_subcommand("encode", "Print the token ids of TEXT");
    encode->add_option("--tokenizer", enc->tokenizer, "tokenizer.json, encoder.json or directory")
        ->required();
    encode->add_flag("--add-special-tokens", enc->add_special,
                     "add the post-processor's special tokens (Llama 3: <|begin_of_text|>), as "
                     "Hugging Face's tokenizer(text) does");
    encode->add_option("text", enc->text, "text to encode")->required();
    encode->callback([enc] {
        const data::Tokenizer tok = data::Tokenizer::load(enc->tokenizer);
        // Joined by hand: fmt::join trips a GCC 12 -Wstringop-overflow false positive at -O3.
        std::string line;
        for (uint32_t id : tok.encode(enc->text, enc->add_special)) {
            if (!line.empty()) line += ' ';
            line += std::to_string(id);
        }
        fmt::print("{}\n", line);
    });

    auto dec = std::make_shared<std::pair<std::string, std::vector<std::string>>>();
    CLI::App* decode = tokenizer->add_subcommand(
        "decode", "Print the text of token IDS (arguments, or whitespace-separated on stdin)");
    decode->add_option("--tokenizer", dec->first, "tokenizer.json, encoder.json or directory")
        ->required();
    decode->add_option("ids", dec->second, "token ids; read from stdin when none are given");
    decode->callback([dec] {
        const data::Tokenizer tok = data::Tokenizer::load(dec->first);
        const std::string text = tok.decode(parse_ids(dec->second, tok.vocab_size()));
        std::fwrite(text.data(), 1, text.size(), stdout);  // raw bytes: ids may split a character
        std::fputc('\n', stdout);
    });

    auto info_path = std::make_shared<std::string>();
    CLI::App* info = tokenizer->add_subcommand(
        "info", "Print a tokenizer's vocab size, merges, pre-tokenizer, special ids, fingerprint");
    info->add_option("--tokenizer", *info_path, "tokenizer.json, encoder.json or directory")
        ->required();
    info->callback([info_path] { print_info(*info_path); });
}

}  // namespace memtrain::cli
