// C++ CPU kernels of qsync-opt's low-precision ops, registered as torch ops `qsync_cpu::*`
// for the CPU dispatch key. Each computes exactly the formulas of qsync_opt/ops/reference.py
// in the same order (built with -ffp-contract=off so no multiply-add is fused), so its
// results equal the Python reference bit for bit. Loops are written to auto-vectorize
// (-march=native); quantization, the hot one, has explicit AVX-512 code that does the same
// arithmetic lane by lane. Work is split over threads with at::parallel_for.

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

inline float hash_u(int64_t i, uint32_t seed_term) {
  uint64_t ui = static_cast<uint64_t>(i);
  uint32_t h = static_cast<uint32_t>(ui) * 0x9E3779B9u;
  h ^= static_cast<uint32_t>(ui >> 32) * 0x85EBCA6Bu;
  h += seed_term;
  h = fmix32(h);
  return static_cast<float>(h >> 8) * (1.0f / 16777216.0f);
}

inline uint32_t seed_term(int64_t seed) {
  return static_cast<uint32_t>(static_cast<uint64_t>(seed)) * 0xC2B2AE35u + 0x27D4EB2Fu;
}

constexpr int64_t kGrain = 1 << 14;

inline float clamp127(float r) {
  r = r < -127.0f ? -127.0f : r;
  return r > 127.0f ? 127.0f : r;
}

// Scalar quantization of elements [begin, end), all in channel with inverse scale s.
template <typename T>
void quantize_scalar(const T* x, float s, int8_t* q, int64_t begin, int64_t end,
                     bool stochastic, uint32_t st) {
  for (int64_t j = begin; j < end; ++j) {
    float y = static_cast<float>(x[j]) * s;
    float r = stochastic ? std::floor(y + hash_u(j, st)) : std::nearbyint(y);
    q[j] = static_cast<int8_t>(clamp127(r));
  }
}

#ifdef __AVX512F__
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<at::BFloat16>(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
template <>
inline __m512 load16<at::Half>(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// AVX-512: 16 elements a step, the same arithmetic as quantize_scalar lane by lane (the
// hash in 32-bit integer lanes, multiply then add, floor / round-half-even, clamp).
// [begin, end) must not cross a multiple of 2**32 (the hash's high word is constant).
template <typename T>
void quantize_avx512(const T* x, float s, int8_t* q, int64_t begin, int64_t end,
                     bool stochastic, uint32_t st) {
  const __m512 vs = _mm512_set1_ps(s);
  const __m512 lo_clamp = _mm512_set1_ps(-127.0f), hi_clamp = _mm512_set1_ps(127.0f);
  const __m512 inv24 = _mm512_set1_ps(1.0f / 16777216.0f);
  const __m512i c1 = _mm512_set1_epi32(static_cast<int>(0x9E3779B9u));
  const __m512i c2 = _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu));
  const __m512i c3 = _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u));
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i vhi = _mm512_set1_epi32(
      static_cast<int>(static_cast<uint32_t>(static_cast<uint64_t>(begin) >> 32) * 0x85EBCA6Bu));
  const __m512i vst = _mm512_set1_epi32(static_cast<int>(st));
  int64_t j = begin;
  for (; j + 16 <= end; j += 16) {
    __m512 y = _mm512_mul_ps(load16(x + j), vs);
    __m512 r;
    if (stochastic) {
      __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(j))), lanes);
      __m512i h = _mm512_mullo_epi32(idx, c1);
      h = _mm512_xor_si512(h, vhi);
      h = _mm512_add_epi32(h, vst);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
      h = _mm512_mullo_epi32(h, c2);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
      h = _mm512_mullo_epi32(h, c3);
      h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
      __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(h, 8)), inv24);
      r = _mm512_roundscale_ps(_mm512_add_ps(y, u), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    } else {
      r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    }
    r = _mm512_min_ps(_mm512_max_ps(r, lo_clamp), hi_clamp);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + j), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  quantize_scalar(x, s, q, j, end, stochastic, st);
}
#endif

template <typename T>
void quantize_range(const T* x, float s, int8_t* q, int64_t begin, int64_t end,
                    bool stochastic, uint32_t st) {
#ifdef __AVX512F__
  while (begin < end) {  // split where the index's high 32 bits change
    const int64_t boundary = ((begin >> 32) + 1) << 32;
    const int64_t stop = std::min(end, boundary);
    quantize_avx512(x, s, q, begin, stop, stochastic, st);
    begin = stop;
  }
#else
  quantize_scalar(x, s, q, begin, end, stochastic, st);
#endif
}

