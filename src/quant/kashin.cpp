// Kashin-2D: Haar bases from a seed, the greedy decomposition (residual X and its rotated copy
// Y = Q1^T X Q2 both kept, so a step costs one GEMM pair), the 2-D codebook, and decoding.
#include "quant/kashin.h"

#include <cblas.h>

#include <cmath>

#include "core/error.h"
#include "quant/methods.h"

extern "C" {
// LAPACK from OpenBLAS (which bundles it); Debian ships no lapacke.h beside the openmp build.
void dgeqrf_(const blasint* m, const blasint* n, double* a, const blasint* lda, double* tau,
             double* work, const blasint* lwork, blasint* info);
void dorgqr_(const blasint* m, const blasint* n, const blasint* k, double* a, const blasint* lda,
             const double* tau, double* work, const blasint* lwork, blasint* info);
}

namespace memtrain::quant {

namespace {

// Every this many steps Y is recomputed from X, so the two copies cannot drift apart.
constexpr int kResync = 16;

double sum_abs(const std::vector<double>& a) {
    double s = 0;
    for (double v : a) s += std::fabs(v);
    return s;
}
double sum_sq(const std::vector<double>& a) {
    double s = 0;
    for (double v : a) s += v * v;
    return s;
}
// sign(a) into s; returns how many entries are non-zero (= ||s||^2).
int64_t signs(const std::vector<double>& a, std::vector<double>& s) {
    int64_t nnz = 0;
    for (std::size_t i = 0; i < a.size(); i++) {
        s[i] = (double)((a[i] > 0) - (a[i] < 0));
        nnz += s[i] != 0;
    }
    return nnz;
}

// out = alpha * A^T S B + beta * out (A: m x m, S: m x n, B: n x n), via tmp = A^T S.
void rotate(const KashinBasis& q, bool forward, const std::vector<double>& s, double alpha,
            double beta, std::vector<double>& tmp, std::vector<double>& out) {
    const auto m = (blasint)q.m, n = (blasint)q.n;
    // forward: Q1^T S Q2 (into the coefficient space); backward: Q1 S Q2^T.
    cblas_dgemm(CblasRowMajor, forward ? CblasTrans : CblasNoTrans, CblasNoTrans, m, n, m, 1.0,
                q.q1.data(), m, s.data(), n, 0.0, tmp.data(), n);
    cblas_dgemm(CblasRowMajor, CblasNoTrans, forward ? CblasNoTrans : CblasTrans, m, n, n, alpha,
                tmp.data(), n, q.q2.data(), n, beta, out.data(), n);
}

}  // namespace

std::vector<double> haar_orthogonal(int64_t n, Rng& rng) {
    std::vector<double> a((std::size_t)(n * n));
    for (auto& v : a) v = rng.normal();
    const blasint nn = (blasint)n;
    std::vector<double> tau((std::size_t)n);
    blasint info = 0, lwork = -1;
    double query = 0;
    dgeqrf_(&nn, &nn, a.data(), &nn, tau.data(), &query, &lwork, &info);
    lwork = (blasint)query;
    std::vector<double> work((std::size_t)std::max<blasint>(lwork, 1));
    dgeqrf_(&nn, &nn, a.data(), &nn, tau.data(), work.data(), &lwork, &info);
    if (info != 0) fail("QR of a {}x{} Gaussian matrix failed (LAPACK info {})", n, n, info);
    std::vector<double> rsign((std::size_t)n);
    for (int64_t j = 0; j < n; j++)
        rsign[(std::size_t)j] = a[(std::size_t)(j * n + j)] < 0 ? -1.0 : 1.0;
    lwork = -1;
    dorgqr_(&nn, &nn, &nn, a.data(), &nn, tau.data(), &query, &lwork, &info);
    lwork = (blasint)query;
    work.resize((std::size_t)std::max<blasint>(lwork, 1));
    dorgqr_(&nn, &nn, &nn, a.data(), &nn, tau.data(), work.data(), &lwork, &info);
    if (info != 0) fail("forming Q of a {}x{} QR failed (LAPACK info {})", n, n, info);
    // LAPACK is column-major: column j of Q is a[j*n ...]. Scaling it by sign(R_jj) makes Q Haar;
    // read row-major the buffer is Q^T, which is Haar as well.
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < n; i++) a[(std::size_t)(j * n + i)] *= rsign[(std::size_t)j];
    return a;
}

KashinBasis kashin_basis(int64_t m, int64_t n, uint64_t seed) {
    Rng rng(seed);
    KashinBasis q;
    q.m = m;
    q.n = n;
    q.q1 = haar_orthogonal(m, rng);
    q.q2 = haar_orthogonal(n, rng);
    return q;
}

