// The TCP backend (see tessera/dist/tcp_group.h).
//
// All sockets are non-blocking; every operation is an "exchange": a set of messages to send
// to and receive from some peers, progressed together with poll() until all are done, so
// that two ranks sending to each other never wait on each other's kernel buffers. A message
// is a header (magic, group id, length) and the payload. A message for another group than
// the one being received (possible when sub-groups interleave) is kept aside until its
// group asks for it.
#include "tessera/dist/tcp_group.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <deque>
#include <map>
#include <thread>

#include "collective_math.h"
#include "tessera/dist/watchdog.h"

namespace tessera::dist {

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kMagic = 0x3173736574726574ull;  // "tertess1", any fixed value

struct Header {
  uint64_t magic = kMagic;
  uint64_t group = 0;
  uint64_t bytes = 0;
};

struct Hello {
  uint64_t magic = kMagic;
  int32_t size = 0, rank = 0, port = 0, unused = 0;
};

struct Address {
  uint32_t ip = 0;    // network byte order
  uint32_t port = 0;  // host byte order
};

struct Deadline {
  bool forever;
  Clock::time_point at;
  explicit Deadline(double seconds)
      : forever(!(seconds > 0)),
        at(Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(forever ? 0 : seconds))) {}
  int poll_ms(int cap = -1) const {
    if (forever) return cap;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now()).count() + 1;
    const int ms = static_cast<int>(std::max<int64_t>(0, left));
    return cap >= 0 ? std::min(ms, cap) : ms;
  }
  bool passed() const { return !forever && Clock::now() >= at; }
};

std::string errno_text(int e) { return std::strerror(e); }

void set_socket_options(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

void wait_fd(int fd, short events, const Deadline& d, const std::string& what) {
  pollfd p{fd, events, 0};
  for (;;) {
    const int n = ::poll(&p, 1, d.poll_ms());
    if (n > 0) return;
    if (n == 0) TESSERA_FAIL(what, ": timed out");
    if (errno != EINTR) TESSERA_FAIL(what, ": poll failed: ", errno_text(errno));
  }
}

void send_all(int fd, const void* data, size_t n, const Deadline& d, const std::string& what) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      wait_fd(fd, POLLOUT, d, what);
    } else {
      TESSERA_FAIL(what, ": ", errno_text(errno));
    }
  }
}

void recv_all(int fd, void* data, size_t n, const Deadline& d, const std::string& what) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k > 0) {
      p += k;
      n -= static_cast<size_t>(k);
    } else if (k == 0) {
      TESSERA_FAIL(what, ": the peer closed the connection");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      wait_fd(fd, POLLIN, d, what);
    } else {
      TESSERA_FAIL(what, ": ", errno_text(errno));
    }
  }
}

sockaddr_in resolve(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  TESSERA_CHECK(rc == 0 && found != nullptr, "tcp: cannot resolve MASTER_ADDR '", host, "': ", ::gai_strerror(rc));
  sockaddr_in out = *reinterpret_cast<const sockaddr_in*>(found->ai_addr);
  ::freeaddrinfo(found);
  out.sin_port = htons(static_cast<uint16_t>(port));
  return out;
}

// A listening socket on every interface; port 0 picks a free one. Returns (fd, port).
std::pair<int, int> listen_on(int port, int backlog) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  TESSERA_CHECK(fd >= 0, "tcp: socket() failed: ", errno_text(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  a.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, backlog) != 0) {
    const int e = errno;
    ::close(fd);
    TESSERA_FAIL("tcp: cannot listen on port ", port, ": ", errno_text(e),
                 e == EADDRINUSE ? " (another job uses it: set MASTER_PORT, or --master-port, to a free port)" : "");
  }
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  return {fd, ntohs(a.sin_port)};
}

// Connects to `to`, retrying while nobody listens there yet (the peer may start later).
int connect_to(const sockaddr_in& to, const Deadline& d, const std::string& what) {
  for (;;) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    TESSERA_CHECK(fd >= 0, "tcp: socket() failed: ", errno_text(errno));
    int e = 0;
    if (::connect(fd, reinterpret_cast<const sockaddr*>(&to), sizeof to) == 0) {
      set_socket_options(fd);
      return fd;
    }
    e = errno;
    if (e == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      const int n = ::poll(&p, 1, d.poll_ms(1000));
      if (n > 0) {
        socklen_t len = sizeof e;
        ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len);
        if (e == 0) {
          set_socket_options(fd);
          return fd;
        }
      } else {
        e = ETIMEDOUT;
      }
    }
    ::close(fd);
    const bool retry = e == ECONNREFUSED || e == ETIMEDOUT || e == ECONNRESET || e == ENETUNREACH || e == EHOSTUNREACH ||
                       e == ECONNABORTED || e == EAGAIN;
    TESSERA_CHECK(retry && !d.passed(), what, ": ", errno_text(e));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

