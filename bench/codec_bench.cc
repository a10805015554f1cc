// The REST response encoding (runtime/json_codec.h) against the way it was done before, in
// the same run: a JSON document built element by element and dumped, floats held as doubles.
//   BM_EncodeJson/N          EncodeJsonInferResponse of one FP32 output of N elements.
//   BM_EncodeJsonDocument/N  the same response as a document (the baseline).
// N: 64 (the demo encoder's pooled embedding), 1024 (one bge-m3 dense embedding), 16384 (a
// batch of 16 of them). Values: uniform in [-1, 1], as embeddings are.
//   BM_DecodeJson/L          DecodeJsonInferRequest of an encoder request: token ids and an
//                            attention mask of L tokens each (16, 512, 8192), as clients send it.
//   BM_ParseJsonDocument/L   json::parse of the same body, for scale (nothing decoded).

#include <benchmark/benchmark.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "runtime/json_codec.h"
#include "runtime/tensor.h"

namespace kiln {
namespace {

InferResponse Response(int64_t n) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& f : v) f = value(rng);
  InferResponse r;
  r.model_name = "encoder";
  r.model_version = "2";
  r.id = "bench";
  Tensor t;
  t.name = "embedding";
  t.dtype = DataType::kFp32;
  t.shape = {1, n};
  t.data.assign(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
  r.outputs.push_back(std::move(t));
  return r;
}

void BM_EncodeJson(benchmark::State& state) {
  const InferResponse r = Response(state.range(0));
  size_t bytes = 0;
  for (auto _ : state) {
    std::string out = EncodeJsonInferResponse(r, nullptr);
    bytes = out.size();
    benchmark::DoNotOptimize(out);
  }
  state.counters["bytes"] = static_cast<double>(bytes);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// The baseline: the response as a JSON document, each float as a double value, dumped.
void BM_EncodeJsonDocument(benchmark::State& state) {
  const InferResponse r = Response(state.range(0));
  size_t bytes = 0;
  for (auto _ : state) {
    nlohmann::json out = nlohmann::json::object();
    out["model_name"] = r.model_name;
    out["model_version"] = r.model_version;
    out["id"] = r.id;
    nlohmann::json outputs = nlohmann::json::array();
    for (const Tensor& t : r.outputs) {
      nlohmann::json o = nlohmann::json::object();
      o["name"] = t.name;
      o["datatype"] = "FP32";
      o["shape"] = t.shape;
      nlohmann::json data = nlohmann::json::array();
      auto& arr = data.get_ref<nlohmann::json::array_t&>();
      const auto* f = reinterpret_cast<const float*>(t.data.data());
      const size_t n = t.data.size() / sizeof(float);
      arr.reserve(n);
      for (size_t i = 0; i < n; ++i) {
        if (std::isfinite(f[i])) {
          arr.emplace_back(f[i]);
        } else {
          arr.emplace_back(nullptr);
        }
      }
      o["data"] = std::move(data);
      outputs.push_back(std::move(o));
    }
    out["outputs"] = std::move(outputs);
    std::string text = out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    bytes = text.size();
    benchmark::DoNotOptimize(text);
  }
  state.counters["bytes"] = static_cast<double>(bytes);
  state.SetItemsProcessed(state.iterations() * state.range(0));
}

// An encoder request of `len` tokens, written by hand: each input's data after its name, shape
// and datatype, the order clients send (json::dump would sort "data" first, which the decoder
// takes the slower way).
std::string EncoderRequestBody(int64_t len) {
  std::mt19937 rng(12);
  std::uniform_int_distribution<int64_t> token(1, 250001);
  std::string ids, mask;
  for (int64_t i = 0; i < len; ++i) {
    ids += (i > 0 ? "," : "") + std::to_string(token(rng));
    mask += (i > 0 ? ",1" : "1");
  }
  const std::string shape = "[1," + std::to_string(len) + "]";
  return "{\"id\":\"bench\",\"inputs\":[{\"name\":\"input_ids\",\"shape\":" + shape +
         ",\"datatype\":\"INT64\",\"data\":[" + ids + "]},{\"name\":\"attention_mask\",\"shape\":" +
         shape + ",\"datatype\":\"INT64\",\"data\":[" + mask + "]}]}";
}

void BM_DecodeJson(benchmark::State& state) {
  const int64_t len = state.range(0);
  const std::string body = EncoderRequestBody(len);
  for (auto _ : state) {
    nlohmann::json parameters;
    auto r = DecodeJsonInferRequest(body, "encoder", "", 64LL << 20, &parameters);
    if (!r.ok()) {
      state.SkipWithError(std::string(r.status().message()).c_str());
      break;
    }
    benchmark::DoNotOptimize(r);
  }
  state.counters["bytes"] = static_cast<double>(body.size());
  state.SetItemsProcessed(state.iterations() * 2 * len);
}

// For scale: json::parse of the same body into a document, nothing decoded.
void BM_ParseJsonDocument(benchmark::State& state) {
  const int64_t len = state.range(0);
  const std::string body = EncoderRequestBody(len);
  for (auto _ : state) {
    nlohmann::json doc = nlohmann::json::parse(body);
    benchmark::DoNotOptimize(doc);
  }
  state.SetItemsProcessed(state.iterations() * 2 * len);
}

BENCHMARK(BM_DecodeJson)->Arg(16)->Arg(512)->Arg(8192)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ParseJsonDocument)->Arg(16)->Arg(512)->Arg(8192)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_EncodeJson)->Arg(64)->Arg(1024)->Arg(16384)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_EncodeJsonDocument)->Arg(64)->Arg(1024)->Arg(16384)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace kiln

BENCHMARK_MAIN();
