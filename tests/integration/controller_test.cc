// The real kiln-controller and kilnctl binaries over loopback HTTP with a real SQLite store.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "gtest/gtest.h"
#include "kiln/v1/control_plane.grpc.pb.h"
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

const char* kSpec = R"(apiVersion: serving.kiln.dev/v1alpha1
kind: ModelDeployment
metadata: {name: embedder}
spec:
  model: {name: encoder, version: "1", uri: "file:///models/encoder/1/model.pt"}
  replicas: 2
  warmPool: 1
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

}  // namespace
