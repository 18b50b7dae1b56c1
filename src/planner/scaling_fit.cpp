// Fitting L(N, D) = E + A / N^alpha + B / D^beta to runs (see scaling_fit.h).
#include "planner/scaling_fit.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <deque>
#include <set>

#include "core/error.h"
#include "core/rng.h"

namespace memtrain::plan {

namespace {

// x = (a, b, e, alpha, beta): A = exp(a), B = exp(b), E = exp(e).
using Vec = std::array<double, 5>;

struct Sample {
    double log_n, log_d, log_l;
};

ChinchillaFit law_of(const Vec& x) {
    return {std::exp(x[2]), std::exp(x[0]), std::exp(x[1]), x[3], x[4]};
}

double huber(double r, double delta) {
    const double a = std::fabs(r);
    return a <= delta ? 0.5 * r * r : delta * (a - 0.5 * delta);
}

// The objective and its gradient.
double objective(const Vec& x, const std::vector<Sample>& s, double delta, Vec& grad) {
    double f = 0;
    grad.fill(0.0);
    for (const Sample& p : s) {
        const double t1 = x[0] - x[3] * p.log_n, t2 = x[1] - x[4] * p.log_d, t3 = x[2];
        const double m = std::max({t1, t2, t3});
        const double e1 = std::exp(t1 - m), e2 = std::exp(t2 - m), e3 = std::exp(t3 - m);
        const double sum = e1 + e2 + e3;
        const double r = m + std::log(sum) - p.log_l;
        f += huber(r, delta);
        const double dr = std::fabs(r) <= delta ? r : (r > 0 ? delta : -delta);
        const double w1 = e1 / sum, w2 = e2 / sum, w3 = e3 / sum;
        grad[0] += dr * w1;
        grad[1] += dr * w2;
        grad[2] += dr * w3;
        grad[3] -= dr * w1 * p.log_n;
        grad[4] -= dr * w2 * p.log_d;
    }
    return f;
}

double dot(const Vec& a, const Vec& b) {
    double s = 0;
    for (int i = 0; i < 5; i++) s += a[i] * b[i];
    return s;
}

// L-BFGS (memory 10) with a backtracking Armijo line search, from x; returns the objective.
double minimise(Vec& x, const std::vector<Sample>& s, double delta) {
    constexpr int kMemory = 10, kIterations = 1000;
    Vec g;
    double f = objective(x, s, delta, g);
    std::deque<std::pair<Vec, Vec>> history;  // (step, gradient change)
    for (int it = 0; it < kIterations; it++) {
        if (std::sqrt(dot(g, g)) < 1e-14) break;
        // Two-loop recursion: d = -H g.
        Vec q = g;
        std::vector<double> alpha(history.size());
        for (int i = (int)history.size() - 1; i >= 0; i--) {
            const auto& [sk, yk] = history[(std::size_t)i];
            alpha[(std::size_t)i] = dot(sk, q) / dot(yk, sk);
            for (int j = 0; j < 5; j++) q[j] -= alpha[(std::size_t)i] * yk[j];
        }
        if (!history.empty()) {
            const auto& [sk, yk] = history.back();
            const double gamma = dot(sk, yk) / dot(yk, yk);
            for (double& v : q) v *= gamma;
        }
        for (std::size_t i = 0; i < history.size(); i++) {
            const auto& [sk, yk] = history[i];
            const double beta = dot(yk, q) / dot(yk, sk);
            for (int j = 0; j < 5; j++) q[j] += sk[j] * (alpha[i] - beta);
        }
        Vec d;
        for (int j = 0; j < 5; j++) d[j] = -q[j];
        double slope = dot(d, g);
        if (!(slope < 0)) {  // not a descent direction: steepest descent, history dropped
            history.clear();
            for (int j = 0; j < 5; j++) d[j] = -g[j];
            slope = -dot(g, g);
        }
        double step = 1;
        Vec xn, gn;
        double fn = 0;
        bool moved = false;
        for (int k = 0; k < 60; k++, step *= 0.5) {
            for (int j = 0; j < 5; j++) xn[j] = x[j] + step * d[j];
            fn = objective(xn, s, delta, gn);
            if (std::isfinite(fn) && fn <= f + 1e-4 * step * slope) {
                moved = true;
                break;
            }
        }
        if (!moved) break;
        Vec sk, yk;
        for (int j = 0; j < 5; j++) {
            sk[j] = xn[j] - x[j];
            yk[j] = gn[j] - g[j];
        }
        const bool converged = f - fn <= 1e-16 * std::max(1.0, std::fabs(f));
        if (dot(sk, yk) > 1e-300) {
            history.push_back({sk, yk});
            if ((int)history.size() > kMemory) history.pop_front();
        }
        x = xn;
        g = gn;
        f = fn;
        if (converged) break;
    }
    return f;
}

// Chinchilla's grid of initialisations (appendix D.2).
std::vector<Vec> chinchilla_starts() {
    std::vector<Vec> out;
    for (double alpha = 0; alpha <= 2.0; alpha += 0.5)
        for (double beta = 0; beta <= 2.0; beta += 0.5)
            for (double e = -1; e <= 1.0; e += 0.5)
                for (double a = 0; a <= 25; a += 5)
                    for (double b = 0; b <= 25; b += 5) out.push_back({a, b, e, alpha, beta});
    return out;
}

Vec best_of(const std::vector<Vec>& starts, const std::vector<Sample>& s, double delta,
            double* best_f) {
    Vec best = starts.front();
    double bf = INFINITY;
    for (Vec x : starts) {
        const double f = minimise(x, s, delta);
        if (f < bf) {
            bf = f;
            best = x;
        }
    }
    *best_f = bf;
    return best;
}

}  // namespace

Interval percentile_interval(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    auto at = [&](double q) {
        const double pos = q * (double)(v.size() - 1);
        const std::size_t i = (std::size_t)pos;
        const double frac = pos - (double)i;
        return i + 1 < v.size() ? v[i] * (1 - frac) + v[i + 1] * frac : v[i];
    };
    return {at(0.025), at(0.975)};
}

ScalingLawFit fit_scaling_law(const std::vector<LossPoint>& points, const FitOptions& opts) {
    std::set<double> ns, ds;
    std::vector<Sample> s;
    for (const LossPoint& p : points) {
        const std::string who = p.origin.empty() ? std::string("a point") : p.origin;
        if (!(p.params > 0 && std::isfinite(p.params)))
            fail("{}: the parameter count {} is not a positive number", who, p.params);
        if (!(p.tokens > 0 && std::isfinite(p.tokens)))
            fail("{}: the token count {} is not a positive number", who, p.tokens);
        if (!(p.loss > 0 && std::isfinite(p.loss)))
            fail("{}: the loss {} is not a positive number", who, p.loss);
        ns.insert(p.params);
        ds.insert(p.tokens);
        s.push_back({std::log(p.params), std::log(p.tokens), std::log(p.loss)});
    }
    if (points.size() < 5 || ns.size() < 2 || ds.size() < 2)
        fail(
            "a fit of L(N, D) = E + A/N^alpha + B/D^beta needs at least 5 runs with at least 2 "
            "model sizes and 2 token counts; got {} runs, {} sizes, {} token counts",
            points.size(), ns.size(), ds.size());
    ScalingLawFit out;
    out.points = (int)points.size();
    const Vec best = best_of(chinchilla_starts(), s, opts.huber_delta, &out.objective);
    out.law = law_of(best);
    if (opts.bootstrap <= 0) return out;
    // Each resample refits from the full fit's optimum and a few of Chinchilla's starts.
    std::vector<Vec> starts{best};
    for (double alpha : {0.25, 0.75})
        for (double beta : {0.25, 0.75}) starts.push_back({5, 5, 0, alpha, beta});
    Rng rng(opts.seed);
    std::vector<double> E, A, B, al, be;
    for (int r = 0; r < opts.bootstrap; r++) {
        std::vector<Sample> re;
        for (std::size_t i = 0; i < s.size(); i++) re.push_back(s[rng.next_u64() % s.size()]);
        double f = 0;
        const ChinchillaFit law = law_of(best_of(starts, re, opts.huber_delta, &f));
        out.resamples.push_back(law);
        E.push_back(law.E);
        A.push_back(law.A);
        B.push_back(law.B);
        al.push_back(law.alpha);
        be.push_back(law.beta);
    }
    out.E = percentile_interval(E);
    out.A = percentile_interval(A);
    out.B = percentile_interval(B);
    out.alpha = percentile_interval(al);
    out.beta = percentile_interval(be);
    return out;
}

}  // namespace memtrain::plan
