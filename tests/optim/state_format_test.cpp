// Moment storage formats (optim/state_format.h): the code maps, the round-trip error bounds the
// header documents, the block layout and its bytes, and the promise that makes ZeRO exact: from
// the same gradients, optimizers over any world size's shards hold bitwise the state of one.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/error.h"
#include "model/param_layout.h"
#include "optim/optimizer.h"
#include "optim/state_format.h"
#include "test_util.h"

using namespace memtrain;

namespace {

// A model whose matrices are quantized (>= 4096 elements) and whose gains, biases and position
// embedding keep fp32, with tensors that do not start on the 256 grid (n_embd 80).
ModelConfig formats_model() {
    ModelConfig c = test::tiny_model();
    c.n_embd = 80;
    c.block_size = 16;
    c.vocab_size = 61;
    return c;
}

const StateFormat kStored[] = {StateFormat::Bf16, StateFormat::Int8, StateFormat::Int4};

struct MapCase {
    int bits;
    bool is_signed;
    int mantissa;    // bits
    double sub_abs;  // half the subnormal step, relative to the block's largest value
};

// The maps' documented bounds: relative error 2^-(m+1) in the normal range (1/3 for the
// powers of two), half a subnormal step below it.
std::vector<MapCase> map_cases() {
    // Half a subnormal step is 2^(-bias - m) over the map's largest value 2 - 2^-m.
    return {{8, true, 3, std::ldexp(1.0, -15 - 3) / 1.875},
            {8, false, 3, std::ldexp(1.0, -31 - 3) / 1.875},
            {4, true, 1, std::ldexp(1.0, -3 - 1) / 1.5},
            {4, false, 0, std::ldexp(1.0, -15 - 0)}};
}

}  // namespace

TEST(StateFormat, CodeMapsAreMonotoneEndAtOneAndRoundTrip) {
    for (const MapCase& k : map_cases()) {
        const int codes = 1 << k.bits, mags = k.is_signed ? codes / 2 : codes;
        float prev = -1;
        for (int c = 0; c < mags; c++) {
            const float v = decode_code(k.bits, k.is_signed, (uint8_t)c);
            EXPECT_GT(v, prev) << k.bits << " bits, code " << c;
            prev = v;
            EXPECT_EQ(encode_code(k.bits, k.is_signed, v), c) << k.bits << " bits, code " << c;
            if (k.is_signed && c > 0) {
                const uint8_t neg = (uint8_t)(c | mags);
                EXPECT_EQ(decode_code(k.bits, true, neg), -v);
                EXPECT_EQ(encode_code(k.bits, true, -v), neg);
            }
        }
        EXPECT_EQ(prev, 1.0f) << k.bits << " bits: the largest code decodes to 1";
        EXPECT_EQ(decode_code(k.bits, k.is_signed, 0), 0.0f);
    }
}

TEST(StateFormat, EncodingPicksTheNearestCodeAndNeverZeroesAPositiveSecondMoment) {
    Rng rng(7);
    for (const MapCase& k : map_cases()) {
        const int mags = k.is_signed ? (1 << k.bits) / 2 : 1 << k.bits;
        for (int i = 0; i < 20000; i++) {
            // Magnitudes spread over the whole exponent range of the map.
            float x = (float)std::ldexp(rng.uniform(), -(int)(rng.next_u64() % 40));
            if (k.is_signed && rng.uniform() < 0.5f) x = -x;
            const uint8_t c = encode_code(k.bits, k.is_signed, x);
            const double err = std::fabs((double)decode_code(k.bits, k.is_signed, c) - x);
            if (!k.is_signed && x > 0) {
                ASSERT_NE(c, 0) << "a positive v became zero: " << x;
                if (c == 1 && x < decode_code(k.bits, false, 1)) continue;  // rounded up, by rule
            }
            for (int d = 0; d < mags; d++) {
                const float v = decode_code(k.bits, k.is_signed, (uint8_t)d);
                const float s = std::signbit(x) ? -v : v;
                ASSERT_LE(err, std::fabs((double)s - x) * (1 + 1e-5) + 1e-30)
                    << k.bits << " bits: " << x << " is nearer code " << d;
            }
            const double bound = std::max(
                std::fabs(x) * (k.mantissa == 0 ? 1.0 / 3 : std::ldexp(1.0, -k.mantissa - 1)),
                k.sub_abs);
            ASSERT_LE(err, bound * (1 + 1e-6)) << k.bits << " bits, x = " << x;
        }
    }
}

