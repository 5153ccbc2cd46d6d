// The decode/verify step of a llama-family transformer (llama, qwen2, qwen3) for 1–16 query
// rows: bf16 weights and KV cache, f32 accumulation and residual stream. Compiled to PTX by
// build.rs (nvcc, sm_90) and loaded through cudarc; every kernel reads its lengths and positions
// from device memory (`state`: state[0] = position of row 0, state[1..17] = the rows' tokens), so
// one CUDA graph per window size replays with no parameter upload.
//
// Programmatic dependent launch: the host may launch each kernel while the previous one still
// runs (`Step::set_pdl`; off by default, it measured slower on the H200 in most cases). Every kernel then calls grid_wait() before it touches activations, the cache or
// any output (so it sees the previous kernel's writes, and by induction all earlier ones), and
// grid_launch() right after, letting the next kernel be scheduled (one grid ahead at most).
// The projections issue their first weight loads before grid_wait(): weights depend on
// nothing, so their latency overlaps the previous kernel. Without the launch attribute both
// instructions are no-ops.
//
// Layouts (row-major): activations [16 rows, width] (rows >= M are never read); a weight
// [N, K] (out, in); the KV cache of a layer [kv_heads, max_ctx, head_dim].
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

typedef __nv_bfloat16 bf16;

#define MAX_ROWS 16
#define ATTN_CHUNK 32
#define ATTN_PARTIAL_THREADS 128
#define HD_MAX 128
#define MAX_CTX_SPLITS 258  // 8256 positions: shape.rs's MAX_CTX

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
  __shared__ float part[32];
  __shared__ float total;
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) total = s;
  }
  __syncthreads();
  float r = total;
  __syncthreads();
  return r;
}

// 16 bytes of weights that are read once per step: bypass L1.
__device__ __forceinline__ uint4 load_stream(const bf16* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ void mma_bf16(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void grid_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

__device__ __forceinline__ void grid_launch() { asm volatile("griddepcontrol.launch_dependents;"); }

// Sums of squares of the RMS norms' rows, carried between kernels as fixed point with 20
// fraction bits: integer atomic adds commute, so the sum is the same bits whatever the order
// in which a projection's blocks add their columns' parts.
#define SSQ_ONE 1048576.0

__device__ __forceinline__ unsigned long long ssq_fixed(float ss) {
  return (unsigned long long)__double2ll_rn((double)ss * SSQ_ONE);
}

__device__ __forceinline__ float ssq_scale(unsigned long long q, int K, float eps) {
  return rsqrtf((float)((double)q * (1.0 / SSQ_ONE)) / K + eps);
}

template <int WARPS, int GEMM_UNROLL, bool NORM, int CS>
__device__ __forceinline__ void skinny_gemm_body(const bf16* __restrict__ X,
                                                 const unsigned long long* __restrict__ ssq,
                                                 const bf16* __restrict__ W,
                                                 const bf16* __restrict__ bias, void* out, int M, int N,
                                                 int K, int mode, float eps, bf16* __restrict__ xb_out,
                                                 const bf16* __restrict__ nw_out,
                                                 unsigned long long* __restrict__ ssq_out) {
  __shared__ float red[WARPS][MAX_ROWS][8];
  // With a cluster of CS blocks over K: this block's sums (16 rows x 8 columns), read by the
  // cluster's first block.
  __shared__ float cpart[MAX_ROWS * 8];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, t = lane & 3;
  int n0 = blockIdx.x * 8;
  const bf16* wrow = W + (size_t)(n0 + g) * K + t * 8;
  const bf16* x0 = X + (size_t)g * K + t * 8;
  const bf16* x1 = X + (size_t)(g + 8) * K + t * 8;
  int chunks = K / 32;
  if constexpr (CS > 1) {
    chunks /= CS;
    int k0 = (int)blockIdx.y * chunks * 32;  // gridDim.y == CS: the rank in the cluster
    wrow += k0;
    x0 += k0;
    x1 += k0;
  }
  bool r0 = g < M, r1 = g + 8 < M;
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wv[GEMM_UNROLL], av[GEMM_UNROLL], bv[GEMM_UNROLL];
#pragma unroll
  for (int u = 0; u < GEMM_UNROLL; u++) {
    int cc = warp + u * WARPS;
    wv[u] = cc < chunks ? load_stream(wrow + cc * 32) : zero;
  }
  grid_wait();
  grid_launch();
  for (int c = warp; c < chunks; c += WARPS * GEMM_UNROLL) {
#pragma unroll
    for (int u = 0; u < GEMM_UNROLL; u++) {
      int cc = c + u * WARPS;
      bool in = cc < chunks;
      if (c != warp) wv[u] = in ? load_stream(wrow + cc * 32) : zero;
      av[u] = (in && r0) ? *reinterpret_cast<const uint4*>(x0 + cc * 32) : zero;
      bv[u] = (in && r1) ? *reinterpret_cast<const uint4*>(x1 + cc * 32) : zero;
    }
#pragma unroll
    for (int u = 0; u < GEMM_UNROLL; u++) {
      mma_bf16(d, av[u].x, bv[u].x, av[u].y, bv[u].y, wv[u].x, wv[u].y);
      mma_bf16(d, av[u].z, bv[u].z, av[u].w, bv[u].w, wv[u].z, wv[u].w);
    }
  }
  red[warp][g][2 * t] = d[0];
  red[warp][g][2 * t + 1] = d[1];
  red[warp][g + 8][2 * t] = d[2];
  red[warp][g + 8][2 * t + 1] = d[3];
  __syncthreads();
  int tid = threadIdx.x;
  if constexpr (CS > 1) {
    // Each block adds its warps (in order), the cluster meets, and its first block adds the
    // blocks' sums in rank order (distributed shared memory) and runs the epilogue; the
    // others wait at a second barrier so that their shared memory outlives those reads.
    if (tid < MAX_ROWS * 8) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; w++) v += red[w][tid >> 3][tid & 7];
      cpart[tid] = v;
    }
    cg::this_cluster().sync();
    if (cg::this_cluster().block_rank() != 0) {
      cg::this_cluster().sync();
      return;
    }
  }
  // The sum of output (m, col) and the folded norm's scale of row m: rsqrt(mean(x^2) + eps),
  // the warps' (or the cluster's blocks') sums in order.
  auto total = [&](int m, int col) {
    float v = 0.f;
    if constexpr (CS > 1) {
#pragma unroll
      for (int r = 0; r < CS; r++) v += cg::this_cluster().map_shared_rank(cpart, r)[m * 8 + col];
    } else {
#pragma unroll
      for (int w = 0; w < WARPS; w++) v += red[w][m][col];
    }
    return v;
  };
  auto row_scale = [&](int m) { return ssq_scale(ssq[m], K, eps); };
  if (mode == 2) {
    if (tid < MAX_ROWS * 4) {
      int m = tid >> 2, j = tid & 3;
      if (m < M) {
        float gate = total(m, 2 * j), up = total(m, 2 * j + 1);
        if constexpr (NORM) {
          float rs = row_scale(m);
          gate *= rs;
          up *= rs;
        }
        float v = gate / (1.f + __expf(-gate)) * up;
        reinterpret_cast<bf16*>(out)[(size_t)m * (N / 2) + n0 / 2 + j] = __float2bfloat16(v);
      }
    }
  } else if (tid < MAX_ROWS * 8) {  // warps 0-3 whole: the shuffles below see every lane
    int m = tid >> 3, col = tid & 7;
    float nv = 0.f;
    if (m < M) {
      float v = total(m, col);
      if constexpr (NORM) v *= row_scale(m);
      float* o = reinterpret_cast<float*>(out) + (size_t)m * N + n0 + col;
      if (mode == 1) {
        nv = *o + v;
      } else {
        nv = bias ? v + __bfloat162float(bias[n0 + col]) : v;
      }
      *o = nv;
    }
    // The residual add can hand the next projection its RMS norm: bf16(x * nw) and the
    // row's sum of squares, these 8 columns' part (added in one order) added in fixed point.
    if (mode == 1 && xb_out) {
      float sq = nv * nv;
      sq += __shfl_xor_sync(0xffffffffu, sq, 1);
      sq += __shfl_xor_sync(0xffffffffu, sq, 2);
      sq += __shfl_xor_sync(0xffffffffu, sq, 4);
      if (m < M) {
        xb_out[(size_t)m * N + n0 + col] = __float2bfloat16(nv * __bfloat162float(nw_out[n0 + col]));
        if (col == 0) atomicAdd(ssq_out + m, ssq_fixed(sq));
      }
    }
  }
  if constexpr (CS > 1) cg::this_cluster().sync();
}

