#include "runtime/response_cache.h"

namespace kiln {

std::string ResponseCache::Key(const std::string& model, const std::string& version,
                               const std::vector<Tensor>& inputs) {
  size_t n = model.size() + version.size() + 2;
  for (const auto& t : inputs) n += t.name.size() + t.data.size() + 16 + 8 * t.shape.size();
  std::string key;
  key.reserve(n);
  auto put_len = [&key](uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  put_len(model.size());
  key += model;
  put_len(version.size());
  key += version;
  for (const auto& t : inputs) {
    put_len(t.name.size());
    key += t.name;
    key += DataTypeName(t.dtype);
    put_len(t.shape.size());
    for (int64_t d : t.shape) put_len(static_cast<uint64_t>(d));
    put_len(t.data.size());
    key += t.data;
  }
  return key;
}

int64_t ResponseCache::SizeOf(const std::string& key, const std::vector<Tensor>& outputs) {
  int64_t n = static_cast<int64_t>(key.size()) * 2;  // the list entry and the index both hold it
  for (const auto& t : outputs) {
    n += static_cast<int64_t>(t.data.size() + t.name.size() + 8 * t.shape.size());
  }
  return n;
}

std::optional<std::vector<Tensor>> ResponseCache::Lookup(const std::string& key) {
  absl::MutexLock lock(&mu_);
  auto it = index_.find(key);
  if (it == index_.end()) {
    counters_.misses++;
    return std::nullopt;
  }
  counters_.hits++;
  lru_.splice(lru_.begin(), lru_, it->second);
  return it->second->outputs;
}

void ResponseCache::Insert(const std::string& key, const std::vector<Tensor>& outputs) {
  int64_t bytes = SizeOf(key, outputs);
  if (bytes > max_bytes_) return;
  absl::MutexLock lock(&mu_);
  if (auto it = index_.find(key); it != index_.end()) {
    counters_.bytes -= it->second->bytes;
    lru_.erase(it->second);
    index_.erase(it);
  }
  while (!lru_.empty() && counters_.bytes + bytes > max_bytes_) {
    Entry& victim = lru_.back();
    counters_.bytes -= victim.bytes;
    counters_.evictions++;
    index_.erase(victim.key);
    lru_.pop_back();
  }
  lru_.push_front(Entry{key, outputs, bytes});
  index_[key] = lru_.begin();
  counters_.bytes += bytes;
  counters_.entries = static_cast<int64_t>(lru_.size());
}

ResponseCache::Counters ResponseCache::counters() const {
  absl::MutexLock lock(&mu_);
  Counters c = counters_;
  c.entries = static_cast<int64_t>(lru_.size());
  return c;
}

}  // namespace kiln
