// train.diagnostics = amp: the log2 histograms count exactly, their fp16/bf16 fractions follow,
// and a run logs them (every value of every gradient counted) and says what they suggest.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/log2_histogram.h"
#include "io/run_report.h"
#include "io/text_file.h"
#include "model/gpt.h"
#include "test_util.h"
#include "train/trainer.h"

namespace memtrain {

TEST(Log2Histogram, CountsEveryExponentExactly) {
    const float sub = std::numeric_limits<float>::denorm_min();  // 2^-149
    const std::vector<float> x{0.0f,     -0.0f,    1.0f,     1.5f,     1.999f,  2.0f,
                               -3.0f,    0.25f,    0x1p-30f, sub,      3 * sub, 0x1p-127f,
                               65504.0f, 65536.0f, 0x1p100f, INFINITY, NAN};
    Log2Histogram h;
    h.add(x.data(), x.size());
    EXPECT_EQ(h.total, 17);
    EXPECT_EQ(h.zeros, 2);
    EXPECT_EQ(h.nonfinite, 2);
    EXPECT_EQ(h.at(0), 3) << "1, 1.5, 1.999";
    EXPECT_EQ(h.at(1), 2) << "2, -3";
    EXPECT_EQ(h.at(-2), 1);
    EXPECT_EQ(h.at(-30), 1);
    EXPECT_EQ(h.at(-149), 1) << "the smallest subnormal";
    EXPECT_EQ(h.at(-148), 1) << "3 x 2^-149";
    EXPECT_EQ(h.at(-127), 1) << "a subnormal's exponent from its top bit";
    EXPECT_EQ(h.at(15), 1) << "65504";
    EXPECT_EQ(h.at(16), 1);
    EXPECT_EQ(h.at(100), 1);
    EXPECT_EQ(h.max_exp(), 100);
    EXPECT_EQ(h.min_exp(), -149);
    EXPECT_EQ(Log2Histogram{}.min_exp(), Log2Histogram::kMaxExp + 1) << "none";
    EXPECT_EQ(h.below(-24), 4);
    EXPECT_EQ(h.at_or_above(16), 2);

    const PrecisionLoss p = precision_loss(h, 0);
    EXPECT_DOUBLE_EQ(p.zero, 2.0 / 17);
    EXPECT_DOUBLE_EQ(p.fp16_underflow, 4.0 / 17) << "2^-30 and the subnormals";
    EXPECT_DOUBLE_EQ(p.fp16_overflow, 2.0 / 17) << "2^16 and 2^100 (65504 fits)";
    EXPECT_DOUBLE_EQ(p.bf16_underflow, 2.0 / 17)
        << "below 2^-133: 2^-149 and 3 x 2^-149 (2^-127 is a bf16 subnormal too)";
    // Scaled by 2^10: 2^-30 becomes 2^-20 (kept), 2^15 and 2^16 overflow ... and 2^100.
    const PrecisionLoss q = precision_loss(h, 10);
    EXPECT_DOUBLE_EQ(q.fp16_underflow, 3.0 / 17);
    EXPECT_DOUBLE_EQ(q.fp16_overflow, 3.0 / 17);
    EXPECT_EQ(largest_safe_scale_log2(h), -85) << "2^100 x 2^-85 = 2^15 fits";
    Log2Histogram small;
    const float v[] = {0.5f, 0.01f};
    small.add(v, 2);
    EXPECT_EQ(largest_safe_scale_log2(small), 16) << "2^-1 x 2^16 = 2^15";
    Log2Histogram m = small;
    m.merge(h);
    EXPECT_EQ(m.total, 19);
    EXPECT_EQ(m.at(-1), 1);
}

// A run with diagnostics logs an amp line at its first step and every diagnostics_every steps;
// each counts every gradient value of the model, and the report draws them.
TEST(AmpDiagnostics, ARunLogsEveryGradientValueAndTheReportDrawsThem) {
    RunConfig c = test::tiny_run(test::temp_dir("amp_diag"), 10);
    c.train.diagnostics = "amp";
    c.train.diagnostics_every = 5;
    Trainer t(c, test::quiet());
    const std::size_t params = t.params().size();
    t.run();
    const std::string log = io::read_text_file(c.io.out_dir + "/metrics.jsonl");
    std::vector<int64_t> steps;
    std::istringstream in(log);
    for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j.value("event", "") != "amp") continue;
        steps.push_back(j["step"].get<int64_t>());
        EXPECT_EQ(j["values"].get<int64_t>(), (int64_t)params);
        int64_t sum = j["zeros"].get<int64_t>() + j["nonfinite"].get<int64_t>();
        for (const auto& n : j["log2_counts"]) sum += n.get<int64_t>();
        EXPECT_EQ(sum, (int64_t)params) << "every value in one bin";
        int64_t per_tensor = 0;
        for (const auto& tj : j["tensors"]) per_tensor += tj["values"].get<int64_t>();
        EXPECT_EQ(per_tensor, (int64_t)params);
        EXPECT_EQ(j["loss_scale_log2"].get<int>(), 16);
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 5, 10}));
    const io::RunMetrics m = io::parse_metrics(log, "metrics.jsonl");
    ASSERT_EQ(m.amp.size(), 3u);
    io::ReportInput in_report;
    in_report.run_dir = c.io.out_dir;
    in_report.metrics = m;
    const std::string html = io::render_report_html(in_report);
    EXPECT_NE(html.find("id=\"chart-amp\""), std::string::npos);
    EXPECT_NE(html.find("fp16 overflows from 2^0 at loss scale 2^16"), std::string::npos);
}