// The projections over 16 output columns a block (two mma tiles a warp): each activation
// fragment feeds two weight tiles (half the activation loads per weight byte of the 8-column
// kernel: the cost of windows of many rows), twice the weight bytes in flight a warp, half the
// blocks and epilogues. The warps split K as in skinny_gemm_body and add their sums in the same
// order, so every output has the bits of the 8-column kernels; the handed-over sums of squares
// are added 16 columns at a time (fixed point: the order of the adds does not matter, but the
// rounding of each part does, so the step never mixes plans within a shape). Needs N % 16 == 0
// and blockDim 256.
template <int WARPS, int UNROLL, bool NORM>
__device__ __forceinline__ void skinny_gemm_wide_body(const bf16* __restrict__ X,
                                                      const unsigned long long* __restrict__ ssq,
                                                      const bf16* __restrict__ W,
                                                      const bf16* __restrict__ bias, void* out,
                                                      int M, int N, int K, int mode, float eps,
                                                      bf16* __restrict__ xb_out,
                                                      const bf16* __restrict__ nw_out,
                                                      unsigned long long* __restrict__ ssq_out) {
  __shared__ float red[WARPS][MAX_ROWS][16];
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  int g = lane >> 2, t = lane & 3;
  int n0 = blockIdx.x * 16;
  const bf16* w0 = W + (size_t)(n0 + g) * K + t * 8;
  const bf16* w1 = w0 + (size_t)8 * K;
  const bf16* x0 = X + (size_t)g * K + t * 8;
  const bf16* x1 = X + (size_t)(g + 8) * K + t * 8;
  int chunks = K / 32;
  bool r0 = g < M, r1 = g + 8 < M;
  float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
  const uint4 zero = make_uint4(0, 0, 0, 0);
  uint4 wa[UNROLL], wb[UNROLL], av[UNROLL], bv[UNROLL];
#pragma unroll
  for (int u = 0; u < UNROLL; u++) {
    int cc = warp + u * WARPS;
    wa[u] = cc < chunks ? load_stream(w0 + cc * 32) : zero;
    wb[u] = cc < chunks ? load_stream(w1 + cc * 32) : zero;
  }
  grid_wait();
  grid_launch();
  for (int c = warp; c < chunks; c += WARPS * UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      int cc = c + u * WARPS;
      bool in = cc < chunks;
      if (c != warp) {
        wa[u] = in ? load_stream(w0 + cc * 32) : zero;
        wb[u] = in ? load_stream(w1 + cc * 32) : zero;
      }
      av[u] = (in && r0) ? *reinterpret_cast<const uint4*>(x0 + cc * 32) : zero;
      bv[u] = (in && r1) ? *reinterpret_cast<const uint4*>(x1 + cc * 32) : zero;
    }
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
      mma_bf16(d0, av[u].x, bv[u].x, av[u].y, bv[u].y, wa[u].x, wa[u].y);
      mma_bf16(d0, av[u].z, bv[u].z, av[u].w, bv[u].w, wa[u].z, wa[u].w);
      mma_bf16(d1, av[u].x, bv[u].x, av[u].y, bv[u].y, wb[u].x, wb[u].y);
      mma_bf16(d1, av[u].z, bv[u].z, av[u].w, bv[u].w, wb[u].z, wb[u].w);
    }
  }
  red[warp][g][2 * t] = d0[0];
  red[warp][g][2 * t + 1] = d0[1];
  red[warp][g + 8][2 * t] = d0[2];
  red[warp][g + 8][2 * t + 1] = d0[3];
  red[warp][g][8 + 2 * t] = d1[0];
  red[warp][g][8 + 2 * t + 1] = d1[1];
  red[warp][g + 8][8 + 2 * t] = d1[2];
  red[warp][g + 8][8 + 2 * t + 1] = d1[3];
  __syncthreads();
  int tid = threadIdx.x;
  auto total = [&](int m, int col) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; w++) v += red[w][m][col];
    return v;
  };
  auto row_scale = [&](int m) { return ssq_scale(ssq[m], K, eps); };
  if (mode == 2) {
    if (tid < MAX_ROWS * 8) {
      int m = tid >> 3, j = tid & 7;
      if (m < M) {
        float gate = total(m, 2 * j), up = total(m, 2 * j + 1);
        if constexpr (NORM) {
          float rs = row_scale(m);
          gate *= rs;
          up *= rs;
        }
        float v = gate / (1.f + __expf(-gate)) * up;
        reinterpret_cast<bf16*>(out)[(size_t)m * (N / 2) + n0 / 2 + j] = __float2bfloat16(v);
      }
    }
  } else {  // 256 threads: 16 rows x 16 columns, every warp whole for the shuffles below
    int m = tid >> 4, col = tid & 15;
    float nv = 0.f;
    if (m < M) {
      float v = total(m, col);
      if constexpr (NORM) v *= row_scale(m);
      float* o = reinterpret_cast<float*>(out) + (size_t)m * N + n0 + col;
      if (mode == 1) {
        nv = *o + v;
      } else {
        nv = bias ? v + __bfloat162float(bias[n0 + col]) : v;
      }
      *o = nv;
    }
    if (mode == 1 && xb_out) {
      float sq = nv * nv;
      sq += __shfl_xor_sync(0xffffffffu, sq, 1);
      sq += __shfl_xor_sync(0xffffffffu, sq, 2);
      sq += __shfl_xor_sync(0xffffffffu, sq, 4);
      sq += __shfl_xor_sync(0xffffffffu, sq, 8);
      if (m < M) {
        xb_out[(size_t)m * N + n0 + col] = __float2bfloat16(nv * __bfloat162float(nw_out[n0 + col]));
        if (col == 0) atomicAdd(ssq_out + m, ssq_fixed(sq));
      }
    }
  }
}

