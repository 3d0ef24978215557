// The watchdog thread behind bounded waits (see tessera/dist/watchdog.h).
//
// Its state lives on the heap and is never destroyed: the thread is detached and may still
// look at it while static destructors run at exit.
#include "tessera/dist/watchdog.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "tessera/dist/process_group.h"

namespace tessera::dist {

namespace {

using Clock = std::chrono::steady_clock;

double initial_timeout() {
  const char* v = std::getenv("TESSERA_DIST_TIMEOUT_S");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  const double t = std::strtod(v, &end);
  return end != v && t > 0 ? t : 0;
}

struct Blocking {
  std::string what;
  Clock::time_point since;
};

struct Async {
  std::string what;
  Clock::time_point since;
  std::function<bool()> done;
  std::function<void()> release;
};

struct State {
  std::mutex mutex;
  std::atomic<double> timeout{initial_timeout()};
  std::atomic<int> rank{0};
  std::atomic<bool> stopping{false};
  long next_id = 0;
  std::map<long, Blocking> blocking;
  std::list<Async> async;
  std::map<long, std::function<void()>> hooks;
  bool thread_started = false;
};

State& state() {
  static State* s = new State;
  return *s;
}

std::string describe_group(const ProcessGroup* group) {
  if (group == nullptr) return "";
  std::string ranks;
  const auto& w = group->world_ranks();
  for (size_t i = 0; i < w.size() && i < 16; ++i) ranks += (i ? "," : "") + std::to_string(w[i]);
  if (w.size() > 16) ranks += ",...";
  return std::string(" over ") + group->backend() + " ranks [" + ranks + "]";
}

void watch_loop() {
  State& s = state();
  for (;;) {
    const double t = s.timeout.load();
    const double poll = t > 0 ? std::min(1.0, std::max(0.01, t / 20)) : 0.5;
    std::this_thread::sleep_for(std::chrono::duration<double>(poll));
    if (s.stopping.load()) return;
    std::string expired;
    double waited = 0;
    std::list<Async> finished;
    {
      std::lock_guard lock(s.mutex);
      const auto now = Clock::now();
      for (const auto& [id, b] : s.blocking) {
        const double age = std::chrono::duration<double>(now - b.since).count();
        if (t > 0 && age > t && expired.empty()) {
          expired = b.what;
          waited = age;
        }
      }
      for (auto it = s.async.begin(); it != s.async.end();) {
        if (it->done()) {
          auto next = std::next(it);
          finished.splice(finished.end(), s.async, it);
          it = next;
          continue;
        }
        const double age = std::chrono::duration<double>(now - it->since).count();
        if (t > 0 && age > t && expired.empty()) {
          expired = it->what;
          waited = age;
        }
        ++it;
      }
    }
    for (Async& a : finished)
      if (a.release) a.release();
    if (!expired.empty()) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%.0f", waited);
      detail::stop_process(expired + " has not completed after " + seconds + " s (the timeout, " +
                           "training.parallel.timeout_s, is " + std::to_string(static_cast<long>(t)) +
                           " s): another rank died, hung or is running different code");
    }
  }
}

void ensure_thread(State& s) {
  // Called with s.mutex held.
  if (s.thread_started) return;
  s.thread_started = true;
  std::thread(watch_loop).detach();
}

}  // namespace

void set_timeout(double seconds) { state().timeout.store(seconds > 0 ? seconds : 0); }
double timeout() { return state().timeout.load(); }
void set_message_rank(int world_rank) { state().rank.store(world_rank); }
int message_rank() { return state().rank.load(); }

BlockingScope::BlockingScope(const char* what, const ProcessGroup* group) {
  State& s = state();
  if (s.timeout.load() <= 0) return;
  std::lock_guard lock(s.mutex);
  ensure_thread(s);
  id_ = s.next_id++;
  s.blocking.emplace(id_, Blocking{std::string(what) + describe_group(group), Clock::now()});
}

BlockingScope::~BlockingScope() {
  if (id_ < 0) return;
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.blocking.erase(id_);
}

void watch_async(std::string what, std::function<bool()> done, std::function<void()> release) {
  State& s = state();
  if (s.timeout.load() <= 0) {
    if (release) release();
    return;
  }
  std::lock_guard lock(s.mutex);
  ensure_thread(s);
  s.async.push_back(Async{std::move(what), Clock::now(), std::move(done), std::move(release)});
}

long add_abort_hook(std::function<void()> hook) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  const long id = s.next_id++;
  s.hooks.emplace(id, std::move(hook));
  return id;
}

void remove_abort_hook(long id) {
  State& s = state();
  std::lock_guard lock(s.mutex);
  s.hooks.erase(id);
}

namespace detail {

void stop_process(const std::string& message) {
  State& s = state();
  if (s.stopping.exchange(true)) {
    // Another thread is already stopping the process.
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  std::fprintf(stderr, "\ntessera: error: rank %d: %s; stopping this rank (exit status %d)\n", s.rank.load(),
               message.c_str(), kTimeoutExitStatus);
  std::fflush(stderr);
  std::fflush(stdout);
  std::map<long, std::function<void()>> hooks;
  {
    // try_lock: the thread that holds the mutex may be the one that is stuck.
    std::unique_lock lock(s.mutex, std::try_to_lock);
    if (lock.owns_lock()) hooks = s.hooks;
  }
  for (auto& [id, hook] : hooks) {
    try {
      hook();
    } catch (...) {
    }
  }
  std::_Exit(kTimeoutExitStatus);
}

}  // namespace detail

}  // namespace tessera::dist
