// Paged-KV attention kernels for kernels_cupy (compiled at run time with NVRTC through cupy.RawModule).
//
// Compile-time configuration (passed as -D options by kernels_cupy/compile.py):
//   KV_BF16    1: tensors are bfloat16, 0: float16 (both stored as raw 16-bit words; fp32 accumulation)
//   HEAD_DIM   64 or 128 (elements per head)
//   BLOCK_SIZE tokens per KV-cache block (power of two not required)
//   GQA        query heads per KV head (1..8); query head h reads KV head h / GQA
//
// Layouts (elements, row-major):
//   k_cache, v_cache : [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
//   query / out      : [num_tokens, num_kv_heads * GQA, HEAD_DIM], token stride given, heads contiguous
//   block_tables     : [num_seqs, bt_stride] int32 physical block ids
//
// Sources followed: vLLM's PagedAttention v1/v2 kernels (csrc/attention/attention_kernels.cuh: one CTA
// per (head, sequence, partition), logits in shared memory, partition reduction kernel) and
// FlashAttention-2's online softmax (Dao 2023, arXiv:2307.08691) for the prefill kernel.
// No headers are included: 16-bit conversions use PTX cvt (sm_80+), so NVRTC needs no include path.
// CUDA_EMU: the same source also builds as C++ for the CPU emulator (kernels_cupy/cuda_emu.h, tests only).

#ifndef KV_BF16
#error "KV_BF16 must be defined (0 or 1)"
#endif
#ifndef HEAD_DIM
#error "HEAD_DIM must be defined"
#endif
#ifndef BLOCK_SIZE
#error "BLOCK_SIZE must be defined"
#endif
#ifndef GQA
#error "GQA must be defined"
#endif

typedef unsigned short raw16;

#ifndef DYNAMIC_SMEM
#define DYNAMIC_SMEM(type, name) extern __shared__ type name[]
#endif

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
#define VEC 8  // 16-bit elements per 16-byte vector

#if KV_BF16
__device__ __forceinline__ float to_f32(raw16 x) { return __uint_as_float(((unsigned int)x) << 16); }
__device__ __forceinline__ raw16 from_f32(float f) {
#ifdef CUDA_EMU
  return emu_f32_to_bf16(f);
#else
  raw16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#endif
}
__device__ __forceinline__ float2 unpack2(unsigned int w) {
  return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}
#else
__device__ __forceinline__ float to_f32(raw16 x) {
#ifdef CUDA_EMU
  return emu_f16_to_f32(x);
#else
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#endif
}
__device__ __forceinline__ raw16 from_f32(float f) {
#ifdef CUDA_EMU
  return emu_f32_to_f16(f);
#else
  raw16 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#endif
}
__device__ __forceinline__ float2 unpack2(unsigned int w) {
  return make_float2(to_f32((raw16)(w & 0xffffu)), to_f32((raw16)(w >> 16)));
}
#endif

__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
  float2 a = unpack2(v.x), b = unpack2(v.y), c = unpack2(v.z), d = unpack2(v.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL_MASK, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(FULL_MASK, x, o);
  return x;
}

// ---------------------------------------------------------------------------------------------------------
// (a) write_kv: copy key/value rows [T, num_kv_heads, HEAD_DIM] into the paged cache at slot_mapping[t].
// grid = (T), block = 128. Slots < 0 are skipped. key/value rows: heads and dims contiguous, token stride
// given in elements (multiple of 8, 16-byte aligned base). One 16-byte vector per thread per step.
// ---------------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(128) write_kv(
    const raw16* __restrict__ key, long long key_stride,
    const raw16* __restrict__ value, long long value_stride,
    raw16* __restrict__ k_cache, raw16* __restrict__ v_cache,
    const long long* __restrict__ slot_mapping, int num_kv_heads) {
  const int t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const int nvec = num_kv_heads * (HEAD_DIM / VEC);
  const long long row = slot * (long long)num_kv_heads * HEAD_DIM;
  const raw16* kp = key + (long long)t * key_stride;
  const raw16* vp = value + (long long)t * value_stride;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const uint4 kx = *reinterpret_cast<const uint4*>(kp + i * VEC);
    const uint4 vx = *reinterpret_cast<const uint4*>(vp + i * VEC);
    *reinterpret_cast<uint4*>(k_cache + row + i * VEC) = kx;
    *reinterpret_cast<uint4*>(v_cache + row + i * VEC) = vx;
  }
}

