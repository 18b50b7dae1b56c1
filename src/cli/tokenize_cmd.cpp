// `memtrain tokenize` turns text files into train/val token shards; `memtrain tokenizer train`
// learns a byte-level BPE vocabulary and `memtrain tokenizer encode` prints ids for debugging.
// Parsing and printing only: the work is in data/tokenizer and data/shard.
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "core/rng.h"
#include "data/shard.h"
#include "data/tokenizer.h"

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
        std::ifstream in(file, std::ios::binary);
        if (!in) fail("cannot read input '{}'", file.string());
        std::ostringstream ss;
        ss << in.rdbuf();
        const std::string text = ss.str();
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

    std::vector<std::vector<uint32_t>> encoded(docs.size());
#pragma omp parallel for schedule(dynamic, 16)
    for (long i = 0; i < static_cast<long>(docs.size()); ++i) encoded[i] = tok.encode(docs[i]);

    // The end-of-text token precedes every document (as GPT-2 and llm.c do), so it separates
    // documents and a sample can start from it.
    std::vector<uint32_t> train, val;
    size_t train_docs = 0, val_docs = 0, text_tokens = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
        const bool to_val = is_validation(o.seed, i, o.val_fraction);
        auto& dst = to_val ? val : train;
        (to_val ? val_docs : train_docs)++;
        if (tok.eot_token()) dst.push_back(*tok.eot_token());
        dst.insert(dst.end(), encoded[i].begin(), encoded[i].end());
        text_tokens += encoded[i].size();
    }
    if (train_docs == 0)
        fail("the train split is empty: all {} documents went to val", docs.size());
    if (o.val_fraction > 0 && val_docs == 0) {
        fail(
            "the val split is empty: none of {} documents was drawn with --val-fraction {}; raise "
            "it, add documents, or pass --val-fraction 0 to write no val.bin",
            docs.size(), o.val_fraction);
    }
    std::error_code ec;
    fs::create_directories(o.out, ec);
    if (ec) fail("cannot create output directory '{}': {}", o.out, ec.message());
    const auto vocab = static_cast<uint32_t>(tok.vocab_size());
    data::write_shard((fs::path(o.out) / "train.bin").string(), train, vocab);
    const std::string val_path = (fs::path(o.out) / "val.bin").string();
    if (o.val_fraction > 0) {
        data::write_shard(val_path, val, vocab);
    } else {
        fs::remove(val_path, ec);  // a val.bin from an earlier run would no longer match
    }

    size_t doc_bytes = 0;
    for (const auto& d : docs) doc_bytes += d.size();
    fmt::print("tokenize: {} text files ({} binary skipped), {} documents ({} train, {} val)\n",
               corpus.files, corpus.skipped.size(), docs.size(), train_docs, val_docs);
    fmt::print("tokenize: {}/train.bin {} tokens, {}, vocab {}\n", o.out, train.size(),
               o.val_fraction > 0 ? fmt::format("{}/val.bin {} tokens", o.out, val.size())
                                  : std::string("no val.bin (--val-fraction 0)"),
               vocab);
    fmt::print(
        "tokenize: {:.2f} bytes/token, {:.2f} s\n",
        static_cast<double>(doc_bytes) / static_cast<double>(std::max<size_t>(text_tokens, 1)),
        seconds_since(start));
}

struct TrainOptions {
    int vocab_size = 0;
    std::string out, separator;
    std::vector<std::string> inputs;
};

void run_tokenizer_train(const TrainOptions& o) {
    const auto start = std::chrono::steady_clock::now();
    const Corpus corpus = read_corpus(o.inputs, o.separator);
    const data::Tokenizer tok = data::Tokenizer::train(corpus.documents, o.vocab_size);
    tok.save(o.out);
    fmt::print(
        "tokenizer train: vocab {} ({} merges) from {} documents, {} bytes in {} files; "
        "{:.2f} s -> {}\n",
        tok.vocab_size(), tok.num_merges(), corpus.documents.size(), corpus.bytes, corpus.files,
        seconds_since(start), o.out);
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
                     "fraction of documents drawn for val.bin (0: no val.bin)")
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

    auto tr = std::make_shared<TrainOptions>();
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

    auto enc = std::make_shared<std::pair<std::string, std::string>>();
    CLI::App* encode = tokenizer->add_subcommand("encode", "Print the token ids of TEXT");
    encode->add_option("--tokenizer", enc->first, "tokenizer.json, encoder.json or directory")
        ->required();
    encode->add_option("text", enc->second, "text to encode")->required();
    encode->callback([enc] {
        const data::Tokenizer tok = data::Tokenizer::load(enc->first);
        // Joined by hand: fmt::join trips a GCC 12 -Wstringop-overflow false positive at -O3.
        std::string line;
        for (uint32_t id : tok.encode(enc->second)) {
            if (!line.empty()) line += ' ';
            line += std::to_string(id);
        }
        fmt::print("{}\n", line);
    });
}

}  // namespace memtrain::cli