extern "C" {

// Deterministic pseudo-random weights, uniform in [-half_width, half_width] (splitmix64 of the
// element index and seed), drawn on the device: an 8B model needs no host-to-device copy.
__global__ void fill_uniform_bf16(bf16* out, uint64_t n, uint64_t seed, float half_width) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += stride) {
    uint64_t z = i + seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    float u = (float)(z >> 40) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16((2.f * u - 1.f) * half_width);
  }
}

__global__ void fill_const_bf16(bf16* out, uint64_t n, float value) {
  uint64_t stride = (uint64_t)gridDim.x * blockDim.x;
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = __float2bfloat16(value);
}

// x[m, :] = table[state[1 + m], :] in f32. Grid: M blocks. With `nw` (the first layer's
// attention norm, folded into qkv) also xb = bf16(x * nw) and the row's sum of squares in slot
// 0 of `ssq` (fixed point), zeroing the row in the other `slots` for the residual adds.
__global__ void embed(const bf16* __restrict__ table, const int* __restrict__ state,
                      float* __restrict__ x, int hidden, const bf16* __restrict__ nw,
                      bf16* __restrict__ xb, unsigned long long* __restrict__ ssq, int slots) {
  grid_wait();
  grid_launch();
  int m = blockIdx.x;
  const bf16* row = table + (size_t)state[1 + m] * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
    float v = __bfloat162float(row[i]);
    x[(size_t)m * hidden + i] = v;
    if (nw) {
      ss += v * v;
      xb[(size_t)m * hidden + i] = __float2bfloat16(v * __bfloat162float(nw[i]));
    }
  }
  if (nw) {  // uniform per block
    ss = block_sum(ss);
    if (threadIdx.x == 0) ssq[m] = ssq_fixed(ss);
    for (int sl = 1 + threadIdx.x; sl < slots; sl += blockDim.x) ssq[(size_t)sl * MAX_ROWS + m] = 0;
  }
}

// y[m, :] = bf16(x[m, :] * rsqrt(mean(x^2) + eps) * w). Grid: M blocks.
__global__ void rmsnorm(const float* __restrict__ x, const bf16* __restrict__ w,
                        bf16* __restrict__ y, int hidden, float eps) {
  grid_wait();
  grid_launch();
  int m = blockIdx.x;
  const float* row = x + (size_t)m * hidden;
  float ss = 0.f;
  for (int i = threadIdx.x; i < hidden; i += blockDim.x) ss += row[i] * row[i];
  float r = rsqrtf(block_sum(ss) / hidden + eps);
  for (int i = threadIdx.x; i < hidden; i += blockDim.x)
    y[(size_t)m * hidden + i] = __float2bfloat16(row[i] * r * __bfloat162float(w[i]));
}

// The projections of 1–16 rows: acc[m, n] = sum_k X[m, k] W[n, k], W streamed from memory
// once for all rows. One block per 8 output columns; its warps split K and meet in shared
// memory. Tensor cores (mma m16n8k16) do the products: each lane loads 16 bytes of a weight row
// (8 consecutive k) and the same 8 k of its two activation rows; the k order inside the two
// mma steps is a permutation shared by A and B, so the sum is the plain dot product.
//   mode 0: out_f32[m, n] = acc (+ bias[n] when bias is not null)
//   mode 1: out_f32[m, n] += acc                       (the residual add)
//   mode 2: columns 2j, 2j+1 are gate_j, up_j: out_bf16[m, j] = silu(gate_j) * up_j
// `_norm`: the RMS norm is folded in: X holds bf16(x * nw) and `ssq` the rows' sums of
// squares of x (fixed point), written by the kernel before (embed, or a residual add given
// `xb_out`, `nw_out`, `ssq_out`); acc is scaled by the row's rsqrt(mean(x^2) + eps).
// Needs N % 8 == 0, K % 32 == 0, 16-byte aligned rows (the host checks).
// Each warp keeps 4 chunks of 32 k in flight; `_deep` keeps 8 (more bytes in flight where few
// blocks share the multiprocessors, and one round trip for the 6 chunks a warp takes of a K of
// 1536). `_b4` is capped at 64 registers so that four blocks fit an SM: one wave where the
// plain kernel needs two (the 512 tiles of a 4096-wide projection on 132 SMs), and more
// resident blocks to hide the epilogue of short blocks.
#define GEMM_ARGS                                                                              \
  const bf16 *__restrict__ X, const unsigned long long *__restrict__ ssq,                      \
      const bf16 *__restrict__ W, const bf16 *__restrict__ bias, void *out, int M, int N, int K, \
      int mode, float eps, bf16 *__restrict__ xb_out, const bf16 *__restrict__ nw_out,           \
      unsigned long long *__restrict__ ssq_out
