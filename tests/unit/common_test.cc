#include "common/clock.h"
#include "common/config_node.h"
#include "common/grpc_status.h"
#include "common/histogram.h"
#include "common/status.h"
#include "common/uri.h"
#include "gtest/gtest.h"

namespace kiln {
namespace {

TEST(StatusTest, HttpMapping) {
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kInvalidArgument), 400);
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kNotFound), 404);
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kResourceExhausted), 429);
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kUnavailable), 503);
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kDeadlineExceeded), 504);
  EXPECT_EQ(HttpStatusFromCode(absl::StatusCode::kInternal), 500);
}

// A gRPC status's message is cut to a size every client takes in its trailers, keeping the
// code and the start of the reason.
TEST(StatusTest, GrpcMessagesAreBounded) {
  const std::string name(20000, 'n');
  grpc::Status s = ToGrpcStatus(absl::InvalidArgumentError("unknown input '" + name + "'"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_LT(s.error_message().size(), 2100u);
  EXPECT_EQ(s.error_message().rfind("unknown input 'nnn", 0), 0u);
  EXPECT_NE(s.error_message().find("(20016 bytes in all)"), std::string::npos);
  EXPECT_EQ(ToGrpcStatus(absl::NotFoundError("short")).error_message(), "short");
}

// host:port for the HTTP client and the routing tables' endpoints: digits only for the port.
TEST(UriTest, SplitHostPortTakesHostAndPortAndRefusesTheRest) {
  std::string host, port;
  ASSERT_TRUE(SplitHostPort("10.0.0.2:8001", &host, &port).ok());
  EXPECT_EQ(host, "10.0.0.2");
  EXPECT_EQ(port, "8001");
  ASSERT_TRUE(SplitHostPort("[fd00::3]:8000", &host, &port).ok());
  EXPECT_EQ(host, "fd00::3");
  EXPECT_EQ(port, "8000");
  for (const std::string bad : {"h", ":8001", "h:", "h:0", "h:65536", "h:+80", "h: 80", "h:x"}) {
    absl::Status s = SplitHostPort(bad, &host, &port);
    EXPECT_EQ(s.message(), "address '" + bad + "': expected host:port") << bad;
  }
}

TEST(ClockTest, SimulatedClockMovesOnlyWhenAdvanced) {
  SimulatedClock c;
  absl::Time t = c.Now();
  EXPECT_EQ(c.Now(), t);
  c.Advance(absl::Milliseconds(5));
  EXPECT_EQ(c.Now(), t + absl::Milliseconds(5));
}

// The monotonic clock is CLOCK_MONOTONIC's: it agrees with steady_clock (not the wall clock)
// and never goes back.
TEST(ClockTest, MonotonicClockFollowsTheSteadyClock) {
  MonotonicClock c;
  const absl::Time before = absl::UnixEpoch() +
                            absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  absl::Time last = c.Now();
  EXPECT_GE(last, before);
  for (int i = 0; i < 1000; ++i) {
    const absl::Time t = c.Now();
    EXPECT_GE(t, last);
    last = t;
  }
  const absl::Time after = absl::UnixEpoch() +
                           absl::FromChrono(std::chrono::steady_clock::now().time_since_epoch());
  EXPECT_LE(last, after);
}

TEST(ConfigNodeTest, NamesTheFieldInErrors) {
  auto root = ConfigNode::Parse("a: {b: notanumber, c: [1, 2, x]}", "f.yaml");
  ASSERT_TRUE(root.ok());
  auto a = root->Child("a");
  ASSERT_TRUE(a.ok());
  auto b = a->GetInt("b", 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("a.b"), std::string::npos);
  auto c = a->GetIntList("c");
  EXPECT_NE(c.status().message().find("a.c[2]"), std::string::npos);
  auto missing = a->Child("d");
  EXPECT_NE(missing.status().message().find("a.d: required"), std::string::npos);
  EXPECT_NE(a->CheckKeys({"b"}).message().find("a.c: unknown field"), std::string::npos);
}

TEST(ConfigNodeTest, RejectsBadYaml) {
  auto bad = ConfigNode::Parse("a: [1, 2", "f.yaml");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("f.yaml"), std::string::npos);
}

TEST(ByteSizeTest, ParsesQuantities) {
  EXPECT_EQ(*ParseByteSize("1024", "f"), 1024);
  EXPECT_EQ(*ParseByteSize("64Mi", "f"), 64LL << 20);
  EXPECT_EQ(*ParseByteSize("2Gi", "f"), 2LL << 30);
  EXPECT_EQ(*ParseByteSize("5k", "f"), 5000);
  EXPECT_FALSE(ParseByteSize("", "f").ok());
  EXPECT_FALSE(ParseByteSize("12XB", "f").ok());
  EXPECT_FALSE(ParseByteSize("-1", "f").ok());
  EXPECT_FALSE(ParseByteSize("99999999999999999999Gi", "max_bytes").ok());
}

TEST(HistogramTest, CountsAndQuantiles) {
  Histogram h({1, 2, 4, 8});
  for (int i = 0; i < 90; ++i) h.Record(1);
  for (int i = 0; i < 10; ++i) h.Record(7);
  h.Record(100);
  auto s = h.Take();
  EXPECT_EQ(s.count, 101u);
  EXPECT_EQ(s.counts[0], 90u);
  EXPECT_EQ(s.counts[3], 10u);
  EXPECT_EQ(s.counts[4], 1u);
  EXPECT_LE(s.Quantile(0.5), 1.0);
  EXPECT_GT(s.Quantile(0.95), 4.0);
  EXPECT_LE(s.Quantile(0.95), 8.0);
}

TEST(HistogramTest, PrometheusTextIsCumulative) {
  Histogram h({0.5, 2});
  h.Record(0.25);
  h.Record(1);
  h.Record(1.5);
  h.Record(9);
  EXPECT_EQ(h.Take().Prometheus("x_seconds", "How long.", "node=\"a\""),
            "# HELP x_seconds How long.\n# TYPE x_seconds histogram\n"
            "x_seconds_bucket{node=\"a\",le=\"0.5\"} 1\n"
            "x_seconds_bucket{node=\"a\",le=\"2\"} 3\n"
            "x_seconds_bucket{node=\"a\",le=\"+Inf\"} 4\n"
            "x_seconds_sum{node=\"a\"} 11.75\n"
            "x_seconds_count{node=\"a\"} 4\n");
  EXPECT_EQ(Histogram({1}).Take().Prometheus("y", "Y."),
            "# HELP y Y.\n# TYPE y histogram\ny_bucket{le=\"1\"} 0\ny_bucket{le=\"+Inf\"} 0\n"
            "y_sum 0\ny_count 0\n");
}

}  // namespace
}  // namespace kiln
