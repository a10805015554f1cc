#include "runtime/control_service.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <system_error>

#include <grpcpp/server_builder.h>

#include "common/data_frames.h"
#include "common/grpc_status.h"

namespace kiln {
namespace {

// A call answered inline.
grpc::ServerUnaryReactor* Answered(grpc::CallbackServerContext* ctx, const grpc::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

// What `work` answers; INTERNAL, naming it, for what it throws (a call never takes the
// process down).
grpc::Status Guarded(const std::function<grpc::Status()>& work) {
  try {
    return work();
  } catch (const std::exception& e) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what());
  } catch (...) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "internal error");
  }
}

}  // namespace

absl::StatusOr<absl::Duration> ControlService::Deadline(int64_t millis) const {
  if (millis < 0 || millis > 3'600'000) {
    return absl::InvalidArgumentError("deadline_millis: must be in 0..3600000 (0 = default), got " +
                                      std::to_string(millis));
  }
  return millis == 0 ? default_drain_ : absl::Milliseconds(millis);
}

ControlService::~ControlService() {
  // The server has stopped: every call is finished, so each worker is past its work.
  std::list<Worker> workers;
  {
    absl::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) {
    if (w.thread.joinable()) w.thread.join();
  }
}

grpc::ServerUnaryReactor* ControlService::Blocking(grpc::CallbackServerContext* ctx,
                                                   std::function<grpc::Status()> work,
                                                   bool bounded) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  std::list<Worker> exited;
  std::string refused;
  {
    absl::MutexLock lock(&mu_);
    // Workers past their call's Finish: joining them waits only for their return. (A worker
    // still inside Finish may be running this very call's handler: it is not taken.)
    for (auto it = workers_.begin(); it != workers_.end();) {
      auto next = std::next(it);
      if (it->exited) exited.splice(exited.end(), workers_, it);
      it = next;
    }
    if (bounded && active_ >= kMaxBlockingCalls) {
      refused = "too many control calls in progress (at most " +
                std::to_string(kMaxBlockingCalls) + ")";
    } else {
      Worker& w = workers_.emplace_back();
      try {
        // Started under the lock: the worker takes it only once its work is done, by when
        // w.thread is set.
        w.thread = std::thread([this, reactor, work = std::move(work), &w] {
          grpc::Status status = Guarded(work);
          {
            absl::MutexLock done(&mu_);
            --active_;
          }
          reactor->Finish(status);
          absl::MutexLock done(&mu_);
          w.exited = true;
        });
        ++active_;
      } catch (const std::system_error& e) {
        workers_.pop_back();
        refused = std::string("cannot start a thread for the call: ") + e.what();
      }
    }
  }
  for (Worker& w : exited) w.thread.join();
  if (!refused.empty()) {
    reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, refused));
  }
  return reactor;
}

grpc::ServerUnaryReactor* ControlService::GetState(grpc::CallbackServerContext* ctx,
                                                   const v1::GetStateRequest*,
                                                   v1::RuntimeState* resp) {
  *resp = target_->GetState();
  return Answered(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* ControlService::Promote(grpc::CallbackServerContext* ctx,
                                                  const v1::PromoteRequest*,
                                                  v1::RuntimeState* resp) {
  auto promote = [this, resp]() -> grpc::Status {
    absl::Status s = target_->Promote();
    *resp = target_->GetState();
    return ToGrpcStatus(s);
  };
  // May run a warm-up inference first. Without one it is a state change, answered at once: a
  // thread started per call cost about a millisecond of Promote -> first served on a 2-vCPU VM.
  if (target_->PromoteWaits()) return Blocking(ctx, promote);
  return Answered(ctx, Guarded(promote));
}

grpc::ServerUnaryReactor* ControlService::Demote(grpc::CallbackServerContext* ctx,
                                                 const v1::DemoteRequest*,
                                                 v1::RuntimeState* resp) {
  absl::Status s = target_->Demote();
  *resp = target_->GetState();
  return Answered(ctx, ToGrpcStatus(s));
}

grpc::ServerUnaryReactor* ControlService::Drain(grpc::CallbackServerContext* ctx,
                                                const v1::DrainRequest* req,
                                                v1::DrainResponse* resp) {
  return Blocking(ctx, [this, req, resp] {
    auto deadline = Deadline(req->deadline_millis());
    if (!deadline.ok()) return ToGrpcStatus(deadline.status());
    auto drained = target_->Drain(*deadline);
    if (!drained.ok()) return ToGrpcStatus(drained.status());
    resp->set_drained(*drained);
    resp->set_in_flight(target_->InFlight());
    *resp->mutable_state() = target_->GetState();
    return grpc::Status::OK;
  });
}

grpc::ServerUnaryReactor* ControlService::Stats(grpc::CallbackServerContext* ctx,
                                                const v1::StatsRequest*, v1::RuntimeStats* resp) {
  *resp = target_->Stats();
  return Answered(ctx, grpc::Status::OK);
}

grpc::ServerUnaryReactor* ControlService::Shutdown(grpc::CallbackServerContext* ctx,
                                                   const v1::ShutdownRequest* req,
                                                   v1::ShutdownResponse* resp) {
  // Never refused for the bound: a runtime must always be able to be told to stop.
  return Blocking(
      ctx,
      [this, req, resp] {
        auto deadline = Deadline(req->deadline_millis());
        if (!deadline.ok()) return ToGrpcStatus(deadline.status());
        resp->set_drained(target_->Shutdown(*deadline));
        return grpc::Status::OK;
      },
      /*bounded=*/false);
}

grpc::ServerUnaryReactor* ControlService::Load(grpc::CallbackServerContext* ctx,
                                               const v1::LoadRequest* req, v1::LoadResponse*) {
  return Blocking(ctx, [this, req] {
    return ToGrpcStatus(target_->Load({req->args().begin(), req->args().end()}));
  });
}

absl::StatusOr<std::unique_ptr<grpc::Server>> StartControlServer(const std::string& path,
                                                                 grpc::Service* service) {
  if (auto s = ClearStaleSocket(path, "--control-socket"); !s.ok()) return s;
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:" + path, grpc::InsecureServerCredentials());
  b.RegisterService(service);
  // The socket is created 0600 (no window in which others could connect).
  mode_t old_umask = umask(0177);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  umask(old_umask);
  if (!server) return absl::UnavailableError("--control-socket: cannot listen on " + path);
  if (chmod(path.c_str(), 0600) != 0) {
    return absl::PermissionDeniedError("--control-socket: cannot chmod 0600 " + path);
  }
  return server;
}

}  // namespace kiln
