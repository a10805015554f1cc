// The embedded SQLite store: real SQLite files in a temporary directory.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "common/clock.h"
#include "controller/sqlite_store.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

constexpr char kKind[] = "ModelDeployment";

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("kiln-store-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::remove_all(dir_);
    store_ = OpenStore();
  }
  void TearDown() override {
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::unique_ptr<SqliteStore> OpenStore(int64_t retention = 10000) {
    SqliteStore::Options o;
    o.state_dir = dir_;
    o.event_retention = retention;
    auto s = SqliteStore::Open(o, &clock_);
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  SimulatedClock clock_{absl::FromUnixSeconds(1800000000)};
  std::string dir_;
  std::unique_ptr<SqliteStore> store_;
};

TEST_F(StoreTest, CreateGetListAndVersions) {
  auto a = store_->Create(kKind, "b-model", R"({"replicas":1})");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->generation, 1);
  EXPECT_EQ(a->resource_version, 1);
  EXPECT_EQ(a->status, "{}");
  EXPECT_EQ(a->created_unix_micros, absl::ToUnixMicros(absl::FromUnixSeconds(1800000000)));
  EXPECT_FALSE(a->uid.empty());
  auto b = store_->Create(kKind, "a-model", R"({"replicas":2})");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->resource_version, 2);
  EXPECT_NE(a->uid, b->uid);

  auto again = store_->Create(kKind, "a-model", "{}");
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists);
  auto got = store_->Get(kKind, "b-model");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->spec, R"({"replicas":1})");
  EXPECT_EQ(store_->Get(kKind, "nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Get("Node", "a-model").status().code(), absl::StatusCode::kNotFound);
  auto list = store_->List(kKind);
  ASSERT_TRUE(list.ok());
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].name, "a-model");  // sorted by name
  EXPECT_EQ(*store_->CurrentResourceVersion(), 2);
  EXPECT_EQ(store_->Create(kKind, "", "{}").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(StoreTest, OptimisticConcurrencyAndGenerations) {
  auto a = store_->Create(kKind, "m", R"({"v":1})");
  ASSERT_TRUE(a.ok());
  auto b = store_->Update(kKind, "m", R"({"v":2})", a->resource_version);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->generation, 2);
  EXPECT_GT(b->resource_version, a->resource_version);
  // A writer still holding the old version loses, and is told to re-read.
  auto stale = store_->Update(kKind, "m", R"({"v":3})", a->resource_version);
  EXPECT_EQ(stale.status().code(), absl::StatusCode::kAborted);
  EXPECT_NE(stale.status().message().find("modified"), std::string::npos);
  // 0 = unconditional.
  auto c = store_->Update(kKind, "m", R"({"v":3})", 0);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->generation, 3);
  // The same spec again changes nothing: no version, no event.
  int64_t before = *store_->CurrentResourceVersion();
  auto same = store_->Update(kKind, "m", R"({"v":3})", 0);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(same->resource_version, c->resource_version);
  EXPECT_EQ(*store_->CurrentResourceVersion(), before);
  // Status writes keep the generation.
  auto st = store_->UpdateStatus(kKind, "m", R"({"readyReplicas":1})", c->resource_version);
  ASSERT_TRUE(st.ok());
  EXPECT_EQ(st->generation, 3);
  EXPECT_EQ(st->spec, R"({"v":3})");
  EXPECT_EQ(store_->UpdateStatus(kKind, "m", "{}", c->resource_version).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(store_->Update(kKind, "gone", "{}", 0).status().code(), absl::StatusCode::kNotFound);
  // Delete with a stale version is refused, with the current one it goes.
  EXPECT_EQ(store_->Delete(kKind, "m", c->resource_version).code(), absl::StatusCode::kAborted);
  EXPECT_TRUE(store_->Delete(kKind, "m", st->resource_version).ok());
  EXPECT_EQ(store_->Get(kKind, "m").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Delete(kKind, "m", 0).code(), absl::StatusCode::kNotFound);
}