template <typename T>
void quantize_loop(const T* x, const float* inv, int8_t* q, int64_t n, int64_t inner,
                   bool stochastic, uint32_t st) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    while (i < end) {
      const int64_t c = i / inner;
      const int64_t stop = std::min(end, (c + 1) * inner);
      quantize_range(x, inv[c], q, i, stop, stochastic, st);
      i = stop;
    }
  });
}

at::Tensor quantize_int8(const at::Tensor& x, const at::Tensor& inv_scale, bool stochastic,
                         int64_t seed) {
  TORCH_CHECK(x.device().is_cpu(), "quantize_int8: x must be on the CPU");
  TORCH_CHECK(inv_scale.scalar_type() == at::kFloat, "quantize_int8: inv_scale must be float32");
  auto xc = x.contiguous();
  auto inv = inv_scale.contiguous();
  const int64_t n = xc.numel();
  const int64_t channels = inv.numel();
  TORCH_CHECK(channels >= 1 && n % channels == 0, "quantize_int8: numel not divisible by channels");
  const int64_t inner = channels ? n / channels : 0;
  auto q = at::empty(xc.sizes(), xc.options().dtype(at::kChar));
  if (n == 0) return q;
  const uint32_t st = seed_term(seed);
  const float* s = inv.data_ptr<float>();
  int8_t* out = q.data_ptr<int8_t>();
  switch (xc.scalar_type()) {
    case at::kFloat:
      quantize_loop(xc.data_ptr<float>(), s, out, n, inner, stochastic, st);
      break;
    case at::kBFloat16:
      quantize_loop(xc.data_ptr<at::BFloat16>(), s, out, n, inner, stochastic, st);
      break;
    case at::kHalf:
      quantize_loop(xc.data_ptr<at::Half>(), s, out, n, inner, stochastic, st);
      break;
    default:
      TORCH_CHECK(false, "quantize_int8: x must be float32, bfloat16 or float16");
  }
  return q;
}

template <typename T>
void dequantize_loop(const int8_t* q, const float* scale, T* out, int64_t n, int64_t inner) {
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      out[j] = static_cast<T>(static_cast<float>(q[j]) * scale[j / inner]);
    }
  });
}