int accept_one(int listen_fd, const Deadline& d, const std::string& what, uint32_t* ip) {
  for (;;) {
    wait_fd(listen_fd, POLLIN, d, what);
    sockaddr_in from{};
    socklen_t len = sizeof from;
    const int fd = ::accept4(listen_fd, reinterpret_cast<sockaddr*>(&from), &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED) continue;
      TESSERA_FAIL(what, ": accept failed: ", errno_text(errno));
    }
    set_socket_options(fd);
    if (ip) *ip = from.sin_addr.s_addr;
    return fd;
  }
}

// One message to send to and/or receive from a peer within an exchange.
struct Transfer {
  int peer = -1;  // world rank
  const char* send = nullptr;
  size_t send_bytes = 0;
  bool sending = false;
  char* recv = nullptr;
  size_t recv_bytes = 0;
  bool receiving = false;
  // progress
  Header out{};
  size_t out_done = 0;  // of sizeof(Header) + send_bytes
  Header in{};
  size_t in_header_done = 0, in_done = 0;
  std::vector<char> foreign;  // the payload of a message for another group
  bool in_is_foreign = false;
  bool send_complete = true, recv_complete = true;
};

// The sockets to every other rank, shared by the world group and all its sub-groups.
struct Mesh {
  int rank = 0, size = 1;
  std::vector<int> fds;                                                  // by world rank; -1 for self
  std::vector<std::map<uint64_t, std::deque<std::vector<char>>>> stash;  // by world rank, then group

  ~Mesh() {
    for (int fd : fds)
      if (fd >= 0) ::close(fd);
  }

  [[noreturn]] void closed(int peer, const std::string& what) const {
    TESSERA_FAIL("rank ", rank, ": ", what, ": rank ", peer,
                 " closed its connection (it exited, crashed or stopped on an error)");
  }

