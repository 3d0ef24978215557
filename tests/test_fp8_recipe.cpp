// Tests of the FP8 recipe configs (parsing, defaults, round trip, errors naming the key) and
// of delayed scaling: scales against hand-computed amax histories, the zero / NaN / Inf
// rules, and an exact resume from saved state.
#include "tessera/fp8/recipe.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>

#include "tessera/core/error.h"

using namespace tessera;
using namespace tessera::fp8;
using json = nlohmann::json;
using Algo = DelayedScalingConfig::AmaxCompute;

namespace {

// The message of the Error that `f` throws ("" when it throws none).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

DelayedScalingConfig delayed(int len, Algo algo, float margin, Format format = Format::Hybrid) {
  DelayedScalingConfig c;
  c.history_len = len;
  c.amax_compute = algo;
  c.margin = margin;
  c.format = format;
  return c;
}

}  // namespace

// ---- Configs ----------------------------------------------------------------------------

TEST(Fp8Recipe, DefaultsFollowTransformerEngine) {
  const Recipe r = Recipe::from_json({{"recipe", "delayed"}});
  const auto& c = std::get<DelayedScalingConfig>(r.config);
  EXPECT_EQ(c.history_len, 1024);
  EXPECT_EQ(c.amax_compute, Algo::Max);
  EXPECT_EQ(c.margin, 0.0f);
  EXPECT_EQ(c.format, Format::Hybrid);
  const auto b = std::get<BlockScalingConfig>(Recipe::from_json({{"recipe", "block"}}).config);
  EXPECT_EQ(b.format, Format::E4M3);
  EXPECT_TRUE(b.power_of_two_scales);
  EXPECT_EQ(b.activations().block_rows, 1);
  EXPECT_EQ(b.activations().block_cols, 128);
  EXPECT_EQ(b.gradients().block_cols, 128);
  EXPECT_EQ(b.weights().block_rows, 128);
  EXPECT_EQ(b.weights().block_cols, 128);
  EXPECT_FALSE(std::get<CurrentScalingConfig>(Recipe::from_json({{"recipe", "current"}}).config).power_of_two_scales);
  EXPECT_EQ(std::get<Mxfp8Config>(Recipe::from_json({{"recipe", "mxfp8"}}).config).format, Format::E4M3);
}

TEST(Fp8Recipe, FormatsPerRole) {
  EXPECT_EQ(fp8_dtype(Format::Hybrid, Role::Forward), DType::E4M3);
  EXPECT_EQ(fp8_dtype(Format::Hybrid, Role::Gradient), DType::E5M2);
  EXPECT_EQ(fp8_dtype(Format::E4M3, Role::Forward), DType::E4M3);
  EXPECT_EQ(fp8_dtype(Format::E4M3, Role::Gradient), DType::E4M3);
}

TEST(Fp8Recipe, ParsesAndRoundTrips) {
  const json d = {{"recipe", "delayed"}, {"history_len", 16}, {"amax_compute", "most_recent"},
                  {"margin", 1}, {"format", "e4m3"}};
  const Recipe r = Recipe::from_json(d);
  EXPECT_EQ(r.name(), "delayed");
  const auto& c = std::get<DelayedScalingConfig>(r.config);
  EXPECT_EQ(c.history_len, 16);
  EXPECT_EQ(c.amax_compute, Algo::MostRecent);
  EXPECT_EQ(c.margin, 1.0f);
  EXPECT_EQ(c.format, Format::E4M3);
  for (const json& j : {d, json{{"recipe", "current"}, {"margin", 0.5}, {"power_of_two_scales", true}},
                        json{{"recipe", "block"}, {"format", "hybrid"}, {"power_of_two_scales", false}},
                        json{{"recipe", "mxfp8"}, {"format", "hybrid"}}}) {
    const json once = Recipe::from_json(j).to_json();
    EXPECT_EQ(Recipe::from_json(once).to_json(), once) << j.dump();
    for (auto it = j.begin(); it != j.end(); ++it) EXPECT_EQ(once.at(it.key()), it.value()) << it.key();
  }
}

