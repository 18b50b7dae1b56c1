// Safetensors reader and writer: round trips, atomic writes, one hand-built malformed file per
// validation the reader makes (each must give a memtrain::Error whose message names the file and
// the fault), and a deterministic mutation fuzz: any corruption gives a valid file or an Error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "cli/cli_util.h"
#include "core/error.h"
#include "io/safetensors.h"

using namespace memtrain;
using io::DType;

namespace {

using test::read_file;
using test::write_file;

// Named after the running test too: CTest runs tests in parallel processes.
std::string test_dir(const std::string& name) {
    auto p = std::filesystem::path(MT_BINARY_DIR) / "test_tmp" / "safetensors" /
             ::testing::UnitTest::GetInstance()->current_test_info()->name() / name;
    std::filesystem::remove_all(p);
    std::filesystem::create_directories(p);
    return p.string();
}

std::string le64(uint64_t n) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; i++) s[i] = (char)(n >> (8 * i));
    return s;
}

// A raw file: length field, header text, data bytes.
std::string raw_file(const std::string& header, const std::string& data) {
    return le64(header.size()) + header + data;
}

// Expects opening `bytes` to throw memtrain::Error whose message holds every one of `words`.
void expect_open_error(const std::string& bytes, std::vector<std::string> words,
                       const std::string& file_name) {
    std::string path = test_dir("bad") + "/" + file_name;
    write_file(path, bytes);
    words.push_back(path);
    try {
        io::SafetensorsFile::open(path);
        ADD_FAILURE() << file_name << ": expected an Error, the file opened";
    } catch (const Error& e) {
        std::string msg = e.what();
        for (const auto& w : words)
            EXPECT_NE(msg.find(w), std::string::npos)
                << file_name << ": message lacks '" << w << "': " << msg;
    }
}

uint16_t to_bf16(float f) {
    uint32_t b;
    std::memcpy(&b, &f, 4);
    return (uint16_t)(b >> 16);  // exact for the values used below
}

struct Sample {
    std::vector<float> f32{1.5f, -2.0f, 0.25f, 3.0f, 1e-3f, -7.5f};
    std::vector<uint16_t> bf16;
    std::vector<uint16_t> f16{0x3c00, 0xc000, 0x3800,
                              0x0001, 0x7c00, 0x0000};  // 1 -2 .5 2^-24 inf 0
    std::vector<int32_t> i32{1, -2, 3, 2147483647};
    std::vector<int64_t> i64{-1, 1LL << 40, 7};
    std::vector<uint8_t> u8{1, 2, 3, 4, 5};
    std::vector<uint16_t> u16{65535, 0, 9};
    Sample() {
        for (float v : {1.0f, -3.5f, 0.125f, 2.0f}) bf16.push_back(to_bf16(v));
    }
    void add_to(io::SafetensorsWriter& w) const {
        w.add("h.0.attn.c_attn.weight", DType::F32, {2, 3}, f32.data());
        w.add("b", DType::BF16, {4}, bf16.data());
        w.add("half", DType::F16, {3, 2}, f16.data());
        w.add("ints", DType::I32, {2, 2}, i32.data());
        w.add("longs", DType::I64, {3}, i64.data());
        w.add("bytes", DType::U8, {5}, u8.data());
        w.add("shorts", DType::U16, {1, 3}, u16.data());
        w.add("empty", DType::F32, {0, 4}, nullptr);
        w.add("scalar", DType::F32, {}, f32.data());
    }
};

std::string write_sample(const std::string& dir) {
    Sample s;
    io::SafetensorsWriter w;
    s.add_to(w);
    w.set_metadata("format", "pt");
    w.set_metadata("step", "42");
    w.set_metadata("note", "spaces and \"quotes\" and unicode \xc3\xa9");
    std::string path = dir + "/sample.safetensors";
    w.write(path);
    return path;
}

}  // namespace