  void progress_send(Transfer& t, const std::string& what) {
    const size_t total = sizeof(Header) + t.send_bytes;
    while (t.out_done < total) {
      iovec iov[2];
      int count = 0;
      if (t.out_done < sizeof(Header)) {
        iov[count++] = {reinterpret_cast<char*>(&t.out) + t.out_done, sizeof(Header) - t.out_done};
        if (t.send_bytes > 0) iov[count++] = {const_cast<char*>(t.send), t.send_bytes};
      } else {
        const size_t done = t.out_done - sizeof(Header);
        iov[count++] = {const_cast<char*>(t.send) + done, t.send_bytes - done};
      }
      msghdr m{};
      m.msg_iov = iov;
      m.msg_iovlen = static_cast<size_t>(count);
      const ssize_t k = ::sendmsg(fds[static_cast<size_t>(t.peer)], &m, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (k > 0) {
        t.out_done += static_cast<size_t>(k);
        continue;
      }
      if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
      if (k < 0 && (errno == EPIPE || errno == ECONNRESET)) closed(t.peer, what);
      TESSERA_FAIL("rank ", rank, ": ", what, ": sending to rank ", t.peer, " failed: ", errno_text(errno));
    }
    t.send_complete = true;
  }

  // Reads `n` bytes into `dst`; false when the socket has nothing more now.
  bool read_some(Transfer& t, char* dst, size_t n, size_t& done, const std::string& what) {
    while (done < n) {
      const ssize_t k = ::recv(fds[static_cast<size_t>(t.peer)], dst + done, n - done, MSG_DONTWAIT);
      if (k > 0) {
        done += static_cast<size_t>(k);
        continue;
      }
      if (k == 0) closed(t.peer, what);
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return false;
      if (errno == ECONNRESET) closed(t.peer, what);
      TESSERA_FAIL("rank ", rank, ": ", what, ": receiving from rank ", t.peer, " failed: ", errno_text(errno));
    }
    return true;
  }

  void progress_recv(Transfer& t, uint64_t group, const std::string& what) {
    for (;;) {
      if (t.in_header_done < sizeof(Header)) {
        if (!read_some(t, reinterpret_cast<char*>(&t.in), sizeof(Header), t.in_header_done, what)) return;
        TESSERA_CHECK(t.in.magic == kMagic, "rank ", rank, ": ", what, ": garbled stream from rank ", t.peer);
        t.in_done = 0;
        t.in_is_foreign = t.in.group != group;
        if (t.in_is_foreign) {
          t.foreign.assign(t.in.bytes, 0);
        } else {
          TESSERA_CHECK(t.in.bytes == t.recv_bytes, "rank ", rank, ": ", what, ": rank ", t.peer, " sent ", t.in.bytes,
                        " bytes, this rank expected ", t.recv_bytes,
                        " (the ranks disagree on a shape or called different operations)");
        }
      }
      char* dst = t.in_is_foreign ? t.foreign.data() : t.recv;
      if (!read_some(t, dst, t.in.bytes, t.in_done, what)) return;
      t.in_header_done = 0;
      if (!t.in_is_foreign) {
        t.recv_complete = true;
        return;
      }
      stash[static_cast<size_t>(t.peer)][t.in.group].push_back(std::move(t.foreign));
      t.foreign = {};
    }
  }

  void exchange(uint64_t group, std::vector<Transfer>& ts, const std::string& what) {
    for (Transfer& t : ts) {
      t.send_complete = !t.sending;
      t.recv_complete = !t.receiving;
      t.out = Header{kMagic, group, t.send_bytes};
      if (t.receiving) {
        auto& queue = stash[static_cast<size_t>(t.peer)][group];
        if (!queue.empty()) {
          std::vector<char> m = std::move(queue.front());
          queue.pop_front();
          TESSERA_CHECK(m.size() == t.recv_bytes, "rank ", rank, ": ", what, ": rank ", t.peer, " sent ", m.size(),
                        " bytes, this rank expected ", t.recv_bytes, " (the ranks disagree on a shape)");
          if (!m.empty()) std::memcpy(t.recv, m.data(), m.size());
          t.recv_complete = true;
        }
      }
    }
    const Deadline deadline(timeout());
    std::vector<pollfd> polls;
    std::vector<Transfer*> owners;
    for (;;) {
      polls.clear();
      owners.clear();
      for (Transfer& t : ts) {
        short events = 0;
        if (!t.send_complete) events |= POLLOUT;
        if (!t.recv_complete) events |= POLLIN;
        if (events == 0) continue;
        polls.push_back({fds[static_cast<size_t>(t.peer)], events, 0});
        owners.push_back(&t);
      }
      if (polls.empty()) return;
      const int n = ::poll(polls.data(), polls.size(), deadline.poll_ms());
      if (n < 0) {
        if (errno == EINTR) continue;
        TESSERA_FAIL("rank ", rank, ": ", what, ": poll failed: ", errno_text(errno));
      }
      if (n == 0) {
        std::string waiting;
        for (const Transfer* t : owners) waiting += (waiting.empty() ? "" : ", ") + std::to_string(t->peer);
        TESSERA_FAIL("rank ", rank, ": ", what, " has not completed after ", timeout(),
                     " s (the timeout, training.parallel.timeout_s): no answer from rank(s) ", waiting,
                     "; another rank died, hung or is running different code");
      }
      for (size_t i = 0; i < polls.size(); ++i) {
        const short r = polls[i].revents;
        if (r == 0) continue;
        Transfer& t = *owners[i];
        if (r & POLLNVAL) TESSERA_FAIL("rank ", rank, ": ", what, ": the socket to rank ", t.peer, " is not open");
        if (!t.recv_complete && (r & (POLLIN | POLLERR | POLLHUP))) progress_recv(t, group, what);
        if (!t.send_complete && (r & (POLLOUT | POLLERR | POLLHUP))) progress_send(t, what);
      }
    }
  }
};

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t h = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return h;
}

class TcpGroup final : public ProcessGroup {
 public:
  TcpGroup(std::shared_ptr<Mesh> mesh, uint64_t id, std::vector<int> members) : mesh_(std::move(mesh)), id_(id) {
    world_ranks_ = std::move(members);
    size_ = static_cast<int>(world_ranks_.size());
    rank_ = static_cast<int>(std::find(world_ranks_.begin(), world_ranks_.end(), mesh_->rank) - world_ranks_.begin());
  }
  const char* backend() const override { return "tcp"; }

