#include "runtime/inference_engine.h"

#include <cstring>
#include <future>
#include <set>

#include "common/logging.h"
#include "common/status.h"
#include "runtime/buckets.h"

namespace kiln {

absl::StatusOr<std::unique_ptr<InferenceEngine>> InferenceEngine::Create(
    ModelConfig config, std::string version, std::unique_ptr<Backend> backend,
    Lifecycle* lifecycle, Clock* clock) {
  if (!backend || !lifecycle || !clock) {
    return absl::InvalidArgumentError("engine needs a backend, a lifecycle and a clock");
  }
  KILN_RETURN_IF_ERROR(ValidateModelConfig(config));
  std::unique_ptr<InferenceEngine> engine(new InferenceEngine(
      std::move(config), std::move(version), std::move(backend), lifecycle, clock));
  InferenceEngine* self = engine.get();
  KILN_ASSIGN_OR_RETURN(
      engine->batcher_,
      Batcher::Create(
          engine->config_,
          [self](std::vector<Tensor> inputs) {
            const absl::Time start = self->clock_->Now();
            auto outputs = self->backend_->Execute(std::move(inputs));
            self->compute_micros_.Record(
                absl::ToDoubleMicroseconds(self->clock_->Now() - start));
            return outputs;
          },
          clock,
          [self](int64_t requests, int64_t rows) {
            self->batches_++;
            self->batch_size_.Record(static_cast<double>(rows));
          },
          engine->backend_->WantsOneExecutionThread()));
  return engine;
}

InferenceEngine::InferenceEngine(ModelConfig config, std::string version,
                                 std::unique_ptr<Backend> backend, Lifecycle* lifecycle,
                                 Clock* clock)
    : config_(std::move(config)),
      version_(std::move(version)),
      backend_(std::move(backend)),
      lifecycle_(lifecycle),
      clock_(clock),
      latency_micros_(Histogram::ExponentialBounds(25, 1.5, 36)),
      compute_micros_(Histogram::ExponentialBounds(25, 1.5, 36)),
      batch_size_(Histogram::ExponentialBounds(1, 2, 12)) {
  if (config_.response_cache.enable) {
    cache_ = std::make_unique<ResponseCache>(config_.response_cache.max_bytes);
  }
}

InferenceEngine::~InferenceEngine() { Stop(); }

void InferenceEngine::Stop() {
  if (batcher_) batcher_->Stop();
}

bool InferenceEngine::Serves(const std::string& model, const std::string& version) const {
  return model == config_.name && (version.empty() || version == version_);
}

absl::Status InferenceEngine::Validate(InferRequest& r) const {
  if (r.model_name != config_.name) {
    return absl::NotFoundError("unknown model '" + r.model_name + "' (this runtime serves '" +
                               config_.name + "')");
  }
  if (!r.model_version.empty() && r.model_version != version_) {
    return absl::NotFoundError("unknown version '" + r.model_version + "' of model '" +
                               config_.name + "' (this runtime serves version " + version_ + ")");
  }
  const bool batched = config_.max_batch_size > 0;
  std::vector<Tensor> ordered(config_.inputs.size());
  std::vector<bool> seen(config_.inputs.size(), false);
  int64_t rows = -1;
  for (Tensor& t : r.inputs) {
    int idx = config_.InputIndex(t.name);
    if (idx < 0) {
      std::string names;
      for (const auto& s : config_.inputs) names += (names.empty() ? "" : ", ") + s.name;
      return absl::InvalidArgumentError("unknown input '" + t.name + "' (expected: " + names + ")");
    }
    if (seen[idx]) return absl::InvalidArgumentError("input '" + t.name + "' is given twice");
    seen[idx] = true;
    const TensorSpec& spec = config_.inputs[idx];
    if (t.dtype != spec.dtype) {
      return absl::InvalidArgumentError("input '" + t.name + "': expected datatype " +
                                        DataTypeName(spec.dtype) + ", got " +
                                        DataTypeName(t.dtype));
    }
    std::vector<int64_t> expected = spec.dims;
    if (batched) expected.insert(expected.begin(), -1);
    bool ok = t.shape.size() == expected.size();
    for (size_t d = 0; ok && d < expected.size(); ++d) {
      if (t.shape[d] < 0 || (expected[d] != -1 && expected[d] != t.shape[d])) ok = false;
    }
    if (!ok) {
      return absl::InvalidArgumentError("input '" + t.name + "': expected shape " +
                                        ShapeString(expected) +
                                        (batched ? " (batch dimension first)" : "") + ", got " +
                                        ShapeString(t.shape));
    }
    if (batched) {
      if (t.shape[0] < 1 || t.shape[0] > config_.max_batch_size) {
        return absl::InvalidArgumentError("input '" + t.name + "': batch size " +
                                          std::to_string(t.shape[0]) + " is outside 1.." +
                                          std::to_string(config_.max_batch_size) +
                                          " (max_batch_size)");
      }
      if (rows >= 0 && rows != t.shape[0]) {
        return absl::InvalidArgumentError("input '" + t.name + "': batch size " +
                                          std::to_string(t.shape[0]) +
                                          " differs from the other inputs' " +
                                          std::to_string(rows));
      }
      rows = t.shape[0];
    }
    KILN_ASSIGN_OR_RETURN(int64_t n, ElementCount(t.shape, "input '" + t.name + "'"));
    size_t want = static_cast<size_t>(n) * DataTypeSize(t.dtype);
    if (t.data.size() != want) {
      return absl::InvalidArgumentError("input '" + t.name + "': expected " +
                                        std::to_string(want) + " bytes for " +
                                        DataTypeName(t.dtype) + " " + ShapeString(t.shape) +
                                        ", got " + std::to_string(t.data.size()));
    }
    ordered[idx] = std::move(t);
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    if (!seen[i]) {
      return absl::InvalidArgumentError("missing input '" + config_.inputs[i].name + "'");
    }
  }
  std::set<std::string> requested;
  for (const auto& o : r.outputs) {
    if (config_.OutputIndex(o) < 0) {
      std::string names;
      for (const auto& s : config_.outputs) names += (names.empty() ? "" : ", ") + s.name;
      return absl::InvalidArgumentError("unknown output '" + o + "' (expected: " + names + ")");
    }
    if (!requested.insert(o).second) {
      return absl::InvalidArgumentError("output '" + o + "' is requested twice");
    }
  }
  if (config_.dynamic_batching) {
    const auto& db = *config_.dynamic_batching;
    if (r.priority < 0 || r.priority > db.priority_levels) {
      return absl::InvalidArgumentError("parameter 'priority': must be in 0.." +
                                        std::to_string(db.priority_levels) +
                                        " (0 = default), got " + std::to_string(r.priority));
    }
  } else if (r.priority < 0) {
    return absl::InvalidArgumentError("parameter 'priority': must be >= 0");
  }
  if (r.timeout_micros < 0) {
    return absl::InvalidArgumentError("parameter 'timeout': must be >= 0 microseconds");
  }
  if (r.caller_time_left_micros < 0) {
    return absl::DeadlineExceededError("the request's deadline passed before it was queued");
  }
  r.inputs = std::move(ordered);
  return absl::OkStatus();
}

void InferenceEngine::Record(absl::Time start, const absl::Status& status) {
  latency_micros_.Record(absl::ToDoubleMicroseconds(clock_->Now() - start));
  if (!status.ok()) {
    errors_++;
    if (status.code() == absl::StatusCode::kDeadlineExceeded) timed_out_++;
  }
}

void InferenceEngine::Leave() {
  absl::MutexLock lock(&idle_mu_);
  in_flight_--;
}

void InferenceEngine::CountRefused() {
  requests_++;
  errors_++;
}

void InferenceEngine::Infer(InferRequest request, Done done) {
  absl::Time start = clock_->Now();
  requests_++;
  {
    absl::MutexLock lock(&idle_mu_);
    in_flight_++;
  }
  // A request leaves the in-flight count only after its reply was handed to the frontend,
  // so a drain never closes a frontend under a finished-but-unsent reply.
  auto fail = [&](absl::Status s) {
    Record(start, s);
    done(s);
    Leave();
  };
  RuntimeState state = lifecycle_->state();
  if (state != RuntimeState::kServing) {
    // Unknown models are NOT_FOUND whatever the state; a known one is unavailable.
    if (!Serves(request.model_name, request.model_version)) {
      fail(absl::NotFoundError("unknown model '" + request.model_name + "' version '" +
                               request.model_version + "'"));
    } else {
      fail(absl::UnavailableError(std::string("model '") + config_.name + "' is not serving (" +
                                  RuntimeStateName(state) + ")"));
    }
    return;
  }
  absl::Status valid = Validate(request);
  int64_t seq_len = -1;
  int64_t bucket = -1;
  if (valid.ok() && config_.sequence_buckets) {
    auto len = RequestSequenceLength(config_, request.inputs);
    if (!len.ok()) {
      valid = len.status();
    } else if (*len == 0) {
      // All padding: pooled outputs of nothing (NaN), not an answer.
      valid = absl::InvalidArgumentError(
          "sequence length must be at least 1, got 0 (the model pads to sequence buckets)");
    } else if (*len > 0) {
      seq_len = *len;
      std::string first;
      for (size_t i = 0; i < config_.inputs.size(); ++i) {
        if (SequenceAxis(config_.inputs[i], config_.max_batch_size > 0) >= 0) {
          first = config_.inputs[i].name;
          break;
        }
      }
      auto b = BucketLength(*config_.sequence_buckets, seq_len, "input '" + first + "'");
      if (b.ok()) {
        bucket = *b;
      } else {
        valid = b.status();
      }
    }
  }
  if (!valid.ok()) {
    fail(valid);
    return;
  }

  auto respond = [this, start, id = request.id, wanted = request.outputs,
                  done](absl::StatusOr<std::vector<Tensor>> outputs, bool hit) {
    if (!outputs.ok()) {
      absl::Status s = outputs.status();
      Record(start, s);
      LeaveAfter leave{this};  // even when `done` throws: a drain waits on the count
      done(s);
      return;
    }
    InferResponse resp;
    resp.model_name = config_.name;
    resp.model_version = version_;
    resp.id = id;
    resp.cache_hit = hit;
    if (wanted.empty()) {
      resp.outputs = std::move(*outputs);
    } else {
      for (const auto& name : wanted) {
        for (auto& t : *outputs) {
          if (t.name == name) resp.outputs.push_back(std::move(t));
        }
      }
    }
    Record(start, absl::OkStatus());
    LeaveAfter leave{this};
    done(std::move(resp));
  };

  std::string cache_key;
  if (cache_ && !request.skip_cache) {
    cache_key = ResponseCache::Key(config_.name, version_, request.inputs);
    if (auto hit = cache_->Lookup(cache_key)) {
      respond(std::move(*hit), true);
      return;
    }
  }

  if (bucket >= 0) {
    absl::Status padded;
    try {
      padded = PadToBucket(config_, bucket, &request.inputs, payload_limit_.load());
    } catch (const std::exception& e) {  // an allocation failing: answered, and left
      padded = absl::ResourceExhaustedError(std::string("padding the request: ") + e.what());
    }
    if (!padded.ok()) {
      fail(padded);
      return;
    }
  }

  Batcher::Item item;
  item.rows = config_.max_batch_size > 0 ? request.inputs[0].shape[0] : 1;
  item.priority = request.priority;
  if (item.priority == 0) {
    item.priority = config_.dynamic_batching ? config_.dynamic_batching->default_priority_level : 1;
  }
  int64_t timeout = request.timeout_micros;
  if (timeout == 0 && config_.dynamic_batching) {
    timeout = config_.dynamic_batching->default_timeout_microseconds;
  }
  if (request.caller_time_left_micros > 0 &&
      (timeout == 0 || request.caller_time_left_micros < timeout)) {
    timeout = request.caller_time_left_micros;
  }
  if (timeout > 0) item.deadline = start + absl::Microseconds(timeout);
  item.may_run_inline = !request.never_inline &&
                        !(request.shared_reader && config_.dynamic_batching &&
                          config_.dynamic_batching->priority_levels > 1);
  item.inputs = std::move(request.inputs);
  item.done = [this, respond, cache_key,
               seq_len](absl::StatusOr<std::vector<Tensor>> outputs) {
    try {
      if (outputs.ok() && seq_len >= 0) {
        absl::Status trimmed = TrimToLength(config_, seq_len, &*outputs);
        if (!trimmed.ok()) outputs = trimmed;
      }
      if (outputs.ok() && !cache_key.empty()) cache_->Insert(cache_key, *outputs);
    } catch (const std::exception& e) {  // an allocation failing: answered, not lost
      outputs = absl::InternalError(std::string("the answer could not be made: ") + e.what());
    }
    respond(std::move(outputs), false);
  };
  absl::Status queued = batcher_->Enqueue(std::move(item));
  if (!queued.ok()) {
    if (queued.code() == absl::StatusCode::kResourceExhausted) rejected_queue_full_++;
    fail(queued);
  }
}

absl::StatusOr<InferResponse> InferenceEngine::InferSync(InferRequest request) {
  std::promise<absl::StatusOr<InferResponse>> promise;
  auto future = promise.get_future();
  Infer(std::move(request), [&promise](absl::StatusOr<InferResponse> r) {
    promise.set_value(std::move(r));
  });
  return future.get();
}

absl::Status InferenceEngine::Warmup(bool once) {
  // On the executions' thread, whatever the backend: what LibTorch and the BLAS set up per
  // thread on its first forward (the intra-op thread settings, work buffers; an OpenMP team
  // where there is more than one intra-op thread) is made there before the first request, not
  // paid by it.
  absl::Status s;
  KILN_RETURN_IF_ERROR(batcher_->RunOnExecutor([&] { s = WarmupHere(once); }));
  return s;
}

absl::Status InferenceEngine::WarmupHere(bool once) {
  if (config_.warmup.empty()) {
    // No samples configured: one zero-filled request of the smallest shape (batch 1, each
    // variable dimension 1), so the first client does not pay for the first execution (a
    // power-parked GPU's slow first kernel, lazy allocations). Best effort: a model that
    // refuses such an input is served as it is.
    WarmupSample w;
    w.name = "default";
    for (const auto& spec : config_.inputs) {
      std::vector<int64_t> dims = spec.dims;
      for (auto& d : dims) d = d < 0 ? 1 : d;
      w.dims[spec.name] = std::move(dims);
    }
    absl::Status s = RunWarmupSample(w, once);
    if (!s.ok()) {
      GetLogger("runtime.engine")
          ->warn("default warm-up (no warmup: in config.yaml) failed, serving without it: {}",
                 std::string(s.message()));
    }
    return absl::OkStatus();
  }
  for (const auto& w : config_.warmup) {
    KILN_RETURN_IF_ERROR(RunWarmupSample(w, once));
    if (once) break;
  }
  return absl::OkStatus();
}

absl::Status InferenceEngine::RunWarmupSample(const WarmupSample& w, bool once) {
  auto log = GetLogger("runtime.engine");
  std::vector<Tensor> inputs;
  for (const auto& spec : config_.inputs) {
    Tensor t;
    t.name = spec.name;
    t.dtype = spec.dtype;
    auto it = w.dims.find(spec.name);
    t.shape = it != w.dims.end() ? it->second : spec.dims;
    if (config_.max_batch_size > 0) t.shape.insert(t.shape.begin(), w.batch_size);
    KILN_ASSIGN_OR_RETURN(int64_t n, ElementCount(t.shape, "warmup input " + spec.name));
    try {
      t.data.assign(static_cast<size_t>(n) * DataTypeSize(t.dtype), '\0');
    } catch (const std::exception&) {
      return absl::ResourceExhaustedError("warmup '" + w.name + "': cannot allocate input " +
                                          spec.name + " " + ShapeString(t.shape));
    }
    if (w.ones) {
      for (int64_t e = 0; e < n; ++e) {
        char* p = t.data.data() + e * DataTypeSize(t.dtype);
        switch (t.dtype) {
          case DataType::kFp32: {
            float one = 1.0f;
            std::memcpy(p, &one, 4);
            break;
          }
          case DataType::kFp64: {
            double one = 1.0;
            std::memcpy(p, &one, 8);
            break;
          }
          case DataType::kFp16: {
            uint16_t one = FloatToHalf(1.0f);
            std::memcpy(p, &one, 2);
            break;
          }
          case DataType::kBf16: {
            uint16_t one = FloatToBf16(1.0f);
            std::memcpy(p, &one, 2);
            break;
          }
          default:
            p[0] = 1;  // little-endian integer or bool one
        }
      }
    }
    inputs.push_back(std::move(t));
  }
  if (config_.sequence_buckets) {
    // Warm the shapes serving will run: the sample padded to its bucket.
    KILN_ASSIGN_OR_RETURN(int64_t len, RequestSequenceLength(config_, inputs));
    if (len >= 0) {
      KILN_ASSIGN_OR_RETURN(int64_t b, BucketLength(*config_.sequence_buckets, len,
                                                    "warmup '" + w.name + "'"));
      KILN_RETURN_IF_ERROR(PadToBucket(config_, b, &inputs));
    }
  }
  for (int64_t i = 0; i < (once ? 1 : w.iterations); ++i) {
    absl::Time t0 = clock_->Now();
    auto out = backend_->Execute(inputs);
    if (!out.ok()) return Annotate(out.status(), "warmup '" + w.name + "'");
    log->debug("warmup '{}' iteration {}: {:.3f} ms", w.name, i,
               absl::ToDoubleMilliseconds(clock_->Now() - t0));
  }
  return absl::OkStatus();
}

bool InferenceEngine::WaitIdle(absl::Duration timeout) {
  absl::MutexLock lock(&idle_mu_);
  auto idle = [this]() { return in_flight_.load() == 0; };
  return idle_mu_.AwaitWithTimeout(absl::Condition(&idle), timeout);
}

EngineStats InferenceEngine::Stats() const {
  EngineStats s;
  s.requests = requests_.load();
  s.errors = errors_.load();
  s.in_flight = in_flight_.load();
  s.queue_depth = batcher_ ? batcher_->queue_depth() : 0;
  s.idle_spins = batcher_ ? batcher_->idle_spins() : 0;
  s.idle_spin_catches = batcher_ ? batcher_->idle_spin_catches() : 0;
  s.batches = batches_.load();
  s.rejected_queue_full = rejected_queue_full_.load();
  s.timed_out = timed_out_.load();
  s.latency_micros = latency_micros_.Take();
  s.compute_micros = compute_micros_.Take();
  s.batch_size = batch_size_.Take();
  if (cache_) s.cache = cache_->counters();
  return s;
}

}  // namespace kiln