#define GEMM_PASS X, ssq, W, bias, out, M, N, K, mode, eps, xb_out, nw_out, ssq_out
#define GEMM_KERNEL(name, bounds, unroll, norm, cs) \
  __global__ void bounds name(GEMM_ARGS) { skinny_gemm_body<8, unroll, norm, cs>(GEMM_PASS); }
#define B1 __launch_bounds__(256)
#define B4 __launch_bounds__(256, 4)
GEMM_KERNEL(skinny_gemm, B1, 4, false, 1)
GEMM_KERNEL(skinny_gemm_b4, B4, 4, false, 1)
GEMM_KERNEL(skinny_gemm_deep, B1, 8, false, 1)
GEMM_KERNEL(skinny_gemm_norm, B1, 4, true, 1)
GEMM_KERNEL(skinny_gemm_b4_norm, B4, 4, true, 1)
GEMM_KERNEL(skinny_gemm_deep_norm, B1, 8, true, 1)
// Split-K over a cluster of 2 or 4 blocks (grid (N / 8, CS)): more, shorter blocks for grids
// that would leave multiprocessors idle or unevenly loaded, merged through distributed shared
// memory with no global atomics.
#define C2 __cluster_dims__(1, 2, 1)
#define C4 __cluster_dims__(1, 4, 1)
GEMM_KERNEL(skinny_gemm_x2, C2 B1, 4, false, 2)
GEMM_KERNEL(skinny_gemm_b4_x2, C2 B4, 4, false, 2)
GEMM_KERNEL(skinny_gemm_x4, C4 B1, 4, false, 4)
GEMM_KERNEL(skinny_gemm_b4_x4, C4 B4, 4, false, 4)
GEMM_KERNEL(skinny_gemm_norm_x2, C2 B1, 4, true, 2)
GEMM_KERNEL(skinny_gemm_b4_norm_x2, C2 B4, 4, true, 2)
GEMM_KERNEL(skinny_gemm_norm_x4, C4 B1, 4, true, 4)
GEMM_KERNEL(skinny_gemm_b4_norm_x4, C4 B4, 4, true, 4)
// 16 columns a block: `_w16` 2 chunks of each tile in flight a warp, capped at 64 registers
// (four blocks an SM); `_w16d` 4 chunks (two blocks an SM).
#define GEMM_WIDE_KERNEL(name, bounds, unroll, norm) \
  __global__ void bounds name(GEMM_ARGS) { skinny_gemm_wide_body<8, unroll, norm>(GEMM_PASS); }
GEMM_WIDE_KERNEL(skinny_gemm_w16, B4, 2, false)
GEMM_WIDE_KERNEL(skinny_gemm_w16d, B1, 4, false)
GEMM_WIDE_KERNEL(skinny_gemm_w16_norm, B4, 2, true)
GEMM_WIDE_KERNEL(skinny_gemm_w16d_norm, B1, 4, true)

// Per (row, head) of the fused q|k|v output: the optional per-head RMS norm (qwen3), rotary
// embedding (rotate-half) at position state[0] + m, then q to `q` (f32 [M, heads, hd]) and k, v
// into the layer's cache at that position. Grid: (M, heads + 2 kv_heads); block: hd / 2.
__global__ void rope_kv(const float* __restrict__ qkv, const int* __restrict__ state,
                        const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                        const bf16* __restrict__ q_norm, const bf16* __restrict__ k_norm,
                        float* __restrict__ q, bf16* __restrict__ k_cache,
                        bf16* __restrict__ v_cache, int heads, int kv_heads, int hd, int max_ctx,
                        float eps) {
  grid_wait();
  grid_launch();
  int m = blockIdx.x, h = blockIdx.y, i = threadIdx.x, half = hd / 2;
  int pos = state[0] + m;
  int width = (heads + 2 * kv_heads) * hd;
  const float* src = qkv + (size_t)m * width + (size_t)h * hd;
  float a = src[i], b = src[i + half];
  if (h >= heads + kv_heads) {  // v: straight into the cache
    int kvh = h - heads - kv_heads;
    bf16* dst = v_cache + ((size_t)kvh * max_ctx + pos) * hd;
    dst[i] = __float2bfloat16(a);
    dst[i + half] = __float2bfloat16(b);
    return;
  }
  const bf16* nw = h < heads ? q_norm : k_norm;
  if (nw) {  // uniform per block: the branch holds no divergent barrier
    float r = rsqrtf(block_sum(a * a + b * b) / hd + eps);
    a = a * r * __bfloat162float(nw[i]);
    b = b * r * __bfloat162float(nw[i + half]);
  }
  float c = cos_t[(size_t)pos * half + i], s = sin_t[(size_t)pos * half + i];
  float ra = a * c - b * s, rb = b * c + a * s;
  if (h < heads) {
    float* dst = q + ((size_t)m * heads + h) * hd;
    dst[i] = ra;
    dst[i + half] = rb;
  } else {
    bf16* dst = k_cache + ((size_t)(h - heads) * max_ctx + pos) * hd;
    dst[i] = __float2bfloat16(ra);
    dst[i + half] = __float2bfloat16(rb);
  }
}

