// The picks [0, nk) of one layer are grouped by expert without a separate pass: the block
// of slot s works only when s is the first slot on its expert (checked by one warp with a
// ballot), and then walks the later slots on that expert with ballots, so every weight row
// is fetched from memory once per step however many rows picked the expert.
__device__ __forceinline__ bool leads_expert(const int* idx, int s, int e, int* flag) {
    if (threadIdx.x < 32) {
        bool dup = false;
        for (int t = threadIdx.x; t < s; t += 32) dup |= idx[t] == e;
        dup = __any_sync(0xffffffffu, dup);
        if (threadIdx.x == 0) *flag = !dup;
    }
    __syncthreads();
    return *flag != 0;
}

// The experts' activation of one gate and up value: silu(gate) * up, or with limit > 0
// gpt_oss's clamped one, (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g =
// min(gate, limit); gb (when not null) the expert's gate_up bias [2I], gate's then up's.
__device__ __forceinline__ float glu_act(float sg, float su, const float* gb, int j, int I,
                                         float alpha, float limit) {
    if (gb) {
        sg += gb[j];
        su += gb[I + j];
    }
    if (limit > 0.f) {
        const float g = fminf(sg, limit), u = fminf(fmaxf(su, -limit), limit);
        return (u + 1.f) * (g / (1.f + expf(-alpha * g)));
    }
    return sg / (1.f + expf(-sg)) * su;
}

// MoE up-projection for all picks of this layer whose expert this GPU holds (table entry
// non-zero): act[s, j] = silu(gate_e[j] . h[row]) * (up_e[j] . h[row]), row = s/k, or rows[s]
// when given (a sidecar's picks name their activation rows). One warp per row j,
// 8 rows per block. grid: (nk, ceil(I/8)). `distinct`: the caller knows every slot's expert
// differs (the picks of one row), so each block leads its slot without checking.
// FP8 experts (moe_up_f8): gs_tab holds each expert's block scales, b0 x b1 weights a block.
template <typename W, bool F8, bool X>
__device__ __forceinline__ void moe_up_body(const int* __restrict__ idx, const unsigned long long* __restrict__ gu_tab,
                                            const float* __restrict__ h, float* __restrict__ act,
                                            int nk, int k, int H, int I, int vec4,
                                            const int* __restrict__ rows, int distinct,
                                            const unsigned long long* __restrict__ gs_tab, int b0, int b1,
                                            const unsigned long long* __restrict__ gb_tab, float alpha,
                                            float limit) {
    PDL_ENTRY();
    __shared__ int flag;
    const int s = blockIdx.x;
    const int e = idx[s];
    const W* gu = (const W*)gu_tab[e];
    // X (the `_x` kernels): the experts' gate_up biases and gpt_oss's activation; the plain
    // kernels compile without them
    const float* gb = X && gb_tab ? (const float*)gb_tab[e] : 0;
    const auto sc = ScalesOf<F8>::make(F8 ? (const float*)gs_tab[e] : 0, b0, b1, H);
    if (gu == 0 || !(distinct || leads_expert(idx, s, e, &flag))) return;
    const int j = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (j >= I) return;
    const W* g = gu + (size_t)j * H;
    const W* u = gu + (size_t)(j + I) * H;
    const int end = distinct ? s + 1 : nk;
    for (int t0 = s; t0 < end; t0 += 32) {
        unsigned mask = distinct ? 1u : __ballot_sync(0xffffffffu, t0 + lane < nk && idx[t0 + lane] == e);
        while (mask) {
            const int t = t0 + __ffs(mask) - 1;
            mask &= mask - 1;
            const float* x = h + (size_t)(rows ? rows[t] : t / k) * H;
            float sg = 0.f, su = 0.f;
            if (!F8 && sizeof(W) == 2 && (H & 7) == 0 && ((size_t)gu & 15) == 0) {
                // 16-bit weights: eight a lane per load (lane * 8 + 256 i), so the row's
                // loads go out in one round where four at a time took two
#pragma unroll 4
                for (int i = lane * 8; i < H; i += 256) {
                    float4 g0, g1, u0, u1;
                    wload8(g + i, g0, g1);
                    wload8(u + i, u0, u1);
                    const float4 x0 = *(const float4*)(x + i), x1 = *(const float4*)(x + i + 4);
                    sg = fma4(g1, x1, fma4(g0, x0, sg));
                    su = fma4(u1, x1, fma4(u0, x0, su));
                }
            } else if (vec4) {
#pragma unroll 4
                for (int i = lane * 4; i < H; i += 128) {
                    const float4 gv = scaled4(wload4(g + i), sc, j, i);
                    const float4 uv = scaled4(wload4(u + i), sc, j + I, i);
                    const float4 xv = *(const float4*)(x + i);
                    sg = fma4(gv, xv, sg);
                    su = fma4(uv, xv, su);
                }
            } else {
                for (int i = lane; i < H; i += 32) {
                    sg = fmaf(scaled1(wload1(g + i), sc, j, i), x[i], sg);
                    su = fmaf(scaled1(wload1(u + i), sc, j + I, i), x[i], su);
                }
            }
            sg = warp_sum(sg);
            su = warp_sum(su);
            if (lane == 0)
                act[(size_t)t * I + j] = X ? glu_act(sg, su, gb, j, I, alpha, limit) : sg / (1.f + expf(-sg)) * su;
        }
    }
}

