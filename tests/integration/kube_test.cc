// The Kubernetes store, its client and leader election against the in-test API server
// (tests/support/fake_kube_api.h) over loopback HTTP.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/escaping.h"
#include "absl/time/clock.h"
#include "controller/kube_store.h"
#include "controller/leader_election.h"
#include "controller/model_deployment.h"
#include "controller/kube_client.h"
#include "tests/support/eventually.h"
#include "tests/support/fake_kube_api.h"
#include "tests/support/shell.h"
#include "tests/support/test_ca.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::FakeKubeApi;

// Polls `pred` every 5 ms for up to 10 s.
template <typename F>
bool Eventually(F pred) {
  return testing::Eventually(pred, absl::Seconds(10));
}

std::string Spec(int replicas, const std::string& version = "1") {
  ModelDeployment d;
  d.name = "enc";
  d.labels = {{"team", "a"}};
  d.spec.model = {"enc", version, "file:///m/enc/" + version + "/model.pt", "torchscript", ""};
  d.spec.replicas = replicas;
  return EncodeForStore(d);
}

class KubeStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    api_ = std::make_unique<FakeKubeApi>();
    config_.server = api_->url();
    config_.token = "test-token";
    config_.ns = "kiln";
    KubernetesStore::Options o;
    o.retry = absl::Milliseconds(20);
    o.sync_timeout = absl::Seconds(5);
    auto s = KubernetesStore::Open(config_, o);
    ASSERT_TRUE(s.ok()) << s.status();
    store_ = std::move(*s);
  }
  // Another client (kubectl) writing straight to the API.
  KubeResponse Other(const std::string& method, const std::string& path, const json& body) {
    KubeClient c(config_);
    auto r = c.Call(method, path, &body);
    EXPECT_TRUE(r.ok()) << r.status();
    return *r;
  }
  int64_t ReplicasInCache(const std::string& name) {
    auto o = store_->Get(kModelDeploymentKind, name);
    if (!o.ok()) return -1;
    auto d = DecodeFromStore(name, o->spec);
    return d.ok() ? d->spec.replicas : -2;
  }

  std::unique_ptr<FakeKubeApi> api_;
  KubeConfig config_;
  std::unique_ptr<KubernetesStore> store_;
};

TEST_F(KubeStoreTest, CreateGetUpdateAndStatusFollowTheApisRules) {
  auto created = store_->Create(kModelDeploymentKind, "enc", Spec(2));
  ASSERT_TRUE(created.ok()) << created.status();
  EXPECT_EQ(created->generation, 1);
  EXPECT_FALSE(created->uid.empty());
  EXPECT_GT(created->created_unix_micros, 0);
  EXPECT_EQ(store_->Create(kModelDeploymentKind, "enc", Spec(2)).status().code(),
            absl::StatusCode::kAlreadyExists);
  auto got = store_->Get(kModelDeploymentKind, "enc");
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->resource_version, created->resource_version);
  EXPECT_EQ(ReplicasInCache("enc"), 2);
  EXPECT_EQ(json::parse(got->spec)["labels"]["team"], "a");

  // Status: through the subresource, the generation stays.
  auto st = store_->UpdateStatus(kModelDeploymentKind, "enc", R"({"readyReplicas":2})", got->resource_version);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->generation, 1);
  EXPECT_GT(st->resource_version, got->resource_version);
  EXPECT_EQ(json::parse(st->status)["readyReplicas"], 2);
  // A spec change bumps the generation and keeps the status.
  auto up = store_->Update(kModelDeploymentKind, "enc", Spec(3), st->resource_version);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->generation, 2);
  EXPECT_EQ(json::parse(up->status)["readyReplicas"], 2);
  // A stale resourceVersion is a conflict, for spec and status alike.
  EXPECT_EQ(store_->Update(kModelDeploymentKind, "enc", Spec(4), st->resource_version).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(store_->UpdateStatus(kModelDeploymentKind, "enc", "{}", st->resource_version).status().code(),
            absl::StatusCode::kAborted);
  EXPECT_EQ(ReplicasInCache("enc"), 3);
  // Delete with a stale precondition is refused; with the current one it goes.
  EXPECT_EQ(store_->Delete(kModelDeploymentKind, "enc", st->resource_version).code(), absl::StatusCode::kAborted);
  ASSERT_TRUE(store_->Delete(kModelDeploymentKind, "enc", up->resource_version).ok());
  EXPECT_EQ(store_->Get(kModelDeploymentKind, "enc").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Update(kModelDeploymentKind, "enc", Spec(1), 0).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Get("Node", "x").status().code(), absl::StatusCode::kInvalidArgument);
}

