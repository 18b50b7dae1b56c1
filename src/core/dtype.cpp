// The dtype table (core/dtype.h).
#include "core/dtype.h"

#include "core/error.h"

namespace memtrain {

namespace {

struct DTypeRow {
    DType dtype;
    std::string_view name;
    std::size_t size;
};

constexpr DTypeRow dtype_table[] = {
    {DType::F64, "F64", 8},   {DType::F32, "F32", 4}, {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::I64, "I64", 8}, {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},   {DType::I8, "I8", 1},   {DType::U64, "U64", 8},
    {DType::U32, "U32", 4},   {DType::U16, "U16", 2}, {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1},
};

const DTypeRow& dtype_row(DType dtype) {
    for (const auto& r : dtype_table)
        if (r.dtype == dtype) return r;
    fail("invalid DType value {}", static_cast<int>(dtype));
}

}  // namespace

const char* precision_name(Precision p) {
    switch (p) {
        case Precision::fp32:
            return "fp32";
        case Precision::bf16:
            return "bf16";
        case Precision::fp16:
            return "fp16";
    }
    return "?";
}

std::optional<Precision> find_precision(std::string_view name) {
    for (Precision p : {Precision::fp32, Precision::bf16, Precision::fp16})
        if (name == precision_name(p)) return p;
    return std::nullopt;
}

std::size_t dtype_size(DType dtype) {
    return dtype_row(dtype).size;
}

std::string_view dtype_name(DType dtype) {
    return dtype_row(dtype).name;
}

std::optional<DType> parse_dtype(std::string_view name) {
    for (const auto& r : dtype_table)
        if (r.name == name) return r.dtype;
    return std::nullopt;
}

}  // namespace memtrain
