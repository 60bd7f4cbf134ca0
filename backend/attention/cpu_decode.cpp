// Paged-KV decode attention for the CPU: one query token per sequence, K/V read in place from the
// block pool (no gather copy), float32 math, one (sequence, KV head) pair per task over torch's
// intra-op thread pool. Built at first use by backend/attention/cpu_decode.py (torch cpp_extension).
//
// Shapes: q [nd, nh, hd] float32; k_cache / v_cache [num_blocks, block_size, nkv, hd] (float32 or
// bfloat16, contiguous); block_tables [>= nd, W] int32; seq_lens [>= nd] int32; out [nd, nh, hd] in
// the cache dtype. Query head h reads KV head h / (nh / nkv) (grouped-query attention).
// Source followed: vLLM PagedAttention (Kwon et al. 2023) semantics; two-pass softmax.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
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

// One task = one sequence and a contiguous range of its KV heads [h0, h1). With all heads in one
// task, each token's K (then V) record of nkv * hd values is read front to back, and a block of
// block_size tokens is one contiguous run of memory: DRAM-streaming friendly. (Per-head tasks read
// 128 of every 384 bytes and measured 3 GB/s from DRAM; see docs/perf.md.)
template <typename T>
void decode_seq(const float* q, const T* kc, const T* vc, const int32_t* table, int64_t L, T* out, int64_t nh,
                int64_t nkv, int64_t hd, int64_t bs, int64_t h0, int64_t h1, float scale, std::vector<float>& buf) {
  const int64_t g = nh / nkv, rows = (h1 - h0) * g, rec = nkv * hd;
  buf.resize(rows * hd * 2 + hd + rows * L + rows);
  float* qs = buf.data();               // [rows, hd] scaled queries
  float* acc = qs + rows * hd;          // [rows, hd]
  float* row = acc + rows * hd;         // [hd]
  float* scores = row + hd;             // [rows, L]
  float* denom = scores + rows * L;     // [rows]
  for (int64_t i = 0; i < rows * hd; ++i) qs[i] = q[h0 * g * hd + i] * scale;
  for (int64_t t = 0; t < L; ++t) {
    const int64_t blk = table[t / bs];
    if (t % bs == 0 && t + bs < L) __builtin_prefetch(kc + static_cast<int64_t>(table[t / bs + 1]) * bs * rec);
    const T* krec = kc + (blk * bs + t % bs) * rec;
    for (int64_t h = h0; h < h1; ++h) {
      load_row<T>(krec + h * hd, row, hd);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = (h - h0) * g + j;
        const float* qj = qs + r * hd;
        float sc = 0.f;
#pragma omp simd reduction(+ : sc)
        for (int64_t d = 0; d < hd; ++d) sc += qj[d] * row[d];
        scores[r * L + t] = sc;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * L;
    float m = -FLT_MAX;  // scores are finite: built with -ffast-math (vectorized expf from libmvec)
#pragma omp simd reduction(max : m)
    for (int64_t t = 0; t < L; ++t) m = sr[t] > m ? sr[t] : m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      sr[t] = expf(sr[t] - m);
      sum += sr[t];
    }
    denom[r] = sum;
  }
  std::fill(acc, acc + rows * hd, 0.f);
  for (int64_t t = 0; t < L; ++t) {
    const int64_t blk = table[t / bs];
    if (t % bs == 0 && t + bs < L) __builtin_prefetch(vc + static_cast<int64_t>(table[t / bs + 1]) * bs * rec);
    const T* vrec = vc + (blk * bs + t % bs) * rec;
    for (int64_t h = h0; h < h1; ++h) {
      load_row<T>(vrec + h * hd, row, hd);
      for (int64_t j = 0; j < g; ++j) {
        const int64_t r = (h - h0) * g + j;
        const float p = scores[r * L + t];
        float* ar = acc + r * hd;
#pragma omp simd
        for (int64_t d = 0; d < hd; ++d) ar[d] += p * row[d];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_row<T>(acc + r * hd, out + (h0 * g + r) * hd, hd, 1.f / denom[r]);
}

template <typename T>
void decode_impl(const float* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* lens, T* out,
                 int64_t nd, int64_t nh, int64_t nkv, int64_t hd, int64_t bs, int64_t W, float scale) {
  // few sequences: split their KV heads over the threads; many: one whole sequence per task
  const int64_t split = nd < 2 * at::get_num_threads() ? nkv : 1;
  at::parallel_for(0, nd * split, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / split, part = item % split;
      const int64_t h0 = part * nkv / split, h1 = (part + 1) * nkv / split;
      decode_seq<T>(q + b * nh * hd, kc, vc, bt + b * W, lens[b], out + b * nh * hd, nh, nkv, hd, bs, h0, h1, scale, buf);
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: contiguous float32 [nd, nh, hd]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache: contiguous [num_blocks, block_size, nkv, hd] of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables: contiguous int32 [B, W]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt32 && seq_lens.is_contiguous(), "seq_lens: contiguous int32 [B]");
  const int64_t nd = q.size(0), nh = q.size(1), hd = q.size(2);
  const int64_t nblocks = k_cache.size(0), bs = k_cache.size(1), nkv = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == hd && nkv > 0 && nh % nkv == 0, "head_dim / head counts mismatch");
  TORCH_CHECK(block_tables.size(0) >= nd && seq_lens.size(0) >= nd, "fewer block-table rows / lengths than queries");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < nd; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * bs, "sequence length outside its block table");
    for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
      TORCH_CHECK(bt[b * W + i] >= 0 && bt[b * W + i] < nblocks, "block id outside the pool");
  }
  auto out = torch::empty({nd, nh, hd}, k_cache.options());
  if (k_cache.scalar_type() == torch::kFloat32) {
    decode_impl<float>(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), bt, lens,
                       out.data_ptr<float>(), nd, nh, nkv, hd, bs, W, static_cast<float>(scale));
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "cache dtype must be float32 or bfloat16");
    decode_impl<uint16_t>(q.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_cache.data_ptr()),
                          reinterpret_cast<const uint16_t*>(v_cache.data_ptr()), bt, lens,
                          reinterpret_cast<uint16_t*>(out.data_ptr()), nd, nh, nkv, hd, bs, W, static_cast<float>(scale));
  }
  return out;
}