// The API allows no unconditional update of a custom resource (the fake refuses one, 422, as
// the real server does): an update or status write without a version is made against the one
// read just before.
TEST_F(KubeStoreTest, AnUnconditionalUpdateIsMadeAgainstTheCurrentVersion) {
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "enc", Spec(1)).ok());
  json obj = api_->Get(FakeKubeApi::ModelDeployments("kiln"), "enc");
  obj["spec"]["replicas"] = 3;
  ASSERT_EQ(Other("PUT", FakeKubeApi::ModelDeployments("kiln") + "/enc", obj).code, 200);
  auto up = store_->Update(kModelDeploymentKind, "enc", Spec(5), 0);  // over the other's write
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(json::parse(up->spec)["spec"]["replicas"], 5);
  auto st = store_->UpdateStatus(kModelDeploymentKind, "enc", R"({"readyReplicas":4})", 0);
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(api_->Get(FakeKubeApi::ModelDeployments("kiln"), "enc")["status"]["readyReplicas"], 4);
  obj = api_->Get(FakeKubeApi::ModelDeployments("kiln"), "enc");
  obj["metadata"].erase("resourceVersion");
  EXPECT_EQ(Other("PUT", FakeKubeApi::ModelDeployments("kiln") + "/enc", obj).code, 422);
}

TEST_F(KubeStoreTest, TheCrdSchemaRefusesABadSpecNamingTheField) {
  json env = json::parse(Spec(1));
  env["spec"]["replicas"] = 20000;
  auto r = store_->Create(kModelDeploymentKind, "enc", env.dump());
  ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_NE(std::string(r.status().message()).find("spec.replicas"), std::string::npos) << r.status();
  EXPECT_EQ(store_->Get(kModelDeploymentKind, "enc").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(KubeStoreTest, AnotherClientsWritesArriveThroughTheWatch) {
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "enc", Spec(1)).ok());
  json obj = api_->Get(FakeKubeApi::ModelDeployments("kiln"), "enc");
  obj["spec"]["replicas"] = 5;
  ASSERT_EQ(Other("PUT", FakeKubeApi::ModelDeployments("kiln") + "/enc", obj).code, 200);
  EXPECT_TRUE(Eventually([&] { return ReplicasInCache("enc") == 5; }));
  // kubectl scale: the scale subresource sets spec.replicas.
  json scale = {{"apiVersion", "autoscaling/v1"}, {"kind", "Scale"},
                {"metadata", {{"name", "enc"}}}, {"spec", {{"replicas", 7}}}};
  KubeResponse sr = Other("PUT", FakeKubeApi::ModelDeployments("kiln") + "/enc/scale", scale);
  ASSERT_EQ(sr.code, 200) << sr.body.dump();
  EXPECT_EQ(sr.body["spec"]["replicas"], 7);
  EXPECT_TRUE(Eventually([&] { return ReplicasInCache("enc") == 7; }));
  EXPECT_EQ(store_->Get(kModelDeploymentKind, "enc")->generation, 3);
  // Deleted by someone else.
  ASSERT_EQ(Other("DELETE", FakeKubeApi::ModelDeployments("kiln") + "/enc", json::object()).code, 200);
  EXPECT_TRUE(Eventually([&] { return store_->Get(kModelDeploymentKind, "enc").status().code() == absl::StatusCode::kNotFound; }));
}

