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
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per kv head handled in one pass

// One (request, kv head) pair. BS and D are compile-time so the inner loops become a few fixed
// vector FMAs whose accumulators stay in registers.
template <int BS, int D>
void decode_one(const float* qb, const float* kp, const float* vp, const int* table, int64_t L, int64_t G,
                int64_t head_off, int64_t block_stride, float scale, float* scores, float* op) {
  const int64_t nblk = (L + BS - 1) / BS;
  const int64_t Lp = nblk * BS;
  float qs[kMaxGroup][D];
  for (int64_t g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) qs[g][d] = qb[g * D + d] * scale;
  for (int64_t j = 0; j < nblk; ++j) {
    const float* kb = kp + static_cast<int64_t>(table[j]) * block_stride + head_off;
    for (int64_t g = 0; g < G; ++g) {
      float acc[BS] = {};
      for (int d = 0; d < D; ++d) {
        const float qd = qs[g][d];
        const float* kr = kb + d * BS;
#pragma omp simd
        for (int t = 0; t < BS; ++t) acc[t] += qd * kr[t];
      }
      float* s = scores + g * Lp + j * BS;
      for (int t = 0; t < BS; ++t) s[t] = acc[t];
    }
  }
  float inv[kMaxGroup];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * Lp;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) mx = std::max(mx, sg[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    for (int64_t t = L; t < Lp; ++t) sg[t] = 0.f;
    inv[g] = 1.f / sum;
  }
  for (int64_t g = 0; g < G; ++g) {
    float acc[D] = {};
    const float* p = scores + g * Lp;
    for (int64_t j = 0; j < nblk; ++j) {
      const float* vb = vp + static_cast<int64_t>(table[j]) * block_stride + head_off;
      for (int t = 0; t < BS; ++t) {
        const float pt = p[j * BS + t];
        const float* vr = vb + t * D;
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[d] += pt * vr[d];
      }
    }
    float* o = op + g * D;
    for (int d = 0; d < D; ++d) o[d] = acc[d] * inv[g];
  }
}

using DecodeFn = void (*)(const float*, const float*, const float*, const int*, int64_t, int64_t, int64_t,
                          int64_t, float, float*, float*);

DecodeFn pick(int64_t bs, int64_t d) {
#define VLLM_LITE_CASE(B_, D_) \
  if (bs == B_ && d == D_) return &decode_one<B_, D_>;
  VLLM_LITE_CASE(16, 64) VLLM_LITE_CASE(16, 128) VLLM_LITE_CASE(32, 64) VLLM_LITE_CASE(32, 128)
  VLLM_LITE_CASE(16, 96) VLLM_LITE_CASE(32, 96) VLLM_LITE_CASE(16, 80) VLLM_LITE_CASE(32, 80)
#undef VLLM_LITE_CASE
  return nullptr;
}

}  // namespace

bool paged_decode_supported(int64_t block_size, int64_t head_dim, int64_t group) {
  return group <= kMaxGroup && pick(block_size, head_dim) != nullptr;
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
  const DecodeFn fn = pick(BS, D);
  TORCH_CHECK(fn != nullptr && G <= kMaxGroup, "paged_decode: unsupported block size / head dim / grouping");
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

  at::parallel_for(0, B * KVH, 1, [&](int64_t start, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = start; idx < end; ++idx) {
      const int64_t b = idx / KVH, kh = idx % KVH;
      const int64_t L = cl[b];
      scores.resize(G * ((L + BS - 1) / BS) * BS);
      fn(qp + (b * H + kh * G) * D, kp, vp, bt + b * max_blocks, L, G, kh * head_stride, block_stride, fscale,
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