// ---------------------------------------------------------------------------------------------------------
// (b) paged decode attention, one query token per sequence (PagedAttention v1/v2).
// grid = (num_kv_heads, num_seqs, num_parts), block = 32 * DECODE_WARPS, dynamic shared memory =
//   4 * (partition_size * GQA + DECODE_WARPS * GQA * HEAD_DIM) + 4 * (partition_size / BLOCK_SIZE + 1) bytes.
// Each CTA handles one KV head, all GQA query heads of that group (every K/V row is loaded once for the
// whole group) and one partition of partition_size tokens (a multiple of BLOCK_SIZE).
//   K phase: each key row is read by K_LPT lanes (two 16-byte vectors each); q (pre-scaled, fp32) lives in
//            registers; the dot products of the GQA heads are reduced with warp shuffles; logits -> smem.
//   softmax: max and exp-sum over the partition per head (block reductions).
//   V phase: each value row is read by V_LPT lanes (one 16-byte vector each); probabilities from smem.
// num_parts == 1 (gridDim.z): the normalized result is written to out directly (v1). Otherwise the
// partition's normalized result goes to tmp_out [num_seqs, num_heads, num_parts, HEAD_DIM] fp32 with
// its max logit and exp-sum in max_logits / exp_sums [num_seqs, num_heads, num_parts], and
// paged_decode_reduce combines them (v2). Query row of sequence s is row s (decodes come first).
// ---------------------------------------------------------------------------------------------------------
#ifndef DECODE_WARPS
#define DECODE_WARPS 4  // tunable (kernels_cupy.compile.KernelConfig.decode_warps)
#endif
#ifndef K_UNROLL
#define K_UNROLL 4  // key rows in flight per lane (tunable)
#endif
#ifndef V_UNROLL
#define V_UNROLL 8  // value rows in flight per lane (tunable)
#endif
#define NUM_WARPS DECODE_WARPS
#define NUM_THREADS (NUM_WARPS * 32)
#define K_VECS 2
#define K_LPT (HEAD_DIM / (VEC * K_VECS))
#define K_TPW (32 / K_LPT)
#define V_LPT (HEAD_DIM / VEC)
#define V_TPW (32 / V_LPT)

