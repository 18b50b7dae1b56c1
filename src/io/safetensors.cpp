// Safetensors reader and writer. The reader trusts nothing in the file: every count, offset and
// shape is range-checked (with overflow checks) before any byte of tensor data is touched, so a
// corrupt or hostile file gives a memtrain::Error, never a crash.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "core/regular_file.h"

namespace memtrain::io {

namespace {

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t max_header_bytes = 100'000'000;

std::string sys_error(const std::string& what, const std::string& path) {
    return fmt::format("{} {}: {}", what, path, std::strerror(errno));
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    float mag;
    if (exp == 0) {
        mag = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    } else if (exp == 31) {
        mag =
            mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
    } else {
        mag = std::ldexp(static_cast<float>(mant | 0x400), static_cast<int>(exp) - 25);
    }
    return sign ? -mag : mag;
}

// Writes all of [p, p+n) to fd, retrying short writes and EINTR.
bool write_all(int fd, const void* p, std::size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
        std::size_t chunk = std::min<std::size_t>(n, std::size_t{1} << 30);
        ssize_t w = ::write(fd, c, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            return false;
        }
        c += w;
        n -= static_cast<std::size_t>(w);
    }
    return true;
}

uint64_t checked_numel(std::span<const int64_t> shape, const std::string& what) {
    uint64_t n = 1;
    for (int64_t d : shape) {
        if (d < 0) fail("{} has shape {} with a negative dimension", what, shape_string(shape));
        if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n))
            fail("{} has shape {} whose element count overflows 64 bits", what,
                 shape_string(shape));
    }
    return n;
}

}  // namespace

std::string shape_string(std::span<const int64_t> shape) {
    return fmt::format("[{}]", fmt::join(shape, ", "));
}

// ---------------------------------------------------------------------------------------------
// Writer

void SafetensorsWriter::add(std::string name, DType dtype, std::vector<int64_t> shape,
                            const void* data) {
    if (name.empty()) fail("safetensors writer: a tensor needs a non-empty name");
    if (name == "__metadata__") fail("safetensors writer: '__metadata__' is reserved");
    for (const auto& e : entries_)
        if (e.name == name) fail("safetensors writer: tensor '{}' was added twice", name);
    uint64_t numel = checked_numel(shape, fmt::format("safetensors writer: tensor '{}'", name));
    uint64_t bytes;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(dtype)), &bytes))
        fail("safetensors writer: tensor '{}' of shape {} is too large", name, shape_string(shape));
    if (bytes > 0 && data == nullptr)
        fail("safetensors writer: tensor '{}' has {} bytes but no data", name, bytes);
    entries_.push_back({std::move(name), dtype, std::move(shape), data, bytes});
}

void SafetensorsWriter::declare(std::string name, DType dtype, std::vector<int64_t> shape) {
    static const char dummy = 0;  // passes add()'s check; replaced by the null below
    add(std::move(name), dtype, std::move(shape), &dummy);
    entries_.back().data = nullptr;
}

void SafetensorsWriter::set_metadata(std::string key, std::string value) {
    metadata_[std::move(key)] = std::move(value);
}