TEST_F(KubeStoreTest, AWatchDroppedMidStreamMissesNothingAndRepeatsNothing) {
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "a", Spec(1)).ok());
  const std::string md = FakeKubeApi::ModelDeployments("kiln");
  for (int round = 0; round < 5; ++round) {
    ASSERT_TRUE(Eventually([&] { return api_->open_watches() == 1; }));  // the store's stream is up
    int64_t watches = store_->watches();
    api_->DropWatches();
    // Writes while the store is between streams.
    json obj = api_->Get(md, "a");
    obj["spec"]["replicas"] = 10 + round;
    ASSERT_EQ(Other("PUT", md + "/a", obj).code, 200);
    json b = {{"apiVersion", kModelDeploymentApiVersion}, {"kind", kModelDeploymentKind},
              {"metadata", {{"name", "b" + std::to_string(round)}}},
              {"spec", json::parse(Spec(1))["spec"]}};
    ASSERT_EQ(Other("POST", md, b).code, 201);
    EXPECT_TRUE(Eventually([&] { return store_->watches() > watches; }));
  }
  EXPECT_TRUE(Eventually([&] { return ReplicasInCache("a") == 14 && store_->List(kModelDeploymentKind)->size() == 6; }));
  EXPECT_EQ(store_->lists(), 1);  // re-watched from the last version, never relisted
  // Each change applied once: our create + 5 updates + 5 creates seen through the watch.
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_EQ(store_->applied_changes(), 11);
  auto events = store_->EventsSince(0, 100);
  ASSERT_TRUE(events.ok());
  EXPECT_EQ(events->size(), 11u);
  for (size_t i = 1; i < events->size(); ++i) {
    EXPECT_LT((*events)[i - 1].resource_version, (*events)[i].resource_version);
  }
}

// The store's own write between two watches does not move where the next watch starts: another
// client's change made before it is still delivered.
TEST_F(KubeStoreTest, OwnWritesBetweenWatchesDoNotSkipOthersChanges) {
  const std::string md = FakeKubeApi::ModelDeployments("kiln");
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "a", Spec(1)).ok());
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "b", Spec(1)).ok());
  ASSERT_TRUE(Eventually([&] { return api_->open_watches() == 1; }));
  api_->SetWatchesRefused(true);  // the store is between streams
  json b = api_->Get(md, "b");
  b["spec"]["replicas"] = 5;
  ASSERT_EQ(Other("PUT", md + "/b", b).code, 200);
  auto a = store_->Get(kModelDeploymentKind, "a");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(store_->UpdateStatus(kModelDeploymentKind, "a", R"({"readyReplicas":1})",
                                   a->resource_version).ok());  // newer than b's change
  api_->SetWatchesRefused(false);
  EXPECT_TRUE(Eventually([&] { return ReplicasInCache("b") == 5; }));
  EXPECT_EQ(store_->lists(), 1);  // by the watch, not a relist
}

class KubeStoreGoneTest : public KubeStoreTest, public ::testing::WithParamInterface<bool> {};