TEST(StateFormat, Bf16RoundsToNearestEvenAndKeepsNaN) {
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f)), 1.0f);
    const float halfway = 1.0f + std::ldexp(1.0f, -8);  // between 1 and 1 + 2^-7: ties to even
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(halfway)), 1.0f);
    const float above = 1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -12);
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(above)), 1.0f + std::ldexp(1.0f, -7));
    EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
    EXPECT_EQ(bf16_to_f32(f32_to_bf16(-INFINITY)), -INFINITY);
}

TEST(StateFormat, MomentBuffersRoundTripWithinTheirBoundsAndAgainExactly) {
    const ParamLayout layout = make_param_layout(formats_model());
    const std::size_t n = layout.total;
    std::vector<float> x = test::gaussian((int64_t)n, 3, 0.02f);
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; i++) v[i] = x[i] * x[i] * (float)(1 + i % 7);
    for (StateFormat f : kStored) {
        for (bool is_signed : {true, false}) {
            const std::vector<float>& src = is_signed ? x : v;
            MomentBuffer m(f, is_signed, layout, 0, n);
            EXPECT_EQ(m.bytes(), MomentBuffer::predicted_bytes(f, layout, 0, n));
            m.write(src.data());
            std::vector<float> once(n), twice(n);
            m.read(once.data());
            m.write(once.data());
            m.read(twice.data());
            EXPECT_EQ(0, std::memcmp(once.data(), twice.data(), n * 4))
                << state_format_name(f) << ": decoding and encoding again changed the state";
            // Each element within its bound: bf16's half unit in the last place, or the map's
            // relative bound, or half a subnormal step of its block's largest value.
            for (const MomentBuffer::Segment& s : m.segments()) {
                const ParamSpec& t = layout.tensors[s.tensor];
                for (std::size_t k = 0; k < std::max<std::size_t>(s.blocks, 1); k++) {
                    const auto [start, len] =
                        s.direct ? std::pair<std::size_t, std::size_t>{0, s.n} : m.block_span(s, k);
                    float big = 0;
                    for (std::size_t i = 0; i < len; i++)
                        big = std::max(big, std::fabs(src[s.begin + start + i]));
                    for (std::size_t i = 0; i < len; i++) {
                        const std::size_t j = s.begin + start + i;
                        const double err = std::fabs((double)once[j] - src[j]);
                        if (s.direct) {
                            ASSERT_EQ(once[j], src[j]) << t.name << " keeps fp32";
                            continue;
                        }
                        double bound = std::ldexp(std::fabs(src[j]), -8);  // bf16
                        if (f != StateFormat::Bf16) {
                            const MapCase c =
                                map_cases()[(f == StateFormat::Int8 ? 0 : 2) + (is_signed ? 0 : 1)];
                            bound = std::max(
                                std::fabs(src[j]) *
                                    (c.mantissa == 0 ? 1.0 / 3 : std::ldexp(1.0, -c.mantissa - 1)),
                                c.sub_abs * big);
                            if (!is_signed && src[j] > 0)
                                bound =
                                    std::max(bound, (double)decode_code(c.bits, false, 1) * big);
                        }
                        ASSERT_LE(err, bound * (1 + 1e-5) + 1e-30)
                            << state_format_name(f) << " " << t.name << "[" << j - t.offset << "]";
                    }
                }
            }
        }
    }
}