void SafetensorsWriter::write(const std::string& path,
                              const std::function<const void*(std::size_t)>& source) const {
    for (const auto& e : entries_)
        if (e.bytes > 0 && e.data == nullptr && !source)
            fail("safetensors writer: tensor '{}' was declared but write() got no source", e.name);
    // Header: "__metadata__" first, then tensors in insertion order, packed back to back.
    nlohmann::ordered_json header = nlohmann::ordered_json::object();
    if (!metadata_.empty()) {
        nlohmann::ordered_json meta = nlohmann::ordered_json::object();
        for (const auto& [k, v] : metadata_) meta[k] = v;
        header["__metadata__"] = std::move(meta);
    }
    uint64_t offset = 0;
    for (const auto& e : entries_) {
        nlohmann::ordered_json t = nlohmann::ordered_json::object();
        t["dtype"] = std::string(dtype_name(e.dtype));
        t["shape"] = e.shape;
        t["data_offsets"] = {offset, offset + e.bytes};
        header[e.name] = std::move(t);
        offset += e.bytes;
    }
    std::string text;
    try {
        text = header.dump();
    } catch (const nlohmann::json::exception& ex) {
        fail("cannot write {}: a tensor name or metadata entry is not valid UTF-8 ({})", path,
             ex.what());
    }
    // Padding the header to 8 bytes keeps every tensor 8-byte aligned in the file.
    text.append((8 - text.size() % 8) % 8, ' ');
    unsigned char len[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; i++) len[i] = static_cast<unsigned char>(n >> (8 * i));

    const std::string tmp = path + ".tmp";
    int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("{}", sys_error("cannot create", tmp));
    auto abandon = [&](const std::string& msg) {
        int saved = errno;
        ::close(fd);
        ::unlink(tmp.c_str());
        errno = saved;
        fail("{}", sys_error(msg, tmp));
    };
    if (!write_all(fd, len, 8) || !write_all(fd, text.data(), text.size())) abandon("cannot write");
    for (std::size_t i = 0; i < entries_.size(); i++) {
        const Entry& e = entries_[i];
        if (e.bytes == 0) continue;
        const void* data = e.data;
        if (!data) {
            try {
                data = source(i);
            } catch (...) {
                ::close(fd);
                ::unlink(tmp.c_str());
                throw;
            }
        }
        if (!write_all(fd, data, e.bytes)) abandon("cannot write");
    }
    if (::fsync(fd) != 0) abandon("cannot fsync");
    if (::close(fd) != 0) {
        ::unlink(tmp.c_str());
        fail("{}", sys_error("cannot close", tmp));
    }
    if (::rename(tmp.c_str(), path.c_str()) != 0) {
        int saved = errno;
        ::unlink(tmp.c_str());
        errno = saved;
        fail("{}", sys_error(fmt::format("cannot rename {} onto", tmp), path));
    }
    // Make the rename itself durable; failure here is not worth an error (the data is safe).
    std::string dir = std::filesystem::path(path).parent_path().string();
    int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        ::fsync(dfd);
        ::close(dfd);
    }
}

// ---------------------------------------------------------------------------------------------
// Reader

struct SafetensorsFile::Mapping {
    void* addr = nullptr;
    std::size_t size = 0;
    Mapping(void* a, std::size_t s) : addr(a), size(s) {}
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping() {
        if (addr) ::munmap(addr, size);
    }
};

// The header read as a stream of JSON events into TensorInfo records, never as a DOM: a
// 100 MB header of tiny tensors costs about its own size instead of 20 times it, and values
// under keys the format does not know are skipped without being built.
class SafetensorsFile::HeaderReader : public nlohmann::json_sax<nlohmann::json> {
  public:
    HeaderReader(SafetensorsFile& f, const std::string& path) : f_(f), path_(path) {}
    bool done() const { return done_; }

    bool null() override { return scalar("null"); }
    bool boolean(bool) override { return scalar("boolean"); }
    bool number_integer(number_integer_t v) override {
        if (in_ == In::Shape) {
            if (v < 0) fail("{} has a shape with a negative dimension {}", what(), v);
            info_.shape.push_back(v);
            return true;
        }
        if (in_ == In::Offsets) return offset(v < 0 ? -1 : v);
        return scalar("number");
    }
    bool number_unsigned(number_unsigned_t v) override {
        if (in_ == In::Shape) {
            if (v > static_cast<uint64_t>(INT64_MAX))
                fail("{} has a shape, expected non-negative integers of 63 bits", what());
            info_.shape.push_back(static_cast<int64_t>(v));
            return true;
        }
        if (in_ == In::Offsets) return offset((int64_t)std::min<uint64_t>(v, INT64_MAX), v);
        return scalar("number");
    }
    bool number_float(number_float_t, const string_t&) override {
        if (in_ == In::Shape)
            fail("{} has a shape, expected non-negative integers (got a fraction)", what());
        if (in_ == In::Offsets) return offset(-1);
        return scalar("number");
    }
    bool string(string_t& v) override {
        if (in_ == In::Skip) return true;
        if (in_ == In::Meta) {
            f_.metadata_[key_] = std::move(v);
            return true;
        }
        if (in_ == In::Tensor && key_ == "dtype") {
            auto parsed = parse_dtype(v);
            if (!parsed)
                fail(
                    "{} has unknown dtype '{}' (expected one of F64 F32 F16 BF16 I64 I32 I16 I8 "
                    "U64 U32 U16 U8 BOOL)",
                    what(), printable(v.substr(0, 32)) + (v.size() > 32 ? "..." : ""));
            info_.dtype = *parsed;
            has_dtype_ = true;
            return true;
        }
        return scalar("string");
    }
    bool binary(binary_t&) override { return scalar("binary"); }

