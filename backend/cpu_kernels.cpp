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
#if defined(__AVX512F__)
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
#endif

template <typename T>
void decode_impl(const float* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* row_seq, const int32_t* lens,
                 T* out, int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t W, float scale) {
  const int64_t g = nh / nkv;
#ifdef HAVE_AVX512_DECODE
  const bool tiled = hd == 64 && (g == 1 || g == 3 || g == 4);
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
#ifdef HAVE_AVX512_ROWS
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
#ifdef HAVE_AVX512_ROWS
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
// int8 per 32-element group (d_x = max|x|/127, q_x = round(x/d_x), s_x = d_x*sum(q_x)) from that row
// alone; per (row, group) the int32 dot of the codes (u8) with q_x (s8) is taken with VPDPBUSD (exact
// integers), then, in float32 and in group order, acc = fma(cvt(isum), d_w*d_x, acc);
// acc = fma(m_w, s_x, acc). The same compiled sequence serves every row whatever the row block, the batch
// or the thread split (threads split N only, never K), so a row's bits depend on that row alone.
// Weight layout (wq, uint8): per 16-column block nb and group g, 4-bit: 4 x 64 bytes, vector v byte
// 4*col + j = code[col][32g + 8v + j] | code[col][32g + 8v + 4 + j] << 4; 8-bit: 8 x 64 bytes, vector c
// byte 4*col + j = code[col][32g + 4c + j]. Scales (ws, float32): [N/16, G, 2, 16] = (d_w, m_w).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
// rows per pass over a 16-column block (the accumulators of 8 rows, their int32 dots and the 8 unpacked
// weight vectors fit in the 32 zmm registers); a verify chunk of up to 8 rows reads each block once
constexpr int Q_ROWS = 8;
// software prefetch distance (bytes ahead in the weight stream): the hardware prefetcher alone left a
// decode step waiting on memory (2-core Xeon, bf16, 1 row: 4.8 -> 4.0 ms per step with it)
constexpr int64_t Q_PREFETCH = 4096;

template <int BITS>
static inline void q_unpack(const uint8_t* p, __m512i* w) {
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
static inline void q_block(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                           int64_t K, int64_t G, __m512* acc) {
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
static inline void q_store(TO* o, __m512 v) {
  if constexpr (std::is_same<TO, float>::value) {
    _mm512_storeu_ps(o, v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), (__m256i)_mm512_cvtneps_pbh(v));
  }
}

template <int R, int BITS, typename TO>
static inline void q_rows(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                          int64_t K, int64_t G, TO* out, int64_t N) {
  __m512 acc[R];
  q_block<R, BITS>(wq, ws, qx, dx, sx, K, G, acc);
  for (int r = 0; r < R; ++r) q_store<TO>(out + r * N, acc[r]);
}

// Row-local Q8_1 quantization of x [M, K] (bf16 or f32): qx [M, K] s8, dx / sx [M, G] f32.
template <typename TI>
static void q8_rows(const TI* x, int64_t M, int64_t K, int8_t* qx, float* dx, float* sx) {
  const int64_t G = K / 32;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < G; ++g) {
      float v[32];
      const TI* xp = x + m * K + g * 32;
      for (int i = 0; i < 32; ++i) v[i] = static_cast<float>(xp[i]);
      __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = amax / 127.0f;
      const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
      const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(id)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + m * K + g * 32), _mm512_cvtsepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qx + m * K + g * 32 + 16), _mm512_cvtsepi32_epi8(qb));
      const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
      dx[m * G + g] = d;
      sx[m * G + g] = d * static_cast<float>(s);
    }
  }
}

template <int BITS, typename TO>
static void q_gemm_impl(const uint8_t* wq, const float* ws, const int8_t* qx, const float* dx, const float* sx,
                        int64_t M, int64_t K, int64_t N, TO* out) {
  const int64_t G = K / 32, NB = N / 16;
  const int64_t wblock = G * (BITS == 4 ? 256 : 512);
  at::parallel_for(0, NB, 1, [&](int64_t b, int64_t e) {
    for (int64_t nb = b; nb < e; ++nb) {
      const uint8_t* w = wq + nb * wblock;
      const float* s = ws + nb * G * 32;
      int64_t m = 0;
      for (; m + Q_ROWS <= M; m += Q_ROWS)
        q_rows<Q_ROWS, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N);
      switch (M - m) {
        case 7: q_rows<7, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 6: q_rows<6, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 5: q_rows<5, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 4: q_rows<4, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 3: q_rows<3, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 2: q_rows<2, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        case 1: q_rows<1, BITS, TO>(w, s, qx + m * K, dx + m * G, sx + m * G, K, G, out + m * N + nb * 16, N); break;
        default: break;
      }
    }
  });
}
#endif

bool q4_gemm_supported() {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor q4_gemm(torch::Tensor x, torch::Tensor wq, torch::Tensor ws, int64_t n, int64_t bits) {
  TORCH_CHECK(q4_gemm_supported(), "q4_gemm needs AVX-512 BW/VNNI/BF16");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8");
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat32),
              "x: contiguous bfloat16/float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = n;
  TORCH_CHECK(K % 32 == 0 && N % 16 == 0 && N > 0, "K must be a multiple of 32 and N of 16");
  const int64_t G = K / 32;
  TORCH_CHECK(wq.scalar_type() == torch::kUInt8 && wq.is_contiguous() && wq.numel() == N * K * bits / 8,
              "wq: contiguous uint8 of N*K*bits/8 bytes");
  TORCH_CHECK(ws.scalar_type() == torch::kFloat32 && ws.is_contiguous() && ws.numel() == (N / 16) * G * 32,
              "ws: contiguous float32 [N/16, K/32, 2, 16]");
  auto out = torch::empty({M, N}, x.options());
  if (M == 0) return out;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  std::vector<int8_t> qx(M * K);
  std::vector<float> dx(M * G), sx(M * G);
  pybind11::gil_scoped_release no_gil;
  if (x.scalar_type() == torch::kBFloat16)
    q8_rows(x.data_ptr<at::BFloat16>(), M, K, qx.data(), dx.data(), sx.data());
  else
    q8_rows(x.data_ptr<float>(), M, K, qx.data(), dx.data(), sx.data());
  const uint8_t* w = wq.data_ptr<uint8_t>();
  const float* s = ws.data_ptr<float>();
  if (x.scalar_type() == torch::kBFloat16) {
    auto* o = out.data_ptr<at::BFloat16>();
    if (bits == 4) q_gemm_impl<4>(w, s, qx.data(), dx.data(), sx.data(), M, K, N, o);
    else q_gemm_impl<8>(w, s, qx.data(), dx.data(), sx.data(), M, K, N, o);
  } else {
    float* o = out.data_ptr<float>();
    if (bits == 4) q_gemm_impl<4>(w, s, qx.data(), dx.data(), sx.data(), M, K, N, o);
    else q_gemm_impl<8>(w, s, qx.data(), dx.data(), sx.data(), M, K, N, o);
  }
#endif
  return out;
}
