#include "agent/inference_prober.h"

#include <set>
#include <utility>

#include <grpcpp/create_channel.h>

#include "common/grpc_status.h"
#include "common/oip_parameters.h"
#include "inference/grpc_service.grpc.pb.h"

namespace kiln {

namespace {

size_t ElementSize(const std::string& dt) {
  if (dt == "BOOL" || dt == "INT8" || dt == "UINT8") return 1;
  if (dt == "INT16" || dt == "UINT16" || dt == "FP16" || dt == "BF16") return 2;
  if (dt == "INT32" || dt == "UINT32" || dt == "FP32") return 4;
  return 8;
}

class GrpcInferenceProber : public InferenceProber {
 public:
  explicit GrpcInferenceProber(absl::Duration timeout) : timeout_(timeout) {}

  absl::Status Probe(const std::string& address, const std::string& model) override {
    // One deadline for the whole probe (metadata and inference), so that it takes at most its
    // timeout, and CancelAll() can end it sooner.
    const absl::Time deadline = absl::Now() + timeout_;
    auto stub = inference::GRPCInferenceService::NewStub(
        grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
    inference::ModelInferRequest req;
    // Per address and model: a port freed by one replica may be bound by another.
    const std::string key = address + "\n" + model;
    {
      absl::MutexLock lock(&mu_);
      auto it = requests_.find(key);
      if (it != requests_.end()) req = it->second;
    }
    if (req.inputs_size() == 0) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      Live live(this, &ctx);
      if (!live.ok()) return Cancelled();
      inference::ModelMetadataRequest mreq;
      mreq.set_name(model);
      inference::ModelMetadataResponse meta;
      grpc::Status s = stub->ModelMetadata(&ctx, mreq, &meta);
      if (!s.ok()) return FromGrpcStatus(s);
      req.set_model_name(model);
      req.set_id("kiln-health-probe");
      // A probe runs the model: never answered from the response cache, ahead of the queue's
      // other requests (priority 1 is the highest level), and given the probe's own time
      // rather than the model's default queue timeout, so a busy replica is not taken for a
      // broken one.
      auto& params = *req.mutable_parameters();
      params[kSkipCacheParameter].set_bool_param(true);
      params["priority"].set_int64_param(1);
      params["timeout"].set_int64_param(absl::ToInt64Microseconds(timeout_));
      for (const auto& in : meta.inputs()) {
        auto* t = req.add_inputs();
        t->set_name(in.name());
        t->set_datatype(in.datatype());
        int64_t n = 1;
        for (int64_t d : in.shape()) {
          int64_t dim = d < 0 ? 1 : d;
          t->add_shape(dim);
          n *= dim;
        }
        req.add_raw_input_contents(std::string(static_cast<size_t>(n) * ElementSize(in.datatype()), '\0'));
      }
      absl::MutexLock lock(&mu_);
      // Bounded: replicas come and go (new ports); a forgotten one reads its metadata again.
      if (requests_.size() >= 1024) requests_.clear();
      requests_[key] = req;
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    Live live(this, &ctx);
    if (!live.ok()) return Cancelled();
    inference::ModelInferResponse resp;
    grpc::Status s = stub->ModelInfer(&ctx, req, &resp);
    if (s.error_code() == grpc::StatusCode::INVALID_ARGUMENT ||
        s.error_code() == grpc::StatusCode::NOT_FOUND) {
      // The request no longer fits what serves there (another version, another replica):
      // the next probe reads the metadata again.
      absl::MutexLock lock(&mu_);
      requests_.erase(key);
    }
    return FromGrpcStatus(s);
  }

  void CancelAll() override {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* ctx : live_) ctx->TryCancel();
  }

 private:
  static absl::Status Cancelled() { return absl::CancelledError("the agent is stopping"); }

  // A call under way, which CancelAll() cancels; none starts after it.
  class Live {
   public:
    Live(GrpcInferenceProber* p, grpc::ClientContext* ctx) : p_(p), ctx_(ctx) {
      absl::MutexLock lock(&p_->mu_);
      ok_ = !p_->cancelled_;
      if (ok_) p_->live_.insert(ctx_);
    }
    ~Live() {
      absl::MutexLock lock(&p_->mu_);
      p_->live_.erase(ctx_);
    }
    bool ok() const { return ok_; }

   private:
    GrpcInferenceProber* p_;
    grpc::ClientContext* ctx_;
    bool ok_ = false;
  };

  absl::Duration timeout_;
  absl::Mutex mu_;
  std::map<std::string, inference::ModelInferRequest> requests_ ABSL_GUARDED_BY(mu_);
  std::set<grpc::ClientContext*> live_ ABSL_GUARDED_BY(mu_);
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::unique_ptr<InferenceProber> MakeGrpcInferenceProber(absl::Duration timeout) {
  return std::make_unique<GrpcInferenceProber>(timeout);
}

ProbeRunner::ProbeRunner(InferenceProber* prober, int threads) : prober_(prober) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Work(); });
}

ProbeRunner::~ProbeRunner() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    jobs_.clear();
  }
  if (!threads_.empty()) prober_->CancelAll();  // the probes under way end now
  for (auto& t : threads_) t.join();
}

void ProbeRunner::Submit(uint64_t token, std::string address, std::string model) {
  Job job{token, std::move(address), std::move(model)};
  if (threads_.empty()) {
    Run(job);
    return;
  }
  absl::MutexLock lock(&mu_);
  jobs_.push_back(std::move(job));
}

std::vector<ProbeRunner::Result> ProbeRunner::Take() {
  absl::MutexLock lock(&mu_);
  return std::exchange(results_, {});
}

void ProbeRunner::Run(const Job& job) {
  absl::Status status;
  try {
    status = prober_->Probe(job.address, job.model);
  } catch (const std::exception& e) {
    status = absl::InternalError(std::string("the probe failed: ") + e.what());
  }
  absl::MutexLock lock(&mu_);
  results_.push_back({job.token, std::move(status)});
}

void ProbeRunner::Work() {
  for (;;) {
    Job job;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !jobs_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    Run(job);
  }
}

}  // namespace kiln