TEST(Fp8Recipe, ErrorsNameTheKey) {
  auto err = [](const json& j) { return error_of([&] { Recipe::from_json(j); }); };
  EXPECT_NE(err({{"history_len", 4}}).find("fp8.recipe is missing"), std::string::npos);
  EXPECT_NE(err({{"recipe", "nvfp4"}}).find("fp8.recipe must be one of delayed, current, block, mxfp8"), std::string::npos);
  // A key of another recipe is unknown here: a typo or a misplaced setting should not pass silently.
  EXPECT_NE(err({{"recipe", "current"}, {"history_len", 4}}).find("unknown key \"fp8.history_len\""), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"amax_compute_algo", "max"}}).find("\"fp8.amax_compute_algo\""), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"history_len", 0}}).find("fp8.history_len"), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"history_len", 2.5}}).find("fp8.history_len"), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"amax_compute", "mean"}}).find("fp8.amax_compute must be one of max, most_recent"), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"margin", "1"}}).find("fp8.margin must be a finite number"), std::string::npos);
  EXPECT_NE(err({{"recipe", "delayed"}, {"format", "e5m2"}}).find("fp8.format must be one of e4m3, hybrid"), std::string::npos);
  EXPECT_NE(err({{"recipe", "block"}, {"power_of_two_scales", 1}}).find("fp8.power_of_two_scales"), std::string::npos);
  EXPECT_NE(err(json::array()).find("fp8 must be a mapping"), std::string::npos);
  EXPECT_NE(error_of([] { Recipe::from_json({{"recipe", "mxfp8"}, {"margin", 0}}, "training.fp8"); })
                .find("\"training.fp8.margin\""),
            std::string::npos);
}

// ---- Delayed scaling --------------------------------------------------------------------

// Two tensors (a forward one, E4M3, and a gradient, E5M2), history_len 4, seven steps.
// Windows after each step (oldest first), tensor 0 / tensor 1:
//   1: {2} / {8}   2: {2,1} / {8,16}   3: {2,1,3} / {8,16,4}   4: {2,1,3,.5} / {8,16,4,2}
//   5: {1,3,.5,.5} / {16,4,2,1}   6: {3,.5,.5,.5} / {4,2,1,1}   7: {.5,.5,.5,.5} / {2,1,1,1}
const float kAmax0[] = {2, 1, 3, 0.5f, 0.5f, 0.5f, 0.5f};
const float kAmax1[] = {8, 16, 4, 2, 1, 1, 1};
const float kMaxWindow0[] = {2, 2, 3, 3, 3, 3, 0.5f};
const float kMaxWindow1[] = {8, 16, 16, 16, 16, 4, 2};

TEST(DelayedScaling, HandComputedHistories) {
  for (Algo algo : {Algo::Max, Algo::MostRecent}) {
    for (float margin : {0.0f, 1.0f}) {
      DelayedScalingState st(delayed(4, algo, margin), {Role::Forward, Role::Gradient});
      EXPECT_EQ(st.dtype(0), DType::E4M3);
      EXPECT_EQ(st.dtype(1), DType::E5M2);
      EXPECT_EQ(st.scale(0), 1.0f);  // nothing recorded yet
      const float div = margin == 0 ? 1.0f : 2.0f;
      for (int step = 0; step < 7; ++step) {
        st.record(0, kAmax0[step]);
        st.record(1, kAmax1[step]);
        EXPECT_EQ(st.history(0, 0), kAmax0[step]);
        st.update();
        const float a0 = algo == Algo::Max ? kMaxWindow0[step] : kAmax0[step];
        const float a1 = algo == Algo::Max ? kMaxWindow1[step] : kAmax1[step];
        SCOPED_TRACE(::testing::Message() << "step " << step << " margin " << margin << " max " << (algo == Algo::Max));
        EXPECT_EQ(st.scale(0), 448.0f / a0 / div);
        EXPECT_EQ(st.scale(1), 57344.0f / a1 / div);
        EXPECT_EQ(st.scale_inv(0), 1.0f / st.scale(0));
        EXPECT_EQ(st.scale_inv(1), 1.0f / st.scale(1));
        EXPECT_EQ(st.history(0, 0), 0.0f);  // the new step's slot starts empty
        EXPECT_EQ(st.history(0, 1), kAmax0[step]);
      }
    }
  }
  // Format E4M3: gradients use E4M3 as well.
  DelayedScalingState e4(delayed(4, Algo::Max, 0, Format::E4M3), {Role::Gradient});
  e4.record(0, 7.0f);
  e4.update();
  EXPECT_EQ(e4.scale(0), 448.0f / 7.0f);
}