    bool start_object(std::size_t) override {
        switch (in_) {
            case In::Start:
                in_ = In::Root;
                return true;
            case In::Root:
                if (key_ == "__metadata__") {
                    in_ = In::Meta;
                } else {
                    in_ = In::Tensor;
                    info_ = TensorInfo{};
                    info_.name = key_;
                    has_dtype_ = has_shape_ = false;
                    offsets_ = 0;
                }
                return true;
            case In::Tensor:
                if (key_ == "dtype" || key_ == "shape" || key_ == "data_offsets")
                    return container("object");
                return skip();
            case In::Skip:
                skip_depth_++;
                return true;
            default:
                return container("object");
        }
    }
    bool start_array(std::size_t) override {
        if (in_ == In::Tensor && key_ == "shape") {
            in_ = In::Shape;
            has_shape_ = true;
            info_.shape.clear();
            return true;
        }
        if (in_ == In::Tensor && key_ == "data_offsets") {
            in_ = In::Offsets;
            offsets_ = 0;
            return true;
        }
        if (in_ == In::Tensor) return skip();
        if (in_ == In::Skip) {
            skip_depth_++;
            return true;
        }
        return container("array");
    }
    bool end_array() override {
        if (in_ == In::Skip) return unskip();
        if (in_ == In::Offsets && offsets_ != 2) bad_offsets();
        in_ = In::Tensor;  // (Shape or Offsets: the only arrays not skipped or refused)
        return true;
    }
    bool end_object() override {
        switch (in_) {
            case In::Skip:
                return unskip();
            case In::Meta:
                in_ = In::Root;
                return true;
            case In::Tensor:
                finish_tensor();
                in_ = In::Root;
                return true;
            case In::Root:
                in_ = In::End;
                done_ = true;
                return true;
            default:
                return true;
        }
    }
    bool key(string_t& k) override {
        if (in_ == In::Skip) return true;
        if (in_ == In::Root && k.empty()) fail("{} has a tensor with an empty name", path_);
        key_ = std::move(k);
        return true;
    }
    bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
        return false;  // (sax_parse returns false; open() says the header is invalid)
    }

  private:
    enum class In { Start, Root, Meta, Tensor, Shape, Offsets, Skip, End };

    std::string what() const { return fmt::format("tensor '{}' in {}", info_.name, path_); }
    static std::string printable(const std::string& s) {
        std::string out;
        for (unsigned char c : s) out += c >= 0x20 && c < 0x7f ? (char)c : '?';
        return out;
    }
    // A value that is not a container where one was expected, by the kind that came.
    bool scalar(const char* kind) {
        switch (in_) {
            case In::Skip:
                return true;
            case In::Start:
                fail("{} has a JSON header that is a {}, expected an object of tensors", path_,
                     kind);
            case In::Root:
                if (key_ == "__metadata__")
                    fail("{}: __metadata__ is a {}, expected an object of strings", path_, kind);
                info_.name = key_;
                fail(
                    "{} is described by a {}, expected an object with dtype, shape and "
                    "data_offsets",
                    what(), kind);
            case In::Meta:
                fail("{}: metadata value for '{}' is a {}, expected a string", path_, key_, kind);
            case In::Tensor:
                if (key_ == "dtype")
                    fail("{} has a dtype that is a {}, expected a string", what(), kind);
                if (key_ == "shape")
                    fail("{} has a shape that is a {}, expected an array", what(), kind);
                if (key_ == "data_offsets") bad_offsets();
                return true;  // another key's value: not ours to judge
            case In::Shape:
                fail("{} has a shape, expected non-negative integers (got a {})", what(), kind);
            case In::Offsets:
                bad_offsets();
            default:
                return true;
        }
    }
    bool container(const char* kind) { return scalar(kind); }
    bool skip() {
        in_ = In::Skip;
        skip_depth_ = 1;
        return true;
    }
    bool unskip() {
        if (--skip_depth_ == 0) in_ = In::Tensor;
        return true;
    }
    bool offset(int64_t v, uint64_t u = 0) {
        if (v < 0 || offsets_ >= 2) bad_offsets();
        (offsets_ == 0 ? info_.begin : info_.end) = u ? u : (uint64_t)v;
        offsets_++;
        return true;
    }
    [[noreturn]] void bad_offsets() const {
        fail("{} has data_offsets that are not [begin, end] as two non-negative integers", what());
    }
    void finish_tensor() {
        if (!has_dtype_) fail("{} has no dtype", what());
        if (!has_shape_) fail("{} has no shape", what());
        if (offsets_ == 0) fail("{} has no data_offsets", what());
        uint64_t numel = checked_numel(info_.shape, what());
        uint64_t nbytes;
        if (numel > static_cast<uint64_t>(INT64_MAX) ||
            __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(info_.dtype)), &nbytes))
            fail("{} has shape {} whose byte size overflows 64 bits", what(),
                 shape_string(info_.shape));
        info_.numel = static_cast<int64_t>(numel);
        if (info_.begin > info_.end)
            fail("{} has data_offsets [{}, {}] with begin after end", what(), info_.begin,
                 info_.end);
        if (info_.end > f_.data_size_)
            fail(
                "{} has data_offsets [{}, {}] but the data section is only {} bytes (file "
                "truncated?)",
                what(), info_.begin, info_.end, f_.data_size_);
        if (info_.end - info_.begin != nbytes)
            fail(
                "{} has dtype {} and shape {}, which is {} bytes, but its data_offsets [{}, {}] "
                "span {} bytes",
                what(), dtype_name(info_.dtype), shape_string(info_.shape), nbytes, info_.begin,
                info_.end, info_.end - info_.begin);
        f_.tensors_.push_back(std::move(info_));
    }

    SafetensorsFile& f_;
    const std::string& path_;
    In in_ = In::Start;
    std::string key_;
    TensorInfo info_;
    bool has_dtype_ = false, has_shape_ = false, done_ = false;
    int offsets_ = 0;
    std::size_t skip_depth_ = 0;
};

