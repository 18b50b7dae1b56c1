// Codebook quantizers: the per-tensor 1-D k-means of the paper's GLUE baseline (Lloyd over
// sorted values with prefix sums, so a round costs O(k log n)) and the 2-D Lloyd that Kashin-2D
// runs on its (U, V) pairs.
#include <cmath>
#include <limits>
#include <numeric>

#include "core/error.h"
#include "quant/kashin.h"
#include "quant/methods.h"

namespace memtrain::quant {

Kmeans2d kmeans_2d(std::span<const double> x, std::span<const double> y, int kx, int ky,
                   int max_iter, double tol) {
    const std::size_t n = x.size();
    const int k = kx * ky;
    double x0 = x[0], x1 = x[0], y0 = y[0], y1 = y[0];
    for (std::size_t i = 0; i < n; i++) {
        x0 = std::min(x0, x[i]), x1 = std::max(x1, x[i]);
        y0 = std::min(y0, y[i]), y1 = std::max(y1, y[i]);
    }
    std::vector<double> c((std::size_t)k * 2);
    for (int a = 0; a < kx; a++)
        for (int b = 0; b < ky; b++) {
            c[(std::size_t)(a * ky + b) * 2] = x0 + (a + 0.5) * (x1 - x0) / kx;
            c[(std::size_t)(a * ky + b) * 2 + 1] = y0 + (b + 0.5) * (y1 - y0) / ky;
        }
    const double range = std::max({x1 - x0, y1 - y0, std::numeric_limits<double>::min()});
    Kmeans2d out;
    out.assign.assign(n, 0);
    auto assign_all = [&]() {
#pragma omp parallel for schedule(static)
        for (std::size_t i = 0; i < n; i++) {
            double best = std::numeric_limits<double>::infinity();
            uint32_t arg = 0;
            for (int j = 0; j < k; j++) {
                const double dx = x[i] - c[(std::size_t)j * 2],
                             dy = y[i] - c[(std::size_t)j * 2 + 1];
                const double d = dx * dx + dy * dy;
                if (d < best) best = d, arg = (uint32_t)j;
            }
            out.assign[i] = arg;
        }
    };
    for (int it = 0; it < max_iter; it++) {
        assign_all();
        std::vector<double> sum((std::size_t)k * 2, 0.0);
        std::vector<int64_t> cnt((std::size_t)k, 0);
        for (std::size_t i = 0; i < n; i++) {
            const uint32_t j = out.assign[i];
            sum[j * 2] += x[i], sum[j * 2 + 1] += y[i], cnt[j]++;
        }
        double moved = 0;
        for (int j = 0; j < k; j++) {
            if (cnt[(std::size_t)j] == 0) continue;  // an empty cluster keeps its place
            for (int d = 0; d < 2; d++) {
                const double nc = sum[(std::size_t)j * 2 + d] / (double)cnt[(std::size_t)j];
                moved = std::max(moved, std::fabs(nc - c[(std::size_t)j * 2 + d]));
                c[(std::size_t)j * 2 + d] = nc;
            }
        }
        out.iterations = it + 1;
        if (moved <= tol * range) break;
    }
    assign_all();
    out.centroids.assign(c.begin(), c.end());
    return out;
}

namespace detail {

Result kmeans_quantize(MatrixView w, int bits) {
    Result r;
    r.method = "kmeans";
    r.bits = bits;
    r.rows = w.rows;
    r.cols = w.cols;
    const std::size_t n = (std::size_t)w.numel();
    const int k = 1 << bits;
    std::vector<float> sorted(w.data, w.data + n);
    std::sort(sorted.begin(), sorted.end());
    std::vector<double> prefix(n + 1, 0.0);
    for (std::size_t i = 0; i < n; i++) prefix[i + 1] = prefix[i] + sorted[i];
    // Started at equal-count quantiles, which is deterministic and already near Lloyd-Max.
    std::vector<double> c((std::size_t)k);
    for (int j = 0; j < k; j++)
        c[(std::size_t)j] = sorted[(std::size_t)((j + 0.5) * (double)n / k)];
    const double range = std::max((double)sorted.back() - sorted.front(), 1e-30);
    std::vector<std::size_t> edge((std::size_t)k + 1);
    for (int it = 0; it < 300; it++) {
        edge[0] = 0;
        edge[(std::size_t)k] = n;
        for (int j = 1; j < k; j++) {
            const float b = (float)(0.5 * (c[(std::size_t)j - 1] + c[(std::size_t)j]));
            edge[(std::size_t)j] =
                (std::size_t)(std::lower_bound(sorted.begin(), sorted.end(), b) - sorted.begin());
            edge[(std::size_t)j] = std::max(edge[(std::size_t)j], edge[(std::size_t)j - 1]);
        }
        double moved = 0;
        for (int j = 0; j < k; j++) {
            const std::size_t lo = edge[(std::size_t)j], hi = edge[(std::size_t)j + 1];
            if (hi == lo) continue;
            const double nc = (prefix[hi] - prefix[lo]) / (double)(hi - lo);
            moved = std::max(moved, std::fabs(nc - c[(std::size_t)j]));
            c[(std::size_t)j] = nc;
        }
        if (moved <= 1e-7 * range) break;
    }
    std::vector<float> book(c.begin(), c.end());
    std::sort(book.begin(), book.end());
    std::vector<uint32_t> codes(n);
    for (std::size_t e = 0; e < n; e++) {
        const float v = w.data[e];
        auto it = std::lower_bound(book.begin(), book.end(), v);
        std::size_t j = (std::size_t)(it - book.begin());
        if (j == book.size() || (j > 0 && v - book[j - 1] <= book[j] - v)) j--;
        codes[e] = (uint32_t)j;
    }
    const auto packed = pack_bits(codes, bits);
    r.parts.push_back(
        make_part("qweight", DType::U8, {(int64_t)packed.size()}, packed.data(), packed.size()));
    r.parts.push_back(make_part("codebook", DType::F32, {k}, book.data(), book.size() * 4));
    r.dequant = kmeans_dequantize(r);
    return r;
}

std::vector<float> kmeans_dequantize(const Result& r) {
    const auto codes =
        unpack_bits(part(r, "qweight").bytes, r.bits, (std::size_t)(r.rows * r.cols));
    const auto book = part_values<float>(part(r, "codebook"));
    std::vector<float> out(codes.size());
    for (std::size_t e = 0; e < codes.size(); e++) out[e] = book[codes[e]];
    return out;
}

}  // namespace detail
}  // namespace memtrain::quant
