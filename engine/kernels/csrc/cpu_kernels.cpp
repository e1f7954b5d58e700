// CPU kernels for the decode step's small ops, built on first use by engine/kernels/cpu_kernels.py.
//
// On a CPU a decode step spends as much time in the ~30 small torch ops per layer (norms,
// rotary, SiLU-and-mul, gathering the paged context for attention) as in the matmuls: each
// op costs microseconds of dispatch and a pass over memory. Each function here does one of
// those jobs in one pass. The elementwise ones round where the torch code they replace
// rounds (products of two bfloat16 values are exact in float32, so rounding the float32
// result reproduces torch's bfloat16 op); reductions may differ from torch's in the last
// bit of float32 because they sum in another order.
//
// The last section is different in kind: a linear over a GGUF checkpoint's own quantized
// blocks, for decode batches small enough that reading the weights is the step's cost.
//
// Compiled with -ffp-contract=off: a fused multiply-add would skip a rounding torch does.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
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

// The sum of v's sixteen lanes in the AVX2 build's order for two 8-lane halves (hsum8 of
// their sum): lanes i + 8, then + 4, + 2, + 1.
inline float hsum16(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), high);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// The lane sums of n <= 16 vectors at once: out[i] = the sum of v[i]'s 16 lanes. Every
// vector goes through the same tree, whatever n and its place among them (lanes i and i+8,
// then +4, +2, +1, as pairs of shuffles and one add per level), so a sum's bits do not
// depend on the tile it came from; a quarter of the work of n separate reductions.
inline void lane_sums(const __m512* v, int n, float* out) {
  __m512 t[8], u[4], w[2];
  const __m512 zero = _mm512_setzero_ps();
  const auto at = [&](int i) { return i < n ? v[i] : zero; };
  for (int i = 0; i < 8; ++i) {  // [a.q0+a.q2, a.q1+a.q3, b.q0+b.q2, b.q1+b.q3]
    const __m512 a = at(2 * i), b = at(2 * i + 1);
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // quarter q: vector 4i + q's four partial sums
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 z = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(64) float sums[16];
  _mm512_store_ps(sums, z);
  // Lane 4q + l of z holds vector 4l + q's sum.
  for (int i = 0; i < n; ++i) out[i] = sums[4 * (i % 4) + i / 4];
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA (x86-64-v3) versions of the helpers above, eight lanes: the same operations in
// the same order, so elementwise results are the AVX-512 build's bits.
#define SLUICE_AVX2 1
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// float32 -> bfloat16 bits in the low half of each 32-bit lane: float_to_bf16, eight at once.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
  return _mm256_srli_epi32(rounded, 16);
}

inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) {
  const __m256i b = bf16_bits8(v);  // eight 32-bit lanes, values < 2^16: pack, then order
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

inline __m256 round8(__m256 v, float) { return v; }
inline __m256 round8(__m256 v, uint16_t) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

// exp_approx, eight lanes (exp16's steps).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, _mm256_mul_ps(r, r)), r), _mm256_set1_ps(1.f));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The sum of v's eight lanes: i + 4, then + 2, + 1.
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}
#endif

// The norms' vector, written once for the build's widest: sixteen lanes with AVX-512, eight
// with AVX2. Elementwise steps give the same bits at any width; the one reduction
// (sum_squares16) fixes its order for both. (RoPE's omp simd loops need no more: the
// compiler vectorises them at either width, and hand-written intrinsics measured slower.)
#if defined(__AVX512F__) || defined(SLUICE_AVX2)
#define SLUICE_VEC 1
#ifdef __AVX512F__
using vecf = __m512;
constexpr int64_t kLanes = 16;
template <typename T> inline vecf vload(const T* p) { return load16(p); }
template <typename T> inline void vstore(T* p, vecf v) { store16(p, v); }
template <typename T> inline vecf vround(vecf v) { return round16(v, T{}); }
inline vecf vset(float a) { return _mm512_set1_ps(a); }
inline vecf vadd(vecf a, vecf b) { return _mm512_add_ps(a, b); }
inline vecf vmul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
#else
using vecf = __m256;
constexpr int64_t kLanes = 8;
template <typename T> inline vecf vload(const T* p) { return load8(p); }
template <typename T> inline void vstore(T* p, vecf v) { store8(p, v); }
template <typename T> inline vecf vround(vecf v) { return round8(v, T{}); }
inline vecf vset(float a) { return _mm256_set1_ps(a); }
inline vecf vadd(vecf a, vecf b) { return _mm256_add_ps(a, b); }
inline vecf vmul(vecf a, vecf b) { return _mm256_mul_ps(a, b); }
#endif

// The sum of the squares of n16 (a multiple of 16) values, which next(d) hands out kLanes
// at a time from d on (and may store): sixteen running lane sums on either build (one
// 16-lane vector, or two 8-lane ones), then added i + 8, + 4, + 2, + 1. So both builds
// give a row the same bits.
template <typename Next> inline float sum_squares16(int64_t n16, Next&& next) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < n16; d += 16) {
    const __m512 v = next(d);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return hsum16(acc);
#else
  __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
  for (int64_t d = 0; d < n16; d += 16) {
    const __m256 a = next(d), b = next(d + 8);
    lo = _mm256_fmadd_ps(a, a, lo);
    hi = _mm256_fmadd_ps(b, b, hi);
  }
  return hsum8(_mm256_add_ps(lo, hi));
#endif
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

// out = weight * round(x * scale), each product rounded as torch's ops round: the second
// pass of both norms, a row of dim values.
template <typename T>
inline void scale_by_weight(const T* x, const T* weight, float scale, int64_t dim, T* out) {
  int64_t d = 0;
#ifdef SLUICE_VEC
  const vecf s = vset(scale);
  for (; d + kLanes <= dim; d += kLanes)
    vstore(out + d, vmul(vload(weight + d), vround<T>(vmul(vload(x + d), s))));
#endif
#pragma omp simd
  for (int64_t j = d; j < dim; ++j) {
    const float normed = Elem<T>::round(Elem<T>::load(x[j]) * scale);
    out[j] = Elem<T>::store(Elem<T>::load(weight[j]) * normed);
  }
}

inline float norm_scale(float sum_squares, int64_t dim, double eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(dim) + static_cast<float>(eps));
}

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
      float sum = 0.f;
#ifdef SLUICE_VEC
      int64_t d = dim / 16 * 16;
      sum = sum_squares16(d, [&](int64_t j) { return vload(row + j); });
      for (; d < dim; ++d) {  // in order: a vectorised tail would sum by the build's width
        const float v = Elem<T>::load(row[d]);
        sum += v * v;
      }
#else
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = Elem<T>::load(row[d]);
        sum += v * v;
      }
#endif
      scale_by_weight(row, wp, norm_scale(sum, dim, eps), dim, op + i * dim);
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

// The residual add and the next RMSNorm in one pass: summed = round(h + delta), as torch's
// add rounds, then normed = rms_norm(summed). Returns (normed, summed).
template <typename T>
void add_rms_norm_rows(const torch::Tensor& h, const torch::Tensor& delta,
                       const torch::Tensor& weight, torch::Tensor& normed, torch::Tensor& summed,
                       double eps) {
  const int64_t rows = h.size(0), dim = h.size(1);
  const T* hp = ptr<T>(h);
  const T* dp = ptr<T>(delta);
  const T* wp = ptr<T>(weight);
  T* np_ = ptr<T>(normed);
  T* sp = ptr<T>(summed);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = hp + r * dim;
      const T* b = dp + r * dim;
      T* s = sp + r * dim;
      float sum = 0.f;
#ifdef SLUICE_VEC
      int64_t d = dim / 16 * 16;
      sum = sum_squares16(d, [&](int64_t j) {
        const vecf v = vround<T>(vadd(vload(a + j), vload(b + j)));
        vstore(s + j, v);
        return v;
      });
      for (; d < dim; ++d) {  // in order, as rms_norm_rows
        const float v = Elem<T>::round(Elem<T>::load(a[d]) + Elem<T>::load(b[d]));
        s[d] = Elem<T>::store(v);
        sum += v * v;
      }
#else
#pragma omp simd reduction(+ : sum)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = Elem<T>::round(Elem<T>::load(a[d]) + Elem<T>::load(b[d]));
        s[d] = Elem<T>::store(v);
        sum += v * v;
      }
#endif
      scale_by_weight(s, wp, norm_scale(sum, dim, eps), dim, np_ + r * dim);
    }
  });
}

std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta,
                                        const torch::Tensor& weight, double eps) {
  check_cpu_float(h, "h");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && delta.is_contiguous() &&
                  delta.sizes() == h.sizes() && delta.scalar_type() == h.scalar_type(),
              "h and delta must be contiguous [rows, dim] tensors of one dtype");
  TORCH_CHECK(weight.scalar_type() == h.scalar_type() && weight.is_contiguous() &&
                  weight.numel() == h.size(1),
              "weight must be contiguous [dim] of h's dtype");
  auto normed = torch::empty_like(h);
  auto summed = torch::empty_like(h);
  dispatch(h, [&](auto tag) {
    add_rms_norm_rows<decltype(tag)>(h, delta, weight, normed, summed, eps);
  });
  return {normed, summed};
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
#elif defined(SLUICE_AVX2)
      for (; i + 8 <= width; i += 8) {
        const __m256 g = load8(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        const __m256 silu = round8(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)), T{});
        store8(dst + i, _mm256_mul_ps(silu, load8(up + i)));
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

// ---------------------------------------------------------------- narrow KV cache elements

// --kv-cache-dtype's caches (engine/attention/kv_dtype.py) as the decode kernel reads them:
// widened in registers as loaded, never copied whole. AVX-512 and AVX2 have no FP8
// arithmetic, so bit moves make an fp16 of each byte, which F16C widens: e5m2 is an fp16's
// top byte; e4m3's 7 exponent-and-mantissa bits put at the top of fp16's 10 mantissa bits
// give value * 2^-8, normals and subnormals alike (fp16's exponent bias is 8 more), so
// kRawScale<E4M3> = 256 is folded into the kernel's two scales instead. The per-layer K/V
// scales come in the same way: K's in the query's scale, V's in the output's.
struct E4M3 { uint8_t v; };
struct E5M2 { uint8_t v; };
struct Half16 { uint16_t v; };
struct I8 { int8_t v; };

inline float half_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}
inline uint16_t e4m3_half_bits(uint8_t b) {
  return static_cast<uint16_t>(((b & 0x7F) << 7) | ((b & 0x80) << 8));
}

template <> struct Elem<E4M3> {
  static inline float load(E4M3 x) { return half_to_float(e4m3_half_bits(x.v)); }
};
template <> struct Elem<E5M2> {
  static inline float load(E5M2 x) { return half_to_float(static_cast<uint16_t>(x.v << 8)); }
};
template <> struct Elem<Half16> {
  static inline float load(Half16 x) { return half_to_float(x.v); }
};
template <> struct Elem<I8> {
  static inline float load(I8 x) { return static_cast<float>(x.v); }
};