#define MOE_UP_KERNEL(name, W, F8, X)                                                             \
    extern "C" __global__ void name(const int* __restrict__ idx, const unsigned long long* __restrict__ gu_tab, \
                                    const float* __restrict__ h, float* __restrict__ act, int nk, int k, \
                                    int H, int I, int vec4, const int* __restrict__ rows, int distinct, \
                                    const unsigned long long* __restrict__ gs_tab, int b0, int b1,        \
                                    const unsigned long long* __restrict__ gb_tab, float alpha, float limit) { \
        moe_up_body<W, F8, X>(idx, gu_tab, h, act, nk, k, H, I, vec4, rows, distinct, gs_tab, b0, b1,  \
                              gb_tab, alpha, limit);                                                 \
    }
MOE_UP_KERNEL(moe_up, float, false, false)
MOE_UP_KERNEL(moe_up_bf16, bf16_t, false, false)
MOE_UP_KERNEL(moe_up_f8, f8_t, true, false)
// with the experts' biases and gpt_oss's clamped activation
MOE_UP_KERNEL(moe_up_x, float, false, true)
MOE_UP_KERNEL(moe_up_x_bf16, bf16_t, false, true)
MOE_UP_KERNEL(moe_up_x_f8, f8_t, true, true)

// MoE down-projection: y[s, j] = down_e[j] . act[s], as moe_up. grid: (nk, ceil(H/8)).
// Thread 0 asks the L2 for the 8 down-projection rows of this block's expert before the
// wait: the picks were written two kernels back (the router), whose completion the
// up-projection waited for before it let this kernel launch, so they are final here (a
// sidecar's picks are copied before its up-projection).
template <typename W>
__device__ __forceinline__ void prefetch_down_rows(const int* __restrict__ idx,
                                                   const unsigned long long* __restrict__ dn_tab,
                                                   int H, int I) {
    if (threadIdx.x == 0) {
        const W* dn = (const W*)dn_tab[idx[blockIdx.x]];
        const int j0 = blockIdx.y * (blockDim.x >> 5);
        const int rows = min((int)(blockDim.x >> 5), H - j0);
        if (dn != 0 && rows > 0) prefetch_l2(dn + (size_t)j0 * I, (unsigned)((size_t)rows * I * sizeof(W)));
    }
}

// PRE (moe_down_pre, with vec4): each warp loads its down row's first weights into
// registers before the wait (f32: the first W_AHEAD float4s per lane, as gemv_rows; 16-bit:
// up to B16_AHEAD 16-byte loads of eight per lane, kept unwidened), same products, same
// order as moe_down; the registers this takes cost occupancy, so large batches take
// moe_down. 16-bit rows (I a multiple of 8, 16-byte aligned) are read eight a lane
// (lane * 8 + 256 u) by every down kernel, preloaded or not, so the sums agree bit for bit
// across batch sizes.
#define B16_AHEAD 4

// d . a for a 16-bit down row d and an activation row a of I (a multiple of 8) floats, eight
// weights a lane per load (lane * 8 + 256 u): from the row's loads preloaded into wb when
// `pre` (I <= 256 * B16_AHEAD), else loaded here. Every 16-bit down product sums this way.
template <typename W>
__device__ __forceinline__ float dot8(const uint4 (&wb)[B16_AHEAD], bool pre, const W* __restrict__ d,
                                      const float* __restrict__ a, int I, int lane) {
    float sum = 0.f;
    if (pre) {
        // the activation row in one round of loads, then the products
        float4 a0[B16_AHEAD], a1[B16_AHEAD];
#pragma unroll
        for (int u = 0; u < B16_AHEAD; u++) {
            const int i = lane * 8 + u * 256;
            if (i < I) {
                a0[u] = *(const float4*)(a + i);
                a1[u] = *(const float4*)(a + i + 4);
            }
        }
#pragma unroll
        for (int u = 0; u < B16_AHEAD; u++) {
            if (lane * 8 + u * 256 < I) {
                float4 d0, d1;
                widen8(wb[u], d0, d1);
                sum = fma4(d1, a1[u], fma4(d0, a0[u], sum));
            }
        }
    } else {
#pragma unroll 4
        for (int i = lane * 8; i < I; i += 256) {
            float4 d0, d1;
            wload8(d + i, d0, d1);
            const float4 a0 = *(const float4*)(a + i), a1 = *(const float4*)(a + i + 4);
            sum = fma4(d1, a1, fma4(d0, a0, sum));
        }
    }
    return sum;
}

