// The primary's decode step on the GPU: everything between the embedding and the logits
// except the dense matrix products (cuBLAS). f32 throughout, as the CPU backend, so the two
// agree to rounding. Row-major [rows, cols] everywhere; a "row" is one token of the batch.
//
// KV cache: per layer K and V of [blocks * 16, kv_dim]; row r of the batch sits at
// position row_pos[r] of a sequence whose block table starts at blocks[row_tab[r]].

#define KV_BLOCK 16

// Programmatic dependent launch (sm_90+): every step kernel first waits for its predecessor
// grid (its results visible), then lets its own successor be scheduled, so the successor's
// launch overlaps this kernel's run. Launched without the attribute, both are no-ops.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTRY()                                          \
    do {                                                     \
        asm volatile("griddepcontrol.wait;" ::: "memory");   \
        asm volatile("griddepcontrol.launch_dependents;" :::); \
    } while (0)
// Hints the L2 to fetch [p, p + bytes) (p 16-byte aligned, bytes below 2^32; rounded down
// to 16): issued before PDL_ENTRY by kernels whose weights do not depend on the previous
// kernel, so their weight reads overlap its tail.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
    if (bytes >= 16 && ((unsigned long long)p & 15) == 0)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes & ~15u) : "memory");
}
#else
#define PDL_ENTRY() do {} while (0)
__device__ __forceinline__ void prefetch_l2(const void*, unsigned) {}
#endif
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result.
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = (int)threadIdx.x < nw ? red[threadIdx.x] : 0.f;
    if (w == 0) t = warp_sum(t);
    if (threadIdx.x == 0) red[32] = t;
    __syncthreads();
    return red[32];
}

__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = (int)threadIdx.x < nw ? red[threadIdx.x] : -INFINITY;
    if (w == 0) t = warp_max(t);
    if (threadIdx.x == 0) red[32] = t;
    __syncthreads();
    return red[32];
}

// (value, index) argmax over the warp, ties to the lower index; every lane gets it.
__device__ __forceinline__ void warp_argmax(float& bv, int& bi) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
}

// As warp_argmax, for values that are not NaN: the warp's largest value by one reduction
// over order-keeping keys, then the lowest index holding it by another (sm_80+).
__device__ __forceinline__ void warp_argmax_fast(float& bv, int& bi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned u = __float_as_uint(bv);
    const unsigned key = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    const unsigned top = __reduce_max_sync(0xffffffffu, key);
    bi = (int)__reduce_min_sync(0xffffffffu, key == top ? (unsigned)bi : 0xffffffffu);
    bv = __uint_as_float((top & 0x80000000u) ? (top & 0x7fffffffu) : ~top);
#else
    warp_argmax(bv, bi);
#endif
}

// (value, index) argmax over the block, ties to the lower index; every thread gets it.
__device__ void block_argmax(float& v, int& i, float* redv, int* redi) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    warp_argmax(v, i);
    __syncthreads();
    if (lane == 0) { redv[w] = v; redi[w] = i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        float bv = redv[0]; int bi = redi[0];
        for (int k = 1; k < nw; k++)
            if (redv[k] > bv || (redv[k] == bv && redi[k] < bi)) { bv = redv[k]; bi = redi[k]; }
        redv[32] = bv; redi[32] = bi;
    }
    __syncthreads();
    v = redv[32]; i = redi[32];
}


// Weights are kept on the device in the checkpoint's dtype: f32, or bf16 (its 16 bits, as
// `unsigned short`), widened exactly where they are read (a bf16 is the top half of an
// f32). Every product accumulates in f32; the overloads below are the only place a kernel
// reads a weight, so one template body serves both dtypes.
typedef unsigned short bf16_t;