template <typename C> constexpr float kRawScale = 1.f;
template <> constexpr float kRawScale<E4M3> = 256.f;

#ifdef __AVX512F__
inline __m128i load_bytes16(const void* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}
inline __m512 load16(const E4M3* p) {
  const __m256i w = _mm256_cvtepu8_epi16(load_bytes16(p));
  const __m256i h = _mm256_or_si256(
      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7),
      _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8));
  return _mm512_cvtph_ps(h);
}
inline __m512 load16(const E5M2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load_bytes16(p)), 8));
}
inline __m512 load16(const Half16* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const I8* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(load_bytes16(p)));
}
#elif defined(SLUICE_AVX2)
inline __m128i load_bytes8(const void* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}
inline __m256 load8(const E4M3* p) {
  const __m128i w = _mm_cvtepu8_epi16(load_bytes8(p));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7),
                                 _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8));
  return _mm256_cvtph_ps(h);
}
inline __m256 load8(const E5M2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load_bytes8(p)), 8));
}
inline __m256 load8(const Half16* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const I8* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(load_bytes8(p)));
}
#endif

// ------------------------------------------------------------------ paged decode attention

// One query token per sequence against its whole context, read from the paged cache in
// place (no gather). One task per (sequence, kv head): the q heads of that kv head's group
// share each loaded key and value row. Scores, softmax and the weighted sum of values are
// float32; the output is rounded once.
// The cache slot of a sequence's t-th token.
// The cache slots of a sequence's tokens 0, 1, 2, ... in turn, without a division per
// token (a 64-bit divide costs more than the token's dot product).
struct SlotWalk {
  const int64_t* pages;
  int64_t page_size;
  int64_t page = 0, offset = 0;
  inline int64_t next() {
    const int64_t slot = pages[page] * page_size + offset;
    if (++offset == page_size) {
      offset = 0;
      ++page;
    }
    return slot;
  }
};

// One (sequence, kv head) task: qf holds the group's q heads, already scaled, as float32
// [group, dim]. Leaves each head's unnormalised output in acc [group, dim] and its softmax
// denominator in total [group]; scores [group, len] is scratch.
template <typename T>
void attend_task(const float* qf, const T* kp, const T* vp, const int64_t* pages, int64_t len,
                 int64_t page_size, int64_t kv_heads, int64_t kvh, int64_t group, int64_t dim,
                 float* scores, float* acc, float* total) {
  SlotWalk keys{pages, page_size};
  for (int64_t t = 0; t < len; ++t) {
    const T* key = kp + (keys.next() * kv_heads + kvh) * dim;
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
  SlotWalk values{pages, page_size};
  for (int64_t t = 0; t < len; ++t) {
    const T* value = vp + (values.next() * kv_heads + kvh) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * Elem<T>::load(value[d]);
    }
  }
}

#ifdef __AVX512F__
// One head's scores -> exp(score - max) in place; returns their sum.
inline float softmax_numerators(float* sg, int64_t len) {
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
  return sum;
}

// attend_task_avx512 for a group of G heads of dim 16 * NV known at compile time: each key
// and value row is loaded and widened once for the whole group instead of once per head.
// Every head's arithmetic is attend_task_avx512's, step for step, so are its bits.
template <typename T, int G, int NV>
void attend_group_avx512(const float* qf, const T* kp, const T* vp, const int64_t* pages,
                         int64_t len, int64_t page_size, int64_t kv_heads, int64_t kvh,
                         float* scores, float* acc, float* total) {
  constexpr int64_t dim = 16 * NV;
  {
    __m512 q[G][NV];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < NV; ++v) q[g][v] = _mm512_loadu_ps(qf + g * dim + 16 * v);
    SlotWalk keys{pages, page_size};
    for (int64_t t = 0; t < len; t += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, len - t));
      __m512 part[G][16];
      for (int j = 0; j < n; ++j) {
        const T* key = kp + (keys.next() * kv_heads + kvh) * dim;
        __m512 k[NV];
        for (int v = 0; v < NV; ++v) k[v] = load16(key + 16 * v);
        for (int g = 0; g < G; ++g) {
          __m512 s = _mm512_mul_ps(q[g][0], k[0]);
          for (int v = 1; v < NV; ++v) s = _mm512_fmadd_ps(q[g][v], k[v], s);
          part[g][j] = s;
        }
      }
      for (int g = 0; g < G; ++g) lane_sums(part[g], n, scores + g * len + t);
    }
  }
  for (int g = 0; g < G; ++g) total[g] = softmax_numerators(scores + g * len, len);
  __m512 o[G][NV];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) o[g][v] = _mm512_setzero_ps();
  SlotWalk values{pages, page_size};
  for (int64_t t = 0; t < len; ++t) {
    const T* value = vp + (values.next() * kv_heads + kvh) * dim;
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16(value + 16 * v);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int v = 0; v < NV; ++v) o[g][v] = _mm512_fmadd_ps(p, x[v], o[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * dim + 16 * v, o[g][v]);
}

// attend_group_avx512 where (group, dim) is one it is compiled for; false otherwise.
template <typename T>
bool attend_group(const float* qf, const T* kp, const T* vp, const int64_t* pages, int64_t len,
                  int64_t page_size, int64_t kv_heads, int64_t kvh, int64_t group, int64_t dim,
                  float* scores, float* acc, float* total) {
  const auto run = [&](auto g, auto nv) {
    attend_group_avx512<T, decltype(g)::value, decltype(nv)::value>(
        qf, kp, vp, pages, len, page_size, kv_heads, kvh, scores, acc, total);
    return true;
  };
  const auto by_group = [&](auto nv) {
    switch (group) {
      case 1: return run(std::integral_constant<int, 1>{}, nv);
      case 2: return run(std::integral_constant<int, 2>{}, nv);
      case 3: return run(std::integral_constant<int, 3>{}, nv);
      case 4: return run(std::integral_constant<int, 4>{}, nv);
      case 6: return run(std::integral_constant<int, 6>{}, nv);
      case 8: return run(std::integral_constant<int, 8>{}, nv);
      default: return false;
    }
  };
  if (dim == 64) return by_group(std::integral_constant<int, 4>{});
  if (dim == 128) return by_group(std::integral_constant<int, 8>{});
  return false;
}

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
    // Sixteen keys' products at a time, their lanes summed together (lane_sums): each
    // score's sum is the same tree wherever the key falls among the sixteen.
    SlotWalk keys{pages, page_size};
    for (int64_t t = 0; t < len; t += 16) {
      const int n = static_cast<int>(std::min<int64_t>(16, len - t));
      __m512 part[16];
      for (int j = 0; j < n; ++j) {
        const T* key = kp + (keys.next() * kv_heads + kvh) * dim;
        __m512 s = _mm512_mul_ps(reg[0], load16(key));
        for (int64_t v = 1; v < nv; ++v) s = _mm512_fmadd_ps(reg[v], load16(key + 16 * v), s);
        part[j] = s;
      }
      lane_sums(part, n, sg + t);
    }
    total[g] = softmax_numerators(sg, len);
    for (int64_t v = 0; v < nv; ++v) reg[v] = _mm512_setzero_ps();
    SlotWalk values{pages, page_size};
    for (int64_t t = 0; t < len; ++t) {
      const T* value = vp + (values.next() * kv_heads + kvh) * dim;
      const __m512 p = _mm512_set1_ps(sg[t]);
      for (int64_t v = 0; v < nv; ++v) reg[v] = _mm512_fmadd_ps(p, load16(value + 16 * v), reg[v]);
    }
    for (int64_t v = 0; v < nv; ++v) _mm512_storeu_ps(acc + g * dim + 16 * v, reg[v]);
  }
}
#endif

#if defined(SLUICE_AVX2)
// The lane sums of n <= 8 vectors at once: out[i] = the sum of v[i]'s 8 lanes (missing
// vectors count as zero). Each vector goes through the same tree wherever it sits.
inline void lane_sums8(const __m256* v, int n, float* out) {
  const __m256 zero = _mm256_setzero_ps();
  const auto at = [&](int i) { return i < n ? v[i] : zero; };
  const __m256 t0 = _mm256_hadd_ps(at(0), at(1)), t1 = _mm256_hadd_ps(at(2), at(3));
  const __m256 t2 = _mm256_hadd_ps(at(4), at(5)), t3 = _mm256_hadd_ps(at(6), at(7));
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 holds vectors 0-3's halves (low 128 bits: lanes 0-3, high: lanes 4-7), u1 4-7's.
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                                    _mm256_permute2f128_ps(u0, u1, 0x31));
  alignas(32) float all[8];
  _mm256_store_ps(all, sums);
  for (int i = 0; i < n; ++i) out[i] = all[i];
}

// One head's scores -> exp(score - max) in place; returns their sum.
inline float softmax_numerators8(float* sg, int64_t len) {
  float top = sg[0];
  for (int64_t t = 1; t < len; ++t) top = std::max(top, sg[t]);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= len; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(top)));
    _mm256_storeu_ps(sg + t, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float sum = hsum8(sum8);
  for (; t < len; ++t) {
    sg[t] = exp_approx(sg[t] - top);
    sum += sg[t];
  }
  return sum;
}

// The group's (up to 8) heads of dim 8 * NV at once, as attend_group_avx512 does: each key
// and value row is loaded and widened once for the whole group; eight keys' products are
// summed together (lane_sums8).
template <typename T, int NV>
void attend_group_avx2(const float* qf, const T* kp, const T* vp, const int64_t* pages,
                       int64_t len, int64_t page_size, int64_t kv_heads, int64_t kvh,
                       int64_t group, float* scores, float* acc, float* total) {
  constexpr int64_t dim = 8 * NV;
  SlotWalk keys{pages, page_size};
  for (int64_t t = 0; t < len; t += 8) {
    const int n = static_cast<int>(std::min<int64_t>(8, len - t));
    __m256 part[8][8];
    for (int j = 0; j < n; ++j) {
      const T* key = kp + (keys.next() * kv_heads + kvh) * dim;
      __m256 k[NV];
      for (int v = 0; v < NV; ++v) k[v] = load8(key + 8 * v);
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qf + g * dim;
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]);
        for (int v = 1; v < NV; ++v) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * v), k[v], s);
        part[g][j] = s;
      }
    }
    for (int64_t g = 0; g < group; ++g) lane_sums8(part[g], n, scores + g * len + t);
  }
  for (int64_t g = 0; g < group; ++g) total[g] = softmax_numerators8(scores + g * len, len);
  __m256 o[8][NV];
  for (int64_t g = 0; g < group; ++g)
    for (int v = 0; v < NV; ++v) o[g][v] = _mm256_setzero_ps();
  SlotWalk values{pages, page_size};
  for (int64_t t = 0; t < len; ++t) {
    const T* value = vp + (values.next() * kv_heads + kvh) * dim;
    __m256 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load8(value + 8 * v);
    for (int64_t g = 0; g < group; ++g) {
      const __m256 p = _mm256_set1_ps(scores[g * len + t]);
      for (int v = 0; v < NV; ++v) o[g][v] = _mm256_fmadd_ps(p, x[v], o[g][v]);
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + g * dim + 8 * v, o[g][v]);
}