// Loads the first B16_AHEAD eights of a lane of a 16-bit row wr of I weights (zero past I).
template <typename W>
__device__ __forceinline__ void preload8(uint4 (&wb)[B16_AHEAD], const W* __restrict__ wr, int I, int lane) {
#pragma unroll
    for (int u = 0; u < B16_AHEAD; u++) {
        const int i = lane * 8 + u * 256;
        wb[u] = i < I ? __ldg((const uint4*)(wr + i)) : make_uint4(0u, 0u, 0u, 0u);
    }
}
template <bool PRE, typename W, bool F8, bool X>
__device__ __forceinline__ void moe_down_body(const int* __restrict__ idx,
                                              const unsigned long long* __restrict__ dn_tab,
                                              const float* __restrict__ act, float* __restrict__ y,
                                              int nk, int H, int I, int vec4, int distinct,
                                              const unsigned long long* __restrict__ ds_tab, int b0, int b1,
                                              const unsigned long long* __restrict__ db_tab) {
    constexpr bool B16 = sizeof(W) == 2 && !F8;
    const int s = blockIdx.x;
    const int j = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    float4 wa[B16 ? 1 : W_AHEAD];
    uint4 wb[B16_AHEAD];
    bool pre = false;
    // eight 16-bit weights a lane per load: rows of a multiple of 8, 16-byte aligned
    const auto by8 = [&](const W* base) { return B16 && vec4 && (I & 7) == 0 && ((size_t)base & 15) == 0; };
    if (PRE) {
        // the picks are final before the wait (see prefetch_down_rows)
        const W* dn = (const W*)dn_tab[idx[s]];
        if constexpr (B16) {
            pre = dn != 0 && j < H && by8(dn) && I <= 256 * B16_AHEAD;
            if (pre) preload8(wb, dn + (size_t)j * I, I, lane);
        } else {
            pre = !F8 && vec4 && dn != 0 && j < H;
            if (pre) load_ahead(wa, dn + (size_t)j * I, I, lane);
        }
    }
    // a row preloaded whole needs no L2 prefetch
    if (!(PRE && pre && (B16 || (vec4 && I <= 128 * W_AHEAD)))) prefetch_down_rows<W>(idx, dn_tab, H, I);
    PDL_ENTRY();
    __shared__ int flag;
    const int e = idx[s];
    const W* dn = (const W*)dn_tab[e];
    if (dn == 0 || !(distinct || leads_expert(idx, s, e, &flag))) return;
    if (j >= H) return;
    const W* d = dn + (size_t)j * I;
    const auto sc = ScalesOf<F8>::make(F8 ? (const float*)ds_tab[e] : 0, b0, b1, I);
    // the expert's down bias [H] (gpt_oss), when its table is given and the entry set
    const float* db = X && db_tab ? (const float*)db_tab[e] : 0;
    const bool eight = by8(dn);
    const int end = distinct ? s + 1 : nk;
    for (int t0 = s; t0 < end; t0 += 32) {
        unsigned mask = distinct ? 1u : __ballot_sync(0xffffffffu, t0 + lane < nk && idx[t0 + lane] == e);
        while (mask) {
            const int t = t0 + __ffs(mask) - 1;
            mask &= mask - 1;
            const float* a = act + (size_t)t * I;
            float sum = 0.f;
            if (eight) {
                sum = dot8(wb, PRE && pre, d, a, I, lane);
            } else if (vec4) {
                int i0 = lane * 4;
                if (!B16 && PRE && pre) {
                    // the activation row in one round of loads, then the products
                    float4 ar[W_AHEAD];
                    load_row(ar, a, I, lane);
#pragma unroll
                    for (int u = 0; u < W_AHEAD; u++, i0 += 128)
                        if (i0 < I) sum = fma4(wa[B16 ? 0 : u], ar[u], sum);
                }
#pragma unroll 4
                for (int i = i0; i < I; i += 128) {
                    const float4 dv = scaled4(wload4(d + i), sc, j, i);
                    const float4 av = *(const float4*)(a + i);
                    sum = fma4(dv, av, sum);
                }
            } else {
                for (int i = lane; i < I; i += 32) sum = fmaf(scaled1(wload1(d + i), sc, j, i), a[i], sum);
            }
            sum = warp_sum(sum);
            if (lane == 0) y[(size_t)t * H + j] = X && db ? sum + db[j] : sum;
        }
    }
}

