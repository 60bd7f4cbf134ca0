// Paged-KV attention for the CPU, one kernel for decode and prefill: every query row attends to the keys
// [0, len) of its sequence, K/V read in place from the block pool (no gather copy), float32 math, one
// (tile, KV-head range) per task over torch's intra-op thread pool, a tile being up to 4 consecutive rows
// of one sequence (a prefill chunk's; a decode row is a tile of one) that share each K/V row load. Built at first use by
// backend/cpu_kernels.py (torch cpp_extension).
//
// Batch invariance: a row's result depends only on its query, its sequence's K/V and its length. The
// same compiled function serves every row, keys are visited in position order (scores, then one max,
// one exp-sum and one P.V pass, all in key order), and the score buffers sit at 64-byte aligned,
// 16-float padded offsets, so the vectorized reductions split a row the same way whatever the task,
// the batch or the thread split (a decode query and the same query inside a prefill chunk get the
// same bits).
//
// Shapes: q [R, nh, hd] float32; k_cache / v_cache [num_blocks, block_size, nkv, hd] (float32 or
// bfloat16, contiguous); block_tables [B, W] int32; row_seq [R] int32 (row -> block-table row; absent:
// row r uses row r); row_lens [R] int32; out [R, nh, hd] in the cache dtype. Query head h reads KV head
// h / (nh / nkv) (grouped-query attention).
// Source followed: vLLM PagedAttention (Kwon et al. 2023) semantics; two-pass softmax.
#include <torch/extension.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// Row kernels in explicit AVX-512 (batch invariance): each element's arithmetic is one fixed instruction
// sequence and every reduction one fixed order, whatever the row's place in the batch. Auto-vectorized
// loops under -ffast-math were not: the compiler's runtime alias checks between the row's output pointer
// and the scratch buffers picked the vector or the scalar version of a loop per row, and the two round
// differently (add_rms_norm gave other bf16 bits for 3 of 44 rows than for the same rows alone).
#define HAVE_AVX512_ROWS 1
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec's expf, 16 lanes (what -ffast-math loops call)

inline __mmask16 lanes(int64_t left) { return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u); }
inline __m512 load_m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_m(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_m(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store_m(uint16_t* p, __m512 v, __mmask16 m) {  // round to nearest even, as f32_to_bf16
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

template <typename TD, typename TO>
void add_rms_norm_row(float* xr, const TD* dr, const float* w, TO* o, int64_t H, float eps) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = lanes(H - i);
    __m512 v = load_m(xr + i, m);
    if (dr) {
      v = _mm512_add_ps(v, load_m(dr + i, m));
      store_m(xr + i, v, m);
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += 16) {
    const __mmask16 m = lanes(H - i);
    store_m(o + i, _mm512_mul_ps(load_m(w + i, m), _mm512_mul_ps(load_m(xr + i, m), r)), m);
  }
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t I) {
  const __m512 lo = _mm512_set1_ps(-80.f), one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = lanes(I - i);
    const __m512 z = _mm512_max_ps(load_m(g + i, m), lo);
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(zero, z));
    store_m(o + i, _mm512_mul_ps(_mm512_div_ps(z, _mm512_add_ps(one, e)), load_m(u + i, m)), m);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// The same row kernels in explicit AVX2 + FMA (8 lanes): one instruction sequence per element and one
// reduction order per row, tails through a zero-padded 8-value buffer (AVX2 has no masked 16-bit loads).
// Their bits differ from the AVX-512 kernels' (8-lane partial sums, glibc's 8-lane expf), never between rows.
#define HAVE_AVX2_ROWS 1
extern "C" __m256 _ZGVdN8v_expf(__m256);  // glibc libmvec's expf, 8 lanes (AVX2)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {  // round to nearest even, as f32_to_bf16
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);  // r0..r7 in the low 128 bits
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// `left` (>= 1) values from p; lanes past them read as 0
template <typename T> inline __m256 load_n(const T* p, int64_t left) {
  if (left >= 8) return load8(p);
  T tmp[8] = {};
  std::memcpy(tmp, p, left * sizeof(T));
  return load8(tmp);
}
template <typename T> inline void store_n(T* p, __m256 v, int64_t left) {
  if (left >= 8) return store8(p, v);
  T tmp[8];
  store8(tmp, v);
  std::memcpy(p, tmp, left * sizeof(T));
}
// sum of the 8 lanes in one fixed order: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
__attribute__((noinline)) float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

template <typename TD, typename TO>
void add_rms_norm_row(float* xr, const TD* dr, const float* w, TO* o, int64_t H, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t i = 0; i < H; i += 8) {
    __m256 v = load_n(xr + i, H - i);
    if (dr) {
      v = _mm256_add_ps(v, load_n(dr + i, H - i));
      store_n(xr + i, v, H - i);
    }
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  const __m256 r = _mm256_set1_ps(1.f / std::sqrt(hsum8(acc) / static_cast<float>(H) + eps));
  for (int64_t i = 0; i < H; i += 8)
    store_n(o + i, _mm256_mul_ps(load_n(w + i, H - i), _mm256_mul_ps(load_n(xr + i, H - i), r)), H - i);
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t I) {
  const __m256 lo = _mm256_set1_ps(-80.f), one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < I; i += 8) {
    const __m256 z = _mm256_max_ps(load_n(g + i, I - i), lo);
    const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(zero, z));
    store_n(o + i, _mm256_mul_ps(_mm256_div_ps(z, _mm256_add_ps(one, e)), load_n(u + i, I - i)), I - i);
  }
}
#endif
#if defined(HAVE_AVX512_ROWS) || defined(HAVE_AVX2_ROWS)
#define HAVE_VECTOR_ROWS 1  // add_rms_norm_row, silu_mul_row, rope_row: explicit SIMD, batch invariant
#endif

template <typename T> inline void load_row(const T* src, float* dst, int64_t n);
template <> inline void load_row<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
template <> inline void load_row<uint16_t>(const uint16_t* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = bf16_to_f32(src[d]);
}

template <typename T> inline void store_row(const float* src, T* dst, int64_t n, float mul);
template <> inline void store_row<float>(const float* src, float* dst, int64_t n, float mul) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) dst[d] = src[d] * mul;
}
template <> inline void store_row<uint16_t>(const float* src, uint16_t* dst, int64_t n, float mul) {
  for (int64_t d = 0; d < n; ++d) dst[d] = f32_to_bf16(src[d] * mul);
}

// Token t's row at element offset `off` (`n` elements) of its record in a paged cache; also prefetches the
// same row one block ahead: blocks are scattered in the pool, so the hardware streamer stops at each
// block's end (30 layers x 32 seqs x 256 keys bf16: 17.1 -> 12.2 ms with whole-row prefetch, vs one line
// every 4 tokens; reading from DRAM was latency-bound without it).
template <typename T>
inline const T* paged_row(const T* cache, const int32_t* table, int64_t t, int64_t L, int64_t bs, int64_t rec,
                          int64_t off, int64_t n) {
  if (t + bs < L) {
    const char* nx = reinterpret_cast<const char*>(cache + (static_cast<int64_t>(table[t / bs + 1]) * bs + t % bs) * rec + off);
    for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(T)); b += 64) __builtin_prefetch(nx + b);
  }
  return cache + (static_cast<int64_t>(table[t / bs]) * bs + t % bs) * rec + off;
}