SafetensorsFile SafetensorsFile::open(const std::string& path) {
    SafetensorsFile f;
    f.path_ = path;

    // A FIFO (which would block the open) or a device is refused before it is opened.
    int fd = open_regular_file(path, "safetensors file");
    struct stat st;
    if (::fstat(fd, &st) != 0) {
        int saved = errno;
        ::close(fd);
        errno = saved;
        fail("{}", sys_error("cannot stat", path));
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        fail("{} is not a regular file", path);
    }
    const uint64_t file_size = static_cast<uint64_t>(st.st_size);
    if (file_size < 8) {
        ::close(fd);
        fail(
            "{} is not a safetensors file: it is {} bytes long, shorter than the 8-byte header "
            "length",
            path, file_size);
    }
    void* addr = ::mmap(nullptr, file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    ::close(fd);
    if (addr == MAP_FAILED) {
        errno = map_errno;
        fail("{}", sys_error("cannot mmap", path));
    }
    f.map_ = std::make_shared<const Mapping>(addr, file_size);
    const auto* bytes = static_cast<const unsigned char*>(addr);

    // (The length itself is not printed: in a file that is not a safetensors, it is the file's
    // first eight bytes.)
    uint64_t header_len = 0;
    for (int i = 0; i < 8; i++) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
    if (header_len > max_header_bytes)
        fail(
            "{} is not a safetensors file: its header length field is more than the {} bytes "
            "allowed",
            path, max_header_bytes);
    if (header_len > file_size - 8)
        fail(
            "{} is truncated or corrupt: its header length field says more than the {} bytes "
            "that follow it",
            path, file_size - 8);
    f.data_ = bytes + 8 + header_len;
    f.data_size_ = file_size - 8 - header_len;

    std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
    // Room for every tensor at once (an upper bound: each has one data_offsets key), so the
    // list is not copied while it grows; capacity never touched costs no memory.
    std::size_t entries = 0;
    for (auto at = text.find("\"data_offsets\""); at != std::string_view::npos;
         at = text.find("\"data_offsets\"", at + 1))
        entries++;
    f.tensors_.reserve(entries);
    HeaderReader reader(f, path);
    try {
        nlohmann::json::sax_parse(text, &reader);
    } catch (const nlohmann::json::exception&) {
        fail("{} has an invalid JSON header ({} bytes)", path, header_len);
    }
    if (!reader.done()) fail("{} has an invalid JSON header ({} bytes)", path, header_len);

    // The format requires the tensors to tile the data section: no overlaps, no holes. Sorted
    // in place (files are usually in order already); empty tensors at one offset by name.
    auto by_offset = [](const TensorInfo& a, const TensorInfo& b) {
        return a.begin != b.begin ? a.begin < b.begin
               : a.end != b.end   ? a.end < b.end
                                  : a.name < b.name;
    };
    if (!std::is_sorted(f.tensors_.begin(), f.tensors_.end(), by_offset))
        std::sort(f.tensors_.begin(), f.tensors_.end(), by_offset);
    uint64_t expect = 0;
    const TensorInfo* prev = nullptr;
    for (const auto& t : f.tensors_) {
        if (t.begin < expect)
            fail("{}: tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {}))", path,
                 t.name, t.begin, t.end, prev->name, prev->begin, prev->end);
        if (t.begin > expect)
            fail(
                "{}: there is a hole of {} bytes in the data section before tensor '{}' (bytes "
                "[{}, {}))",
                path, t.begin - expect, t.name, t.begin, t.end);
        expect = t.end;
        prev = &t;
    }
    if (expect != f.data_size_)
        fail(
            "{}: the data section is {} bytes but its tensors cover only {} (trailing bytes or "
            "a corrupt header)",
            path, f.data_size_, expect);
    f.index_.resize(f.tensors_.size());
    for (std::size_t i = 0; i < f.index_.size(); i++) f.index_[i] = i;
    std::sort(f.index_.begin(), f.index_.end(), [&](std::size_t a, std::size_t b) {
        return f.tensors_[a].name < f.tensors_[b].name;
    });
    for (std::size_t i = 1; i < f.index_.size(); i++)
        if (f.tensors_[f.index_[i - 1]].name == f.tensors_[f.index_[i]].name)
            fail("{}: tensor '{}' appears twice in the header", path, f.tensors_[f.index_[i]].name);
    return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
    auto it =
        std::lower_bound(index_.begin(), index_.end(), name,
                         [&](std::size_t i, std::string_view n) { return tensors_[i].name < n; });
    return it == index_.end() || tensors_[*it].name != name ? nullptr : &tensors_[*it];
}

const TensorInfo& SafetensorsFile::get(std::string_view name) const {
    const TensorInfo* t = find(name);
    if (!t)
        fail("{} has no tensor named '{}' ({} tensors in the file)", path_, name, tensors_.size());
    return *t;
}

std::vector<std::string> SafetensorsFile::names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back(t.name);
    return out;
}

