#pragma once

#include <grpcpp/security/credentials.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kiln/v1/control_plane.grpc.pb.h"

namespace kiln {

// The agent's side of kiln.v1.ControlPlane.Connect: registers, sends Status every
// `status_period`, hands each Assignment and RoutingTable to the agent and answers Ack or
// Nack with the generation; reconnects with backoff (1 s doubling to kMaxReconnectBackoff,
// jittered). While the controller is away the agent keeps serving what it last applied.
//
// The cap is shorter than the controller's observe window after a start (--observe-seconds,
// 10 s by default): a restarted controller hears from every agent before it places anything,
// so replicas on nodes that were merely reconnecting are not placed again elsewhere.
inline constexpr absl::Duration kMaxReconnectBackoff = absl::Seconds(5);
class ControllerClient {
 public:
  struct Hooks {
    std::function<v1::Register()> make_register;
    std::function<v1::NodeStatus()> make_status;
    // Apply on the agent's loop; OK -> Ack, error -> Nack with the message. UNAVAILABLE (it
    // could not be saved) is tried again every status period until it is applied (then
    // Acked) or a newer one comes: the controller does not send it again by itself.
    std::function<absl::Status(const v1::Assignment&)> apply_assignment;
    std::function<absl::Status(const v1::RoutingTable&)> apply_routing;
    std::function<void(const std::string&)> log;
  };
  // `credentials`: plaintext by default; TLS ones from MakeChannelCredentials. `server_name`
  // (optional) is the name the controller's certificate must carry when it differs from the
  // address's host.
  ControllerClient(std::string address, Hooks hooks,
                   std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr,
                   std::string server_name = "", absl::Duration status_period = absl::Seconds(1));
  ~ControllerClient();

  void Start();
  void Stop();
  bool connected() const;
  uint64_t connects() const;

 private:
  void Run();
  bool Session();  // one connection; false when stopping
  void StatusLoop(grpc::ClientReaderWriter<v1::AgentMessage, v1::ControllerMessage>* stream,
                  bool* done);

  const std::string address_;
  Hooks hooks_;
  const absl::Duration status_period_;
  std::unique_ptr<v1::ControlPlane::Stub> stub_;

  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool connected_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t connects_ ABSL_GUARDED_BY(mu_) = 0;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Mutex write_mu_;  // one writer at a time on the stream
  // Held around each apply_assignment: a retry never applies an assignment a newer one
  // replaced meanwhile.
  absl::Mutex apply_mu_ ABSL_ACQUIRED_BEFORE(write_mu_);
  // Nacked as not saved, tried again by the status loop (cleared by any newer assignment).
  std::optional<v1::Assignment> unsaved_ ABSL_GUARDED_BY(apply_mu_);
  std::thread thread_;
};

}  // namespace kiln