// In-place exp(s - max(s)) over L scores; returns their sum (scores are finite: built with -ffast-math,
// which gives the vectorized expf of libmvec).
inline float softmax_numerators(float* s, int64_t L) {
#ifdef HAVE_AVX512_ROWS
  const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
  __m512 mv = lowest;
  for (int64_t t = 0; t < L; t += 16) mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(lowest, lanes(L - t), s + t));
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 acc = _mm512_setzero_ps();
  for (int64_t t = 0; t < L; t += 16) {
    const __mmask16 m = lanes(L - t);
    const __m512 e = _mm512_maskz_mov_ps(m, _ZGVeN16v_expf(_mm512_sub_ps(_mm512_mask_loadu_ps(mx, m, s + t), mx)));
    _mm512_mask_storeu_ps(s + t, m, e);
    acc = _mm512_add_ps(acc, e);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(HAVE_AVX2_ROWS)
  const __m256 lowest = _mm256_set1_ps(-FLT_MAX);
  __m256 mv = lowest;
  for (int64_t t = 0; t + 8 <= L; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  float m = -FLT_MAX;
  {
    alignas(32) float lane[8];
    _mm256_store_ps(lane, mv);
    for (int i = 0; i < 8; ++i) m = std::max(m, lane[i]);  // max is exact in any order
    for (int64_t t = L & ~static_cast<int64_t>(7); t < L; ++t) m = std::max(m, s[t]);
  }
  const __m256 mx = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t t = 0; t < L; t += 8) {
    const int64_t left = L - t;
    if (left >= 8) {
      const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + t), mx));
      _mm256_storeu_ps(s + t, e);
      acc = _mm256_add_ps(acc, e);
    } else {  // tail lanes: exp(max - max) computed, then zeroed before the sum
      alignas(32) float tmp[8];
      for (int i = 0; i < 8; ++i) tmp[i] = i < left ? s[t + i] : m;
      const __m256 keep = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_ps(static_cast<float>(left)), _CMP_LT_OQ);
      const __m256 e = _mm256_and_ps(keep, _ZGVdN8v_expf(_mm256_sub_ps(_mm256_load_ps(tmp), mx)));
      _mm256_store_ps(tmp, e);
      std::memcpy(s + t, tmp, left * sizeof(float));
      acc = _mm256_add_ps(acc, e);
    }
  }
  return hsum8(acc);
#else
  float m = -FLT_MAX;
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < L; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < L; ++t) {
    s[t] = expf(s[t] - m);
    sum += s[t];
  }
  return sum;
#endif
}

// One task = one sequence and a contiguous range of its KV heads [h0, h1). With all heads in one
// task, each token's K (then V) record of nkv * hd values is read front to back, and a block of
// block_size tokens is one contiguous run of memory: DRAM-streaming friendly. (Per-head tasks read
// 128 of every 384 bytes and measured 3 GB/s from DRAM; see docs/perf.md.)
// HD > 0: head_dim known at compile time (constant trip counts: fully vectorized inner loops).
// A 64-byte aligned scratch of n floats from buf (the same alignment for every call: see the top).
inline float* aligned_scratch(std::vector<float>& buf, int64_t n) {
  buf.resize(n + 16);
  const uintptr_t a = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<float*>((a + 63) & ~static_cast<uintptr_t>(63));
}

inline int64_t pad16(int64_t n) { return (n + 15) & ~static_cast<int64_t>(15); }

template <typename T, int HD>
void decode_seq(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t L, T* out, int64_t nh,
                int64_t nkv, int64_t hd_rt, int64_t bs, int64_t h0, int64_t h1, float scale, std::vector<float>& buf) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  const int64_t g = nh / nkv, rows = (h1 - h0) * g, rec = nkv * hd, hdp = pad16(hd), Lp = pad16(L);
  float* qs = aligned_scratch(buf, rows * hdp * 2 + hdp + rows * Lp + rows);  // [rows, hdp] scaled queries
  float* acc = qs + rows * hdp;         // [rows, hdp]
  float* row = acc + rows * hdp;        // [hdp]
  float* scores = row + hdp;            // [rows, Lp]
  float* denom = scores + rows * Lp;    // [rows]
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < hd; ++d) qs[r * hdp + d] = q[(h0 * g + r) * hd + d] * scale;
  for (int64_t t = 0; t < L; ++t) {
    const T* krec = paged_row<T>(kc, table, t, L, bs, rec, 0, rec);
    for (int64_t h = h0; h < h1; ++h) {
      load_row<T>(krec + h * hd, row, hd);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = (h - h0) * g + j;
        const float* qj = qs + r * hdp;
        float sc = 0.f;
#pragma omp simd reduction(+ : sc)
        for (int64_t d = 0; d < hd; ++d) sc += qj[d] * row[d];
        scores[r * Lp + t] = sc;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) denom[r] = softmax_numerators(scores + r * Lp, L);
  std::fill(acc, acc + rows * hdp, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const T* vrec = paged_row<T>(vc, table, t, L, bs, rec, 0, rec);
    for (int64_t h = h0; h < h1; ++h) {
      load_row<T>(vrec + h * hd, row, hd);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = (h - h0) * g + j;
        const float p = scores[r * Lp + t];
        float* ar = acc + r * hdp;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ar[d] += p * row[d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row<T>(acc + r * hdp, out + (h0 * g + r) * hd, hd, 1.f / denom[r]);
}

//: query positions per tile of attend_tile_avx512 (one sequence's consecutive prefill rows share K/V loads)
constexpr int TILE_POSITIONS = 4;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// The 16 lane sums of 16 vectors in one fixed order: out[i] = the sum of part[16 i .. 16 i + 15] (a 4-level
// shuffle/add tree over 128-bit, 64-bit and 32-bit halves, then one permute), 46 instructions for 16
// scores where one _mm512_reduce_add_ps per score took 8. Not inlined: one compiled instance serves every
// row, so -ffast-math cannot reassociate it differently for a decode and for a prefill tile.
__attribute__((noinline)) __m512 hsum16(const float* part) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {
    const __m512 x = _mm512_load_ps(part + 32 * i), y = _mm512_load_ps(part + 32 * i + 16);
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_unpacklo_ps(b[2 * i], b[2 * i + 1]), _mm512_unpackhi_ps(b[2 * i], b[2 * i + 1]));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 2, 3, 2)));
  // d[4k + m] holds vector 4m + k's sum
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), d);
}

// P.V for NP query positions (NP * G rows) of one KV head, accumulators in registers: row r adds p[r][t] v[t]
// for its own t < len only, in key order (the same FMA chain whatever NP or the tile).
template <typename T, int G, int NP>
inline void pv_rows(const T* vc, const int32_t* table, int64_t Lmax, const int32_t* lens, const float* scores, int64_t Lp,
                    const float* inv, T* out, int64_t nh, int64_t rec, int64_t bs, int64_t h) {
  constexpr int HD = 64;
  __m512 acc[NP * G][4];
  for (int r = 0; r < NP * G; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < Lmax; ++t) {
    const T* vp = paged_row<T>(vc, table, t, Lmax, bs, rec, h * HD, HD);
    const __m512 v0 = load16(vp), v1 = load16(vp + 16), v2 = load16(vp + 32), v3 = load16(vp + 48);
    for (int i = 0; i < NP; ++i) {
      if (t >= lens[i]) continue;
      for (int j = 0; j < G; ++j) {
        const int r = i * G + j;
        const __m512 p = _mm512_set1_ps(scores[r * Lp + t]);
        acc[r][0] = _mm512_fmadd_ps(p, v0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(p, v1, acc[r][1]);
        acc[r][2] = _mm512_fmadd_ps(p, v2, acc[r][2]);
        acc[r][3] = _mm512_fmadd_ps(p, v3, acc[r][3]);
      }
    }
  }
  for (int i = 0; i < NP; ++i)
    for (int j = 0; j < G; ++j) {
      const int r = i * G + j;
      alignas(64) float tmp[HD];
      for (int c = 0; c < 4; ++c) _mm512_store_ps(tmp + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r])));
      store_row<T>(tmp, out + (i * nh + h * G + j) * HD, HD, 1.f);
    }
}

