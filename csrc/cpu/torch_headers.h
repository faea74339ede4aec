// The torch headers the CPU kernels include, precompiled once per SIMD capability (GCC's
// precompiled headers, https://gcc.gnu.org/onlinedocs/gcc/Precompiled-Headers.html) and
// included ahead of every csrc/cpu/*.cpp file (setup.py, precompile_headers): each file
// alone spends ~12 of its ~13 s parsing them. A precompiled header is the parser's state
// saved, so the kernels' code is what it is without it (checked: same instructions per
// function); where it cannot be used (another compiler, other flags) this file is read
// as plain text. Each .cpp still includes what it uses.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>