// Whether the API says 410 Gone in the stream (an ERROR event) or as the answer's status.
TEST_P(KubeStoreGoneTest, A410GoneRelistsAndCatchesUpWithDeletes) {
  api_->SetGoneAsStatus(GetParam());
  const std::string md = FakeKubeApi::ModelDeployments("kiln");
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "keep", Spec(1)).ok());
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "drop", Spec(1)).ok());
  ASSERT_TRUE(Eventually([&] { return *store_->CurrentResourceVersion() == api_->resource_version(); }));
  // Another client changes one and deletes the other, then history is compacted: the
  // version the store would watch from is gone.
  api_->SetWatchesRefused(true);
  json keep = api_->Get(md, "keep");
  keep["spec"]["replicas"] = 9;
  ASSERT_EQ(Other("PUT", md + "/keep", keep).code, 200);
  ASSERT_EQ(Other("DELETE", md + "/drop", json::object()).code, 200);
  api_->Compact();
  EXPECT_EQ(ReplicasInCache("keep"), 1);  // not seen yet
  api_->SetWatchesRefused(false);
  EXPECT_TRUE(Eventually([&] { return store_->lists() >= 2; }));
  EXPECT_TRUE(Eventually([&] {
    return ReplicasInCache("keep") == 9 &&
           store_->Get(kModelDeploymentKind, "drop").status().code() == absl::StatusCode::kNotFound;
  }));
}

INSTANTIATE_TEST_SUITE_P(EventOrStatus, KubeStoreGoneTest, ::testing::Bool());

// After StopWatches a Watch about to start does not run (until its timeout, or an event): the
// store's stop never waits on one begun in the moment it stopped.
TEST_F(KubeStoreTest, AWatchAfterStopWatchesEndsAtOnce) {
  KubeClient c(config_);
  c.StopWatches();
  int events = 0;
  absl::Status s = c.Watch(FakeKubeApi::ModelDeployments("kiln") + "?watch=1&timeoutSeconds=30",
                           [&](const json&) { return ++events < 100; }, absl::Seconds(30));
  EXPECT_TRUE(absl::IsUnavailable(s)) << s;
  EXPECT_EQ(events, 0);
}

TEST_F(KubeStoreTest, BookmarksMoveTheVersionTheNextWatchStartsFrom) {
  // A write elsewhere (a Lease) moves the server's version without any ModelDeployment event.
  json lease = {{"apiVersion", "coordination.k8s.io/v1"}, {"kind", "Lease"},
                {"metadata", {{"name", "x"}}}, {"spec", {{"holderIdentity", "y"}}}};
  ASSERT_EQ(Other("POST", FakeKubeApi::Leases("kiln"), lease).code, 201);
  int64_t before = *store_->CurrentResourceVersion();
  ASSERT_LT(before, api_->resource_version());
  EXPECT_TRUE(Eventually([&] {
    api_->Bookmark();  // again until a watch is open to carry it
    return *store_->CurrentResourceVersion() == api_->resource_version();
  }));
  EXPECT_TRUE(store_->WaitForChange(before, absl::Milliseconds(1)));
}

TEST_F(KubeStoreTest, EventsAreRecordedAgainstTheDeployment) {
  auto created = store_->Create(kModelDeploymentKind, "enc", Spec(1));
  ASSERT_TRUE(created.ok());
  store_->RecordEvent(kModelDeploymentKind, "enc", "Warning", "RolledBack", "canary 2 failed analysis");
  // Posted from the store's own thread: bounded poll.
  auto events = api_->EventsRecorded();
  for (int i = 0; i < 400 && events.empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    events = api_->EventsRecorded();
  }
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0]["involvedObject"]["name"], "enc");
  EXPECT_EQ(events[0]["involvedObject"]["uid"], created->uid);
  EXPECT_EQ(events[0]["reason"], "RolledBack");
  EXPECT_EQ(events[0]["type"], "Warning");
  // And listed back from the API server (what `kilnctl describe` shows).
  store_->RecordEvent(kModelDeploymentKind, "other", "Normal", "RolloutStep", "elsewhere");
  for (int i = 0; i < 400 && api_->EventsRecorded().size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  auto listed = store_->ListEvents(kModelDeploymentKind, "enc", 10);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 1u);
  EXPECT_EQ((*listed)[0].reason, "RolledBack");
  EXPECT_EQ((*listed)[0].message, "canary 2 failed analysis");
  EXPECT_GT((*listed)[0].unix_micros, 0);
  EXPECT_EQ(store_->ListEvents(kModelDeploymentKind, "", 10)->size(), 2u);
  EXPECT_EQ(store_->ListEvents(kModelDeploymentKind, "", 1)->size(), 1u);
}