// The activation histograms count exactly what the step made: the last block's output (the
// stage output) and the first block's input gradient (left in stage_grad), value for value, and
// B x T x C values per block; an evaluation pass counts nothing.
TEST(AmpDiagnostics, ActivationsAndTheirGradientsAreCountedExactly) {
    const ModelConfig cfg = test::tiny_model(2);
    GPT m(cfg);
    m.init_weights(5);
    const int B = 2, T = 8;
    std::vector<int32_t> x(B * T), y(B * T);
    for (int i = 0; i < B * T; i++) {
        x[i] = (7 * i + 3) % cfg.vocab_size;
        y[i] = (5 * i + 1) % cfg.vocab_size;
    }
    ActivationHistograms h;
    m.set_activation_histograms(&h);
    m.forward_loss(x.data(), y.data(), B, T);  // evaluation: not counted
    for (const auto& v : h.outputs) EXPECT_EQ(v.total, 0);
    m.forward_backward(x.data(), y.data(), B, T, 1.0f / (B * T));
    m.set_activation_histograms(nullptr);
    const std::size_t n = (std::size_t)B * T * cfg.n_embd;
    ASSERT_EQ(h.outputs.size(), 2u);
    ASSERT_EQ(h.input_grads.size(), 2u);
    for (int l = 0; l < 2; l++) {
        EXPECT_EQ(h.outputs[l].total, (int64_t)n);
        EXPECT_EQ(h.input_grads[l].total, (int64_t)n);
    }
    Log2Histogram out, grad;
    out.add(m.stage_output(0), n);
    grad.add(m.stage_grad(), n);
    EXPECT_EQ(h.outputs[1].bins, out.bins);
    EXPECT_EQ(h.outputs[1].zeros, out.zeros);
    EXPECT_EQ(h.input_grads[0].bins, grad.bins);
    EXPECT_EQ(h.input_grads[0].zeros, grad.zeros);
    EXPECT_GT(grad.total - grad.zeros, 0);
}

// A run logs the activation histograms beside the gradients' at the same steps, and the report
// draws the activation gradients (the lecture's Figure 5).
TEST(AmpDiagnostics, ARunLogsActivationHistogramsAndTheReportDrawsThem) {
    RunConfig c = test::tiny_run(test::temp_dir("amp_diag_act"), 6);
    c.train.diagnostics = "amp";
    c.train.diagnostics_every = 5;
    Trainer t(c, test::quiet());
    t.run();
    const std::string log = io::read_text_file(c.io.out_dir + "/metrics.jsonl");
    const int64_t per_block =
        (int64_t)c.micro_batch() * c.train.seq_len * c.model.n_embd * c.accum_steps();
    std::vector<int64_t> steps;
    std::istringstream in(log);
    for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line);
        if (j.value("event", "") != "amp_activations") continue;
        steps.push_back(j["step"].get<int64_t>());
        for (const char* kind : {"activations", "activation_grads"}) {
            const auto& a = j[kind];
            EXPECT_EQ(a["values"].get<int64_t>(), per_block * c.model.n_layer) << kind;
            int64_t sum = a["zeros"].get<int64_t>() + a["nonfinite"].get<int64_t>();
            for (const auto& v : a["log2_counts"]) sum += v.get<int64_t>();
            EXPECT_EQ(sum, a["values"].get<int64_t>()) << kind;
        }
        EXPECT_EQ(j["tensors"].size(), 2u * c.model.n_layer);
    }
    EXPECT_EQ(steps, (std::vector<int64_t>{1, 5}));
    const io::RunMetrics m = io::parse_metrics(log, "metrics.jsonl");
    ASSERT_EQ(m.amp_activation_grads.size(), 2u);
    EXPECT_EQ(m.steps.size(), 6u);  // the amp lines are not steps
    io::ReportInput in_report;
    in_report.run_dir = c.io.out_dir;
    in_report.metrics = m;
    const std::string html = io::render_report_html(in_report);
    EXPECT_NE(html.find("id=\"chart-amp-activation-grads\""), std::string::npos);
}

}  // namespace memtrain
