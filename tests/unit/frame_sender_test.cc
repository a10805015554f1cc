// FrameSender on a socketpair: frames are never lost, reordered or cut, the sending thread
// never waits on a peer that does not read, and a stuck peer breaks the connection.
#include "common/frame_sender.h"

#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/data_frames.h"
#include "gtest/gtest.h"
#include "tests/support/eventually.h"

namespace kiln {
namespace {

class FrameSenderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds_), 0);
    int small = 4096;  // the kernel's minimum-ish: the socket fills after a few frames
    ::setsockopt(fds_[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    ::setsockopt(fds_[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  }
  void TearDown() override {
    ::close(fds_[0]);
    ::close(fds_[1]);
  }
  // The frame numbered `i`: its tag is i, its body i's own bytes.
  static std::string Frame(uint64_t i, size_t size) {
    return EncodeFrame(i, 0, 0, std::string(size, static_cast<char>('a' + i % 26)));
  }
  // Reads one frame from the peer's end; tag -1 when the connection ended.
  std::pair<int64_t, std::string> Read() {
    char head[kFrameHeaderBytes];
    if (!ReadFull(fds_[1], head, sizeof(head))) return {-1, ""};
    FrameHeader h = DecodeFrameHeader(head);
    std::string body(h.length, '\0');
    if (h.length > 0 && !ReadFull(fds_[1], body.data(), body.size())) return {-1, ""};
    return {static_cast<int64_t>(h.tag), body};
  }
  int fds_[2];
};

TEST_F(FrameSenderTest, FramesTheSocketTakesAreWrittenAtOnce) {
  FrameSender s(fds_[0], absl::Hours(1), 1 << 20);
  ASSERT_TRUE(s.Send(Frame(1, 10)));
  EXPECT_EQ(s.backlog_bytes(), 0u);
  auto [tag, body] = Read();
  EXPECT_EQ(tag, 1);
  EXPECT_EQ(body, std::string(10, 'b'));
}

TEST_F(FrameSenderTest, APeerThatDoesNotReadNeverHoldsTheSenderAndLosesNothing) {
  FrameSender s(fds_[0], absl::Hours(1), 64 << 20);
  // Far more than the socket holds: every Send returns (this thread would hang otherwise).
  constexpr int kFrames = 200;
  for (int i = 0; i < kFrames; ++i) ASSERT_TRUE(s.Send(Frame(i, 1000 + i)));
  EXPECT_GT(s.backlog_bytes(), 0u);
  // The peer reads again: every frame, whole and in order.
  for (int i = 0; i < kFrames; ++i) {
    auto [tag, body] = Read();
    ASSERT_EQ(tag, i);
    EXPECT_EQ(body, std::string(1000 + i, static_cast<char>('a' + i % 26)));
  }
  EXPECT_TRUE(testing::Eventually([&] { return s.backlog_bytes() == 0; }, absl::Seconds(10)));
  EXPECT_FALSE(s.broken());
  // And a frame sent with nothing waiting goes straight out again.
  ASSERT_TRUE(s.Send(Frame(7, 3)));
  EXPECT_EQ(Read().first, 7);
}

TEST_F(FrameSenderTest, APeerThatReadsNothingForTheStallBreaksTheConnection) {
  FrameSender s(fds_[0], absl::Milliseconds(1), 64 << 20);
  for (int i = 0; i < 50; ++i) s.Send(Frame(i, 1000));
  ASSERT_TRUE(testing::Eventually([&] { return s.broken(); }, absl::Seconds(10)));
  EXPECT_EQ(s.why_given_up(), "it read nothing for 1ms");
  EXPECT_EQ(s.backlog_bytes(), 0u);        // what waited is dropped
  EXPECT_FALSE(s.Send(Frame(99, 1)));      // and nothing more goes
  // The peer sees whole frames, then the end (shut down): never a cut frame read as whole.
  for (;;) {
    auto [tag, body] = Read();
    if (tag < 0) break;
    EXPECT_EQ(body.size(), 1000u);
  }
}

TEST_F(FrameSenderTest, ABacklogOverItsLimitBreaksTheConnection) {
  FrameSender s(fds_[0], absl::Hours(1), 64 * 1024);
  bool refused = false;
  for (int i = 0; i < 200 && !refused; ++i) refused = !s.Send(Frame(i, 1000));
  EXPECT_TRUE(refused);
  EXPECT_TRUE(s.broken());
  EXPECT_NE(s.why_given_up().find("bytes waited for it to read them, over the limit of 65536"),
            std::string::npos)
      << s.why_given_up();
  EXPECT_EQ(s.backlog_bytes(), 0u);
}

TEST_F(FrameSenderTest, DestroyingItWithFramesWaitingDoesNotWaitOutTheStall) {
  auto s = std::make_unique<FrameSender>(fds_[0], absl::Hours(1), 64 << 20);
  for (int i = 0; i < 50; ++i) ASSERT_TRUE(s->Send(Frame(i, 1000)));
  ASSERT_GT(s->backlog_bytes(), 0u);
  s.reset();  // joins its writer, which was waiting on a peer that never reads (an hour)
  // The connection was shut down with it: the peer reads what was written, then the end.
  int frames = 0;
  while (Read().first >= 0) frames++;
  EXPECT_LT(frames, 50);
}

TEST_F(FrameSenderTest, APeerThatClosedBreaksIt) {
  FrameSender s(fds_[0], absl::Hours(1), 64 << 20);
  ::shutdown(fds_[1], SHUT_RDWR);
  EXPECT_FALSE(s.Send(Frame(1, 10)));
  EXPECT_TRUE(s.broken());
}

}  // namespace
}  // namespace kiln