TEST(StateFormat, SmallTensorsKeepFp32AndBlocksFollowTheGrid) {
    const ParamLayout layout = make_param_layout(formats_model());
    MomentBuffer m(StateFormat::Int8, true, layout, 0, layout.total);
    for (const MomentBuffer::Segment& s : m.segments()) {
        const ParamSpec& t = layout.tensors[s.tensor];
        EXPECT_EQ(s.direct, t.numel < kKeepFp32Below) << t.name;
        if (s.direct) continue;
        for (std::size_t k = 0; k < s.blocks; k++) {
            const auto [start, len] = m.block_span(s, k);
            const std::size_t flat = t.offset + start;  // whole tensors: begin == offset
            // Each block ends on the 256 grid or where its tensor ends, and starts on it or
            // where its tensor starts.
            EXPECT_TRUE(flat % 256 == 0 || start == 0) << t.name << " block " << k;
            EXPECT_TRUE((flat + len) % 256 == 0 || start + len == s.n) << t.name << " block " << k;
            EXPECT_LE(len, 256u);
        }
    }
    // 4-bit: blocks of 128, each starting on a byte of its own.
    MomentBuffer m4(StateFormat::Int4, false, layout, 0, layout.total);
    EXPECT_EQ(m4.bytes(),
              MomentBuffer::predicted_bytes(StateFormat::Int4, layout, 0, layout.total));
    EXPECT_LT(m4.bytes(), m.bytes());
}

TEST(StateFormat, ANonFiniteValueMakesItsBlockNaN) {
    const ParamLayout layout = make_param_layout(formats_model());
    std::vector<float> x = test::gaussian((int64_t)layout.total, 5);
    const ParamSpec& w = layout.get("h.0.mlp.c_fc.weight");
    x[w.offset + 3] = std::numeric_limits<float>::infinity();
    MomentBuffer m(StateFormat::Int8, true, layout, 0, layout.total);
    m.write(x.data());
    std::vector<float> back(layout.total);
    m.read(back.data());
    EXPECT_TRUE(std::isnan(back[w.offset + 3]));
    EXPECT_TRUE(std::isnan(back[w.offset]));  // the same block: never silently zero
}

// The promise behind ZeRO with compressed moments: shards cut on the grain hold whole blocks, so
// N optimizers over them, fed the same gradients, hold bitwise the parameters and state of one.
TEST(StateFormat, ShardedOptimizersHoldBitwiseTheStateOfOne) {
    const ParamLayout layout = make_param_layout(formats_model());
    const std::size_t n = layout.total;
    for (StateFormat f : kStored) {
        for (const char* name : {"adamw", "sgd"}) {
            OptimConfig cfg;
            cfg.name = name;
            cfg.state_format = state_format_name(f);
            if (f == StateFormat::Int4 && cfg.name == "sgd") continue;  // refused (validate)
            auto one = make_optimizer(cfg, layout);
            std::vector<float> p1 = test::gaussian((int64_t)n, 11, 0.1f);
            for (int N : {2, 3, 4}) {
                const auto shards =
                    dist::grain_shard_ranges(0, (int64_t)n, N, (int64_t)shard_grain(f));
                std::vector<std::unique_ptr<Optimizer>> parts;
                for (const auto& s : shards)
                    parts.push_back(
                        make_optimizer(cfg, layout, (std::size_t)s.offset, (std::size_t)s.count));
                auto ref = make_optimizer(cfg, layout);
                std::vector<float> pr = p1, ps = p1;
                for (int step = 1; step <= 4; step++) {
                    const std::vector<float> g = test::gaussian((int64_t)n, 100 + step, 0.01f);
                    ref->step(pr.data(), g.data(), 1e-2);
                    for (std::size_t r = 0; r < parts.size(); r++)
                        parts[r]->step(ps.data() + shards[r].offset, g.data() + shards[r].offset,
                                       1e-2);
                }
                EXPECT_EQ(0, std::memcmp(pr.data(), ps.data(), n * 4))
                    << name << " " << state_format_name(f) << " at N = " << N;
                for (const std::string& sname : ref->state_names()) {
                    std::vector<float> whole(n), pieces(n);
                    ref->read_state(sname, whole.data());
                    for (std::size_t r = 0; r < parts.size(); r++)
                        parts[r]->read_state(sname, pieces.data() + shards[r].offset);
                    EXPECT_EQ(0, std::memcmp(whole.data(), pieces.data(), n * 4))
                        << name << " " << state_format_name(f) << " " << sname << " at N = " << N;
                }
                std::size_t bytes = 0;
                for (std::size_t r = 0; r < parts.size(); r++) {
                    EXPECT_EQ(parts[r]->state_bytes(),
                              optimizer_state_bytes(cfg, layout, (std::size_t)shards[r].offset,
                                                    (std::size_t)shards[r].count));
                    bytes += parts[r]->state_bytes();
                }
                EXPECT_GE(bytes, ref->state_bytes());  // a block cut by a tensor costs a scale
            }
        }
    }
}