// AVX-512 attention for head_dim 64 over a tile of nq <= TILE_POSITIONS query positions of one sequence
// (q/out rows [nq, nh, 64], position i attends to keys [0, lens[i])), KV heads [h0, h1). Per KV head: each
// key's K row is loaded once for the tile's nq * G query rows; a row's score for key t is the 4-FMA dot of
// its scaled query with k_t, lane-summed 16 keys at a time by hsum16; then softmax_numerators over its own
// len; then pv_rows. Every row's arithmetic is the same whatever nq, the other rows or the split (batch
// invariance: a decode is the nq = 1 tile).
template <typename T, int G>
void attend_tile_avx512(const float* q, const T* kc, const T* vc, const int32_t* table, const int32_t* lens, int64_t nq,
                        T* out, int64_t nh, int64_t nkv, int64_t bs, int64_t h0, int64_t h1, float scale,
                        std::vector<float>& buf) {
  constexpr int HD = 64;
  const int64_t rec = nkv * HD, R = nq * G;
  int64_t Lmax = 0;
  for (int64_t i = 0; i < nq; ++i) Lmax = std::max<int64_t>(Lmax, lens[i]);
  const int64_t Lp = pad16(Lmax);
  float* scores = aligned_scratch(buf, R * Lp + R * 256 + R * HD + R);  // [R, Lp]
  float* part = scores + R * Lp;                                         // [R, 16 keys, 16 lanes]
  float* qs = part + R * 256;                                            // [R, 64] scaled queries
  float* inv = qs + R * HD;                                              // [R]
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < nq; ++i)
      for (int j = 0; j < G; ++j)
        for (int c = 0; c < 4; ++c)
          _mm512_store_ps(qs + (i * G + j) * HD + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(q + (i * nh + h * G + j) * HD + 16 * c), sc));
    for (int64_t t0 = 0; t0 < Lmax; t0 += 16) {
      const int64_t n = std::min<int64_t>(16, Lmax - t0);
      for (int64_t tt = 0; tt < n; ++tt) {
        const T* kp = paged_row<T>(kc, table, t0 + tt, Lmax, bs, rec, h * HD, HD);
        const __m512 k0 = load16(kp), k1 = load16(kp + 16), k2 = load16(kp + 32), k3 = load16(kp + 48);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qs + r * HD;
          __m512 a = _mm512_mul_ps(_mm512_load_ps(qr), k0);
          a = _mm512_fmadd_ps(_mm512_load_ps(qr + 16), k1, a);
          a = _mm512_fmadd_ps(_mm512_load_ps(qr + 32), k2, a);
          a = _mm512_fmadd_ps(_mm512_load_ps(qr + 48), k3, a);
          _mm512_store_ps(part + r * 256 + tt * 16, a);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t tt = n; tt < 16; ++tt) _mm512_store_ps(part + r * 256 + tt * 16, _mm512_setzero_ps());
        _mm512_store_ps(scores + r * Lp + t0, hsum16(part + r * 256));
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int j = 0; j < G; ++j) inv[i * G + j] = 1.f / softmax_numerators(scores + (i * G + j) * Lp, lens[i]);
    int64_t i = 0;
    for (; i + 2 <= nq; i += 2)
      pv_rows<T, G, 2>(vc, table, Lmax, lens + i, scores + i * G * Lp, Lp, inv + i * G, out + i * nh * HD, nh, rec, bs, h);
    if (i < nq) pv_rows<T, G, 1>(vc, table, Lmax, lens + i, scores + i * G * Lp, Lp, inv + i * G, out + i * nh * HD, nh, rec, bs, h);
  }
}
#define HAVE_AVX512_DECODE 1
#elif defined(HAVE_AVX2_ROWS)
// The 8 lane sums of 8 vectors in one fixed order: out[i] = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7))
// over part[8 i .. 8 i + 7] (two levels of hadd, one 128-bit swap and add). Not inlined: one compiled
// instance serves every row (as hsum16 on AVX-512).
__attribute__((noinline)) __m256 hsum8x8(const float* part) {
  __m256 v[8];
  for (int i = 0; i < 8; ++i) v[i] = _mm256_load_ps(part + 8 * i);
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // u0 = [s0..s3 over lanes 0-3, s0..s3 over lanes 4-7], u1 the same for vectors 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// AVX2 attention for head_dim 64 over a tile of nq <= TILE_POSITIONS query positions of one sequence, any
// group size G = nh / nkv, KV heads [h0, h1): attend_tile_avx512's plan in 8 lanes. Per KV head each key's K
// row is loaded once for the tile's nq * G rows; a row's score for key t is the 8-FMA dot of its scaled
// query with k_t, lane-summed 8 keys at a time by hsum8x8; softmax_numerators over its own len; P.V in key
// order into a per-row accumulator in L1. A row's arithmetic does not depend on nq, the other rows or the split.
template <typename T>
void attend_tile_avx2(const float* q, const T* kc, const T* vc, const int32_t* table, const int32_t* lens, int64_t nq,
                      T* out, int64_t nh, int64_t nkv, int64_t bs, int64_t h0, int64_t h1, float scale,
                      std::vector<float>& buf) {
  constexpr int HD = 64;
  const int64_t G = nh / nkv, rec = nkv * HD, R = nq * G;
  int64_t Lmax = 0;
  for (int64_t i = 0; i < nq; ++i) Lmax = std::max<int64_t>(Lmax, lens[i]);
  const int64_t Lp = pad16(Lmax);
  float* scores = aligned_scratch(buf, R * Lp + R * 64 + 2 * R * HD + R);  // [R, Lp]
  float* part = scores + R * Lp;                                            // [R, 8 keys, 8 lanes]
  float* qs = part + R * 64;                                                // [R, 64] scaled queries
  float* acc = qs + R * HD;                                                 // [R, 64] P.V sums
  float* inv = acc + R * HD;                                                // [R]
  const __m256 sc = _mm256_set1_ps(scale);
  for (int64_t h = h0; h < h1; ++h) {
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < G; ++j)
        for (int c = 0; c < 8; ++c)
          _mm256_store_ps(qs + (i * G + j) * HD + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(q + (i * nh + h * G + j) * HD + 8 * c), sc));
    for (int64_t t0 = 0; t0 < Lmax; t0 += 8) {
      const int64_t n = std::min<int64_t>(8, Lmax - t0);
      for (int64_t tt = 0; tt < n; ++tt) {
        const T* kp = paged_row<T>(kc, table, t0 + tt, Lmax, bs, rec, h * HD, HD);
        __m256 k[8];
        for (int c = 0; c < 8; ++c) k[c] = load8(kp + 8 * c);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qs + r * HD;
          __m256 a = _mm256_mul_ps(_mm256_load_ps(qr), k[0]);
          for (int c = 1; c < 8; ++c) a = _mm256_fmadd_ps(_mm256_load_ps(qr + 8 * c), k[c], a);
          _mm256_store_ps(part + r * 64 + tt * 8, a);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        for (int64_t tt = n; tt < 8; ++tt) _mm256_store_ps(part + r * 64 + tt * 8, _mm256_setzero_ps());
        _mm256_store_ps(scores + r * Lp + t0, hsum8x8(part + r * 64));
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < G; ++j) inv[i * G + j] = 1.f / softmax_numerators(scores + (i * G + j) * Lp, lens[i]);
    std::fill(acc, acc + R * HD, 0.f);
    for (int64_t t = 0; t < Lmax; ++t) {
      const T* vp = paged_row<T>(vc, table, t, Lmax, bs, rec, h * HD, HD);
      __m256 v[8];
      for (int c = 0; c < 8; ++c) v[c] = load8(vp + 8 * c);
      for (int64_t i = 0; i < nq; ++i) {
        if (t >= lens[i]) continue;
        for (int64_t j = 0; j < G; ++j) {
          const int64_t r = i * G + j;
          const __m256 p = _mm256_set1_ps(scores[r * Lp + t]);
          float* ar = acc + r * HD;
          for (int c = 0; c < 8; ++c) _mm256_store_ps(ar + 8 * c, _mm256_fmadd_ps(p, v[c], _mm256_load_ps(ar + 8 * c)));
        }
      }
    }
    for (int64_t i = 0; i < nq; ++i)
      for (int64_t j = 0; j < G; ++j) {
        const int64_t r = i * G + j;
        alignas(32) float tmp[HD];
        const __m256 iv = _mm256_set1_ps(inv[r]);
        for (int c = 0; c < 8; ++c) _mm256_store_ps(tmp + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc + r * HD + 8 * c), iv));
        store_row<T>(tmp, out + (i * nh + h * G + j) * HD, HD, 1.f);
      }
  }
}
#define HAVE_AVX2_DECODE 1
#endif

