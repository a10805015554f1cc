#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "agent/runtime_client.h"

namespace kiln {

// Runtimes that exist only in memory, by control socket: tests set their state.
class FakeRuntimeClientFactory : public RuntimeClientFactory {
 public:
  struct Runtime {
    v1::RuntimeState state;
    v1::RuntimeStats stats;
    bool reachable = true;
    bool stats_pending = false;  // Stats answers AnswerPending() (a slow runtime)
    int promotes = 0;
    int demotes = 0;
    // Load: every accepted call's arguments; `load_error` refuses the next one.
    std::vector<std::vector<std::string>> loads;
    absl::Status load_error;
    // While `load_held`, a Load is taken (its arguments kept) but answers AnswerPending(), as
    // do the calls after it; the first call once released answers it (`load_error` or OK).
    bool load_held = false;
    std::optional<std::vector<std::string>> load_on_its_way;
    int load_calls = 0;
  };

  std::unique_ptr<RuntimeClient> Connect(const std::string& socket_path) override;

  // Creates or updates the runtime behind `socket`.
  void Set(const std::string& socket, v1::LifecycleState state, const std::string& model = "",
           const std::string& version = "", int grpc_port = 0);
  void SetReachable(const std::string& socket, bool reachable);
  void SetDeviceMemory(const std::string& socket, int64_t bytes);
  // Its Stats' execution count (RuntimeStats.batches).
  void SetExecutions(const std::string& socket, uint64_t batches);
  // Its Stats answer pending (still on its way) until set back.
  void SetStatsPending(const std::string& socket, bool pending);
  void SetReplicaId(const std::string& socket, const std::string& id);
  void FailNextLoad(const std::string& socket, absl::Status error);
  void HoldLoad(const std::string& socket, bool held);
  Runtime Get(const std::string& socket) const;

 private:
  friend class FakeRuntimeClient;
  mutable absl::Mutex mu_;
  std::map<std::string, Runtime> runtimes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