  void all_reduce(Context&, Tensor& tensor, ReduceOp op) override {
    detail::check_cpu_tensor(tensor, "TCP", "all_reduce", "tensor");
    if (size_ == 1) return;
    const DType acc = detail::accumulate_dtype(tensor.dtype(), "all_reduce");
    const int64_t n = tensor.numel();
    const int64_t chunk = (n + size_ - 1) / size_;
    Tensor send = Tensor::zeros({size_ * chunk}, acc);
    Tensor head = send.slice(0, 0, n);
    detail::convert(tensor.reshape({n}), head);
    Tensor recv = Tensor::empty({size_ * chunk}, acc);
    equal_all_to_all(send, recv, static_cast<size_t>(chunk) * dtype_size(acc), "all_reduce");
    Tensor mine = detail::reduce_received(recv, chunk, size_, op, acc);
    Tensor gathered = Tensor::empty({size_ * chunk}, acc);
    gather_bytes(mine.raw_data(), gathered.raw_data(), mine.nbytes(), "all_reduce");
    Tensor flat = tensor.reshape({n});
    detail::convert(gathered.slice(0, 0, n), flat);
  }

  void reduce_scatter(Context&, const Tensor& in, Tensor& out, ReduceOp op) override {
    detail::check_cpu_tensor(in, "TCP", "reduce_scatter", "in");
    detail::check_cpu_tensor(out, "TCP", "reduce_scatter", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel() * size_, "reduce_scatter: in ", in.describe(),
                  " must hold ", size_, " x out ", out.describe());
    const DType acc = detail::accumulate_dtype(in.dtype(), "reduce_scatter");
    const int64_t chunk = out.numel();
    Tensor send = Tensor::empty({in.numel()}, acc);
    detail::convert(in.reshape({in.numel()}), send);
    Tensor recv = Tensor::empty({in.numel()}, acc);
    equal_all_to_all(send, recv, static_cast<size_t>(chunk) * dtype_size(acc), "reduce_scatter");
    Tensor mine = detail::reduce_received(recv, chunk, size_, op, acc);
    Tensor flat = out.reshape({chunk});
    detail::convert(mine, flat);
  }

  void all_gather(Context&, const Tensor& in, Tensor& out) override {
    detail::check_cpu_tensor(in, "TCP", "all_gather", "in");
    detail::check_cpu_tensor(out, "TCP", "all_gather", "out");
    TESSERA_CHECK(in.dtype() == out.dtype() && out.numel() == in.numel() * size_, "all_gather: out ", out.describe(),
                  " must hold ", size_, " x in ", in.describe());
    gather_bytes(in.raw_data(), out.raw_data(), in.nbytes(), "all_gather");
  }

  void broadcast(Context&, Tensor& tensor, int root) override {
    detail::check_cpu_tensor(tensor, "TCP", "broadcast", "tensor");
    TESSERA_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is outside a group of ", size_);
    if (size_ == 1) return;
    std::vector<Transfer> ts;
    char* data = static_cast<char*>(tensor.raw_data());
    if (rank_ == root) {
      for (int p = 0; p < size_; ++p) {
        if (p == rank_) continue;
        Transfer t;
        t.peer = world_ranks_[static_cast<size_t>(p)];
        t.send = data;
        t.send_bytes = tensor.nbytes();
        t.sending = true;
        ts.push_back(std::move(t));
      }
    } else {
      Transfer t;
      t.peer = world_ranks_[static_cast<size_t>(root)];
      t.recv = data;
      t.recv_bytes = tensor.nbytes();
      t.receiving = true;
      ts.push_back(std::move(t));
    }
    mesh_->exchange(id_, ts, what("broadcast"));
  }

