// CUDA kernels, one header per op family, all included here: the same ops, argument order and
// semantics as kernels/cpu/ops.h (read that file's comments for each op), on device pointers, with
// the stream last. Entries are templates over the storage type (float, __nv_bfloat16, __half;
// fp32 arithmetic inside). Each entry queues its work on `stream` and returns: results the host
// needs (losses, norms) are written to device memory, and nothing here waits for the GPU.
//
// Determinism: no floating-point atomics anywhere. Every sum runs in an order fixed by the shapes
// alone (never by timing or the number of SMs), so a run repeats bit for bit on the same GPU and
// build; results differ from the CPU's in the last bits where the summation order differs
// (docs/cuda.md lists which ops match the CPU order exactly).
//
// Scratch memory: kernels that need temporary room take it from memtrain::device_scratch(), one
// process-wide area, so calls on two different streams must not overlap in time.
#pragma once

#include "kernels/cuda/activation.h"
#include "kernels/cuda/adafactor.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/embedding.h"
#include "kernels/cuda/lora.h"
#include "kernels/cuda/matmul.h"
#include "kernels/cuda/muon.h"
#include "kernels/cuda/norm.h"
#include "kernels/cuda/optimizer.h"
#include "kernels/cuda/reduce.h"
#include "kernels/cuda/rope.h"