// attend_task for dim a multiple of 8 (at most 256), eight lanes at a time: one head of the
// group at a time over all keys, its q and output accumulators in registers (or L1), the
// keys and values it re-reads from L1/L2. Each score is eight lane products summed by hsum8.
template <typename T>
void attend_task_avx2(const float* qf, const T* kp, const T* vp, const int64_t* pages,
                      int64_t len, int64_t page_size, int64_t kv_heads, int64_t kvh,
                      int64_t group, int64_t dim, float* scores, float* acc, float* total) {
  const int64_t nv = dim / 8;
  __m256 reg[32];
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t v = 0; v < nv; ++v) reg[v] = _mm256_loadu_ps(qf + g * dim + 8 * v);
    float* sg = scores + g * len;
    SlotWalk keys{pages, page_size};
    for (int64_t t = 0; t < len; ++t) {
      const T* key = kp + (keys.next() * kv_heads + kvh) * dim;
      __m256 s = _mm256_mul_ps(reg[0], load8(key));
      for (int64_t v = 1; v < nv; ++v) s = _mm256_fmadd_ps(reg[v], load8(key + 8 * v), s);
      sg[t] = hsum8(s);
    }
    total[g] = softmax_numerators8(sg, len);
    for (int64_t v = 0; v < nv; ++v) reg[v] = _mm256_setzero_ps();
    SlotWalk values{pages, page_size};
    for (int64_t t = 0; t < len; ++t) {
      const T* value = vp + (values.next() * kv_heads + kvh) * dim;
      const __m256 p = _mm256_set1_ps(sg[t]);
      for (int64_t v = 0; v < nv; ++v) reg[v] = _mm256_fmadd_ps(p, load8(value + 8 * v), reg[v]);
    }
    for (int64_t v = 0; v < nv; ++v) _mm256_storeu_ps(acc + g * dim + 8 * v, reg[v]);
  }
}
#endif

// T: q's and the output's element, C: the cache's (T, or a narrow one). v_scale multiplies
// the output (a narrow cache's V scale).
template <typename T, typename C>
void decode_attention_rows(const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& page_table,
                           const torch::Tensor& lengths, int64_t page_size, double scale,
                           double v_scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads;
  const int64_t max_pages = page_table.size(1);
  const T* qp = ptr<T>(q);
  const C* kp = ptr<C>(k_cache);
  const C* vp = ptr<C>(v_cache);
  const int64_t* table = page_table.data_ptr<int64_t>();
  const int64_t* lens = lengths.data_ptr<int64_t>();
  T* op = ptr<T>(out);
  const float fscale = static_cast<float>(scale) * kRawScale<C>;
  const float fv_scale = static_cast<float>(v_scale) * kRawScale<C>;
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
      if (attend_group<C>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group, dim,
                          scores.data(), acc.data(), total)) {
        // done: the whole group at once
      } else if (dim % 16 == 0 && dim <= 256) {
        attend_task_avx512<C>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group,
                              dim, scores.data(), acc.data(), total);
      } else
#elif defined(SLUICE_AVX2)
      if (group <= 8 && dim == 64) {
        attend_group_avx2<C, 8>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group,
                                scores.data(), acc.data(), total);
      } else if (group <= 8 && dim == 128) {
        attend_group_avx2<C, 16>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh,
                                 group, scores.data(), acc.data(), total);
      } else if (dim % 8 == 0 && dim <= 256) {
        attend_task_avx2<C>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group,
                            dim, scores.data(), acc.data(), total);
      } else
#endif
      {
        attend_task<C>(qf.data(), kp, vp, pages, len, page_size, kv_heads, kvh, group, dim,
                       scores.data(), acc.data(), total);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * heads + kvh * group + g) * dim;
        const float inv = fv_scale / sums[g];
        for (int64_t d = 0; d < dim; ++d) dst[d] = Elem<T>::store(acc[g * dim + d] * inv);
      }
    }
  });
}

// The cache's element type as decode_attention_rows reads it: q's, or a narrow one
// (--kv-cache-dtype). f(C{}) with C that type.
template <typename T, typename F> void dispatch_cache(const torch::Tensor& cache, F&& f) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn: return f(E4M3{});
    case torch::kFloat8_e5m2: return f(E5M2{});
    case torch::kChar: return f(I8{});
    case torch::kHalf: return f(Half16{});
    case torch::kBFloat16: return f(uint16_t{});
    default: return f(T{});
  }
}

bool cache_dtype_ok(const torch::Tensor& q, const torch::Tensor& cache) {
  const auto t = cache.scalar_type();
  return t == q.scalar_type() || t == torch::kFloat8_e4m3fn || t == torch::kFloat8_e5m2 ||
         t == torch::kChar || t == torch::kHalf ||
         (t == torch::kBFloat16 && q.scalar_type() == torch::kFloat);
}

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                               const torch::Tensor& v_cache, const torch::Tensor& page_table,
                               const torch::Tensor& lengths, int64_t page_size, double scale,
                               double v_scale = 1.0) {
  check_cpu_float(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D], last dim contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && cache_dtype_ok(q, k_cache),
              "the caches must have q's dtype, or both one of float8_e4m3fn, float8_e5m2, "
              "int8, float16 (bfloat16 under float32 q)");
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
    using T = decltype(tag);
    dispatch_cache<T>(k_cache, [&](auto cache_tag) {
      decode_attention_rows<T, decltype(cache_tag)>(q, k_cache, v_cache, page_table, lengths,
                                                    page_size, scale, v_scale, out);
    });
  });
  return out;
}

// ------------------------------------------------------------- GGUF block-quantized linear

// y = x @ W^T with W kept in the GGUF checkpoint's quantized blocks, so a decode step
// streams 4.25 to 11 bits per weight from memory instead of 16 or 32. The checkpoint's
//   Q4_1, 20 bytes / 32 weights: fp16 d, fp16 m, 16 bytes of nibbles; w[j] = d * lo(q[j]) + m
//                   and w[j + 16] = d * hi(q[j]) + m
//   Q8_0, 34 bytes / 32 weights: fp16 d, 32 int8;                     w[j] = d * q[j]
//   MXFP4, 17 bytes / 32 weights: E8M0 e, 16 bytes of e2m1 nibbles; w[j] = 2^(e - 128) *
//                   doubled e2m1 value (gpt-oss's experts)
// and the k-quants of most GGUF files (llama.cpp's ggml-quants.c), 256 weights a block in
// eight sub-blocks of 32:
//   Q4_K, 144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) pairs, 128 bytes of
//                    nibbles;  w = (d * scale) * q - dmin * min
//   Q5_K, 176 bytes: Q4_K's header, 32 bytes of fifth bits, 128 bytes of nibbles; the same w
//   Q6_K, 210 bytes: 128 bytes of low nibbles, 64 of high 2 bits, 16 int8 scales (one per
//                    16 weights), fp16 d;  w = (d * scale) * (q - 32)
// are repacked once at load (`pack_blocks`) into one of five layouts of 32 weights the
// kernel reads fastest (kinds share a layout where their weights fit it):
//   HalfNibbles (Q4_1), 20 bytes: fp16 d, fp16 m, 16 bytes of nibbles in lane order:
//                   weight j is nibble j / 8 of 16-bit word j % 8, so one broadcast and one
//                   variable shift put every weight's nibble in the low bits of its 16-bit
//                   lane; w = d * q + m. As many bytes as the GGUF block: a decode step
//                   streams no more than llama.cpp does.
//   Nibbles (Q4_K), 24 bytes: HalfNibbles with float32 d and m (a k-quant's d * scale is
//                   not an fp16)
//   Bytes (Q8_0), 34 bytes: fp16 d, 32 int8 (the GGUF block itself); w = d * q
//   ScaledBytes (Q5_K, Q6_K), 44 bytes: float32 d0 (weights 0-15), float32 d1 (16-31),
//                   float32 m, 32 int8; w = d0|d1 * q + m
//   Fp4 (MXFP4), 17 bytes: the GGUF block itself, 4.25 bits a weight (gpt-oss's experts are
//                   most of its bytes); w = 2^(e - 128) * kE2m1[code]: a 16-entry table
//                   looked up in registers (vpermps; pshufb on AVX2), times the block's
//                   power of two
// fp16 scales widen exactly (F16C), so both forms of a scale give the same float32 weights.
// A k-quant's d is the product of its fp16 super-block scale and its integer sub-block scale
// (exact in float32), its m minus dmin times the sub-block min (exact): so every weight is
// d * q (exact: at most 23 significant bits) plus m in one rounding, the very float32 the
// GGUF reference computes. Sums are float32 in a fixed order per output whatever the batch,
// so a row's result does not depend on its neighbours.
constexpr int64_t kBlock = 32;
enum Kind : int64_t { kQ4_1 = 0, kQ8_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kMXFP4 = 5 };
enum Layout : int64_t { kNibbles = 0, kBytes = 1, kScaledBytes = 2, kHalfNibbles = 3, kFp4 = 4 };

void check_kind(int64_t kind) {
  TORCH_CHECK(kind >= kQ4_1 && kind <= kMXFP4,
              "kind must be 0 (Q4_1), 1 (Q8_0), 2 (Q4_K), 3 (Q5_K), 4 (Q6_K) or 5 (MXFP4)");
}

inline Layout layout_of(int64_t kind) {
  return kind == kQ4_1 ? kHalfNibbles : kind == kQ4_K ? kNibbles
       : kind == kQ8_0 ? kBytes : kind == kMXFP4 ? kFp4 : kScaledBytes;
}

// A GGUF block of `kind`: its bytes, and the weights it holds.
inline int64_t gguf_block_bytes(int64_t kind) {
  constexpr int64_t bytes[] = {20, 34, 144, 176, 210, 17};
  return bytes[kind];
}
inline int64_t gguf_block_weights(int64_t kind) {
  return kind <= kQ8_0 || kind == kMXFP4 ? 32 : 256;
}

constexpr int64_t layout_bytes(int64_t layout) {
  return layout == kHalfNibbles ? 20 : layout == kNibbles ? 24 : layout == kBytes ? 34
       : layout == kFp4 ? 17 : 44;
}