  void all_to_all(Context&, const Tensor& in, Tensor& out, const std::vector<int64_t>& in_splits,
                  const std::vector<int64_t>& out_splits) override {
    detail::check_cpu_tensor(in, "TCP", "all_to_all", "in");
    detail::check_cpu_tensor(out, "TCP", "all_to_all", "out");
    TESSERA_CHECK(in.dtype() == out.dtype(), "all_to_all: in and out dtypes differ");
    TESSERA_CHECK(in_splits.size() == static_cast<size_t>(size_) && out_splits.size() == static_cast<size_t>(size_),
                  "all_to_all: need ", size_, " splits, got ", in_splits.size(), " and ", out_splits.size());
    TESSERA_CHECK(in.dim() >= 1 && out.dim() >= 1, "all_to_all: tensors need a row dimension");
    const size_t row_bytes = in.size(0) ? in.nbytes() / static_cast<size_t>(in.size(0)) : 0;
    const size_t out_row_bytes = out.size(0) ? out.nbytes() / static_cast<size_t>(out.size(0)) : 0;
    TESSERA_CHECK(in.size(0) == 0 || out.size(0) == 0 || row_bytes == out_row_bytes,
                  "all_to_all: rows of in and out differ in size");
    const size_t rb = std::max(row_bytes, out_row_bytes);
    std::vector<size_t> s_off(static_cast<size_t>(size_) + 1, 0), r_off(s_off.size(), 0);
    for (size_t p = 0; p < static_cast<size_t>(size_); ++p) {
      TESSERA_CHECK(in_splits[p] >= 0 && out_splits[p] >= 0, "all_to_all: negative split");
      s_off[p + 1] = s_off[p] + static_cast<size_t>(in_splits[p]) * rb;
      r_off[p + 1] = r_off[p] + static_cast<size_t>(out_splits[p]) * rb;
    }
    TESSERA_CHECK(s_off.back() == in.nbytes() && r_off.back() == out.nbytes(), "all_to_all: splits sum to ",
                  s_off.back() / std::max<size_t>(rb, 1), " and ", r_off.back() / std::max<size_t>(rb, 1),
                  " rows, but in has ", in.size(0), " and out ", out.size(0));
    const char* src = static_cast<const char*>(in.raw_data());
    char* dst = static_cast<char*>(out.raw_data());
    const size_t me = static_cast<size_t>(rank_);
    TESSERA_CHECK(s_off[me + 1] - s_off[me] == r_off[me + 1] - r_off[me], "all_to_all: rank ", rank_, " sends itself ",
                  in_splits[me], " rows but expects ", out_splits[me]);
    if (r_off[me + 1] > r_off[me]) std::memcpy(dst + r_off[me], src + s_off[me], r_off[me + 1] - r_off[me]);
    std::vector<Transfer> ts;
    for (size_t p = 0; p < static_cast<size_t>(size_); ++p) {
      if (p == me) continue;
      Transfer t;
      t.peer = world_ranks_[p];
      t.send = src + s_off[p];
      t.send_bytes = s_off[p + 1] - s_off[p];
      t.sending = true;
      t.recv = dst + r_off[p];
      t.recv_bytes = r_off[p + 1] - r_off[p];
      t.receiving = true;
      ts.push_back(std::move(t));
    }
    mesh_->exchange(id_, ts, what("all_to_all"));
  }

  void send(Context&, const Tensor& tensor, int dst) override {
    detail::check_cpu_tensor(tensor, "TCP", "send", "tensor");
    TESSERA_CHECK(dst >= 0 && dst < size_ && dst != rank_, "send: bad destination ", dst);
    std::vector<Transfer> ts(1);
    ts[0].peer = world_ranks_[static_cast<size_t>(dst)];
    ts[0].send = static_cast<const char*>(tensor.raw_data());
    ts[0].send_bytes = tensor.nbytes();
    ts[0].sending = true;
    mesh_->exchange(id_, ts, what("send"));
  }

  void recv(Context&, Tensor& tensor, int src) override {
    detail::check_cpu_tensor(tensor, "TCP", "recv", "tensor");
    TESSERA_CHECK(src >= 0 && src < size_ && src != rank_, "recv: bad source ", src);
    std::vector<Transfer> ts(1);
    ts[0].peer = world_ranks_[static_cast<size_t>(src)];
    ts[0].recv = static_cast<char*>(tensor.raw_data());
    ts[0].recv_bytes = tensor.nbytes();
    ts[0].receiving = true;
    mesh_->exchange(id_, ts, what("recv"));
  }

