// kiln-status-sim: many simulated agents speaking the real kiln.v1.ControlPlane protocol to a
// running kiln-controller over loopback: each registers (8 GPUs, its replicas) and then sends
// a Status every period, as kiln-agent does. It measures the controller's CPU over the run
// from /proc/PID/stat (cores = CPU seconds / wall seconds) and its own, and prints one JSON
// line.
//
//   kiln-status-sim --controller 127.0.0.1:7071 --controller-pid PID --nodes 1000
//       --replicas-per-node 5 --seconds 20 [--admin http://127.0.0.1:PORT --deployments 100]
//
// With --deployments D, once every node has registered it creates D ModelDeployments through
// the admin API whose replicas are exactly the ones the nodes report (node i's belong to
// deployment i % D), so each tick of the controller places, rolls out, routes and writes the
// status of real deployments; at the end it reads their readyReplicas back.
//
// Streams are spread over --channels connections; one thread writes every stream's Status in
// turn each period. Nobody reads what the controller sends (a thread per stream to read would
// cost the simulator more than the controller): with --deployments the unread assignments and
// routing tables make the connections fail after about 20 s ("Connection reset by peer"; the
// first failed round and the reason are printed), so measure 15-20 s.

#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/admin_client.h"
#include "kiln/v1/control_plane.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace {

using Clock = std::chrono::steady_clock;

// utime + stime of `pid`, in seconds (0 when unreadable).
double CpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(sysconf(_SC_CLK_TCK));
}

kiln::v1::ReplicaStatus Replica(int node, int r, int deployments) {
  kiln::v1::ReplicaStatus s;
  s.set_replica_id("sim" + std::to_string(node % deployments) + "." +
                   std::to_string(node * 8 + r));
  // One model per deployment: a model name is served by one deployment (others are refused).
  s.set_model("m" + std::to_string(node % deployments));
  s.set_version("1");
  s.set_device("cuda:" + std::to_string(r % 8));
  s.set_state(kiln::v1::SERVING);
  s.set_healthy(true);
  s.set_pid(10000 + r);
  s.set_cpus(std::to_string(2 * r) + "-" + std::to_string(2 * r + 1));
  s.set_gpu_memory_bytes(10LL << 30);
  s.set_measured_gpu_memory_bytes(9LL << 30);
  return s;
}


}  // namespace

