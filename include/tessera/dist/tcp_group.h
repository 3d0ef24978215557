// The TCP backend: collectives over CPU tensors between processes that were started without
// an MPI launcher (`tessera launch`, torchrun-style RANK / WORLD_SIZE / MASTER_ADDR /
// MASTER_PORT launches, one host or several).
//
// Rendezvous: rank 0 listens on master_addr:master_port; every other rank connects (retrying
// until rank 0 is up), says its rank and the port it listens on, and gets the table of all
// ranks' addresses back; then each pair of ranks connects directly (a full mesh of sockets).
// Ranks that disagree on the world size, or two processes claiming one rank, stop with an
// error.
//
// Collectives follow the MPI backend's algorithms and reduce in rank order with the same
// arithmetic, so results are bitwise those of the MPI backend. all_gather and broadcast send
// each rank's part straight to every other rank (p - 1 copies): right for the few ranks of
// one host, not tuned for many hosts. Every message carries its group and length, so a rank
// that sends another shape than its peer expects stops with an error instead of reading
// garbage.
//
// Every wait is bounded by dist::timeout() (when > 0): a peer that does not answer in time
// or that closed its connection (it exited or crashed) makes the call throw Error naming the
// peer and the operation.
#pragma once

#include <string>

#include "tessera/dist/process_group.h"

namespace tessera::dist {

// Collective over `size` processes that agree on master_addr:master_port. `connect_timeout_s`
// bounds the rendezvous (rank 0 waiting for the others, the others retrying rank 0).
GroupPtr tcp_group(int rank, int size, const std::string& master_addr, int master_port, double connect_timeout_s = 300);

}  // namespace tessera::dist