// Split-KV attention, first pass: block (head h, split s) takes keys [32 s, 32 s + 32) for all
// M rows of head h (causal: row m sees keys 0..state[0] + m) and writes its unnormalised output
// and (max, sum) for the second pass. Splits past the current length exit at once, so a graph
// sized for max_ctx replays at any length. Grid: (heads, ceil(max_ctx / 32)); block: 128.
__global__ void __launch_bounds__(ATTN_PARTIAL_THREADS)
    attn_partial(const float* __restrict__ q, const bf16* __restrict__ k_cache,
                 const bf16* __restrict__ v_cache, const int* __restrict__ state,
                 float* __restrict__ part_o, float* __restrict__ part_ml, int M, int heads,
                 int kv_heads, int hd, int max_ctx, float scale) {
  __shared__ float q_s[MAX_ROWS][HD_MAX];
  __shared__ float k_s[ATTN_CHUNK][HD_MAX + 1];
  __shared__ float v_s[ATTN_CHUNK][HD_MAX];
  __shared__ float p_s[MAX_ROWS][ATTN_CHUNK];
  grid_wait();
  grid_launch();
  int h = blockIdx.x, s = blockIdx.y, splits = gridDim.y;
  int kvh = h / (heads / kv_heads);
  int pos0 = state[0];
  int kbeg = s * ATTN_CHUNK;
  if (kbeg >= pos0 + M) return;
  int nk = min(ATTN_CHUNK, pos0 + M - kbeg);
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (int e = tid; e < M * hd; e += ATTN_PARTIAL_THREADS) {
    int m = e / hd, dd = e % hd;
    q_s[m][dd] = q[((size_t)m * heads + h) * hd + dd] * scale;
  }
  const bf16* kc = k_cache + ((size_t)kvh * max_ctx + kbeg) * hd;
  const bf16* vc = v_cache + ((size_t)kvh * max_ctx + kbeg) * hd;
  for (int e = tid; e < nk * hd; e += ATTN_PARTIAL_THREADS) {
    int j = e / hd, dd = e % hd;
    k_s[j][dd] = __bfloat162float(kc[e]);
    v_s[j][dd] = __bfloat162float(vc[e]);
  }
  __syncthreads();
  for (int e = tid; e < M * ATTN_CHUNK; e += ATTN_PARTIAL_THREADS) {
    int m = e / ATTN_CHUNK, j = e % ATTN_CHUNK;
    float sc = -INFINITY;
    if (j < nk && kbeg + j <= pos0 + m) {
      sc = 0.f;
      for (int dd = 0; dd < hd; dd++) sc += q_s[m][dd] * k_s[j][dd];
    }
    p_s[m][j] = sc;
  }
  __syncthreads();
  for (int m = warp; m < M; m += ATTN_PARTIAL_THREADS / 32) {
    float v = p_s[m][lane];
    float mx = warp_max(v);
    float e = mx == -INFINITY ? 0.f : __expf(v - mx);
    p_s[m][lane] = e;
    float sum = warp_sum(e);
    if (lane == 0) {
      size_t at = ((size_t)m * heads + h) * splits + s;
      part_ml[2 * at] = mx;
      part_ml[2 * at + 1] = sum;
    }
  }
  __syncthreads();
  for (int e = tid; e < M * hd; e += ATTN_PARTIAL_THREADS) {
    int m = e / hd, dd = e % hd;
    float o = 0.f;
    for (int j = 0; j < nk; j++) o += p_s[m][j] * v_s[j][dd];
    part_o[(((size_t)m * heads + h) * splits + s) * hd + dd] = o;
  }
}

// The merge of split-KV attention, shared by attn_merge and attn_fused so that both give the
// same bits. By one warp: the weights exp(max_s - max) of row m's splits (exactly 1 for the
// largest, so a row whose keys sit in one split gets that split's result bit for bit; 0 for
// splits holding none of its keys) into w[0..used), and their sum weighted by the splits' sums,
// returned to every lane. `ml` points at the row's (max, sum) of split 0.
__device__ __forceinline__ float merge_weights(const float* __restrict__ ml, int used, float* w) {
  int lane = threadIdx.x & 31;
  float gmax = -INFINITY;
  for (int p = lane; p < used; p += 32) gmax = fmaxf(gmax, __ldcg(ml + 2 * p));
  gmax = warp_max(gmax);
  float l = 0.f;
  for (int p = lane; p < used; p += 32) {
    float mx = __ldcg(ml + 2 * p);
    float wp = mx == -INFINITY ? 0.f : (mx == gmax ? 1.f : __expf(mx - gmax));
    if (wp != 0.f) l += wp * __ldcg(ml + 2 * p + 1);
    w[p] = wp;
  }
  return warp_sum(l);
}

// One output value of the merge: the splits' unnormalised outputs `po` (stride hd) weighted,
// added in split order; the loads of 16 splits at a time are issued together (one round trip
// each 16 splits, not one a split).
__device__ __forceinline__ float merge_value(const float* __restrict__ po, int used, int hd,
                                             const float* w) {
  constexpr int BATCH = 16;
  float o = 0.f;
  for (int p0 = 0; p0 < used; p0 += BATCH) {
    float v[BATCH];
#pragma unroll
    for (int i = 0; i < BATCH; i++) v[i] = p0 + i < used ? __ldcg(po + (size_t)(p0 + i) * hd) : 0.f;
#pragma unroll
    for (int i = 0; i < BATCH; i++) {
      if (p0 + i < used) {
        float wp = w[p0 + i];
        if (wp != 0.f) o += wp * v[i];
      }
    }
  }
  return o;
}

// Split-KV attention, second pass: row m of head h merges the splits that hold its keys and
// writes bf16 out[m, h * hd + d]. Grid: (heads, M); block: 128 (hd <= 128).
__global__ void attn_merge(const float* __restrict__ part_o, const float* __restrict__ part_ml,
                           const int* __restrict__ state, bf16* __restrict__ out, int heads,
                           int hd, int splits) {
  __shared__ float w_s[MAX_CTX_SPLITS];
  __shared__ float l_s;
  grid_wait();
  grid_launch();
  int h = blockIdx.x, m = blockIdx.y, dd = threadIdx.x;
  int used = (state[0] + m + 1 + ATTN_CHUNK - 1) / ATTN_CHUNK;
  size_t base = ((size_t)m * heads + h) * splits;
  if (threadIdx.x < 32) {
    float l = merge_weights(part_ml + 2 * base, used, w_s);
    if (threadIdx.x == 0) l_s = l;
  }
  __syncthreads();
  if (dd < hd) {
    float o = merge_value(part_o + base * hd + dd, used, hd, w_s);
    out[((size_t)m * heads + h) * hd + dd] = __float2bfloat16(o / l_s);
  }
}

