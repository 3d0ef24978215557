// `tessera launch`: starts N ranks of a tessera command on this host, without MPI.
//
// Each child is this same executable with the given arguments and RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT in its environment; the ranks
// then meet over TCP (dist::init_from_env, tcp_group.h). The launcher watches them: when one
// exits with an error or is killed, it stops the others (SIGTERM, then SIGKILL after a grace
// period) and exits non-zero naming that rank. Ctrl-C / SIGTERM to the launcher reach every
// rank. A child outlives no launcher: it gets SIGTERM when the launcher dies.
#include <CLI/CLI.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "tessera/core/error.h"
#include "tessera/dist/process_group.h"

namespace tessera::cli {

namespace {

volatile sig_atomic_t forwarded_signal = 0;
std::vector<std::string> words_after_dashes;  // `tessera launch ... -- COMMAND...`, see split_launch_args

void on_signal(int sig) { forwarded_signal = sig; }

// A TCP port nobody listens on now (the kernel picks it); rank 0 binds it moments later.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TESSERA_CHECK(fd >= 0, "launch: socket() failed: ", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  TESSERA_CHECK(ok, "launch: cannot find a free TCP port: ", std::strerror(errno), " (pass --master-port)");
  return ntohs(a.sin_port);
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return std::string("was killed by signal ") + std::to_string(WTERMSIG(status)) + " (" +
                                  strsignal(WTERMSIG(status)) + ")";
  return "stopped (status " + std::to_string(status) + ")";
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

struct Options {
  int nproc = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  double grace_s = 10;
  std::vector<std::string> command;
};

int run_launch(const Options& o) {
  TESSERA_CHECK(o.nproc >= 1, "launch: --nproc must be at least 1");
  TESSERA_CHECK(!o.command.empty(), "launch: no command to run (e.g. tessera launch --nproc 2 train config.yaml)");
  TESSERA_CHECK(o.command.front() != "launch", "launch: the command cannot be launch itself");
  TESSERA_CHECK(!dist::launched_by_mpi(), "launch: this process was started by an MPI launcher; use either mpirun -np N ",
                "tessera ... or tessera launch --nproc N ..., not both");
  const int port = o.master_port > 0 ? o.master_port : free_port();
  // One OpenMP thread per core share, unless the user chose.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const std::string omp_threads = std::to_string(std::max(1u, cores / static_cast<unsigned>(o.nproc)));
  const bool set_omp = std::getenv("OMP_NUM_THREADS") == nullptr;

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;  // no SA_RESTART: waitpid returns to look at the signal
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  std::vector<pid_t> pids(static_cast<size_t>(o.nproc), -1);
  std::vector<bool> done(pids.size(), false);
  const pid_t launcher = ::getpid();
  std::fflush(stdout);
  std::fflush(stderr);
  for (int r = 0; r < o.nproc; ++r) {
    const pid_t pid = ::fork();
    TESSERA_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != launcher) std::_Exit(1);  // the launcher died before prctl
      signal(SIGINT, SIG_DFL);
      signal(SIGTERM, SIG_DFL);
      signal(SIGHUP, SIG_DFL);
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc).c_str(), 1);
      setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      if (set_omp) setenv("OMP_NUM_THREADS", omp_threads.c_str(), 1);
      std::vector<std::string> args{"tessera"};
      args.insert(args.end(), o.command.begin(), o.command.end());
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "tessera launch: rank %d: cannot run /proc/self/exe: %s\n", r, std::strerror(errno));
      std::_Exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
  }

  int failed_rank = -1, failed_status = 0, running = o.nproc;
  auto stop_all = [&](int sig) {
    for (size_t r = 0; r < pids.size(); ++r)
      if (!done[r]) ::kill(pids[r], sig);
  };
  auto reap = [&](pid_t pid, int status) {
    for (size_t r = 0; r < pids.size(); ++r) {
      if (pids[r] != pid || done[r]) continue;
      done[r] = true;
      --running;
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && failed_rank < 0) {
        failed_rank = static_cast<int>(r);
        failed_status = status;
        if (running > 0) {
          std::fprintf(stderr, "tessera launch: rank %zu (pid %d) %s; stopping the other %d rank(s)\n", r, pid,
                       describe_status(status).c_str(), running);
          stop_all(SIGTERM);
        }
      }
    }
  };
  auto deadline = std::chrono::steady_clock::time_point::max();
  bool killed = false;
  int signal_seen = 0;
  while (running > 0) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, failed_rank >= 0 || signal_seen ? WNOHANG : 0);
    if (pid > 0) {
      reap(pid, status);
      continue;
    }
    if (pid < 0 && errno != EINTR) break;  // no children left
    if (forwarded_signal && !signal_seen) {
      signal_seen = forwarded_signal;
      std::fprintf(stderr, "tessera launch: got signal %d; passing it to the ranks\n", signal_seen);
      stop_all(signal_seen);
    }
    if ((failed_rank >= 0 || signal_seen) && deadline == std::chrono::steady_clock::time_point::max())
      deadline = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                         std::chrono::duration<double>(o.grace_s));
    if (!killed && std::chrono::steady_clock::now() > deadline) {
      std::fprintf(stderr, "tessera launch: %d rank(s) still running after %.0f s; killing them\n", running, o.grace_s);
      stop_all(SIGKILL);
      killed = true;
    }
    if (pid == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (failed_rank >= 0) {
    std::fprintf(stderr, "tessera launch: failed: rank %d %s\n", failed_rank, describe_status(failed_status).c_str());
    const int code = exit_code_of(failed_status);
    return code != 0 ? code : 1;
  }
  if (signal_seen) return 128 + signal_seen;
  return 0;
}

}  // namespace

