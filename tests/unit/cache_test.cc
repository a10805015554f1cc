#include "runtime/response_cache.h"

#include "gtest/gtest.h"

namespace kiln {
namespace {

std::vector<Tensor> Out(size_t bytes) {
  Tensor t;
  t.name = "y";
  t.dtype = DataType::kUint8;
  t.shape = {static_cast<int64_t>(bytes)};
  t.data.assign(bytes, 'x');
  return {t};
}

std::vector<Tensor> In(char c) {
  Tensor t;
  t.name = "x";
  t.dtype = DataType::kUint8;
  t.shape = {4};
  t.data.assign(4, c);
  return {t};
}

TEST(ResponseCacheTest, HitAfterInsertAndCountsMisses) {
  ResponseCache cache(1 << 20);
  std::string k = ResponseCache::Key("m", "1", In('a'));
  EXPECT_FALSE(cache.Lookup(k).has_value());
  cache.Insert(k, Out(10));
  auto hit = cache.Lookup(k);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ((*hit)[0].data, std::string(10, 'x'));
  auto c = cache.counters();
  EXPECT_EQ(c.hits, 1u);
  EXPECT_EQ(c.misses, 1u);
  EXPECT_EQ(c.entries, 1);
}

TEST(ResponseCacheTest, KeyCoversModelVersionAndInputs) {
  EXPECT_NE(ResponseCache::Key("m", "1", In('a')), ResponseCache::Key("m", "2", In('a')));
  EXPECT_NE(ResponseCache::Key("m", "1", In('a')), ResponseCache::Key("n", "1", In('a')));
  EXPECT_NE(ResponseCache::Key("m", "1", In('a')), ResponseCache::Key("m", "1", In('b')));
  auto reshaped = In('a');
  reshaped[0].shape = {2, 2};
  EXPECT_NE(ResponseCache::Key("m", "1", In('a')), ResponseCache::Key("m", "1", reshaped));
}

TEST(ResponseCacheTest, EvictsLeastRecentlyUsedWithinBytes) {
  std::string a = ResponseCache::Key("m", "1", In('a'));
  std::string b = ResponseCache::Key("m", "1", In('b'));
  std::string c = ResponseCache::Key("m", "1", In('c'));
  // Room for two entries of this size, not three.
  int64_t one = static_cast<int64_t>(a.size()) * 2 + 100 + 1 + 8;
  ResponseCache cache(one * 2 + 10);
  cache.Insert(a, Out(100));
  cache.Insert(b, Out(100));
  ASSERT_TRUE(cache.Lookup(a).has_value());  // a is now the most recent
  cache.Insert(c, Out(100));                 // evicts b
  EXPECT_TRUE(cache.Lookup(a).has_value());
  EXPECT_FALSE(cache.Lookup(b).has_value());
  EXPECT_TRUE(cache.Lookup(c).has_value());
  auto counters = cache.counters();
  EXPECT_EQ(counters.evictions, 1u);
  EXPECT_LE(counters.bytes, one * 2 + 10);
}

TEST(ResponseCacheTest, EntryLargerThanCacheIsNotStored) {
  ResponseCache cache(64);
  std::string k = ResponseCache::Key("m", "1", In('a'));
  cache.Insert(k, Out(1000));
  EXPECT_FALSE(cache.Lookup(k).has_value());
  EXPECT_EQ(cache.counters().bytes, 0);
}

}  // namespace
}  // namespace kiln
