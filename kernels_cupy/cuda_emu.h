// CPU emulator of the CUDA subset used by paged_attention.cu (tests only; see kernels_cupy/emu.py).
// One OS thread per CUDA thread of a block, blocks run one after another; __syncthreads / __syncwarp are
// std::barrier waits, warp shuffles exchange through a per-warp buffer between two barrier waits, and
// __shared__ variables are function statics (one block at a time). Only for checking index arithmetic,
// synchronisation structure and numerics of the real kernel source on machines without a GPU.
#pragma once
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#define CUDA_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(x)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct emu_dim3 { unsigned x, y, z; };
inline thread_local emu_dim3 threadIdx, blockIdx;
inline emu_dim3 blockDim, gridDim;
inline char* emu_dyn_smem = nullptr;
#define DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(emu_dyn_smem)

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
using std::max;
using std::min;

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return std::exp(x); }
inline float __fdividef(float a, float b) { return a / b; }

inline unsigned short emu_f32_to_bf16(float f) {
  unsigned u; std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
inline float emu_f16_to_f32(unsigned short x) { _Float16 h; std::memcpy(&h, &x, 2); return (float)h; }
inline unsigned short emu_f32_to_f16(float f) { _Float16 h = (_Float16)f; unsigned short x; std::memcpy(&x, &h, 2); return x; }

struct EmuSync {
  std::unique_ptr<std::barrier<>> block;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<uint64_t> xchg;  // [warps * 32]
};
inline EmuSync* emu_sync = nullptr;
inline thread_local int emu_tid = 0;

inline void __syncthreads() { emu_sync->block->arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_sync->warps[emu_tid / 32]->arrive_and_wait(); }
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int o) {
  const int w = emu_tid / 32, l = emu_tid % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu_sync->xchg[w * 32 + l] = bits;
  emu_sync->warps[w]->arrive_and_wait();
  bits = emu_sync->xchg[w * 32 + (l ^ o)];
  emu_sync->warps[w]->arrive_and_wait();
  T r;
  std::memcpy(&r, &bits, sizeof(T));
  return r;
}

// Runs body() as every thread of every block of the grid; threads persist across blocks.
inline void emu_run(unsigned gx, unsigned gy, unsigned gz, unsigned bx, long long smem, const std::function<void()>& body) {
  gridDim = {gx, gy, gz};
  blockDim = {bx, 1, 1};
  std::vector<char> dyn((size_t)smem + 16);
  emu_dyn_smem = dyn.data();
  EmuSync s;
  s.block = std::make_unique<std::barrier<>>((std::ptrdiff_t)bx);
  for (unsigned w = 0; w < (bx + 31) / 32; ++w) s.warps.push_back(std::make_unique<std::barrier<>>(32));
  s.xchg.assign(((bx + 31) / 32) * 32, 0);
  emu_sync = &s;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < bx; ++t) {
    ts.emplace_back([&, t] {
      emu_tid = (int)t;
      threadIdx = {t, 0, 0};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            body();
            s.block->arrive_and_wait();  // block done before the next reuses shared memory
          }
    });
  }
  for (auto& th : ts) th.join();
  emu_sync = nullptr;
}