  void barrier() override {
    if (size_ == 1) return;
    std::vector<Transfer> ts;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      Transfer t;
      t.peer = world_ranks_[static_cast<size_t>(p)];
      t.sending = t.receiving = true;
      ts.push_back(std::move(t));
    }
    mesh_->exchange(id_, ts, what("barrier"));
  }

  std::shared_ptr<ProcessGroup> split(int color, int key) override {
    Context cpu = Context::cpu();
    Tensor mine = Tensor::from_ints({color, key}, {2}, DType::I64);
    Tensor all = Tensor::empty({2 * size_}, DType::I64);
    all_gather(cpu, mine, all);
    const std::vector<int64_t> v = all.to_ints();
    const uint64_t id = mix(mix(id_, ++splits_), static_cast<uint64_t>(color));
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;  // (key, rank in this group)
    for (int p = 0; p < size_; ++p)
      if (v[static_cast<size_t>(2 * p)] == color) members.emplace_back(v[static_cast<size_t>(2 * p + 1)], p);
    std::sort(members.begin(), members.end());
    std::vector<int> world;
    for (const auto& [k, p] : members) world.push_back(world_ranks_[static_cast<size_t>(p)]);
    return std::make_shared<TcpGroup>(mesh_, id, std::move(world));
  }

 private:
  std::string what(const char* op) const {
    std::string ranks;
    for (size_t i = 0; i < world_ranks_.size() && i < 16; ++i) ranks += (i ? "," : "") + std::to_string(world_ranks_[i]);
    if (world_ranks_.size() > 16) ranks += ",...";
    return std::string("TCP ") + op + " over ranks [" + ranks + "]";
  }

  // recv[p] = send part `rank_` of rank p, for parts of `part_bytes`.
  void equal_all_to_all(const Tensor& send, Tensor& recv, size_t part_bytes, const char* op) {
    const char* src = static_cast<const char*>(send.raw_data());
    char* dst = static_cast<char*>(recv.raw_data());
    const size_t me = static_cast<size_t>(rank_);
    if (part_bytes > 0) std::memcpy(dst + me * part_bytes, src + me * part_bytes, part_bytes);
    std::vector<Transfer> ts;
    for (size_t p = 0; p < static_cast<size_t>(size_); ++p) {
      if (p == me) continue;
      Transfer t;
      t.peer = world_ranks_[p];
      t.send = src + p * part_bytes;
      t.send_bytes = part_bytes;
      t.sending = true;
      t.recv = dst + p * part_bytes;
      t.recv_bytes = part_bytes;
      t.receiving = true;
      ts.push_back(std::move(t));
    }
    mesh_->exchange(id_, ts, what(op));
  }

  // out[p] = rank p's `bytes` bytes at `in`.
  void gather_bytes(const void* in, void* out, size_t bytes, const char* op) {
    const size_t me = static_cast<size_t>(rank_);
    char* dst = static_cast<char*>(out);
    if (bytes > 0) std::memmove(dst + me * bytes, in, bytes);
    if (size_ == 1) return;
    const char* src = dst + me * bytes;
    std::vector<Transfer> ts;
    for (size_t p = 0; p < static_cast<size_t>(size_); ++p) {
      if (p == me) continue;
      Transfer t;
      t.peer = world_ranks_[p];
      t.send = src;
      t.send_bytes = bytes;
      t.sending = true;
      t.recv = dst + p * bytes;
      t.recv_bytes = bytes;
      t.receiving = true;
      ts.push_back(std::move(t));
    }
    mesh_->exchange(id_, ts, what(op));
  }

  std::shared_ptr<Mesh> mesh_;
  uint64_t id_;
  uint64_t splits_ = 0;
};

}  // namespace