TEST_F(StoreTest, EventsReplayEveryChangeInOrder) {
  auto a = store_->Create(kKind, "m", "{}");
  ASSERT_TRUE(store_->Update(kKind, "m", R"({"x":1})", 0).ok());
  ASSERT_TRUE(store_->UpdateStatus(kKind, "m", R"({"ok":true})", 0).ok());
  ASSERT_TRUE(store_->Delete(kKind, "m", 0).ok());
  auto events = store_->EventsSince(0, 100);
  ASSERT_TRUE(events.ok()) << events.status();
  ASSERT_EQ(events->size(), 4u);
  EXPECT_EQ((*events)[0].type, WatchEvent::Type::kAdded);
  EXPECT_EQ((*events)[1].type, WatchEvent::Type::kModified);
  EXPECT_EQ((*events)[1].object.spec, R"({"x":1})");
  EXPECT_EQ((*events)[2].object.status, R"({"ok":true})");
  EXPECT_EQ((*events)[3].type, WatchEvent::Type::kDeleted);
  EXPECT_EQ((*events)[3].object.name, "m");
  for (size_t i = 0; i < events->size(); ++i) {
    EXPECT_EQ((*events)[i].resource_version, static_cast<int64_t>(i) + 1);
  }
  auto tail = store_->EventsSince(2, 100);
  ASSERT_TRUE(tail.ok());
  EXPECT_EQ(tail->size(), 2u);
  auto limited = store_->EventsSince(0, 1);
  ASSERT_TRUE(limited.ok());
  EXPECT_EQ(limited->size(), 1u);
  EXPECT_EQ(store_->EventsSince(-1, 10).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_STREQ(WatchEventTypeName(WatchEvent::Type::kDeleted), "DELETED");
}

TEST_F(StoreTest, AWatcherTooFarBehindIsToldToListAgain) {
  store_ = OpenStore(/*retention=*/3);
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(store_->Create(kKind, "m" + std::to_string(i), "{}").ok());
  }
  auto old = store_->EventsSince(1, 100);
  EXPECT_EQ(old.status().code(), absl::StatusCode::kOutOfRange);  // 410 Gone
  EXPECT_NE(old.status().message().find("list again"), std::string::npos);
  auto recent = store_->EventsSince(3, 100);
  ASSERT_TRUE(recent.ok()) << recent.status();
  EXPECT_EQ(recent->size(), 3u);
}

TEST_F(StoreTest, WaitForChangeWakesOnAWrite) {
  int64_t rv = *store_->CurrentResourceVersion();
  EXPECT_FALSE(store_->WaitForChange(rv, absl::Milliseconds(1)));
  std::thread writer([this]() { ASSERT_TRUE(store_->Create(kKind, "m", "{}").ok()); });
  EXPECT_TRUE(store_->WaitForChange(rv, absl::Seconds(10)));
  writer.join();
}

TEST_F(StoreTest, EverythingSurvivesReopening) {
  ASSERT_TRUE(store_->Create(kKind, "a", R"({"v":1})").ok());
  ASSERT_TRUE(store_->Create(kKind, "b", R"({"v":1})").ok());
  ASSERT_TRUE(store_->Update(kKind, "a", R"({"v":2})", 0).ok());
  ASSERT_TRUE(store_->Delete(kKind, "b", 0).ok());
  auto a_before = store_->Get(kKind, "a");
  store_.reset();
  store_ = OpenStore();
  auto a = store_->Get(kKind, "a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->spec, R"({"v":2})");
  EXPECT_EQ(a->generation, 2);
  EXPECT_EQ(a->uid, a_before->uid);
  EXPECT_EQ(store_->Get(kKind, "b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(*store_->CurrentResourceVersion(), 4);
  // Versions keep counting from where they were.
  auto c = store_->Create(kKind, "c", "{}");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->resource_version, 5);
  EXPECT_EQ(store_->EventsSince(0, 100)->size(), 5u);
}

// Operators' events: kept across a reopen, listed oldest first per object (the newest
// `limit`), pruned to the newest `object_event_retention`.
TEST_F(StoreTest, EventsAreKeptListedAndPruned) {
  for (int i = 0; i < 3; ++i) {
    clock_.Advance(absl::Seconds(1));
    store_->RecordEvent(kKind, "a", "Normal", "RolloutStep", "a step " + std::to_string(i));
    store_->RecordEvent(kKind, "b", "Warning", "RolledBack", "b back " + std::to_string(i));
  }
  auto a = store_->ListEvents(kKind, "a", 100);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->size(), 3u);
  EXPECT_EQ((*a)[0].message, "a step 0");
  EXPECT_EQ((*a)[2].message, "a step 2");
  EXPECT_EQ((*a)[2].reason, "RolloutStep");
  EXPECT_EQ((*a)[2].type, "Normal");
  EXPECT_EQ((*a)[2].unix_micros, absl::ToUnixMicros(absl::FromUnixSeconds(1800000003)));
  auto newest_two = store_->ListEvents(kKind, "", 2);
  ASSERT_TRUE(newest_two.ok());
  ASSERT_EQ(newest_two->size(), 2u);
  EXPECT_EQ((*newest_two)[0].message, "a step 2");
  EXPECT_EQ((*newest_two)[1].message, "b back 2");
  EXPECT_FALSE(store_->ListEvents(kKind, "a", 0).ok());
  EXPECT_TRUE(store_->ListEvents("Other", "", 10)->empty());
  // Kept across a restart.
  store_.reset();
  SqliteStore::Options o;
  o.state_dir = dir_;
  o.object_event_retention = 5;
  store_ = std::move(*SqliteStore::Open(o, &clock_));
  EXPECT_EQ(store_->ListEvents(kKind, "b", 100)->size(), 3u);
  // Only the newest 5 are kept.
  for (int i = 0; i < 6; ++i) store_->RecordEvent(kKind, "c", "Normal", "X", std::to_string(i));
  auto all = store_->ListEvents(kKind, "", 100);
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->size(), 5u);
  EXPECT_EQ(all->front().message, "1");
  EXPECT_EQ(all->back().message, "5");
}

