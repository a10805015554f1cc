// The controller's admin API over a real SQLite store, without a socket.
#include "controller/admin_api.h"

#include <unistd.h>

#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "common/clock.h"
#include "controller/model_deployment.h"
#include "controller/sqlite_store.h"
#include "gtest/gtest.h"
#include "tests/support/eventually.h"

namespace kiln {
namespace {

const char* kDoc = R"({"apiVersion": "serving.kiln.dev/v1alpha1", "kind": "ModelDeployment",
  "metadata": {"name": "emb", "labels": {"team": "search"}},
  "spec": {"model": {"name": "encoder", "version": "1", "uri": "file:///m/encoder/1/model.pt"},
           "replicas": 2}})";

class AdminApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (std::filesystem::temp_directory_path() /
            ("kiln-api-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    std::filesystem::remove_all(dir_);
    SqliteStore::Options o;
    o.state_dir = dir_;
    store_ = std::move(*SqliteStore::Open(o, &clock_));
    api_ = std::make_unique<AdminApi>(store_.get(), "");
  }
  void TearDown() override {
    api_.reset();
    store_.reset();
    std::filesystem::remove_all(dir_);
  }
  ApiResponse Call(const std::string& method, const std::string& path, const std::string& body = "",
                   const std::string& auth = "") {
    return api_->Handle({method, path, body, auth});
  }
  static nlohmann::json Body(const ApiResponse& r) { return nlohmann::json::parse(r.body); }
  std::string One(const std::string& name) { return std::string(kDeploymentsPath) + "/" + name; }

  SimulatedClock clock_{absl::FromUnixSeconds(1800000000)};
  std::string dir_;
  std::unique_ptr<SqliteStore> store_;
  std::unique_ptr<AdminApi> api_;
};

TEST_F(AdminApiTest, CreateGetListReplaceDelete) {
  auto created = Call("POST", kDeploymentsPath, kDoc);
  ASSERT_EQ(created.code, 201) << created.body;
  auto obj = Body(created);
  EXPECT_EQ(obj["kind"], "ModelDeployment");
  EXPECT_EQ(obj["metadata"]["name"], "emb");
  EXPECT_EQ(obj["metadata"]["generation"], 1);
  EXPECT_EQ(obj["metadata"]["labels"]["team"], "search");
  EXPECT_EQ(obj["metadata"]["creationTimestamp"], "2027-01-15T08:00:00Z");
  EXPECT_EQ(obj["spec"]["replicas"], 2);
  EXPECT_EQ(obj["spec"]["warmPool"], 0);  // defaults filled in
  EXPECT_EQ(Call("POST", kDeploymentsPath, kDoc).code, 409);

  auto got = Call("GET", One("emb"));
  ASSERT_EQ(got.code, 200);
  EXPECT_EQ(Body(got)["spec"], obj["spec"]);
  auto list = Body(Call("GET", kDeploymentsPath));
  EXPECT_EQ(list["kind"], "ModelDeploymentList");
  ASSERT_EQ(list["items"].size(), 1u);

  // Replace with the version read: accepted, generation 2. With the old one again: 409.
  nlohmann::json edit = nlohmann::json::parse(kDoc);
  edit["spec"]["replicas"] = 4;
  edit["metadata"]["resourceVersion"] = obj["metadata"]["resourceVersion"];
  auto replaced = Call("PUT", One("emb"), edit.dump());
  ASSERT_EQ(replaced.code, 200) << replaced.body;
  EXPECT_EQ(Body(replaced)["metadata"]["generation"], 2);
  auto conflict = Call("PUT", One("emb"), edit.dump());
  EXPECT_EQ(conflict.code, 409);
  EXPECT_EQ(Body(conflict)["reason"], "Conflict");
  // YAML bodies work too.
  auto yaml = Call("PUT", One("emb"),
                   "apiVersion: serving.kiln.dev/v1alpha1\nkind: ModelDeployment\n"
                   "metadata: {name: emb}\nspec:\n  model: {name: encoder, version: '2', uri: "
                   "'file:///m/encoder/2/model.pt'}\n");
  ASSERT_EQ(yaml.code, 200) << yaml.body;
  EXPECT_EQ(Body(yaml)["spec"]["model"]["version"], "2");

  ASSERT_EQ(Call("DELETE", One("emb")).code, 200);
  EXPECT_EQ(Call("GET", One("emb")).code, 404);
  EXPECT_EQ(Call("DELETE", One("emb")).code, 404);
}

