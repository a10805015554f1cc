// Mutual TLS on kiln.v1.ControlPlane: the real controller service and the agent's client over
// loopback gRPC with certificates from a CA the test makes with openssl.
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "agent/controller_client.h"
#include "common/clock.h"
#include "common/grpc_tls.h"
#include "controller/controller.h"
#include "controller/sqlite_store.h"
#include "gtest/gtest.h"
#include "tests/support/test_ca.h"

namespace kiln {
namespace {

namespace fs = std::filesystem;
using testing::CertFiles;
using testing::TestCa;

class ControlPlaneTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() /
            ("kiln-tls-" + std::to_string(getpid()) + "-" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name()))
               .string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ca_ = std::make_unique<TestCa>(dir_, "kiln-test-ca");
    rogue_ = std::make_unique<TestCa>(dir_, "rogue-ca");
    server_ = ca_->Issue("controller", "kiln-controller",
                         {"DNS:kiln-controller", "DNS:localhost", "IP:127.0.0.1"});
    node_a_ = ca_->Issue("node-a", "node-a", {"DNS:node-a"});
    node_b_ = ca_->Issue("node-b", "node-b", {"DNS:node-b"});
    rogue_a_ = rogue_->Issue("rogue-a", "node-a", {"DNS:node-a"});
    ASSERT_TRUE(ca_->ok()) << ca_->error();
    ASSERT_TRUE(rogue_->ok()) << rogue_->error();
    SqliteStore::Options so;
    so.state_dir = dir_ + "/state";
    auto store = SqliteStore::Open(so, &clock_);
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = std::move(*store);
  }
  void TearDown() override {
    if (server_grpc_) server_grpc_->Shutdown(std::chrono::system_clock::now());
    if (controller_) controller_->Stop();
    server_grpc_.reset();
    controller_.reset();
    fs::remove_all(dir_);
  }

  // The controller's ControlPlane on a free loopback port with these credentials.
  void Serve(const TlsFiles& files, bool require_identity) {
    auto creds = MakeServerCredentials(files);
    ASSERT_TRUE(creds.ok()) << creds.status();
    ControllerOptions co;
    co.require_node_identity = require_identity;
    controller_ = std::make_unique<Controller>(co, store_.get(), &clock_);
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", *creds, &port_);
    b.RegisterService(controller_.get());
    server_grpc_ = b.BuildAndStart();
    ASSERT_TRUE(server_grpc_ && port_ > 0);
  }
  TlsFiles ServerFiles(bool mutual) {
    TlsFiles f;
    f.cert = server_.cert;
    f.key = server_.key;
    if (mutual) f.ca = ca_->ca();
    return f;
  }
  std::string Address() const { return "127.0.0.1:" + std::to_string(port_); }

  // One Connect as `node` with these channel credentials: the stream's final status, or OK
  // once the controller lists the node (the stream is then cancelled).
  grpc::Status RegisterAs(const std::string& node, std::shared_ptr<grpc::ChannelCredentials> creds,
                          const std::string& server_name = "") {
    grpc::ChannelArguments args;
    if (!server_name.empty()) args.SetSslTargetNameOverride(server_name);
    auto stub = v1::ControlPlane::NewStub(grpc::CreateCustomChannel(Address(), creds, args));
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    auto stream = stub->Connect(&ctx);
    v1::AgentMessage m;
    m.mutable_register_()->set_node_name(node);
    m.mutable_register_()->set_cpu_capacity(2);
    if (!stream->Write(m)) return stream->Finish();
    // The controller (its loop not started) sends nothing to a registered node; a refused
    // one sees its stream end. Whichever comes first, bounded by the deadline.
    std::atomic<bool> ended{false};
    std::thread reader([&] {
      v1::ControllerMessage reply;
      while (stream->Read(&reply)) {
      }
      ended = true;
    });
    bool registered = false;
    while (!ended && !(registered = Registered(node))) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (registered) ctx.TryCancel();
    reader.join();
    grpc::Status st = stream->Finish();
    return registered ? grpc::Status::OK : st;
  }
  bool Registered(const std::string& node) {
    return controller_->NodesJson().find("\"name\":\"" + node + "\"") != std::string::npos;
  }
  std::shared_ptr<grpc::ChannelCredentials> Client(const CertFiles* cert,
                                                   const std::string& ca = "") {
    TlsFiles f;
    f.ca = ca.empty() ? ca_->ca() : ca;
    if (cert) {
      f.cert = cert->cert;
      f.key = cert->key;
    }
    auto c = MakeChannelCredentials(f);
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? *c : nullptr;
  }

  std::string dir_;
  SimulatedClock clock_;
  std::unique_ptr<TestCa> ca_, rogue_;
  CertFiles server_, node_a_, node_b_, rogue_a_;
  std::unique_ptr<SqliteStore> store_;
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<grpc::Server> server_grpc_;
  int port_ = 0;
};