template <typename T>
void decode_impl(const float* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* row_seq, const int32_t* lens,
                 T* out, int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t W, float scale) {
  const int64_t g = nh / nkv;
#ifdef HAVE_AVX512_DECODE
  const bool tiled = hd == 64 && (g == 1 || g == 3 || g == 4);
#elif defined(HAVE_AVX2_DECODE)
  const bool tiled = hd == 64;
#else
  const bool tiled = false;
#endif
  // tiles: runs of up to TILE_POSITIONS consecutive rows of one block-table row (a prefill chunk's rows;
  // each decode row is a tile of one)
  std::vector<int64_t> starts;
  for (int64_t r = 0; r < nd;) {
    starts.push_back(r);
    const int64_t b = row_seq ? row_seq[r] : r;
    int64_t e = r + 1;
    if (tiled)
      while (e < nd && e - r < TILE_POSITIONS && (row_seq ? row_seq[e] : e) == b) ++e;
    r = e;
  }
  starts.push_back(nd);
  const int64_t ntiles = static_cast<int64_t>(starts.size()) - 1;
  // few tiles: split their KV heads over the threads; many: one whole tile per task
  const int64_t split = ntiles < 2 * at::get_num_threads() ? nkv : 1;
  at::parallel_for(0, ntiles * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t tile = item / split, part = item % split;
      const int64_t r0 = starts[tile], nq = starts[tile + 1] - r0;
      const int64_t h0 = part * nkv / split, h1 = (part + 1) * nkv / split;
      const int32_t* table = bt + (row_seq ? static_cast<int64_t>(row_seq[r0]) : r0) * W;
      const float* qt = q + r0 * nh * hd;
      T* ot = out + r0 * nh * hd;
#ifdef HAVE_AVX512_DECODE
      if (tiled) {
        if (g == 3)
          attend_tile_avx512<T, 3>(qt, kc, vc, table, lens + r0, nq, ot, nh, nkv, bs, h0, h1, scale, buf);
        else if (g == 4)
          attend_tile_avx512<T, 4>(qt, kc, vc, table, lens + r0, nq, ot, nh, nkv, bs, h0, h1, scale, buf);
        else
          attend_tile_avx512<T, 1>(qt, kc, vc, table, lens + r0, nq, ot, nh, nkv, bs, h0, h1, scale, buf);
        continue;
      }
#elif defined(HAVE_AVX2_DECODE)
      if (tiled) {
        attend_tile_avx2<T>(qt, kc, vc, table, lens + r0, nq, ot, nh, nkv, bs, h0, h1, scale, buf);
        continue;
      }
#endif
      if (hd == 64)
        decode_seq<T, 64>(qt, kc, vc, table, lens[r0], ot, nh, nkv, hd, bs, h0, h1, scale, buf);
      else if (hd == 128)
        decode_seq<T, 128>(qt, kc, vc, table, lens[r0], ot, nh, nkv, hd, bs, h0, h1, scale, buf);
      else
        decode_seq<T, 0>(qt, kc, vc, table, lens[r0], ot, nh, nkv, hd, bs, h0, h1, scale, buf);
    }
  });
}

}  // namespace

// Query row r attends to the keys [0, row_lens[r]) of block-table row row_seq[r] (row r when row_seq is
// absent). Checks every shape, length and block id before any read (RuntimeError from TORCH_CHECK).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                              c10::optional<torch::Tensor> row_seq, torch::Tensor row_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                  row_lens.device().is_cpu() && (!row_seq.has_value() || row_seq->device().is_cpu()),
              "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous float32 [R, nh, hd]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache: contiguous [num_blocks, block_size, nkv, hd] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: contiguous int32 [B, W]");
  TORCH_CHECK(row_lens.scalar_type() == torch::kInt32 && row_lens.is_contiguous(), "row_lens: contiguous int32 [R]");
  const int64_t nd = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nblocks = k_cache.size(0), bs = k_cache.size(1), nkv = k_cache.size(2), W = block_tables.size(1);
  const int64_t B = block_tables.size(0);
  TORCH_CHECK(k_cache.size(3) == hd && nkv > 0 && nh % nkv == 0, "head_dim / head counts mismatch");
  TORCH_CHECK(row_lens.numel() >= nd, "fewer lengths than query rows");
  const int32_t* lens = row_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* rs = nullptr;
  if (row_seq.has_value()) {
    TORCH_CHECK(row_seq->scalar_type() == torch::kInt32 && row_seq->is_contiguous() && row_seq->numel() >= nd,
                "row_seq: contiguous int32 [R]");
    rs = row_seq->data_ptr<int32_t>();
  } else {
    TORCH_CHECK(B >= nd, "fewer block-table rows than queries");
  }
  std::vector<int32_t> longest(B, 0);  // per block-table row: the most keys any query reads
  for (int64_t r = 0; r < nd; ++r) {
    const int64_t b = rs ? rs[r] : r;
    TORCH_CHECK(b >= 0 && b < B, "row_seq outside the block table");
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= W * bs, "sequence length outside its block table");
    longest[b] = std::max(longest[b], lens[r]);
  }
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < (longest[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(bt[b * W + i] >= 0 && bt[b * W + i] < nblocks, "block id outside the pool");
  auto out = torch::empty({nd, nh, hd}, k_cache.options());
  pybind11::gil_scoped_release no_gil;  // the backend's socket reader/writer threads run meanwhile
  if (k_cache.scalar_type() == torch::kFloat32) {
    decode_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, rs, lens,
                       out.data_ptr<float>(), nd, nh, nkv, hd, bs, W, static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "cache dtype must be float32 or bfloat16");
    decode_impl<uint16_t>(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                          reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), bt, rs, lens,
                          reinterpret_cast<uint16_t*>(out.data_ptr()), nd, nh, nkv, hd, bs, W, static_cast<float>(scale));
  }
  return out;
}

