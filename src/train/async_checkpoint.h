// Checkpoints written by a background thread.
//
// The training loop hands over a CheckpointSnapshot (already copied to host memory, see
// checkpoint.h) and continues; one writer thread serialises it, fsyncs and renames it into
// place exactly as write_checkpoint() does, so the files are byte-identical to a synchronous
// save. At most one write is in flight: a request while the previous one is still being
// written waits for it (back-pressure, so host memory holds at most two snapshots) and
// reports how long it waited. A failed write is rethrown by the next request, wait() or
// finish().
#pragma once

#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "tessera/train/checkpoint.h"

namespace tessera::train {

class AsyncCheckpointer {
 public:
  AsyncCheckpointer(std::string out_dir, Retention retention);
  // Waits for the write in flight (a checkpoint is never abandoned half way), without throwing.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Queues `snapshot` for writing; returns the seconds spent waiting for the previous write.
  // The snapshot is shared, not copied (the trainer keeps it as its rewind point too).
  double request(std::shared_ptr<const CheckpointSnapshot> snapshot);
  // Blocks until nothing is in flight; rethrows a write's error. Returns seconds waited.
  double wait();
  // The directory of the last write that completed ("" before the first).
  std::string last_written() const;

 private:
  void run();

  std::string out_dir_;
  Retention retention_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::shared_ptr<const CheckpointSnapshot> pending_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::string last_written_;
  std::thread thread_;
};

}  // namespace tessera::train
