#pragma once

// A unary gRPC call of any method with any bytes as its request (what no generated stub
// sends), for tests of how servers refuse them.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <string>

#include "gtest/gtest.h"

namespace kiln::testing {

inline grpc::Status RawUnaryCall(const std::string& address, const std::string& method,
                                 const std::string& bytes) {
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::CompletionQueue cq;
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1), response;
  auto call = stub.PrepareUnaryCall(&ctx, method, request, &cq);
  call->StartCall();
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

}  // namespace kiln::testing