// One query per sequence (row r: block-table row r, seq_lens[r] keys): paged_attention without row_seq.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: contiguous int32 [B]");
  TORCH_CHECK(q.dim() == 3 && seq_lens.numel() >= q.size(0), "fewer block-table rows / lengths than queries");
  return paged_attention(q, k_cache, v_cache, block_tables, c10::nullopt, seq_lens, scale);
}

// ---------------------------------------------------------------------------------------------
// Fused per-layer element-wise ops of the llama decoder (one call instead of 5-10 torch ops each;
// a decode step of a 135M model on 2 cores spends as much time dispatching small ops as in GEMMs).

namespace {

template <typename T> inline void store_vals(const float* src, T* dst, int64_t n);
template <> inline void store_vals<float>(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
template <> inline void store_vals<uint16_t>(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
}

bool is_bf16(const torch::Tensor& t) { return t.scalar_type() == torch::kBFloat16; }


template <typename T> const T* ptr(const torch::Tensor& t) { return reinterpret_cast<const T*>(t.data_ptr()); }
template <typename T> T* mptr(torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

template <typename TD, typename TO>
void add_rms_norm_impl(float* x, const TD* delta, const float* w, TO* out, int64_t T, int64_t H, float eps) {
  at::parallel_for(0, T, 16, [&](int64_t b, int64_t e) {
#ifdef HAVE_VECTOR_ROWS
    for (int64_t t = b; t < e; ++t) add_rms_norm_row<TD, TO>(x + t * H, delta ? delta + t * H : nullptr, w, out + t * H, H, eps);
    return;
#endif
    std::vector<float> tmp(H), y(H);
    for (int64_t t = b; t < e; ++t) {
      float* xr = x + t * H;
      if (delta) {
        load_row<TD>(delta + t * H, tmp.data(), H);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) xr[i] += tmp[i];
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float r = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) y[i] = w[i] * (xr[i] * r);
      store_vals<TO>(y.data(), out + t * H, H);
    }
  });
}

template <typename T>
void silu_mul_impl(const T* gu, T* out, int64_t N, int64_t I) {
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) {
#ifdef HAVE_VECTOR_ROWS
    for (int64_t t = b; t < e; ++t) silu_mul_row<T>(gu + t * 2 * I, gu + t * 2 * I + I, out + t * I, I);
    return;
#endif
    std::vector<float> g(I), u(I);
    for (int64_t t = b; t < e; ++t) {
      load_row<T>(gu + t * 2 * I, g.data(), I);
      load_row<T>(gu + t * 2 * I + I, u.data(), I);
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float z = g[i] < -80.f ? -80.f : g[i];
        g[i] = z / (1.f + expf(-z)) * u[i];
      }
      store_vals<T>(g.data(), out + t * I, I);
    }
  });
}

// rotate-half RoPE (HF llama): y[i] = x[i] cos[i] - x[i+h] sin[i], y[i+h] = x[i+h] cos[i+h] + x[i] sin[i+h]
inline void rope_row(const float* x, const float* c, const float* s, float* y, int64_t hd, int64_t rd) {
  const int64_t h = rd / 2;
#ifdef HAVE_AVX2_ROWS
  for (int64_t i = 0; i < h; i += 8) {
    const int64_t left = h - i;
    const __m256 a = load_n(x + i, left), b = load_n(x + i + h, left);
    store_n(y + i, _mm256_fnmadd_ps(b, load_n(s + i, left), _mm256_mul_ps(a, load_n(c + i, left))), left);
    store_n(y + i + h, _mm256_fmadd_ps(a, load_n(s + i + h, left), _mm256_mul_ps(b, load_n(c + i + h, left))), left);
  }
  for (int64_t i = rd; i < hd; ++i) y[i] = x[i];
  return;
#endif
#ifdef HAVE_AVX512_ROWS
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(h - i);
    const __m512 a = load_m(x + i, m), b = load_m(x + i + h, m);
    store_m(y + i, _mm512_fnmadd_ps(b, load_m(s + i, m), _mm512_mul_ps(a, load_m(c + i, m))), m);
    store_m(y + i + h, _mm512_fmadd_ps(a, load_m(s + i + h, m), _mm512_mul_ps(b, load_m(c + i + h, m))), m);
  }
  for (int64_t i = rd; i < hd; ++i) y[i] = x[i];
  return;
#endif
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * c[i] - x[i + h] * s[i];
    y[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
  }
  for (int64_t i = rd; i < hd; ++i) y[i] = x[i];
}

template <typename T>
void rope_write_impl(const T* qkv, const int64_t* pos, const float* cos, const float* sin, T* kc, T* vc,
                     const int64_t* slots, float* q_out, int64_t Tn, int64_t nh, int64_t nkv, int64_t hd, int64_t rd) {
  const int64_t width = (nh + 2 * nkv) * hd;
  at::parallel_for(0, Tn, 8, [&](int64_t b, int64_t e) {
    std::vector<float> x(hd), y(hd);
    for (int64_t t = b; t < e; ++t) {
      const T* row = qkv + t * width;
      const float* c = cos + pos[t] * rd;
      const float* s = sin + pos[t] * rd;
      for (int64_t h = 0; h < nh; ++h) {
        load_row<T>(row + h * hd, x.data(), hd);
        rope_row(x.data(), c, s, q_out + (t * nh + h) * hd, hd, rd);
      }
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      for (int64_t h = 0; h < nkv; ++h) {
        load_row<T>(row + (nh + h) * hd, x.data(), hd);
        rope_row(x.data(), c, s, y.data(), hd, rd);
        store_vals<T>(y.data(), kc + (slot * nkv + h) * hd, hd);
      }
      std::memcpy(vc + slot * nkv * hd, row + (nh + nkv) * hd, nkv * hd * sizeof(T));
    }
  });
}

}  // namespace

// x [T, H] float32 (updated in place: x += delta when delta is given); returns w * x / rms(x) in out_dtype.
torch::Tensor add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor w, double eps,
                           bool out_bf16) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!delta.has_value() || delta->device().is_cpu()),
              "add_rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x: contiguous float32 [T, H]");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == x.size(1), "w: float32 [H]");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty({T, H}, x.options().dtype(out_bf16 ? torch::kBFloat16 : torch::kFloat32));
  pybind11::gil_scoped_release no_gil;  // the backend's socket reader/writer threads run meanwhile
  const float e = static_cast<float>(eps);
  if (delta.has_value()) {
    const auto& d = *delta;
    TORCH_CHECK(d.sizes() == x.sizes() && d.is_contiguous() && (is_bf16(d) || d.scalar_type() == torch::kFloat32),
                "delta: contiguous [T, H] float32/bfloat16");
    if (is_bf16(d)) {
      if (out_bf16) add_rms_norm_impl<uint16_t, uint16_t>(x.data_ptr<float>(), ptr<uint16_t>(d), w.data_ptr<float>(), mptr<uint16_t>(out), T, H, e);
      else add_rms_norm_impl<uint16_t, float>(x.data_ptr<float>(), ptr<uint16_t>(d), w.data_ptr<float>(), out.data_ptr<float>(), T, H, e);
    } else {
      if (out_bf16) add_rms_norm_impl<float, uint16_t>(x.data_ptr<float>(), d.data_ptr<float>(), w.data_ptr<float>(), mptr<uint16_t>(out), T, H, e);
      else add_rms_norm_impl<float, float>(x.data_ptr<float>(), d.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), T, H, e);
    }
  } else {
    if (out_bf16) add_rms_norm_impl<float, uint16_t>(x.data_ptr<float>(), nullptr, w.data_ptr<float>(), mptr<uint16_t>(out), T, H, e);
    else add_rms_norm_impl<float, float>(x.data_ptr<float>(), nullptr, w.data_ptr<float>(), out.data_ptr<float>(), T, H, e);
  }
  return out;
}

