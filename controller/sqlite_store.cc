#include "controller/sqlite_store.h"

#include <sqlite3.h>

#include <algorithm>
#include <filesystem>
#include <random>

#include "common/logging.h"
#include "common/status.h"

namespace kiln {

const char* WatchEventTypeName(WatchEvent::Type t) {
  switch (t) {
    case WatchEvent::Type::kAdded:
      return "ADDED";
    case WatchEvent::Type::kModified:
      return "MODIFIED";
    default:
      return "DELETED";
  }
}

namespace {

// One prepared statement. With a cache, the store's: prepared once and reset after each use
// (preparing every statement of every write was a twentieth of the controller's loop);
// without one, or while the cached one is in use, its own, finalised on scope exit.
class Stmt {
 public:
  Stmt(sqlite3* db, const std::string& sql) : db_(db) {
    rc_ = sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt_, nullptr);
  }
  Stmt(sqlite3* db, SqliteStore::Statements* cache, const std::string& sql) : db_(db) {
    auto it = cache->find(sql);
    if (it != cache->end() && !it->second.in_use) {
      cached_ = &it->second;
    } else if (it == cache->end()) {
      sqlite3_stmt* stmt = nullptr;
      rc_ = sqlite3_prepare_v3(db, sql.c_str(), -1, SQLITE_PREPARE_PERSISTENT, &stmt, nullptr);
      if (rc_ != SQLITE_OK) {
        sqlite3_finalize(stmt);
        return;
      }
      cached_ = &cache->emplace(sql, SqliteStore::Statement{stmt, false}).first->second;
    } else {
      rc_ = sqlite3_prepare_v2(db, sql.c_str(), -1, &stmt_, nullptr);
      return;
    }
    cached_->in_use = true;
    stmt_ = cached_->stmt;
  }
  ~Stmt() {
    if (cached_) {
      sqlite3_reset(stmt_);
      sqlite3_clear_bindings(stmt_);
      cached_->in_use = false;
    } else {
      sqlite3_finalize(stmt_);
    }
  }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;

