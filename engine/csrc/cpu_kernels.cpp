// CPU kernels for the decode step's small ops, built on first use by engine/cpu_kernels.py.
//
// On a CPU a decode step spends as much time in the ~30 small torch ops per layer (norms,
// rotary, SiLU-and-mul, gathering the paged context for attention) as in the matmuls: each
// op costs microseconds of dispatch and a pass over memory. Each function here does one of
// those jobs in one pass. The elementwise ones round where the torch code they replace
// rounds (products of two bfloat16 values are exact in float32, so rounding the float32
// result reproduces torch's bfloat16 op); reductions may differ from torch's in the last
// bit of float32 because they sum in another order.
//
// Compiled with -ffp-contract=off: a fused multiply-add would skip a rounding torch does.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

// bfloat16 <-> float32, as c10::BFloat16 does it (round to nearest even; NaN stays NaN).
inline float bf16_to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// Element access for the two dtypes the CPU engine runs: float32 and bfloat16 (as uint16).
template <typename T> struct Elem;

template <> struct Elem<float> {
  static inline float load(float v) { return v; }
  static inline float store(float v) { return v; }
  static inline float round(float v) { return v; }
};

template <> struct Elem<uint16_t> {
  static inline float load(uint16_t v) { return bf16_to_float(v); }
  static inline uint16_t store(float v) { return float_to_bf16(v); }
  // The value a bfloat16 tensor would hold: torch rounds after every op.
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

// exp in plain arithmetic, so loops over it vectorize (std::exp is a call per element):
// Cephes' single-precision polynomial, within about 2 ulp of the true value. Torch's own
// vectorized exp is not bit-identical either; after rounding to bfloat16 they agree.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.7f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T> T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// AVX-512 versions of the hot loops (the compiler does not vectorize exp or the bfloat16
// rounding on its own); the scalar code above is the definition and the fallback.
#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// float32 -> bfloat16 bits, round to nearest even, NaN kept: float_to_bf16 sixteen at once.
inline __m512i bf16_bits(__m512 v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_srli_epi32(rounded, 16);
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

inline __m512 round16(__m512 v, float) { return v; }
inline __m512 round16(__m512 v, uint16_t) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

// exp_approx, sixteen lanes, with the same operations in the same order.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
  __m512 n = _mm512_floor_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _mm512_set1_ps(0.5f)));
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r), _mm512_set1_ps(1.f));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}
#endif

void check_cpu_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
}

template <typename F> void dispatch(const torch::Tensor& t, F&& f) {
  if (t.scalar_type() == torch::kBFloat16) {
    f(uint16_t{});
  } else {
    f(float{});
  }
}

// ------------------------------------------------------------------------------- RMSNorm

// out = weight * round(x * rsqrt(mean(x^2) + eps)), the normalisation in float32, over the
// last dim of a [rows, heads, dim] view whose last dim is contiguous.
template <typename T>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out,
                   double eps) {
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const T* xp = ptr<T>(x);
  const T* wp = ptr<T>(weight);
  T* op = ptr<T>(out);
  at::parallel_for(0, rows * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* row = xp + (i / heads) * s0 + (i % heads) * s1;
      T* dst = op + i * dim;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) {
        float v = Elem<T>::load(row[d]);
        sum += v * v;
      }
      const float scale = 1.f / std::sqrt(sum / static_cast<float>(dim) + static_cast<float>(eps));
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) {
        float normed = Elem<T>::round(Elem<T>::load(row[d]) * scale);
        dst[d] = Elem<T>::store(Elem<T>::load(wp[d]) * normed);
      }
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_cpu_float(x, "x");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous(),
              "weight must be contiguous and of x's dtype");
  TORCH_CHECK(x.stride(-1) == 1, "x's last dim must be contiguous");
  TORCH_CHECK(x.dim() == 2 || x.dim() == 3, "x must be [rows, dim] or [rows, heads, dim]");
  torch::Tensor x3 = x.dim() == 2 ? x.unsqueeze(1) : x;
  TORCH_CHECK(weight.numel() == x3.size(2), "weight must match x's last dim");
  auto out = torch::empty(x.sizes(), x.options());
  dispatch(x, [&](auto tag) { rms_norm_rows<decltype(tag)>(x3, weight, out, eps); });
  return out;
}

// ---------------------------------------------------------------------------------- RoPE