TEST(Safetensors, DTypeNamesAndSizes) {
    EXPECT_EQ(io::dtype_name(DType::F32), "F32");
    EXPECT_EQ(io::dtype_name(DType::BF16), "BF16");
    EXPECT_EQ(io::dtype_size(DType::F32), 4u);
    EXPECT_EQ(io::dtype_size(DType::F16), 2u);
    EXPECT_EQ(io::dtype_size(DType::BF16), 2u);
    EXPECT_EQ(io::dtype_size(DType::I64), 8u);
    EXPECT_EQ(io::dtype_size(DType::U8), 1u);
    for (auto d :
         {DType::F64, DType::F32, DType::F16, DType::BF16, DType::I64, DType::I32, DType::I16,
          DType::I8, DType::U64, DType::U32, DType::U16, DType::U8, DType::BOOL})
        EXPECT_EQ(io::parse_dtype(io::dtype_name(d)), d);
    EXPECT_FALSE(io::parse_dtype("F8").has_value());
}

TEST(Safetensors, RoundTripsTensorsAndMetadata) {
    std::string path = write_sample(test_dir("roundtrip"));
    Sample s;
    auto f = io::SafetensorsFile::open(path);
    EXPECT_EQ(f.path(), path);
    EXPECT_EQ(f.names(), (std::vector<std::string>{"h.0.attn.c_attn.weight", "b", "half", "ints",
                                                   "longs", "bytes", "shorts", "empty", "scalar"}));
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.metadata().at("step"), "42");
    EXPECT_EQ(f.metadata().at("note"), "spaces and \"quotes\" and unicode \xc3\xa9");

    const auto& w = f.get("h.0.attn.c_attn.weight");
    EXPECT_EQ(w.dtype, DType::F32);
    EXPECT_EQ(w.shape, (std::vector<int64_t>{2, 3}));
    EXPECT_EQ(w.numel, 6);
    EXPECT_EQ(w.end - w.begin, 24u);
    EXPECT_EQ(std::memcmp(f.data(w), s.f32.data(), 24), 0);
    EXPECT_EQ(std::memcmp(f.data(f.get("ints")), s.i32.data(), 16), 0);
    EXPECT_EQ(std::memcmp(f.data(f.get("longs")), s.i64.data(), 24), 0);
    EXPECT_EQ(std::memcmp(f.data(f.get("bytes")), s.u8.data(), 5), 0);
    EXPECT_EQ(std::memcmp(f.data(f.get("shorts")), s.u16.data(), 6), 0);
    EXPECT_EQ(f.get("empty").numel, 0);
    EXPECT_EQ(f.get("scalar").numel, 1);
    EXPECT_TRUE(f.get("scalar").shape.empty());
    EXPECT_EQ(f.find("nope"), nullptr);
    EXPECT_EQ(f.find("ints"), &f.get("ints"));

    // The header is padded to 8 bytes, so the data section starts 8-aligned.
    std::string raw = read_file(path);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)(unsigned char)raw[i] << (8 * i);
    EXPECT_EQ(hlen % 8, 0u);
    EXPECT_EQ(raw[8], '{');

    std::vector<float> out(6);
    std::vector<int64_t> shape{2, 3};
    f.read_f32(w, out, "h.0.attn.c_attn.weight", shape);
    EXPECT_EQ(out, s.f32);
    std::vector<float> b(4);
    std::vector<int64_t> bshape{4};
    f.read_f32(f.get("b"), b, "b", bshape);
    EXPECT_EQ(b, (std::vector<float>{1.0f, -3.5f, 0.125f, 2.0f}));
    std::vector<float> h(6);
    std::vector<int64_t> hshape{3, 2};
    f.read_f32(f.get("half"), h, "half", hshape);
    EXPECT_EQ(h[0], 1.0f);
    EXPECT_EQ(h[1], -2.0f);
    EXPECT_EQ(h[2], 0.5f);
    EXPECT_EQ(h[3], std::ldexp(1.0f, -24));
    EXPECT_TRUE(std::isinf(h[4]) && h[4] > 0);
    EXPECT_EQ(h[5], 0.0f);
    std::vector<float> none;
    std::vector<int64_t> eshape{0, 4};
    f.read_f32(f.get("empty"), none, "empty", eshape);

    // Copies share the mapping; the data stays valid after the original goes.
    auto copy = std::make_unique<io::SafetensorsFile>(f);
    f = io::SafetensorsFile::open(path);
    EXPECT_EQ(std::memcmp(copy->data(copy->get("ints")), s.i32.data(), 16), 0);
}