TEST_F(AdminApiTest, BadInputNamesTheField) {
  nlohmann::json bad = nlohmann::json::parse(kDoc);
  bad["spec"]["replicas"] = -3;
  auto r = Call("POST", kDeploymentsPath, bad.dump());
  EXPECT_EQ(r.code, 400);
  auto status = Body(r);
  EXPECT_EQ(status["kind"], "Status");
  EXPECT_EQ(status["reason"], "Invalid");
  EXPECT_NE(status["message"].get<std::string>().find("request body: spec.replicas"),
            std::string::npos)
      << r.body;
  EXPECT_EQ(Call("POST", kDeploymentsPath, "{not json").code, 400);
  EXPECT_EQ(Call("POST", kDeploymentsPath, "").code, 400);
  ASSERT_EQ(Call("POST", kDeploymentsPath, kDoc).code, 201);
  auto other = nlohmann::json::parse(kDoc);
  other["metadata"]["name"] = "other";
  auto mismatch = Call("PUT", One("emb"), other.dump());
  EXPECT_EQ(mismatch.code, 400);
  EXPECT_NE(mismatch.body.find("metadata.name"), std::string::npos);
  auto bad_rv = nlohmann::json::parse(kDoc);
  bad_rv["metadata"]["resourceVersion"] = "abc";
  EXPECT_EQ(Call("PUT", One("emb"), bad_rv.dump()).code, 400);
  EXPECT_EQ(Call("PATCH", One("emb"), kDoc).code, 405);
  EXPECT_EQ(Call("GET", "/apis/other").code, 404);
  EXPECT_EQ(Call("GET", One("emb") + "/status/x").code, 404);
  EXPECT_EQ(Call("PUT", One("nope"), kDoc).code, 400);  // name mismatch comes first
}

TEST_F(AdminApiTest, ScaleSubresource) {
  ASSERT_EQ(Call("POST", kDeploymentsPath, kDoc).code, 201);
  auto s = Call("PUT", One("emb") + "/scale", R"({"spec": {"replicas": 7}})");
  ASSERT_EQ(s.code, 200) << s.body;
  EXPECT_EQ(Body(Call("GET", One("emb")))["spec"]["replicas"], 7);
  EXPECT_EQ(Body(Call("GET", One("emb") + "/scale"))["spec"]["replicas"], 7);
  EXPECT_EQ(Call("PUT", One("emb") + "/scale", R"({"spec": {"replicas": -1}})").code, 400);
  EXPECT_EQ(Call("PUT", One("emb") + "/scale", R"({"replicas": 3})").code, 400);
  EXPECT_EQ(Call("PUT", One("nope") + "/scale", R"({"spec": {"replicas": 3}})").code, 404);
  auto as = nlohmann::json::parse(kDoc);
  as["metadata"]["name"] = "auto";
  as["spec"].erase("replicas");
  as["spec"]["autoscale"] = {{"min", 1}, {"max", 4}};
  ASSERT_EQ(Call("POST", kDeploymentsPath, as.dump()).code, 201);
  auto refused = Call("PUT", One("auto") + "/scale", R"({"spec": {"replicas": 3}})");
  EXPECT_EQ(refused.code, 400);
  EXPECT_NE(refused.body.find("autoscale"), std::string::npos);
}

TEST_F(AdminApiTest, RolloutActionsGoToTheController) {
  std::vector<std::pair<std::string, std::string>> asked;
  api_->SetRolloutActions(
      [&](const std::string& name, const std::string& action) -> absl::StatusOr<bool> {
        asked.emplace_back(name, action);
        if (action == "resume") return absl::FailedPreconditionError("no rollout in progress");
        if (action == "pause") return absl::UnavailableError("not in this controller's loop yet");
        if (action == "abort") return absl::DeadlineExceededError("not written down yet");
        return name == "emb";  // written down; for another, only accepted
      });
  ASSERT_EQ(Call("POST", kDeploymentsPath, kDoc).code, 201);
  auto r = Call("POST", One("emb") + "/rollout", R"({"action": "promote"})");
  EXPECT_EQ(r.code, 200) << r.body;
  EXPECT_NE(r.body.find("promote applied"), std::string::npos) << r.body;
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0], std::make_pair(std::string("emb"), std::string("promote")));
  // Accepted, not yet written down (the controller's waiters are all busy): 202.
  nlohmann::json other = nlohmann::json::parse(kDoc);
  other["metadata"]["name"] = "emb2";
  ASSERT_EQ(Call("POST", kDeploymentsPath, other.dump()).code, 201);
  r = Call("POST", One("emb2") + "/rollout", R"({"action": "promote"})");
  EXPECT_EQ(r.code, 202) << r.body;
  EXPECT_NE(r.body.find("promote requested"), std::string::npos) << r.body;
  // Not written within the wait: a timeout, 504.
  r = Call("POST", One("emb") + "/rollout", R"({"action": "abort"})");
  EXPECT_EQ(r.code, 504) << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"Timeout\""), std::string::npos) << r.body;
  // No rollout in progress: a conflict with its state. A controller that has not read the
  // deployment yet: try again later.
  r = Call("POST", One("emb") + "/rollout", R"({"action": "resume"})");
  EXPECT_EQ(r.code, 409) << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"Conflict\""), std::string::npos) << r.body;
  r = Call("POST", One("emb") + "/rollout", R"({"action": "pause"})");
  EXPECT_EQ(r.code, 503) << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"ServiceUnavailable\""), std::string::npos) << r.body;
  EXPECT_EQ(Call("POST", One("emb") + "/rollout", R"({"do": "promote"})").code, 400);
  EXPECT_EQ(Call("POST", One("nope") + "/rollout", R"({"action": "promote"})").code, 404);
  EXPECT_EQ(Call("GET", One("emb") + "/rollout").code, 405);
}