// Rotates q [T, H, D] and k [T, KVH, D] (views, last dim contiguous) by the cos/sin rows of
// each token's position, the half-split ("neox") way, into one new [T, H + KVH, D] tensor:
//   out = x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch does.
template <typename T>
void rope_rows(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
               const torch::Tensor& sin, const torch::Tensor& positions, torch::Tensor& out) {
  const int64_t tokens = q.size(0), qh = q.size(1), kh = k.size(1), dim = q.size(2);
  const int64_t half = dim / 2, heads = qh + kh;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const T* cp = ptr<T>(cos);
  const T* sp = ptr<T>(sin);
  T* op = ptr<T>(out);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + pos[t] * dim;
      const T* s = sp + pos[t] * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = h < qh ? ptr<T>(q) + t * q.stride(0) + h * q.stride(1)
                            : ptr<T>(k) + t * k.stride(0) + (h - qh) * k.stride(1);
        T* dst = op + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t d = 0; d < half; ++d) {
          float a = Elem<T>::round(Elem<T>::load(x[d]) * Elem<T>::load(c[d]));
          float b = Elem<T>::round(-Elem<T>::load(x[d + half]) * Elem<T>::load(s[d]));
          dst[d] = Elem<T>::store(a + b);
        }
#pragma omp simd
        for (int64_t d = half; d < dim; ++d) {
          float a = Elem<T>::round(Elem<T>::load(x[d]) * Elem<T>::load(c[d]));
          float b = Elem<T>::round(Elem<T>::load(x[d - half]) * Elem<T>::load(s[d]));
          dst[d] = Elem<T>::store(a + b);
        }
      }
    }
  });
}

torch::Tensor rope(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& cos,
                   const torch::Tensor& sin, const torch::Tensor& positions) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q must be [T, H, D] and k [T, KVH, D]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "q, k, cos and sin must share a dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k's last dim must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == q.size(2),
              "cos and sin must be contiguous [positions, D]");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(),
              "positions must be contiguous int64");
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  auto out = torch::empty({q.size(0), q.size(1) + k.size(1), q.size(2)}, q.options());
  dispatch(q, [&](auto tag) { rope_rows<decltype(tag)>(q, k, cos, sin, positions, out); });
  return out;
}

// ------------------------------------------------------------------------- SiLU-and-mul

// x [T, 2I] (gate then up) -> round(silu(gate)) * up, rounded: torch's F.silu then a mul.
template <typename T> void silu_and_mul_rows(const torch::Tensor& x, torch::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1) / 2;
  const T* xp = ptr<T>(x);
  T* op = ptr<T>(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = xp + r * 2 * width;
      const T* up = gate + width;
      T* dst = op + r * width;
      int64_t i = 0;
#ifdef __AVX512F__
      for (; i + 16 <= width; i += 16) {
        __m512 g = load16(gate + i);
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 silu = round16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), T{});
        store16(dst + i, _mm512_mul_ps(silu, load16(up + i)));
      }
#endif
      for (; i < width; ++i) {
        float g = Elem<T>::load(gate[i]);
        float silu = Elem<T>::round(g / (1.f + exp_approx(-g)));
        dst[i] = Elem<T>::store(silu * Elem<T>::load(up[i]));
      }
    }
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0,
              "x must be a contiguous [T, 2 * width] tensor");
  auto out = torch::empty({x.size(0), x.size(1) / 2}, x.options());
  dispatch(x, [&](auto tag) { silu_and_mul_rows<decltype(tag)>(x, out); });
  return out;
}

// ------------------------------------------------------------------ paged decode attention

// One query token per sequence against its whole context, read from the paged cache in
// place (no gather). One task per (sequence, kv head): the q heads of that kv head's group
// share each loaded key and value row. Scores, softmax and the weighted sum of values are
// float32; the output is rounded once.
// The cache slot of a sequence's t-th token.
inline int64_t slot_of(const int64_t* pages, int64_t t, int64_t page_size) {
  return pages[t / page_size] * page_size + t % page_size;
}

// One (sequence, kv head) task: qf holds the group's q heads, already scaled, as float32
// [group, dim]. Leaves each head's unnormalised output in acc [group, dim] and its softmax
// denominator in total [group]; scores [group, len] is scratch.
template <typename T>
void attend_task(const float* qf, const T* kp, const T* vp, const int64_t* pages, int64_t len,
                 int64_t page_size, int64_t kv_heads, int64_t kvh, int64_t group, int64_t dim,
                 float* scores, float* acc, float* total) {
  for (int64_t t = 0; t < len; ++t) {
    const T* key = kp + (slot_of(pages, t, page_size) * kv_heads + kvh) * dim;
    for (int64_t g = 0; g < group; ++g) {
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[g * dim + d] * Elem<T>::load(key[d]);
      scores[g * len + t] = s;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores + g * len;
    const float top = *std::max_element(sg, sg + len);
    float sum = 0.f;
    for (int64_t t = 0; t < len; ++t) {
      sg[t] = exp_approx(sg[t] - top);
      sum += sg[t];
    }
    total[g] = sum;
  }
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const T* value = vp + (slot_of(pages, t, page_size) * kv_heads + kvh) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * Elem<T>::load(value[d]);
    }
  }
}

