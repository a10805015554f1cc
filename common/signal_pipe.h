#pragma once

#include <initializer_list>

namespace kiln {

// Signals taken through a pipe. A signal may land on any thread (gRPC and LibTorch start
// their own), so the handler only writes the signal's number (keeping errno); the main
// loop reads it with NextSignal. One per process.

// Handles each of `signals` (SA_RESTART; a SIGCHLD only for exits, not stops) and ignores
// SIGPIPE. False when the pipe or a handler cannot be made.
bool InstallSignalPipe(std::initializer_list<int> signals);
// The next signal taken, waiting up to `timeout_ms`; 0 when none came.
int NextSignal(int timeout_ms);

}  // namespace kiln
