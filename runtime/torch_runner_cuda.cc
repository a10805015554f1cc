// The CUDA runner: built only where LibTorch has CUDA (runtime/CMakeLists.txt picks this file
// or torch_runner_nocuda.cc by target).
//
// - Every copy and kernel runs on the replica's own stream from the pool, never the default
//   stream, so the replica overlaps nothing it should not wait for.
// - Inputs are staged through pinned host buffers that grow to the largest request seen and
//   are reused; host-to-device and device-to-host copies are async on that stream, with one
//   synchronisation per batch.
// - With graphs planned, each (batch size, sequence bucket) is run until the model has
//   settled (TorchScript's executor re-optimises on its first runs), then captured into a CUDA
//   graph over static input tensors; all graphs share one memory pool, the largest captured
//   first. Serving copies a batch into the static inputs of the smallest graph that holds it
//   (extra rows keep earlier, valid data and are never read back) and replays it. Shapes
//   without a graph run eagerly.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "runtime/torch_runner.h"

namespace kiln {

namespace {

double MillisSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string Fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.*f", digits, v);
  return buf;
}

class CudaRunner : public TorchRunner {
 public:
  CudaRunner(ForwardFn forward, RunnerOptions options)
      : forward_(std::move(forward)),
        options_(std::move(options)),
        stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/false,
                                             options_.device.index())) {
    for (size_t i = 0; i < options_.inputs.size(); ++i) {
      const auto& dims = options_.inputs[i].dims;
      for (size_t d = 0; d < dims.size(); ++d) {
        if (dims[d] == -1 && seq_input_ < 0) {
          seq_input_ = static_cast<int>(i);
          seq_axis_ = static_cast<int>(d) + 1;
        }
      }
    }
    in_staging_.resize(options_.inputs.size());
    // The weights are on the device already: reported from the load on, not only once
    // Prepare() has captured its graphs.
    memory_bytes_ = ReservedBytes();
  }

  absl::StatusOr<std::vector<at::Tensor>> Run(const std::vector<at::Tensor>& inputs) override {
    runs_waiting_++;
    std::lock_guard<std::mutex> lock(mu_);
    runs_waiting_--;
    c10::cuda::CUDAGuard device_guard(options_.device);
    c10::cuda::CUDAStreamGuard stream_guard(stream_);
    const int64_t rows = inputs.empty() ? 0 : inputs[0].size(0);
    int64_t length = -1;
    if (seq_input_ >= 0 && seq_input_ < static_cast<int>(inputs.size())) {
      length = inputs[seq_input_].size(seq_axis_);
    }
    std::vector<at::Tensor> staged(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) staged[i] = Stage(i, inputs[i]);
    std::vector<GraphShape> chunks = PlanChunks(captured_shapes_, rows, length);
    if (!chunks.empty()) {
      // The batch in graph-sized pieces, all queued on the stream, one synchronisation.
      std::vector<at::Tensor> host;
      int64_t offset = 0;
      for (const GraphShape& c : chunks) {
        Graph& g = graphs_.at({c.batch, c.length});
        const int64_t n = std::min(c.batch, rows - offset);
        for (size_t i = 0; i < staged.size(); ++i) {
          g.inputs[i].narrow(0, 0, n).copy_(staged[i].narrow(0, offset, n), /*non_blocking=*/true);
        }
        g.graph->replay();
        if (host.empty()) {
          for (size_t i = 0; i < g.outputs.size(); ++i) {
            std::vector<int64_t> sizes(g.outputs[i].sizes().begin(), g.outputs[i].sizes().end());
            sizes[0] = rows;
            int64_t bytes = g.outputs[i].element_size();
            for (int64_t d : sizes) bytes *= d;
            host.push_back(OutStaging(i, static_cast<size_t>(bytes))
                               .view(g.outputs[i].scalar_type())
                               .view(sizes));
          }
        }
        for (size_t i = 0; i < g.outputs.size(); ++i) {
          host[i].narrow(0, offset, n).copy_(g.outputs[i].narrow(0, 0, n), /*non_blocking=*/true);
        }
        offset += n;
      }
      stream_.synchronize();
      graph_runs_++;
      return host;
    }
    std::vector<at::Tensor> args;
    args.reserve(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i) {
      at::Tensor x = staged[i].to(options_.device, /*non_blocking=*/true);
      at::ScalarType run = RunType(x.scalar_type(), options_.compute_type);
      if (run != x.scalar_type()) x = x.to(run);
      args.emplace_back(std::move(x));
    }
    auto outs = forward_(args);
    if (!outs.ok()) return outs.status();
    std::vector<at::Tensor> host(outs->size());
    for (size_t i = 0; i < outs->size(); ++i) {
      const at::Tensor& d = (*outs)[i];
      host[i] = OutStaging(i, d.nbytes()).view(d.scalar_type()).view(d.sizes());
      host[i].copy_(d, /*non_blocking=*/true);
    }
    stream_.synchronize();
    eager_runs_++;
    return host;
  }

  absl::StatusOr<std::string> Prepare(const std::function<bool()>& cancelled) override {
    if (options_.graphs.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      memory_bytes_ = ReservedBytes();
      return std::string("cuda stream, pinned staging, no graphs");
    }
    int64_t before = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      before = ReservedBytes();
      pool_ = at::cuda::graph_pool_handle();
    }
    auto t0 = std::chrono::steady_clock::now();
    double warm_ms = 0;
    double capture_ms = 0;
    double slowest_ms = 0;
    GraphShape slowest;
    // Largest first (the plan's order), so smaller graphs reuse the pool memory the largest
    // one sized; no single step below holds the device for more than one forward.
    for (const GraphShape& shape : options_.graphs) {
      auto t_shape = std::chrono::steady_clock::now();
      Graph g;
      std::vector<at::Tensor> args;
      // Every forward and the capture take the lock on their own, never ahead of a batch that
      // waits for it (std::mutex is not fair: relocking at once would starve serving), so a
      // request waits at most one forward of the shape being captured.
      auto step = [&](const std::function<absl::Status()>& fn) -> absl::Status {
        if (cancelled && cancelled()) return absl::CancelledError("cancelled");
        while (runs_waiting_.load() > 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(200));
        }
        std::lock_guard<std::mutex> lock(mu_);
        c10::cuda::CUDAGuard device_guard(options_.device);
        c10::cuda::CUDAStreamGuard stream_guard(stream_);
        absl::Status st = fn();
        stream_.synchronize();
        return st;
      };
      absl::Status st = step([&]() {
        for (const RunnerInput& in : options_.inputs) {
          std::vector<int64_t> sizes = {shape.batch};
          for (int64_t d : in.dims) sizes.push_back(d == -1 ? shape.length : d);
          at::ScalarType type = RunType(in.dtype, options_.compute_type);
          g.inputs.push_back(at::full(sizes, in.fill,
                                      at::TensorOptions().dtype(type).device(options_.device)));
        }
        args = g.inputs;
        return absl::OkStatus();
      });
      if (!st.ok()) return st.code() == absl::StatusCode::kCancelled ? st : Shape(shape, st);
      for (int64_t k = 0; k < options_.graph_warmup_iterations; ++k) {
        st = step([&]() { return forward_(args).status(); });
        if (!st.ok()) return st.code() == absl::StatusCode::kCancelled ? st : Shape(shape, st);
      }
      warm_ms += MillisSince(t_shape);
      auto tc = std::chrono::steady_clock::now();
      st = step([&]() -> absl::Status {
        g.graph = std::make_unique<at::cuda::CUDAGraph>();
        g.graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
        absl::StatusOr<std::vector<at::Tensor>> outs;
        try {
          outs = forward_(args);
        } catch (...) {
          try {
            g.graph->capture_end();
          } catch (...) {
          }
          throw;
        }
        g.graph->capture_end();
        if (!outs.ok()) return outs.status();
        for (at::Tensor& o : *outs) {
          if (!o.is_contiguous()) return absl::InternalError("the captured output is not contiguous");
        }
        g.outputs = std::move(*outs);
        g.graph->replay();
        stream_.synchronize();
        graphs_[{shape.batch, shape.length}] = std::move(g);
        captured_shapes_.push_back(shape);
        memory_bytes_ = ReservedBytes();
        return absl::OkStatus();
      });
      if (!st.ok()) return st.code() == absl::StatusCode::kCancelled ? st : Shape(shape, st);
      capture_ms += MillisSince(tc);
      if (MillisSince(t_shape) > slowest_ms) {
        slowest_ms = MillisSince(t_shape);
        slowest = shape;
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    return std::to_string(captured_shapes_.size()) + " cuda graphs in " +
           Fixed(MillisSince(t0), 1) + " ms (warm-up " + Fixed(warm_ms, 1) + " ms, capture " +
           Fixed(capture_ms, 1) + " ms; slowest " + std::to_string(slowest.batch) + "x" +
           std::to_string(slowest.length) + " " + Fixed(slowest_ms, 1) + " ms), graph memory " +
           Fixed((memory_bytes_ - before) / 1048576.0, 1) + " MiB";
  }

  int64_t DeviceMemoryBytes() const override { return memory_bytes_.load(); }

  std::string Describe() const override {
    std::string attention;
    for (const std::string& k : options_.attention) {
      attention += (attention.empty() ? ", attention kernels " : "+") + k;
    }
    return "cuda stream " + std::to_string(stream_.id()) + ", pinned staging" +
           (options_.graphs.empty() ? ", no graphs"
                                    : ", " + std::to_string(options_.graphs.size()) +
                                          " cuda graphs planned") +
           attention;
  }

 private:
  struct Graph {
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    std::vector<at::Tensor> inputs;   // static, on the device
    std::vector<at::Tensor> outputs;  // static, in the graph pool
  };

  absl::Status Shape(const GraphShape& s, absl::Status st) {
    return absl::Status(st.code(), "instance.cuda_graphs: batch " + std::to_string(s.batch) +
                                       " x length " + std::to_string(s.length) + ": " +
                                       std::string(st.message()));
  }

  int64_t ReservedBytes() const {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(options_.device.index());
    return stats.reserved_bytes[0].current;  // [0] = the aggregate over all pools
  }

  static at::Tensor Grow(at::Tensor& buf, size_t bytes) {
    if (!buf.defined() || static_cast<size_t>(buf.numel()) < bytes) {
      size_t cap = std::max<size_t>(bytes, buf.defined() ? 2 * buf.numel() : 4096);
      buf = at::empty({static_cast<int64_t>(cap)},
                      at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    return buf.narrow(0, 0, static_cast<int64_t>(bytes));
  }

  // The request's bytes, copied into this input's pinned buffer (the previous batch's copies
  // finished at its synchronisation, so the buffer is free).
  at::Tensor Stage(size_t i, const at::Tensor& host) {
    at::Tensor src = host.contiguous();
    at::Tensor bytes = Grow(in_staging_[i], src.nbytes());
    std::memcpy(bytes.data_ptr(), src.data_ptr(), src.nbytes());
    return bytes.view(src.scalar_type()).view(src.sizes());
  }

  at::Tensor OutStaging(size_t i, size_t bytes) {
    if (out_staging_.size() <= i) out_staging_.resize(i + 1);
    return Grow(out_staging_[i], bytes);
  }

  ForwardFn forward_;
  RunnerOptions options_;
  c10::cuda::CUDAStream stream_;
  int seq_input_ = -1;
  int seq_axis_ = -1;

  std::mutex mu_;
  std::atomic<int> runs_waiting_{0};
  std::vector<at::Tensor> in_staging_;
  std::vector<at::Tensor> out_staging_;
  decltype(at::cuda::graph_pool_handle()) pool_{0, 0};
  std::map<std::pair<int64_t, int64_t>, Graph> graphs_;
  std::vector<GraphShape> captured_shapes_;
  std::atomic<int64_t> memory_bytes_{0};
  uint64_t graph_runs_ = 0;
  uint64_t eager_runs_ = 0;
};

// instance.attention: the scaled_dot_product_attention kernels LibTorch may choose from. The
// switches are LibTorch's process-wide ones (a runtime serves one model); its own order of
// preference among the allowed kernels stands.
void AllowAttentionKernels(const std::vector<std::string>& kernels) {
  if (kernels.empty()) return;
  auto allowed = [&](const char* name) {
    return std::find(kernels.begin(), kernels.end(), name) != kernels.end();
  };
  at::Context& ctx = at::globalContext();
  ctx.setSDPUseCuDNN(allowed("cudnn"));
  ctx.setSDPUseFlash(allowed("flash"));
  ctx.setSDPUseMemEfficient(allowed("efficient"));
  ctx.setSDPUseMath(allowed("math"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<TorchRunner>> MakeCudaRunner(ForwardFn forward,
                                                            RunnerOptions options) {
  if (!options.device.is_cuda()) {
    return absl::InvalidArgumentError("the cuda runner needs a cuda device, got " +
                                      options.device.str());
  }
  AllowAttentionKernels(options.attention);
  return std::unique_ptr<TorchRunner>(
      new CudaRunner(std::move(forward), std::move(options)));
}

bool CudaRunnerBuiltIn() { return true; }

}  // namespace kiln