extern "C" __global__ void __launch_bounds__(NUM_THREADS) paged_decode(
    raw16* __restrict__ out, long long out_stride,
    float* __restrict__ tmp_out, float* __restrict__ max_logits, float* __restrict__ exp_sums,
    const raw16* __restrict__ q, long long q_stride,
    const raw16* __restrict__ k_cache, const raw16* __restrict__ v_cache,
    const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ seq_lens,
    int num_kv_heads, float scale, int partition_size) {
  const int kvh = blockIdx.x, seq = blockIdx.y, part = blockIdx.z;
  const int num_parts = gridDim.z;
  const int seq_len = seq_lens[seq];
  const int start = part * partition_size;
  if (start >= seq_len) return;  // uniform over the CTA, before any barrier
  const int n = min(partition_size, seq_len - start);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int num_heads = num_kv_heads * GQA;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;  // elements between cache slots

  DYNAMIC_SMEM(float, smem);
  float* logits = smem;                                  // [partition_size][GQA]
  float* red = logits + partition_size * GQA;            // [NUM_WARPS][GQA][HEAD_DIM]
  int* bt = reinterpret_cast<int*>(red + NUM_WARPS * GQA * HEAD_DIM);  // [partition_size / BLOCK_SIZE]
  __shared__ float red_m[NUM_WARPS][GQA];
  __shared__ float red_s[NUM_WARPS][GQA];
  __shared__ float fin_m[GQA];
  __shared__ float fin_s[GQA];

  const int first_blk = start / BLOCK_SIZE;
  const int nblk = (n + BLOCK_SIZE - 1) / BLOCK_SIZE;
  for (int i = tid; i < nblk; i += NUM_THREADS)
    bt[i] = block_tables[(long long)seq * bt_stride + first_blk + i];

  // ---- K phase: q in registers (scaled), dims (k_lane + j*K_LPT)*VEC .. +VEC
  const int k_lane = lane % K_LPT, k_row = lane / K_LPT;
  float qf[GQA][K_VECS * VEC];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    const raw16* qp = q + (long long)seq * q_stride + (long long)(kvh * GQA + g) * HEAD_DIM;
#pragma unroll
    for (int j = 0; j < K_VECS; ++j) {
      float f[VEC];
      unpack8(*reinterpret_cast<const uint4*>(qp + (k_lane + j * K_LPT) * VEC), f);
#pragma unroll
      for (int e = 0; e < VEC; ++e) qf[g][j * VEC + e] = f[e] * scale;
    }
  }
  __syncthreads();  // bt ready

  const int K_STEP = NUM_WARPS * K_TPW;
  for (int base = warp * K_TPW; base < n; base += K_STEP * K_UNROLL) {  // warp-uniform loop
    uint4 kx[K_UNROLL][K_VECS];
#pragma unroll
    for (int u = 0; u < K_UNROLL; ++u) {
      const int t = base + u * K_STEP + k_row;
      if (t < n) {
        const long long slot = (long long)bt[t / BLOCK_SIZE] * BLOCK_SIZE + (t % BLOCK_SIZE);
        const raw16* kp = k_cache + slot * row_stride + (long long)kvh * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < K_VECS; ++j) kx[u][j] = *reinterpret_cast<const uint4*>(kp + (k_lane + j * K_LPT) * VEC);
      } else {
#pragma unroll
        for (int j = 0; j < K_VECS; ++j) kx[u][j] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < K_UNROLL; ++u) {
      float dot[GQA];
#pragma unroll
      for (int g = 0; g < GQA; ++g) dot[g] = 0.f;
#pragma unroll
      for (int j = 0; j < K_VECS; ++j) {
        float f[VEC];
        unpack8(kx[u][j], f);
#pragma unroll
        for (int g = 0; g < GQA; ++g)
#pragma unroll
          for (int e = 0; e < VEC; ++e) dot[g] = fmaf(qf[g][j * VEC + e], f[e], dot[g]);
      }
#pragma unroll
      for (int g = 0; g < GQA; ++g)
#pragma unroll
        for (int o = K_LPT / 2; o > 0; o >>= 1) dot[g] += __shfl_xor_sync(FULL_MASK, dot[g], o);
      const int t = base + u * K_STEP + k_row;
      if (k_lane == 0 && t < n) {
#pragma unroll
        for (int g = 0; g < GQA; ++g) logits[t * GQA + g] = dot[g];
      }
    }
  }
  __syncthreads();

  // ---- softmax over the partition, per query head
  float m[GQA], s[GQA];
#pragma unroll
  for (int g = 0; g < GQA; ++g) m[g] = NEG_INF;
  for (int t = tid; t < n; t += NUM_THREADS) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) m[g] = fmaxf(m[g], logits[t * GQA + g]);
  }
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    m[g] = warp_max(m[g]);
    if (lane == 0) red_m[warp][g] = m[g];
  }
  __syncthreads();
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    m[g] = red_m[0][g];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) m[g] = fmaxf(m[g], red_m[w][g]);
    s[g] = 0.f;
  }
  for (int t = tid; t < n; t += NUM_THREADS) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      const float e = __expf(logits[t * GQA + g] - m[g]);
      logits[t * GQA + g] = e;
      s[g] += e;
    }
  }
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    s[g] = warp_sum(s[g]);
    if (lane == 0) red_s[warp][g] = s[g];
  }
  __syncthreads();  // also publishes the exponentials in logits
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    s[g] = red_s[0][g];
#pragma unroll
    for (int w = 1; w < NUM_WARPS; ++w) s[g] += red_s[w][g];
  }
  if (tid == 0) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      fin_m[g] = m[g];
      fin_s[g] = s[g];
    }
  }

  // ---- V phase
  const int v_lane = lane % V_LPT, v_row = lane / V_LPT;
  float acc[GQA][VEC];