at::Tensor dequantize_int8(const at::Tensor& q, const at::Tensor& scale, at::ScalarType dtype) {
  TORCH_CHECK(q.scalar_type() == at::kChar, "dequantize_int8: q must be int8");
  auto qc = q.contiguous();
  auto sc = scale.to(at::kFloat).contiguous();
  const int64_t n = qc.numel();
  const int64_t channels = sc.numel();
  TORCH_CHECK(channels >= 1 && n % channels == 0, "dequantize_int8: bad scale length");
  auto out = at::empty(qc.sizes(), qc.options().dtype(dtype));
  if (n == 0) return out;
  const int64_t inner = n / channels;
  switch (dtype) {
    case at::kFloat:
      dequantize_loop(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<float>(), n, inner);
      break;
    case at::kBFloat16:
      dequantize_loop(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<at::BFloat16>(), n,
                      inner);
      break;
    case at::kHalf:
      dequantize_loop(qc.data_ptr<int8_t>(), sc.data_ptr<float>(), out.data_ptr<at::Half>(), n, inner);
      break;
    default:
      TORCH_CHECK(false, "dequantize_int8: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// sx_rows: one scale per row (rescale_int32_rows), or nullptr for the one scale sx.
template <typename T>
void rescale_loop(const int32_t* acc, float sx, const float* sw, const float* bias, T* out,
                  int64_t m, int64_t n, const float* sx_rows = nullptr) {
  at::parallel_for(0, m, std::max<int64_t>(1, kGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int32_t* a = acc + r * n;
      T* o = out + r * n;
      const float sr = sx_rows ? sx_rows[r] : sx;
      if (bias) {
        for (int64_t c = 0; c < n; ++c) {
          float s = sr * sw[c];
          float v = static_cast<float>(a[c]) * s;
          v = v + bias[c];
          o[c] = static_cast<T>(v);
        }
      } else {
        for (int64_t c = 0; c < n; ++c) {
          float s = sr * sw[c];
          o[c] = static_cast<T>(static_cast<float>(a[c]) * s);
        }
      }
    }
  });
}

at::Tensor rescale_int32(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                         const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2, "rescale_int32: acc must be 2-D int32");
  auto a = acc.contiguous();
  const int64_t m = a.size(0), n = a.size(1);
  auto w = sw.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == n, "rescale_int32: sw must have one scale per column");
  const float s = sx.to(at::kFloat).item<float>();
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "rescale_int32: bias must have one value per column");
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({m, n}, a.options().dtype(dtype));
  if (m * n == 0) return out;
  switch (dtype) {
    case at::kFloat:
      rescale_loop(a.data_ptr<int32_t>(), s, w.data_ptr<float>(), bp, out.data_ptr<float>(), m, n);
      break;
    case at::kBFloat16:
      rescale_loop(a.data_ptr<int32_t>(), s, w.data_ptr<float>(), bp, out.data_ptr<at::BFloat16>(), m,
                   n);
      break;
    case at::kHalf:
      rescale_loop(a.data_ptr<int32_t>(), s, w.data_ptr<float>(), bp, out.data_ptr<at::Half>(), m, n);
      break;
    default:
      TORCH_CHECK(false, "rescale_int32: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// acc[m, n] * (sx[m] * sw[n]) (+ bias[n]): one scale per row of the GEMM result (the
// per-token output gradient of int8_full, the per-row int4 activations).
at::Tensor rescale_int32_rows(const at::Tensor& acc, const at::Tensor& sx, const at::Tensor& sw,
                              const c10::optional<at::Tensor>& bias, at::ScalarType dtype) {
  TORCH_CHECK(acc.scalar_type() == at::kInt && acc.dim() == 2,
              "rescale_int32_rows: acc must be 2-D int32");
  auto a = acc.contiguous();
  const int64_t m = a.size(0), n = a.size(1);
  auto w = sw.to(at::kFloat).contiguous();
  auto rows = sx.to(at::kFloat).contiguous();
  TORCH_CHECK(w.numel() == n, "rescale_int32_rows: sw must have one scale per column");
  TORCH_CHECK(rows.numel() == m, "rescale_int32_rows: sx must have one scale per row");
  at::Tensor b;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    b = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(b.numel() == n, "rescale_int32_rows: bias must have one value per column");
    bp = b.data_ptr<float>();
  }
  auto out = at::empty({m, n}, a.options().dtype(dtype));
  if (m * n == 0) return out;
  const float* sr = rows.data_ptr<float>();
  switch (dtype) {
    case at::kFloat:
      rescale_loop(a.data_ptr<int32_t>(), 0.0f, w.data_ptr<float>(), bp, out.data_ptr<float>(), m,
                   n, sr);
      break;
    case at::kBFloat16:
      rescale_loop(a.data_ptr<int32_t>(), 0.0f, w.data_ptr<float>(), bp,
                   out.data_ptr<at::BFloat16>(), m, n, sr);
      break;
    case at::kHalf:
      rescale_loop(a.data_ptr<int32_t>(), 0.0f, w.data_ptr<float>(), bp, out.data_ptr<at::Half>(),
                   m, n, sr);
      break;
    default:
      TORCH_CHECK(false, "rescale_int32_rows: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

at::Tensor hash_uniform(int64_t n, int64_t seed, int64_t offset) {
  auto out = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint32_t st = seed_term(seed);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) o[j] = hash_u(j + offset, st);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(qsync_cpu, m) {
  m.def("quantize_int8(Tensor x, Tensor inv_scale, bool stochastic, int seed) -> Tensor");
  m.def("dequantize_int8(Tensor q, Tensor scale, ScalarType dtype) -> Tensor");
  m.def("rescale_int32(Tensor acc, Tensor sx, Tensor sw, Tensor? bias, ScalarType dtype) -> Tensor");
  m.def("rescale_int32_rows(Tensor acc, Tensor sx, Tensor sw, Tensor? bias, ScalarType dtype) -> Tensor");
  m.def("hash_uniform(int n, int seed, int offset) -> Tensor");
  m.def("abi_version() -> int");
}

TORCH_LIBRARY_IMPL(qsync_cpu, CPU, m) {
  m.impl("quantize_int8", &quantize_int8);
  m.impl("dequantize_int8", &dequantize_int8);
  m.impl("rescale_int32", &rescale_int32);
  m.impl("rescale_int32_rows", &rescale_int32_rows);
}

TORCH_LIBRARY_IMPL(qsync_cpu, CompositeExplicitAutograd, m) {
  m.impl("hash_uniform", &hash_uniform);
  m.impl("abi_version", []() -> int64_t { return 1; });
}