TEST(Safetensors, EmptyFileWithNoTensors) {
    std::string path = test_dir("empty") + "/e.safetensors";
    io::SafetensorsWriter w;
    w.write(path);
    auto f = io::SafetensorsFile::open(path);
    EXPECT_TRUE(f.names().empty());
    EXPECT_TRUE(f.metadata().empty());
}

TEST(Safetensors, WriteIsAtomicAndLeavesNoTemporary) {
    std::string dir = test_dir("atomic");
    std::string path = write_sample(dir);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    // Overwriting replaces the file whole.
    std::vector<float> v{9.0f};
    io::SafetensorsWriter w;
    w.add("only", DType::F32, {1}, v.data());
    w.write(path);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));
    auto f = io::SafetensorsFile::open(path);
    EXPECT_EQ(f.names(), std::vector<std::string>{"only"});
    for (const auto& e : std::filesystem::directory_iterator(dir))
        EXPECT_EQ(e.path().filename(), "sample.safetensors");

    // A directory that does not exist: an Error naming the path, and nothing left behind.
    std::string bad = dir + "/missing/x.safetensors";
    try {
        w.write(bad);
        ADD_FAILURE() << "writing into a missing directory succeeded";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
    EXPECT_FALSE(std::filesystem::exists(bad));
}

// The pages of a read tensor leave the resident set when released, and read the same again
// (the checkpoint's non-finite check reads back optimizer files this way).
TEST(Safetensors, ReleasedPagesLeaveTheResidentSetAndReadAgain) {
    auto resident = [] {
        std::ifstream statm("/proc/self/statm");
        uint64_t size = 0, pages = 0;
        statm >> size >> pages;
        return pages * (uint64_t)::sysconf(_SC_PAGESIZE);
    };
    const std::size_t n = std::size_t{16} << 20;  // 64 MiB of floats
    std::string path = test_dir("release") + "/big.safetensors";
    {
        std::vector<float> v(n);
        for (std::size_t i = 0; i < n; i++) v[i] = (float)(i % 1000);
        io::SafetensorsWriter w;
        w.add("big", DType::F32, {(int64_t)n}, v.data());
        w.write(path);
    }
    auto f = io::SafetensorsFile::open(path);
    const io::TensorInfo& t = f.get("big");
    const auto* p = static_cast<const float*>(f.data(t));
    double sum = 0;
    for (std::size_t i = 0; i < n; i += 1024) sum += p[i];  // one read a page: all resident
    const uint64_t touched = resident();
    f.release_pages(t, 0, t.end - t.begin);
    const uint64_t released = resident();
    EXPECT_GT(touched, released + (uint64_t{48} << 20))
        << "resident " << touched << " bytes before release, " << released << " after";
    double again = 0;
    for (std::size_t i = 0; i < n; i += 1024) again += p[i];
    EXPECT_EQ(sum, again);
    EXPECT_EQ(p[n - 1], (float)((n - 1) % 1000));
    // Ranges past the tensor are clipped, an empty one does nothing.
    f.release_pages(t, t.end - t.begin - 4, 1 << 20);
    f.release_pages(t, 0, 0);
    EXPECT_EQ(p[n - 1], (float)((n - 1) % 1000));
}

TEST(Safetensors, WriterRejectsBadTensors) {
    float x = 1;
    io::SafetensorsWriter w;
    w.add("a", DType::F32, {1}, &x);
    EXPECT_THROW(w.add("a", DType::F32, {1}, &x), Error);
    EXPECT_THROW(w.add("", DType::F32, {1}, &x), Error);
    EXPECT_THROW(w.add("__metadata__", DType::F32, {1}, &x), Error);
    EXPECT_THROW(w.add("neg", DType::F32, {-1}, &x), Error);
    EXPECT_THROW(w.add("null", DType::F32, {2}, nullptr), Error);
}