#pragma unroll
  for (int g = 0; g < GQA; ++g)
#pragma unroll
    for (int e = 0; e < VEC; ++e) acc[g][e] = 0.f;
  const int V_STEP = NUM_WARPS * V_TPW;
  for (int base = warp * V_TPW; base < n; base += V_STEP * V_UNROLL) {
    uint4 vx[V_UNROLL];
#pragma unroll
    for (int u = 0; u < V_UNROLL; ++u) {
      const int t = base + u * V_STEP + v_row;
      if (t < n) {
        const long long slot = (long long)bt[t / BLOCK_SIZE] * BLOCK_SIZE + (t % BLOCK_SIZE);
        vx[u] = *reinterpret_cast<const uint4*>(v_cache + slot * row_stride + (long long)kvh * HEAD_DIM + v_lane * VEC);
      } else {
        vx[u] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < V_UNROLL; ++u) {
      const int t = base + u * V_STEP + v_row;
      if (t < n) {
        float f[VEC];
        unpack8(vx[u], f);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
          const float p = logits[t * GQA + g];
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc[g][e] = fmaf(p, f[e], acc[g][e]);
        }
      }
    }
  }
  // lanes with the same v_lane hold partial sums over different rows
#pragma unroll
  for (int o = 16; o >= V_LPT; o >>= 1)
#pragma unroll
    for (int g = 0; g < GQA; ++g)
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[g][e] += __shfl_xor_sync(FULL_MASK, acc[g][e], o);
  if (v_row == 0) {
#pragma unroll
    for (int g = 0; g < GQA; ++g)
#pragma unroll
      for (int e = 0; e < VEC; ++e) red[(warp * GQA + g) * HEAD_DIM + v_lane * VEC + e] = acc[g][e];
  }
  __syncthreads();

  for (int i = tid; i < GQA * HEAD_DIM; i += NUM_THREADS) {
    const int g = i / HEAD_DIM, d = i % HEAD_DIM;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < NUM_WARPS; ++w) a += red[(w * GQA + g) * HEAD_DIM + d];
    const float o = __fdividef(a, fin_s[g]);
    const int head = kvh * GQA + g;
    if (num_parts == 1) {
      out[(long long)seq * out_stride + (long long)head * HEAD_DIM + d] = from_f32(o);
    } else {
      const long long idx = ((long long)seq * num_heads + head) * num_parts + part;
      tmp_out[idx * HEAD_DIM + d] = o;
      if (d == 0) {
        max_logits[idx] = fin_m[g];
        exp_sums[idx] = fin_s[g];
      }
    }
  }
}

// Combines the partitions of paged_decode (PagedAttention v2 reduce).
// grid = (num_heads, num_seqs), block = 128, dynamic shared memory = 4 * num_parts bytes.
extern "C" __global__ void __launch_bounds__(128) paged_decode_reduce(
    raw16* __restrict__ out, long long out_stride,
    const float* __restrict__ tmp_out, const float* __restrict__ max_logits,
    const float* __restrict__ exp_sums, const int* __restrict__ seq_lens,
    int num_parts, int partition_size) {
  const int head = blockIdx.x, seq = blockIdx.y, num_heads = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int n_parts = (seq_lens[seq] + partition_size - 1) / partition_size;
  DYNAMIC_SMEM(float, w);  // [num_parts]
  __shared__ float red_m[4], red_s[4];
  const long long base = ((long long)seq * num_heads + head) * num_parts;

  float m = NEG_INF;
  for (int p = tid; p < n_parts; p += 128) m = fmaxf(m, max_logits[base + p]);
  m = warp_max(m);
  if (lane == 0) red_m[warp] = m;
  __syncthreads();
  m = fmaxf(fmaxf(red_m[0], red_m[1]), fmaxf(red_m[2], red_m[3]));
  float s = 0.f;
  for (int p = tid; p < n_parts; p += 128) {
    const float x = exp_sums[base + p] * __expf(max_logits[base + p] - m);
    w[p] = x;
    s += x;
  }
  s = warp_sum(s);
  if (lane == 0) red_s[warp] = s;
  __syncthreads();
  s = red_s[0] + red_s[1] + red_s[2] + red_s[3];
  const float inv = __fdividef(1.f, s);
  for (int d = tid; d < HEAD_DIM; d += 128) {
    float a = 0.f;
    for (int p = 0; p < n_parts; ++p) a = fmaf(w[p], tmp_out[(base + p) * HEAD_DIM + d], a);
    out[(long long)seq * out_stride + (long long)head * HEAD_DIM + d] = from_f32(a * inv);
  }
}

