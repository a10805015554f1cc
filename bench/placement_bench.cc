// How the controller's placement scales: Google Benchmark over Place() with N nodes (64 CPUs,
// 8 GPUs of 80 GiB each) and N/2 GPU deployments of 10 replicas (10 GiB, 2 CPUs), i.e. 5
// replicas per node on average:
//   BM_PlaceFromScratch   every replica new (a fresh cluster, or the first tick)
//   BM_PlaceSteadyState   every replica already assigned (the common tick: nothing moves)
//   BM_PlaceAfterNodeLoss steady state minus one node, whose replicas go elsewhere
//   BM_PlaceFromScratchFewDeployments  5 deployments of N replicas each (the same 5 replicas
//                         per node), every replica new: big deployments
//   BM_LoopPlace...       the same two as the controller's loop calls Place: nodes whose
//                         assignment stays as it was are named, not copied (omit_unchanged)
//
//   build/bench/kiln-placement-bench --benchmark_counters_tabular=true
#include <benchmark/benchmark.h>

#include "controller/placement.h"

namespace {

using kiln::PlacementDemand;
using kiln::PlacementNode;

std::vector<PlacementNode> Nodes(int n) {
  std::vector<PlacementNode> nodes(n);
  for (int i = 0; i < n; ++i) {
    PlacementNode& p = nodes[i];
    char name[32];
    std::snprintf(name, sizeof(name), "node-%05d", i);
    p.name = name;
    p.zone = "zone-" + std::to_string(i % 3);
    p.cpu_capacity = 64;
    for (int g = 0; g < 8; ++g) p.gpus.push_back({g, 80LL << 30, true});
    p.load = i % 7;
  }
  return nodes;
}

// `deployments` of 5 * nodes / deployments replicas each (the default: N/2 of 10).
std::vector<PlacementDemand> Demands(int nodes, int deployments = 0) {
  if (deployments <= 0) deployments = nodes / 2;
  const int64_t each = 5LL * nodes / deployments;
  std::vector<PlacementDemand> out;
  for (int i = 0; i < deployments; ++i) {
    PlacementDemand d;
    d.deployment = "dep-" + std::to_string(i);
    d.model = "m" + std::to_string(i);
    d.version = "1";
    d.repository = "/models";
    d.serving = each - each / 10;
    d.warm = each / 10;
    d.gpus = 1;
    d.gpu_memory_bytes = 10LL << 30;
    d.cpus = 2;
    out.push_back(d);
  }
  return out;
}

// The nodes with what a first placement assigned them (placement reads it where it lies).
struct Cluster {
  kiln::PlacementResult placed;
  std::vector<PlacementNode> nodes;
};
std::unique_ptr<Cluster> Assigned(int n) {
  auto c = std::make_unique<Cluster>();
  c->nodes = Nodes(n);
  c->placed = kiln::Place(Demands(n), c->nodes);
  for (auto& node : c->nodes) {
    for (const auto& spec : c->placed.nodes[node.name]) node.assigned.push_back(&spec);
  }
  return c;
}

void Report(benchmark::State& state, int nodes) {
  state.counters["nodes"] = nodes;
  state.counters["replicas"] = nodes / 2 * 10;
}

void BM_PlaceFromScratchFewDeployments(benchmark::State& state) {
  int n = static_cast<int>(state.range(0));
  auto nodes = Nodes(n);
  auto demands = Demands(n, 5);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::Place(demands, nodes));
  Report(state, n);
}
void BM_PlaceFromScratch(benchmark::State& state) {
  int n = static_cast<int>(state.range(0));
  auto nodes = Nodes(n);
  auto demands = Demands(n);
  for (auto _ : state) benchmark::DoNotOptimize(kiln::Place(demands, nodes));
  Report(state, n);
}

// `omit_unchanged`: as the controller's loop calls Place.
void SteadyState(benchmark::State& state, bool omit_unchanged) {
  int n = static_cast<int>(state.range(0));
  auto cluster = Assigned(n);
  auto demands = Demands(n);
  for (auto _ : state) {
    benchmark::DoNotOptimize(kiln::Place(demands, cluster->nodes, {}, {}, {}, omit_unchanged));
  }
  Report(state, n);
}
void AfterNodeLoss(benchmark::State& state, bool omit_unchanged) {
  int n = static_cast<int>(state.range(0));
  auto cluster = Assigned(n);
  auto& nodes = cluster->nodes;
  std::set<std::string> retired;
  for (const auto* spec : nodes[n / 2].assigned) retired.insert(spec->replica_id());
  nodes.erase(nodes.begin() + n / 2);
  auto demands = Demands(n);
  for (auto _ : state) {
    benchmark::DoNotOptimize(kiln::Place(demands, nodes, retired, {}, {}, omit_unchanged));
  }
  Report(state, n);
}
void BM_PlaceSteadyState(benchmark::State& state) { SteadyState(state, false); }
void BM_PlaceAfterNodeLoss(benchmark::State& state) { AfterNodeLoss(state, false); }
void BM_LoopPlaceSteadyState(benchmark::State& state) { SteadyState(state, true); }
void BM_LoopPlaceAfterNodeLoss(benchmark::State& state) { AfterNodeLoss(state, true); }
BENCHMARK(BM_PlaceFromScratch)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlaceFromScratchFewDeployments)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlaceSteadyState)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_PlaceAfterNodeLoss)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoopPlaceSteadyState)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_LoopPlaceAfterNodeLoss)->Arg(100)->Arg(1000)->Arg(10000)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