// gu [N, 2I] (gate | up), float32 or bfloat16 -> silu(gate) * up, [N, I] same dtype.
torch::Tensor silu_mul(torch::Tensor gu) {
  TORCH_CHECK(gu.device().is_cpu(), "silu_mul: CPU tensors only");
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.is_contiguous() && (is_bf16(gu) || gu.scalar_type() == torch::kFloat32),
              "gu: contiguous [N, 2I] float32/bfloat16");
  const int64_t N = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({N, I}, gu.options());
  pybind11::gil_scoped_release no_gil;  // the backend's socket reader/writer threads run meanwhile
  if (is_bf16(gu)) silu_mul_impl<uint16_t>(ptr<uint16_t>(gu), mptr<uint16_t>(out), N, I);
  else silu_mul_impl<float>(gu.data_ptr<float>(), out.data_ptr<float>(), N, I);
  return out;
}

// qkv [T, (nh + 2 nkv) hd] (cache dtype); rotates q and k heads at positions [T] with cos/sin [P, rd]
// float32 tables, writes rotated k and v into the caches at slots [T] (slot < 0: skipped), returns
// rotated q [T, nh, hd] float32.
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.device().is_cpu() && positions.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu() && slots.device().is_cpu(),
              "rope_write_kv: CPU tensors only");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "k_cache/v_cache: contiguous [num_blocks, block_size, nkv, hd]");
  const int64_t hd = k_cache.size(3), nslots = k_cache.size(0) * k_cache.size(1), Tn = qkv.size(0), rd = cos.size(1);
  TORCH_CHECK(k_cache.size(2) == nkv && qkv.dim() == 2 && qkv.size(1) == (nh + 2 * nkv) * hd && qkv.is_contiguous() &&
                  qkv.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "qkv: contiguous [T, (nh + 2 nkv) hd] in the cache dtype");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == Tn && slots.scalar_type() == torch::kInt64 &&
                  slots.numel() == Tn && positions.is_contiguous() && slots.is_contiguous(), "positions/slots: int64 [T]");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.sizes() == cos.sizes() && cos.is_contiguous() && sin.is_contiguous() &&
                  rd % 2 == 0 && rd <= hd, "cos/sin: float32 [P, rope_dim]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tn; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0), "position outside the RoPE table");
    TORCH_CHECK(sl[t] < nslots, "slot outside the KV pool");
  }
  auto q = torch::empty({Tn, nh, hd}, qkv.options().dtype(torch::kFloat32));
  pybind11::gil_scoped_release no_gil;  // the backend's socket reader/writer threads run meanwhile
  if (is_bf16(qkv)) {
    rope_write_impl<uint16_t>(ptr<uint16_t>(qkv), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), mptr<uint16_t>(k_cache),
                              mptr<uint16_t>(v_cache), sl, q.data_ptr<float>(), Tn, nh, nkv, hd, rd);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kFloat32, "dtype must be float32 or bfloat16");
    rope_write_impl<float>(qkv.data_ptr<float>(), pos, cos.data_ptr<float>(), sin.data_ptr<float>(), k_cache.data_ptr<float>(),
                           v_cache.data_ptr<float>(), sl, q.data_ptr<float>(), Tn, nh, nkv, hd, rd);
  }
  return q;
}

// Grammar masks (backend/grammar.py): row rows[j] of logits keeps the tokens whose bit is set in bitmask[j]
// (bit t % 32 of word t / 32, llguidance's layout); every other logit becomes -inf. Words that allow all 32
// tokens are skipped, words that allow none are filled; in place, O(R * V) at most.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 &&
                  logits.stride(1) == 1, "logits: float32 [B, V], each row contiguous");
  TORCH_CHECK(bitmask.device().is_cpu() && bitmask.scalar_type() == torch::kInt32 && bitmask.dim() == 2 &&
                  bitmask.is_contiguous(), "bitmask: contiguous int32 [R, W]");
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == torch::kInt64 && rows.is_contiguous() &&
                  rows.numel() == bitmask.size(0), "rows: int64 [R]");
  const int64_t B = logits.size(0), V = logits.size(1), R = bitmask.size(0), W = bitmask.size(1);
  TORCH_CHECK(W * 32 >= V, "bitmask narrower than the vocabulary");
  const int64_t* rw = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < R; ++j) TORCH_CHECK(rw[j] >= 0 && rw[j] < B, "row outside the batch");
  float* lg = logits.data_ptr<float>();
  const int64_t ls = logits.stride(0);
  const uint32_t* bm = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const uint32_t ninf_bits = 0xFF800000u;  // -inf by its bits: -ffast-math assumes no infinities in arithmetic
  float ninf;
  std::memcpy(&ninf, &ninf_bits, sizeof(ninf));
  pybind11::gil_scoped_release no_gil;
  for (int64_t j = 0; j < R; ++j) {
    float* row = lg + rw[j] * ls;
    const uint32_t* m = bm + j * W;
    for (int64_t w = 0; w < W; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;
      const int64_t base = w * 32;
      const int64_t n = V - base < 32 ? V - base : 32;
      for (int64_t b = 0; b < n; ++b)
        if (!((bits >> b) & 1u)) row[base + b] = ninf;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// q4_gemm: y [M, N] = x [M, K] @ W.T for 4-bit (Q4_1-style: w = d*q + m, q in 0..15, one (d, m) per 32
// k) or 8-bit (w = s*(c - 128), c in 0..255, one s per output column) weights, row-invariant.
// The llama.cpp way (ggml's Q4_1 x Q8_1 dot, ggml_vec_dot_q4_1_q8_1): each row of x is quantized to
// int8 per 32-element group (d_x = max|x|/127, q_x = round(x * (127/max|x|)), s_x = d_x*sum(q_x), both
// divisions IEEE) from that row alone; per (row, group) the int32 dot of the codes (u8) with q_x (s8) is
// exact, then, in float32 and in group order, acc = fma(cvt(isum), d_w*d_x, acc); acc = fma(m_w, s_x, acc).
// The same compiled sequence serves every row whatever the row block, the batch or the thread split
// (threads split N only, never K), so a row's bits depend on that row alone; and every ISA computes the
// same integers and the same float sequence, so AVX2 and AVX-512 give the same bits (bf16 output: round to
// nearest even, denormals to signed zero, as VCVTNEPS2BF16).
// Integer dots: AVX-512 VNNI: VPDPBUSD. AVX2: VPMADDUBSW (u8 x s8 pairs -> s16, saturating) then VPMADDWD
// with ones; 4-bit codes cannot saturate (2 * 15 * 127 = 3,810; the 8 chunks of a group are summed in s16,
// at most 30,480, before one VPMADDWD); 8-bit codes can (2 * 255 * 127 > 32,767), so the AVX2 8-bit dot
// takes w8 = c - 128 (signed) as |w8| (u8) times sign(w8) * q_x (ggml's mul_sum_i8_pairs: 2 * 128 * 127 =
// 32,512) and adds back 128 * sum(q_x).
// Weight layout (wq, uint8): per 16-column block nb and group g, 4-bit: 4 x 64 bytes, vector v byte
// 4*col + j = code[col][32g + 8v + j] | code[col][32g + 8v + 4 + j] << 4; 8-bit: 8 x 64 bytes, vector c
// byte 4*col + j = code[col][32g + 4c + j]. Scales (ws, float32): [N/16, G, 2, 16] = (d_w, m_w). AVX2 runs
// a 16-column block as two 8-column halves (bytes [0, 32) and [32, 64) of each 64-byte vector).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#define Q4_AVX2 1
#endif

#if defined(Q4_AVX512) || defined(Q4_AVX2)
namespace {
// a / b rounded as IEEE division whatever the compiler flags (-ffast-math may turn x / 127 into x * (1/127))
inline float div_exact(float a, float b) {
  __m128 r = _mm_set_ss(a);
  asm("vdivss %1, %0, %0" : "+x"(r) : "x"(_mm_set_ss(b)));
  return _mm_cvtss_f32(r);
}

// software prefetch distance (bytes ahead in the weight stream): the hardware prefetcher alone left a
// decode step waiting on memory (2-core Xeon, bf16, 1 row: 4.8 -> 4.0 ms per step with it)
constexpr int64_t Q_PREFETCH = 4096;
}  // namespace
#endif

#if defined(Q4_AVX512)
namespace {
// rows per pass over a 16-column block (the accumulators of 8 rows, their int32 dots and the 8 unpacked
// weight vectors fit in the 32 zmm registers); a verify chunk of up to 8 rows reads each block once
constexpr int Q_ROWS = 8;

template <int BITS>
inline void q_unpack(const uint8_t* p, __m512i* w) {
  if constexpr (BITS == 4) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int v = 0; v < 4; ++v) {
      const __m512i b = _mm512_loadu_si512(p + 64 * v);
      w[2 * v] = _mm512_and_si512(b, lo);
      w[2 * v + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), lo);
    }
  } else {
    for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(p + 64 * c);
  }
}

