// The MPI backend's entry points, for process_group.cpp (the class itself stays private to
// mpi_group.cpp). Built only with TESSERA_WITH_MPI.
#pragma once

#include "tessera/dist/process_group.h"

namespace tessera::dist::detail {

// MPI_COMM_WORLD as a group; initializes MPI (thread level FUNNELED: only the thread that
// called init makes MPI calls, OpenMP workers never do) on the first call.
GroupPtr mpi_world();
// MPI_Finalize when mpi_world() initialized MPI and it is not finalized yet.
void mpi_finalize();
// MPI_Abort on MPI_COMM_WORLD (the launcher stops every rank) when MPI is live.
void mpi_abort(int status);

}  // namespace tessera::dist::detail
