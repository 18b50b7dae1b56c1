// The quantized frozen base (quant/quantized_store.h): every decoded block is bitwise
// quant::dequantize of its matrices, a model on it computes what a model on the dequantized fp32
// weights computes, the bytes allocated are the predicted bytes, and decoded blocks are reused.
#include "quant/quantized_store.h"

#include <gtest/gtest.h>

#include <cstring>

#include "core/error.h"
#include "io/hf_weights.h"
#include "model/gpt.h"
#include "test_util.h"

namespace memtrain::quant {
namespace {

// Widths that every group and NF4 block of 64 (and int4's group 32) divide.
ModelConfig gpt2_config() {
    ModelConfig c = test::tiny_model(3);
    c.n_head = 4;
    c.n_embd = 64;  // MLP hidden 256
    return c;
}

ModelConfig llama_config() {
    ModelConfig c = gpt2_config();
    c.n_kv_head = 2;
    c.norm = "rmsnorm";
    c.activation = "swiglu";
    c.positions = "rope";
    c.tied_embeddings = false;
    c.bias = false;
    c.ffn_hidden = 128;
    c.norm_eps = 1e-6;
    return c;
}

std::vector<BaseQuant> formats() {
    return {parse_base_quant("int8"), parse_base_quant("int4"), parse_base_quant("int4", 32),
            parse_base_quant("nf4")};
}

std::size_t param_bytes() {
    return host_memory().snapshot()[MemCategory::Parameters];
}
std::size_t workspace_bytes() {
    return host_memory().snapshot()[MemCategory::Workspace];
}

// (in, out) -> (out, in) and back.
std::vector<float> transpose(const float* x, int64_t rows, int64_t cols) {
    std::vector<float> t((std::size_t)(rows * cols));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) t[(std::size_t)(c * rows + r)] = x[r * cols + c];
    return t;
}

// Quantizes memtrain (in, out) tensor t of `params` as the store must: quant::quantize of the
// (out, in) matrix.
Result reference_quantization(const BaseQuant& q, const ParamSpec& t, const float* params) {
    const int64_t in = t.shape[0], out = t.shape[1];
    const std::vector<float> w = transpose(params + t.offset, in, out);
    return quantize(q.options(), {w.data(), out, in});
}

// Every parameter as the quantized base holds it: its matrices quant::dequantize'd (back to
// (in, out)), the rest as given.
std::vector<float> dequantized_params(const BaseQuant& q, const ParamLayout& layout,
                                      const float* params) {
    std::vector<float> all(params, params + layout.total);
    for (const ParamSpec& t : layout.tensors) {
        if (!is_packed_matrix(t)) continue;
        const Result r = reference_quantization(q, t, params);
        const std::vector<float> d = dequantize(r);
        const std::vector<float> back = transpose(d.data(), r.rows, r.cols);
        std::copy(back.begin(), back.end(), all.begin() + (std::ptrdiff_t)t.offset);
    }
    return all;
}

// The exact packed bytes of an m x n matrix (m outputs, n inputs).
std::size_t matrix_bytes(const BaseQuant& q, std::size_t m, std::size_t n) {
    const std::size_t g = (std::size_t)q.group;
    switch (q.format) {
        case BaseFormat::Int8:
            return m * n + 2 * m;
        case BaseFormat::Int4:
            return m * n / 2 + 2 * m * n / g;
        case BaseFormat::Nf4:
            return m * n / 2 + m * n / g + 4 * ((m * n / g + 255) / 256);
    }
    return 0;
}

class QuantizedStore : public ::testing::TestWithParam<bool> {
  protected:
    ModelConfig config() const { return GetParam() ? llama_config() : gpt2_config(); }
};

TEST_P(QuantizedStore, DecodesExactlyWhatDequantizeGives) {
    const ModelConfig cfg = config();
    GPT full(cfg);
    full.init_weights(7);
    const ParamLayout& layout = full.layout();
    for (const BaseQuant& q : formats()) {
        SCOPED_TRACE(q.name());
        QuantizedParamStore store(full.weights(), q);
        int matrices = 0;
        for (int u = 0; u < (int)layout.units.size(); u++) {
            const ParamUnit& unit = layout.units[(std::size_t)u];
            const float* got = store.acquire(u);
            for (std::size_t i = unit.first_tensor; i < unit.last_tensor; i++) {
                const ParamSpec& t = layout.tensors[i];
                const float* mine = got + (t.offset - unit.begin);
                if (!is_packed_matrix(t)) {
                    EXPECT_EQ(std::memcmp(mine, full.params() + t.offset, 4 * t.numel), 0)
                        << t.name;
                    continue;
                }
                matrices++;
                const Result ref = reference_quantization(q, t, full.params());
                const Result kept = store.stored(t.name);
                ASSERT_EQ(kept.parts.size(), ref.parts.size()) << t.name;
                for (std::size_t p = 0; p < ref.parts.size(); p++) {
                    EXPECT_EQ(kept.parts[p].name, ref.parts[p].name) << t.name;
                    EXPECT_EQ(kept.parts[p].shape, ref.parts[p].shape) << t.name;
                    EXPECT_EQ(kept.parts[p].bytes, ref.parts[p].bytes) << t.name;
                }
                EXPECT_EQ(kept.stored_bits(), 8 * matrix_bytes(q, ref.rows, ref.cols)) << t.name;
                const std::vector<float> d = dequantize(ref);
                EXPECT_EQ(dequantize(kept), d) << t.name;
                const std::vector<float> back = transpose(d.data(), ref.rows, ref.cols);
                EXPECT_EQ(std::memcmp(mine, back.data(), 4 * t.numel), 0) << t.name;
            }
            store.release(u);
        }
        EXPECT_EQ(matrices, 4 * cfg.n_layer);
    }
}

TEST_P(QuantizedStore, ModelMatchesTheDequantizedFp32Model) {
    const ModelConfig cfg = config();
    GPT full(cfg);
    full.init_weights(3);
    const int B = 2, T = cfg.block_size;
    const auto x = test::random_tokens(B * T, cfg.vocab_size, 11);
    const auto y = test::random_tokens(B * T, cfg.vocab_size, 12);
    for (const BaseQuant& q : formats()) {
        SCOPED_TRACE(q.name());
        QuantizedParamStore store(full.weights(), q);
        GPT quantized(cfg, &store);
        GPT reference(cfg);
        const std::vector<float> d = dequantized_params(q, full.layout(), full.params());
        std::copy(d.begin(), d.end(), reference.params());
        const float loss = quantized.forward_loss(x.data(), y.data(), B, T);
        EXPECT_EQ(loss, reference.forward_loss(x.data(), y.data(), B, T));
        // Quantization moved the weights, so the loss moved too, but not far.
        const float exact = full.forward_loss(x.data(), y.data(), B, T);
        EXPECT_NE(loss, exact);
        EXPECT_NEAR(loss, exact, 0.05);
        const std::size_t V = (std::size_t)cfg.vocab_size;
        std::vector<float> a(B * T * V), b(B * T * V);
        quantized.forward_logits(x.data(), B, T, a.data());
        reference.forward_logits(x.data(), B, T, b.data());
        EXPECT_EQ(a, b);
    }
}

TEST_P(QuantizedStore, AllocatesThePredictedBytes) {
    const ModelConfig cfg = config();
    GPT full(cfg);
    full.init_weights(5);
    const ParamLayout& layout = full.layout();
    std::size_t weights = 0, other = 0, block_floats = layout.units[1].size();
    for (const ParamSpec& t : layout.tensors) (is_packed_matrix(t) ? weights : other) += t.numel;
    for (const BaseQuant& q : formats()) {
        SCOPED_TRACE(q.name());
        const BaseBytes predicted = QuantizedParamStore::predicted_bytes(cfg, q);
        std::size_t exact = 0;
        for (const ParamSpec& t : layout.tensors)
            if (is_packed_matrix(t))
                exact += matrix_bytes(q, (std::size_t)t.shape[1], (std::size_t)t.shape[0]);
        EXPECT_EQ(predicted.packed, exact);
        EXPECT_EQ(predicted.fp32, 4 * other);
        EXPECT_EQ(predicted.slots, 2 * 4 * block_floats);

        const std::size_t p0 = param_bytes(), w0 = workspace_bytes();
        {
            QuantizedParamStore store(full.weights(), q);
            EXPECT_EQ(param_bytes() - p0, predicted.params());
            EXPECT_EQ(workspace_bytes() - w0, predicted.slots);
            const BaseBytes measured = store.bytes();
            EXPECT_EQ(measured.packed, predicted.packed);
            EXPECT_EQ(measured.fp32, predicted.fp32);
            EXPECT_EQ(measured.slots, predicted.slots);
            EXPECT_NE(store.summary().find("decode slots"), std::string::npos);
        }
        EXPECT_EQ(param_bytes(), p0);
        EXPECT_EQ(workspace_bytes(), w0);
        // Bits per packed weight: 8 + 16 / n, 4 + 16 / G, 4 + 8 / 64 + a scale per 256 blocks.
        const double bpw = 8.0 * (double)predicted.packed / (double)weights;
        if (q.format == BaseFormat::Int8) {
            EXPECT_GT(bpw, 8.0);
            EXPECT_LT(bpw, 8.0 + 16.0 / 64);
        } else if (q.format == BaseFormat::Int4) {
            EXPECT_DOUBLE_EQ(bpw, 4.0 + 16.0 / q.group);
        } else {
            EXPECT_GT(bpw, 4.125);
            EXPECT_LT(bpw, 4.135);
        }
        EXPECT_LT(predicted.params(), 4 * layout.total);
    }
    // int8 of one m x n matrix: m n + 2 m bytes exactly.
    QuantizedParamStore int8(full.weights(), parse_base_quant("int8"));
    const ParamSpec& fc = layout.get("h.0.mlp.c_fc.weight");
    const std::size_t n = (std::size_t)fc.shape[0], m = (std::size_t)fc.shape[1];
    EXPECT_EQ(int8.stored("h.0.mlp.c_fc.weight").stored_bits(), 8 * (m * n + 2 * m));
}

INSTANTIATE_TEST_SUITE_P(Models, QuantizedStore, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Llama" : "Gpt2"; });

TEST(QuantizedStoreCache, DecodesABlockOnceWhileItStaysInASlot) {
    const ModelConfig cfg = gpt2_config();  // 3 blocks, units 1..3
    GPT full(cfg);
    full.init_weights(1);
    QuantizedParamStore store(full.weights(), parse_base_quant("nf4"));
    float* a = store.acquire(1);
    EXPECT_EQ(store.acquire(1), a);  // nested: the same floats
    store.release(1);
    store.release(1);
    EXPECT_EQ(store.acquire(1), a);  // released but still in its slot
    store.release(1);
    EXPECT_EQ(store.stats().decodes, 1u);
    EXPECT_EQ(store.stats().acquires, 3u);
    // The embedding and head are fp32 as stored: no slot, no decode.
    store.acquire(0);
    store.acquire(cfg.n_layer + 1);
    store.release(cfg.n_layer + 1);
    store.release(0);
    EXPECT_EQ(store.stats().decodes, 1u);
    // Two slots: block 2 takes the free one, block 3 evicts the least recently used (block 1).
    store.acquire(2);
    store.release(2);
    store.acquire(3);
    store.release(3);
    EXPECT_EQ(store.stats().decodes, 3u);
    store.acquire(2);
    store.release(2);
    EXPECT_EQ(store.stats().decodes, 3u);
    store.acquire(1);
    store.release(1);
    EXPECT_EQ(store.stats().decodes, 4u);
    // Slots holding acquired blocks are never evicted.
    store.acquire(1);
    store.acquire(2);
    EXPECT_THROW(store.acquire(3), Error);
    store.release(2);
    store.acquire(3);
    store.release(3);
    store.release(1);
    // A forward pass decodes every block and leaves the last two decoded, where a backward (which
    // starts from the end) finds them.
    QuantizedParamStore fresh(full.weights(), parse_base_quant("nf4"));
    const auto x = test::random_tokens(8, cfg.vocab_size, 2);
    GPT model(cfg, &fresh);
    model.forward_loss(x.data(), x.data(), 1, 8);
    EXPECT_EQ(fresh.stats().decodes, 3u);
    fresh.acquire(3);
    fresh.acquire(2);
    fresh.release(2);
    fresh.release(3);
    EXPECT_EQ(fresh.stats().decodes, 3u);
    model.forward_loss(x.data(), x.data(), 1, 8);  // 1 evicts 3, 2 hits, 3 evicts 1
    EXPECT_EQ(fresh.stats().decodes, 5u);
    EXPECT_EQ(fresh.stats().acquires, 8u);
}

TEST(QuantizedStoreCache, ALoadedUnitIsDecodedAgain) {
    const ModelConfig cfg = gpt2_config();
    GPT full(cfg);
    full.init_weights(1);
    QuantizedParamStore store(full.weights(), parse_base_quant("int8"));
    const float* before = store.acquire(1);
    const float first = before[0];
    store.release(1);
    const ParamUnit& unit = full.layout().units[1];
    std::vector<float> values(full.params() + unit.begin, full.params() + unit.end);
    values[0] += 1.0f;  // ln_1.weight[0], kept fp32
    store.load_unit(1, values.data());
    EXPECT_EQ(store.acquire(1)[0], first + 1.0f);
    EXPECT_THROW(store.load_unit(1, values.data()), Error);  // acquired
    store.release(1);
    EXPECT_EQ(store.stats().decodes, 2u);
}

TEST(QuantizedStoreFrozen, RefusesWritesAndGradients) {
    const ModelConfig cfg = gpt2_config();
    GPT full(cfg);
    full.init_weights(1);
    QuantizedParamStore store(full.weights(), parse_base_quant("int4"));
    for (int u : {0, 1}) {
        try {
            store.acquire(u, true);
            ADD_FAILURE() << "acquire for writing of unit " << u;
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("frozen"), std::string::npos) << e.what();
        }
    }
    EXPECT_THROW(store.unit_grads(1), Error);
    EXPECT_THROW(store.release(1), Error);  // never acquired
    EXPECT_THROW(store.acquire(cfg.n_layer + 2), Error);
    EXPECT_EQ(store.full_params(), nullptr);
    EXPECT_EQ(store.full_grads(), nullptr);
    store.zero_grads();
    store.grads_done(1);
    // A model on it evaluates but cannot train.
    GPT model(cfg, &store);
    const auto x = test::random_tokens(8, cfg.vocab_size, 2);
    EXPECT_THROW(model.forward_backward(x.data(), x.data(), 1, 8, 1.0f / 8), Error);
}

TEST(QuantizedStoreWriter, LoadsUnitByUnitAsTheSourceConstructorDoes) {
    const ModelConfig cfg = llama_config();
    GPT full(cfg);
    full.init_weights(9);
    const BaseQuant q = parse_base_quant("nf4");
    QuantizedParamStore from_source(full.weights(), q);
    // Initialisation and a Hugging Face import, each written through the writer.
    const std::string dir = test::temp_dir("quantized_store_writer");
    save_hf_weights(full.weights(), dir + "/model.safetensors");
    QuantizedParamStore initialised(cfg, q), imported(cfg, q);
    {
        QuantizedStoreWriter writer(initialised);
        init_gpt2_weights(writer.weights(), 9);
        EXPECT_THROW(writer.acquire(0), Error);  // write-only
    }
    {
        QuantizedStoreWriter writer(imported);
        load_hf_weights(writer.weights(), dir);
    }
    const ParamLayout& layout = from_source.layout();
    for (QuantizedParamStore* loaded : {&initialised, &imported})
        for (int u = 0; u < (int)layout.units.size(); u++) {
            const std::size_t n = layout.units[(std::size_t)u].size();
            EXPECT_EQ(std::memcmp(loaded->acquire(u), from_source.acquire(u), 4 * n), 0) << u;
            loaded->release(u);
            from_source.release(u);
        }
}

TEST(QuantizedStoreFormat, ParsesNamesAndRefusesBadOnes) {
    EXPECT_EQ(parse_base_quant("int8").format, BaseFormat::Int8);
    EXPECT_EQ(parse_base_quant("int8").group, 0);
    EXPECT_EQ(parse_base_quant("int4").group, 64);
    EXPECT_EQ(parse_base_quant("int4", 128).group, 128);
    EXPECT_EQ(parse_base_quant("nf4").format, BaseFormat::Nf4);
    EXPECT_EQ(parse_base_quant("nf4").options().method, "nf4-dq");
    auto message = [](auto f) -> std::string {
        try {
            f();
        } catch (const Error& e) {
            return e.what();
        }
        return "";
    };
    const std::string unknown = message([] { parse_base_quant("int3"); });
    EXPECT_NE(unknown.find("'int3'"), std::string::npos) << unknown;
    EXPECT_NE(unknown.find("int8, int4 or nf4"), std::string::npos) << unknown;
    EXPECT_EQ(unknown.find('\n'), std::string::npos);
    EXPECT_NE(message([] { parse_base_quant("NF4"); }), "");
    EXPECT_NE(message([] { parse_base_quant("int8", 64); }).find("int8"), std::string::npos);
    EXPECT_NE(message([] { parse_base_quant("int4", -1); }).find("-1"), std::string::npos);
    // A group must divide the input width of every matrix (n_embd 64, MLP hidden 256).
    const ModelConfig cfg = gpt2_config();
    const std::string bad =
        message([&] { QuantizedParamStore::predicted_bytes(cfg, parse_base_quant("int4", 48)); });
    EXPECT_NE(bad.find("48"), std::string::npos) << bad;
    EXPECT_NE(bad.find("64"), std::string::npos) << bad;
    EXPECT_THROW((QuantizedParamStore{cfg, parse_base_quant("nf4", 128)}), Error);
}

}  // namespace
}  // namespace memtrain::quant
