/*
 * qsync-opt CUDA kernels: a small C ABI (raw pointers, sizes, a void* CUDA stream).
 *
 * Compiled by nvcc without torch headers and loaded with ctypes
 * (qsync_opt.cuda.kernels), so the CUDA toolkit building it need not match torch's.
 * Integer GEMMs are not here (torch._int_mm does them); these are the fusions around them.
 *
 * Numerics are bit-exact with the CPU reference in qsync_opt.ops: the library is built with
 * -fmad=false and the arithmetic below is written in exactly the documented order.
 *
 * Every function returns 0 on success, else a cudaError_t value (bad arguments give
 * cudaErrorInvalidValue = 1); qsync_cuda_error_string turns it into text. Kernels are
 * launched asynchronously on `stream` (a cudaStream_t; NULL is the legacy default stream)
 * on the device current to the calling thread.
 *
 * Layouts are contiguous. For quantize/dequantize the tensor is [C, inner] with n = C*inner
 * elements; the channel of element i is i / inner (per-tensor: inner = n, C = 1).
 */
#ifndef QSYNC_KERNELS_H_
#define QSYNC_KERNELS_H_

#include <stdint.h>

#if defined(__GNUC__)
#define QSYNC_API __attribute__((visibility("default")))
#else
#define QSYNC_API
#endif

/* Bump when a signature or a formula changes; the ctypes loader refuses other versions. */
#define QSYNC_CUDA_ABI_VERSION 3

/* Floating dtype codes for x / out. */
#define QSYNC_DTYPE_FP32 0
#define QSYNC_DTYPE_FP16 1
#define QSYNC_DTYPE_BF16 2

#ifdef __cplusplus
extern "C" {
#endif

/* Returns QSYNC_CUDA_ABI_VERSION. Makes no CUDA call (works without a driver). */
QSYNC_API int qsync_cuda_abi_version(void);

/* Text for a code returned by the functions below (cudaGetErrorString). */
QSYNC_API const char* qsync_cuda_error_string(int code);

/*
 * Symmetric int8 quantization of x (fp32/fp16/bf16, n elements, [C, inner]):
 *   y = float(x[i]) * inv_scale[i / inner]
 *   r = stochastic ? floorf(y + u(i, seed)) : rintf(y)      (rintf: half to even)
 *   q[i] = (int8_t)clamp(r, -127, 127)
 * inv_scale = 127 / amax per channel (amax 0 replaced by 1 beforehand), float32[C].
 * u(i, seed) is the counter-based uniform of qsync_hash_uniform (low 32 bits of seed).
 */
QSYNC_API int qsync_quantize_int8(const void* x, int x_dtype, int8_t* q, const float* inv_scale,
                                  int64_t n, int64_t inner, int stochastic, uint64_t seed,
                                  void* stream);

/*
 * Symmetric int4 quantization: as qsync_quantize_int8 with inv_scale = 7 / amax and the
 * clamp at [-7, 7] (15 levels). The values are written one per byte (int8 storage), the
 * layout torch._int_mm consumes; qsync_pack_int4 packs them two per byte.
 */
QSYNC_API int qsync_quantize_int4(const void* x, int x_dtype, int8_t* q, const float* inv_scale,
                                  int64_t n, int64_t inner, int stochastic, uint64_t seed,
                                  void* stream);

/*
 * Pack int4 values (int8 storage, each in [-8, 7]) of a row-major [rows, k] matrix two per
 * byte: packed[r, j] = (q[r, 2j] & 0xF) | ((q[r, 2j + 1] & 0xF) << 4), with a zero high
 * nibble in the last byte of a row when k is odd; packed is [rows, (k + 1) / 2].
 */
QSYNC_API int qsync_pack_int4(const int8_t* q, uint8_t* packed, int64_t rows, int64_t k,
                              void* stream);

/*
 * Integer GEMM on packed int4 operands (the layout of qsync_pack_int4), int32 accumulation:
 *   out[m, n] = sum_k a[m, k] * b[n, k]     (a: [M, K] packed, b: [N, K] packed, "NT")
 * Each nibble is sign-extended. Exact for any K below 2^31 / 64 (|a*b| <= 64). A CUDA-core
 * kernel (one thread per output element, eight int4 products per packed word): the
 * reference of the int4 path and its memory layout, not a tensor-core kernel; the runtime's
 * int4 GEMM runs torch._int_mm on the int8-stored values.
 */
QSYNC_API int qsync_int4_gemm(const uint8_t* a, const uint8_t* b, int32_t* out, int64_t m,
                              int64_t n, int64_t k, void* stream);

/* out[i] = (float)q[i] * scale[i / inner], written as out_dtype (round to nearest even). */
QSYNC_API int qsync_dequantize_int8(const int8_t* q, const float* scale, void* out,
                                    int out_dtype, int64_t n, int64_t inner, void* stream);

/*
 * Rescale an int32 GEMM result acc[m, n] (row-major): for column j
 *   s = sx * sw[j]; v = (float)acc[i] * s; if (bias) v = v + bias[j];
 * written as out_dtype (round to nearest even). bias may be NULL.
 */
QSYNC_API int qsync_rescale_int32(const int32_t* acc, float sx, const float* sw,
                                  const float* bias, void* out, int out_dtype, int64_t m,
                                  int64_t n, void* stream);

/*
 * The same with one scale per row (version 3): for row i, column j
 *   s = sx[i] * sw[j]; v = (float)acc[i, j] * s; if (bias) v = v + bias[j];
 */
QSYNC_API int qsync_rescale_int32_rows(const int32_t* acc, const float* sx, const float* sw,
                                       const float* bias, void* out, int out_dtype, int64_t m,
                                       int64_t n, void* stream);

/*
 * out[i] = u(i, seed) for i in [0, n): the stochastic-rounding uniform in [0, 1), 24 bits:
 *   h = (uint32)i * 0x9E3779B9; h ^= (uint32)((uint64)i >> 32) * 0x85EBCA6B;
 *   h += (uint32)seed * 0xC2B2AE35 + 0x27D4EB2F; murmur3 fmix32(h);
 *   u = (float)(h >> 8) * (1 / 16777216)
 */
QSYNC_API int qsync_hash_uniform(float* out, int64_t n, uint64_t seed, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* QSYNC_KERNELS_H_ */