#ifdef __AVX512F__
// attend_task with the head in registers (dim a multiple of 16, at most 256): one head of
// the group at a time over all keys, so its q and its output accumulators stay in zmm
// registers and the keys and values it re-reads come from L1/L2.
template <typename T>
void attend_task_avx512(const float* qf, const T* kp, const T* vp, const int64_t* pages,
                        int64_t len, int64_t page_size, int64_t kv_heads, int64_t kvh,
                        int64_t group, int64_t dim, float* scores, float* acc, float* total) {
  const int64_t nv = dim / 16;
  __m512 reg[16];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t v = 0; v < nv; ++v) reg[v] = _mm512_loadu_ps(qf + g * dim + 16 * v);
    float* sg = scores + g * len;
    for (int64_t t = 0; t < len; ++t) {
      const T* key = kp + (slot_of(pages, t, page_size) * kv_heads + kvh) * dim;
      __m512 s = _mm512_mul_ps(reg[0], load16(key));
      for (int64_t v = 1; v < nv; ++v) s = _mm512_fmadd_ps(reg[v], load16(key + 16 * v), s);
      sg[t] = _mm512_reduce_add_ps(s);
    }
    float top = sg[0];
    for (int64_t t = 1; t < len; ++t) top = std::max(top, sg[t]);
    __m512 sum16 = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + 16 <= len; t += 16) {
      __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), _mm512_set1_ps(top)));
      _mm512_storeu_ps(sg + t, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    float sum = _mm512_reduce_add_ps(sum16);
    for (; t < len; ++t) {
      sg[t] = exp_approx(sg[t] - top);
      sum += sg[t];
    }
    total[g] = sum;
    for (int64_t v = 0; v < nv; ++v) reg[v] = _mm512_setzero_ps();
    for (t = 0; t < len; ++t) {
      const T* value = vp + (slot_of(pages, t, page_size) * kv_heads + kvh) * dim;
      const __m512 p = _mm512_set1_ps(sg[t]);
      for (int64_t v = 0; v < nv; ++v) reg[v] = _mm512_fmadd_ps(p, load16(value + 16 * v), reg[v]);
    }
    for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(acc + g * dim + 16 * v, reg[v]);
  }
}
#endif

template <typename T>
void decode_attention_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& page_table,
                           const torch::Tensor& lengths, int64_t page_size, double scale,
                           torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t max_pages = page_table.size(1);
  const T* qp = ptr<T>(q);
  const T* kp = ptr<T>(k_cache);
  const T* vp = ptr<T>(v_cache);
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  T* op = ptr<T>(out);
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores, sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, kvh = task % kv_heads;
      const int64_t len = lens[b];
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q.stride(0) + (kvh * group + g) * q.stride(1);
        for (int64_t d = 0; d < dim; ++d) qf[g * dim + d] = Elem<T>::load(src[d]) * fscale;
      }
      const int64_t* pages = table + b * max_pages;
      float* total = sums.data();
#ifdef __AVX512F__
      if (dim % 16 == 0 && dim <= 256) {
        attend_task_avx512<T>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group,
                              dim, scores.data(), acc.data(), total);
      } else
#endif
      {
        attend_task<T>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group, dim,
                       scores.data(), acc.data(), total);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * heads + kvh * group + g) * dim;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = Elem<T>::store(acc[g * dim + d] * inv);
      }
    }
  });
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& page_table,
                               const torch::Tensor& lengths, int64_t page_size, double scale) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D], last dim contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the caches must have q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2),
              "the caches must be contiguous [slots, KVH, D]");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "heads must be a multiple of kv heads");
  TORCH_CHECK(page_table.scalar_type() == torch::kLong && page_table.is_contiguous() &&
                  page_table.dim() == 2 && page_table.size(0) == q.size(0),
              "page_table must be contiguous int64 [B, pages]");
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.is_contiguous() &&
                  lengths.numel() == q.size(0),
              "lengths must be contiguous int64 [B]");
  // A length past the table or the cache would read memory the sequence does not own.
  const int64_t slots = k_cache.size(0);
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(lens[b] > 0 && lens[b] <= page_table.size(1) * page_size,
                "a context length does not fit its page table");
    for (int64_t p = 0; p * page_size < lens[b]; ++p) {
      const int64_t page = table[b * page_table.size(1) + p];
      TORCH_CHECK(page >= 0 && (page + 1) * page_size <= slots, "page out of the cache");
    }
  }
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  dispatch(q, [&](auto tag) {
    decode_attention_rows<decltype(tag)>(q, k_cache, v_cache, page_table, lengths, page_size,
                                         scale, out);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, weight applied after rounding");
  m.def("rope", &rope, "Half-split rotary embedding of q and k into one [T, H + KVH, D]");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2 * width] tensor");
  m.def("decode_attention", &decode_attention,
        "One-token attention per sequence over its pages of the KV cache, read in place");
}