// MXFP4's e2m1 codes as ggml keeps them, doubled (integers; code 8, -0, is +0 as there), and
// its E8M0 scale halved to match: 2^(e - 128), built from its bits (a denormal for e < 2),
// so every weight d * kE2m1[code] is exact in float32.
alignas(64) constexpr float kE2m1[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float mx_scale(uint8_t e) {
  const uint32_t bits = e >= 2 ? static_cast<uint32_t>(e - 1) << 23 : 0x00200000u << e;
  float d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// The layouts with nibbles: where d, m and the nibbles lie, and how wide the scales are.
template <int64_t LAYOUT> struct NibbleBlock {
  static constexpr bool half = LAYOUT == kHalfNibbles;
  static constexpr int64_t nibbles = half ? 4 : 8;  // offset of the 16 bytes of nibbles
};
constexpr bool has_nibbles(int64_t layout) { return layout == kNibbles || layout == kHalfNibbles; }
inline int64_t packed_block_bytes(int64_t kind) { return layout_bytes(layout_of(kind)); }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float float_at(const uint8_t* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline uint16_t half_bits(float f) { return c10::Half(f).x; }  // exact for an fp16's value

// A block's d (and m, where it has one) as float32, from float32 or fp16 scales.
template <int64_t LAYOUT> inline float scale_d(const uint8_t* blk) {
  return LAYOUT == kHalfNibbles || LAYOUT == kBytes ? half_at(blk) : float_at(blk);
}
template <int64_t LAYOUT> inline float scale_m(const uint8_t* blk) {
  return LAYOUT == kHalfNibbles ? half_at(blk + 2) : float_at(blk + 4);
}

#ifdef SLUICE_VEC
// A block's fp16 d (lane 0) and m (lane 1, HalfNibbles) as float32, F16C's exact widening;
// for the float32 layouts, its first two floats as they are.
template <int64_t LAYOUT> inline __m128 scales_dm(const uint8_t* blk) {
  if constexpr (LAYOUT == kHalfNibbles || LAYOUT == kBytes) {
    uint32_t bits = 0;
    std::memcpy(&bits, blk, LAYOUT == kBytes ? 2 : 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits)));
  } else {
    return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk)));
  }
}

// d and m broadcast to every lane of V (__m256 or __m512): the float32 layouts straight
// from memory, the fp16 ones widened once.
template <int64_t LAYOUT, typename V> inline void broadcast_dm(const uint8_t* blk, V& d, V& m) {
  constexpr bool half = LAYOUT == kHalfNibbles || LAYOUT == kBytes;
#ifdef __AVX512F__
  if constexpr (std::is_same_v<V, __m512>) {
    const __m128 dm = half ? scales_dm<LAYOUT>(blk) : _mm_setzero_ps();
    d = half ? _mm512_broadcastss_ps(dm) : _mm512_set1_ps(float_at(blk));
    m = half ? _mm512_broadcastss_ps(_mm_movehdup_ps(dm)) : _mm512_set1_ps(float_at(blk + 4));
    return;
  }
#endif
  if constexpr (std::is_same_v<V, __m256>) {
    const __m128 dm = half ? scales_dm<LAYOUT>(blk) : _mm_setzero_ps();
    d = half ? _mm256_broadcastss_ps(dm) : _mm256_set1_ps(float_at(blk));
    m = half ? _mm256_broadcastss_ps(_mm_movehdup_ps(dm)) : _mm256_set1_ps(float_at(blk + 4));
  }
}
#endif

// The index (0..15) of weight j of a packed Nibbles block.
inline int q4_1_index(const uint8_t* nibbles, int j) {
  uint16_t word;
  std::memcpy(&word, nibbles + 2 * (j % 8), sizeof word);
  return (word >> (4 * (j / 8))) & 0xF;
}

// 32 weights as the GGUF block gives them: w[j] = d[j / 16] * q[j] + m.
struct Unit {
  float d[2];
  float m;
  int q[32];
};

// Q4_K's and Q5_K's 6-bit scale and min of sub-block i (llama.cpp's get_scale_min_k4).
inline void k_scale_min(const uint8_t* s, int i, int& scale, int& min) {
  if (i < 4) {
    scale = s[i] & 63;
    min = s[i + 4] & 63;
  } else {
    scale = (s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4);
    min = (s[i + 4] >> 4) | ((s[i] >> 6) << 4);
  }
}

// One GGUF block of `kind` into its gguf_block_weights / 32 units.
void decode_block(int64_t kind, const uint8_t* in, Unit* units) {
  if (kind == kMXFP4) {
    // E8M0 exponent e, then 16 bytes of e2m1 nibbles (low: weights 0-15, high: 16-31).
    // ggml keeps the e2m1 values doubled (integers) and halves the scale: 2^(e - 128),
    // a float32 (a denormal for e < 2) exactly, so d * q is exact.
    static constexpr int kValues[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    Unit& u = units[0];
    u.d[0] = u.d[1] = std::ldexp(1.0f, static_cast<int>(in[0]) - 128);
    u.m = 0.f;
    for (int j = 0; j < 16; ++j) {
      u.q[j] = kValues[in[1 + j] & 0xF];
      u.q[j + 16] = kValues[in[1 + j] >> 4];
    }
    return;
  }
  if (kind == kQ4_1 || kind == kQ8_0) {
    Unit& u = units[0];
    u.d[0] = u.d[1] = half_at(in);
    u.m = kind == kQ4_1 ? half_at(in + 2) : 0.f;
    for (int j = 0; j < 32; ++j)
      u.q[j] = kind == kQ8_0 ? static_cast<int8_t>(in[2 + j])
                             : (j < 16 ? in[4 + j] & 0xF : in[4 + j - 16] >> 4);
    return;
  }
  if (kind == kQ6_K) {
    const uint8_t *ql = in, *qh = in + 128;
    const auto* scales = reinterpret_cast<const int8_t*>(in + 192);
    const float d = half_at(in + 208);
    for (int w = 0; w < 256; ++w) {
      const int h = w / 128, l = w % 128;
      const int low = l < 64 ? ql[64 * h + l] & 0xF : ql[64 * h + l - 64] >> 4;
      const int high = (qh[32 * h + l % 32] >> (2 * (l / 32))) & 3;
      units[w / 32].q[w % 32] = (low | (high << 4)) - 32;
    }
    for (int i = 0; i < 8; ++i) {
      units[i].d[0] = d * scales[2 * i];
      units[i].d[1] = d * scales[2 * i + 1];
      units[i].m = 0.f;
    }
    return;
  }
  // Q4_K, Q5_K: sub-block i holds the low (even i) or high (odd i) nibbles of 32 bytes.
  const float d = half_at(in), dmin = half_at(in + 2);
  const uint8_t* scales = in + 4;
  const uint8_t* qh = in + 16;  // Q5_K: bit i of byte j is weight j of sub-block i's fifth
  const uint8_t* qs = in + (kind == kQ5_K ? 48 : 16);
  for (int i = 0; i < 8; ++i) {
    int scale, min;
    k_scale_min(scales, i, scale, min);
    Unit& u = units[i];
    u.d[0] = u.d[1] = d * scale;
    u.m = -(dmin * min);
    for (int j = 0; j < 32; ++j) {
      u.q[j] = (qs[32 * (i / 2) + j] >> (4 * (i % 2))) & 0xF;
      if (kind == kQ5_K) u.q[j] |= ((qh[j] >> i) & 1) << 4;
    }
  }
}

// One unit into its packed layout (see above).
// (The fp16 layouts hold only Q4_1 and Q8_0 units, whose d and m came from fp16 values.)
void pack_unit(Layout layout, const Unit& u, uint8_t* out) {
  if (has_nibbles(layout)) {
    int64_t at = 8;
    if (layout == kHalfNibbles) {
      const uint16_t dm[2] = {half_bits(u.d[0]), half_bits(u.m)};
      std::memcpy(out, dm, 4);
      at = 4;
    } else {
      std::memcpy(out, &u.d[0], 4);
      std::memcpy(out + 4, &u.m, 4);
    }
    uint16_t words[8] = {0};
    for (int j = 0; j < 32; ++j) words[j % 8] |= static_cast<uint16_t>(u.q[j] << (4 * (j / 8)));
    std::memcpy(out + at, words, 16);
    return;
  }
  if (layout == kBytes) {
    const uint16_t d = half_bits(u.d[0]);
    std::memcpy(out, &d, 2);
  } else {
    std::memcpy(out, &u.d[0], 4);
  }
  int8_t* q = reinterpret_cast<int8_t*>(out + (layout == kBytes ? 2 : 12));
  if (layout == kScaledBytes) {
    std::memcpy(out + 4, &u.d[1], 4);
    std::memcpy(out + 8, &u.m, 4);
  }
  for (int j = 0; j < 32; ++j) q[j] = static_cast<int8_t>(u.q[j]);
}

// GGUF blocks of `kind` in the layout quantized_linear reads for `as_kind` (-1: kind's own).
// ScaledBytes (Q5_K's and Q6_K's) takes every kind's weights exactly, so the parts of a
// fused weight whose kinds differ (Q4_K_M's Q4_K q, k beside its Q6_K v) can share it.
torch::Tensor pack_blocks(const torch::Tensor& gguf, int64_t kind, int64_t as_kind) {
  check_kind(kind);
  if (as_kind < 0) as_kind = kind;
  check_kind(as_kind);
  const Layout layout = layout_of(as_kind);
  TORCH_CHECK(layout == layout_of(kind) || layout == kScaledBytes, "blocks of kind ", kind,
              " cannot be packed as kind ", as_kind, ": only kinds 3 and 4 take every kind");
  TORCH_CHECK(gguf.scalar_type() == torch::kUInt8 && gguf.is_contiguous() && gguf.dim() == 2 &&
                  gguf.size(1) % gguf_block_bytes(kind) == 0,
              "blocks must be contiguous uint8 [out, in / block weights * block bytes]");
  const int64_t rows = gguf.size(0), nb = gguf.size(1) / gguf_block_bytes(kind);
  const int64_t units = gguf_block_weights(kind) / kBlock;  // 32-weight units per block
  auto packed = torch::empty({rows, nb * units * layout_bytes(layout)}, gguf.options());
  const uint8_t* src = gguf.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  if (layout == kFp4) {  // the GGUF block is the layout: a plain copy
    std::memcpy(dst, src, gguf.numel());
    return packed;
  }
  at::parallel_for(0, rows * nb, 256, [&](int64_t begin, int64_t end) {
    Unit unit[8];
    for (int64_t i = begin; i < end; ++i) {
      decode_block(kind, src + i * gguf_block_bytes(kind), unit);
      for (int64_t u = 0; u < units; ++u)
        pack_unit(layout, unit[u], dst + (i * units + u) * layout_bytes(layout));
    }
  });
  return packed;
}

// Where a linear's weights come from, as one "weight row" policy per layout, so the packed
// GGUF blocks and a dense bfloat16 or float32 weight share one set of dot products and one
// driver: a row's sum is the same code, in the same order, whichever layout feeds it.
//   Quant<LAYOUT>: a pack_blocks row (layout_bytes per block of 32 weights)
//   Dense<T>:    a dense row of T (32 weights a block)
template <int64_t LAYOUT> struct Quant {
  static constexpr int64_t block_bytes = layout_bytes(LAYOUT);
  static inline float weight(const uint8_t* blk, int j) {
    if constexpr (has_nibbles(LAYOUT))
      return scale_d<LAYOUT>(blk) * q4_1_index(blk + NibbleBlock<LAYOUT>::nibbles, j) +
             scale_m<LAYOUT>(blk);
    else if constexpr (LAYOUT == kBytes)
      return scale_d<LAYOUT>(blk) * static_cast<int8_t>(blk[2 + j]);
    else if constexpr (LAYOUT == kFp4)
      return mx_scale(blk[0]) * kE2m1[j < 16 ? blk[1 + j] & 0xF : blk[1 + j - 16] >> 4];
    else
      return float_at(blk + 4 * (j / 16)) * static_cast<int8_t>(blk[12 + j]) + float_at(blk + 8);
  }
};

template <typename T> struct Dense {
  static constexpr int64_t block_bytes = kBlock * sizeof(T);
  static inline float weight(const uint8_t* blk, int j) {
    return Elem<T>::load(reinterpret_cast<const T*>(blk)[j]);
  }
};

// The scalar definition: one weight row against rows of x (float32 [rows, K]).
template <typename W>
void dot_scalar(const float* x, int64_t rows, int64_t k, const uint8_t* wrow, float* result) {
  const int64_t nb = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    float total = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = wrow + b * W::block_bytes;
      float part = 0.f;
      for (int j = 0; j < kBlock; ++j) part += xr[b * kBlock + j] * W::weight(blk, j);
      total += part;
    }
    result[r] = total;
  }
}

