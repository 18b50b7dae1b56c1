// Kashin-DCT per output channel (the follow-up preprint's repaired variant, research note 1.7):
// each row x = u + P v with P = C^T diag(eps) C (orthonormal DCT-II C, seeded signs eps), found
// by blocks of two u-steps and two v-steps; u and v then get 2 bits each on symmetric levels.
#include <cblas.h>

#include <cmath>

#include "core/error.h"
#include "core/rng.h"
#include "quant/kashin.h"
#include "quant/methods.h"

namespace memtrain::quant {

std::vector<double> signed_dct_involution(int64_t n, uint64_t seed) {
    std::vector<double> c((std::size_t)(n * n)), ec((std::size_t)(n * n)), p((std::size_t)(n * n));
    const double pi = 3.14159265358979323846;
    for (int64_t k = 0; k < n; k++)
        for (int64_t i = 0; i < n; i++)
            c[(std::size_t)(k * n + i)] = (k == 0 ? std::sqrt(1.0 / n) : std::sqrt(2.0 / n)) *
                                          std::cos(pi * (2 * i + 1) * k / (2.0 * n));
    Rng rng(seed);
    for (int64_t k = 0; k < n; k++) {
        const double e = (rng.next_u64() >> 63) ? -1.0 : 1.0;
        for (int64_t i = 0; i < n; i++)
            ec[(std::size_t)(k * n + i)] = e * c[(std::size_t)(k * n + i)];
    }
    cblas_dgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (blasint)n, (blasint)n, (blasint)n, 1.0,
                c.data(), (blasint)n, ec.data(), (blasint)n, 0.0, p.data(), (blasint)n);
    return p;
}

namespace detail {

namespace {

// One greedy step on every row of `r` at once (m rows of length n): delta = sign * ||row||_1 /
// nnz, added to `acc` and returned in `delta`.
void row_step(const std::vector<double>& r, int64_t m, int64_t n, std::vector<double>& acc,
              std::vector<double>& delta) {
    for (int64_t i = 0; i < m; i++) {
        const double* x = r.data() + i * n;
        double l1 = 0;
        int64_t nnz = 0;
        for (int64_t j = 0; j < n; j++) l1 += std::fabs(x[j]), nnz += x[j] != 0;
        const double c = nnz ? l1 / (double)nnz : 0.0;
        for (int64_t j = 0; j < n; j++) {
            const double d = c * (double)((x[j] > 0) - (x[j] < 0));
            delta[(std::size_t)(i * n + j)] = d;
            acc[(std::size_t)(i * n + j)] += d;
        }
    }
}

// Symmetric 2-bit levels {-b, -a, a, b} for one row: 1-D Lloyd with 2 centroids on |x|.
std::pair<float, float> symmetric_levels(const double* x, int64_t n) {
    std::vector<double> a((std::size_t)n);
    for (int64_t j = 0; j < n; j++) a[(std::size_t)j] = std::fabs(x[j]);
    std::sort(a.begin(), a.end());
    double lo = a[(std::size_t)(n / 4)], hi = a[(std::size_t)(3 * n / 4)];
    for (int it = 0; it < 30; it++) {
        const double mid = 0.5 * (lo + hi);
        double s0 = 0, s1 = 0;
        int64_t n0 = 0, n1 = 0;
        for (double v : a) {
            if (v <= mid)
                s0 += v, n0++;
            else
                s1 += v, n1++;
        }
        const double nl = n0 ? s0 / (double)n0 : lo, nh = n1 ? s1 / (double)n1 : hi;
        if (nl == lo && nh == hi) break;
        lo = nl, hi = nh;
    }
    return {f16_to_f32(f32_to_f16((float)lo)), f16_to_f32(f32_to_f16((float)hi))};
}

uint32_t code2(double v, float a, float b) {
    const uint32_t mag = std::fabs(v) > 0.5 * ((double)a + (double)b) ? 1u : 0u;
    return (v < 0 ? 2u : 0u) | mag;
}
double level2(uint32_t c, float a, float b) {
    const double m = (c & 1u) ? b : a;
    return (c & 2u) ? -m : m;
}

std::vector<float> decode_dct(const Result& r, const std::vector<double>& p) {
    const int64_t m = r.rows, n = r.cols;
    const auto codes = unpack_bits(part(r, "qweight").bytes, 4, (std::size_t)(m * n));
    const auto lv = part_values<uint16_t>(part(r, "levels"));
    std::vector<double> u((std::size_t)(m * n)), v(u.size()), out(u.size());
    for (int64_t i = 0; i < m; i++) {
        const float ua = f16_to_f32(lv[(std::size_t)(i * 4)]),
                    ub = f16_to_f32(lv[(std::size_t)(i * 4 + 1)]),
                    va = f16_to_f32(lv[(std::size_t)(i * 4 + 2)]),
                    vb = f16_to_f32(lv[(std::size_t)(i * 4 + 3)]);
        for (int64_t j = 0; j < n; j++) {
            const std::size_t e = (std::size_t)(i * n + j);
            u[e] = level2(codes[e] & 3u, ua, ub);
            v[e] = level2(codes[e] >> 2, va, vb);
        }
    }
    // Row form of x = u + P v: X = U + V P^T = U + V P (P is symmetric).
    out = u;
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)m, (blasint)n, (blasint)n, 1.0,
                v.data(), (blasint)n, p.data(), (blasint)n, 1.0, out.data(), (blasint)n);
    return std::vector<float>(out.begin(), out.end());
}

}  // namespace