TEST_F(ControlPlaneTlsTest, TheAgentRegistersUnderTheNameItsCertificateCarries) {
  Serve(ServerFiles(/*mutual=*/true), /*require_identity=*/true);
  ControllerClient::Hooks hooks;
  hooks.make_register = [] {
    v1::Register r;
    r.set_node_name("node-a");
    r.set_cpu_capacity(2);
    return r;
  };
  hooks.make_status = [] { return v1::NodeStatus(); };
  hooks.apply_assignment = [](const v1::Assignment&) { return absl::OkStatus(); };
  hooks.apply_routing = [](const v1::RoutingTable&) { return absl::OkStatus(); };
  hooks.log = [](const std::string&) {};
  ControllerClient client(Address(), hooks, Client(&node_a_));
  client.Start();
  bool seen = false;
  for (int i = 0; i < 500 && !seen; ++i) {
    seen = Registered("node-a") && client.connected();
    if (!seen) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  client.Stop();
  EXPECT_TRUE(seen) << controller_->NodesJson();
}

TEST_F(ControlPlaneTlsTest, ACertificateForAnotherNodeCannotRegisterAsThisOne) {
  Serve(ServerFiles(true), true);
  grpc::Status s = RegisterAs("node-a", Client(&node_b_));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("register.node_name: 'node-a'"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("node-b"), std::string::npos) << s.error_message();
  EXPECT_FALSE(Registered("node-a"));
  EXPECT_TRUE(RegisterAs("node-b", Client(&node_b_)).ok());
}

TEST_F(ControlPlaneTlsTest, AStreamCannotReRegisterUnderAnotherName) {
  Serve(ServerFiles(true), true);
  auto stub = v1::ControlPlane::NewStub(grpc::CreateChannel(Address(), Client(&node_a_)));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  auto stream = stub->Connect(&ctx);
  v1::AgentMessage m;
  m.mutable_register_()->set_node_name("node-a");
  m.mutable_register_()->set_cpu_capacity(2);
  ASSERT_TRUE(stream->Write(m));
  for (int i = 0; i < 400 && !Registered("node-a"); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(Registered("node-a"));
  m.mutable_register_()->set_node_name("node-b");
  m.mutable_register_()->set_ingress_grpc_address("10.0.0.66:8001");
  stream->Write(m);
  v1::ControllerMessage reply;
  while (stream->Read(&reply)) {
  }
  grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED) << s.error_message();
  EXPECT_NE(s.error_message().find("cannot register 'node-b'"), std::string::npos) << s.error_message();
  EXPECT_FALSE(Registered("node-b"));
}

TEST_F(ControlPlaneTlsTest, ClientsWithoutATrustedCertificateAreRefusedAtTheHandshake) {
  Serve(ServerFiles(true), true);
  // No client certificate, one from another CA, and plaintext.
  grpc::Status none = RegisterAs("node-a", Client(nullptr));
  EXPECT_EQ(none.error_code(), grpc::StatusCode::UNAVAILABLE) << none.error_message();
  grpc::Status rogue = RegisterAs("node-a", Client(&rogue_a_));
  EXPECT_EQ(rogue.error_code(), grpc::StatusCode::UNAVAILABLE) << rogue.error_message();
  grpc::Status plain = RegisterAs("node-a", grpc::InsecureChannelCredentials());
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();
  EXPECT_FALSE(Registered("node-a"));
}

TEST_F(ControlPlaneTlsTest, TheAgentVerifiesTheControllersCertificateAndName) {
  Serve(ServerFiles(true), true);
  // A controller certificate the agent's CA did not sign.
  grpc::Status untrusted = RegisterAs("node-a", Client(&node_a_, rogue_->ca()));
  EXPECT_EQ(untrusted.error_code(), grpc::StatusCode::UNAVAILABLE) << untrusted.error_message();
  // A name the certificate does not carry.
  grpc::Status wrong = RegisterAs("node-a", Client(&node_a_), "other-controller");
  EXPECT_EQ(wrong.error_code(), grpc::StatusCode::UNAVAILABLE) << wrong.error_message();
  // One it does (the address is an IP; the certificate also names kiln-controller).
  EXPECT_TRUE(RegisterAs("node-a", Client(&node_a_), "kiln-controller").ok());
}

TEST_F(ControlPlaneTlsTest, ServerOnlyTlsTakesAnyNodeName) {
  Serve(ServerFiles(/*mutual=*/false), /*require_identity=*/false);
  EXPECT_TRUE(RegisterAs("node-z", Client(nullptr)).ok());
  grpc::Status plain = RegisterAs("node-y", grpc::InsecureChannelCredentials());
  EXPECT_EQ(plain.error_code(), grpc::StatusCode::UNAVAILABLE) << plain.error_message();
}

TEST_F(ControlPlaneTlsTest, BadFilesAreErrorsNamingTheFlag) {
  auto expect = [](const absl::Status& s, const std::string& text) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(text), std::string::npos) << s;
  };
  TlsFiles f = ServerFiles(true);
  f.cert_flag = "--tls-cert";
  f.key_flag = "--tls-key";
  f.ca_flag = "--tls-client-ca";
  TlsFiles no_key = f;
  no_key.key.clear();
  expect(MakeServerCredentials(no_key).status(), "--tls-key: required with --tls-cert");
  TlsFiles missing = f;
  missing.cert = dir_ + "/nope.crt";
  expect(MakeServerCredentials(missing).status(), "--tls-cert: " + dir_ + "/nope.crt: cannot be read");
  TlsFiles swapped = f;
  swapped.cert = f.key;
  expect(MakeServerCredentials(swapped).status(), "--tls-cert: " + f.key + ": no PEM CERTIFICATE");
  TlsFiles not_key = f;
  not_key.key = f.cert;
  expect(MakeServerCredentials(not_key).status(), "--tls-key: " + f.cert + ": no PEM PRIVATE KEY");
  std::ofstream(dir_ + "/empty.pem").close();
  TlsFiles empty_ca = f;
  empty_ca.ca = dir_ + "/empty.pem";
  expect(MakeServerCredentials(empty_ca).status(), "--tls-client-ca: " + dir_ + "/empty.pem");
  TlsFiles only_ca;
  only_ca.ca = ca_->ca();
  expect(MakeServerCredentials(only_ca).status(), "--tls-cert and --tls-key: required");

  TlsFiles client;
  client.ca_flag = "--controller-ca";
  client.cert_flag = "--controller-cert";
  client.key_flag = "--controller-key";
  client.cert = node_a_.cert;
  expect(MakeChannelCredentials(client).status(), "--controller-ca: required for TLS");
  client.ca = ca_->ca();
  expect(MakeChannelCredentials(client).status(), "--controller-key: required with --controller-cert");
}

}  // namespace
}  // namespace kiln
