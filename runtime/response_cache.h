#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "runtime/tensor.h"

namespace kiln {

// An LRU cache of model outputs bounded in bytes (keys and values both count). Thread-safe.
class ResponseCache {
 public:
  explicit ResponseCache(int64_t max_bytes) : max_bytes_(max_bytes) {}

  // The exact key of a request: model, version and every input's name, type, shape and bytes.
  static std::string Key(const std::string& model, const std::string& version,
                         const std::vector<Tensor>& inputs);

  std::optional<std::vector<Tensor>> Lookup(const std::string& key);
  // Entries larger than the whole cache are not stored.
  void Insert(const std::string& key, const std::vector<Tensor>& outputs);

  struct Counters {
    uint64_t hits = 0;
    uint64_t misses = 0;
    uint64_t evictions = 0;
    int64_t bytes = 0;
    int64_t entries = 0;
  };
  Counters counters() const;

 private:
  struct Entry {
    std::string key;
    std::vector<Tensor> outputs;
    int64_t bytes = 0;
  };
  static int64_t SizeOf(const std::string& key, const std::vector<Tensor>& outputs);

  const int64_t max_bytes_;
  mutable absl::Mutex mu_;
  std::list<Entry> lru_ ABSL_GUARDED_BY(mu_);  // front = most recently used
  std::unordered_map<std::string, std::list<Entry>::iterator> index_ ABSL_GUARDED_BY(mu_);
  Counters counters_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kiln