TEST(Safetensors, GetNamesTheMissingTensorAndTheFile) {
    std::string path = write_sample(test_dir("missing"));
    auto f = io::SafetensorsFile::open(path);
    try {
        f.get("h.7.mlp.c_fc.weight");
        ADD_FAILURE() << "get of a missing tensor succeeded";
    } catch (const Error& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("h.7.mlp.c_fc.weight"), std::string::npos) << msg;
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
    }
}

TEST(Safetensors, ReadF32ChecksShapeAndDType) {
    std::string path = write_sample(test_dir("readf32"));
    auto f = io::SafetensorsFile::open(path);
    std::vector<float> out(6);
    std::vector<int64_t> wrong{3, 2};
    try {
        f.read_f32(f.get("h.0.attn.c_attn.weight"), out, "h.0.attn.c_attn.weight", wrong);
        ADD_FAILURE() << "wrong shape accepted";
    } catch (const Error& e) {
        EXPECT_EQ(std::string(e.what()), "tensor h.0.attn.c_attn.weight in " + path +
                                             " has shape [2, 3], expected [3, 2]");
    }
    std::vector<int64_t> ishape{2, 2};
    std::vector<float> four(4);
    try {
        f.read_f32(f.get("ints"), four, "ints", ishape);
        ADD_FAILURE() << "I32 accepted as float";
    } catch (const Error& e) {
        std::string msg = e.what();
        EXPECT_NE(msg.find("I32"), std::string::npos) << msg;
        EXPECT_NE(msg.find("ints"), std::string::npos) << msg;
    }
    std::vector<int64_t> right{2, 3};
    std::vector<float> small(5);
    EXPECT_THROW(f.read_f32(f.get("h.0.attn.c_attn.weight"), small, "x", right), Error);
}

TEST(Safetensors, OpenRejectsMissingAndNonRegularFiles) {
    std::string dir = test_dir("nofile");
    expect_open_error("", {"shorter than"}, "empty.safetensors");
    expect_open_error("abcde", {"5 bytes"}, "five.safetensors");
    try {
        io::SafetensorsFile::open(dir + "/absent.safetensors");
        ADD_FAILURE();
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(dir + "/absent.safetensors"), std::string::npos);
    }
    EXPECT_THROW(io::SafetensorsFile::open(dir), Error);
}

TEST(Safetensors, OpenRejectsBadHeaderLength) {
    expect_open_error(le64(100'000'001) + std::string(64, ' '), {"header length", "100000000"},
                      "absurd.safetensors");
    expect_open_error(le64(~0ull), {"header length"}, "max.safetensors");
    expect_open_error(le64(50) + "{}", {"header length", "2 bytes"}, "long.safetensors");
}

// A file that is not a safetensors (a link to a password file, say) is refused without its
// bytes in the message: the "header length" is the file's first 8 bytes read as a number.
TEST(Safetensors, ErrorsDoNotEchoTheBytesOfAFileThatIsNotOne) {
    const std::string dir = test_dir("not_safetensors");
    const std::string path = dir + "/model.safetensors";
    for (const std::string& text : {std::string("root:$y$j9T$secretsecret:19000:0:99999:7:::\n"),
                                    le64(40) + "root:$y$j9T$secretsecretsecret"}) {
        std::ofstream(path, std::ios::binary) << text;
        std::uint64_t first8 = 0;
        for (int i = 0; i < 8; i++) first8 |= (std::uint64_t)(unsigned char)text[i] << (8 * i);
        try {
            io::SafetensorsFile::open(path);
            ADD_FAILURE() << "opened";
        } catch (const Error& e) {
            const std::string m = e.what();
            EXPECT_EQ(m.find(std::to_string(first8)), std::string::npos) << m;
            EXPECT_EQ(m.find("root"), std::string::npos) << m;
            EXPECT_EQ(m.find("secret"), std::string::npos) << m;
            EXPECT_EQ(m.find("last read"), std::string::npos) << m;
        }
    }
}

