// Thread 0 asks the L2 for the weight rows this block's warps will read (one warp per row):
// they do not depend on the previous kernel, so they may be fetched before PDL_ENTRY.
template <typename W>
__device__ __forceinline__ void prefetch_block_rows(const W* w, int out, int in) {
    if (threadIdx.x == 0) {
        const int j0 = blockIdx.x * (blockDim.x >> 5);
        const int rows = min((int)(blockDim.x >> 5), out - j0);
        if (rows > 0) prefetch_l2(w + (size_t)j0 * in, (unsigned)((size_t)rows * in * sizeof(W)));
    }
}

// Float4s of its weight row a lane of a small-batch product loads into registers before the
// kernel waits for its predecessor (the first 4 KiB of the row per warp): weights do not
// depend on earlier kernels, so their latency overlaps the predecessor's run instead of
// adding to the step's chain of dependent kernels.
#define W_AHEAD 8

// As load_wrow, through the read-only data path (__ldg): the weight rows loaded before the wait.
template <typename W>
__device__ __forceinline__ void load_ahead(float4 (&wa)[W_AHEAD], const W* __restrict__ wr,
                                           int in, int lane) {
#pragma unroll
    for (int u = 0; u < W_AHEAD; u++) {
        const int i = lane * 4 + u * 128;
        wa[u] = i < in ? wldg4(wr + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// One row's float4s lane * 4 + 128 u (u < W_AHEAD; zero past `in`), every load issued before
// any is used: the row arrives in one round trip, not one per float4.
__device__ __forceinline__ void load_row(float4 (&xr)[W_AHEAD], const float* __restrict__ x,
                                         int in, int lane) {
#pragma unroll
    for (int u = 0; u < W_AHEAD; u++) {
        const int i = lane * 4 + u * 128;
        xr[u] = i < in ? *(const float4*)(x + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// As load_row, for a weight row in its stored dtype (widened as it is loaded).
template <typename W>
__device__ __forceinline__ void load_wrow(float4 (&wr4)[W_AHEAD], const W* __restrict__ w,
                                          int in, int lane) {
#pragma unroll
    for (int u = 0; u < W_AHEAD; u++) {
        const int i = lane * 4 + u * 128;
        wr4[u] = i < in ? wload4(w + i) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// acc + wv . xv, the products summed last lane first (every product of this file's small-batch
// paths sums this way, so their results agree bit for bit).
__device__ __forceinline__ float fma4(float4 wv, float4 xv, float acc) {
    return fmaf(wv.x, xv.x, fmaf(wv.y, xv.y, fmaf(wv.z, xv.z, fmaf(wv.w, xv.w, acc))));
}

// gv * (xv * inv), element by element: an RMSNorm'd float4.
__device__ __forceinline__ float4 normed4(float4 gv, float4 xv, float inv) {
    return make_float4(gv.x * (xv.x * inv), gv.y * (xv.y * inv), gv.z * (xv.z * inv), gv.w * (xv.w * inv));
}

// acc[r] += wr . x[r] for r < n <= 4, or with `nw` not null wr . (nw * (x[r] * inv[r])) (an
// RMSNorm'd row), in rounds of W_AHEAD float4s per lane (4 KiB of a row per warp): the round's
// weights (and norm weights), then each input row's matching floats, each in one round of
// loads before their products (a load next to each product would wait out one round trip per
// float4); the sums run in the order of one float4 at a time.
template <typename W>
__device__ __forceinline__ void products_in_rounds(float (&acc)[4], const W* __restrict__ wr,
                                                   const float* __restrict__ nw,
                                                   const float (&inv)[4],
                                                   const float* __restrict__ x, int in, int n,
                                                   int lane) {
    for (int c = 0; c < in; c += 128 * W_AHEAD) {
        float4 wc[W_AHEAD], gc[W_AHEAD];
        load_wrow(wc, wr + c, in - c, lane);
        if (nw != 0) load_row(gc, nw + c, in - c, lane);
#pragma unroll
        for (int r = 0; r < 4; r++) {
            if (r < n) {
                float4 xc[W_AHEAD];
                load_row(xc, x + (size_t)r * in + c, in - c, lane);
#pragma unroll
                for (int u = 0; u < W_AHEAD; u++)
                    if (lane * 4 + u * 128 < in - c)
                        acc[r] = fma4(wc[u], nw != 0 ? normed4(gc[u], xc[u], inv[r]) : xc[u], acc[r]);
            }
        }
    }
}

// y[r, j] = beta * y[r, j] + the warp's sum of acc[r], for r < n (lane 0 writes).
__device__ __forceinline__ void store_rows(const float (&acc)[4], float* __restrict__ y, int out,
                                           int j, int n, float beta, int lane) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
        if (r < n) {
            const float t = warp_sum(acc[r]);
            if (lane == 0) {
                float* o = y + (size_t)r * out + j;
                *o = beta != 0.f ? beta * *o + t : t;
            }
        }
    }
}

// y[r, j] = beta * y[r, j] + w[j] . x[r] for r < n <= 4 (beta 0 or 1): the dense products
// of small decode batches, one warp per output row, each weight row read once for all n
// rows (cuBLAS takes n > 4). With `preload` (and vec4) the row's first W_AHEAD float4s per
// lane are loaded before the wait (same products, same order). grid: ceil(out/8); block: 256.
template <typename W>
__device__ __forceinline__ void gemv_rows_body(const W* __restrict__ w, const float* __restrict__ x,
                                               float* __restrict__ y, int out, int in, int n, float beta,
                                               int vec4, int prefetch, int preload) {
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    // rows longer than one round keep their registers for the rounds after the wait
    const bool pre = preload && vec4 && j < out && in <= 128 * W_AHEAD;
    float4 wa[W_AHEAD];
    if (pre) load_ahead(wa, w + (size_t)j * in, in, lane);
    if (prefetch && !(preload && vec4 && in <= 128 * W_AHEAD)) prefetch_block_rows(w, out, in);
    PDL_ENTRY();
    if (j >= out) return;
    const W* wr = w + (size_t)j * in;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (pre) {
        // the whole row is in wa: each input row in one round of loads, then its products
#pragma unroll
        for (int r = 0; r < 4; r++) {
            if (r < n) {
                float4 xr[W_AHEAD];
                load_row(xr, x + (size_t)r * in, in, lane);
#pragma unroll
                for (int u = 0; u < W_AHEAD; u++)
                    if (lane * 4 + u * 128 < in) acc[r] = fma4(wa[u], xr[u], acc[r]);
            }
        }
    } else if (vec4) {
        const float one[4] = {1.f, 1.f, 1.f, 1.f};
        products_in_rounds(acc, wr, 0, one, x, in, n, lane);
    } else {
        for (int i = lane; i < in; i += 32) {
            const float wv = wload1(wr + i);
#pragma unroll
            for (int r = 0; r < 4; r++)
                if (r < n) acc[r] = fmaf(wv, x[(size_t)r * in + i], acc[r]);
        }
    }
    store_rows(acc, y, out, j, n, beta, lane);
}

extern "C" __global__ void gemv_rows(const float* __restrict__ w, const float* __restrict__ x,
                                     float* __restrict__ y, int out, int in, int n, float beta,
                                     int vec4, int prefetch, int preload) {
    gemv_rows_body(w, x, y, out, in, n, beta, vec4, prefetch, preload);
}

extern "C" __global__ void gemv_rows_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int out, int in, int n, float beta,
                                          int vec4, int prefetch, int preload) {
    gemv_rows_body(w, x, y, out, in, n, beta, vec4, prefetch, preload);
}

// As gemv_rows, on RMSNorm'd rows: y[r] = w . (nw * (x[r] * rsqrt(mean(x[r]^2) + eps))), each
// warp computing the norms itself (the rows are a few KiB, read from L2), so no separate
// norm kernel runs; block 0 also writes the normed rows to h when h is not null. n <= 4.
// `preload` as gemv_rows, the norm weights' matching float4s too.
template <typename W>
__device__ __forceinline__ void norm_gemv_body(const W* __restrict__ w, const float* __restrict__ x,
                                               const float* __restrict__ nw, float* __restrict__ h,
                                               float* __restrict__ y, int out, int in, int n, float eps,
                                               int vec4, int prefetch, int preload) {
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const bool pre = preload && vec4 && j < out && in <= 128 * W_AHEAD;
    float4 wa[W_AHEAD], ga[W_AHEAD];
    if (pre) {
        load_ahead(wa, w + (size_t)j * in, in, lane);
        load_ahead(ga, nw, in, lane);
    }
    if (prefetch && !(preload && vec4 && in <= 128 * W_AHEAD)) prefetch_block_rows(w, out, in);
    PDL_ENTRY();
    float inv[4];
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // loads in rounds of W_AHEAD float4s per lane, as gemv_rows; with `pre` the whole rows fit
    // one round (wa, ga preloaded), so each input row stays in registers from its norm to
    // its products
#pragma unroll
    for (int r = 0; r < 4; r++) {
        float s = 0.f;
        if (pre) {
            if (r < n) {
                float4 xr[W_AHEAD];
                load_row(xr, x + (size_t)r * in, in, lane);
#pragma unroll
                for (int u = 0; u < W_AHEAD; u++)
                    if (lane * 4 + u * 128 < in) s = fma4(xr[u], xr[u], s);
                s = warp_sum(s);
                inv[r] = 1.f / sqrtf(s / (float)in + eps);
#pragma unroll
                for (int u = 0; u < W_AHEAD; u++)
                    if (lane * 4 + u * 128 < in) acc[r] = fma4(wa[u], normed4(ga[u], xr[u], inv[r]), acc[r]);
            }
            continue;
        }
        if (r < n) {
            if (vec4) {
                for (int c = 0; c < in; c += 128 * W_AHEAD) {
                    float4 xc[W_AHEAD];
                    load_row(xc, x + (size_t)r * in + c, in - c, lane);
#pragma unroll
                    for (int u = 0; u < W_AHEAD; u++)
                        if (lane * 4 + u * 128 < in - c) s = fma4(xc[u], xc[u], s);
                }
            } else {
                for (int i = lane; i < in; i += 32) s = fmaf(x[(size_t)r * in + i], x[(size_t)r * in + i], s);
            }
        }
        s = warp_sum(s);
        inv[r] = 1.f / sqrtf(s / (float)in + eps);
    }
    if (h != 0 && blockIdx.x == 0) {
#pragma unroll
        for (int r = 0; r < 4; r++)
            if (r < n)
                for (int i = threadIdx.x; i < in; i += blockDim.x)
                    h[(size_t)r * in + i] = nw[i] * (x[(size_t)r * in + i] * inv[r]);
    }
    if (j >= out) return;
    const W* wr = w + (size_t)j * in;
    if (pre) {
        // products taken above
    } else if (vec4) {
        products_in_rounds(acc, wr, nw, inv, x, in, n, lane);
    } else {
        for (int i = lane; i < in; i += 32) {
            const float wv = wload1(wr + i);
#pragma unroll
            for (int r = 0; r < 4; r++)
                if (r < n) acc[r] = fmaf(wv, nw[i] * (x[(size_t)r * in + i] * inv[r]), acc[r]);
        }
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        if (r < n) {
            const float t = warp_sum(acc[r]);
            if (lane == 0) y[(size_t)r * out + j] = t;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) norm_gemv_rows(const float* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ nw, float* __restrict__ h,
                                          float* __restrict__ y, int out, int in, int n, float eps,
                                          int vec4, int prefetch, int preload) {
    norm_gemv_body(w, x, nw, h, y, out, in, n, eps, vec4, prefetch, preload);
}

extern "C" __global__ void __launch_bounds__(256, 2) norm_gemv_rows_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                          const float* __restrict__ nw, float* __restrict__ h,
                                          float* __restrict__ y, int out, int in, int n, float eps,
                                          int vec4, int prefetch, int preload) {
    norm_gemv_body(w, x, nw, h, y, out, in, n, eps, vec4, prefetch, preload);
}

// The router's product on RMSNorm'd rows (norm_gemv_rows, n <= 4 rows, E = out experts)
// and its softmax top k in one kernel: the last block to finish its logits (counted in
// `done`, which it sets back to 0) routes every row, warp r row r, as route_topk does with
// the row in registers (E <= 32 * TOPK_REG, k <= 32): the same picks and weights without a
// kernel of its own. grid: ceil(E/8); block: 256.
template <typename W>
__device__ __forceinline__ void norm_gemv_route_body(const W* __restrict__ w, const float* __restrict__ x,
                                                     const float* __restrict__ nw, float* __restrict__ h,
                                                     float* __restrict__ y, int out, int in, int n, float eps,
                                                     int vec4, int prefetch, int preload,
                                                     int* __restrict__ idx, float* __restrict__ wts,
                                                     int k, int norm, unsigned* __restrict__ done) {
    norm_gemv_body(w, x, nw, h, y, out, in, n, eps, vec4, prefetch, preload);
    __shared__ int last;
    // this block's logits are visible to the device before it counts itself done
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const int r = threadIdx.x >> 5;
    if (r < n) topk_row_regs(y + (size_t)r * out, idx + r * k, wts + r * k, out, k, norm);
    if (threadIdx.x == 0) *done = 0u;
}

#define NORM_GEMV_ROUTE_KERNEL(name, W)                                                           \
    extern "C" __global__ void __launch_bounds__(256, 2) name(                                     \
        const W* __restrict__ w, const float* __restrict__ x, const float* __restrict__ nw,        \
        float* __restrict__ h, float* __restrict__ y, int out, int in, int n, float eps, int vec4,  \
        int prefetch, int preload, int* __restrict__ idx, float* __restrict__ wts, int k, int norm, \
        unsigned* __restrict__ done) {                                                             \
        norm_gemv_route_body(w, x, nw, h, y, out, in, n, eps, vec4, prefetch, preload, idx, wts, k, \
                             norm, done);                                                          \
    }
NORM_GEMV_ROUTE_KERNEL(norm_gemv_route, float)
NORM_GEMV_ROUTE_KERNEL(norm_gemv_route_bf16, bf16_t)

// The activations of a product on bf16 weights through cuBLAS (more than 4 rows), split so
// that the tensor cores see every bit: x[r] = hi + mid + lo, three bf16 rows 3r, 3r+1, 3r+2
// of xs whose sum is x[r] exactly (each the top 8 significant bits of what is left, cut by
// truncation: f32's 24 need three; exact down to |x| ~ 2^-110, below which bf16's smallest
// subnormal drops low bits), so every product w . piece is exact in f32 and the tensor
// cores' f32 accumulation does the rest: the f32 product on the widened weights up to the
// order and the rounding of the sums. NaN stays NaN, an infinity stays in hi. grid: n.
__device__ __forceinline__ float bf16_trunc(float v) { return __uint_as_float(__float_as_uint(v) & 0xffff0000u); }

// Round to nearest even (NaN kept a quiet NaN): for weights generated in f32 and kept as bf16.
__device__ __forceinline__ bf16_t bf16_rn(float v) {
    const unsigned u = __float_as_uint(v);
    if (v != v) return (bf16_t)((u >> 16) | 0x40u);
    return (bf16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

extern "C" __global__ void split_bf16(const float* __restrict__ x, bf16_t* __restrict__ xs, int in) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const float* xr = x + (size_t)r * in;
    bf16_t* o = xs + (size_t)3 * r * in;
    for (int i = threadIdx.x; i < in; i += blockDim.x) {
        const float v = xr[i];
        // a NaN whose payload is in its low bits would truncate to an infinity: keep it NaN
        const float a = v != v ? __uint_as_float(0x7fc00000u) : bf16_trunc(v);
        const float r1 = isfinite(v) ? v - a : 0.f;
        const float b = bf16_trunc(r1);
        o[i] = (bf16_t)(__float_as_uint(a) >> 16);
        o[in + i] = (bf16_t)(__float_as_uint(b) >> 16);
        o[2 * in + i] = (bf16_t)(__float_as_uint(r1 - b) >> 16);
    }
}

// y[r, j] = beta * y[r, j] + (c[3r, j] + c[3r+1, j]) + c[3r+2, j] (the three parts of a
// split product, see split_bf16). grid: (n, ceil(out / 256)); block: 256.
extern "C" __global__ void sum3_rows(const float* __restrict__ c, float* __restrict__ y, int out, float beta) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= out) return;
    const float* cr = c + (size_t)3 * r * out;
    const float t = (cr[j] + cr[out + j]) + cr[2 * out + j];
    float* o = y + (size_t)r * out + j;
    *o = beta != 0.f ? beta * *o + t : t;
}

// y[i] = x[i] rounded to bf16 (nearest even), i < n: weights generated in f32 kept at bf16's
// bytes (a benchmark's model). grid-stride.
extern "C" __global__ void round_bf16(const float* __restrict__ x, bf16_t* __restrict__ y, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = bf16_rn(x[i]);
}

// Dense products on FP8 e4m3 weights with one f32 scale per b0 x b1 block (DeepSeek's and
// Qwen's FP8 checkpoints: attention, dense and shared-expert matrices), kept as stored.
// gemv_rows_f8: as gemv_rows for n <= 4 rows, each weight widened and scaled as it is read
// (four at a time when `in` is a multiple of 4; b1 is a multiple of 4, so the four share a
// scale); no preload (the weights are a quarter of f32's bytes). grid: ceil(out/8); block: 256.
extern "C" __global__ void gemv_rows_f8(const f8_t* __restrict__ w, const float* __restrict__ s,
                                        const float* __restrict__ x, float* __restrict__ y, int out,
                                        int in, int n, float beta, int b0, int b1) {
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    PDL_ENTRY();
    if (j >= out) return;
    const BlockScales sc = ScalesOf<true>::make(s, b0, b1, in);
    const f8_t* wr = w + (size_t)j * in;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    if ((in & 3) == 0) {
        for (int i = lane * 4; i < in; i += 128) {
            const float4 wv = scaled4(wload4(wr + i), sc, j, i);
#pragma unroll
            for (int r = 0; r < 4; r++)
                if (r < n) acc[r] = fma4(wv, *(const float4*)(x + (size_t)r * in + i), acc[r]);
        }
    } else {
        for (int i = lane; i < in; i += 32) {
            const float wv = scaled1(wload1(wr + i), sc, j, i);
#pragma unroll
            for (int r = 0; r < 4; r++)
                if (r < n) acc[r] = fmaf(wv, x[(size_t)r * in + i], acc[r]);
        }
    }
    store_rows(acc, y, out, j, n, beta, lane);
}

// y[r, c] = e4m3(w[r, c]) * s[r / b0, c / b1] for a rows x cols FP8 matrix: the f32 copy a
// product of more than 4 rows hands to cuBLAS (into one scratch the size of the largest FP8
// dense matrix), exact. grid-stride.
extern "C" __global__ void dequant_f8(const f8_t* __restrict__ w, const float* __restrict__ s,
                                      float* __restrict__ y, long long rows, int cols, int b0, int b1) {
    PDL_ENTRY();
    const BlockScales sc = ScalesOf<true>::make(s, b0, b1, cols);
    const long long n = rows * cols;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        const int r = (int)(i / cols), c = (int)(i % cols);
        y[i] = scaled1(wload1(w + i), sc, r, c);
    }
}
