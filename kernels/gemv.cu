// Thread 0 asks the L2 for the weight rows this block's warps will read (one warp per row):
// they do not depend on the previous kernel, so they may be fetched before PDL_ENTRY.
__device__ __forceinline__ void prefetch_block_rows(const float* w, int out, int in) {
    if (threadIdx.x == 0) {
        const int j0 = blockIdx.x * (blockDim.x >> 5);
        const int rows = min((int)(blockDim.x >> 5), out - j0);
        if (rows > 0) prefetch_l2(w + (size_t)j0 * in, (unsigned)((size_t)rows * in * 4));
    }
}

// Float4s of its weight row a lane of a small-batch product loads into registers before the
// kernel waits for its predecessor (the first 4 KiB of the row per warp): weights do not
// depend on earlier kernels, so their latency overlaps the predecessor's run instead of
// adding to the step's chain of dependent kernels.
#define W_AHEAD 8

// As load_row, through the read-only data path (__ldg): the weight rows loaded before the wait.
__device__ __forceinline__ void load_ahead(float4 (&wa)[W_AHEAD], const float* __restrict__ wr,
                                           int in, int lane) {
#pragma unroll
    for (int u = 0; u < W_AHEAD; u++) {
        const int i = lane * 4 + u * 128;
        wa[u] = i < in ? __ldg((const float4*)(wr + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
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
__device__ __forceinline__ void products_in_rounds(float (&acc)[4], const float* __restrict__ wr,
                                                   const float* __restrict__ nw,
                                                   const float (&inv)[4],
                                                   const float* __restrict__ x, int in, int n,
                                                   int lane) {
    for (int c = 0; c < in; c += 128 * W_AHEAD) {
        float4 wc[W_AHEAD], gc[W_AHEAD];
        load_row(wc, wr + c, in - c, lane);
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

// y[r, j] = beta * y[r, j] + w[j] . x[r] for r < n <= 4 (beta 0 or 1): the dense products
// of small decode batches, one warp per output row, each weight row read once for all n
// rows (cuBLAS takes n > 4). With `preload` (and vec4) the row's first W_AHEAD float4s per
// lane are loaded before the wait (same products, same order). grid: ceil(out/8); block: 256.
extern "C" __global__ void gemv_rows(const float* __restrict__ w, const float* __restrict__ x,
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
    const float* wr = w + (size_t)j * in;
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
            const float wv = wr[i];
#pragma unroll
            for (int r = 0; r < 4; r++)
                if (r < n) acc[r] = fmaf(wv, x[(size_t)r * in + i], acc[r]);
        }
    }
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

// As gemv_rows, on RMSNorm'd rows: y[r] = w . (nw * (x[r] * rsqrt(mean(x[r]^2) + eps))), each
// warp computing the norms itself (the rows are a few KiB, read from L2), so no separate
// norm kernel runs; block 0 also writes the normed rows to h when h is not null. n <= 4.
// `preload` as gemv_rows, the norm weights' matching float4s too.
extern "C" __global__ void __launch_bounds__(256, 2) norm_gemv_rows(const float* __restrict__ w, const float* __restrict__ x,
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
    const float* wr = w + (size_t)j * in;
    if (pre) {
        // products taken above
    } else if (vec4) {
        products_in_rounds(acc, wr, nw, inv, x, in, n, lane);
    } else {
        for (int i = lane; i < in; i += 32) {
            const float wv = wr[i];
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