// One head-row of q or k from the fused q|k|v output `src` (hd values), by one warp: the
// optional per-head RMS norm (qwen3), rotary embedding (rotate-half) at `pos`, times `mul`,
// into dst[0..hd) (rounded through bf16 when `round`, as the KV cache stores it). Every load
// (the row, cos/sin, the norm's weights) is issued before the first use: one memory round trip.
__device__ __forceinline__ void rope_row(const float* __restrict__ src, const bf16* __restrict__ nw,
                                         const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int pos, int hd,
                                         float eps, float mul, bool round, float* dst) {
  constexpr int IT = HD_MAX / 64;  // values a lane holds of each half
  int lane = threadIdx.x & 31, half = hd / 2;
  float a[IT], b[IT], c[IT], s[IT], wa[IT], wb[IT];
#pragma unroll
  for (int it = 0; it < IT; it++) {
    int i = lane + 32 * it;
    a[it] = b[it] = c[it] = s[it] = 0.f;
    wa[it] = wb[it] = 1.f;
    if (i < half) {
      a[it] = src[i];
      b[it] = src[i + half];
      c[it] = cos_t[(size_t)pos * half + i];
      s[it] = sin_t[(size_t)pos * half + i];
      if (nw) {
        wa[it] = __bfloat162float(nw[i]);
        wb[it] = __bfloat162float(nw[i + half]);
      }
    }
  }
  float r = 1.f;
  if (nw) {
    float ss = 0.f;
#pragma unroll
    for (int it = 0; it < IT; it++)
      if (lane + 32 * it < half) ss += a[it] * a[it] + b[it] * b[it];
    r = rsqrtf(warp_sum(ss) / hd + eps);
  }
#pragma unroll
  for (int it = 0; it < IT; it++) {
    int i = lane + 32 * it;
    if (i >= half) continue;
    float x = a[it], y = b[it];
    if (nw) {
      x = x * r * wa[it];
      y = y * r * wb[it];
    }
    float ra = (x * c[it] - y * s[it]) * mul, rb = (y * c[it] + x * s[it]) * mul;
    if (round) {
      ra = __bfloat162float(__float2bfloat16(ra));
      rb = __bfloat162float(__float2bfloat16(rb));
    }
    dst[i] = ra;
    dst[i + half] = rb;
  }
}

// Attention in one kernel: rope (+ q/k norm), the K/V write of the window's rows, split-KV
// attention and the merge. Block (head h, split s) takes keys [32 s, 32 s + 32) for all M rows
// of head h (causal: row m sees keys 0..state[0] + m). Keys before state[0] come from the
// cache; the window's own keys and values are computed from `qkv` by every block that needs
// them (rounded to bf16 as the cache holds them) and written to the cache by the first head of
// each kv group, so no block waits on another before the merge. With `merge` and one split
// in use the block writes the output; with `merge` and more, each writes its unnormalised
// output and (max, sum) and the last of the head's blocks to arrive (a counter per head, reset
// by it) merges them in split order; without `merge` every block writes its partial and
// attn_merge merges (one block per row and head: the faster for windows of many rows). Splits
// past the current length exit at once, so a graph sized for max_ctx replays at any length.
// The cached keys and values arrive in 16-byte loads all issued before the queries' rope (one
// memory round trip, not one per 4 keys), and the scores and weighted values run over the
// window's rows only (attn_scores, attn_values: a one-row step does one row's work).
// Grid: (heads, ceil(max_ctx / 32)); block: 128 or 256.
}  // extern "C"

// The scores of R query rows (q0, q0 + stride, ...; scaled, in shared memory) against one
// key (`krow`, this lane's): four partial sums over d mod 4, added in one order, so a score
// has the same bits whatever R, the block's size or the window's rows.
template <int R>
__device__ __forceinline__ void attn_scores(const float* krow, const float* q0, int stride,
                                            int hd, float* sc) {
  float a[R][4];
#pragma unroll
  for (int i = 0; i < R; i++) a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
  for (int dd = 0; dd < hd; dd += 4) {
    float k0 = krow[dd], k1 = krow[dd + 1], k2 = krow[dd + 2], k3 = krow[dd + 3];
#pragma unroll
    for (int i = 0; i < R; i++) {
      float4 qv = *reinterpret_cast<const float4*>(q0 + i * stride + dd);
      a[i][0] += qv.x * k0;
      a[i][1] += qv.y * k1;
      a[i][2] += qv.z * k2;
      a[i][3] += qv.w * k3;
    }
  }
#pragma unroll
  for (int i = 0; i < R; i++) sc[i] = (a[i][0] + a[i][1]) + (a[i][2] + a[i][3]);
}

// Value column `v` (stride HD_MAX + 0: v_s rows) weighted by R rows of probabilities (p0,
// p0 + stride, ...), the nk keys in order: the same bits whatever R.
template <int R>
__device__ __forceinline__ void attn_values(const float* v, const float* p0, int stride, int nk,
                                            float* o) {
  float a[R];
#pragma unroll
  for (int i = 0; i < R; i++) a[i] = 0.f;
  for (int j = 0; j < nk; j++) {
    float x = v[j * HD_MAX];
#pragma unroll
    for (int i = 0; i < R; i++) a[i] += p0[i * stride + j] * x;
  }
#pragma unroll
  for (int i = 0; i < R; i++) o[i] = a[i];
}