TEST_F(KubeStoreTest, EventsGoOnAfterTheApiWasAway) {
  ASSERT_TRUE(store_->Create(kModelDeploymentKind, "enc", Spec(1)).ok());
  api_->SetUnavailable(true);  // every call fails
  for (int i = 0; i < 50; ++i) {
    store_->RecordEvent(kModelDeploymentKind, "enc", "Normal", "RolloutStep", "step " + std::to_string(i));
  }
  api_->SetUnavailable(false);
  // The queue goes on once the API is back (the calls made while it was away are lost).
  store_->RecordEvent(kModelDeploymentKind, "enc", "Normal", "RolloutStep", "after");
  bool seen = false;
  for (int i = 0; i < 1000 && !seen; ++i) {
    for (const auto& e : api_->EventsRecorded()) seen |= e.value("message", "") == "after";
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(seen);
  EXPECT_EQ(store_->events_dropped(), 0);
}

TEST(KubeStoreOpenTest, AnUnreachableApiFailsOpenWithinTheSyncTimeout) {
  KubeConfig c;
  c.server = "http://127.0.0.1:1";
  c.token = "t";
  KubernetesStore::Options o;
  o.retry = absl::Milliseconds(20);
  o.sync_timeout = absl::Milliseconds(200);
  auto s = KubernetesStore::Open(c, o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kUnavailable) << s.status();
}

TEST(KubeStoreOpenTest, AWrongTokenIsRefusedAtOnce) {
  FakeKubeApi api;
  KubeConfig c;
  c.server = api.url();
  c.token = "wrong";
  auto s = KubernetesStore::Open(c, {});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kPermissionDenied) << s.status();
}

// --- configuration ---

class KubeConfigTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("kiln-kubeconfig-" + std::to_string(getpid()));
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
    return (dir_ / name).string();
  }
  fs::path dir_;
};

TEST_F(KubeConfigTest, InClusterReadsTheServiceAccountAndTheEnvironment) {
  Write("token", "abc\n");
  Write("ca.crt", "-----BEGIN CERTIFICATE-----\n");
  Write("namespace", "kiln-system");
  unsetenv("KUBERNETES_SERVICE_HOST");
  EXPECT_EQ(KubeConfig::InCluster(dir_.string()).status().code(), absl::StatusCode::kFailedPrecondition);
  setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1", 1);
  setenv("KUBERNETES_SERVICE_PORT", "443", 1);
  auto c = KubeConfig::InCluster(dir_.string());
  unsetenv("KUBERNETES_SERVICE_HOST");
  unsetenv("KUBERNETES_SERVICE_PORT");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->server, "https://10.0.0.1:443");
  EXPECT_EQ(c->token, "abc");
  EXPECT_EQ(c->ns, "kiln-system");
  EXPECT_EQ(c->ca_pem, "-----BEGIN CERTIFICATE-----\n");
}

