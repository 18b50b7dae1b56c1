// The communicator of the multi-process test binary (made once by dist_main.cpp's main()).
// GoogleTest bodies cannot take arguments, so tests reach it through this accessor; library
// code gets its communicator passed in (STYLE lesson 9).
#pragma once

#include "comm/communicator.h"

namespace memtrain::dist {

Communicator& comm();

// Fail-fast scenario (zero_test.cpp): rank 1 dies in the middle of data-parallel training.
int run_rank1_dies_in_training(Communicator& c);

}  // namespace memtrain::dist
