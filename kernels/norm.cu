// x[r] = emb[tok[r]]. grid: rows.
template <typename W>
__device__ __forceinline__ void embed_body(const W* __restrict__ emb, const int* __restrict__ tok,
                                           float* __restrict__ x, int h) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const W* e = emb + (size_t)tok[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)r * h + i] = wload1(e + i);
}

extern "C" __global__ void embed_rows(const float* __restrict__ emb, const int* __restrict__ tok,
                                      float* __restrict__ x, int h) {
    embed_body(emb, tok, x, h);
}

// As embed_rows, from a bf16 table (widened).
extern "C" __global__ void embed_rows_bf16(const bf16_t* __restrict__ emb, const int* __restrict__ tok,
                                           float* __restrict__ x, int h) {
    embed_body(emb, tok, x, h);
}

// 1 / rms(x[0..h]) with eps, over the block (red: 33 floats of shared memory); every thread
// gets it, after a barrier, so the caller may then overwrite x in place.
__device__ __forceinline__ float row_inv_rms(const float* xr, int h, float eps, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
    s = block_sum(s, red);
    return 1.f / sqrtf(s / (float)h + eps);
}

// y[r] = w * (x[src] * rsqrt(mean(x[src]^2) + eps)), src = rows ? rows[r] : r. grid: rows.
extern "C" __global__ void rmsnorm_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                        const float* __restrict__ w, float* __restrict__ y,
                                        int h, float eps) {
    PDL_ENTRY();
    __shared__ float red[33];
    const int r = blockIdx.x;
    const int src = rows ? rows[r] : r;
    const float* xr = x + (size_t)src * h;
    float* yr = y + (size_t)r * h;
    const float inv = row_inv_rms(xr, h, eps, red);
    for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

// A step kernel's slot with its work left out (`MOELANE_CUDA_HOLLOW`, a diagnostic: the
// results are wrong): launched with the replaced kernel's grid, it only waits and releases.
extern "C" __global__ void hollow_step() { PDL_ENTRY(); }

