// qsync-opt CUDA kernels behind the C ABI of qsync_kernels.h.
//
// Bit-exactness with the CPU reference: build with -fmad=false, and every float multiply or
// add below is an explicit round-to-nearest intrinsic (__fmul_rn / __fadd_rn), which nvcc
// never contracts into an FMA, so the order of operations is exactly the documented one.
//
// All kernels are grid-stride loops over int64 indices with 256 threads per block. The
// channel (or column) of an index is tracked incrementally: one int64 division per thread
// instead of one per element (int64 division is a long software sequence on the GPU).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "qsync_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

inline int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  if (b > kMaxBlocks) b = kMaxBlocks;
  if (b < 1) b = 1;
  return static_cast<int>(b);
}

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// The seed's contribution, (uint32)s * 0xC2B2AE35 + 0x27D4EB2F, is the same for every element.
inline uint32_t seed_term(uint64_t seed) {
  return static_cast<uint32_t>(seed) * 0xC2B2AE35u + 0x27D4EB2Fu;
}

__device__ __forceinline__ float hash_uniform_at(int64_t i, uint32_t seed_mix) {
  uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B9u;
  h ^= static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) * 0x85EBCA6Bu;
  h += seed_mix;
  // murmur3 fmix32
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  // h >> 8 < 2^24 converts exactly; the product by 2^-24 is exact too.
  return __fmul_rn(static_cast<float>(h >> 8), 1.0f / 16777216.0f);
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Index i = blockIdx.x * blockDim.x + threadIdx.x, advancing by the grid stride, with its row
// (i / width) and column (i % width) kept up to date without dividing in the loop.
struct StridedIndex {
  int64_t i, row, col, stride, drow, dcol, width;

  __device__ __forceinline__ StridedIndex(int64_t width_) : width(width_) {
    i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
    row = i / width;
    col = i - row * width;
    drow = stride / width;
    dcol = stride - drow * width;
  }

  __device__ __forceinline__ void next() {
    i += stride;
    row += drow;
    col += dcol;
    if (col >= width) {
      col -= width;
      ++row;
    }
  }
};