template <int ATTN_THREADS>
__device__ __forceinline__ void attn_fused_body(
    const float* __restrict__ qkv, const int* __restrict__ state, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const bf16* __restrict__ q_norm,
    const bf16* __restrict__ k_norm, bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
    float* __restrict__ part_o, float* __restrict__ part_ml, unsigned* __restrict__ counters,
    bf16* __restrict__ out, int M, int heads, int kv_heads, int hd, int max_ctx, float scale,
    float eps, int merge) {
  __shared__ __align__(16) float q_s[MAX_ROWS][HD_MAX];
  __shared__ float k_s[ATTN_CHUNK][HD_MAX + 1];
  __shared__ float v_s[ATTN_CHUNK][HD_MAX];
  __shared__ float p_s[MAX_ROWS][ATTN_CHUNK];
  __shared__ float l_s[MAX_ROWS];
  __shared__ int is_last;
  grid_wait();
  grid_launch();
  int h = blockIdx.x, s = blockIdx.y, splits = gridDim.y;
  int group = heads / kv_heads, kvh = h / group;
  int pos0 = state[0], total = pos0 + M;
  int kbeg = s * ATTN_CHUNK;
  if (kbeg >= total) return;
  int nk = min(ATTN_CHUNK, total - kbeg);
  int used = (total + ATTN_CHUNK - 1) / ATTN_CHUNK;
  int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int WARPS = ATTN_THREADS / 32;
  int width = (heads + 2 * kv_heads) * hd;
  // Cached keys and values of this split: every 16-byte load issued at once (one memory
  // round trip), kept in registers while the queries' rope runs, then into shared memory.
  constexpr int PER = ATTN_CHUNK * HD_MAX / 8 / ATTN_THREADS;
  int cached = max(0, min(nk, pos0 - kbeg));
  int vrow = hd / 8, nvec = cached * vrow;
  const uint4* kc = reinterpret_cast<const uint4*>(k_cache + ((size_t)kvh * max_ctx + kbeg) * hd);
  const uint4* vc = reinterpret_cast<const uint4*>(v_cache + ((size_t)kvh * max_ctx + kbeg) * hd);
  uint4 kr[PER], vr[PER];
#pragma unroll
  for (int u = 0; u < PER; u++) {
    int e = tid + u * ATTN_THREADS;
    if (e < nvec) {
      kr[u] = kc[e];
      vr[u] = vc[e];
    }
  }
  for (int m = warp; m < M; m += WARPS)
    rope_row(qkv + (size_t)m * width + (size_t)h * hd, q_norm, cos_t, sin_t, pos0 + m, hd, eps,
             scale, false, q_s[m]);
  // The window's keys (one warp a key).
  bool writer = h % group == 0;
  for (int j = cached + warp; j < nk; j += WARPS) {
    int p = kbeg + j, m = p - pos0;
    const float* row = qkv + (size_t)m * width;
    rope_row(row + (size_t)(heads + kvh) * hd, k_norm, cos_t, sin_t, p, hd, eps, 1.f, true,
             k_s[j]);
    const float* vsrc = row + (size_t)(heads + kv_heads + kvh) * hd;
    for (int dd = lane; dd < hd; dd += 32) v_s[j][dd] = __bfloat162float(__float2bfloat16(vsrc[dd]));
    if (writer) {
      __syncwarp();
      bf16* kd = k_cache + ((size_t)kvh * max_ctx + p) * hd;
      bf16* vd = v_cache + ((size_t)kvh * max_ctx + p) * hd;
      for (int dd = lane; dd < hd; dd += 32) {
        kd[dd] = __float2bfloat16(k_s[j][dd]);
        vd[dd] = __float2bfloat16(v_s[j][dd]);
      }
    }
  }
#pragma unroll
  for (int u = 0; u < PER; u++) {
    int e = tid + u * ATTN_THREADS;
    if (e < nvec) {
      int j = e / vrow, d0 = (e - j * vrow) * 8;
      const __nv_bfloat162* kp = reinterpret_cast<const __nv_bfloat162*>(&kr[u]);
      const __nv_bfloat162* vp = reinterpret_cast<const __nv_bfloat162*>(&vr[u]);
#pragma unroll
      for (int i = 0; i < 4; i++) {
        float2 kf = __bfloat1622float2(kp[i]), vf = __bfloat1622float2(vp[i]);
        k_s[j][d0 + 2 * i] = kf.x;
        k_s[j][d0 + 2 * i + 1] = kf.y;
        v_s[j][d0 + 2 * i] = vf.x;
        v_s[j][d0 + 2 * i + 1] = vf.y;
      }
    }
  }
  __syncthreads();
  // Scores: warp w takes rows w, w + WARPS, ..., lane j key j (attn_scores; only the rows the
  // window has, so a one-row step does one row's work). The softmax of each row stays in its
  // warp's registers.
  constexpr int RPW = MAX_ROWS / WARPS;
  int nr = M > warp ? (M - warp + WARPS - 1) / WARPS : 0;
  float sc[4];
  const float* krow = k_s[lane];
  const float* q0 = q_s[warp];
  if (nr >= 4) attn_scores<4>(krow, q0, WARPS * HD_MAX, hd, sc);
  else if (nr == 3) attn_scores<3>(krow, q0, WARPS * HD_MAX, hd, sc);
  else if (nr == 2) attn_scores<2>(krow, q0, WARPS * HD_MAX, hd, sc);
  else if (nr == 1) attn_scores<1>(krow, q0, WARPS * HD_MAX, hd, sc);
#pragma unroll
  for (int r = 0; r < RPW; r++) {
    if (r >= nr) break;
    int m = warp + r * WARPS;
    float v = (lane < nk && kbeg + lane <= pos0 + m) ? sc[r] : -INFINITY;
    float mx = warp_max(v);
    float e = mx == -INFINITY ? 0.f : __expf(v - mx);
    p_s[m][lane] = e;
    float sum = warp_sum(e);
    if (lane == 0) {
      l_s[m] = sum;
      if (used > 1 || !merge) {
        size_t at = ((size_t)m * heads + h) * splits + s;
        part_ml[2 * at] = mx;
        part_ml[2 * at + 1] = sum;
      }
    }
  }
  __syncthreads();
  // Weighted values: thread (d, g) takes rows g, g + G, ... (G = threads / hd) of value column
  // d, up to 4 at a time (attn_values), the keys in order.
  int G = ATTN_THREADS / hd, dd = tid % hd;
  for (int m0 = tid / hd; m0 < M; m0 += 4 * G) {
    int left = (M - m0 + G - 1) / G;
    float o[4];
    if (left >= 4) attn_values<4>(&v_s[0][dd], &p_s[m0][0], G * ATTN_CHUNK, nk, o);
    else if (left == 3) attn_values<3>(&v_s[0][dd], &p_s[m0][0], G * ATTN_CHUNK, nk, o);
    else if (left == 2) attn_values<2>(&v_s[0][dd], &p_s[m0][0], G * ATTN_CHUNK, nk, o);
    else attn_values<1>(&v_s[0][dd], &p_s[m0][0], G * ATTN_CHUNK, nk, o);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if (i >= left) break;
      int m = m0 + i * G;
      if (used == 1 && merge)
        out[((size_t)m * heads + h) * hd + dd] = __float2bfloat16(o[i] / l_s[m]);
      else
        part_o[(((size_t)m * heads + h) * splits + s) * hd + dd] = o[i];
    }
  }
  if (used == 1 || !merge) return;
  __threadfence();
  __syncthreads();
  if (tid == 0) is_last = atomicAdd(&counters[h], 1u) == (unsigned)(used - 1);
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  // The merge (merge_weights, merge_value), each row's weights in the reused key tile.
  float* w_s = &k_s[0][0];  // MAX_ROWS * used <= 32 * 129 floats: the host caps max_ctx
  for (int m = warp; m < M; m += WARPS) {
    float l = merge_weights(part_ml + 2 * ((size_t)m * heads + h) * splits, used, w_s + m * used);
    if (lane == 0) l_s[m] = l;
  }
  __syncthreads();
  for (int e = tid; e < M * hd; e += ATTN_THREADS) {
    int m = e / hd, d2 = e % hd;
    float ov = merge_value(part_o + ((size_t)m * heads + h) * splits * hd + d2, used, hd,
                           w_s + m * used);
    out[((size_t)m * heads + h) * hd + d2] = __float2bfloat16(ov / l_s[m]);
  }
  if (tid == 0) counters[h] = 0;
}