GroupPtr tcp_group(int rank, int size, const std::string& master_addr, int master_port, double connect_timeout_s) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "tcp_group: rank ", rank, " is outside a world of ", size);
  TESSERA_CHECK(master_port > 0 && master_port < 65536, "tcp_group: MASTER_PORT ", master_port, " is not a TCP port");
  auto mesh = std::make_shared<Mesh>();
  mesh->rank = rank;
  mesh->size = size;
  mesh->fds.assign(static_cast<size_t>(size), -1);
  mesh->stash.resize(static_cast<size_t>(size));
  std::vector<int> everyone(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) everyone[static_cast<size_t>(i)] = i;
  if (size == 1) return std::make_shared<TcpGroup>(mesh, 1, everyone);

  const Deadline d(connect_timeout_s);
  const std::string where = master_addr + ":" + std::to_string(master_port);
  std::vector<Address> table(static_cast<size_t>(size));
  auto check_hello = [&](const Hello& h, int lowest, const std::string& from) {
    TESSERA_CHECK(h.magic == kMagic, "tcp: rank ", rank, ": ", from, " is not a tessera rank of this job");
    TESSERA_CHECK(h.size == size, "tcp: rank ", h.rank, " was started with WORLD_SIZE=", h.size, ", rank ", rank,
                  " with WORLD_SIZE=", size, " (every rank needs the same)");
    TESSERA_CHECK(h.rank >= lowest && h.rank < size, "tcp: rank ", rank, ": a peer says it is rank ", h.rank,
                  ", outside [", lowest, ", ", size, ")");
    TESSERA_CHECK(mesh->fds[static_cast<size_t>(h.rank)] < 0, "tcp: two processes say they are rank ", h.rank,
                  " (RANK must differ between the processes of a job)");
  };
  if (rank == 0) {
    auto [lfd, port] = listen_on(master_port, size);
    (void)port;
    try {
      for (int i = 1; i < size; ++i) {
        uint32_t ip = 0;
        const int fd = accept_one(lfd, d,
                                  "tcp: rank 0 waited for " + std::to_string(size - i) + " more rank(s) to connect to " +
                                      where + " (started with another MASTER_ADDR/MASTER_PORT, or not at all?)",
                                  &ip);
        Hello h;
        recv_all(fd, &h, sizeof h, d, "tcp: rank 0: reading a peer's hello");
        if (h.magic != kMagic || h.size != size || h.rank < 1 || h.rank >= size ||
            mesh->fds[static_cast<size_t>(h.rank)] >= 0)
          ::close(fd);
        check_hello(h, 1, "a connection to " + where);
        mesh->fds[static_cast<size_t>(h.rank)] = fd;
        table[static_cast<size_t>(h.rank)] = {ip, static_cast<uint32_t>(h.port)};
      }
    } catch (...) {
      ::close(lfd);
      throw;
    }
    ::close(lfd);
    for (int r = 1; r < size; ++r)
      send_all(mesh->fds[static_cast<size_t>(r)], table.data(), table.size() * sizeof(Address), d,
               "tcp: rank 0: sending the address table");
  } else {
    auto [lfd, my_port] = listen_on(0, size);
    try {
      const int fd0 = connect_to(resolve(master_addr, master_port), d,
                                 "tcp: rank " + std::to_string(rank) + " could not reach rank 0 at " + where);
      mesh->fds[0] = fd0;
      Hello h;
      h.size = size;
      h.rank = rank;
      h.port = my_port;
      send_all(fd0, &h, sizeof h, d, "tcp: rank " + std::to_string(rank) + ": sending hello to rank 0");
      recv_all(fd0, table.data(), table.size() * sizeof(Address), d,
               "tcp: rank " + std::to_string(rank) + ": waiting for rank 0's address table (rank 0 stopped?)");
      for (int j = 1; j < rank; ++j) {
        sockaddr_in to{};
        to.sin_family = AF_INET;
        to.sin_addr.s_addr = table[static_cast<size_t>(j)].ip;
        to.sin_port = htons(static_cast<uint16_t>(table[static_cast<size_t>(j)].port));
        const int fd = connect_to(to, d, "tcp: rank " + std::to_string(rank) + " could not reach rank " + std::to_string(j));
        mesh->fds[static_cast<size_t>(j)] = fd;
        Hello me;
        me.size = size;
        me.rank = rank;
        send_all(fd, &me, sizeof me, d, "tcp: rank " + std::to_string(rank) + ": hello to rank " + std::to_string(j));
      }
      for (int k = rank + 1; k < size; ++k) {
        const int fd = accept_one(lfd, d, "tcp: rank " + std::to_string(rank) + " waited for the higher ranks to connect",
                                  nullptr);
        Hello peer;
        recv_all(fd, &peer, sizeof peer, d, "tcp: rank " + std::to_string(rank) + ": reading a peer's hello");
        if (peer.magic != kMagic || peer.size != size || peer.rank <= rank || peer.rank >= size ||
            mesh->fds[static_cast<size_t>(peer.rank)] >= 0)
          ::close(fd);
        check_hello(peer, rank + 1, "a peer");
        mesh->fds[static_cast<size_t>(peer.rank)] = fd;
      }
    } catch (...) {
      ::close(lfd);
      throw;
    }
    ::close(lfd);
  }
  return std::make_shared<TcpGroup>(mesh, 1, everyone);
}

}  // namespace tessera::dist
