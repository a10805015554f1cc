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

#include "gtest/gtest.h"
#include "tests/support/shell.h"

namespace {

namespace fs = std::filesystem;

using kiln::testing::ReadFile;
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
    pid_ = kiln::testing::SpawnLogged(args, log);
    ASSERT_GE(pid_, 0);
    for (int i = 0; i < 200; ++i) {
      std::string text = ReadFile(log);
      size_t at = text.find("admin=http://127.0.0.1:");
      if (at != std::string::npos) {
        port_ = std::stoi(text.substr(at + 23));
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
  int last_status_ = 0;
};

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

TEST_F(ControllerTest, BearerTokenWhenConfigured) {
  std::string token = Write("token", "t0ken\n");
  Start({"--token-file", token});
  auto r = Shell(Ctl("get deployments"));
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.out.find("Unauthorized"), std::string::npos) << r.out;
  r = Shell(Ctl("--token-file " + token + " get deployments"));
  EXPECT_EQ(r.rc, 0) << r.out;
}

}  // namespace