#ifdef __AVX512F__
// Shift per 16-bit lane that brings weight j's nibble to the low bits (lane order above).
inline __m512i q4_1_lane_shifts() {
  return _mm512_set_epi16(12, 12, 12, 12, 12, 12, 12, 12, 8, 8, 8, 8, 8, 8, 8, 8,
                          4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
}

// The block's 32 nibbles, each in the low 4 bits of its 16-bit lane (higher bits: junk).
template <int64_t LAYOUT>
inline __m512i q4_1_nibbles(const uint8_t* blk) {
  const __m512i words = _mm512_broadcast_i32x4(_mm_loadu_si128(
      reinterpret_cast<const __m128i*>(blk + NibbleBlock<LAYOUT>::nibbles)));
  return _mm512_srlv_epi16(words, q4_1_lane_shifts());
}

// A block's 32 weights as float32, low and high 16 (exact: see the layouts above).
template <int64_t LAYOUT>
inline void block_f32(const uint8_t* blk, __m512& lo, __m512& hi) {
  if constexpr (LAYOUT == kFp4) {
    // Byte j: weight j's code (low nibble), weight j + 16's (high); vpermps reads 4 bits.
    // The table is scaled once per block (each d * value exact), then looked up twice.
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(mx_scale(blk[0])), _mm512_load_ps(kE2m1));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(blk + 1)));
    lo = _mm512_permutexvar_ps(codes, table);
    hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), table);
    return;
  }
  __m512 d, m;
  broadcast_dm<LAYOUT>(blk, d, m);  // m: the nibble layouts' only
  if constexpr (has_nibbles(LAYOUT)) {
    const __m512i q = _mm512_and_si512(q4_1_nibbles<LAYOUT>(blk), _mm512_set1_epi16(0xF));
    // d * q exact, then one rounding for + m: the reference's d * q + m.
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(q))), m);
    hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(q, 1))), m);
  } else if constexpr (LAYOUT == kBytes) {
    lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)))));
    hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)))));
  } else {
    // d * q exact, then one rounding for + m, as for Q4_1.
    const __m512 m = _mm512_set1_ps(float_at(blk + 8));
    lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 12)))), m);
    hi = _mm512_fmadd_ps(_mm512_set1_ps(float_at(blk + 4)),
                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                             _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 28)))), m);
  }
}

template <typename W> struct BlockF32;
template <int64_t LAYOUT> struct BlockF32<Quant<LAYOUT>> {
  static inline void load(const uint8_t* blk, __m512& lo, __m512& hi) { block_f32<LAYOUT>(blk, lo, hi); }
};
template <typename T> struct BlockF32<Dense<T>> {
  static inline void load(const uint8_t* blk, __m512& lo, __m512& hi) {
    const T* w = reinterpret_cast<const T*>(blk);
    lo = load16(w);
    hi = load16(w + 16);
  }
};

// The R x C accumulators' sums into result [R, result_stride].
template <int R, int C>
inline void store_sums(__m512 (&acc)[R][C], float* result, int64_t result_stride) {
  constexpr int n = R * C;
  float sums[n];
  const __m512* flat = &acc[0][0];
  for (int i = 0; i < n; i += 16) lane_sums(flat + i, std::min(16, n - i), sums + i);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) result[r * result_stride + c] = sums[r * C + c];
}

// float32 path: exact weights. A tile of R rows of x against C weight rows: each weight
// block is unpacked once for the R rows, each x block loaded once for the C weight rows,
// and every output has one accumulator, fed block by block in order (low then high half).
template <typename W, int R, int C>
void tile_f32(const float* x, int64_t k, const uint8_t* wrow, int64_t row_bytes, float* result,
              int64_t result_stride) {
  const int64_t nb = k / kBlock;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[C], hi[C];
    for (int c = 0; c < C; ++c) BlockF32<W>::load(wrow + c * row_bytes + b * W::block_bytes, lo[c], hi[c]);
    for (int r = 0; r < R; ++r) {
      const __m512 xlo = _mm512_loadu_ps(x + r * k + b * kBlock);
      const __m512 xhi = _mm512_loadu_ps(x + r * k + b * kBlock + 16);
      for (int c = 0; c < C; ++c) {
        acc[r][c] = _mm512_fmadd_ps(lo[c], xlo, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(hi[c], xhi, acc[r][c]);
      }
    }
  }
  store_sums(acc, result, result_stride);
}
#endif

#if defined(SLUICE_AVX2)
// The AVX2 + FMA float32 path (x86-64-v3: AMD Zen 3, Intel before AVX-512): tile_f32's
// arithmetic, bit for bit, in 8-wide registers. Each output keeps two accumulators, lanes
// 0-7 and 8-15 of tile_f32's one, fed the same products in the same order (weights 0-7 and
// 16-23 into the first, 8-15 and 24-31 into the second), and sum8x2 adds the sixteen lanes
// in lane_sums' tree. So the AVX2 and AVX-512 builds give the same float32 sums.

// Lanes i + 8, then + 4, + 2, + 1 of the 16 lanes (lo, hi): lane_sums' tree for one vector.
inline float sum8x2(__m256 lo, __m256 hi) {
  const __m256 s8 = _mm256_add_ps(lo, hi);
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// A block's 32 weights as float32, eight at a time (w[v] = weights 8v .. 8v + 7), the values
// block_f32 gives.
template <typename W> struct BlockF32x8;
template <int64_t LAYOUT> struct BlockF32x8<Quant<LAYOUT>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    __m256 d, m;
    broadcast_dm<LAYOUT>(blk, d, m);
    // The eight 16-bit words: weight 8v + i is nibble v of word i (the packed lane order).
    const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(blk + NibbleBlock<LAYOUT>::nibbles)));
    const __m256i low4 = _mm256_set1_epi32(0xF);
    w[0] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(words, low4)), m);
    w[1] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 4), low4)), m);
    w[2] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, 8), low4)), m);
    w[3] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 12)), m);
  }
};
template <> struct BlockF32x8<Quant<kBytes>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    __m256 d, unused;
    broadcast_dm<kBytes>(blk, d, unused);
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * v)))));
  }
};
template <> struct BlockF32x8<Quant<kScaledBytes>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    const __m256 m = _mm256_set1_ps(float_at(blk + 8));
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_fmadd_ps(_mm256_set1_ps(float_at(blk + 4 * (v / 2))),
                             _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                                 reinterpret_cast<const __m128i*>(blk + 12 + 8 * v)))), m);
  }
};
template <> struct BlockF32x8<Quant<kFp4>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    // pshufb looks the 32 codes up as int8 (kE2m1's integers), which widen and scale as
    // Q8_0's bytes do: the AVX-512 path's values (d * value exact either way).
    const __m128i table = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 1));
    const __m128i q[2] = {_mm_shuffle_epi8(table, _mm_and_si128(raw, low4)),  // weights 0-15
                          _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(raw, 4), low4))};
    const __m256 d = _mm256_set1_ps(mx_scale(blk[0]));
    for (int v = 0; v < 4; ++v) {  // weights 8v .. 8v + 7
      const __m128i part = v % 2 ? _mm_srli_si128(q[v / 2], 8) : q[v / 2];
      w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)));
    }
  }
};
template <> struct BlockF32x8<Dense<float>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    const float* p = reinterpret_cast<const float*>(blk);
    for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(p + 8 * v);
  }
};
// bfloat16 -> float32 is a 16-bit shift: the weights stay bfloat16 in memory (half the
// bytes a decode step streams) and widen here.
template <> struct BlockF32x8<Dense<uint16_t>> {
  static inline void load(const uint8_t* blk, __m256 (&w)[4]) {
    const __m128i* p = reinterpret_cast<const __m128i*>(blk);
    for (int v = 0; v < 4; ++v)
      w[v] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + v)), 16));
  }
};

// R rows of x against C weight rows (tile_f32's scheme); 2 * R * C accumulators, so the
// caller keeps R * C <= 6 (16 ymm registers).
template <typename W, int R, int C>
void tile_f32x8_part(const float* x, int64_t k, const uint8_t* wrow, int64_t row_bytes,
                     float* result, int64_t result_stride) {
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k / kBlock; ++b) {
    for (int c = 0; c < C; ++c) {
      __m256 w[4];
      BlockF32x8<W>::load(wrow + c * row_bytes + b * W::block_bytes, w);
      for (int r = 0; r < R; ++r) {
        const float* xb = x + r * k + b * kBlock;
        lo[r][c] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), hi[r][c]);
        lo[r][c] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), hi[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) result[r * result_stride + c] = sum8x2(lo[r][c], hi[r][c]);
}