// A deployment's events, every deployment's, and every node's replicas (from the nodes
// source), each naming its node.
TEST_F(AdminApiTest, EventsAndReplicas) {
  ASSERT_EQ(Call("POST", kDeploymentsPath, kDoc).code, 201);
  store_->RecordEvent(kModelDeploymentKind, "emb", "Warning", "RolledBack", "canary 2 failed");
  store_->RecordEvent(kModelDeploymentKind, "other", "Normal", "RolloutStep", "step 1");
  auto mine = Call("GET", One("emb") + "/events");
  ASSERT_EQ(mine.code, 200) << mine.body;
  auto items = Body(mine)["items"];
  ASSERT_EQ(items.size(), 1u) << mine.body;
  EXPECT_EQ(items[0]["reason"], "RolledBack");
  EXPECT_EQ(items[0]["type"], "Warning");
  EXPECT_EQ(items[0]["message"], "canary 2 failed");
  EXPECT_EQ(items[0]["involvedObject"]["name"], "emb");
  EXPECT_EQ(items[0]["lastTimestamp"], "2027-01-15T08:00:00Z");
  EXPECT_EQ(Body(Call("GET", kEventsPath))["items"].size(), 2u);
  EXPECT_EQ(Call("GET", One("nope") + "/events").code, 404);
  EXPECT_EQ(Call("POST", kEventsPath).code, 405);
  // Replicas: none without a nodes source; then each node's, naming the node.
  EXPECT_EQ(Call("GET", kReplicasPath).code, 404);
  api_->SetNodesSource([] {
    return R"({"items": [{"name": "n1", "replicas": [{"id": "emb.0", "state": "SERVING"}]},
                         {"name": "n2", "replicas": [{"id": "emb.1", "state": "WARM"}]}]})";
  });
  auto reps = Body(Call("GET", kReplicasPath))["items"];
  ASSERT_EQ(reps.size(), 2u);
  EXPECT_EQ(reps[0]["id"], "emb.0");
  EXPECT_EQ(reps[0]["node"], "n1");
  EXPECT_EQ(reps[1]["node"], "n2");
  EXPECT_EQ(reps[1]["state"], "WARM");
}

TEST_F(AdminApiTest, DeletingANodeForgetsItUnlessItIsConnected) {
  std::vector<std::string> asked;
  api_->SetNodeRemover([&](const std::string& name) {
    asked.push_back(name);
    if (name == "up") return absl::FailedPreconditionError("node 'up' is connected");
    if (name == "nope") return absl::NotFoundError("node 'nope' is not known");
    return absl::OkStatus();
  });
  const std::string nodes = kNodesPath;
  auto r = Call("DELETE", nodes + "/gone");
  EXPECT_EQ(r.code, 200) << r.body;
  EXPECT_EQ(Body(r)["details"]["name"], "gone");
  auto up = Call("DELETE", nodes + "/up");
  EXPECT_EQ(up.code, 409) << up.body;
  EXPECT_NE(up.body.find("connected"), std::string::npos);
  EXPECT_EQ(Call("DELETE", nodes + "/nope").code, 404);
  EXPECT_EQ(Call("GET", nodes + "/gone").code, 405);
  EXPECT_EQ(Call("DELETE", nodes + "/a/b").code, 404);
  // A name a path cannot hold as is comes escaped (kilnctl does it).
  EXPECT_EQ(Call("DELETE", nodes + "/gpu%20node%3F1").code, 200);
  EXPECT_EQ(asked, (std::vector<std::string>{"gone", "up", "nope", "gpu node?1"}));
}

