// Kashin-2D (Merkulov et al., UAI 2024, Algorithm 2): W/||W||_F = U + Q1 V Q2^T with both
// factors of small sup-norm, found greedily with Kronecker-factored random orthogonal Q1, Q2;
// then one 2-D k-means codebook over the (U_ij, V_ij) pairs. The pieces are public for tests.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/rng.h"
#include "quant/quant.h"

namespace memtrain::quant {

// A Haar-distributed n x n orthogonal matrix (row-major): QR of a Gaussian matrix with the signs
// of R's diagonal moved into Q, without which QR's Q is not Haar.
std::vector<double> haar_orthogonal(int64_t n, Rng& rng);

// Q1 (m x m) and Q2 (n x n), regenerated from the seed stored with the weights.
struct KashinBasis {
    int64_t m = 0, n = 0;
    std::vector<double> q1, q2;
};
KashinBasis kashin_basis(int64_t m, int64_t n, uint64_t seed);

// One greedy step: ||r'||^2 should equal ||r||^2 - <r,s>^2/||s||^2 (= r2_before - proj2).
struct KashinStep {
    bool u_step = true;
    double r2_before = 0, r2_after = 0, proj2 = 0;
};

struct KashinDecomposition {
    int64_t rows = 0, cols = 0;
    float norm = 0;            // s = ||W||_F as stored (fp32)
    std::vector<double> u, v;  // W/s ~= U + Q1 V Q2^T; V holds the coefficients
    int iterations = 0;        // greedy steps taken
    bool converged = false;    // residual < tol
    double residual = 0;       // ||W/s - U - Q1 V Q2^T||_F, recomputed from scratch
};
KashinDecomposition kashin_decompose(MatrixView w, const KashinBasis& q, int max_iter, double tol,
                                     std::vector<KashinStep>* trace = nullptr);

// s * (U + Q1 V Q2^T), rows x cols.
std::vector<float> kashin_reconstruct(std::span<const double> u, std::span<const double> v,
                                      const KashinBasis& q, float norm);

// P = C^T diag(eps) C for the orthonormal DCT-II C and seeded signs eps: symmetric, orthogonal,
// P P = I (the per-channel Kashin-DCT basis), n x n row-major.
std::vector<double> signed_dct_involution(int64_t n, uint64_t seed);

// Lloyd's k-means on 2-D points, k = kx * ky centroids started on a kx x ky grid of cell centres
// over the ranges of x and y (so it is deterministic); stops when no centroid moves by more than
// tol times the larger range, or after max_iter rounds.
struct Kmeans2d {
    std::vector<float> centroids;  // k x 2
    std::vector<uint32_t> assign;
    int iterations = 0;
};
Kmeans2d kmeans_2d(std::span<const double> x, std::span<const double> y, int kx, int ky,
                   int max_iter = 100, double tol = 1e-6);

}  // namespace memtrain::quant