// tile_f32 for AVX2: the C weight rows in groups that fit the registers (each output's sum
// is the same whatever group it falls in).
template <typename W, int R, int C>
void tile_f32(const float* x, int64_t k, const uint8_t* wrow, int64_t row_bytes, float* result,
              int64_t result_stride) {
  constexpr int group = std::max(1, 6 / R);
  constexpr int first = std::min(group, C);
  tile_f32x8_part<W, R, first>(x, k, wrow, row_bytes, result, result_stride);
  if constexpr (C > first)
    tile_f32<W, R, C - first>(x, k, wrow + first * row_bytes, row_bytes, result + first,
                              result_stride);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bfloat16 path multiplies by exactly the bfloat16 weights the dense model holds,
// round(w) with w as above, so it agrees with oneDNN's matmul over those weights up to
// summation order; vdpbf16ps takes 32 exact bf16 x bf16 products per instruction. A Q4_1
// block has 16 distinct weights: round(d * i + m), i = 0..15, is a table that vpermw
// indexes with the nibbles (it reads 5 index bits, so the table is there twice).
constexpr bool kHasBf16Dot = true;

template <int64_t LAYOUT>
inline __m512i q4_1_weights_bf16(const uint8_t* blk) {
  const __m512 steps = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512 d, m;
  broadcast_dm<LAYOUT>(blk, d, m);
  const __m512 w = _mm512_fmadd_ps(d, steps, m);
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(w, w);
  return _mm512_permutexvar_epi16(q4_1_nibbles<LAYOUT>(blk), table);
}

template <int64_t LAYOUT>
inline __m512i bytes_weights_bf16(const uint8_t* blk) {
  __m512 lo, hi;
  block_f32<LAYOUT>(blk, lo, hi);
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

template <typename W> struct BlockBf16;
template <int64_t LAYOUT> struct BlockBf16<Quant<LAYOUT>> {
  static inline __m512i load(const uint8_t* blk) {
    if constexpr (has_nibbles(LAYOUT)) return q4_1_weights_bf16<LAYOUT>(blk);
    else return bytes_weights_bf16<LAYOUT>(blk);
  }
};
template <> struct BlockBf16<Dense<uint16_t>> {
  static inline __m512i load(const uint8_t* blk) { return _mm512_loadu_si512(blk); }
};

// The tile_f32 scheme with 32 bf16 x bf16 products per instruction.
template <typename W, int R, int C>
void tile_bf16(const uint16_t* x, int64_t k, const uint8_t* wrow, int64_t row_bytes,
               float* result, int64_t result_stride) {
  const int64_t nb = k / kBlock;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[C];
    for (int c = 0; c < C; ++c) w[c] = BlockBf16<W>::load(wrow + c * row_bytes + b * W::block_bytes);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * k + b * kBlock);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)w[c]);
    }
  }
  store_sums(acc, result, result_stride);
}
#else
constexpr bool kHasBf16Dot = false;
#endif

// A column tile's weights [cols, k] unpacked into `out` in the type the dot products take
// (bfloat16 bits, or float32): the values the tile kernels read block by block.
template <typename W, typename U>
void unpack_cols(const uint8_t* wrow, int64_t row_bytes, int64_t cols, int64_t k, U* out) {
#ifdef __AVX512F__
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      const uint8_t* blk = wrow + c * row_bytes + b * W::block_bytes;
      U* dst = out + c * k + b * kBlock;
      if constexpr (std::is_same_v<U, uint16_t>) {
#if defined(__AVX512BF16__)
        _mm512_storeu_si512(dst, BlockBf16<W>::load(blk));
#endif
      } else {
        __m512 lo, hi;
        BlockF32<W>::load(blk, lo, hi);
        _mm512_storeu_ps(dst, lo);
        _mm512_storeu_ps(dst + 16, hi);
      }
    }
  }
#elif defined(SLUICE_AVX2)
  static_assert(std::is_same_v<U, float>, "AVX2 has no bfloat16 dot products");
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t b = 0; b < k / kBlock; ++b) {
      __m256 w[4];
      BlockF32x8<W>::load(wrow + c * row_bytes + b * W::block_bytes, w);
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(out + c * k + b * kBlock + 8 * v, w[v]);
    }
  }
#endif
}

// Register tiles: up to kTileRows rows of x by kTileCols weight rows (24 accumulators).
constexpr int kTileRows = 4;
constexpr int kTileCols = 6;

// Calls tile<R, C>() with R = rows and C = cols known at compile time (1..4, 1..6).
template <typename Tile>
void with_tile_shape(int64_t rows, int64_t cols, Tile tile) {
  const auto by_cols = [&](auto r) {
    switch (cols) {
      case 6: return tile(r, std::integral_constant<int, 6>{});
      case 5: return tile(r, std::integral_constant<int, 5>{});
      case 4: return tile(r, std::integral_constant<int, 4>{});
      case 3: return tile(r, std::integral_constant<int, 3>{});
      case 2: return tile(r, std::integral_constant<int, 2>{});
      default: return tile(r, std::integral_constant<int, 1>{});
    }
  };
  switch (rows) {
    case 4: return by_cols(std::integral_constant<int, 4>{});
    case 3: return by_cols(std::integral_constant<int, 3>{});
    case 2: return by_cols(std::integral_constant<int, 2>{});
    default: return by_cols(std::integral_constant<int, 1>{});
  }
}

// Rows of x taken per pass over the weights: they stay in L2 while the weights stream by.
constexpr int64_t kRowTile = 64;

// y = x @ W^T, W's rows in layout W. Each output is one dot product in a fixed order, the
// same in every tile shape, so a row of y depends on its row of x alone, never on how many
// rows came with it; the work is split over outputs (never over the sum) for the same reason.
template <typename T, typename W>
void linear_rows(const torch::Tensor& x, const uint8_t* wp, int64_t row_bytes, int64_t n_out,
                 torch::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1);
  T* op = ptr<T>(out);
  // float32 x for the float32 path (a copy only when x is bfloat16 and no bf16 kernel).
  std::vector<float> xf;
  constexpr bool bf16_dot = std::is_same_v<T, uint16_t> && kHasBf16Dot;
  if constexpr (!bf16_dot) {
    xf.resize(rows * k);
    const T* xp = ptr<T>(x);
    for (int64_t i = 0; i < rows * k; ++i) xf[i] = Elem<T>::load(xp[i]);
  }
  // One column tile (up to kTileCols weight rows, layout L at wrow) against every row of
  // the row tile, into result [tile_rows, kTileCols].
  const auto col_tile = [&](auto layout, const uint8_t* wrow, int64_t rb, int64_t cols,
                            int64_t tile, int64_t tile_rows, float* result) {
    using L = decltype(layout);
    for (int64_t r = 0; r < tile_rows; r += kTileRows) {
      const int64_t rs = std::min<int64_t>(kTileRows, tile_rows - r);
      float* res = result + r * kTileCols;
      with_tile_shape(rs, cols, [&](auto R, auto C) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if constexpr (bf16_dot) {
          tile_bf16<L, R.value, C.value>(ptr<uint16_t>(x) + (tile + r) * k, k, wrow, rb, res,
                                         kTileCols);
          return;
        }
#endif
        const float* xr = xf.data() + (tile + r) * k;
#if defined(__AVX512F__) || defined(SLUICE_AVX2)
        if constexpr (!bf16_dot) tile_f32<L, R.value, C.value>(xr, k, wrow, rb, res, kTileCols);
#else
        for (int c = 0; c < C.value; ++c)
          for (int i = 0; i < R.value; ++i)
            dot_scalar<L>(xr + i * k, 1, k, wrow + c * rb, res + i * kTileCols + c);
#endif
      });
    }
  };
  // Quantized weights are unpacked once per column tile when more than one register tile of
  // rows reuses them; the dot products then read the very values they would have unpacked.
  using Unpacked = std::conditional_t<bf16_dot, uint16_t, float>;
#if defined(__AVX512F__) || defined(SLUICE_AVX2)
  constexpr bool unpack = !std::is_same_v<W, Dense<T>>;
#else
  constexpr bool unpack = false;
#endif
  const int64_t col_tiles = (n_out + kTileCols - 1) / kTileCols;
  for (int64_t tile = 0; tile < rows; tile += kRowTile) {
    const int64_t tile_rows = std::min(kRowTile, rows - tile);
    at::parallel_for(0, col_tiles, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> result(tile_rows * kTileCols);
      std::vector<Unpacked> scratch;
      for (int64_t ct = begin; ct < end; ++ct) {
        const int64_t n = ct * kTileCols, cols = std::min<int64_t>(kTileCols, n_out - n);
        const uint8_t* wrow = wp + n * row_bytes;
        // Ask for the next column tile's weights now, so memory streams while this one
        // computes (a decode step is bound by reading the weights).
        if (ct + 1 < end) {
          const char* ahead = reinterpret_cast<const char*>(wrow + kTileCols * row_bytes);
          const int64_t next = std::min<int64_t>(kTileCols, n_out - n - kTileCols) * row_bytes;
          for (int64_t off = 0; off < next; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        if (unpack && tile_rows > kTileRows) {
          scratch.resize(kTileCols * k);
          unpack_cols<W>(wrow, row_bytes, cols, k, scratch.data());
          col_tile(Dense<Unpacked>{}, reinterpret_cast<const uint8_t*>(scratch.data()),
                   k * sizeof(Unpacked), cols, tile, tile_rows, result.data());
        } else {
          col_tile(W{}, wrow, row_bytes, cols, tile, tile_rows, result.data());
        }
        for (int64_t r = 0; r < tile_rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            op[(tile + r) * n_out + n + c] = Elem<T>::store(result[r * kTileCols + c]);
      }
    });
  }
}

// -------------------------------------------------- int16 activations (Q4_1 and Q8_0 blocks)
// llama.cpp's lever with these blocks, at 16 bits where it takes 8: each row of x is rounded
// to int16 once per linear, per group of 4 values (d = max|x| / 32767, q = round-to-nearest-
// even(x * 32767 / max|x|)), and a weight block times an x block is one integer dot product
// whose eight int32 lanes are the eight groups' sums, each scaled by its own d:
//   Q4_1 (w = d_w * q_w + m_w): d_w * sum_g d_g * sum_g(q_w * q) + m_w * s
//   Q8_0 (w = d_w * q_w):       d_w * sum_g d_g * sum_g(q_w * q)
// with s = sum_g d_g * sum_g(q). The weights widen to int16 in the order x is stored (Q4_1:
// a broadcast, two shifts and two masks per 32; Q8_0: two sign extensions) and vpmaddwd
// (AVX2) or vpdpwssd (AVX512-VNNI) take 16 products an instruction, where the float path
// converts every weight to float32 and pays an FMA per product. A group is the 4 values one
// int32 lane sums: values 2g, 2g+1 (the first vpmaddwd's lane g) and 2g+16, 2g+17 (the
// second's). The integer sums are exact (|q_w| <= 128, |q| <= 32767: a lane's four products
// stay under 2^24), so both builds give the same bits. The only loss is x's rounding, at
// most max|x| / 65534 of its group per value (2^-16 of the group's largest; an int8 rounding
// moved 258 times more, and speculative decoding's verify logprobs 0.04 off one-row
// decoding's): the result is the exact product of the weights with x rounded so, up to
// float32 rounding of the per-block terms and their sum (tests/unit/test_int16_linear.py
// states both bounds). (Two int8 terms per value, x ~ d (q_hi + q_lo / 256), are as precise;
// on AVX2 they take the same count of instructions per block, more of them multiplies.)
// Each output keeps one eight-lane float32 accumulator: block by block, the eight int32
// group sums, each times d_w * its group's d; its lanes are added in a fixed tree at the
// end, then Q4_1's sum of m_w * s (eight blocks a vector; rows pad to a multiple of eight
// blocks with zeros, which add exactly zero). Every output runs that same sequence whatever
// the tile or the batch, so a row's result depends on its row of x alone (batch
// invariance).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kHasInt16Dot = true;
constexpr int64_t kGroup = 8;  // blocks per vector of the m_w * s sums (rows pad to it)

// 8 values of x as float32 (bfloat16 widens exactly by a shift).
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The eight lanes' sum: lanes i + 4, then + 2, + 1.
inline float sum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// x's rows rounded to int16 per group of 4 values (see above), each row padded with zero
// blocks to a multiple of kGroup blocks; d holds a block's 8 group scales (lane g: group g).
struct RowsQ16 {
  int64_t blocks = 0;     // per row, padded
  std::vector<int16_t> q; // [rows, blocks * 32], in x's order
  std::vector<float> d;   // [rows, blocks * 8]
  std::vector<float> s;   // [rows, blocks]: sum over groups of d * sum(q)
};

// One block of 32 values: q, its 8 group scales d and s.
template <typename T>
inline void quantize_block(const T* x, int16_t* q, float* d, float& s) {
  __m256 v[4], top[2];  // top[h]: the max |x| of group 4h + l / 2 in lane l
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) v[i] = widen8(x + 8 * i);
  // v[0] (values 0-7) and v[2] (16-23) hold groups 0-3 in lanes 2g, 2g + 1; v[1], v[3]
  // groups 4-7.
  for (int h = 0; h < 2; ++h) {
    const __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, v[h]), _mm256_andnot_ps(sign, v[h + 2]));
    top[h] = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1)));
  }
  const __m256 groups = _mm256_permutevar8x32_ps(
      _mm256_shuffle_ps(top[0], top[1], _MM_SHUFFLE(2, 0, 2, 0)),
      _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
  const __m256 d8 = _mm256_div_ps(groups, _mm256_set1_ps(32767.f));
  _mm256_storeu_ps(d, d8);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) {
    // 32767 / max, or 0 where max < 2^-110 (an all-zero group, or one so small that d would
    // be subnormal and 32767 / max could overflow: its values count as zeros). The default
    // rounding: to nearest, ties to even.
    const __m256 t = top[k % 2];
    const __m256 inv = _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(32767.f), t),
                                     _mm256_cmp_ps(t, _mm256_set1_ps(0x1p-110f), _CMP_GE_OQ));
    i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], inv));
  }
  // packs interleave 128-bit lanes (values 0-3, 8-11, 4-7, 12-15): put them back in order.
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[0], i[1]), _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(i[2], i[3]), _MM_SHUFFLE(3, 1, 2, 0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), hi);
  // The groups' sums of q, in the same lanes as d.
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
  s = sum8(_mm256_mul_ps(d8, _mm256_cvtepi32_ps(sums)));
}