TEST(StateFormat, ARangeThatCutsABlockIsRefused) {
    const ParamLayout layout = make_param_layout(formats_model());
    const ParamSpec& w = layout.get("h.0.mlp.c_fc.weight");
    OptimConfig cfg;
    cfg.state_format = "int8";
    const std::size_t inside = (w.offset / 256 + 1) * 256 + 100;  // mid-block of a big tensor
    ASSERT_LT(inside, w.offset + w.numel);
    EXPECT_THROW(make_optimizer(cfg, layout, inside, layout.total - inside), Error);
    cfg.state_format = "bf16";  // no blocks: any range
    EXPECT_NO_THROW(make_optimizer(cfg, layout, inside, layout.total - inside));
}

// A checkpoint holds the state decoded; written back in pieces (files of another world size)
// and finished, it is bitwise the state that was saved, and the next steps agree bitwise.
TEST(StateFormat, StateWrittenBackInPiecesResumesBitwise) {
    const ParamLayout layout = make_param_layout(formats_model());
    const std::size_t n = layout.total;
    for (StateFormat f : kStored) {
        OptimConfig cfg;
        cfg.state_format = state_format_name(f);
        auto a = make_optimizer(cfg, layout);
        std::vector<float> pa = test::gaussian((int64_t)n, 21, 0.1f);
        for (int step = 1; step <= 3; step++)
            a->step(pa.data(), test::gaussian((int64_t)n, 200 + step, 0.01f).data(), 1e-2);
        auto b = make_optimizer(cfg, layout);
        b->set_steps_taken(a->steps_taken());
        for (const std::string& s : a->state_names()) {
            std::vector<float> saved(n);
            a->read_state(s, saved.data());
            // Two overlapping pieces that cut blocks, as files of another layout would.
            const std::size_t cut = n / 3 + 17;
            b->write_state(s, 0, cut + 50, saved.data());
            b->write_state(s, cut, n - cut, saved.data() + cut);
        }
        b->finish_writes();
        std::vector<float> pb = pa;
        for (int step = 4; step <= 5; step++) {
            const std::vector<float> g = test::gaussian((int64_t)n, 200 + step, 0.01f);
            a->step(pa.data(), g.data(), 1e-2);
            b->step(pb.data(), g.data(), 1e-2);
        }
        EXPECT_EQ(0, std::memcmp(pa.data(), pb.data(), n * 4)) << state_format_name(f);
    }
}

TEST(StateFormat, ConfigRefusesUnknownFormatsAndInt4WithSgd) {
    OptimConfig cfg;
    cfg.state_format = "int3";
    EXPECT_THROW(cfg.validate(), Error);
    cfg.state_format = "int4";
    cfg.name = "sgd";
    try {
        cfg.validate();
        FAIL() << "int4 with SGD was accepted";
    } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("optim.name"), std::string::npos) << e.what();
    }
    cfg.state_format = "int8";
    EXPECT_NO_THROW(cfg.validate());
}

TEST(StateFormat, GrainShardRangesCutOnTheGrainAndBalance) {
    for (int64_t begin : {0, 100, 256}) {
        for (int64_t count : {0, 1, 255, 256, 1000, 70000}) {
            for (int N : {1, 2, 3, 4, 7}) {
                const auto r = dist::grain_shard_ranges(begin, begin + count, N, 256);
                ASSERT_EQ((int)r.size(), N);
                int64_t at = 0;
                for (const auto& s : r) {
                    EXPECT_EQ(s.offset, at);
                    at += s.count;
                    const int64_t end = begin + s.offset + s.count;
                    EXPECT_TRUE(end % 256 == 0 || end == begin + count || s.count == 0);
                }
                EXPECT_EQ(at, count);
                int64_t lo = count, hi = 0;
                for (const auto& s : r) lo = std::min(lo, s.count), hi = std::max(hi, s.count);
                EXPECT_LE(hi - lo, 2 * 256) << begin << " " << count << " " << N;
            }
            const auto plain = dist::grain_shard_ranges(begin, begin + count, 3, 1);
            const auto ref = dist::shard_ranges(count, 3);
            for (int i = 0; i < 3; i++) EXPECT_EQ(plain[i].count, ref[i].count);
        }
    }
}
