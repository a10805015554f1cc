#pragma once

#include <atomic>
#include <string>

#include "runtime/inference_engine.h"
#include "runtime/lifecycle.h"
#include "runtime/model_config.h"

namespace kiln {

// What the frontends see of the served model: its config and version from the start, the
// lifecycle, and the engine once it is loaded. Requests before then are UNAVAILABLE.
class ModelHost {
 public:
  ModelHost(ModelConfig config, std::string version, Lifecycle* lifecycle)
      : config_(std::move(config)), version_(std::move(version)), lifecycle_(lifecycle) {}

  const ModelConfig& config() const { return config_; }
  const std::string& version() const { return version_; }
  RuntimeState state() const { return lifecycle_->state(); }
  Lifecycle* lifecycle() const { return lifecycle_; }

  void SetEngine(InferenceEngine* engine) { engine_.store(engine); }
  InferenceEngine* engine() const { return engine_.load(); }

  bool Serves(const std::string& model, const std::string& version) const {
    return model == config_.name && (version.empty() || version == version_);
  }
  bool ModelReady(const std::string& model, const std::string& version) const {
    return Serves(model, version) && state() == RuntimeState::kServing && engine() != nullptr;
  }
  bool Live() const { return state() != RuntimeState::kFailed; }

  // A request refused before decoding (InferenceEngine::CountRefused); before the model is
  // loaded there is nothing to count it in.
  void CountRefused() {
    if (InferenceEngine* e = engine()) e->CountRefused();
  }

  void Infer(InferRequest request, InferenceEngine::Done done) {
    InferenceEngine* e = engine();
    if (e != nullptr) {
      e->Infer(std::move(request), std::move(done));
      return;
    }
    if (!Serves(request.model_name, request.model_version)) {
      done(absl::NotFoundError("unknown model '" + request.model_name + "'"));
    } else {
      done(absl::UnavailableError(std::string("model '") + config_.name + "' is " +
                                  RuntimeStateName(state())));
    }
  }

 private:
  const ModelConfig config_;
  const std::string version_;
  Lifecycle* lifecycle_;
  std::atomic<InferenceEngine*> engine_{nullptr};
};

}  // namespace kiln