TEST_F(StoreTest, AStateDirThatCannotBeUsedIsAClearError) {
  SqliteStore::Options o;
  o.state_dir = "/proc/kiln-cannot-be-here";
  auto s = SqliteStore::Open(o, &clock_);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("--state-dir"), std::string::npos) << s.status();
  o.state_dir = "";
  EXPECT_EQ(SqliteStore::Open(o, &clock_).status().code(), absl::StatusCode::kInvalidArgument);
  // A file that is not a database.
  std::filesystem::create_directories(dir_ + "/junk");
  std::FILE* f = std::fopen((dir_ + "/junk/kiln.db").c_str(), "w");
  std::fputs("this is not a database, it is a text file with enough bytes to look like one....",
             f);
  std::fclose(f);
  o.state_dir = dir_ + "/junk";
  auto junk = SqliteStore::Open(o, &clock_);
  ASSERT_FALSE(junk.ok());
  EXPECT_NE(junk.status().message().find("kiln.db"), std::string::npos) << junk.status();
}

// A writer process is SIGKILLed at a random moment while it writes; every write it had
// acknowledged (reported through a pipe after the call returned) must be there afterwards,
// and the store must open and keep working.
TEST_F(StoreTest, WritesThatReturnedSurviveAKillAtAnyMoment) {
  store_.reset();
  std::mt19937 rng(12345);
  for (int round = 0; round < 3; ++round) {
    int fds[2];
    ASSERT_EQ(pipe(fds), 0);
    pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      close(fds[0]);
      SimulatedClock clock(absl::FromUnixSeconds(1800000000));
      SqliteStore::Options o;
      o.state_dir = dir_;
      auto s = SqliteStore::Open(o, &clock);
      if (!s.ok()) _exit(3);
      for (int i = 0;; ++i) {
        std::string name = "r" + std::to_string(round) + "-" + std::to_string(i);
        if (!(*s)->Create(kKind, name, "{\"i\":" + std::to_string(i) + "}").ok()) _exit(4);
        if (!(*s)->Update(kKind, name, "{\"i\":" + std::to_string(i) + ",\"u\":1}", 0).ok()) {
          _exit(5);
        }
        int32_t acked = i;
        if (write(fds[1], &acked, sizeof(acked)) != sizeof(acked)) _exit(6);
      }
    }
    close(fds[1]);
    // Let it acknowledge a random number of writes, then kill it mid-stream.
    int want = 5 + static_cast<int>(rng() % 40);
    int32_t last = -1;
    for (int n = 0; n < want; ++n) {
      ASSERT_EQ(read(fds[0], &last, sizeof(last)), static_cast<ssize_t>(sizeof(last)));
    }
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    // Drain what it acknowledged before it died.
    int32_t more;
    while (read(fds[0], &more, sizeof(more)) == static_cast<ssize_t>(sizeof(more))) last = more;
    close(fds[0]);
    ASSERT_TRUE(WIFSIGNALED(status)) << "writer exited with " << WEXITSTATUS(status);

    auto store = OpenStore();
    ASSERT_NE(store, nullptr);
    for (int i = 0; i <= last; ++i) {
      std::string name = "r" + std::to_string(round) + "-" + std::to_string(i);
      auto o = store->Get(kKind, name);
      ASSERT_TRUE(o.ok()) << "acknowledged write lost: " << name << ": " << o.status();
      EXPECT_EQ(o->spec, "{\"i\":" + std::to_string(i) + ",\"u\":1}");
      EXPECT_EQ(o->generation, 2);
    }
    // Versions and events stay consistent: one event per version, no gaps.
    int64_t rv = *store->CurrentResourceVersion();
    auto events = store->EventsSince(0, 100000);
    ASSERT_TRUE(events.ok());
    ASSERT_EQ(static_cast<int64_t>(events->size()), rv);
    EXPECT_TRUE(store->Create(kKind, "after-" + std::to_string(round), "{}").ok());
  }
}

}  // namespace
}  // namespace kiln
