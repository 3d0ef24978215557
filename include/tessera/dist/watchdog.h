// Bounded waits between ranks: a rank whose peer died, hung or took another code path stops
// with an error after timeout() seconds instead of waiting forever.
//
// How each transport bounds its waits:
//   tcp   every send/receive polls with the deadline and throws Error naming the peer (a
//         peer that exited closes its sockets, which is seen at once)
//   mpi   MPI's blocking collectives cannot be interrupted, so each one registers a
//         BlockingScope; a watchdog thread that finds one older than the timeout prints the
//         reason and ends the process (exit status 124). mpirun (or `tessera launch`) then
//         stops the other ranks.
//   nccl  collectives return at once and run on the GPU; each is watched through a CUDA
//         event (watch_async). When one has not completed within the timeout the watchdog
//         runs the abort hooks (ncclCommAbort of every communicator, so no kernel waits on
//         a dead peer) and ends the process likewise.
// A timeout of 0 (the default) waits forever. The trainer sets training.parallel.timeout_s;
// the environment variable TESSERA_DIST_TIMEOUT_S sets the starting value for other programs.
#pragma once

#include <functional>
#include <string>

namespace tessera::dist {

class ProcessGroup;

void set_timeout(double seconds);
double timeout();

// Sets the timeout for the life of the object, then restores the previous one. For waits
// that follow long file I/O on another rank (tokenizing, verifying or writing a checkpoint):
// a slow disk is not a dead rank, and a rank that dies still ends the job (mpirun, the
// closed TCP connections, `tessera launch`).
class ScopedTimeout {
 public:
  explicit ScopedTimeout(double seconds) : previous_(timeout()) { set_timeout(seconds); }
  ~ScopedTimeout() { set_timeout(previous_); }
  ScopedTimeout(const ScopedTimeout&) = delete;
  ScopedTimeout& operator=(const ScopedTimeout&) = delete;

 private:
  double previous_;
};

// The exit status of a process that the watchdog stopped.
inline constexpr int kTimeoutExitStatus = 124;

// The world rank that messages name (set by init_from_env).
void set_message_rank(int world_rank);
int message_rank();

// While alive, the calling thread is blocked in `what` over `group` (may be null); the
// watchdog ends the process when that lasts longer than timeout().
class BlockingScope {
 public:
  BlockingScope(const char* what, const ProcessGroup* group);
  ~BlockingScope();
  BlockingScope(const BlockingScope&) = delete;
  BlockingScope& operator=(const BlockingScope&) = delete;

 private:
  long id_ = -1;
};

// An operation that completes on its own (a collective queued on a GPU stream): the watchdog
// thread polls `done` and calls `release` once it returns true. When timeout() is 0 nothing
// is watched and `release` runs at once.
void watch_async(std::string what, std::function<bool()> done, std::function<void()> release);

// Hooks the watchdog runs (on its thread) before it ends the process. Returns an id for
// remove_abort_hook.
long add_abort_hook(std::function<void()> hook);
void remove_abort_hook(long id);

namespace detail {
// Prints `message` as the reason, runs the abort hooks and ends the process with
// kTimeoutExitStatus. Also what the watchdog thread calls.
[[noreturn]] void stop_process(const std::string& message);
}  // namespace detail

}  // namespace tessera::dist
