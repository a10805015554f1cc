#pragma once

#include <atomic>
#include <cstdint>

namespace kiln {

// Busy-polling a local replica's data socket for its answer.
//
// A reader that sleeps in poll() until the answer comes pays a wake-up: tens of microseconds
// on a loaded VM, more on a large host whose idle cores sit in deep sleep states. That is most
// of what the router adds to a call. Instead, the reader sleeps until shortly before the
// answer is expected (a timed wake-up, paid while the replica is still computing), then spins
// over a window centred on the expected time, then sleeps as before. The expected time is the
// oldest waiting call's send time plus the connection's typical answer time.

// When to spin, in microseconds on the same clock as its inputs. `until` == 0: do not spin
// (sleep until the answer or a deadline).
struct SpinWindow {
  int64_t from = 0;
  int64_t until = 0;
};

// `oldest_sent`: when the oldest call still waiting was sent (0 = no call waits).
// `typical_micros`: the connection's typical answer time (0 = not known yet: spin at once).
// `window_micros`: the window's length (0 = never spin). A window that ended is no window:
// the answer is late, and the reader sleeps.
SpinWindow PlanSpin(int64_t now, int64_t oldest_sent, int64_t typical_micros,
                    int64_t window_micros);

// The answer time a connection expects next, after one was observed: a moving average
// weighted 1/8 to the newest (the first observation is taken as is). Negative observations
// (a clock step) are ignored.
int64_t NextTypical(int64_t typical_micros, int64_t observed_micros);

// How many readers may spin at once, node-wide: each one that spins holds a CPU.
class SpinSlots {
 public:
  explicit SpinSlots(int slots) : free_(slots) {}
  bool TryAcquire();
  void Release() { free_.fetch_add(1); }
  int free() const { return free_.load(); }

 private:
  std::atomic<int> free_;
};

// What the router's data channels do: spin windows of `window_micros`, at most `slots`
// readers spinning at once. Off when either is 0.
struct BusyPollPolicy {
  int64_t window_micros = 0;
  int slots = 0;
  bool on() const { return window_micros > 0 && slots > 0; }
};

}  // namespace kiln