TEST(Safetensors, OpenRejectsBadJson) {
    expect_open_error(raw_file("{\"a\": ", ""), {"invalid JSON"}, "json.safetensors");
    expect_open_error(raw_file("", ""), {"invalid JSON"}, "zero.safetensors");
    expect_open_error(raw_file("[1, 2]", ""), {"array", "expected an object"}, "array.safetensors");
    expect_open_error(raw_file("{\"a\": 3}", ""), {"'a'", "number"}, "entry.safetensors");
    expect_open_error(raw_file("{\"a\": \"\\ud800\"}", ""), {"invalid JSON"}, "utf.safetensors");
}

TEST(Safetensors, OpenRejectsBadTensorEntries) {
    std::string d8(8, '\0');
    expect_open_error(raw_file(R"({"w":{"dtype":"F8","shape":[2],"data_offsets":[0,8]}})", d8),
                      {"'w'", "unknown dtype 'F8'"}, "dtype.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":3,"shape":[2],"data_offsets":[0,8]}})", d8),
                      {"'w'", "dtype"}, "dtypenum.safetensors");
    expect_open_error(raw_file(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", d8),
                      {"'w'", "no dtype"}, "nodtype.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", d8),
                      {"'w'", "no shape"}, "noshape.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[2]}})", d8),
                      {"'w'", "no data_offsets"}, "nooffsets.safetensors");
    expect_open_error(
        raw_file(R"({"w":{"dtype":"F32","shape":[-2, -1],"data_offsets":[0,8]}})", d8),
        {"'w'", "negative"}, "negative.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", d8),
                      {"'w'", "non-negative integers"}, "fraction.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8),
                      {"'w'", "expected an array"}, "shapestr.safetensors");
    expect_open_error(
        raw_file(
            R"({"w":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})",
            d8),
        {"'w'", "overflows"}, "overflow.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
                      {"'w'", "12 bytes", "span 8 bytes"}, "size.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", d8),
                      {"'w'", "only 8 bytes"}, "range.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", d8),
                      {"'w'", "begin after end"}, "reversed.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", d8),
                      {"'w'", "data_offsets"}, "negoffset.safetensors");
    expect_open_error(raw_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8),
                      {"'w'", "data_offsets"}, "oneoffset.safetensors");
}

TEST(Safetensors, OpenRejectsOverlapsHolesAndTrailingBytes) {
    std::string d12(12, '\0');
    expect_open_error(
        raw_file(
            R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            d12),
        {"overlaps", "'a'", "'b'"}, "overlap.safetensors");
    expect_open_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", d12),
                      {"hole", "'a'"}, "hole.safetensors");
    expect_open_error(raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", d12),
                      {"12 bytes", "cover only 8"}, "trailing.safetensors");
}

TEST(Safetensors, OpenRejectsBadMetadata) {
    expect_open_error(raw_file(R"({"__metadata__":{"step":3}})", ""),
                      {"'step'", "number", "expected a string"}, "metanum.safetensors");
    expect_open_error(raw_file(R"({"__metadata__":["a"]})", ""), {"__metadata__", "array"},
                      "metaarr.safetensors");
}

TEST(Safetensors, ReadsForeignLayoutWithPaddingAndNoMetadata) {
    // As the Python library writes it: keys sorted, header padded with spaces, no metadata.
    std::string data(8 + 2, '\0');
    float one = 1.0f, two = 2.0f;
    std::memcpy(data.data(), &one, 4);
    std::memcpy(data.data() + 4, &two, 4);
    std::string header =
        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"z":{"dtype":"U8","shape":[2],"data_offsets":[8,10]}})";
    header.append(8 - header.size() % 8, ' ');
    std::string path = test_dir("foreign") + "/f.safetensors";
    write_file(path, raw_file(header, data));
    auto f = io::SafetensorsFile::open(path);
    EXPECT_EQ(f.names(), (std::vector<std::string>{"a", "z"}));
    std::vector<float> out(2);
    std::vector<int64_t> shape{2};
    f.read_f32(f.get("a"), out, "a", shape);
    EXPECT_EQ(out, (std::vector<float>{1.0f, 2.0f}));
}