TEST(DelayedScaling, RecordKeepsTheLargestAmaxOfTheStep) {
  DelayedScalingState st(delayed(4, Algo::MostRecent, 0), {Role::Forward});
  st.record(0, 2.0f);
  st.record(0, 7.0f);
  st.record(0, 3.0f);
  st.update();
  EXPECT_EQ(st.scale(0), 64.0f);
}

TEST(DelayedScaling, ZeroNanAndInfKeepThePreviousScale) {
  for (Algo algo : {Algo::Max, Algo::MostRecent}) {
    DelayedScalingState st(delayed(2, algo, 0), {Role::Forward});
    st.update();  // no amax at all: the initial scale 1 stays
    EXPECT_EQ(st.scale(0), 1.0f);
    st.record(0, 0.0f);
    st.update();
    EXPECT_EQ(st.scale(0), 1.0f);
    st.record(0, 4.0f);
    st.update();
    EXPECT_EQ(st.scale(0), 112.0f);
    // A step without record (amax 0): max still sees the 4; most_recent keeps the scale.
    st.update();
    EXPECT_EQ(st.scale(0), 112.0f);
    // NaN: max skips it (the window {0, NaN} has no usable value), most_recent keeps the scale.
    st.record(0, NAN);
    st.record(0, 8.0f);  // NaN is sticky within the step
    EXPECT_TRUE(std::isnan(st.history(0, 0)));
    st.update();
    EXPECT_EQ(st.scale(0), 112.0f);
    st.record(0, 16.0f);
    st.update();  // window {NaN, 16}: max ignores NaN
    EXPECT_EQ(st.scale(0), 28.0f);
    // Inf keeps the previous scale for as long as it is in the window (max), one step (most_recent).
    st.record(0, INFINITY);
    st.update();
    EXPECT_EQ(st.scale(0), 28.0f);
    st.record(0, 2.0f);
    st.update();  // window {Inf, 2}
    EXPECT_EQ(st.scale(0), algo == Algo::Max ? 28.0f : 224.0f);
    st.record(0, 2.0f);
    st.update();  // window {2, 2}
    EXPECT_EQ(st.scale(0), 224.0f);
  }
  // A tiny amax gives FLT_MAX, not infinity (fp8_scale_from_amax's overflow rule).
  DelayedScalingState tiny(delayed(1, Algo::Max, 0), {Role::Forward});
  tiny.record(0, 1e-44f);
  tiny.update();
  EXPECT_EQ(tiny.scale(0), FLT_MAX);
}

TEST(DelayedScaling, ResumeFromStateIsExact) {
  const std::vector<Role> roles = {Role::Forward, Role::Gradient, Role::Forward};
  auto amax = [](int step, int i) { return std::ldexp(1.0f + 0.37f * static_cast<float>((step * 7 + i * 3) % 11), (step % 5) - 2); };
  DelayedScalingState a(delayed(5, Algo::Max, 1), roles);
  for (int step = 0; step < 8; ++step) {  // past one wrap of the ring
    for (int i = 0; i < 3; ++i) a.record(i, amax(step, i));
    a.update();
  }
  a.record(1, 3.0f);  // a half-recorded step is part of the state too
  const auto saved = a.state_dict("layer0.fp8.");
  EXPECT_EQ(saved.size(), 4u);
  DelayedScalingState b(delayed(5, Algo::Max, 1), roles);
  b.load_state_dict(saved, "layer0.fp8.");
  for (int step = 8; step < 20; ++step) {
    for (int i = 0; i < 3; ++i) {
      a.record(i, amax(step, i));
      b.record(i, amax(step, i));
    }
    a.update();
    b.update();
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(a.scale(i), b.scale(i)) << "step " << step << " tensor " << i;
      EXPECT_EQ(a.scale_inv(i), b.scale_inv(i));
    }
  }

  // Mismatched state is refused with the tensor's name, and leaves the state untouched.
  DelayedScalingState shorter(delayed(4, Algo::Max, 1), roles);
  EXPECT_NE(error_of([&] { shorter.load_state_dict(saved, "layer0.fp8."); }).find("'layer0.fp8.amax_history'"),
            std::string::npos);
  EXPECT_EQ(shorter.scale(0), 1.0f);
  EXPECT_NE(error_of([&] { b.load_state_dict(saved, "other."); }).find("lacks tensor 'other.amax_history'"),
            std::string::npos);
  DelayedScalingState st(delayed(2, Algo::Max, 0), {Role::Forward});
  EXPECT_THROW(st.record(1, 1.0f), Error);
  EXPECT_THROW(st.history(0, 2), Error);
}