int main(int argc, char** argv) {
  std::string address;
  int controller_pid = 0;
  int nodes = 1000;
  int replicas = 5;
  int channels = 64;
  double seconds = 20;
  double period_s = 1.0;
  std::string admin;
  int deployments = 0;
  CLI::App app{"kiln-status-sim: simulated agents reporting Status to kiln-controller"};
  app.add_option("--controller", address, "ControlPlane HOST:PORT (loopback)")->required();
  app.add_option("--controller-pid", controller_pid, "The controller's PID (for its CPU)")
      ->required();
  app.add_option("--nodes", nodes, "Simulated agents")->check(CLI::Range(1, 100000));
  app.add_option("--replicas-per-node", replicas, "Replicas each reports")
      ->check(CLI::Range(0, 64));
  app.add_option("--channels", channels, "Connections the streams share")
      ->check(CLI::Range(1, 4096));
  app.add_option("--seconds", seconds, "Measured time after all registered")
      ->check(CLI::Range(1.0, 3600.0));
  app.add_option("--period-seconds", period_s, "Status period of each agent")
      ->check(CLI::Range(0.05, 60.0));
  app.add_option("--admin", admin, "The controller's admin API, http://127.0.0.1:PORT");
  app.add_option("--deployments", deployments,
                 "ModelDeployments to create for the reported replicas (needs --admin)")
      ->check(CLI::Range(0, 100000));
  CLI11_PARSE(app, argc, argv);
  if (deployments > 0 && admin.rfind("http://127.", 0) != 0) {
    std::cerr << "--deployments: needs --admin http://127.x.x.x:PORT (loopback only)\n";
    return 2;
  }
  if (deployments > nodes) {
    std::cerr << "--deployments: at most --nodes (" << nodes << ")\n";
    return 2;
  }
  const int groups = deployments > 0 ? deployments : 997;
  if (address.rfind("127.", 0) != 0 && address.rfind("localhost", 0) != 0) {
    std::cerr << "--controller: loopback addresses only\n";
    return 2;
  }

  std::vector<std::shared_ptr<grpc::Channel>> chans;
  for (int i = 0; i < channels; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("grpc.channel_id", i);  // distinct connections, not one shared subchannel
    chans.push_back(grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  struct Agent {
    std::unique_ptr<kiln::v1::ControlPlane::Stub> stub;
    std::unique_ptr<grpc::ClientContext> ctx;
    std::unique_ptr<grpc::ClientReaderWriter<kiln::v1::AgentMessage, kiln::v1::ControllerMessage>>
        stream;
    kiln::v1::AgentMessage status;
    bool broken = false;  // a write failed: the stream is gone
  };
  std::vector<Agent> agents(nodes);
  auto t_reg = Clock::now();
  for (int i = 0; i < nodes; ++i) {
    Agent& a = agents[i];
    a.stub = kiln::v1::ControlPlane::NewStub(chans[i % channels]);
    a.ctx = std::make_unique<grpc::ClientContext>();
    a.stream = a.stub->Connect(a.ctx.get());
    kiln::v1::AgentMessage reg;
    auto* r = reg.mutable_register_();
    r->set_node_name("sim-" + std::to_string(i));
    r->set_cpu_capacity(64);
    (*r->mutable_labels())["topology.kubernetes.io/zone"] = "zone-" + std::to_string(i % 3);
    for (int g = 0; g < 8; ++g) {
      auto* gi = r->add_gpus();
      gi->set_index(g);
      gi->set_memory_bytes(80LL << 30);
      gi->set_fake(true);
    }
    for (int k = 0; k < replicas; ++k) *r->add_replicas() = Replica(i, k, groups);
    if (!a.stream->Write(reg)) {
      std::cerr << "register sim-" << i << ": the stream broke: " << a.stream->Finish().error_message()
                << "\n";
      return 1;
    }
    auto* st = a.status.mutable_status();
    for (int k = 0; k < replicas; ++k) {
      auto* rs = st->add_replicas();
      *rs = Replica(i, k, groups);
      rs->mutable_load()->set_qps(50);
      rs->mutable_load()->set_in_flight(1);
      rs->mutable_load()->set_latency_p99_micros(4000);
    }
    for (int g = 0; g < 8; ++g) {
      auto* gs = st->add_gpus();
      gs->set_index(g);
      gs->set_healthy(true);
    }
  }
  const double register_s = std::chrono::duration<double>(Clock::now() - t_reg).count();
  for (int d = 0; d < deployments; ++d) {
    const int members = nodes / deployments + (d < nodes % deployments ? 1 : 0);
    nlohmann::json md = {
        {"apiVersion", "serving.kiln.dev/v1alpha1"},
        {"kind", "ModelDeployment"},
        {"metadata", {{"name", "sim" + std::to_string(d)}}},
        {"spec",
         {{"model", {{"name", "m" + std::to_string(d)}, {"version", "1"},
                     {"uri", "file:///models/m" + std::to_string(d) + "/1/model.pt"}}},
          {"replicas", members * replicas},
          {"warmPool", 0},
          {"resources", {{"gpus", 1}, {"gpuMemory", "10Gi"}, {"cpus", 2}}}}}};
    if (kiln::bench::AdminCall(admin, web::http::methods::POST, kiln::bench::kDeploymentsPath,
                               md.dump())
            .is_null()) {
      return 1;
    }
  }

  const double ctl0 = CpuSeconds(controller_pid), self0 = CpuSeconds(getpid());
  auto t0 = Clock::now();
  uint64_t sent = 0, failed = 0, late_rounds = 0, rounds = 0;
  uint64_t requests = 0;
  int64_t first_failed_round = -1;
  for (auto next = t0; std::chrono::duration<double>(Clock::now() - t0).count() < seconds;) {
    requests += 50;
    for (Agent& a : agents) {
      for (auto& rs : *a.status.mutable_status()->mutable_replicas()) {
        rs.mutable_load()->set_requests(requests);
      }
      if (a.broken) continue;
      if (a.stream->Write(a.status)) {
        sent++;
      } else {
        failed++;
        a.broken = true;
        if (first_failed_round < 0) first_failed_round = static_cast<int64_t>(rounds);
      }
    }
    rounds++;
    next += std::chrono::microseconds(static_cast<int64_t>(period_s * 1e6));
    if (Clock::now() > next) {
      late_rounds++;  // a round took longer than the period: the simulator is the bottleneck
    } else {
      std::this_thread::sleep_until(next);
    }
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  const double ctl = CpuSeconds(controller_pid) - ctl0, self = CpuSeconds(getpid()) - self0;
  int64_t ready = -1;  // what the controller's status says serves, over all deployments
  if (deployments > 0) {
    nlohmann::json list =
        kiln::bench::AdminCall(admin, web::http::methods::GET, kiln::bench::kDeploymentsPath);
    if (list.is_object() && list.contains("items")) {
      ready = 0;
      for (const auto& item : list["items"]) {
        if (item.contains("status")) ready += item["status"].value("readyReplicas", 0);
      }
    }
  }
  std::string first_error;  // why the first broken stream ended, as the controller said
  for (Agent& a : agents) {
    if (a.broken && first_error.empty()) {
      grpc::Status st = a.stream->Finish();
      first_error = std::to_string(st.error_code()) + ": " + st.error_message();
    }
  }
  for (Agent& a : agents) {
    a.ctx->TryCancel();
  }

  nlohmann::json out = {{"nodes", nodes},
                        {"replicas", nodes * replicas},
                        {"deployments", deployments},
                        {"ready_replicas_in_status", ready},
                        {"period_s", period_s},
                        {"register_s", register_s},
                        {"measured_s", wall},
                        {"status_messages", sent},
                        {"status_per_s", sent / wall},
                        {"failed_writes", failed},
                        {"first_failed_round", first_failed_round},
                        {"first_error", first_error},
                        {"rounds", rounds},
                        {"late_rounds", late_rounds},
                        {"controller_cores", ctl / wall},
                        {"simulator_cores", self / wall}};
  std::cout << out.dump() << std::endl;
  return failed == 0 ? 0 : 1;
}
