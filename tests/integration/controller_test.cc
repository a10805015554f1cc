// The real kiln-controller and kilnctl binaries over loopback HTTP with a real SQLite store.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"
#include "kiln/v1/control_plane.grpc.pb.h"
#include "tests/support/raw_http_client.h"
#include "tests/support/shell.h"

namespace {

namespace fs = std::filesystem;

using kiln::testing::ReadFile;
using kiln::testing::FindPromtool;
using kiln::testing::PromtoolCheck;
using kiln::testing::Shell;

class ControllerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("kiln-ctl-" + std::to_string(getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    Stop(SIGKILL);
    fs::remove_all(dir_);
  }

  // Starts kiln-controller on a free port and waits (bounded) for its listening line.
  void Start(const std::vector<std::string>& extra = {}) {
    std::string log = dir_ + "/controller.log";
    std::ofstream(log, std::ios::trunc).close();
    std::vector<std::string> args = {KILN_CONTROLLER_BIN, "--state-dir", dir_ + "/state",
                                     "--admin-port", "0"};
    args.insert(args.end(), extra.begin(), extra.end());
    if (std::find(extra.begin(), extra.end(), "--listen") == extra.end()) {
      args.insert(args.end(), {"--listen", "127.0.0.1:0"});  // a free port, not 7071
    }
    pid_ = kiln::testing::SpawnLogged(args, log);
    ASSERT_GE(pid_, 0);
    for (int i = 0; i < 200; ++i) {
      std::string text = ReadFile(log);
      size_t at = text.find("admin=http://127.0.0.1:");
      if (at != std::string::npos) {
        port_ = std::stoi(text.substr(at + 23));
        size_t control = text.find("control=127.0.0.1:");
        if (control != std::string::npos) control_port_ = std::stoi(text.substr(control + 18));
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    FAIL() << "kiln-controller did not start: " << ReadFile(log);
  }
  void Stop(int sig) {
    if (pid_ <= 0) return;
    kill(pid_, sig);
    int status = 0;
    waitpid(pid_, &status, 0);
    last_status_ = status;
    pid_ = -1;
  }
  std::string Ctl(const std::string& args) {
    return std::string(KILNCTL_BIN) + " --server http://127.0.0.1:" + std::to_string(port_) + " " +
           args;
  }
  std::string Write(const std::string& name, const std::string& text) {
    std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // kilnctl `args` again and again until its output holds `text` (with `present` false: until
  // it no longer does), for at most about ten seconds: the controller acts on its next pass,
  // not at once. The last output.
  std::string CtlUntil(const std::string& args, const std::string& text, bool present = true) {
    kiln::testing::ShellResult r;
    for (int i = 0; i < 200; ++i) {
      r = Shell(Ctl(args));
      if (r.rc == 0 && (r.out.find(text) != std::string::npos) == present) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return r.out;
  }

  std::string dir_;
  pid_t pid_ = -1;
  int port_ = 0;
  int control_port_ = 0;
  int last_status_ = 0;
};

// One ControlPlane.Connect stream carrying `messages` as they are (bytes, not necessarily an
// AgentMessage): the status the controller ends it with, or OK when it is still open `wait`
// after them (then cancelled by the test).
grpc::Status Connect(int port, const std::vector<std::string>& messages,
                     std::chrono::milliseconds wait = std::chrono::seconds(10)) {
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + wait + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  void* tag = nullptr;
  bool ok = false;
  auto call = stub.PrepareCall(&ctx, "/kiln.v1.ControlPlane/Connect", &cq);
  call->StartCall(reinterpret_cast<void*>(1));
  if (!cq.Next(&tag, &ok) || !ok) return grpc::Status(grpc::StatusCode::UNKNOWN, "no call");
  for (const auto& m : messages) {
    grpc::Slice slice(m);
    grpc::ByteBuffer bytes(&slice, 1);
    call->Write(bytes, reinterpret_cast<void*>(2));
    if (!cq.Next(&tag, &ok) || !ok) break;  // the controller ended the stream
  }
  // A message or the end: whichever comes first. The controller sends nothing to a node
  // until its loop runs (not within this test's --observe-seconds), so a read means nothing
  // but a close here.
  grpc::ByteBuffer reply;
  call->Read(&reply, reinterpret_cast<void*>(3));
  grpc::Status status;
  bool ended = false;
  auto deadline = std::chrono::system_clock::now() + wait;
  for (;;) {
    auto r = cq.AsyncNext(&tag, &ok, deadline);
    if (r != grpc::CompletionQueue::GOT_EVENT) break;  // still open
    if (tag == reinterpret_cast<void*>(3) && !ok) {
      ended = true;
      break;
    }
  }
  if (!ended) ctx.TryCancel();
  call->Finish(&status, reinterpret_cast<void*>(4));
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(4)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return ended ? status : grpc::Status::OK;
}

std::string Bytes(const kiln::v1::AgentMessage& m) { return m.SerializeAsString(); }

// `text`'s lines, without their ends.
std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// A table row's cells, split at blanks (the cells these tests look at hold none).
std::vector<std::string> Words(const std::string& line) {
  std::vector<std::string> out;
  std::istringstream in(line);
  for (std::string word; in >> word;) out.push_back(word);
  return out;
}

// The admin API's ModelDeployments, for tests that speak HTTP to it without kilnctl.
const std::string kDeployments = "/apis/serving.kiln.dev/v1alpha1/modeldeployments";

// One request on a fresh loopback connection to `port`: the response (code 0 when none came).
kiln::testing::RawHttpClient::Response Http(int port, const std::string& request) {
  kiln::testing::RawHttpClient client(port);
  if (!client.connected() || !client.Send(request)) return {};
  return client.Read();
}

std::string PutRequest(const std::string& path, const std::string& body) {
  return "PUT " + path + " HTTP/1.1\r\nHost: x\r\nContent-Length: " +
         std::to_string(body.size()) + "\r\n\r\n" + body;
}

std::string DeleteRequest(const std::string& path) {
  return "DELETE " + path + " HTTP/1.1\r\nHost: x\r\n\r\n";
}

const char* kSpec = R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: embedder}
spec:
  model: {name: encoder, version: "1", uri: "file:///models/encoder/1/model.pt"}
  replicas: 2
  warmPool: 1
)";

// kSpec at version 2, rolled out as a canary that takes half the traffic for a minute.
const char* kSpecV2 = R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: embedder}
spec:
  model: {name: encoder, version: "2", uri: "file:///models/encoder/2/model.pt"}
  replicas: 2
  warmPool: 1
  rollout:
    strategy: Canary
    steps: [{weight: 50, pause: 1m}]
)";

TEST_F(ControllerTest, ApplyGetScaleDeleteThroughKilnctl) {
  Start();
  std::string f = Write("emb.yaml", kSpec);
  auto r = Shell(Ctl("apply -f " + f));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder created\n");
  r = Shell(Ctl("apply -f " + f));
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder unchanged\n");
  r = Shell(Ctl("get deployments"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("NAME"), std::string::npos);
  EXPECT_NE(r.out.find("embedder   encoder   1         2"), std::string::npos) << r.out;
  r = Shell(Ctl("scale embedder --replicas 3"));
  ASSERT_EQ(r.rc, 0) << r.out;
  r = Shell(Ctl("get deploy embedder -o json"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"replicas\": 3"), std::string::npos) << r.out;
  r = Shell(Ctl("get deploy missing"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("Error from server (NotFound)"), std::string::npos) << r.out;
  r = Shell(Ctl("delete deployment embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  r = Shell(Ctl("get deployments"));
  EXPECT_NE(r.out.find("No resources found."), std::string::npos) << r.out;
}

// The other output formats. -o yaml is block YAML that kilnctl reads back: an exported object
// applies as unchanged (its spec came back whole). -o wide adds the warm pool, the GPUs, the
// rollout strategy and the generation to the table.
TEST_F(ControllerTest, GetDeploymentsAsYamlAndWide) {
  Start();
  std::string spec = std::string(kSpec) +
                     "  resources: {gpus: 1, gpuMemory: 2Gi}\n"
                     "  rollout: {strategy: BlueGreen}\n";
  auto r = Shell(Ctl("apply -f " + Write("emb.yaml", spec)));
  ASSERT_EQ(r.rc, 0) << r.out;
  r = Shell(Ctl("get deployments -o yaml"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.rfind("apiVersion: serving.kiln.dev/v1alpha1\n", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("\nkind: ModelDeploymentList\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\nitems:\n"), std::string::npos) << r.out;
  for (const char* line : {" kind: ModelDeployment\n", " name: embedder\n", " name: encoder\n",
                           " file:///models/encoder/1/model.pt", " replicas: 2\n",
                           " warmPool: 1\n", " gpus: 1\n", " gpuMemory: 2147483648\n",
                           " strategy: BlueGreen\n"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << " in:\n" << r.out;
  }
  EXPECT_EQ(r.out.find("\"apiVersion\""), std::string::npos) << "JSON, not YAML:\n" << r.out;

  // One object, exported and applied again: nothing changes.
  r = Shell(Ctl("get deploy embedder -o yaml"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.rfind("apiVersion: serving.kiln.dev/v1alpha1\n", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("\nkind: ModelDeployment\n"), std::string::npos) << r.out;
  const std::string exported = Write("exported.yaml", r.out);

  r = Shell(Ctl("get deployments -o wide"));
  ASSERT_EQ(r.rc, 0) << r.out;
  std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  EXPECT_EQ(Words(lines[0]),
            (std::vector<std::string>{"NAME", "MODEL", "VERSION", "REPLICAS", "READY", "AGE",
                                      "WARM", "GPUS", "STRATEGY", "GENERATION"}))
      << r.out;
  std::vector<std::string> row = Words(lines[1]);
  ASSERT_EQ(row.size(), 10u) << r.out;
  EXPECT_EQ(row[0], "embedder");
  EXPECT_EQ(row[1], "encoder");
  EXPECT_EQ(row[2], "1");
  EXPECT_EQ(row[3], "2");
  EXPECT_EQ(row[4], "0/2");  // no agents: nothing serves
  EXPECT_EQ(row[6], "1");    // WARM
  EXPECT_EQ(row[7], "1");    // GPUS
  EXPECT_EQ(row[8], "BlueGreen");
  EXPECT_EQ(row[9], "1");    // GENERATION
  // Without -o wide: the first six columns only.
  r = Shell(Ctl("get deployments"));
  ASSERT_EQ(r.rc, 0) << r.out;
  lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 2u) << r.out;
  EXPECT_EQ(Words(lines[0]), (std::vector<std::string>{"NAME", "MODEL", "VERSION", "REPLICAS",
                                                       "READY", "AGE"}))
      << r.out;
  EXPECT_EQ(Words(lines[1]).size(), 6u) << r.out;

  r = Shell(Ctl("apply -f " + exported));
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder unchanged\n") << ReadFile(exported);
  r = Shell(Ctl("get deploy embedder -o json"));
  EXPECT_NE(r.out.find("\"generation\": 1"), std::string::npos) << r.out;

  // Someone scales it after the export: the exported file, edited and applied, is a Conflict,
  // not a silent undo of their change. Exported again, the edit applies.
  r = Shell(Ctl("scale embedder --replicas 3"));
  ASSERT_EQ(r.rc, 0) << r.out;
  std::string edited = ReadFile(exported);
  const size_t at = edited.find(" replicas: 2\n");
  ASSERT_NE(at, std::string::npos) << edited;
  edited.replace(at, 13, " replicas: 4\n");
  r = Shell(Ctl("apply -f " + Write("edited.yaml", edited)));
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("Conflict"), std::string::npos) << r.out;
  r = Shell(Ctl("get deploy embedder -o json"));
  EXPECT_NE(r.out.find("\"replicas\": 3"), std::string::npos) << r.out;
  r = Shell(Ctl("get deploy embedder -o yaml"));
  ASSERT_EQ(r.rc, 0) << r.out;
  edited = r.out;
  const size_t at3 = edited.find(" replicas: 3\n");
  ASSERT_NE(at3, std::string::npos) << edited;
  edited.replace(at3, 13, " replicas: 4\n");
  r = Shell(Ctl("apply -f " + Write("edited.yaml", edited)));
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder configured\n");
  r = Shell(Ctl("get deploy embedder -o json"));
  EXPECT_NE(r.out.find("\"replicas\": 4"), std::string::npos) << r.out;
  // Deleted since: the pinned file does not make it again.
  ASSERT_EQ(Shell(Ctl("delete deployment embedder")).rc, 0);
  r = Shell(Ctl("apply -f " + dir_ + "/edited.yaml"));
  EXPECT_NE(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("was deleted since this file was read"), std::string::npos) << r.out;
  r = Shell(Ctl("get deployments"));
  EXPECT_NE(r.out.find("No resources found."), std::string::npos) << r.out;
}

TEST_F(ControllerTest, InvalidSpecsAndBadUsageAreClearErrors) {
  Start();
  std::string bad = Write("bad.yaml", std::string(kSpec).replace(std::string(kSpec).find("replicas: 2"), 11, "replicas: -2"));
  auto r = Shell(Ctl("apply -f " + bad));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("bad.yaml: spec.replicas: must be in 0..10000"), std::string::npos) << r.out;
  r = Shell(Ctl("apply -f " + dir_ + "/missing.yaml"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("no such file"), std::string::npos) << r.out;
  r = Shell(Ctl("get pods"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("resource type \"pods\""), std::string::npos) << r.out;
  r = Shell(Ctl("scale embedder"));
  EXPECT_EQ(r.rc, 2);
  EXPECT_NE(r.out.find("--replicas"), std::string::npos) << r.out;
  r = Shell(std::string(KILNCTL_BIN) + " --server http://127.0.0.1:1 get deployments");
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("cannot reach kiln-controller"), std::string::npos) << r.out;
  r = Shell(std::string(KILN_CONTROLLER_BIN));
  EXPECT_NE(r.rc, 0);
  EXPECT_NE(r.out.find("--state-dir"), std::string::npos) << r.out;
}

// `apply -f DIR` applies the directory's .yaml, .yml and .json files in name order (others
// are left alone). Every file is parsed and checked before anything is sent: one invalid file
// stops them all, the valid ones beside it included, and the error names the file and the field.
TEST_F(ControllerTest, ApplyADirectoryAppliesAllOfItOrNothing) {
  Start();
  fs::create_directories(dir_ + "/good");
  Write("good/alpha.yaml", R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: alpha}
spec:
  model: {name: encoder, version: "1", uri: "file:///models/encoder/1/model.pt"}
  replicas: 1
)");
  Write("good/beta.json", R"({"apiVersion": "serving.kiln.dev/v1alpha1",
 "kind": "ModelDeployment", "metadata": {"name": "beta"},
 "spec": {"model": {"name": "reranker", "version": "3",
                    "uri": "file:///models/reranker/3/model.pt"},
          "replicas": 2}}
)");
  Write("good/README.txt", "not a deployment: {\n");
  auto r = Shell(Ctl("apply -f " + dir_ + "/good"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out,
            "modeldeployment.serving.kiln.dev/alpha created\n"
            "modeldeployment.serving.kiln.dev/beta created\n");
  r = Shell(Ctl("get deployments"));
  ASSERT_EQ(r.rc, 0) << r.out;
  std::vector<std::string> lines = Lines(r.out);
  ASSERT_EQ(lines.size(), 3u) << r.out;
  std::vector<std::string> alpha = Words(lines[1]), beta = Words(lines[2]);
  ASSERT_EQ(alpha.size(), 6u) << r.out;
  ASSERT_EQ(beta.size(), 6u) << r.out;
  EXPECT_EQ(alpha[0], "alpha");
  EXPECT_EQ(alpha[1], "encoder");
  EXPECT_EQ(alpha[3], "1");
  EXPECT_EQ(beta[0], "beta");
  EXPECT_EQ(beta[1], "reranker");
  EXPECT_EQ(beta[2], "3");
  EXPECT_EQ(beta[3], "2");
  r = Shell(Ctl("apply -f " + dir_ + "/good"));
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out,
            "modeldeployment.serving.kiln.dev/alpha unchanged\n"
            "modeldeployment.serving.kiln.dev/beta unchanged\n");

  // A valid file, then one without spec.model.name.
  fs::create_directories(dir_ + "/mixed");
  Write("mixed/a-gamma.yml", R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: gamma}
spec:
  model: {name: scorer, version: "1", uri: "file:///models/scorer/1/model.pt"}
)");
  const std::string broken = Write("mixed/b-broken.yaml", R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: delta}
spec:
  model: {version: "1", uri: "file:///models/scorer/1/model.pt"}
)");
  r = Shell(Ctl("apply -f " + dir_ + "/mixed"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(r.out, "error: " + broken + ": spec.model.name: required field is missing\n");
  r = Shell(Ctl("get deploy gamma"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(r.out, "Error from server (NotFound): ModelDeployment 'gamma' not found\n");
  r = Shell(Ctl("get deployments"));
  EXPECT_EQ(Lines(r.out).size(), 3u) << r.out;  // alpha and beta only

  // A directory with nothing to apply.
  fs::create_directories(dir_ + "/none");
  Write("none/notes.txt", "nothing here\n");
  r = Shell(Ctl("apply -f " + dir_ + "/none"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(r.out, "error: " + dir_ + "/none: no .yaml, .yml or .json files in it\n");
}

// Straight to the REST API: kilnctl checks a spec before it sends it, so a client that does
// not is what the server's own checks are for. A bad body, JSON or YAML, is 400 Invalid naming
// the field; a second create of a name is 409; an unknown name is 404 for GET and DELETE.
TEST_F(ControllerTest, TheRestApiRefusesBadBodiesAndUnknownNames) {
  Start();
  using kiln::testing::Get;
  using kiln::testing::Post;
  const std::string good = R"({"apiVersion": "serving.kiln.dev/v1alpha1",
 "kind": "ModelDeployment", "metadata": {"name": "ranker"},
 "spec": {"model": {"name": "ranker", "version": "1",
                    "uri": "file:///models/ranker/1/model.pt"}, "replicas": 1}})";
  std::string negative = good;
  negative.replace(negative.find("\"replicas\": 1"), 13, "\"replicas\": -1");
  auto r = Http(port_, Post(kDeployments, negative, "Content-Type: application/json\r\n"));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  EXPECT_NE(r.body.find("\"message\":\"request body: spec.replicas: must be in 0..10000, got -1\""),
            std::string::npos)
      << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"Invalid\""), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("\"kind\":\"Status\""), std::string::npos) << r.body;

  r = Http(port_, Post(kDeployments, R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: ranker}
spec:
  model: {version: "1", uri: "file:///models/ranker/1/model.pt"}
)"));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  EXPECT_NE(r.body.find("request body: spec.model.name: required field is missing"),
            std::string::npos)
      << r.body;

  r = Http(port_, Post(kDeployments, R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: ranker}
spec:
  model: {name: ranker, version: "1", uri: "file:///models/ranker/1/model.pt"}
  replica: 2
)"));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  EXPECT_NE(r.body.find("request body: spec.replica: unknown field"), std::string::npos)
      << r.body;

  r = Http(port_, Post(kDeployments, "{"));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  EXPECT_NE(r.body.find("request body: not valid YAML"), std::string::npos) << r.body;

  // None of that was stored.
  r = Http(port_, Get(kDeployments));
  EXPECT_EQ(r.code, 200) << r.head << r.body;
  EXPECT_NE(r.body.find("\"items\":[]"), std::string::npos) << r.body;

  r = Http(port_, Post(kDeployments, good, "Content-Type: application/json\r\n"));
  ASSERT_EQ(r.code, 201) << r.head << r.body;
  EXPECT_NE(r.body.find("\"name\":\"ranker\""), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("\"generation\":1"), std::string::npos) << r.body;
  r = Http(port_, Post(kDeployments, good, "Content-Type: application/json\r\n"));
  EXPECT_EQ(r.code, 409) << r.head << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"AlreadyExists\""), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("ModelDeployment 'ranker' already exists"), std::string::npos) << r.body;
  // A replace whose body names another deployment than its path.
  r = Http(port_, PutRequest(kDeployments + "/other", good));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  EXPECT_NE(r.body.find("metadata.name: 'ranker' does not match the name in the path 'other'"),
            std::string::npos)
      << r.body;

  r = Http(port_, Get(kDeployments + "/ghost"));
  EXPECT_EQ(r.code, 404) << r.head << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"NotFound\""), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("ModelDeployment 'ghost' not found"), std::string::npos) << r.body;
  r = Http(port_, DeleteRequest(kDeployments + "/ghost"));
  EXPECT_EQ(r.code, 404) << r.head << r.body;
  EXPECT_NE(r.body.find("ModelDeployment 'ghost' not found"), std::string::npos) << r.body;

  r = Http(port_, DeleteRequest(kDeployments + "/ranker"));
  EXPECT_EQ(r.code, 200) << r.head << r.body;
  EXPECT_NE(r.body.find("\"status\":\"Success\""), std::string::npos) << r.body;
  r = Http(port_, Get(kDeployments + "/ranker"));
  EXPECT_EQ(r.code, 404) << r.head << r.body;
}

// Nothing applied is lost when the controller is killed: SIGKILL right after the apply
// returned, restart on the same state dir, and it is all there.
TEST_F(ControllerTest, AKilledControllerLosesNothing) {
  Start();
  std::string multi = Write("two.yaml", std::string(kSpec) + "---\n" +
                                            std::string(kSpec).replace(std::string(kSpec).find("name: embedder"), 14, "name: reranker"));
  auto r = Shell(Ctl("apply -f " + multi));
  ASSERT_EQ(r.rc, 0) << r.out;
  ASSERT_EQ(Shell(Ctl("scale reranker --replicas 4")).rc, 0);
  Stop(SIGKILL);
  ASSERT_TRUE(WIFSIGNALED(last_status_));
  Start();
  r = Shell(Ctl("get deployments -o json"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\"embedder\""), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"reranker\""), std::string::npos) << r.out;
  r = Shell(Ctl("get deploy reranker -o json"));
  EXPECT_NE(r.out.find("\"replicas\": 4"), std::string::npos) << r.out;
  // SIGTERM is a clean stop (exit 0).
  Stop(SIGTERM);
  EXPECT_TRUE(WIFEXITED(last_status_) && WEXITSTATUS(last_status_) == 0) << last_status_;
}