#define MOE_DOWN_KERNEL(name, PRE, W, F8, X)                                                      \
    extern "C" __global__ void name(const int* __restrict__ idx, const unsigned long long* __restrict__ dn_tab, \
                                    const float* __restrict__ act, float* __restrict__ y, int nk, int H, \
                                    int I, int vec4, int distinct,                                      \
                                    const unsigned long long* __restrict__ ds_tab, int b0, int b1,      \
                                    const unsigned long long* __restrict__ db_tab) {                    \
        moe_down_body<PRE, W, F8, X>(idx, dn_tab, act, y, nk, H, I, vec4, distinct, ds_tab, b0, b1, db_tab); \
    }
MOE_DOWN_KERNEL(moe_down, false, float, false, false)
MOE_DOWN_KERNEL(moe_down_bf16, false, bf16_t, false, false)
MOE_DOWN_KERNEL(moe_down_f8, false, f8_t, true, false)
MOE_DOWN_KERNEL(moe_down_pre, true, float, false, false)
MOE_DOWN_KERNEL(moe_down_pre_bf16, true, bf16_t, false, false)
// with the experts' down biases (gpt_oss)
MOE_DOWN_KERNEL(moe_down_x, false, float, false, true)
MOE_DOWN_KERNEL(moe_down_x_bf16, false, bf16_t, false, true)
MOE_DOWN_KERNEL(moe_down_x_f8, false, f8_t, true, true)

// A single row's MoE down-projection and combine in one kernel (every pick of the row on
// this GPU, k <= K1_MAX distinct experts): one warp per output j takes all k picks, y[s, j]
// as moe_down computes it (the same products in the same order), then x[j] += sum_s
// wts[s] y[s, j] as moe_combine (the same order): one kernel and one wave of 8 warps a
// block instead of k blocks per 8 outputs and a combine. 16-bit rows of up to
// 256 * B16_AHEAD weights are loaded into registers before the wait (the picks are final
// then, see prefetch_down_rows). A pick whose expert is not on this GPU adds nothing.
// grid: ceil(H/8); block: 256.
#define K1_MAX 8
template <typename W>
__device__ __forceinline__ void moe_down_one_body(const int* __restrict__ idx,
                                                  const unsigned long long* __restrict__ dn_tab,
                                                  const float* __restrict__ act, float* __restrict__ y,
                                                  float* __restrict__ x, const float* __restrict__ wts,
                                                  int k, int H, int I, int vec4) {
    constexpr bool B16 = sizeof(W) == 2;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    uint4 wb[K1_MAX][B16_AHEAD];
    const bool pre = B16 && vec4 && (I & 7) == 0 && I <= 256 * B16_AHEAD && j < H;
    if (pre) {
#pragma unroll
        for (int s = 0; s < K1_MAX; s++) {
            const W* dn = s < k ? (const W*)dn_tab[idx[s]] : 0;
            if (dn != 0 && ((size_t)dn & 15) == 0) preload8(wb[s], dn + (size_t)j * I, I, lane);
        }
    }
    PDL_ENTRY();
    if (j >= H) return;
    float acc = 0.f;
#pragma unroll
    for (int s = 0; s < K1_MAX; s++) {
        if (s >= k) break;
        const W* dn = (const W*)dn_tab[idx[s]];
        if (dn == 0) continue;
        const W* d = dn + (size_t)j * I;
        const float* a = act + (size_t)s * I;
        float sum = 0.f;
        const bool eight = B16 && vec4 && (I & 7) == 0 && ((size_t)dn & 15) == 0;
        if (eight) {
            sum = dot8(wb[s], pre, d, a, I, lane);
        } else if (vec4) {
#pragma unroll 4
            for (int i = lane * 4; i < I; i += 128) sum = fma4(wload4(d + i), *(const float4*)(a + i), sum);
        } else {
            for (int i = lane; i < I; i += 32) sum = fmaf(wload1(d + i), a[i], sum);
        }
        sum = warp_sum(sum);
        if (lane == 0) y[(size_t)s * H + j] = sum;
        acc = fmaf(wts[s], sum, acc);
    }
    if (lane == 0) x[j] += acc;
}

