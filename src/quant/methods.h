// The method families behind quant::quantize and quant::dequantize, one source file each
// (rtn.cpp, nf4.cpp, kmeans.cpp, kashin.cpp); quant.cpp checks options and dispatches.
#pragma once

#include "quant/quant.h"

namespace memtrain::quant::detail {

// Symmetric absmax (asym = false) or min/max with an integer zero point, per row (group 0) or
// per `group` consecutive inputs of a row; fp16 scales.
Result rtn_quantize(MatrixView w, int bits, int group, bool asym);
std::vector<float> rtn_dequantize(const Result& r);
// One grid over [min, max] of the whole tensor (the paper's GLUE "uniform" baseline).
Result uniform_quantize(MatrixView w, int bits);
std::vector<float> uniform_dequantize(const Result& r);
// One 1-D Lloyd codebook of 2^bits levels for the whole tensor (the paper's GLUE "k-means").
Result kmeans_quantize(MatrixView w, int bits);
std::vector<float> kmeans_dequantize(const Result& r);
// NormalFloat4 with an fp32 absmax per block, or with those absmaxes quantized again (uint8
// codes, one fp32 scale per kNf4DqBlock absmaxes; quant/quantized_store.cpp decodes this too).
constexpr int64_t kNf4DqBlock = 256;
Result nf4_quantize(MatrixView w, int block, bool double_quant);
std::vector<float> nf4_dequantize(const Result& r);
Result kashin_quantize(const Options& o, MatrixView w);
// Per output channel x = u + P v (signed DCT involution P), 2 + 2 bits, fp16 levels per row.
Result kashin_dct_quantize(const Options& o, MatrixView w);
std::vector<float> kashin_dct_dequantize(const Result& r);
std::vector<float> kashin_dequantize(const Result& r);

}  // namespace memtrain::quant::detail