// kilnctl rollout pause, resume and abort against the real controller. With no agents the
// canary never serves, so the rollout of version 2 stays at its first step waiting for its
// canary replica: in progress, which is all the actions need. Each shows in the status, in
// `describe` and in the events; an action with no rollout in progress, or on a deployment
// that does not exist, is an error that says so.
TEST_F(ControllerTest, ARolloutIsPausedResumedAndAbortedThroughKilnctl) {
  Start({"--observe-seconds", "0"});  // no agents to wait for: the loop acts at once
  auto r = Shell(Ctl("apply -f " + Write("v1.yaml", kSpec)));
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string get = "get deploy embedder -o json";
  const std::string log = dir_ + "/controller.log";
  std::string out = CtlUntil(get, "\"stableVersion\": \"1\"");
  ASSERT_NE(out.find("\"stableVersion\": \"1\""), std::string::npos) << out << ReadFile(log);
  EXPECT_NE(out.find("\"phase\": \"Stable\""), std::string::npos) << out;
  // Version 1 is simply stable: there is nothing to pause.
  r = Shell(Ctl("rollout pause embedder"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_EQ(r.out.rfind("Error from server (Conflict): ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("deployment 'embedder' has no rollout in progress (Stable: serving "
                       "version 1)"),
            std::string::npos)
      << r.out;

  r = Shell(Ctl("apply -f " + Write("v2.yaml", kSpecV2)));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder configured\n");
  out = CtlUntil(get, "\"canaryVersion\": \"2\"");
  ASSERT_NE(out.find("\"canaryVersion\": \"2\""), std::string::npos) << out << ReadFile(log);
  EXPECT_NE(out.find("\"phase\": \"Progressing\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"message\": \"canary 2 step 1/1: waiting for 1 canary replica(s) (0 "
                     "ready)\""),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("\"paused\""), std::string::npos) << out;

  r = Shell(Ctl("rollout pause embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder pause applied\n");
  // Answered once written down: the status says so at once, and a controller killed right
  // after the answer has not lost it.
  out = Shell(Ctl(get)).out;
  ASSERT_NE(out.find("\"paused\": true"), std::string::npos) << out << ReadFile(log);
  Stop(SIGKILL);
  Start({"--observe-seconds", "0"});
  out = Shell(Ctl(get)).out;
  ASSERT_NE(out.find("\"paused\": true"), std::string::npos) << out << ReadFile(log);
  EXPECT_NE(out.find("\"canaryVersion\": \"2\""), std::string::npos) << out;
  EXPECT_NE(out.find("waiting for 1 canary replica(s) (0 ready); paused by hand"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("\"phase\": \"Progressing\""), std::string::npos) << out;
  r = Shell(Ctl("describe deployment embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\n  Phase:            Progressing\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  Stable version:   1\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  Canary version:   2 (weight 0%, step 1)\n"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("\n  Paused:           true\n"), std::string::npos) << r.out;

  // The restarted controller takes actions once its loop has read the deployment (bounded).
  for (int i = 0; i < 200; ++i) {
    r = Shell(Ctl("rollout resume embedder"));
    if (r.out.find("try again") == std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder resume applied\n");
  out = Shell(Ctl(get)).out;
  ASSERT_EQ(out.find("\"paused\""), std::string::npos) << out << ReadFile(log);
  EXPECT_NE(out.find("\"canaryVersion\": \"2\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"phase\": \"Progressing\""), std::string::npos) << out;
  r = Shell(Ctl("describe deployment embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out.find("Paused:"), std::string::npos) << r.out;

  r = Shell(Ctl("rollout abort embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_EQ(r.out, "modeldeployment.serving.kiln.dev/embedder abort applied\n");
  out = Shell(Ctl(get)).out;
  ASSERT_NE(out.find("\"phase\": \"Degraded\""), std::string::npos) << out << ReadFile(log);
  EXPECT_NE(out.find("\"failedVersion\": \"2\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"stableVersion\": \"1\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"canaryVersion\": \"\""), std::string::npos) << out;
  EXPECT_NE(out.find("\"message\": \"rollout of version 2 aborted by hand; back to 1\""),
            std::string::npos)
      << out;
  r = Shell(Ctl("describe deployment embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("\n  Phase:            Degraded\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  Canary version:   <none>\n"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\n  Failed version:   2 (not tried again until the spec names "
                       "another)\n"),
            std::string::npos)
      << r.out;
  r = Shell(Ctl("rollout status embedder"));
  EXPECT_EQ(r.rc, 1) << r.out;
  EXPECT_NE(r.out.find("Degraded: rollout of version 2 aborted by hand; back to 1\n"),
            std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("error: rollout of version 2 failed and was rolled back\n"),
            std::string::npos)
      << r.out;
  // Each action left an event (the abort a warning, as a failed analysis would).
  r = Shell(Ctl("get events embedder"));
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* message : {"rollout 1 -> 2 started (Canary)", "paused by hand at step 1",
                              "resumed by hand",
                              "rollout of version 2 aborted by hand; back to 1"}) {
    EXPECT_NE(r.out.find(message), std::string::npos) << message << " in:\n" << r.out;
  }
  EXPECT_NE(r.out.find("RolledBack"), std::string::npos) << r.out;

  // Rolled back, nothing is in progress any more.
  for (const char* action : {"pause", "resume", "abort"}) {
    r = Shell(Ctl(std::string("rollout ") + action + " embedder"));
    EXPECT_EQ(r.rc, 1) << action << ": " << r.out;
    EXPECT_EQ(r.out.rfind("Error from server (Conflict): ", 0), 0u) << action << ": " << r.out;
    EXPECT_NE(r.out.find("deployment 'embedder' has no rollout in progress (Degraded: rollout "
                         "of version 2 aborted by hand; back to 1)"),
              std::string::npos)
        << action << ": " << r.out;
  }
  // A deployment that does not exist: kubectl's NotFound.
  for (const char* action : {"pause", "resume", "abort"}) {
    r = Shell(Ctl(std::string("rollout ") + action + " ghost"));
    EXPECT_EQ(r.rc, 1) << action << ": " << r.out;
    EXPECT_EQ(r.out, "Error from server (NotFound): ModelDeployment 'ghost' not found\n")
        << action;
  }
  // Still rolled back: the actions refused changed nothing.
  out = Shell(Ctl(get)).out;
  EXPECT_NE(out.find("\"phase\": \"Degraded\""), std::string::npos) << out;
}

TEST_F(ControllerTest, TheControlPlaneRefusesBadStreamsWithTheReason) {
  Start({"--listen", "127.0.0.1:0", "--observe-seconds", "60"});
  ASSERT_GT(control_port_, 0);
  // Bytes that are no AgentMessage (a field 1 that claims more bytes than follow).
  grpc::Status s = Connect(control_port_, {std::string("\x0a\x7f\x01", 3)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_NE(s.error_message().find("kiln.v1.AgentMessage"), std::string::npos) << s.error_message();
  // A Status before any Register.
  kiln::v1::AgentMessage status;
  status.mutable_status();
  s = Connect(control_port_, {Bytes(status)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("must be Register"), std::string::npos) << s.error_message();
  // A Register without a name, or with GPUs that share an index.
  kiln::v1::AgentMessage reg;
  reg.mutable_register_()->set_cpu_capacity(4);
  s = Connect(control_port_, {Bytes(reg)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("register.node_name"), std::string::npos) << s.error_message();
  reg.mutable_register_()->set_node_name("n1");
  reg.mutable_register_()->add_gpus()->set_index(0);
  reg.mutable_register_()->add_gpus()->set_index(0);
  s = Connect(control_port_, {Bytes(reg)});
  EXPECT_NE(s.error_message().find("register.gpus[1].index"), std::string::npos) << s.error_message();
  // A good Register stays open; the same stream cannot then speak for another node, and
  // garbage later on ends it too.
  reg.mutable_register_()->mutable_gpus()->RemoveLast();
  const auto kOpen = std::chrono::milliseconds(500);  // refusals come at once
  EXPECT_TRUE(Connect(control_port_, {Bytes(reg)}, kOpen).ok());
  kiln::v1::AgentMessage other = reg;
  other.mutable_register_()->set_node_name("n2");
  s = Connect(control_port_, {Bytes(reg), Bytes(other)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  s = Connect(control_port_, {Bytes(reg), std::string("\xff\xff", 2)});
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  // None of it hurt the controller: it still answers.
  EXPECT_TRUE(Connect(control_port_, {Bytes(reg)}, kOpen).ok());
  auto nodes = Shell(Ctl("get nodes"));
  EXPECT_EQ(nodes.rc, 0) << nodes.out;
  EXPECT_NE(nodes.out.find("n1"), std::string::npos) << nodes.out;
  // Its agent gone for good, an operator removes the node (409 until the controller has seen
  // the stream end: a bounded poll).
  auto removed = Shell(Ctl("delete node n1"));
  for (int i = 0; i < 100 && removed.rc != 0 && removed.out.find("Conflict") != std::string::npos;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    removed = Shell(Ctl("delete node n1"));
  }
  ASSERT_EQ(removed.rc, 0) << removed.out;
  EXPECT_EQ(removed.out, "node \"n1\" deleted\n");
  nodes = Shell(Ctl("get nodes"));
  EXPECT_EQ(nodes.out.find("n1"), std::string::npos) << nodes.out;
  removed = Shell(Ctl("delete node n1"));
  EXPECT_EQ(removed.rc, 1);
  EXPECT_NE(removed.out.find("Error from server (NotFound)"), std::string::npos) << removed.out;
}

TEST_F(ControllerTest, ASecondControllerOnTheSamePortFailsToStart) {
  Start();
  ASSERT_GT(control_port_, 0);
  // gRPC would share the port (SO_REUSEPORT) and split the agents between the two.
  const std::string log = dir_ + "/second.log";
  pid_t second = kiln::testing::SpawnLogged(
      {KILN_CONTROLLER_BIN, "--state-dir", dir_ + "/state2", "--admin-port", "0", "--listen",
       "127.0.0.1:" + std::to_string(control_port_)},
      log);
  ASSERT_GE(second, 0);
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 200 && done == 0; ++i) {  // bounded: it exits at once
    done = waitpid(second, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (done == 0) {
    kill(second, SIGKILL);
    waitpid(second, &status, 0);
    FAIL() << "a second controller started on the first one's port: " << ReadFile(log);
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) != 0) << ReadFile(log);
  EXPECT_NE(ReadFile(log).find("--listen: cannot listen on 127.0.0.1:" +
                               std::to_string(control_port_)),
            std::string::npos)
      << ReadFile(log);
}

TEST_F(ControllerTest, BearerTokenWhenConfigured) {
  std::string token = Write("token", "t0ken\n");
  Start({"--token-file", token});
  auto r = Shell(Ctl("get deployments"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("Unauthorized"), std::string::npos) << r.out;
  r = Shell(Ctl("--token-file " + token + " get deployments"));
  EXPECT_EQ(r.rc, 0) << r.out;
  // /metrics is behind the token too, and clean by Prometheus's linter.
  const std::string url = "http://127.0.0.1:" + std::to_string(port_) + "/metrics";
  r = Shell("curl -s -o /dev/null -w '%{http_code}' " + url);
  EXPECT_EQ(r.out, "401");
  r = Shell("curl -s -f -H 'Authorization: Bearer t0ken' " + url);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_NE(r.out.find("kiln_controller_nodes{health=\"Ready\"} 0"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("kiln_controller_loop_duration_seconds_count"), std::string::npos) << r.out;
  const std::string promtool = FindPromtool(KILN_PROMTOOL_FALLBACK);
  ASSERT_FALSE(promtool.empty()) << "promtool not found: on the PATH or at " KILN_PROMTOOL_FALLBACK;
  auto lint = PromtoolCheck(promtool, r.out, dir_ + "/metrics.txt");
  EXPECT_EQ(lint.rc, 0) << lint.out << "\n" << r.out;
  EXPECT_EQ(lint.out, "") << r.out;
}

// The bearer token guards the REST API itself, not only kilnctl's requests: no header, a wrong
// token and another scheme are all 401, before a body is even looked at; /healthz stays open.
TEST_F(ControllerTest, TheRestApiRefusesMissingAndWrongTokens) {
  std::string token = Write("token", "t0ken\n");
  Start({"--token-file", token});
  using kiln::testing::Get;
  using kiln::testing::Post;
  auto r = Http(port_, Get(kDeployments));
  EXPECT_EQ(r.code, 401) << r.head << r.body;
  EXPECT_NE(r.body.find("\"reason\":\"Unauthorized\""), std::string::npos) << r.body;
  EXPECT_NE(r.body.find("this server needs Authorization: Bearer <token>"), std::string::npos)
      << r.body;
  r = Http(port_, Get(kDeployments, "Authorization: Bearer wrong\r\n"));
  EXPECT_EQ(r.code, 401) << r.head << r.body;
  EXPECT_NE(r.body.find("the bearer token is not valid"), std::string::npos) << r.body;
  r = Http(port_, Get(kDeployments, "Authorization: Basic dDBrZW4=\r\n"));
  EXPECT_EQ(r.code, 401) << r.head << r.body;
  EXPECT_NE(r.body.find("the bearer token is not valid"), std::string::npos) << r.body;
  // A bad body without the token: 401, not 400 (nothing about it is answered).
  r = Http(port_, Post(kDeployments, "{"));
  EXPECT_EQ(r.code, 401) << r.head << r.body;
  EXPECT_EQ(r.body.find("YAML"), std::string::npos) << r.body;
  r = Http(port_, DeleteRequest(kDeployments + "/ghost"));
  EXPECT_EQ(r.code, 401) << r.head << r.body;

  r = Http(port_, Get(kDeployments, "Authorization: Bearer t0ken\r\n"));
  EXPECT_EQ(r.code, 200) << r.head << r.body;
  EXPECT_NE(r.body.find("\"kind\":\"ModelDeploymentList\""), std::string::npos) << r.body;
  r = Http(port_, Post(kDeployments, "{", "Authorization: Bearer t0ken\r\n"));
  EXPECT_EQ(r.code, 400) << r.head << r.body;
  r = Http(port_, Get("/healthz"));
  EXPECT_EQ(r.code, 200) << r.head << r.body;
  EXPECT_EQ(r.body, "ok\n");
}

}  // namespace