// kQmax: 127 for int8, 7 for int4 (the same rounding, a narrower clamp).
template <typename T, bool kStochastic, int kQmax = 127>
__global__ void __launch_bounds__(kThreads)
    quantize_int8_kernel(const T* __restrict__ x, int8_t* __restrict__ q,
                         const float* __restrict__ inv_scale, int64_t n, int64_t inner,
                         uint32_t seed_mix) {
  for (StridedIndex it(inner); it.i < n; it.next()) {
    const float xf = to_float<T>(x[it.i]);
    const float y = __fmul_rn(xf, inv_scale[it.row]);
    float r;
    if (kStochastic) {
      r = floorf(__fadd_rn(y, hash_uniform_at(it.i, seed_mix)));
    } else {
      r = rintf(y);  // round half to even
    }
    r = fminf(fmaxf(r, -static_cast<float>(kQmax)), static_cast<float>(kQmax));
    q[it.i] = static_cast<int8_t>(r);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    dequantize_int8_kernel(const int8_t* __restrict__ q, const float* __restrict__ scale,
                           T* __restrict__ out, int64_t n, int64_t inner) {
  for (StridedIndex it(inner); it.i < n; it.next()) {
    const float v = __fmul_rn(static_cast<float>(q[it.i]), scale[it.row]);
    out[it.i] = from_float<T>(v);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    rescale_int32_kernel(const int32_t* __restrict__ acc, float sx, const float* __restrict__ sw,
                         const float* __restrict__ bias, T* __restrict__ out, int64_t total,
                         int64_t cols) {
  for (StridedIndex it(cols); it.i < total; it.next()) {
    const float s = __fmul_rn(sx, sw[it.col]);
    // int32 -> float rounds to nearest even, like the CPU conversion.
    float v = __fmul_rn(__int2float_rn(acc[it.i]), s);
    if (bias != nullptr) v = __fadd_rn(v, bias[it.col]);
    out[it.i] = from_float<T>(v);
  }
}

// The same with one scale per row: s = sx[row] * sw[col] (int8_full's per-token output
// gradient, int4's per-row activations).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rescale_int32_rows_kernel(const int32_t* __restrict__ acc, const float* __restrict__ sx,
                              const float* __restrict__ sw, const float* __restrict__ bias,
                              T* __restrict__ out, int64_t total, int64_t cols) {
  for (StridedIndex it(cols); it.i < total; it.next()) {
    const float s = __fmul_rn(sx[it.row], sw[it.col]);
    float v = __fmul_rn(__int2float_rn(acc[it.i]), s);
    if (bias != nullptr) v = __fadd_rn(v, bias[it.col]);
    out[it.i] = from_float<T>(v);
  }
}

__global__ void __launch_bounds__(kThreads)
    hash_uniform_kernel(float* __restrict__ out, int64_t n, uint32_t seed_mix) {
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    out[i] = hash_uniform_at(i, seed_mix);
  }
}

template <typename T, int kQmax = 127>
int launch_quantize(const void* x, int8_t* q, const float* inv_scale, int64_t n, int64_t inner,
                    int stochastic, uint64_t seed, cudaStream_t st) {
  const T* xt = static_cast<const T*>(x);
  const uint32_t mix = seed_term(seed);
  if (stochastic) {
    quantize_int8_kernel<T, true, kQmax><<<blocks_for(n), kThreads, 0, st>>>(xt, q, inv_scale,
                                                                             n, inner, mix);
  } else {
    quantize_int8_kernel<T, false, kQmax><<<blocks_for(n), kThreads, 0, st>>>(xt, q, inv_scale,
                                                                              n, inner, mix);
  }
  return static_cast<int>(cudaGetLastError());
}

template <int kQmax>
int quantize_dispatch(const void* x, int x_dtype, int8_t* q, const float* inv_scale, int64_t n,
                      int64_t inner, int stochastic, uint64_t seed, cudaStream_t st) {
  switch (x_dtype) {
    case QSYNC_DTYPE_FP32:
      return launch_quantize<float, kQmax>(x, q, inv_scale, n, inner, stochastic, seed, st);
    case QSYNC_DTYPE_FP16:
      return launch_quantize<__half, kQmax>(x, q, inv_scale, n, inner, stochastic, seed, st);
    case QSYNC_DTYPE_BF16:
      return launch_quantize<__nv_bfloat16, kQmax>(x, q, inv_scale, n, inner, stochastic, seed,
                                                   st);
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
}

// packed[r, j] = lo nibble q[r, 2j], hi nibble q[r, 2j + 1] (0 past the end of an odd row).
__global__ void __launch_bounds__(kThreads)
    pack_int4_kernel(const int8_t* __restrict__ q, uint8_t* __restrict__ packed, int64_t total,
                     int64_t kp, int64_t k) {
  for (StridedIndex it(kp); it.i < total; it.next()) {
    const int64_t base = it.row * k + 2 * it.col;
    const uint32_t lo = static_cast<uint32_t>(static_cast<uint8_t>(q[base])) & 0xFu;
    const uint32_t hi = (2 * it.col + 1 < k)
                            ? (static_cast<uint32_t>(static_cast<uint8_t>(q[base + 1])) & 0xFu)
                            : 0u;
    packed[it.i] = static_cast<uint8_t>(lo | (hi << 4));
  }
}

__device__ __forceinline__ int32_t nibble(uint32_t byte, int shift) {
  // sign-extend the 4-bit field at `shift`
  return static_cast<int32_t>(static_cast<int8_t>(static_cast<uint8_t>((byte >> shift) << 4))) >> 4;
}

// out[m, n] = sum_k a[m, k] * b[n, k] on packed rows of kp bytes; one thread per output.
__global__ void __launch_bounds__(kThreads)
    int4_gemm_kernel(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b,
                     int32_t* __restrict__ out, int64_t total, int64_t n, int64_t kp) {
  for (StridedIndex it(n); it.i < total; it.next()) {
    const uint8_t* ar = a + it.row * kp;
    const uint8_t* br = b + it.col * kp;
    int32_t acc = 0;
    for (int64_t j = 0; j < kp; ++j) {
      const uint32_t x = ar[j], y = br[j];
      acc += nibble(x, 0) * nibble(y, 0) + nibble(x, 4) * nibble(y, 4);
    }
    out[it.i] = acc;
  }
}

template <typename T>
int launch_dequantize(const int8_t* q, const float* scale, void* out, int64_t n, int64_t inner,
                      cudaStream_t st) {
  dequantize_int8_kernel<T><<<blocks_for(n), kThreads, 0, st>>>(q, scale, static_cast<T*>(out),
                                                                n, inner);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_rescale(const int32_t* acc, float sx, const float* sw, const float* bias, void* out,
                   int64_t total, int64_t cols, cudaStream_t st) {
  rescale_int32_kernel<T><<<blocks_for(total), kThreads, 0, st>>>(
      acc, sx, sw, bias, static_cast<T*>(out), total, cols);
  return static_cast<int>(cudaGetLastError());
}

template <typename T>
int launch_rescale_rows(const int32_t* acc, const float* sx, const float* sw, const float* bias,
                        void* out, int64_t total, int64_t cols, cudaStream_t st) {
  rescale_int32_rows_kernel<T><<<blocks_for(total), kThreads, 0, st>>>(
      acc, sx, sw, bias, static_cast<T*>(out), total, cols);
  return static_cast<int>(cudaGetLastError());
}

constexpr int kInvalid = static_cast<int>(cudaErrorInvalidValue);

}  // namespace

extern "C" {

QSYNC_API int qsync_cuda_abi_version(void) { return QSYNC_CUDA_ABI_VERSION; }

QSYNC_API const char* qsync_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

QSYNC_API int qsync_quantize_int8(const void* x, int x_dtype, int8_t* q, const float* inv_scale,
                                  int64_t n, int64_t inner, int stochastic, uint64_t seed,
                                  void* stream) {
  if (n < 0) return kInvalid;
  if (n == 0) return 0;
  if (inner <= 0 || x == nullptr || q == nullptr || inv_scale == nullptr) return kInvalid;
  cudaStream_t st = as_stream(stream);
  switch (x_dtype) {
    case QSYNC_DTYPE_FP32:
      return launch_quantize<float>(x, q, inv_scale, n, inner, stochastic, seed, st);
    case QSYNC_DTYPE_FP16:
      return launch_quantize<__half>(x, q, inv_scale, n, inner, stochastic, seed, st);
    case QSYNC_DTYPE_BF16:
      return launch_quantize<__nv_bfloat16>(x, q, inv_scale, n, inner, stochastic, seed, st);
    default:
      return kInvalid;
  }
}

QSYNC_API int qsync_quantize_int4(const void* x, int x_dtype, int8_t* q, const float* inv_scale,
                                  int64_t n, int64_t inner, int stochastic, uint64_t seed,
                                  void* stream) {
  if (n < 0) return kInvalid;
  if (n == 0) return 0;
  if (inner <= 0 || x == nullptr || q == nullptr || inv_scale == nullptr) return kInvalid;
  return quantize_dispatch<7>(x, x_dtype, q, inv_scale, n, inner, stochastic, seed,
                              as_stream(stream));
}

QSYNC_API int qsync_pack_int4(const int8_t* q, uint8_t* packed, int64_t rows, int64_t k,
                              void* stream) {
  if (rows < 0 || k < 0) return kInvalid;
  if (rows == 0 || k == 0) return 0;
  if (q == nullptr || packed == nullptr) return kInvalid;
  const int64_t kp = (k + 1) / 2;
  if (rows > INT64_MAX / kp) return kInvalid;
  const int64_t total = rows * kp;
  pack_int4_kernel<<<blocks_for(total), kThreads, 0, as_stream(stream)>>>(q, packed, total, kp,
                                                                          k);
  return static_cast<int>(cudaGetLastError());
}

QSYNC_API int qsync_int4_gemm(const uint8_t* a, const uint8_t* b, int32_t* out, int64_t m,
                              int64_t n, int64_t k, void* stream) {
  if (m < 0 || n < 0 || k < 0) return kInvalid;
  if (m == 0 || n == 0) return 0;
  if (m > INT64_MAX / n || k > (INT64_C(1) << 31) / 64) return kInvalid;
  if (out == nullptr || (k > 0 && (a == nullptr || b == nullptr))) return kInvalid;
  const int64_t total = m * n;
  int4_gemm_kernel<<<blocks_for(total), kThreads, 0, as_stream(stream)>>>(a, b, out, total, n,
                                                                          (k + 1) / 2);
  return static_cast<int>(cudaGetLastError());
}

QSYNC_API int qsync_dequantize_int8(const int8_t* q, const float* scale, void* out,
                                    int out_dtype, int64_t n, int64_t inner, void* stream) {
  if (n < 0) return kInvalid;
  if (n == 0) return 0;
  if (inner <= 0 || q == nullptr || scale == nullptr || out == nullptr) return kInvalid;
  cudaStream_t st = as_stream(stream);
  switch (out_dtype) {
    case QSYNC_DTYPE_FP32:
      return launch_dequantize<float>(q, scale, out, n, inner, st);
    case QSYNC_DTYPE_FP16:
      return launch_dequantize<__half>(q, scale, out, n, inner, st);
    case QSYNC_DTYPE_BF16:
      return launch_dequantize<__nv_bfloat16>(q, scale, out, n, inner, st);
    default:
      return kInvalid;
  }
}

QSYNC_API int qsync_rescale_int32(const int32_t* acc, float sx, const float* sw,
                                  const float* bias, void* out, int out_dtype, int64_t m,
                                  int64_t n, void* stream) {
  if (m < 0 || n < 0) return kInvalid;
  if (m == 0 || n == 0) return 0;
  if (m > INT64_MAX / n) return kInvalid;
  if (acc == nullptr || sw == nullptr || out == nullptr) return kInvalid;
  const int64_t total = m * n;
  cudaStream_t st = as_stream(stream);
  switch (out_dtype) {
    case QSYNC_DTYPE_FP32:
      return launch_rescale<float>(acc, sx, sw, bias, out, total, n, st);
    case QSYNC_DTYPE_FP16:
      return launch_rescale<__half>(acc, sx, sw, bias, out, total, n, st);
    case QSYNC_DTYPE_BF16:
      return launch_rescale<__nv_bfloat16>(acc, sx, sw, bias, out, total, n, st);
    default:
      return kInvalid;
  }
}

QSYNC_API int qsync_rescale_int32_rows(const int32_t* acc, const float* sx, const float* sw,
                                       const float* bias, void* out, int out_dtype, int64_t m,
                                       int64_t n, void* stream) {
  if (m < 0 || n < 0) return kInvalid;
  if (m == 0 || n == 0) return 0;
  if (m > INT64_MAX / n) return kInvalid;
  if (acc == nullptr || sx == nullptr || sw == nullptr || out == nullptr) return kInvalid;
  const int64_t total = m * n;
  cudaStream_t st = as_stream(stream);
  switch (out_dtype) {
    case QSYNC_DTYPE_FP32:
      return launch_rescale_rows<float>(acc, sx, sw, bias, out, total, n, st);
    case QSYNC_DTYPE_FP16:
      return launch_rescale_rows<__half>(acc, sx, sw, bias, out, total, n, st);
    case QSYNC_DTYPE_BF16:
      return launch_rescale_rows<__nv_bfloat16>(acc, sx, sw, bias, out, total, n, st);
    default:
      return kInvalid;
  }
}

QSYNC_API int qsync_hash_uniform(float* out, int64_t n, uint64_t seed, void* stream) {
  if (n < 0) return kInvalid;
  if (n == 0) return 0;
  if (out == nullptr) return kInvalid;
  hash_uniform_kernel<<<blocks_for(n), kThreads, 0, as_stream(stream)>>>(out, n, seed_term(seed));
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