// Thousands of deterministic corruptions of a valid file: each must open cleanly or throw
// memtrain::Error, and whatever opens must have every tensor readable within the file.
TEST(Safetensors, MutationFuzzNeverCrashes) {
    std::string dir = test_dir("fuzz");
    const std::string base = read_file(write_sample(dir));
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++) hlen |= (uint64_t)(unsigned char)base[i] << (8 * i);
    const std::string header = base.substr(8, hlen), data = base.substr(8 + hlen);
    const std::string path = dir + "/m.safetensors";
    const std::string alphabet = "{}[]\",:0123456789-.eE aAFIUB_ \\";

    std::mt19937_64 rng(20240611);
    auto below = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
    int valid = 0, errors = 0;
    for (int iter = 0; iter < 6000; iter++) {
        std::string h = header, d = data, bytes;
        int kind = (int)below(9);
        int edits = 1 + (int)below(3);
        for (int e = 0; e < edits; e++) {
            switch (kind) {
                case 0:  // bit flip anywhere in header text or data
                case 1: {
                    std::string& s = (kind == 0 || d.empty()) ? h : d;
                    if (!s.empty()) s[below(s.size())] ^= (char)(1u << below(8));
                    break;
                }
                case 2: {  // a digit changed: offsets and shapes go wrong
                    std::vector<std::size_t> digits;
                    for (std::size_t i = 0; i < h.size(); i++)
                        if (h[i] >= '0' && h[i] <= '9') digits.push_back(i);
                    if (!digits.empty()) h[digits[below(digits.size())]] = (char)('0' + below(10));
                    break;
                }
                case 3:  // a structural character replaced
                    if (!h.empty()) h[below(h.size())] = alphabet[below(alphabet.size())];
                    break;
                case 4: {  // a random slice of the header deleted
                    std::size_t a = below(h.size() + 1), n = below(h.size() - a + 1);
                    h.erase(a, n);
                    break;
                }
                case 5:  // characters inserted
                    h.insert(below(h.size() + 1), 1, alphabet[below(alphabet.size())]);
                    break;
                case 6:  // data grows or shrinks
                    if (below(2))
                        d.append(1 + below(16), (char)below(256));
                    else
                        d.resize(below(d.size() + 1));
                    break;
                default:
                    break;
            }
        }
        bytes = le64(h.size()) + h + d;
        if (kind == 7) {  // length field corrupted
            uint64_t n =
                below(4) == 0 ? rng() : (uint64_t)((int64_t)h.size() + (int64_t)below(33) - 16);
            std::string l = le64(n);
            std::memcpy(bytes.data(), l.data(), 8);
        }
        if (kind == 8) {  // truncated anywhere, or a bit flipped anywhere in the raw file
            if (below(2))
                bytes.resize(below(bytes.size() + 1));
            else
                bytes[below(bytes.size())] ^= (char)(1u << below(8));
        }
        std::filesystem::remove(path);  // a fresh file: rewriting in place makes ext4 flush
        write_file(path, bytes);
        try {
            auto f = io::SafetensorsFile::open(path);
            valid++;
            for (const auto& t : f.tensors()) {
                const auto* p = static_cast<const unsigned char*>(f.data(t));
                unsigned sum = 0;
                for (uint64_t i = 0; i < t.end - t.begin; i++) sum += p[i];
                (void)sum;
                if (t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16) {
                    if (t.numel > (1 << 20)) continue;
                    std::vector<float> out((std::size_t)t.numel);
                    f.read_f32(t, out, t.name, t.shape);
                }
            }
        } catch (const Error&) {
            errors++;
        } catch (const std::exception& e) {
            ADD_FAILURE() << "iteration " << iter
                          << " threw a non-memtrain exception: " << e.what();
        }
    }
    EXPECT_GT(valid, 100);
    EXPECT_GT(errors, 1000);
}
