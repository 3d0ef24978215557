#include "train/async_checkpoint.h"

#include <chrono>

#include "tessera/core/error.h"

namespace tessera::train {

AsyncCheckpointer::AsyncCheckpointer(std::string out_dir, Retention retention)
    : out_dir_(std::move(out_dir)), retention_(retention), thread_([this] { run(); }) {}

AsyncCheckpointer::~AsyncCheckpointer() {
  {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return !pending_ && !busy_; });
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

double AsyncCheckpointer::request(std::shared_ptr<const CheckpointSnapshot> snapshot) {
  TESSERA_CHECK(snapshot != nullptr, "AsyncCheckpointer: null snapshot");
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !pending_ && !busy_; });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  pending_ = std::move(snapshot);
  lock.unlock();
  cv_.notify_all();
  return waited;
}

double AsyncCheckpointer::wait() {
  const auto start = std::chrono::steady_clock::now();
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return !pending_ && !busy_; });
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string AsyncCheckpointer::last_written() const {
  std::lock_guard lock(mutex_);
  return last_written_;
}

void AsyncCheckpointer::run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || pending_ != nullptr; });
    if (!pending_) return;  // stop_ with nothing left to write
    std::shared_ptr<const CheckpointSnapshot> job = std::move(pending_);
    pending_ = nullptr;
    busy_ = true;
    lock.unlock();
    std::string written;
    std::exception_ptr error;
    try {
      written = write_checkpoint(out_dir_, *job, retention_);
    } catch (...) {
      error = std::current_exception();
    }
    job.reset();  // free the host copy (unless the trainer still holds it) before reporting done
    lock.lock();
    busy_ = false;
    if (error) error_ = error;
    else last_written_ = written;
    cv_.notify_all();
  }
}

}  // namespace tessera::train