template <typename T>
RowsQ16 quantize_rows(const T* x, int64_t rows, int64_t k) {
  const int64_t nb = k / kBlock;
  RowsQ16 xq;
  xq.blocks = (nb + kGroup - 1) / kGroup * kGroup;
  xq.q.assign(rows * xq.blocks * kBlock, 0);
  xq.d.assign(rows * xq.blocks * 8, 0.f);
  xq.s.assign(rows * xq.blocks, 0.f);
  at::parallel_for(0, rows * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / nb, b = i % nb, at = r * xq.blocks + b;
      quantize_block(x + r * k + b * kBlock, xq.q.data() + at * kBlock, xq.d.data() + at * 8,
                     xq.s[at]);
    }
  });
  return xq;
}

// A weight block's 32 integers as int16 in x's order: lo weights 0-15, hi 16-31. Q4_1's
// nibbles unsigned (0..15: weight 8v + i is nibble v of 16-bit word i, so a 32-bit shift
// by 4v, one per 128-bit half, and a mask put them in place), Q8_0's bytes sign-extended.
template <int64_t LAYOUT> inline void weight_words(const uint8_t* blk, __m256i& lo, __m256i& hi) {
  if constexpr (LAYOUT == kHalfNibbles) {
    const __m256i words = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4)));
    const __m256i low4 = _mm256_set1_epi16(0x0F);
    lo = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), low4);
    hi = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_setr_epi32(8, 8, 8, 8, 12, 12, 12, 12)),
                          low4);
  } else {
    lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2)));
    hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18)));
  }
}

// sum(w * x) of a block's 32 int16 pairs as 8 int32 group sums (exact either way).
inline __m256i dot_words(__m256i w_lo, __m256i w_hi, const int16_t* x) {
  const __m256i x_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x_hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w_lo, x_lo), w_hi, x_hi);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
#endif
}

// R rows of xq (from r0) against C weight rows: per block, the eight int32 group sums of
// each (row, column) pair, as float32, times d_w * the eight group scales into that pair's
// eight-lane accumulator; at the end its lanes are added in a fixed tree, then Q4_1's sum
// over blocks of m_w * s, eight blocks a vector (the tile writes each column's m_w into
// mw [C, xq.blocks] on the way; the padding stays zero). Each output's float32 steps are
// the same in every tile shape (batch invariance).
template <int64_t LAYOUT, int R, int C>
void tile_q16(const RowsQ16& xq, int64_t r0, const uint8_t* wrow, int64_t row_bytes, int64_t nb,
              float* mw, float* result, int64_t result_stride) {
  constexpr int64_t bb = layout_bytes(LAYOUT);
  const int64_t padded = xq.blocks;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* x[R];
    __m256 dx[R];
    for (int r = 0; r < R; ++r) {
      const int64_t at = (r0 + r) * padded + b;
      x[r] = xq.q.data() + at * kBlock;
      dx[r] = _mm256_loadu_ps(xq.d.data() + at * 8);
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* blk = wrow + c * row_bytes + b * bb;
      __m256i w_lo, w_hi;
      weight_words<LAYOUT>(blk, w_lo, w_hi);
      const __m128 dm = scales_dm<LAYOUT>(blk);  // (d_w, m_w) widened from fp16
      const __m256 d = _mm256_broadcastss_ps(dm);
      if constexpr (LAYOUT == kHalfNibbles)
        _mm_store_ss(mw + c * padded + b, _mm_movehdup_ps(dm));
      for (int r = 0; r < R; ++r)
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(d, dx[r]),
                                    _mm256_cvtepi32_ps(dot_words(w_lo, w_hi, x[r])), acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) {
      float total = sum8(acc[r][c]);
      if constexpr (LAYOUT == kHalfNibbles) {
        const float* s = xq.s.data() + (r0 + r) * padded;
        __m256 m = _mm256_setzero_ps();
        for (int64_t b = 0; b < padded; b += 8)
          m = _mm256_fmadd_ps(_mm256_loadu_ps(mw + c * padded + b), _mm256_loadu_ps(s + b), m);
        total += sum8(m);
      }
      result[r * result_stride + c] = total;
    }
  }
}

// linear_rows with int16 x (LAYOUT: HalfNibbles or Bytes): the same split over column
// tiles, register tiles of up to kInt16Rows rows by kInt16Accs / rows columns.
constexpr int64_t kInt16Accs = 8, kInt16Rows = 2;
template <typename T, int64_t LAYOUT>
void linear_rows_q16(const torch::Tensor& x, const uint8_t* wp, int64_t row_bytes, int64_t n_out,
                     torch::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), nb = k / kBlock;
  const RowsQ16 xq = quantize_rows(ptr<T>(x), rows, k);
  T* op = ptr<T>(out);
  const int64_t col_tiles = (n_out + kTileCols - 1) / kTileCols;
  for (int64_t tile = 0; tile < rows; tile += kRowTile) {
    const int64_t tile_rows = std::min(kRowTile, rows - tile);
    at::parallel_for(0, col_tiles, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> result(tile_rows * kTileCols);
      std::vector<float> mw(kTileCols * xq.blocks, 0.f);
      for (int64_t ct = begin; ct < end; ++ct) {
        const int64_t n = ct * kTileCols, cols = std::min<int64_t>(kTileCols, n_out - n);
        const uint8_t* wrow = wp + n * row_bytes;
        if (ct + 1 < end) {  // the next tile's weights stream in while this one computes
          const char* ahead = reinterpret_cast<const char*>(wrow + kTileCols * row_bytes);
          const int64_t next = std::min<int64_t>(kTileCols, n_out - n - kTileCols) * row_bytes;
          for (int64_t off = 0; off < next; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
        }
        for (int64_t r = 0; r < tile_rows; r += kInt16Rows) {
          const int64_t rs = std::min<int64_t>(kInt16Rows, tile_rows - r);
          const int64_t group = std::max<int64_t>(1, kInt16Accs / rs);
          for (int64_t c0 = 0; c0 < cols; c0 += group) {
            with_tile_shape(rs, std::min(group, cols - c0), [&](auto R, auto C) {
              tile_q16<LAYOUT, R.value, C.value>(
                  xq, tile + r, wrow + c0 * row_bytes, row_bytes, nb, mw.data() + c0 * xq.blocks,
                  result.data() + r * kTileCols + c0, kTileCols);
            });
          }
        }
        for (int64_t r = 0; r < tile_rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            op[(tile + r) * n_out + n + c] = Elem<T>::store(result[r * kTileCols + c]);
      }
    });
  }
}
#else
constexpr bool kHasInt16Dot = false;
#endif

void check_linear_input(const torch::Tensor& x) {
  check_cpu_float(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, in] tensor");
  TORCH_CHECK(x.size(1) % kBlock == 0, "in_features must be a multiple of 32");
}

// int16_x: round x to int16 per group of 4 values and multiply in integers (the section
// above) where the kind's layout has that path (Q4_1, Q8_0) and the build has AVX2;
// elsewhere it is ignored.
torch::Tensor quantized_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t kind,
                               bool int16_x) {
  check_linear_input(x);
  check_kind(kind);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.dim() == 2 &&
                  packed.size(1) == x.size(1) / kBlock * packed_block_bytes(kind),
              "weights must be pack_blocks' contiguous uint8 [out, in / 32 * packed bytes]");
  auto out = torch::empty({x.size(0), packed.size(0)}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (int16_x && layout_of(kind) == kHalfNibbles)
      return linear_rows_q16<T, kHalfNibbles>(x, wp, packed.size(1), packed.size(0), out);
    if (int16_x && layout_of(kind) == kBytes)
      return linear_rows_q16<T, kBytes>(x, wp, packed.size(1), packed.size(0), out);
#endif
    switch (layout_of(kind)) {
      case kHalfNibbles:
        return linear_rows<T, Quant<kHalfNibbles>>(x, wp, packed.size(1), packed.size(0), out);
      case kNibbles: return linear_rows<T, Quant<kNibbles>>(x, wp, packed.size(1), packed.size(0), out);
      case kBytes: return linear_rows<T, Quant<kBytes>>(x, wp, packed.size(1), packed.size(0), out);
      case kScaledBytes:
        return linear_rows<T, Quant<kScaledBytes>>(x, wp, packed.size(1), packed.size(0), out);
      case kFp4: return linear_rows<T, Quant<kFp4>>(x, wp, packed.size(1), packed.size(0), out);
    }
  });
  return out;
}

