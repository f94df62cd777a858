// Batched single-token (decode) attention that reads keys and values straight from the paged KV
// cache, so no per-step gather copy of every request's context is made. fp32, CPU, one task per
// (request, kv head); at::parallel_for follows torch's thread setting.
//
// Layout (see vllm_lite/models/attention.py):
//   q            [B, H, D]
//   key_cache    [num_blocks, KVH, D, BS]  keys transposed inside a block
//   value_cache  [num_blocks, KVH, BS, D]
//   block_tables [B, max_blocks] int32, context_lens [B] int32
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// Numerically safe exp for x <= 0 (softmax after max subtraction), written so that the compiler
// vectorizes it: 2^(x*log2e) split into an integer power (exponent bits) and a degree-6 polynomial
// on [-0.5, 0.5] (relative error ~2e-7, below fp32 rounding of the scores themselves).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.4426950408889634f;
  const float n = std::nearbyint(t);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One (request, kv head) pair. Block size, head dim and group size are compile-time so the
// accumulators live in registers: each key row is loaded once for all G query heads.
template <int BS, int D, int G>
void decode_one(const float* qb, const float* kp, const float* vp, const int* table, int64_t L,
                int64_t head_off, int64_t block_stride, float scale, float* scores, float* op) {
  const int64_t nblk = (L + BS - 1) / BS;
  const int64_t Lp = nblk * BS;
  float qs[G][D];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = qb[g * D + d] * scale;
  float mx[G];
  for (int g = 0; g < G; ++g) mx[g] = -std::numeric_limits<float>::max();
  for (int64_t j = 0; j < nblk; ++j) {
    const float* kb = kp + static_cast<int64_t>(table[j]) * block_stride + head_off;
    // Blocks sit anywhere in the cache, so the hardware prefetcher cannot guess the next one:
    // fetch it line by line while this one is scored (the cache is read from DRAM every step).
    const float* next_kb = kp + static_cast<int64_t>(table[j + 1 < nblk ? j + 1 : j]) * block_stride + head_off;
    float acc[G][BS] = {};
    for (int d = 0; d < D; ++d) {
      const float* kr = kb + d * BS;
      if ((d * BS) % 16 == 0) __builtin_prefetch(next_kb + d * BS);
      for (int g = 0; g < G; ++g) {
        const float qd = qs[g][d];
#pragma omp simd
        for (int t = 0; t < BS; ++t) acc[g][t] += qd * kr[t];
      }
    }
    const int64_t valid = std::min<int64_t>(BS, L - j * BS);
    for (int g = 0; g < G; ++g) {
      float* s = scores + g * Lp + j * BS;
      for (int t = 0; t < BS; ++t) s[t] = acc[g][t];
      for (int64_t t = 0; t < valid; ++t) mx[g] = std::max(mx[g], acc[g][t]);
    }
  }
  float inv[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * Lp;
    float sum = 0.f;
    const float m = mx[g];
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      const float e = exp_nonpositive(sg[t] - m);
      sg[t] = e;
      sum += e;
    }
    for (int64_t t = L; t < Lp; ++t) sg[t] = 0.f;
    inv[g] = 1.f / sum;
  }
  float acc[G][D] = {};
  for (int64_t j = 0; j < nblk; ++j) {
    const float* vb = vp + static_cast<int64_t>(table[j]) * block_stride + head_off;
    const float* next_vb = vp + static_cast<int64_t>(table[j + 1 < nblk ? j + 1 : j]) * block_stride + head_off;
    for (int t = 0; t < BS; ++t) {
      const float* vr = vb + t * D;
      for (int l = 0; l < D; l += 16) __builtin_prefetch(next_vb + t * D + l);
      for (int g = 0; g < G; ++g) {
        const float pt = scores[g * Lp + j * BS + t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += pt * vr[d];
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) op[g * D + d] = acc[g][d] * inv[g];
}

using DecodeFn = void (*)(const float*, const float*, const float*, const int*, int64_t, int64_t, int64_t,
                          float, float*, float*);

template <int BS, int D>
DecodeFn pick_group(int64_t g) {
  switch (g) {
    case 1: return &decode_one<BS, D, 1>;
    case 2: return &decode_one<BS, D, 2>;
    case 3: return &decode_one<BS, D, 3>;
    case 4: return &decode_one<BS, D, 4>;
    case 5: return &decode_one<BS, D, 5>;
    case 6: return &decode_one<BS, D, 6>;
    case 7: return &decode_one<BS, D, 7>;
    case 8: return &decode_one<BS, D, 8>;
    default: return nullptr;
  }
}

DecodeFn pick(int64_t bs, int64_t d, int64_t g) {
#define VLLM_LITE_CASE(B_, D_) \
  if (bs == B_ && d == D_) return pick_group<B_, D_>(g);
  VLLM_LITE_CASE(16, 64) VLLM_LITE_CASE(16, 128) VLLM_LITE_CASE(32, 64) VLLM_LITE_CASE(32, 128)
  VLLM_LITE_CASE(16, 96) VLLM_LITE_CASE(32, 96) VLLM_LITE_CASE(16, 80) VLLM_LITE_CASE(32, 80)
#undef VLLM_LITE_CASE
  return nullptr;
}

}  // namespace

bool paged_decode_supported(int64_t block_size, int64_t head_dim, int64_t group) {
  return pick(block_size, head_dim, group) != nullptr;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && context_lens.scalar_type() == torch::kInt32,
              "paged_decode: block_tables and context_lens must be int32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = key_cache.size(1), BS = key_cache.size(3);
  const int64_t G = H / KVH;
  const DecodeFn fn = pick(BS, D, G);
  TORCH_CHECK(fn != nullptr, "paged_decode: unsupported block size / head dim / grouping");
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int* bt = block_tables.data_ptr<int>();
  const int* cl = context_lens.data_ptr<int>();
  float* op = out.data_ptr<float>();
  const int64_t head_stride = D * BS, block_stride = KVH * D * BS;
  const float fscale = static_cast<float>(scale);

  // at::parallel_for runs on torch's own thread pool and thread count; each chunk of
  // (request, kv head) tasks reuses one scores buffer.
  at::parallel_for(0, B * KVH, 1, [&](int64_t start, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = start; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t L = cl[b];
      scores.resize(G * ((L + BS - 1) / BS) * BS);
      fn(qp + (b * H + kh * G) * D, kp, vp, bt + b * max_blocks, L, kh * head_stride, block_stride, fscale,
         scores.data(), op + (b * H + kh * G) * D);
    }
  });
  return out;
}

TORCH_LIBRARY(vllm_lite, m) {
  m.def("paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor");
  m.impl("paged_decode", torch::kCPU, &paged_decode);
  m.def("paged_decode_supported(int block_size, int head_dim, int group) -> bool", &paged_decode_supported);
}