void SafetensorsFile::release_pages(const TensorInfo& info, uint64_t offset, uint64_t n) const {
    const auto* p = static_cast<const unsigned char*>(data(info));
    if (offset > info.end - info.begin || n == 0) return;
    n = std::min<uint64_t>(n, info.end - info.begin - offset);
    // Whole pages around the range: the mapping is read-only, so dropping a page a neighbour
    // still reads costs only a fault that maps it again.
    const auto page = (uintptr_t)::sysconf(_SC_PAGESIZE);
    const uintptr_t begin = (uintptr_t)(p + offset) & ~(page - 1);
    const uintptr_t end = ((uintptr_t)(p + offset + n) + page - 1) & ~(page - 1);
    ::madvise((void*)begin, end - begin, MADV_DONTNEED);
}

const void* SafetensorsFile::data(const TensorInfo& info) const {
    // Guard against a TensorInfo from another file.
    if (info.begin > info.end || info.end > data_size_)
        fail("{}: tensor '{}' has bytes [{}, {}) outside this file's {}-byte data section", path_,
             info.name, info.begin, info.end, data_size_);
    return data_ + info.begin;
}

void SafetensorsFile::read_f32(const TensorInfo& info, std::span<float> out,
                               std::string_view expect_name,
                               std::span<const int64_t> expect_shape) const {
    std::string label = info.name == expect_name
                            ? fmt::format("tensor {}", info.name)
                            : fmt::format("tensor {} (read as {})", info.name, expect_name);
    if (!std::equal(info.shape.begin(), info.shape.end(), expect_shape.begin(), expect_shape.end()))
        fail("{} in {} has shape {}, expected {}", label, path_, shape_string(info.shape),
             shape_string(expect_shape));
    if (static_cast<uint64_t>(info.numel) != out.size())
        fail("{} in {} has {} elements but the destination holds {}", label, path_, info.numel,
             out.size());
    const auto* src = static_cast<const unsigned char*>(data(info));
    const std::size_t n = out.size();
    switch (info.dtype) {
        case DType::F32:
            if (n) std::memcpy(out.data(), src, n * 4);
            break;
        case DType::BF16:
            for (std::size_t i = 0; i < n; i++) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                out[i] = bf16_to_f32(h);
            }
            break;
        case DType::F16:
            for (std::size_t i = 0; i < n; i++) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                out[i] = f16_to_f32(h);
            }
            break;
        default:
            fail("{} in {} has dtype {}, expected F32, BF16 or F16", label, path_,
                 dtype_name(info.dtype));
    }
}

}  // namespace memtrain::io