Result kashin_dct_quantize(const Options& o, MatrixView w) {
    const int64_t m = w.rows, n = w.cols;
    const std::size_t mn = (std::size_t)(m * n);
    const auto p = signed_dct_involution(n, o.seed);
    std::vector<double> r(w.data, w.data + mn), u(mn, 0.0), v(mn, 0.0), d(mn), t(mn);
    double x2 = 0;
    for (double x : r) x2 += x * x;
    Result res;
    res.method = "kashin-dct";
    res.bits = 4;
    res.rows = m;
    res.cols = n;
    const int blocks = std::max(1, o.max_iter / 4);
    double r2 = x2;
    for (int b = 0; b < blocks && std::sqrt(r2) >= o.tol * std::sqrt(x2); b++) {
        for (int k = 0; k < 2; k++) {
            row_step(r, m, n, u, d);
            for (std::size_t e = 0; e < mn; e++) r[e] -= d[e];
        }
        for (int k = 0; k < 2; k++) {
            // Rows of R P are the rotated residuals P r_i.
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)m, (blasint)n,
                        (blasint)n, 1.0, r.data(), (blasint)n, p.data(), (blasint)n, 0.0, t.data(),
                        (blasint)n);
            row_step(t, m, n, v, d);
            cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (blasint)m, (blasint)n,
                        (blasint)n, -1.0, d.data(), (blasint)n, p.data(), (blasint)n, 1.0, r.data(),
                        (blasint)n);
        }
        res.iterations += 4;
        r2 = 0;
        for (double x : r) r2 += x * x;
    }
    res.residual = x2 > 0 ? std::sqrt(r2 / x2) : 0.0;
    res.converged = res.residual < o.tol;
    std::vector<uint16_t> levels((std::size_t)(m * 4));
    std::vector<uint32_t> codes(mn);
    for (int64_t i = 0; i < m; i++) {
        const auto [ua, ub] = symmetric_levels(u.data() + i * n, n);
        const auto [va, vb] = symmetric_levels(v.data() + i * n, n);
        const float l4[4] = {ua, ub, va, vb};
        for (int q = 0; q < 4; q++) levels[(std::size_t)(i * 4 + q)] = f32_to_f16(l4[q]);
        for (int64_t j = 0; j < n; j++) {
            const std::size_t e = (std::size_t)(i * n + j);
            codes[e] = code2(u[e], ua, ub) | code2(v[e], va, vb) << 2;
        }
    }
    const auto packed = pack_bits(codes, 4);
    res.parts.push_back(
        make_part("qweight", DType::U8, {(int64_t)packed.size()}, packed.data(), packed.size()));
    res.parts.push_back(make_part("levels", DType::F16, {m, 4}, levels.data(), levels.size() * 2));
    res.parts.push_back(make_part("seed", DType::U64, {1}, &o.seed, 8));
    res.dequant = decode_dct(res, p);
    return res;
}

std::vector<float> kashin_dct_dequantize(const Result& r) {
    const uint64_t seed = part_values<uint64_t>(part(r, "seed"))[0];
    return decode_dct(r, signed_dct_involution(r.cols, seed));
}

}  // namespace detail
}  // namespace memtrain::quant