// ---------------------------------------------------------------------------------------------------------
// (c) prefill attention over the paged cache (FlashAttention-2 style online softmax).
// grid = (num_tiles, num_kv_heads), block = PF_WARPS * 32. tiles: [num_tiles, 2] int32 = (sequence index,
// first query row); a tile holds up to PF_WARPS consecutive query rows of one sequence, one per warp, all
// GQA heads of the KV head. Query row r of sequence s (rows query_start_loc[s] .. query_start_loc[s+1]-1)
// attends causally to keys [0, seq_lens[s] - (query_start_loc[s+1] - 1 - r)), i.e. the cached context plus
// the new tokens up to itself (their K/V must already be in the cache). Key tiles of PF_KT rows are staged
// in shared memory once per CTA and shared by its warps; in a warp lane j scores key j of the tile.
// ---------------------------------------------------------------------------------------------------------
#define PF_WARPS 4
#define PF_KT 32
#define KROW (HEAD_DIM + 8)   // padded row: conflict-free 16-byte reads of different rows
#define PF_DPL (HEAD_DIM / 32)

extern "C" __global__ void __launch_bounds__(PF_WARPS * 32) paged_prefill(
    raw16* __restrict__ out, long long out_stride,
    const raw16* __restrict__ q, long long q_stride,
    const raw16* __restrict__ k_cache, const raw16* __restrict__ v_cache,
    const int* __restrict__ block_tables, int bt_stride,
    const int* __restrict__ seq_lens, const int* __restrict__ query_start_loc,
    const int* __restrict__ tiles, int num_kv_heads, float scale) {
  const int kvh = blockIdx.y;
  const int seq = tiles[2 * blockIdx.x], q0 = tiles[2 * blockIdx.x + 1];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int q_end = query_start_loc[seq + 1];
  const int seq_len = seq_lens[seq];
  const int nq = min(PF_WARPS, q_end - q0);
  const int L_max = seq_len - (q_end - q0 - nq);  // keys of the tile's last row
  const bool active = warp < nq;
  const int my_row = q0 + warp;
  const int my_L = active ? seq_len - (q_end - 1 - my_row) : 0;
  const long long row_stride = (long long)num_kv_heads * HEAD_DIM;

  __shared__ __align__(16) raw16 ks[PF_KT][KROW];
  __shared__ __align__(16) raw16 vs[PF_KT][HEAD_DIM];
  __shared__ __align__(16) float qs[PF_WARPS][GQA][HEAD_DIM];
  __shared__ float ps[PF_WARPS][PF_KT][GQA];

  if (active) {
    for (int i = lane; i < GQA * HEAD_DIM; i += 32) {
      const int g = i / HEAD_DIM, d = i % HEAD_DIM;
      qs[warp][g][d] = to_f32(q[(long long)my_row * q_stride + (long long)(kvh * GQA + g) * HEAD_DIM + d]) * scale;
    }
  }
  float m[GQA], l[GQA], acc[GQA][PF_DPL];
#pragma unroll
  for (int g = 0; g < GQA; ++g) {
    m[g] = NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < PF_DPL; ++e) acc[g][e] = 0.f;
  }

  for (int kt0 = 0; kt0 < L_max; kt0 += PF_KT) {
    __syncthreads();  // previous tile consumed (first iteration: qs visible)
    for (int i = tid; i < PF_KT * (HEAD_DIM / VEC); i += PF_WARPS * 32) {
      const int r = i / (HEAD_DIM / VEC), c = i % (HEAD_DIM / VEC);
      const int key = kt0 + r;
      uint4 kx = make_uint4(0u, 0u, 0u, 0u), vx = make_uint4(0u, 0u, 0u, 0u);
      if (key < L_max) {
        const long long slot = (long long)block_tables[(long long)seq * bt_stride + key / BLOCK_SIZE] * BLOCK_SIZE + (key % BLOCK_SIZE);
        const long long off = slot * row_stride + (long long)kvh * HEAD_DIM + c * VEC;
        kx = *reinterpret_cast<const uint4*>(k_cache + off);
        vx = *reinterpret_cast<const uint4*>(v_cache + off);
      }
      *reinterpret_cast<uint4*>(&ks[r][c * VEC]) = kx;
      *reinterpret_cast<uint4*>(&vs[r][c * VEC]) = vx;
    }
    __syncthreads();
    if (active && kt0 < my_L) {  // warp-uniform
      float sc[GQA];
#pragma unroll
      for (int g = 0; g < GQA; ++g) sc[g] = 0.f;
#pragma unroll 4
      for (int c = 0; c < HEAD_DIM / VEC; ++c) {
        float f[VEC];
        unpack8(*reinterpret_cast<const uint4*>(&ks[lane][c * VEC]), f);
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
          const float4 qa = *reinterpret_cast<const float4*>(&qs[warp][g][c * VEC]);
          const float4 qb = *reinterpret_cast<const float4*>(&qs[warp][g][c * VEC + 4]);
          sc[g] += qa.x * f[0] + qa.y * f[1] + qa.z * f[2] + qa.w * f[3]
                 + qb.x * f[4] + qb.y * f[5] + qb.z * f[6] + qb.w * f[7];
        }
      }
      const bool valid = kt0 + lane < my_L;
#pragma unroll
      for (int g = 0; g < GQA; ++g) {
        const float x = valid ? sc[g] : NEG_INF;
        const float m_new = fmaxf(m[g], warp_max(x));  // finite: key kt0 is valid
        const float p = valid ? __expf(x - m_new) : 0.f;
        const float corr = __expf(m[g] - m_new);       // 0 on the first tile (m = -inf)
        l[g] = l[g] * corr + warp_sum(p);
#pragma unroll
        for (int e = 0; e < PF_DPL; ++e) acc[g][e] *= corr;
        m[g] = m_new;
        ps[warp][lane][g] = p;
      }
      __syncwarp();
      const int nk = min(PF_KT, my_L - kt0);
      for (int j = 0; j < nk; ++j) {
        float f[PF_DPL];
#if PF_DPL == 4
        const uint2 w2 = *reinterpret_cast<const uint2*>(&vs[j][lane * 4]);
        const float2 a = unpack2(w2.x), b = unpack2(w2.y);
        f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
#else
        const float2 a = unpack2(*reinterpret_cast<const unsigned int*>(&vs[j][lane * 2]));
        f[0] = a.x; f[1] = a.y;
#endif
#pragma unroll
        for (int g = 0; g < GQA; ++g) {
          const float p = ps[warp][j][g];
#pragma unroll
          for (int e = 0; e < PF_DPL; ++e) acc[g][e] = fmaf(p, f[e], acc[g][e]);
        }
      }
      __syncwarp();
    }
  }
  if (active) {
#pragma unroll
    for (int g = 0; g < GQA; ++g) {
      const float inv = __fdividef(1.f, l[g]);
      raw16* op = out + (long long)my_row * out_stride + (long long)(kvh * GQA + g) * HEAD_DIM + lane * PF_DPL;
#pragma unroll
      for (int e = 0; e < PF_DPL; ++e) op[e] = from_f32(acc[g][e] * inv);
    }
  }
}