TEST_F(AdminApiTest, BearerTokenWhenConfigured) {
  AdminApi secured(store_.get(), "s3cret");
  EXPECT_EQ(secured.Handle({"GET", kDeploymentsPath, "", ""}).code, 401);
  EXPECT_EQ(secured.Handle({"GET", kDeploymentsPath, "", "Bearer wrong"}).code, 401);
  EXPECT_EQ(secured.Handle({"GET", kDeploymentsPath, "", "Bearer s3cret"}).code, 200);
  EXPECT_EQ(secured.Handle({"GET", "/healthz", "", ""}).code, 200);  // probes need no token
}

}  // namespace
}  // namespace kiln

namespace kiln {
namespace {

// At most `max_waiting` callers wait for their action to be written; the others are answered
// "requested" at once, their tickets marked as nobody's (a zero wait), and a freed place is
// taken again.
TEST(RolloutActionAnswersTest, AtMostTwoCallersWaitAndTheOthersAreAnsweredAtOnce) {
  RolloutActionAnswers answers(2, absl::Seconds(10));
  absl::Mutex mu;
  bool written = false;
  std::vector<std::pair<uint64_t, absl::Duration>> awaited;  // guarded by mu
  uint64_t next_ticket = 0;                                  // guarded by mu
  auto request = [&]() -> absl::StatusOr<uint64_t> {
    absl::MutexLock lock(&mu);
    return ++next_ticket;
  };
  auto await = [&](uint64_t ticket, absl::Duration wait) {
    absl::MutexLock lock(&mu);
    awaited.emplace_back(ticket, wait);
    if (wait == absl::ZeroDuration()) return absl::DeadlineExceededError("not yet");
    mu.Await(absl::Condition(&written));
    return absl::OkStatus();
  };
  auto waiting_now = [&] {
    absl::MutexLock lock(&mu);
    return awaited.size();
  };
  absl::StatusOr<bool> first, second, third;
  std::thread a([&] { first = answers.Answer(request, await); });
  std::thread b([&] { second = answers.Answer(request, await); });
  std::thread c;
  // Whatever fails below, the waiters are let go and joined (a failed check must report, not
  // hang or terminate).
  auto release = [&] {
    {
      absl::MutexLock lock(&mu);
      written = true;
    }
    for (std::thread* t : {&a, &b, &c}) {
      if (t->joinable()) t->join();
    }
  };
  struct Finally {
    std::function<void()> fn;
    ~Finally() { fn(); }
  } finally{release};
  ASSERT_TRUE(testing::Eventually([&] { return waiting_now() == 2; }, absl::Seconds(10)));
  c = std::thread([&] { third = answers.Answer(request, await); });  // both places taken
  ASSERT_TRUE(testing::Eventually([&] { return waiting_now() == 3; }, absl::Seconds(10)));
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(awaited[2], std::make_pair(uint64_t{3}, absl::ZeroDuration()));
    EXPECT_EQ(awaited[0].second, absl::Seconds(10));
  }
  release();
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_FALSE(*third);  // requested, not waited for
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_TRUE(*first);
  EXPECT_TRUE(*second);
  absl::StatusOr<bool> fourth = answers.Answer(request, await);  // a place is free again
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_TRUE(*fourth);
}

// A refused request or a failed wait is the caller's answer, and frees its place.
TEST(RolloutActionAnswersTest, ErrorsAreAnsweredAndFreeThePlace) {
  RolloutActionAnswers answers(1, absl::Seconds(1));
  auto refused = [] { return absl::StatusOr<uint64_t>(absl::NotFoundError("no such deployment")); };
  auto never = [](uint64_t, absl::Duration) { return absl::OkStatus(); };
  EXPECT_EQ(answers.Answer(refused, never).status().code(), absl::StatusCode::kNotFound);
  auto ticket = [] { return absl::StatusOr<uint64_t>(7); };
  auto timeout = [](uint64_t, absl::Duration) { return absl::DeadlineExceededError("Timeout"); };
  EXPECT_EQ(answers.Answer(ticket, timeout).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  auto ok = answers.Answer(ticket, never);
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(*ok);  // the one place was given back after the timeout
}

}  // namespace
}  // namespace kiln