TEST_F(KubeConfigTest, AKubeconfigContextGivesServerCaTokenAndNamespace) {
  std::string ca = absl::Base64Escape("PEM");
  std::string path = Write("config", "apiVersion: v1\nkind: Config\ncurrent-context: prod\n"
      "clusters:\n- name: c1\n  cluster: {server: \"https://api:6443\", certificate-authority-data: " + ca + "}\n"
      "- name: c2\n  cluster: {server: \"https://other:6443\", insecure-skip-tls-verify: true}\n"
      "users:\n- name: u1\n  user: {token: tok}\n- name: u2\n  user: {client-certificate-data: x, client-key-data: y}\n"
      "contexts:\n- name: prod\n  context: {cluster: c1, user: u1, namespace: kiln}\n"
      "- name: certs\n  context: {cluster: c2, user: u2}\n");
  auto c = KubeConfig::FromKubeconfig(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->server, "https://api:6443");
  EXPECT_EQ(c->ca_pem, "PEM");
  EXPECT_EQ(c->token, "tok");
  EXPECT_EQ(c->ns, "kiln");
  auto certs = KubeConfig::FromKubeconfig(path, "certs");
  ASSERT_FALSE(certs.ok());
  EXPECT_NE(std::string(certs.status().message()).find("users[u2].user.client-certificate-data: not base64"),
            std::string::npos)
      << certs.status();
  auto missing = KubeConfig::FromKubeconfig(path, "nope");
  EXPECT_NE(std::string(missing.status().message()).find("no context named 'nope'"), std::string::npos);
  EXPECT_FALSE(KubeConfig::FromKubeconfig((dir_ / "absent").string()).ok());
  EXPECT_FALSE(KubeConfig::FromKubeconfig(Write("bad", "clusters: [")).ok());
}

TEST_F(KubeConfigTest, ClientCertificateUsersAndWhatIsRefused) {
  std::string cert = absl::Base64Escape("-----BEGIN CERTIFICATE-----\nAA\n-----END CERTIFICATE-----\n");
  std::string key = absl::Base64Escape("-----BEGIN PRIVATE KEY-----\nAA\n-----END PRIVATE KEY-----\n");
  Write("key.pem", "-----BEGIN EC PRIVATE KEY-----\nAA\n-----END EC PRIVATE KEY-----\n");
  std::string head = "apiVersion: v1\nkind: Config\ncurrent-context: x\n"
      "clusters:\n- name: c\n  cluster: {server: \"https://api:6443\"}\n"
      "contexts:\n- name: x\n  context: {cluster: c, user: u}\nusers:\n- name: u\n  user: ";
  auto load = [&](const std::string& user) {
    return KubeConfig::FromKubeconfig(Write("config", head + user + "\n"));
  };
  auto both = load("{client-certificate-data: " + cert + ", client-key: " + (dir_ / "key.pem").string() + "}");
  ASSERT_TRUE(both.ok()) << both.status();
  EXPECT_TRUE(both->token.empty());
  EXPECT_NE(both->client_cert_pem.find("BEGIN CERTIFICATE"), std::string::npos);
  EXPECT_NE(both->client_key_pem.find("EC PRIVATE KEY"), std::string::npos);
  auto with_token = load("{token: t, client-certificate-data: " + cert + ", client-key-data: " + key + "}");
  ASSERT_TRUE(with_token.ok()) << with_token.status();
  EXPECT_EQ(with_token->token, "t");
  auto expect = [&](const std::string& user, const std::string& text) {
    auto c = load(user);
    ASSERT_FALSE(c.ok()) << user;
    EXPECT_NE(std::string(c.status().message()).find(text), std::string::npos) << c.status();
  };
  expect("{client-certificate-data: " + cert + "}", "users[u].user.client-key: required with client-certificate");
  expect("{client-key-data: " + key + "}", "users[u].user.client-certificate: required with client-key");
  expect("{client-certificate-data: " + key + ", client-key-data: " + key + "}",
         "users[u].user.client-certificate: no PEM CERTIFICATE");
  expect("{client-certificate-data: " + cert + ", client-key: " + (dir_ / "none").string() + "}",
         "users[u].user.client-key");
  expect("{exec: {command: aws}}", "no token, tokenFile or client-certificate (exec and auth-provider");
  expect("{token: \"\"}", "users[u].user.token: empty");
}