extern "C" {

#define ATTN_ARGS                                                                                 \
  const float *__restrict__ qkv, const int *__restrict__ state, const float *__restrict__ cos_t,  \
      const float *__restrict__ sin_t, const bf16 *__restrict__ q_norm,                           \
      const bf16 *__restrict__ k_norm, bf16 *__restrict__ k_cache, bf16 *__restrict__ v_cache,    \
      float *__restrict__ part_o, float *__restrict__ part_ml, unsigned *__restrict__ counters,    \
      bf16 *__restrict__ out, int M, int heads, int kv_heads, int hd, int max_ctx, float scale,   \
      float eps, int merge
#define ATTN_PASS                                                                               \
  qkv, state, cos_t, sin_t, q_norm, k_norm, k_cache, v_cache, part_o, part_ml, counters, out, M, \
      heads, kv_heads, hd, max_ctx, scale, eps, merge
// The same with 128 and 256 threads (every value is computed by one thread or one warp in one
// order whatever the block's size, so both give the same bits): the wider for windows of many
// rows, whose scores and weighted sums are most of the work. Register caps keep five blocks
// an SM (the shared-memory limit) at 128 threads and three at 256.
__global__ void __launch_bounds__(128, 5) attn_fused(ATTN_ARGS) { attn_fused_body<128>(ATTN_PASS); }
__global__ void __launch_bounds__(256, 3) attn_fused_wide(ATTN_ARGS) { attn_fused_body<256>(ATTN_PASS); }

// The better of two (value, index) candidates: the larger value, the lower index among equal
// values (so the result is the lowest index of the maximum whatever the order of comparison).
__device__ __forceinline__ void argmax_pick(float& bv, int& bi, float ov, int oi) {
  if (ov > bv || (ov == bv && oi < bi)) {
    bv = ov;
    bi = oi;
  }
}

// The block's best (value, index), to every thread (blockDim.x a multiple of 32, <= 1024).
__device__ __forceinline__ void argmax_block(float& bv, int& bi) {
  __shared__ float best_v[32];
  __shared__ int best_i[32];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    argmax_pick(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (lane == 0) {
    best_v[warp] = bv;
    best_i[warp] = bi;
  }
  __syncthreads();
  int nw = blockDim.x >> 5;
  bv = lane < nw ? best_v[lane] : -INFINITY;
  bi = lane < nw ? best_i[lane] : 0x7fffffff;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    argmax_pick(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
}

// ids[m] = argmax of logits[m, :] (the lowest index among equal maxima). Grid: (M, splits of
// the row, at most 32); each block takes a slice and writes its best to `part` ((value,
// index) pairs, [MAX_ROWS][32]); the last of the row's blocks to arrive (a counter per row in
// `count`, reset by it) picks the best of the slices. The maximum and the lowest index among
// equal values do not depend on the order of comparison: the same ids as one block a row.
__global__ void argmax_rows(const float* __restrict__ logits, int* __restrict__ ids, int vocab,
                            float2* __restrict__ part, unsigned* __restrict__ count) {
  __shared__ int is_last;
  grid_wait();
  grid_launch();
  int m = blockIdx.x, b = blockIdx.y, nb = gridDim.y;
  int per = (vocab + nb - 1) / nb;
  int lo = b * per, hi = min(vocab, lo + per);
  const float* row = logits + (size_t)m * vocab;
  float bv = -INFINITY;
  int bi = 0x7fffffff;
  for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
    float v = row[i];
    if (v > bv) {
      bv = v;
      bi = i;
    }
  }
  argmax_block(bv, bi);
  if (nb == 1) {
    if (threadIdx.x == 0) ids[m] = bi;
    return;
  }
  if (threadIdx.x == 0) {
    part[m * 32 + b] = make_float2(bv, __int_as_float(bi));
    __threadfence();
    is_last = atomicAdd(&count[m], 1u) == (unsigned)(nb - 1);
  }
  __syncthreads();
  if (!is_last || threadIdx.x >= 32) return;
  __threadfence();
  int lane = threadIdx.x;
  float2 pv = lane < nb ? __ldcg(&part[m * 32 + lane]) : make_float2(-INFINITY, __int_as_float(0x7fffffff));
  bv = pv.x;
  bi = __float_as_int(pv.y);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    argmax_pick(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
  if (lane == 0) {
    ids[m] = bi;
    count[m] = 0;
  }
}

}  // extern "C"