// A pack_blocks weight as a dense float32 [out, in]: the very values quantized_linear reads
// (gguf-py's float32 weights, exactly), for a caller that multiplies many rows by one
// expert with a dense matmul and holds the dense copy only for that call. The SIMD builds
// unpack as the linear's column tiles do; the scalar build reads each weight alone.
template <int64_t LAYOUT>
void dequantize_rows(const uint8_t* wp, int64_t row_bytes, int64_t rows, int64_t k, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__) || defined(SLUICE_AVX2)
    unpack_cols<Quant<LAYOUT>, float>(wp + begin * row_bytes, row_bytes, end - begin, k,
                                      out + begin * k);
#else
    for (int64_t r = begin; r < end; ++r)
      for (int64_t b = 0; b < k / kBlock; ++b)
        for (int j = 0; j < kBlock; ++j)
          out[r * k + b * kBlock + j] = Quant<LAYOUT>::weight(
              wp + r * row_bytes + b * Quant<LAYOUT>::block_bytes, j);
#endif
  });
}

torch::Tensor dequantize_blocks(const torch::Tensor& packed, int64_t kind) {
  check_kind(kind);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(1) % packed_block_bytes(kind) == 0,
              "weights must be pack_blocks' contiguous uint8 [out, in / 32 * packed bytes]");
  const int64_t rows = packed.size(0), k = packed.size(1) / packed_block_bytes(kind) * kBlock;
  auto out = torch::empty({rows, k}, packed.options().dtype(torch::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  switch (layout_of(kind)) {
    case kHalfNibbles: dequantize_rows<kHalfNibbles>(wp, packed.size(1), rows, k, op); break;
    case kNibbles: dequantize_rows<kNibbles>(wp, packed.size(1), rows, k, op); break;
    case kBytes: dequantize_rows<kBytes>(wp, packed.size(1), rows, k, op); break;
    case kScaledBytes: dequantize_rows<kScaledBytes>(wp, packed.size(1), rows, k, op); break;
    case kFp4: dequantize_rows<kFp4>(wp, packed.size(1), rows, k, op); break;
  }
  return out;
}

// The batch-invariant mode's linear over a dense weight of x's dtype: the quantized
// linear's arithmetic with weights read as they are.
// A bfloat16 weight under a float32 x is widened block by block in the kernel (exact): the
// float32 model of a CPU without bf16 dot products keeps its weights in bfloat16 and so
// streams half the bytes at decode (CpuKernelOps.linear_weight_dtype).
torch::Tensor dense_linear(const torch::Tensor& x, const torch::Tensor& weight) {
  check_linear_input(x);
  const bool widened = x.scalar_type() == torch::kFloat && weight.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((weight.scalar_type() == x.scalar_type() || widened) && weight.is_contiguous() &&
                  weight.dim() == 2 && weight.size(1) == x.size(1),
              "weight must be a contiguous [out, in] tensor of x's dtype (or bfloat16 under a "
              "float32 x)");
  auto out = torch::empty({x.size(0), weight.size(0)}, x.options());
  const auto* wp = static_cast<const uint8_t*>(weight.data_ptr());
  if (widened) {
    linear_rows<float, Dense<uint16_t>>(x, wp, weight.size(1) * 2, weight.size(0), out);
    return out;
  }
  dispatch(x, [&](auto tag) {
    using T = decltype(tag);
    linear_rows<T, Dense<T>>(x, wp, weight.size(1) * sizeof(T), weight.size(0), out);
  });
  return out;
}

// ------------------------------------------------------------- one decoder layer at decode

// One Llama decoder layer of a pure decode step (each row one sequence's next token) whose
// four linears all run over blocks: the model's Python steps (engine/models/llama.py), in
// the same order through the same kernels, so the same bits, in one call. At decode a
// layer's norms, RoPE and attention take microseconds; the ~30 torch calls and the Python
// between them took more than that (a few milliseconds a step at one row).
//   x, h: the layer's normed input and the residual stream [T, hidden]
//   blocks, kinds: pack_blocks' q/k/v (fused), o, gate/up (fused) and down, their kinds
//   post_norm: the post-attention norm; next_norm: the next layer's input norm, or an
//   empty tensor for the last layer, which returns h + mlp alone (the model's final add)
//   cos, sin, positions: rope's; k_cache, v_cache: this layer's [slots, KVH, D], written at
//   slots; page_table, lengths, page_size, scale: decode_attention's
//   k_scale, v_scale: a narrow cache's (--kv-cache-dtype; 1 otherwise): K/V are stored
//   divided by them, and scale already holds k_scale
//   int16_x: per linear, whether it takes quantized_linear's int16 path
// Returns (x, h) for the next layer, or (h + mlp) after the last.
// The step's new K or V rows x into the cache at slots, stored as the cache is: in x's own
// dtype, or narrow as engine/attention/kv_dtype.py's quantize stores them (x / scale,
// clipped to the type's range, int8 rounded to nearest), the same ops in the same order.
void write_cache(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& x,
                 double scale) {
  const auto t = cache.scalar_type();
  if (t == x.scalar_type()) {
    cache.index_copy_(0, slots, x);
    return;
  }
  torch::Tensor stored;
  if (t == torch::kHalf || t == torch::kBFloat16) {
    const double limit = t == torch::kHalf ? 65504.0 : 3.3895313892515355e38;
    stored = x.clamp(-limit, limit).to(t);
  } else {
    const auto y = x.to(torch::kFloat) / scale;
    if (t == torch::kChar) {
      stored = y.round().clamp(-127, 127).to(t);
    } else {
      const double limit = t == torch::kFloat8_e4m3fn ? 448.0 : 57344.0;
      stored = y.clamp(-limit, limit).to(t);
    }
  }
  const auto as = cache.element_size() == 1 ? torch::kByte : torch::kShort;
  cache.view(as).index_copy_(0, slots, stored.view(as));
}

std::vector<torch::Tensor> decode_layer(
    const torch::Tensor& x, const torch::Tensor& h, const std::vector<torch::Tensor>& blocks,
    const std::vector<int64_t>& kinds, const torch::Tensor& post_norm,
    const torch::Tensor& next_norm, double eps, const torch::Tensor& cos,
    const torch::Tensor& sin, const torch::Tensor& positions, int64_t heads, int64_t kv_heads,
    torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots,
    const torch::Tensor& page_table, const torch::Tensor& lengths, int64_t page_size,
    double scale, const std::vector<bool>& int16_x, double k_scale, double v_scale) {
  TORCH_CHECK(blocks.size() == 4 && kinds.size() == 4 && int16_x.size() == 4,
              "blocks, kinds and int16_x: q/k/v, o, gate/up and down");
  TORCH_CHECK(h.is_contiguous() && h.sizes() == x.sizes(), "h must be contiguous, x's shape");
  const int64_t tokens = x.size(0), dim = k_cache.size(2);
  const int64_t q_size = heads * dim, kv_size = kv_heads * dim;
  // Attention: q/k/v, RoPE, the cache write, attention over the pages, o.
  const auto qkv = quantized_linear(x.contiguous(), blocks[0], kinds[0], int16_x[0]);
  TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "q/k/v rows must be (H + 2 KVH) * D");
  const auto q = qkv.narrow(1, 0, q_size).view({tokens, heads, dim});
  const auto k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, dim});
  const auto v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, dim});
  const auto both = rope(q, k, cos, sin, positions);
  write_cache(k_cache, slots, both.narrow(1, heads, kv_heads), k_scale);
  write_cache(v_cache, slots, v.contiguous(), v_scale);
  const auto o = decode_attention(both.narrow(1, 0, heads), k_cache, v_cache, page_table,
                                  lengths, page_size, scale, v_scale);
  const auto attn = quantized_linear(o.reshape({tokens, q_size}), blocks[1], kinds[1], int16_x[1]);
  // The MLP between the two fused residual adds and norms.
  const auto mid = add_rms_norm(h, attn, post_norm, eps);  // (normed, summed)
  const auto gate_up = quantized_linear(mid[0], blocks[2], kinds[2], int16_x[2]);
  const auto down = quantized_linear(silu_and_mul(gate_up), blocks[3], kinds[3], int16_x[3]);
  if (!next_norm.defined() || next_norm.numel() == 0) return {mid[1] + down};
  return add_rms_norm(mid[1], down, next_norm, eps);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim, weight applied after rounding");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(h + delta), h + delta) in one pass");
  m.def("rope", &rope, "Half-split rotary embedding of q and k into one [T, H + KVH, D]");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a [T, 2 * width] tensor");
  m.def("pack_blocks", &pack_blocks,
        "GGUF Q4_1 (kind 0), Q8_0 (1), Q4_K (2), Q5_K (3), Q6_K (4) or MXFP4 (5) weight rows into "
        "quantized_linear's layout for that kind, or for as_kind (3 or 4 take any kind)",
        py::arg("blocks"), py::arg("kind"), py::arg("as_kind") = -1);
  m.def("quantized_linear", &quantized_linear,
        "x @ W^T with W from pack_blocks (the same kind); int16_x: x rounded to int16 per group "
        "of 4 values and integer dot products, where the kind (Q4_1, Q8_0) and the build have them",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("int16_x") = false);
  m.def("dequantize_blocks", &dequantize_blocks,
        "W from pack_blocks (of kind) as a dense float32 [out, in]: the weights "
        "quantized_linear reads");
  m.attr("bf16_quantized") = kHasBf16Dot;
  m.attr("int16_dot") = kHasInt16Dot;  // quantized_linear's int16_x has a path
  // The vector path this build runs (tests check they load the build they mean to).
#if defined(__AVX512F__)
  m.attr("simd") = "avx512";
#elif defined(SLUICE_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "scalar";
#endif
  m.def("dense_linear", &dense_linear,
        "x @ W^T over a dense W of x's dtype (or bfloat16 under float32 x), each row summed "
        "alone in a fixed order");
  m.def("decode_attention", &decode_attention,
        "One-token attention per sequence over its pages of the KV cache, read in place; a "
        "narrow cache (float8_e4m3fn, float8_e5m2, int8, float16) widened as read, its V "
        "scale in v_scale (its K scale in scale)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("page_table"),
        py::arg("lengths"), py::arg("page_size"), py::arg("scale"), py::arg("v_scale") = 1.0);
  m.attr("narrow_kv") = true;  // decode_attention reads --kv-cache-dtype's narrow caches
  // Without the GIL: the engine's socket threads run while a layer computes.
  m.def("decode_layer", &decode_layer,
        "One decoder layer of a pure decode step over quantized blocks: (x, h) for the next "
        "layer, or (h + mlp,) after the last",
        py::call_guard<py::gil_scoped_release>());
}