extern "C" __global__ void __launch_bounds__(256, 1) moe_down_one(const int* __restrict__ idx, const unsigned long long* __restrict__ dn_tab,
                                        const float* __restrict__ act, float* __restrict__ y,
                                        float* __restrict__ x, const float* __restrict__ wts,
                                        int k, int H, int I, int vec4) {
    moe_down_one_body<float>(idx, dn_tab, act, y, x, wts, k, H, I, vec4);
}

extern "C" __global__ void __launch_bounds__(256, 1) moe_down_one_bf16(const int* __restrict__ idx, const unsigned long long* __restrict__ dn_tab,
                                             const float* __restrict__ act, float* __restrict__ y,
                                             float* __restrict__ x, const float* __restrict__ wts,
                                             int k, int H, int I, int vec4) {
    moe_down_one_body<bf16_t>(idx, dn_tab, act, y, x, wts, k, H, I, vec4);
}

// y[slots[i]] = src[i] (the cold tier's outputs into their pick slots). grid: count.
extern "C" __global__ void scatter_rows(const float* __restrict__ src, const int* __restrict__ slots,
                                        float* __restrict__ y, int H) {
    PDL_ENTRY();
    const int i = blockIdx.x;
    const float* a = src + (size_t)i * H;
    float* b = y + (size_t)slots[i] * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) b[c] = a[c];
}

// x[r] += sum_j w[r, j] * y[r*k + j], the k picks in router-rank order. grid: (rows,
// ceil(H / blockDim)): several blocks per row, so a single decode row is not one SM's work.
//
// gidx (not null): the next MoE layer's guessed picks, most probable first, written by this
// layer's top-k three kernels back, so final before the wait (as moe_down's prefetch).
// Before its wait the grid asks the L2 for the first gk guesses' gate_up (gu_bytes each,
// from gu_tab) and down (dn_bytes, dn_tab) in 64 KiB pieces spread over every block (extra
// blocks beyond H only do this), so their bytes move while the next layer's attention and
// router run. A wrong guess costs bandwidth, never a result.
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ wts, int k, int H,
                                       const int* __restrict__ gidx,
                                       const unsigned long long* __restrict__ gu_tab,
                                       const unsigned long long* __restrict__ dn_tab, int gk,
                                       unsigned long long gu_bytes, unsigned long long dn_bytes) {
    if (gidx != 0) {
        const unsigned long long piece = 1ull << 16;
        const int cg = (int)((gu_bytes + piece - 1) / piece), cd = (int)((dn_bytes + piece - 1) / piece);
        const int per = cg + cd, total = gk * per;
        const int nb = gridDim.x * gridDim.y, b = blockIdx.y * gridDim.x + blockIdx.x;
        for (int c = threadIdx.x * nb + b; c < total; c += nb * blockDim.x) {
            const int s = c / per, q = c - s * per;
            const int e = gidx[s];
            const bool up = q < cg;
            const unsigned long long base = up ? gu_tab[e] : dn_tab[e];
            const unsigned long long off = (unsigned long long)(up ? q : q - cg) * piece;
            const unsigned long long len = up ? gu_bytes : dn_bytes;
            if (base != 0 && off < len)
                prefetch_l2((const void*)(base + off), (unsigned)(len - off < piece ? len - off : piece));
        }
    }
    PDL_ENTRY();
    const int r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= H) return;
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc = fmaf(wts[r * k + j], y[((size_t)r * k + j) * H + c], acc);
    x[(size_t)r * H + c] += acc;
}

// a[r, j] = silu(gu[r, j]) * gu[r, I + j] (the dense MLP between its two products).
extern "C" __global__ void silu_mul(const float* __restrict__ gu, float* __restrict__ a, int I) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    for (int j = threadIdx.x; j < I; j += blockDim.x) {
        const float g = gu[(size_t)r * 2 * I + j];
        a[(size_t)r * I + j] = g / (1.f + expf(-g)) * gu[(size_t)r * 2 * I + I + j];
    }
}


// y[r, :dim] += b[:dim] for each row r (q/k/v biases). grid: rows.
extern "C" __global__ void bias_rows(float* __restrict__ y, const float* __restrict__ b, int dim) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) y[(size_t)r * dim + j] += b[j];
}

// a[r, :I] *= sigmoid(g[r]) (the shared expert's gate, applied to its activation). grid: rows.
extern "C" __global__ void sigmoid_scale_rows(float* __restrict__ a, const float* __restrict__ g, int I) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const float s = 1.f / (1.f + expf(-g[r]));
    for (int j = threadIdx.x; j < I; j += blockDim.x) a[(size_t)r * I + j] *= s;
}
