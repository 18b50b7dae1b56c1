// What the optimizer tests that check a step against a PyTorch reference script share: the raw
// fp32 files they trade with the script, and the two-tensor layout they step (a block matrix and
// a gain).
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <fstream>
#include <string>
#include <vector>

#include "model/param_layout.h"

namespace memtrain::test {

inline void write_f32(const std::string& path, const std::vector<float>& v) {
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(v.data()), (std::streamsize)(v.size() * 4));
}

inline std::vector<float> read_f32(const std::string& path, std::size_t n) {
    std::vector<float> v(n);
    std::ifstream f(path, std::ios::binary);
    f.read(reinterpret_cast<char*>(v.data()), (std::streamsize)(n * 4));
    EXPECT_TRUE(f.good()) << path;
    return v;
}

// A block matrix (rows x cols, memtrain's (in, out)), which decays, and a gain of `rows`, which
// does not.
inline ParamLayout matrix_and_gain(int rows, int cols) {
    ParamLayout l;
    const std::size_t n = (std::size_t)rows * cols;
    l.tensors.push_back({"h.0.mlp.c_fc.weight", {rows, cols}, 0, n, true});
    l.tensors.push_back({"h.0.ln_1.weight", {rows}, n, (std::size_t)rows, false});
    l.total = n + rows;
    return l;
}

}  // namespace memtrain::test
