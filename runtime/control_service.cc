#include "runtime/control_service.h"

#include <unistd.h>

#include <system_error>
#include <utility>

#include "common/data_frames.h"
#include "common/grpc_status.h"

namespace kiln {
namespace {

using Answer = std::pair<grpc::Status, std::string>;

// What `work` answers; INTERNAL, naming it, for what it throws (a call never takes the
// process down).
template <typename F>
Answer Guarded(const F& work) {
  try {
    return work();
  } catch (const std::exception& e) {
    return {grpc::Status(grpc::StatusCode::INTERNAL, std::string("internal error: ") + e.what()),
            std::string()};
  } catch (...) {
    return {grpc::Status(grpc::StatusCode::INTERNAL, "internal error"), std::string()};
  }
}

Answer Reply(const grpc::Status& status, const google::protobuf::MessageLite& m) {
  return {status, status.ok() ? m.SerializeAsString() : std::string()};
}

}  // namespace

absl::StatusOr<absl::Duration> ControlService::Deadline(int64_t millis) const {
  if (millis < 0 || millis > 3'600'000) {
    return absl::InvalidArgumentError("deadline_millis: must be in 0..3600000 (0 = default), got " +
                                      std::to_string(millis));
  }
  return millis == 0 ? default_drain_ : absl::Milliseconds(millis);
}

ControlService::~ControlService() { JoinWorkers(); }

void ControlService::JoinWorkers() {
  std::list<Worker> workers;
  {
    absl::MutexLock lock(&mu_);
    workers.swap(workers_);
  }
  for (Worker& w : workers) {
    if (w.thread.joinable()) w.thread.join();
  }
}

void ControlService::Blocking(std::shared_ptr<GrpcH2Server::Call> call, Work work, bool bounded) {
  std::list<Worker> exited;
  std::string refused;
  {
    absl::MutexLock lock(&mu_);
    // Workers past their call's Finish: joining them waits only for their return.
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
        w.thread = std::thread([this, call, work = std::move(work), &w] {
          Answer answer = Guarded(work);
          {
            absl::MutexLock done(&mu_);
            --active_;
          }
          call->Finish(answer.first, std::move(answer.second));
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
  if (!refused.empty()) call->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, refused));
}

void ControlService::Serve(std::shared_ptr<GrpcH2Server::Call> call) {
  Answer refused = Guarded([&]() -> Answer {
    Dispatch(call);
    return {grpc::Status::OK, std::string()};
  });
  // Dispatch threw before answering (Finish after an answer does nothing).
  if (!refused.first.ok()) call->Finish(refused.first);
}

void ControlService::Dispatch(const std::shared_ptr<GrpcH2Server::Call>& call) {
  const std::string& path = call->method();
  const std::string method = path.rfind(kServicePrefix, 0) == 0
                                 ? path.substr(sizeof(kServicePrefix) - 1)
                                 : std::string();
  auto inline_answer = [&](auto&& work) {
    Answer a = Guarded(work);
    call->Finish(a.first, std::move(a.second));
  };
  if (method == "GetState") {
    v1::GetStateRequest req;
    if (!ParseRequest(*call, &req)) return;
    inline_answer([&] { return Reply(grpc::Status::OK, target_->GetState()); });
  } else if (method == "Stats") {
    v1::StatsRequest req;
    if (!ParseRequest(*call, &req)) return;
    inline_answer([&] { return Reply(grpc::Status::OK, target_->Stats()); });
  } else if (method == "Promote" || method == "Demote") {
    const bool promote = method == "Promote";
    if (promote ? !ParseRequest(*call, std::make_unique<v1::PromoteRequest>().get())
                : !ParseRequest(*call, std::make_unique<v1::DemoteRequest>().get())) {
      return;
    }
    auto move = [this, promote]() -> Answer {
      absl::Status s = promote ? target_->Promote() : target_->Demote();
      return Reply(ToGrpcStatus(s), target_->GetState());
    };
    // A Promote may run a warm-up inference first, and a Demote waits for a Promote under way:
    // then each runs on a thread of its own, so this one goes on answering the others. Without
    // a warm-up both are state changes, answered at once (a thread started per call cost about
    // a millisecond of Promote -> first served on a 2-vCPU VM).
    if (target_->PromoteWaits()) {
      Blocking(call, move);
    } else {
      inline_answer(move);
    }
  } else if (method == "Drain") {
    auto req = std::make_shared<v1::DrainRequest>();
    if (!ParseRequest(*call, req.get())) return;
    Blocking(call, [this, req]() -> Answer {
      auto deadline = Deadline(req->deadline_millis());
      if (!deadline.ok()) return {ToGrpcStatus(deadline.status()), std::string()};
      auto drained = target_->Drain(*deadline);
      if (!drained.ok()) return {ToGrpcStatus(drained.status()), std::string()};
      v1::DrainResponse resp;
      resp.set_drained(*drained);
      resp.set_in_flight(target_->InFlight());
      *resp.mutable_state() = target_->GetState();
      return Reply(grpc::Status::OK, resp);
    });
  } else if (method == "Shutdown") {
    auto req = std::make_shared<v1::ShutdownRequest>();
    if (!ParseRequest(*call, req.get())) return;
    // Never refused for the bound: a runtime must always be able to be told to stop.
    Blocking(
        call,
        [this, req]() -> Answer {
          auto deadline = Deadline(req->deadline_millis());
          if (!deadline.ok()) return {ToGrpcStatus(deadline.status()), std::string()};
          v1::ShutdownResponse resp;
          resp.set_drained(target_->Shutdown(*deadline));
          return Reply(grpc::Status::OK, resp);
        },
        /*bounded=*/false);
  } else if (method == "Load") {
    auto req = std::make_shared<v1::LoadRequest>();
    if (!ParseRequest(*call, req.get())) return;
    Blocking(call, [this, req]() -> Answer {
      absl::Status s = target_->Load({req->args().begin(), req->args().end()});
      return Reply(ToGrpcStatus(s), v1::LoadResponse());
    });
  } else {
    call->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                              "unknown method " + path + ": the control socket serves " +
                                  "kiln.v1.RuntimeControl"));
  }
}

absl::StatusOr<std::unique_ptr<ControlServer>> ControlServer::Start(const std::string& path,
                                                                    ControlService* service) {
  // Removes a stale socket, binds with umask 0177 and checks the mode.
  auto fd = ListenUnix(path, "--control-socket");
  if (!fd.ok()) return fd.status();
  GrpcH2Server::Options o;
  o.listen_fd = *fd;
  o.flag = "--control-socket";
  o.thread_name = "control";
  // A Load's arguments and a Stats reply are small; 4 MiB is gRPC's usual default.
  o.max_message_bytes = 4LL * 1024 * 1024;
  o.max_concurrent_streams = 64;
  auto server = GrpcH2Server::Start(
      o, [service](std::shared_ptr<GrpcH2Server::Call> call) { service->Serve(std::move(call)); });
  if (!server.ok()) {
    ::close(*fd);
    return server.status();
  }
  return std::unique_ptr<ControlServer>(new ControlServer(std::move(*server), *fd));
}

ControlServer::~ControlServer() { Stop(absl::ZeroDuration()); }

void ControlServer::Stop(absl::Duration grace) {
  if (server_) server_->Stop(grace);
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
}

}  // namespace kiln