  absl::Status ok() const {
    if (rc_ == SQLITE_OK) return absl::OkStatus();
    return absl::InternalError(std::string("store: ") + sqlite3_errmsg(db_));
  }
  Stmt& Bind(int i, const std::string& v) {
    sqlite3_bind_text(stmt_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT);
    return *this;
  }
  Stmt& Bind(int i, int64_t v) {
    sqlite3_bind_int64(stmt_, i, v);
    return *this;
  }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int Step() { return sqlite3_step(stmt_); }
  int64_t Int(int col) { return sqlite3_column_int64(stmt_, col); }
  std::string Text(int col) {
    const unsigned char* t = sqlite3_column_text(stmt_, col);
    return t ? std::string(reinterpret_cast<const char*>(t),
                           static_cast<size_t>(sqlite3_column_bytes(stmt_, col)))
             : std::string();
  }
  absl::Status Error(int rc) const {
    return absl::InternalError(std::string("store: ") + sqlite3_errstr(rc) + ": " +
                               sqlite3_errmsg(db_));
  }

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_ = nullptr;
  SqliteStore::Statement* cached_ = nullptr;
  int rc_ = SQLITE_OK;
};

constexpr char kObjectColumns[] =
    "kind, name, uid, generation, resource_version, created_micros, spec, status";

StoredObject ReadObject(Stmt& s, int first) {
  StoredObject o;
  o.kind = s.Text(first);
  o.name = s.Text(first + 1);
  o.uid = s.Text(first + 2);
  o.generation = s.Int(first + 3);
  o.resource_version = s.Int(first + 4);
  o.created_unix_micros = s.Int(first + 5);
  o.spec = s.Text(first + 6);
  o.status = s.Text(first + 7);
  return o;
}

absl::Status CheckKey(const std::string& kind, const std::string& name) {
  if (kind.empty()) return absl::InvalidArgumentError("kind: must not be empty");
  if (name.empty()) return absl::InvalidArgumentError("metadata.name: must not be empty");
  if (name.size() > 253) {
    return absl::InvalidArgumentError("metadata.name: at most 253 characters");
  }
  return absl::OkStatus();
}

std::string NewUid() {
  static std::mt19937_64 rng{std::random_device{}()};
  static absl::Mutex mu;
  absl::MutexLock lock(&mu);
  uint64_t a = rng(), b = rng();
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%08x-%04x-%04x-%04x-%012llx", static_cast<unsigned>(a >> 32),
                static_cast<unsigned>((a >> 16) & 0xffff), static_cast<unsigned>(a & 0xffff),
                static_cast<unsigned>(b >> 48),
                static_cast<unsigned long long>(b & 0xffffffffffffULL));
  return buf;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SqliteStore>> SqliteStore::Open(Options options, Clock* clock) {
  if (options.state_dir.empty()) {
    return absl::InvalidArgumentError("--state-dir: must not be empty");
  }
  if (options.event_retention < 1 || options.object_event_retention < 1) {
    return absl::InvalidArgumentError("event retention: must be >= 1");
  }
  std::error_code ec;
  std::filesystem::create_directories(options.state_dir, ec);
  if (ec) {
    return absl::PermissionDeniedError("--state-dir: cannot create " + options.state_dir + ": " +
                                       ec.message());
  }
  std::string path = (std::filesystem::path(options.state_dir) / "kiln.db").string();
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(path.c_str(), &db,
                           SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_FULLMUTEX,
                           nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    return absl::UnavailableError("--state-dir: cannot open " + path + ": " + msg);
  }
  std::unique_ptr<SqliteStore> store(new SqliteStore(options, clock, db, path));
  absl::MutexLock lock(&store->mu_);
  // WAL with synchronous=FULL: a commit that returned is on disk.
  for (const char* sql :
       {"PRAGMA busy_timeout=5000", "PRAGMA journal_mode=WAL", "PRAGMA synchronous=FULL",
        "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
        "CREATE TABLE IF NOT EXISTS objects (kind TEXT NOT NULL, name TEXT NOT NULL, uid TEXT "
        "NOT NULL, generation INTEGER NOT NULL, resource_version INTEGER NOT NULL, "
        "created_micros INTEGER NOT NULL, spec TEXT NOT NULL, status TEXT NOT NULL, PRIMARY "
        "KEY (kind, name))",
        "CREATE TABLE IF NOT EXISTS events (rv INTEGER PRIMARY KEY, type INTEGER NOT NULL, "
        "kind TEXT NOT NULL, name TEXT NOT NULL, uid TEXT NOT NULL, generation INTEGER NOT "
        "NULL, resource_version INTEGER NOT NULL, created_micros INTEGER NOT NULL, spec TEXT "
        "NOT NULL, status TEXT NOT NULL)",
        // Operators' events (the table above is the watch's change log).
        "CREATE TABLE IF NOT EXISTS object_events (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
        "kind TEXT NOT NULL, name TEXT NOT NULL, type TEXT NOT NULL, reason TEXT NOT NULL, "
        "message TEXT NOT NULL, unix_micros INTEGER NOT NULL)",
        "CREATE INDEX IF NOT EXISTS object_events_by_name ON object_events (kind, name, seq)",
        "INSERT OR IGNORE INTO meta (key, value) VALUES ('rv', 0), ('compacted', 0)"}) {
    absl::Status s = store->Exec(sql);
    if (!s.ok()) {
      return absl::Status(s.code(), "--state-dir: " + path + ": " + std::string(s.message()));
    }
  }
  {
    Stmt mode(db, "PRAGMA journal_mode");
    if (mode.Step() != SQLITE_ROW || mode.Text(0) != "wal") {
      return absl::FailedPreconditionError("--state-dir: " + path +
                                           ": the file system does not support SQLite's WAL mode");
    }
  }
  auto rv = store->MetaLocked("rv");
  if (!rv.ok()) return rv.status();
  store->current_rv_ = *rv;
  return store;
}

SqliteStore::SqliteStore(Options options, Clock* clock, sqlite3* db, std::string path)
    : options_(std::move(options)), clock_(clock), path_(std::move(path)), db_(db) {}

SqliteStore::~SqliteStore() {
  absl::MutexLock lock(&mu_);
  for (auto& [sql, st] : statements_) sqlite3_finalize(st.stmt);
  sqlite3_close(db_);
}

absl::Status SqliteStore::Exec(const std::string& sql) {
  char* err = nullptr;
  int rc = sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err);
  if (rc == SQLITE_OK) return absl::OkStatus();
  std::string msg = err ? err : sqlite3_errstr(rc);
  sqlite3_free(err);
  return absl::InternalError("store: " + msg);
}

