// Safetensors reading (mmap, validated against every malformation we know of) and writing
// (atomic: written to PATH.tmp, fsynced, renamed). The format: a little-endian u64 header length,
// a JSON header, then the raw tensor bytes; see https://github.com/huggingface/safetensors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"

namespace memtrain::io {

// The element types, in core/ (quant/ stores them too); io::DType is the same type.
using memtrain::DType;
using memtrain::dtype_name;
using memtrain::dtype_size;
using memtrain::parse_dtype;

struct TensorInfo {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte offsets into the data section (after the header)
    int64_t numel = 0;
};

// "[2, 3, 4]"
std::string shape_string(std::span<const int64_t> shape);

class SafetensorsWriter {
  public:
    // `data` is not copied: it must stay valid until write() returns. Names must be unique.
    void add(std::string name, DType dtype, std::vector<int64_t> shape, const void* data);
    // A tensor whose bytes come from write()'s `source` when its turn comes (streaming: a
    // writer need not hold every tensor at once).
    void declare(std::string name, DType dtype, std::vector<int64_t> shape);
    // Stored in the header's "__metadata__" map; setting a key again replaces its value.
    void set_metadata(std::string key, std::string value);
    // Writes path + ".tmp", fsyncs it, and renames it onto path, so path never holds a partial
    // file. Throws memtrain::Error (and removes the .tmp) on failure. Declared tensors are
    // fetched in insertion order as source(i), i their index among all tensors; the pointer
    // need only stay valid until the next call.
    void write(const std::string& path,
               const std::function<const void*(std::size_t)>& source = {}) const;

  private:
    struct Entry {
        std::string name;
        DType dtype;
        std::vector<int64_t> shape;
        const void* data;
        uint64_t bytes;
    };
    std::vector<Entry> entries_;
    std::map<std::string, std::string> metadata_;
};

class SafetensorsFile {
  public:
    // Maps the file and validates its header; throws memtrain::Error naming the file (and the
    // tensor, where one is at fault) if anything is malformed.
    static SafetensorsFile open(const std::string& path);

    const std::string& path() const { return path_; }
    // nullptr if there is no tensor of that name.
    const TensorInfo* find(std::string_view name) const;
    // Throws memtrain::Error naming the tensor and the file if it is missing.
    const TensorInfo& get(std::string_view name) const;
    // Tensor names in file (data offset) order.
    std::vector<std::string> names() const;
    // Tensors in file (data offset) order.
    const std::vector<TensorInfo>& tensors() const { return tensors_; }
    const std::map<std::string, std::string>& metadata() const { return metadata_; }
    // The tensor's bytes inside the mapping; valid while this object (or a copy) lives. Files we
    // write keep every tensor aligned to its element size; foreign files need not.
    const void* data(const TensorInfo& info) const;
    // Drops the pages of bytes [offset, offset + n) of the tensor from this process's resident
    // set (they stay in the page cache; a later read maps them again). A pass over a large file
    // then holds a few MiB resident instead of the whole file.
    void release_pages(const TensorInfo& info, uint64_t offset, uint64_t n) const;

    // Checks the tensor has exactly `expect_shape` (and out.size() elements) and converts it
    // from F32, BF16 or F16 into `out`. `expect_name` is the name the caller asked for, used in
    // messages when it differs from info.name.
    void read_f32(const TensorInfo& info, std::span<float> out, std::string_view expect_name,
                  std::span<const int64_t> expect_shape) const;

  private:
    struct Mapping;
    class HeaderReader;
    std::string path_;
    std::shared_ptr<const Mapping> map_;
    const unsigned char* data_ = nullptr;  // start of the data section
    uint64_t data_size_ = 0;
    std::vector<TensorInfo> tensors_;
    // Positions in tensors_ in name order (a binary search finds a name): 8 bytes a tensor, where
    // a map of names took about 80 (a header may hold a million tensors).
    std::vector<std::size_t> index_;
    std::map<std::string, std::string> metadata_;
};

}  // namespace memtrain::io