__device__ __forceinline__ float bf16_lo(unsigned v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(unsigned v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ float wload1(const float* p) { return *p; }
__device__ __forceinline__ float wload1(const bf16_t* p) { return __uint_as_float((unsigned)*p << 16); }

// Four consecutive weights (p 16-byte aligned for f32, 8-byte aligned for bf16).
__device__ __forceinline__ float4 wload4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 wload4(const bf16_t* p) {
    const uint2 v = *(const uint2*)p;
    return make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
}
// Eight consecutive weights as two float4s (p 32-byte aligned for f32, 16-byte for bf16):
// bf16's eight in one 16-byte load, so a warp's round of loads moves as many bytes as f32's.
__device__ __forceinline__ void wload8(const float* p, float4& a, float4& b) {
    a = *(const float4*)p;
    b = *(const float4*)(p + 4);
}
// Eight bf16 loaded as 16 bytes, widened to two float4s.
__device__ __forceinline__ void widen8(uint4 v, float4& a, float4& b) {
    a = make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
    b = make_float4(bf16_lo(v.z), bf16_hi(v.z), bf16_lo(v.w), bf16_hi(v.w));
}
__device__ __forceinline__ void wload8(const bf16_t* p, float4& a, float4& b) { widen8(*(const uint4*)p, a, b); }
// As wload4, through the read-only data path.
__device__ __forceinline__ float4 wldg4(const float* p) { return __ldg((const float4*)p); }
__device__ __forceinline__ float4 wldg4(const bf16_t* p) {
    const uint2 v = __ldg((const uint2*)p);
    return make_float4(bf16_lo(v.x), bf16_hi(v.x), bf16_lo(v.y), bf16_hi(v.y));
}

// FP8 e4m3fn weights (a byte each) with one f32 scale per block of b0 rows x b1 columns, as
// DeepSeek's and Qwen's FP8 checkpoints ship them: (r, c) is e4m3(q[r, c]) * s[r / b0, c / b1].
// Only the grouped MoE kernels read them (the experts); b1 is a multiple of 4, so the four
// weights of a float4 share a scale.
typedef unsigned char f8_t;

// The e4m3fn byte's value (exact in f32): S.EEEE.MMM, bias 7, no infinities, S.1111.111 NaN.
__device__ __forceinline__ float e4m3(unsigned b) {
    const unsigned em = b & 0x7fu;
    float v;
    if (em == 0x7fu) v = __uint_as_float(0x7fc00000u);
    else if (em < 8u) v = (float)em * (1.f / 512.f);
    else v = __uint_as_float((((em >> 3) + 120u) << 23) | ((em & 7u) << 20));
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float wload1(const f8_t* p) { return e4m3(*p); }
__device__ __forceinline__ float4 wload4(const f8_t* p) {
    const unsigned v = *(const unsigned*)p;
    return make_float4(e4m3(v & 0xffu), e4m3((v >> 8) & 0xffu), e4m3((v >> 16) & 0xffu), e4m3(v >> 24));
}
// (never reached: FP8 rows take the four-at-a-time paths; defined for the templates)
__device__ __forceinline__ void wload8(const f8_t* p, float4& a, float4& b) {
    a = wload4(p);
    b = wload4(p + 4);
}
// (never reached: FP8 rows are not loaded ahead, see moe_down_body; defined for the template)
__device__ __forceinline__ float4 wldg4(const f8_t* p) { return wload4(p); }

// A weight matrix's block scales: none (f32, bf16: every weight as loaded) or FP8's.
struct NoScales {
    __device__ __forceinline__ float at(int, int) const { return 1.f; }
};
struct BlockScales {
    const float* s;
    int b0, b1, cb;
    __device__ __forceinline__ float at(int r, int c) const { return s[(r / b0) * cb + c / b1]; }
};
__device__ __forceinline__ float4 scaled4(float4 v, NoScales, int, int) { return v; }
__device__ __forceinline__ float4 scaled4(float4 v, const BlockScales& s, int r, int c) {
    const float k = s.at(r, c);
    return make_float4(v.x * k, v.y * k, v.z * k, v.w * k);
}
__device__ __forceinline__ float scaled1(float v, NoScales, int, int) { return v; }
__device__ __forceinline__ float scaled1(float v, const BlockScales& s, int r, int c) { return v * s.at(r, c); }
// The scales of a kernel on FP8 weights (F8) or none, for a matrix of `cols` columns.
template <bool F8> struct ScalesOf {
    static __device__ __forceinline__ NoScales make(const float*, int, int, int) { return NoScales(); }
};
template <> struct ScalesOf<true> {
    static __device__ __forceinline__ BlockScales make(const float* s, int b0, int b1, int cols) {
        return BlockScales{s, b0, b1, (cols + b1 - 1) / b1};
    }
};