// R rows (R <= Q_ROWS) x one 16-column block: out[r][0..16) in float32.
template <int R, int BITS>
inline void q_block(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                    const int32_t* /*qs*/, int64_t K, int64_t G, __m512* acc) {
  constexpr int64_t gbytes = BITS == 4 ? 256 : 512;
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t i = 0; i < gbytes; i += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wq + g * gbytes + Q_PREFETCH + i), _MM_HINT_T0);
    __m512i w[8];
    q_unpack<BITS>(wq + g * gbytes, w);
    __m512i is[R];
    for (int r = 0; r < R; ++r) is[r] = _mm512_setzero_si512();
    for (int c = 0; c < 8; ++c) {
      for (int r = 0; r < R; ++r) {
        int32_t xv;
        std::memcpy(&xv, qx + r * K + g * 32 + 4 * c, 4);
        is[r] = _mm512_dpbusd_epi32(is[r], w[c], _mm512_set1_epi32(xv));
      }
    }
    const __m512 dw = _mm512_loadu_ps(ws + g * 32), mw = _mm512_loadu_ps(ws + g * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dwdx = _mm512_mul_ps(dw, _mm512_set1_ps(dx[r * G + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r]), dwdx, acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[r * G + g]), acc[r]);
    }
  }
}

template <typename TO>
inline void q_store(TO* o, __m512 v) {
  if constexpr (std::is_same<TO, float>::value) {
    _mm512_storeu_ps(o, v);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
#else  // VCVTNEPS2BF16 by hand: denormals to signed zero, then round to nearest even
    const __m512i u = _mm512_castps_si512(v);
    const __mmask16 tiny = _mm512_cmplt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x00800000));
    const __m512i z = _mm512_mask_and_epi32(u, tiny, u, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(z, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(z, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(r));
#endif
  }
}

template <int R, int BITS, typename TO>
inline void q_rows(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                   const int32_t* qs, int64_t K, int64_t G, TO* out, int64_t N) {
  __m512 acc[R];
  q_block<R, BITS>(wq, ws, qx, dx, sx, qs, K, G, acc);
  for (int r = 0; r < R; ++r) q_store<TO>(out + r * N, acc[r]);
}

// one group of 32 values -> 32 codes at q, the code sum, max|v|
inline float q8_group(const float* v, int8_t* q, int32_t* sum) {
  const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const float id = amax > 0.0f ? div_exact(127.0f, amax) : 0.0f;
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
  const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtsepi32_epi8(qb));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  return amax;
}
}  // namespace
#elif defined(Q4_AVX2)
namespace {
// rows per pass over an 8-column half block: 4 rows' int16/int32 dots and float accumulators plus the
// weight and activation vectors fit in the 16 ymm registers
constexpr int Q_ROWS = 4;

inline __m256i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows (R <= Q_ROWS) x 8 columns (half h of a 16-column block): acc[r] in float32.
template <int R, int BITS>
inline void q_half(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                   const int32_t* qs, int64_t K, int64_t G, int h, __m256* acc) {
  constexpr int64_t gbytes = BITS == 4 ? 256 : 512;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* p = wq + g * gbytes + 32 * h;
    if (h == 0)
      for (int64_t i = 0; i < gbytes; i += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wq + g * gbytes + Q_PREFETCH + i), _MM_HINT_T0);
    __m256i is[R];
    if constexpr (BITS == 4) {
      const __m256i lo = _mm256_set1_epi8(0x0F);
      __m256i s16[R];
      for (int r = 0; r < R; ++r) s16[r] = _mm256_setzero_si256();
      for (int v = 0; v < 4; ++v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * v));
        const __m256i wl = _mm256_and_si256(b, lo), wh = _mm256_and_si256(_mm256_srli_epi16(b, 4), lo);
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = qx + r * K + g * 32 + 8 * v;
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wl, bcast4(xr)));
          s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(wh, bcast4(xr + 4)));
        }
      }
      for (int r = 0; r < R; ++r) is[r] = _mm256_madd_epi16(s16[r], ones);
    } else {
      const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
      for (int r = 0; r < R; ++r) is[r] = _mm256_set1_epi32(128 * qs[r * G + g]);
      for (int c = 0; c < 8; ++c) {
        const __m256i sw = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64 * c)), flip);
        const __m256i aw = _mm256_sign_epi8(sw, sw);  // |w8| as u8 (-128 -> 128)
        for (int r = 0; r < R; ++r) {
          const __m256i sxr = _mm256_sign_epi8(bcast4(qx + r * K + g * 32 + 4 * c), sw);
          is[r] = _mm256_add_epi32(is[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sxr), ones));
        }
      }
    }
    const __m256 dw = _mm256_loadu_ps(ws + g * 32 + 8 * h), mw = _mm256_loadu_ps(ws + g * 32 + 16 + 8 * h);
    for (int r = 0; r < R; ++r) {
      const __m256 dwdx = _mm256_mul_ps(dw, _mm256_set1_ps(dx[r * G + g]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is[r]), dwdx, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[r * G + g]), acc[r]);
    }
  }
}

template <typename TO>
inline void q_store(TO* o, __m256 v) {
  if constexpr (std::is_same<TO, float>::value) {
    _mm256_storeu_ps(o, v);
  } else {  // VCVTNEPS2BF16's rounding: denormals to signed zero, then round to nearest even
    const __m256i u = _mm256_castps_si256(v);
    const __m256i tiny = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x00800000), _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)));
    const __m256i z = _mm256_blendv_epi8(u, _mm256_and_si256(u, _mm256_set1_epi32(static_cast<int32_t>(0x80000000u))), tiny);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(z, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(z, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o), _mm256_castsi256_si128(packed));
  }
}