absl::StatusOr<int64_t> SqliteStore::MetaLocked(const std::string& key) {
  Stmt s(db_, &statements_, "SELECT value FROM meta WHERE key = ?");
  if (!s.ok().ok()) return s.ok();
  s.Bind(1, key);
  int rc = s.Step();
  if (rc == SQLITE_ROW) return s.Int(0);
  if (rc == SQLITE_DONE) return int64_t{0};
  return s.Error(rc);
}

absl::StatusOr<StoredObject> SqliteStore::GetLocked(const std::string& kind,
                                                    const std::string& name) {
  Stmt s(db_, &statements_, (std::string("SELECT ") + kObjectColumns +
               " FROM objects WHERE kind = ? AND name = ?")
                  );
  if (!s.ok().ok()) return s.ok();
  s.Bind(1, kind).Bind(2, name);
  int rc = s.Step();
  if (rc == SQLITE_ROW) return ReadObject(s, 0);
  if (rc == SQLITE_DONE) return absl::NotFoundError(kind + " '" + name + "' not found");
  return s.Error(rc);
}

absl::StatusOr<StoredObject> SqliteStore::Get(const std::string& kind, const std::string& name) {
  absl::MutexLock lock(&mu_);
  return GetLocked(kind, name);
}

absl::StatusOr<std::vector<StoredObject>> SqliteStore::List(const std::string& kind) {
  absl::MutexLock lock(&mu_);
  Stmt s(db_, &statements_, (std::string("SELECT ") + kObjectColumns +
               " FROM objects WHERE kind = ? ORDER BY name")
                  );
  if (!s.ok().ok()) return s.ok();
  s.Bind(1, kind);
  std::vector<StoredObject> out;
  for (;;) {
    int rc = s.Step();
    if (rc == SQLITE_DONE) break;
    if (rc != SQLITE_ROW) return s.Error(rc);
    out.push_back(ReadObject(s, 0));
  }
  return out;
}

