#include "agent/fake_runtime_client.h"

#include <utility>

namespace kiln {

class FakeRuntimeClient : public RuntimeClient {
 public:
  FakeRuntimeClient(FakeRuntimeClientFactory* f, std::string socket)
      : f_(f), socket_(std::move(socket)) {}

  absl::StatusOr<v1::RuntimeState> GetState() override {
    absl::MutexLock lock(&f_->mu_);
    auto* r = Find();
    if (!r) return absl::UnavailableError("no runtime at " + socket_);
    return r->state;
  }
  absl::StatusOr<v1::RuntimeState> Promote() override {
    return Move(v1::WARM, v1::SERVING, &FakeRuntimeClientFactory::Runtime::promotes);
  }
  absl::StatusOr<v1::RuntimeState> Demote() override {
    return Move(v1::SERVING, v1::WARM, &FakeRuntimeClientFactory::Runtime::demotes);
  }
  absl::StatusOr<v1::RuntimeStats> Stats() override {
    absl::MutexLock lock(&f_->mu_);
    auto* r = Find();
    if (!r) return absl::UnavailableError("no runtime at " + socket_);
    if (r->stats_pending) return AnswerPending("Stats");
    return r->stats;
  }
  absl::Status Load(const std::vector<std::string>& args) override {
    absl::MutexLock lock(&f_->mu_);
    auto* r = Find();
    if (!r) return absl::UnavailableError("no runtime at " + socket_);
    ++r->load_calls;
    if (r->load_held) {
      if (!r->load_on_its_way) r->load_on_its_way = args;
      return AnswerPending("Load");
    }
    // The answer of the one on its way, for the arguments it was sent.
    std::vector<std::string> taken = r->load_on_its_way.value_or(args);
    r->load_on_its_way.reset();
    if (!r->load_error.ok()) return std::exchange(r->load_error, absl::OkStatus());
    if (!r->loads.empty()) return absl::FailedPreconditionError("a Load was already accepted");
    r->loads.push_back(std::move(taken));
    return absl::OkStatus();
  }

 private:
  FakeRuntimeClientFactory::Runtime* Find() ABSL_EXCLUSIVE_LOCKS_REQUIRED(f_->mu_) {
    auto it = f_->runtimes_.find(socket_);
    if (it == f_->runtimes_.end() || !it->second.reachable) return nullptr;
    return &it->second;
  }
  absl::StatusOr<v1::RuntimeState> Move(v1::LifecycleState from, v1::LifecycleState to,
                                        int FakeRuntimeClientFactory::Runtime::*counter) {
    absl::MutexLock lock(&f_->mu_);
    auto* r = Find();
    if (!r) return absl::UnavailableError("no runtime at " + socket_);
    if (r->state.state() != from && r->state.state() != to) {
      return absl::FailedPreconditionError("bad state");
    }
    r->state.set_state(to);
    (r->*counter)++;
    return r->state;
  }

  FakeRuntimeClientFactory* f_;
  std::string socket_;
};

std::unique_ptr<RuntimeClient> FakeRuntimeClientFactory::Connect(const std::string& socket_path) {
  return std::make_unique<FakeRuntimeClient>(this, socket_path);
}

void FakeRuntimeClientFactory::Set(const std::string& socket, v1::LifecycleState state,
                                   const std::string& model, const std::string& version,
                                   int grpc_port) {
  absl::MutexLock lock(&mu_);
  Runtime& r = runtimes_[socket];
  r.state.set_state(state);
  if (!model.empty()) r.state.set_model_name(model);
  if (!version.empty()) r.state.set_model_version(version);
  if (grpc_port) r.state.set_grpc_port(grpc_port);
}

void FakeRuntimeClientFactory::SetReplicaId(const std::string& socket, const std::string& id) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].state.set_replica_id(id);
}

void FakeRuntimeClientFactory::SetDeviceMemory(const std::string& socket, int64_t bytes) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].state.set_device_memory_bytes(bytes);
}

void FakeRuntimeClientFactory::SetExecutions(const std::string& socket, uint64_t batches) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].stats.set_batches(batches);
}

void FakeRuntimeClientFactory::SetStatsPending(const std::string& socket, bool pending) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].stats_pending = pending;
}

void FakeRuntimeClientFactory::FailNextLoad(const std::string& socket, absl::Status error) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].load_error = std::move(error);
}

void FakeRuntimeClientFactory::HoldLoad(const std::string& socket, bool held) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].load_held = held;
}

void FakeRuntimeClientFactory::SetReachable(const std::string& socket, bool reachable) {
  absl::MutexLock lock(&mu_);
  runtimes_[socket].reachable = reachable;
}

FakeRuntimeClientFactory::Runtime FakeRuntimeClientFactory::Get(const std::string& socket) const {
  absl::MutexLock lock(&mu_);
  auto it = runtimes_.find(socket);
  return it == runtimes_.end() ? Runtime{} : it->second;
}

}  // namespace kiln
