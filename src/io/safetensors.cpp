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

#include "core/error.h"

namespace memtrain::io {

namespace {

// The reference implementation refuses headers above 100 MB; so do we.
constexpr uint64_t max_header_bytes = 100'000'000;

std::string sys_error(const std::string& what, const std::string& path) {
    return fmt::format("{} {}: {}", what, path, std::strerror(errno));
}

float bf16_to_f32(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
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

SafetensorsFile SafetensorsFile::open(const std::string& path) {
    SafetensorsFile f;
    f.path_ = path;

    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("{}", sys_error("cannot open safetensors file", path));
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

    uint64_t header_len = 0;
    for (int i = 0; i < 8; i++) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
    if (header_len > max_header_bytes)
        fail(
            "{} is not a safetensors file: its header length is {} bytes, more than the {} "
            "allowed",
            path, header_len, max_header_bytes);
    if (header_len > file_size - 8)
        fail(
            "{} is truncated or corrupt: its header length is {} bytes but only {} bytes follow "
            "the length field",
            path, header_len, file_size - 8);
    f.data_ = bytes + 8 + header_len;
    f.data_size_ = file_size - 8 - header_len;

    std::string_view text(reinterpret_cast<const char*>(bytes + 8), header_len);
    nlohmann::json header;
    try {
        header = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& ex) {
        fail("{} has an invalid JSON header ({} bytes): {}", path, header_len, ex.what());
    }
    if (!header.is_object())
        fail("{} has a JSON header that is a {}, expected an object of tensors", path,
             header.type_name());

    for (const auto& [key, value] : header.items()) {
        if (key == "__metadata__") {
            if (!value.is_object())
                fail("{}: __metadata__ is a {}, expected an object of strings", path,
                     value.type_name());
            for (const auto& [mk, mv] : value.items()) {
                if (!mv.is_string())
                    fail("{}: metadata value for '{}' is a {}, expected a string", path, mk,
                         mv.type_name());
                f.metadata_[mk] = mv.get<std::string>();
            }
            continue;
        }
        const std::string what = fmt::format("tensor '{}' in {}", key, path);
        if (key.empty()) fail("{} has a tensor with an empty name", path);
        if (!value.is_object())
            fail(
                "{} is described by a {}, expected an object with dtype, shape and "
                "data_offsets",
                what, value.type_name());
        TensorInfo info;
        info.name = key;

        auto dt = value.find("dtype");
        if (dt == value.end()) fail("{} has no dtype", what);
        if (!dt->is_string())
            fail("{} has a dtype that is a {}, expected a string", what, dt->type_name());
        auto parsed = parse_dtype(dt->get_ref<const std::string&>());
        if (!parsed)
            fail(
                "{} has unknown dtype '{}' (expected one of F64 F32 F16 BF16 I64 I32 I16 I8 U64 "
                "U32 U16 U8 BOOL)",
                what, dt->get_ref<const std::string&>());
        info.dtype = *parsed;

        auto sh = value.find("shape");
        if (sh == value.end()) fail("{} has no shape", what);
        if (!sh->is_array())
            fail("{} has a shape that is a {}, expected an array", what, sh->type_name());
        for (const auto& d : *sh) {
            if (d.is_number_unsigned() && d.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
                info.shape.push_back(static_cast<int64_t>(d.get<uint64_t>()));
            } else if (d.is_number_integer() && !d.is_number_unsigned()) {
                fail("{} has shape {} with a negative dimension {}", what, sh->dump(),
                     d.get<int64_t>());
            } else {
                fail("{} has shape {}, expected non-negative integers", what, sh->dump());
            }
        }
        uint64_t numel = checked_numel(info.shape, what);
        uint64_t nbytes;
        if (numel > static_cast<uint64_t>(INT64_MAX) ||
            __builtin_mul_overflow(numel, static_cast<uint64_t>(dtype_size(info.dtype)), &nbytes))
            fail("{} has shape {} whose byte size overflows 64 bits", what,
                 shape_string(info.shape));
        info.numel = static_cast<int64_t>(numel);

        auto off = value.find("data_offsets");
        if (off == value.end()) fail("{} has no data_offsets", what);
        if (!off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
            !(*off)[1].is_number_unsigned())
            fail("{} has data_offsets {}, expected [begin, end] as non-negative integers", what,
                 off->dump());
        info.begin = (*off)[0].get<uint64_t>();
        info.end = (*off)[1].get<uint64_t>();
        if (info.begin > info.end)
            fail("{} has data_offsets [{}, {}] with begin after end", what, info.begin, info.end);
        if (info.end > f.data_size_)
            fail(
                "{} has data_offsets [{}, {}] but the data section is only {} bytes (file "
                "truncated?)",
                what, info.begin, info.end, f.data_size_);
        if (info.end - info.begin != nbytes)
            fail(
                "{} has dtype {} and shape {}, which is {} bytes, but its data_offsets [{}, {}] "
                "span {} bytes",
                what, dtype_name(info.dtype), shape_string(info.shape), nbytes, info.begin,
                info.end, info.end - info.begin);
        f.tensors_.push_back(std::move(info));
    }

    // The format requires the tensors to tile the data section: no overlaps, no holes.
    std::stable_sort(f.tensors_.begin(), f.tensors_.end(),
                     [](const TensorInfo& a, const TensorInfo& b) {
                         return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
                     });
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
    for (std::size_t i = 0; i < f.tensors_.size(); i++) f.index_[f.tensors_[i].name] = i;
    return f;
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
    auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
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