// A TLS API endpoint that requires client certificates (openssl s_server, which answers GET
// with a status page): the client's certificate gets it through, its absence does not.
TEST_F(KubeConfigTest, ClientCertificatesAuthenticateTheTlsConnection) {
  kiln::testing::TestCa ca(dir_.string(), "api-ca");
  auto server = ca.Issue("api", "kube-apiserver", {"DNS:localhost", "IP:127.0.0.1"});
  auto admin = ca.Issue("admin", "kubernetes-admin", {});
  ASSERT_TRUE(ca.ok()) << ca.error();
  // A free port: bind 0, note it, close it (s_server takes it at once).
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  close(fd);
  std::string log = (dir_ / "s_server.log").string();
  pid_t pid = kiln::testing::SpawnLogged(
      {"/usr/bin/openssl", "s_server", "-accept", "127.0.0.1:" + std::to_string(port), "-cert",
       server.cert, "-key", server.key, "-CAfile", ca.ca(), "-Verify", "1", "-www", "-quiet"},
      log);
  ASSERT_GT(pid, 0);
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  KubeConfig c;
  c.server = "https://127.0.0.1:" + std::to_string(port);
  c.ca_pem = read(ca.ca());
  c.client_cert_pem = read(admin.cert);
  c.client_key_pem = read(admin.key);
  absl::StatusOr<KubeResponse> r;
  for (int i = 0; i < 200; ++i) {  // bounded: until s_server listens
    r = KubeClient(c).Call("GET", "/", nullptr, absl::Seconds(5));
    if (r.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(r.ok()) << r.status() << read(log);
  EXPECT_EQ(r->code, 200);
  KubeConfig no_cert = c;
  no_cert.client_cert_pem.clear();
  no_cert.client_key_pem.clear();
  no_cert.token = "t";
  auto refused = KubeClient(no_cert).Call("GET", "/", nullptr, absl::Seconds(5));
  EXPECT_FALSE(refused.ok() && refused->code == 200) << "answered without a client certificate";
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

// --- leader election, on simulated time ---

class LeaderElectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    api_ = std::make_unique<FakeKubeApi>();
    KubeConfig c;
    c.server = api_->url();
    c.token = "test-token";
    c.ns = "kiln";
    client_ = std::make_unique<KubeClient>(c);
  }
  LeaderElectionOptions Options(const std::string& id) {
    LeaderElectionOptions o;
    o.identity = id;
    return o;
  }
  std::unique_ptr<FakeKubeApi> api_;
  std::unique_ptr<KubeClient> client_;
  SimulatedClock clock_a_, clock_b_;  // two processes, two clocks (never compared)
};

TEST_F(LeaderElectionTest, OneLeadsTheOtherTakesOverWithinTheLeaseAfterItDies) {
  clock_b_.Advance(absl::Hours(3));  // skewed clocks do not matter
  LeaderElector a(client_.get(), Options("a"), &clock_a_);
  LeaderElector b(client_.get(), Options("b"), &clock_b_);
  EXPECT_TRUE(a.Tick());
  EXPECT_FALSE(b.Tick());
  json lease = api_->Get(FakeKubeApi::Leases("kiln"), "kiln-controller");
  EXPECT_EQ(lease["spec"]["holderIdentity"], "a");
  EXPECT_EQ(lease["spec"]["leaseDurationSeconds"], 15);
  // a renews every retry period; b keeps following.
  for (int i = 0; i < 10; ++i) {
    clock_a_.Advance(absl::Seconds(2));
    clock_b_.Advance(absl::Seconds(2));
    EXPECT_TRUE(a.Tick());
    EXPECT_FALSE(b.Tick());
  }
  // a dies. b takes over once 15 s passed since it last saw the record change, not before.
  absl::Duration waited;
  while (!b.Tick()) {
    clock_b_.Advance(absl::Seconds(2));
    waited += absl::Seconds(2);
    ASSERT_LE(waited, absl::Seconds(17));
  }
  EXPECT_GE(waited, absl::Seconds(14));
  lease = api_->Get(FakeKubeApi::Leases("kiln"), "kiln-controller");
  EXPECT_EQ(lease["spec"]["holderIdentity"], "b");
  EXPECT_EQ(lease["spec"]["leaseTransitions"], 1);
  // a comes back: it is a follower now.
  EXPECT_FALSE(a.Tick());
}

TEST_F(LeaderElectionTest, ALeaderThatCannotRenewStepsDownBeforeItsLeaseEnds) {
  LeaderElector a(client_.get(), Options("a"), &clock_a_);
  LeaderElector b(client_.get(), Options("b"), &clock_b_);
  ASSERT_TRUE(a.Tick());
  ASSERT_FALSE(b.Tick());
  api_->SetUnavailable(true);  // a is cut off from the API
  absl::Duration cut;
  while (a.Tick()) {
    clock_a_.Advance(absl::Seconds(2));
    cut += absl::Seconds(2);
    ASSERT_LE(cut, absl::Seconds(12));
  }
  EXPECT_FALSE(a.last_error().empty());
  EXPECT_GE(cut, absl::Seconds(10));  // the renew deadline
  EXPECT_LT(cut, absl::Seconds(15));  // before the lease others see could have run out
  api_->SetUnavailable(false);
  // b still must wait out the lease from when it saw it: never two leaders at once.
  clock_b_.Advance(absl::Seconds(10));
  EXPECT_FALSE(b.Tick());
  clock_b_.Advance(absl::Seconds(6));
  EXPECT_TRUE(b.Tick());
}

// A renewal counts from before it was sent, not from its answer: with each request taking 2 s
// (the simulated clock moves while it is out), a leader cut off after renewing at 0 steps down
// by 10 s, the renew deadline, not 10 s after the slow answer came back.
TEST_F(LeaderElectionTest, TheRenewDeadlineCountsFromWhenTheRenewalWasSent) {
  LeaderElector a(client_.get(), Options("a"), &clock_a_);
  api_->SetOnRequest([this] { clock_a_.Advance(absl::Seconds(2)); });
  const absl::Time sent = clock_a_.Now();
  ASSERT_TRUE(a.Tick());  // a GET and a create: answered at 4 s
  api_->SetUnavailable(true);
  while (a.Tick()) ASSERT_LE(clock_a_.Now() - sent, absl::Seconds(20));
  EXPECT_LE(clock_a_.Now() - sent, absl::Seconds(10));
  EXPECT_EQ(a.StepDownAt(), absl::InfiniteFuture());  // following: no deadline
  // Leading again, then stalled past its deadline (no tick): it steps down before it sends
  // anything, rather than acting on until an answer comes.
  api_->SetUnavailable(false);
  api_->SetOnRequest(nullptr);
  const absl::Time renewed = clock_a_.Now();
  ASSERT_TRUE(a.Tick());  // its own lease: renewed at once
  EXPECT_EQ(a.StepDownAt(), renewed + absl::Seconds(10));  // the caller wakes by then
  std::atomic<int> requests{0};
  api_->SetOnRequest([&requests] { requests++; });
  clock_a_.Advance(absl::Seconds(11));
  EXPECT_FALSE(a.Tick());
  EXPECT_EQ(requests.load(), 0);
  api_->SetOnRequest(nullptr);
}

TEST_F(LeaderElectionTest, ReleasedLeasesAreTakenAtOnceAndBadOptionsRefused) {
  LeaderElector a(client_.get(), Options("a"), &clock_a_);
  LeaderElector b(client_.get(), Options("b"), &clock_b_);
  ASSERT_TRUE(a.Tick());
  ASSERT_FALSE(b.Tick());
  a.Release();
  EXPECT_FALSE(a.IsLeader());
  EXPECT_TRUE(b.Tick());
  LeaderElectionOptions bad = Options("x");
  bad.renew_deadline = absl::Seconds(20);
  EXPECT_FALSE(LeaderElector::Validate(bad).ok());
  EXPECT_FALSE(LeaderElector::Validate(Options("")).ok());
  EXPECT_TRUE(LeaderElector::Validate(Options("x")).ok());
}

}  // namespace
}  // namespace kiln