KashinDecomposition kashin_decompose(MatrixView w, const KashinBasis& q, int max_iter, double tol,
                                     std::vector<KashinStep>* trace) {
    if (q.m != w.rows || q.n != w.cols)
        fail("Kashin basis is {}x{} / {}x{}, the weight {}x{}", q.m, q.m, q.n, q.n, w.rows, w.cols);
    const std::size_t mn = (std::size_t)w.numel();
    KashinDecomposition d;
    d.rows = w.rows;
    d.cols = w.cols;
    double f2 = 0;
    for (std::size_t i = 0; i < mn; i++) f2 += (double)w.data[i] * w.data[i];
    if (!std::isfinite(f2)) fail("the weight holds a non-finite value");
    d.norm = (float)std::sqrt(f2);
    d.u.assign(mn, 0.0);
    d.v.assign(mn, 0.0);
    if (d.norm == 0) {
        d.converged = true;
        return d;
    }
    std::vector<double> x(mn), y(mn), s(mn), tmp(mn);
    for (std::size_t i = 0; i < mn; i++) x[i] = (double)w.data[i] / d.norm;
    const std::vector<double> x0 = x;
    rotate(q, true, x, 1.0, 0.0, tmp, y);
    double r2 = sum_sq(x);
    while (std::sqrt(r2) >= tol && d.iterations < max_iter) {
        KashinStep st;
        st.r2_before = r2;
        const double l1x = sum_abs(x), l1y = sum_abs(y);
        st.u_step = l1x > l1y;
        if (st.u_step) {
            const int64_t nnz = signs(x, s);
            const double c = l1x / (double)nnz;
            st.proj2 = l1x * l1x / (double)nnz;
            for (std::size_t i = 0; i < mn; i++) d.u[i] += c * s[i], x[i] -= c * s[i];
            rotate(q, true, s, -c, 1.0, tmp, y);
        } else {
            const int64_t nnz = signs(y, s);
            const double c = l1y / (double)nnz;
            st.proj2 = l1y * l1y / (double)nnz;
            for (std::size_t i = 0; i < mn; i++) d.v[i] += c * s[i], y[i] -= c * s[i];
            rotate(q, false, s, -c, 1.0, tmp, x);
        }
        d.iterations++;
        r2 = sum_sq(x);
        st.r2_after = r2;
        if (trace) trace->push_back(st);
        if (d.iterations % kResync == 0) rotate(q, true, x, 1.0, 0.0, tmp, y);
    }
    // The residual from scratch, not the tracked X, so drift cannot hide in it.
    rotate(q, false, d.v, 1.0, 0.0, tmp, x);
    double res = 0;
    for (std::size_t i = 0; i < mn; i++) {
        const double e = x0[i] - d.u[i] - x[i];
        res += e * e;
    }
    d.residual = std::sqrt(res);
    d.converged = d.residual < tol;
    return d;
}

std::vector<float> kashin_reconstruct(std::span<const double> u, std::span<const double> v,
                                      const KashinBasis& q, float norm) {
    const std::size_t mn = (std::size_t)(q.m * q.n);
    std::vector<double> vv(v.begin(), v.end()), tmp(mn), out(mn);
    rotate(q, false, vv, 1.0, 0.0, tmp, out);
    std::vector<float> w(mn);
    for (std::size_t i = 0; i < mn; i++) w[i] = (float)((double)norm * (u[i] + out[i]));
    return w;
}

namespace detail {

namespace {

std::vector<float> decode(const Result& r, const KashinBasis& q) {
    const std::size_t mn = (std::size_t)(r.rows * r.cols);
    const auto codes = unpack_bits(part(r, "qweight").bytes, r.bits, mn);
    const auto book = part_values<float>(part(r, "codebook"));
    const float norm = part_values<float>(part(r, "norm"))[0];
    std::vector<double> u(mn), v(mn);
    for (std::size_t i = 0; i < mn; i++) u[i] = book[codes[i] * 2], v[i] = book[codes[i] * 2 + 1];
    return kashin_reconstruct(u, v, q, norm);
}

}  // namespace

Result kashin_quantize(const Options& o, MatrixView w) {
    const KashinBasis q = kashin_basis(w.rows, w.cols, o.seed);
    const KashinDecomposition d = kashin_decompose(w, q, o.max_iter, o.tol);
    if (!d.converged && !o.kashin_force) {
        Options f = o;
        f.method = o.fallback;
        f.group = 0;
        Result r = quantize(f, w);
        r.iterations = d.iterations;
        r.converged = false;
        r.residual = d.residual;
        r.fell_back = true;
        return r;
    }
    Result r;
    r.method = "kashin";
    r.bits = o.bits;
    r.rows = w.rows;
    r.cols = w.cols;
    r.iterations = d.iterations;
    r.converged = d.converged;
    r.residual = d.residual;
    // 2^floor(b/2) clusters along U and 2^ceil(b/2) along V: at 4 bits the 4 x 4 grid of peaks.
    const Kmeans2d km = kmeans_2d(d.u, d.v, 1 << (o.bits / 2), 1 << ((o.bits + 1) / 2));
    const auto packed = pack_bits(km.assign, o.bits);
    const int64_t k = (int64_t)km.centroids.size() / 2;
    r.parts.push_back(
        make_part("qweight", DType::U8, {(int64_t)packed.size()}, packed.data(), packed.size()));
    r.parts.push_back(
        make_part("codebook", DType::F32, {k, 2}, km.centroids.data(), km.centroids.size() * 4));
    r.parts.push_back(make_part("norm", DType::F32, {1}, &d.norm, 4));
    r.parts.push_back(make_part("seed", DType::U64, {1}, &o.seed, 8));
    r.dequant = decode(r, q);
    return r;
}

std::vector<float> kashin_dequantize(const Result& r) {
    const uint64_t seed = part_values<uint64_t>(part(r, "seed"))[0];
    return decode(r, kashin_basis(r.rows, r.cols, seed));
}

}  // namespace detail
}  // namespace memtrain::quant