template <int R, int BITS, typename TO>
inline void q_rows(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                   const int32_t* qs, int64_t K, int64_t G, TO* out, int64_t N) {
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    q_half<R, BITS>(wq, ws, qx, dx, sx, qs, K, G, h, acc);
    for (int r = 0; r < R; ++r) q_store<TO>(out + r * N + 8 * h, acc[r]);
  }
}

// one group of 32 values -> 32 codes at q, the code sum, max|v| (the same values as the AVX-512 q8_group)
inline float q8_group(const float* v, int8_t* q, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 x[4];
  for (int c = 0; c < 4; ++c) x[c] = _mm256_loadu_ps(v + 8 * c);
  __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, x[0]), _mm256_andnot_ps(sign, x[1]));
  m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, x[2]), _mm256_andnot_ps(sign, x[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  const float id = amax > 0.0f ? div_exact(127.0f, amax) : 0.0f;
  __m256i qi[4];
  for (int c = 0; c < 4; ++c) qi[c] = _mm256_cvtps_epi32(_mm256_mul_ps(x[c], _mm256_set1_ps(id)));
  // saturating packs interleave 128-bit lanes: bytes [q0 0-3, q1 0-3, q2 0-3, q3 0-3 | q0 4-7, ...]
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  return amax;
}
}  // namespace
#endif

#if defined(Q4_AVX512) || defined(Q4_AVX2)
namespace {
// Row-local Q8_1 quantization of x [M, K] (bf16 or f32): qx [M, K] s8, dx / sx [M, G] f32, qs [M, G] code sums.
template <typename TI>
void q8_rows(const TI* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx, int32_t* qs) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      float v[32];
      const TI* xp = x + m * K + g * 32;
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(xp[i]);
      int32_t s;
      const float d = div_exact(q8_group(v, qx + m * K + g * 32, &s), 127.0f);
      dx[m * G + g] = d;
      sx[m * G + g] = d * static_cast<float>(s);
      qs[m * G + g] = s;
    }
  }
}

template <int BITS, typename TO>
void q_gemm_impl(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx, const int32_t* qs,
                 int64_t M, int64_t K, int64_t N, TO* out) {
  const int64_t G = K / 32, NB = N / 16;
  const int64_t wblock = G * (BITS == 4 ? 256 : 512);
  at::parallel_for(0, NB, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb) {
      const uint8_t* w = wq + nb * wblock;
      const float* s = ws + nb * G * 32;
      TO* o = out + nb * 16;
      int64_t m = 0;
      for (; m + Q_ROWS <= M; m += Q_ROWS)
        q_rows<Q_ROWS, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N);
      switch (M - m) {
#if defined(Q4_AVX512)
        case 7: q_rows<7, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        case 6: q_rows<6, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        case 5: q_rows<5, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        case 4: q_rows<4, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
#endif
        case 3: q_rows<3, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        case 2: q_rows<2, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        case 1: q_rows<1, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, qs + m * G, K, G, o + m * N, N); break;
        default: break;
      }
    }
  });
}

struct Q8Rows {  // x's row-local Q8_1 quantization (q8_rows)
  std::vector<int8_t> qx;
  std::vector<float> dx, sx;
  std::vector<int32_t> qs;
  Q8Rows(const torch::Tensor& x) : qx(x.size(0) * x.size(1)), dx(x.size(0) * (x.size(1) / 32)), sx(dx.size()), qs(dx.size()) {
    if (x.scalar_type() == torch::kBFloat16)
      q8_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), qx.data(), dx.data(), sx.data(), qs.data());
    else
      q8_rows(x.data_ptr<float>(), x.size(0), x.size(1), qx.data(), dx.data(), sx.data(), qs.data());
  }
};
}  // namespace
#endif

// The ISA the q4_gemm body was compiled for: "avx512" (VNNI dots), "avx2", or "" (none: q4_gemm raises).
std::string q4_gemm_isa() {
#if defined(Q4_AVX512)
  return "avx512";
#elif defined(Q4_AVX2)
  return "avx2";
#else
  return "";
#endif
}

bool q4_gemm_supported() { return !q4_gemm_isa().empty(); }

static void check_q_input(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x: contiguous bfloat16/float32 [M, K]");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32");
}

// x [M, K] -> (qx [M, K] int8, dx [M, K/32] float32, sx [M, K/32] float32): the row quantization q4_gemm applies.
std::vector<torch::Tensor> q8_quantize(torch::Tensor x) {
  TORCH_CHECK(q4_gemm_supported(), "q8_quantize needs AVX2+FMA or AVX-512 VNNI");
  check_q_input(x);
  const int64_t M = x.size(0), G = x.size(1) / 32;
  auto qx = torch::empty({M, x.size(1)}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, G}, x.options().dtype(torch::kFloat32));
  auto sx = torch::empty({M, G}, x.options().dtype(torch::kFloat32));
#if defined(Q4_AVX512) || defined(Q4_AVX2)
  Q8Rows q(x);
  std::memcpy(qx.data_ptr<int8_t>(), q.qx.data(), q.qx.size());
  std::memcpy(dx.data_ptr<float>(), q.dx.data(), q.dx.size() * 4);
  std::memcpy(sx.data_ptr<float>(), q.sx.data(), q.sx.size() * 4);
#endif
  return {qx, dx, sx};
}

torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor wq, torch::Tensor ws, int64_t n, int64_t bits) {
  TORCH_CHECK(q4_gemm_supported(), "q4_gemm needs AVX2+FMA or AVX-512 VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  check_q_input(x);
  const int64_t M = x.size(0), K = x.size(1), N = n;
  TORCH_CHECK(N % 16 == 0 && N > 0, "N must be a positive multiple of 16");
  const int64_t G = K / 32;
  TORCH_CHECK(wq.scalar_type() == torch::kUInt8 && wq.is_contiguous() && wq.numel() == N * K * bits / 8,
              "wq: contiguous uint8 of N*K*bits/8 bytes");
  TORCH_CHECK(ws.scalar_type() == torch::kFloat32 && ws.is_contiguous() && ws.numel() == (N / 16) * G * 32,
              "ws: contiguous float32 [N/16, K/32, 2, 16]");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(Q4_AVX512) || defined(Q4_AVX2)
  pybind11::gil_scoped_release no_gil;
  const Q8Rows q(x);
  const uint8_t* w = wq.data_ptr<uint8_t>();
  const float* s = ws.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16) {
    auto* o = out.data_ptr<at::BFloat16>();
    if (bits == 4) q_gemm_impl<4>(w, s, q.qx.data(), q.dx.data(), q.sx.data(), q.qs.data(), M, K, N, o);
    else q_gemm_impl<8>(w, s, q.qx.data(), q.dx.data(), q.sx.data(), q.qs.data(), M, K, N, o);
  } else {
    float* o = out.data_ptr<float>();
    if (bits == 4) q_gemm_impl<4>(w, s, q.qx.data(), q.dx.data(), q.sx.data(), q.qs.data(), M, K, N, o);
    else q_gemm_impl<8>(w, s, q.qx.data(), q.dx.data(), q.sx.data(), q.qs.data(), M, K, N, o);
  }
#endif
  return out;
}