absl::StatusOr<StoredObject> SqliteStore::CommitLocked(StoredObject o, WatchEvent::Type type) {
  absl::Status begin = Exec("BEGIN IMMEDIATE");
  if (!begin.ok()) return begin;
  auto fail = [this](absl::Status s) {
    (void)Exec("ROLLBACK");
    return s;
  };
  // Read under the write lock: the database, not this process's cache, is the truth.
  auto last = MetaLocked("rv");
  if (!last.ok()) return fail(last.status());
  const int64_t rv = std::max(*last, current_rv_) + 1;
  o.resource_version = rv;
  {
    Stmt s(db_, &statements_, "UPDATE meta SET value = ? WHERE key = 'rv'");
    if (!s.ok().ok()) return fail(s.ok());
    s.Bind(1, rv);
    if (int rc = s.Step(); rc != SQLITE_DONE) return fail(s.Error(rc));
  }
  if (type == WatchEvent::Type::kDeleted) {
    Stmt s(db_, &statements_, "DELETE FROM objects WHERE kind = ? AND name = ?");
    if (!s.ok().ok()) return fail(s.ok());
    s.Bind(1, o.kind).Bind(2, o.name);
    if (int rc = s.Step(); rc != SQLITE_DONE) return fail(s.Error(rc));
  } else {
    Stmt s(db_, &statements_, (std::string("INSERT OR REPLACE INTO objects (") + kObjectColumns +
                 ") VALUES (?, ?, ?, ?, ?, ?, ?, ?)")
                    );
    if (!s.ok().ok()) return fail(s.ok());
    s.Bind(1, o.kind).Bind(2, o.name).Bind(3, o.uid).Bind(4, o.generation).Bind(5, rv);
    s.Bind(6, o.created_unix_micros).Bind(7, o.spec).Bind(8, o.status);
    if (int rc = s.Step(); rc != SQLITE_DONE) return fail(s.Error(rc));
  }
  {
    Stmt s(db_, &statements_, (std::string("INSERT INTO events (rv, type, ") + kObjectColumns +
                 ") VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
                    );
    if (!s.ok().ok()) return fail(s.ok());
    s.Bind(1, rv).Bind(2, static_cast<int64_t>(type)).Bind(3, o.kind).Bind(4, o.name);
    s.Bind(5, o.uid).Bind(6, o.generation).Bind(7, rv).Bind(8, o.created_unix_micros);
    s.Bind(9, o.spec).Bind(10, o.status);
    if (int rc = s.Step(); rc != SQLITE_DONE) return fail(s.Error(rc));
  }
  const int64_t floor = rv - options_.event_retention;
  if (floor > 0) {
    Stmt del(db_, &statements_, "DELETE FROM events WHERE rv <= ?");
    if (!del.ok().ok()) return fail(del.ok());
    del.Bind(1, floor);
    if (int rc = del.Step(); rc != SQLITE_DONE) return fail(del.Error(rc));
    Stmt mark(db_, &statements_, "UPDATE meta SET value = ? WHERE key = 'compacted'");
    if (!mark.ok().ok()) return fail(mark.ok());
    mark.Bind(1, floor);
    if (int rc = mark.Step(); rc != SQLITE_DONE) return fail(mark.Error(rc));
  }
  absl::Status commit = Exec("COMMIT");
  if (!commit.ok()) return fail(commit);
  current_rv_ = rv;
  return o;
}

absl::Status SqliteStore::CheckVersion(const StoredObject& current, int64_t expected) const {
  if (expected != 0 && expected != current.resource_version) {
    return absl::AbortedError(current.kind + " '" + current.name +
                              "': the object has been modified (resourceVersion " +
                              std::to_string(current.resource_version) + ", the write expected " +
                              std::to_string(expected) + "); read it again and retry");
  }
  return absl::OkStatus();
}

absl::StatusOr<StoredObject> SqliteStore::Create(const std::string& kind, const std::string& name,
                                                 const std::string& spec) {
  if (absl::Status s = CheckKey(kind, name); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto existing = GetLocked(kind, name);
  if (existing.ok()) {
    return absl::AlreadyExistsError(kind + " '" + name + "' already exists");
  }
  if (existing.status().code() != absl::StatusCode::kNotFound) return existing.status();
  StoredObject o;
  o.kind = kind;
  o.name = name;
  o.uid = NewUid();
  o.generation = 1;
  o.created_unix_micros = absl::ToUnixMicros(clock_->Now());
  o.spec = spec;
  o.status = "{}";
  return CommitLocked(std::move(o), WatchEvent::Type::kAdded);
}

absl::StatusOr<StoredObject> SqliteStore::Update(const std::string& kind, const std::string& name,
                                                 const std::string& spec,
                                                 int64_t expected_resource_version) {
  if (absl::Status s = CheckKey(kind, name); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto current = GetLocked(kind, name);
  if (!current.ok()) return current.status();
  if (absl::Status s = CheckVersion(*current, expected_resource_version); !s.ok()) return s;
  if (current->spec == spec) return current;  // nothing changed: no new version, no event
  StoredObject o = *current;
  o.spec = spec;
  o.generation++;
  return CommitLocked(std::move(o), WatchEvent::Type::kModified);
}

absl::StatusOr<StoredObject> SqliteStore::UpdateStatus(const std::string& kind,
                                                       const std::string& name,
                                                       const std::string& status,
                                                       int64_t expected_resource_version) {
  if (absl::Status s = CheckKey(kind, name); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto current = GetLocked(kind, name);
  if (!current.ok()) return current.status();
  if (absl::Status s = CheckVersion(*current, expected_resource_version); !s.ok()) return s;
  if (current->status == status) return current;
  StoredObject o = *current;
  o.status = status;
  return CommitLocked(std::move(o), WatchEvent::Type::kModified);
}

absl::Status SqliteStore::Delete(const std::string& kind, const std::string& name,
                                 int64_t expected_resource_version) {
  if (absl::Status s = CheckKey(kind, name); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto current = GetLocked(kind, name);
  if (!current.ok()) return current.status();
  if (absl::Status s = CheckVersion(*current, expected_resource_version); !s.ok()) return s;
  auto done = CommitLocked(*current, WatchEvent::Type::kDeleted);
  return done.ok() ? absl::OkStatus() : done.status();
}

absl::StatusOr<int64_t> SqliteStore::CurrentResourceVersion() {
  absl::MutexLock lock(&mu_);
  return current_rv_;
}

absl::StatusOr<std::vector<WatchEvent>> SqliteStore::EventsSince(int64_t resource_version,
                                                                 int limit) {
  if (resource_version < 0) {
    return absl::InvalidArgumentError("resourceVersion: must be >= 0");
  }
  absl::MutexLock lock(&mu_);
  auto compacted = MetaLocked("compacted");
  if (!compacted.ok()) return compacted.status();
  if (resource_version < *compacted) {
    return absl::OutOfRangeError("resourceVersion " + std::to_string(resource_version) +
                                 " is too old (events up to " + std::to_string(*compacted) +
                                 " were compacted); list again and watch from there");
  }
  Stmt s(db_, &statements_, (std::string("SELECT type, ") + kObjectColumns +
               " FROM events WHERE rv > ? ORDER BY rv LIMIT ?")
                  );
  if (!s.ok().ok()) return s.ok();
  s.Bind(1, resource_version).Bind(2, static_cast<int64_t>(limit > 0 ? limit : 1000));
  std::vector<WatchEvent> out;
  for (;;) {
    int rc = s.Step();
    if (rc == SQLITE_DONE) break;
    if (rc != SQLITE_ROW) return s.Error(rc);
    WatchEvent e;
    e.type = static_cast<WatchEvent::Type>(s.Int(0));
    e.object = ReadObject(s, 1);
    e.resource_version = e.object.resource_version;
    out.push_back(std::move(e));
  }
  return out;
}

bool SqliteStore::WaitForChange(int64_t resource_version, absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto moved = [this, resource_version]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return current_rv_ > resource_version;
  };
  return mu_.AwaitWithTimeout(absl::Condition(&moved), timeout);
}

void SqliteStore::RecordEvent(const std::string& kind, const std::string& name,
                              const std::string& type, const std::string& reason,
                              const std::string& message) {
  absl::MutexLock lock(&mu_);
  Stmt s(db_, &statements_,
         "INSERT INTO object_events (kind, name, type, reason, message, unix_micros) VALUES "
         "(?, ?, ?, ?, ?, ?)");
  absl::Status st = s.ok();
  if (st.ok()) {
    s.Bind(1, kind).Bind(2, name).Bind(3, type).Bind(4, reason).Bind(5, message.substr(0, 1024));
    s.Bind(6, absl::ToUnixMicros(clock_->Now()));
    if (s.Step() != SQLITE_DONE) st = absl::InternalError(sqlite3_errmsg(db_));
  }
  // Pruned every 256 events (each prune is one indexed delete; up to 255 more than the
  // retention may wait for it), or at each one when under 512 are kept.
  const int64_t prune_every = options_.object_event_retention >= 512 ? 256 : 1;
  if (st.ok() && ++events_since_prune_ >= prune_every) {
    events_since_prune_ = 0;
    Stmt prune(db_, &statements_,
               "DELETE FROM object_events WHERE seq <= (SELECT MAX(seq) FROM object_events) - ?");
    st = prune.ok();
    if (st.ok() && prune.Bind(1, options_.object_event_retention).Step() != SQLITE_DONE) {
      st = absl::InternalError(sqlite3_errmsg(db_));
    }
  }
  if (!st.ok()) {
    GetLogger("controller.store")->warn("event {} {}/{} not kept: {}", reason, kind, name,
                                        std::string(st.message()));
  }
}

absl::StatusOr<std::vector<ObjectEvent>> SqliteStore::ListEvents(const std::string& kind,
                                                                 const std::string& name,
                                                                 int limit) {
  if (limit <= 0) return absl::InvalidArgumentError("limit: must be > 0");
  absl::MutexLock lock(&mu_);
  Stmt s(db_, &statements_,
         name.empty()
             ? "SELECT kind, name, type, reason, message, unix_micros FROM object_events WHERE "
               "kind = ? ORDER BY seq DESC LIMIT ?"
             : "SELECT kind, name, type, reason, message, unix_micros FROM object_events WHERE "
               "kind = ? AND name = ? ORDER BY seq DESC LIMIT ?");
  KILN_RETURN_IF_ERROR(s.ok());
  s.Bind(1, kind);
  if (name.empty()) {
    s.Bind(2, static_cast<int64_t>(limit));
  } else {
    s.Bind(2, name).Bind(3, static_cast<int64_t>(limit));
  }
  std::vector<ObjectEvent> out;
  int rc;
  while ((rc = s.Step()) == SQLITE_ROW) {
    out.push_back({s.Text(0), s.Text(1), s.Text(2), s.Text(3), s.Text(4), s.Int(5)});
  }
  if (rc != SQLITE_DONE) return absl::InternalError(std::string("store: ") + sqlite3_errmsg(db_));
  std::reverse(out.begin(), out.end());
  return out;
}

}  // namespace kiln