int split_launch_args(int argc, char** argv) {
  if (argc < 2 || std::string(argv[1]) != "launch") return argc;
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) != "--") continue;
    words_after_dashes.assign(argv + i + 1, argv + argc);
    return i;
  }
  return argc;
}

void add_launch_command(CLI::App& app) {
  static Options options;
  CLI::App* launch = app.add_subcommand(
      "launch",
      "Run N ranks of a tessera command on this host, without MPI: tessera launch --nproc N [--] train CONFIG ...");
  launch->footer(
      "Each rank runs `tessera COMMAND...` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and "
      "MASTER_PORT set; the ranks connect to each other over TCP (rank 0 listens on MASTER_ADDR:MASTER_PORT). "
      "OMP_NUM_THREADS is set to cores / N unless it is set already. When a rank exits with an error or dies, the "
      "others get SIGTERM (SIGKILL after --grace-s) and launch exits with that rank's status; Ctrl-C reaches every "
      "rank. With MPI, `mpirun -np N tessera train CONFIG` does the same job on one or many hosts. See "
      "docs/distributed.md.");
  launch->add_option("--nproc", options.nproc, "Number of ranks to start")->required()->check(CLI::Range(1, 4096));
  launch->add_option("--master-addr", options.master_addr, "Address rank 0 is reached at")->capture_default_str();
  launch->add_option("--master-port", options.master_port,
                     "TCP port rank 0 listens on (default: a free port picked now)")
      ->check(CLI::Range(0, 65535));
  launch->add_option("--grace-s", options.grace_s,
                     "Seconds the other ranks get to stop after one failed, before SIGKILL")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  // Everything from the first positional argument on (or after `--`) is the command, passed
  // through untouched, options of `train` included.
  launch->prefix_command();
  launch->allow_extras();  // the words after `--` too
  launch->callback([launch] {
    std::vector<std::string> command = launch->remaining();
    command.insert(command.end(), words_after_dashes.begin(), words_after_dashes.end());
    options.command = command;
    const int code = run_launch(options);
    std::fflush(stdout);
    if (code != 0) std::exit(code);
  });
}

}  // namespace tessera::cli
