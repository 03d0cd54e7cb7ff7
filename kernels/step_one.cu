// The persistent decode step of one row (`step_one`): every MoE layer of a span in one
// kernel, one block of 16 warps per SM, the phases of a layer separated by grid barriers
// instead of kernel boundaries. Each phase's weights are asked of the L2 before the barrier
// that precedes it (the dense rows one or two phases ahead, the picked experts' down rows
// once the block's share of the up-projection is done), so after a barrier a
// phase waits only for its activations. The arithmetic is the chain's, kernel for kernel
// and in the same order (norm_gemv_rows, attention_decode, attention_merge, gemv_rows,
// route_topk, moe_up, moe_down and moe_combine): the two paths' logits agree bit for bit.
// Activations written inside the kernel are read through the L2 (__ldcg), never the
// read-only path.
//
// Measured (docs/PERFORMANCE.md): 0.59-0.62x the chain's tok/s at batch 1 on station, so it is
// off by default. A grid barrier costs ~3 us a phase (arrivals, imbalance, the poll; 1.16 us
// alone on an H100, ONE_BARRIERS_ONLY), where a kernel boundary of the chain, with its weights
// preloaded before the dependent launch's wait, costs ~0.7; two blocks an SM, and the experts
// staged in shared memory (below), measured slower still.
//
// The span's layers are described by `lay` (ONE_FIELDS words each, see OneLayer); the grid
// must be co-resident (a cooperative launch). bar[0] counts arrivals at the grid barriers,
// bar[1] blocks done: the last block to finish sets both back to 0 for the next launch
// (words from bar[2] on are ONE_TRACE's).
// grid: the SM count (times MOELANE_CUDA_PERSIST_BLOCKS); block: 32 * ONE_WARPS; dynamic
// shared memory: (ONE_WARPS + 3) * hd floats (attention's).

#define ONE_WARPS 16
#ifndef ONE_DOWN_PREFETCH
#define ONE_DOWN_PREFETCH 2
#endif

struct OneLayer {
    const void* qkv;           // [q_dim + 2 kv_dim, H]
    const float* in_norm;      // [H]
    const float* qn;           // [hd] or null (no q/k norm)
    const float* kn;
    float* kc;                 // this layer's KV cache
    float* vc;
    const void* o;             // [H, q_dim]
    const float* post_norm;    // [H]
    const void* router;        // [E, H]
    const unsigned long long* gu;  // per expert: gate_up [2I, H] or null
    const unsigned long long* dn;  // per expert: down [H, I] or null
    const float* sinks;        // [nh] or null
    long long window;          // sliding window (0: none)
};

// The grid barrier: every block's writes before it are visible to every block after it (the
// block's barrier orders its threads' writes before thread 0's release; the release is
// cumulative, and the poll's acquire orders the reads after it). Measured 1.05x against a
// __threadfence before an atomicAdd and after the poll.
__device__ __forceinline__ void one_sync(unsigned* bar, unsigned& target) {
    __syncthreads();
    target += gridDim.x;
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" : : "l"(bar) : "memory");
        unsigned v;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

// A development aid: with ONE_TRACE defined (a copy of kernels/ through MOELANE_KERNELS_DIR),
// block 0 adds the SM cycles from one barrier's end to the next's to bar[2..] (u64 sums of the
// phases 0-6 at words 2-17, their counts at 18-33), which `persist_trace` reads back.
#ifdef ONE_TRACE
#define ONE_MARK(i)                                                              \
    do {                                                                         \
        if (blockIdx.x == 0 && threadIdx.x == 0) {                               \
            const long long t_ = clock64();                                      \
            unsigned long long* tr_ = (unsigned long long*)(bar + 2);            \
            tr_[i] += (unsigned long long)(t_ - t_mark);                         \
            tr_[8 + i] += 1ull;                                                  \
            t_mark = t_;                                                         \
        }                                                                        \
    } while (0)
#else
#define ONE_MARK(i) \
    do {            \
    } while (0)
#endif

// This block's share [lo, hi) of `total` items, in contiguous ranges.
__device__ __forceinline__ void one_range(int total, int& lo, int& hi) {
    const int per = (total + gridDim.x - 1) / gridDim.x;
    lo = min(total, (int)blockIdx.x * per);
    hi = min(total, lo + per);
}

// Thread 0 asks the L2 for rows [lo, hi) of a matrix of `in` columns.
template <typename W>
__device__ __forceinline__ void one_prefetch(const W* w, int lo, int hi, int in) {
    if (threadIdx.x == 0 && hi > lo) prefetch_l2(w + (size_t)lo * in, (unsigned)((size_t)(hi - lo) * in * sizeof(W)));
}

// As load_row, through the L2.
__device__ __forceinline__ void one_row(float4 (&xr)[W_AHEAD], const float* x, int in, int lane) {
#pragma unroll
    for (int u = 0; u < W_AHEAD; u++) {
        const int i = lane * 4 + u * 128;
        xr[u] = i < in ? __ldcg((const float4*)(x + i)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

// 1 / rms(x) as norm_gemv_rows computes it (each warp for itself).
__device__ __forceinline__ float one_inv(const float* x, int in, float eps, int lane) {
    float s = 0.f;
    for (int c = 0; c < in; c += 128 * W_AHEAD) {
        float4 xc[W_AHEAD];
        one_row(xc, x + c, in - c, lane);
#pragma unroll
        for (int u = 0; u < W_AHEAD; u++)
            if (lane * 4 + u * 128 < in - c) s = fma4(xc[u], xc[u], s);
    }
    s = warp_sum(s);
    return 1.f / sqrtf(s / (float)in + eps);
}

// The warp's sum of wr . x, or with nw not null wr . (nw * (x * inv)), in norm_gemv_rows'
// and gemv_rows' order (rounds of W_AHEAD float4s a lane).
template <typename W>
__device__ __forceinline__ float one_dot(const W* __restrict__ wr, const float* __restrict__ nw, float inv,
                                         const float* x, int in, int lane) {
    float acc = 0.f;
    for (int c = 0; c < in; c += 128 * W_AHEAD) {
        float4 wc[W_AHEAD], gc[W_AHEAD], xc[W_AHEAD];
        load_wrow(wc, wr + c, in - c, lane);
        if (nw != 0) load_row(gc, nw + c, in - c, lane);
        one_row(xc, x + c, in - c, lane);
#pragma unroll
        for (int u = 0; u < W_AHEAD; u++)
            if (lane * 4 + u * 128 < in - c) acc = fma4(wc[u], nw != 0 ? normed4(gc[u], xc[u], inv) : xc[u], acc);
    }
    return warp_sum(acc);
}

// moe_up's sums of one gate row g and up row u against the normed row x (its 16-bit path
// when the rows allow it, else four at a time), then the activation.
template <typename W>
__device__ __forceinline__ float one_up(const W* __restrict__ g, const W* __restrict__ u, const float* x,
                                        int H, bool eight, int lane) {
    float sg = 0.f, su = 0.f;
    if (eight) {
#pragma unroll 4
        for (int i = lane * 8; i < H; i += 256) {
            float4 g0, g1, u0, u1;
            wload8(g + i, g0, g1);
            wload8(u + i, u0, u1);
            const float4 x0 = __ldcg((const float4*)(x + i)), x1 = __ldcg((const float4*)(x + i + 4));
            sg = fma4(g1, x1, fma4(g0, x0, sg));
            su = fma4(u1, x1, fma4(u0, x0, su));
        }
    } else {
#pragma unroll 4
        for (int i = lane * 4; i < H; i += 128) {
            const float4 gv = wload4(g + i), uv = wload4(u + i);
            const float4 xv = __ldcg((const float4*)(x + i));
            sg = fma4(gv, xv, sg);
            su = fma4(uv, xv, su);
        }
    }
    sg = warp_sum(sg);
    su = warp_sum(su);
    return sg / (1.f + expf(-sg)) * su;
}

// A lane's part of down row d . activation row a, in dot8's order for 16-bit rows (eight a
// lane), else moe_down's four at a time (the warp's sum of it is moe_down's).
template <typename W>
__device__ __forceinline__ float one_down_lane(const W* __restrict__ d, const float* a, int I, bool eight, int lane) {
    float sum = 0.f;
    if (eight) {
#pragma unroll 4
        for (int i = lane * 8; i < I; i += 256) {
            float4 d0, d1;
            wload8(d + i, d0, d1);
            const float4 a0 = __ldcg((const float4*)(a + i)), a1 = __ldcg((const float4*)(a + i + 4));
            sum = fma4(d1, a1, fma4(d0, a0, sum));
        }
    } else {
#pragma unroll 4
        for (int i = lane * 4; i < I; i += 128) sum = fma4(wload4(d + i), __ldcg((const float4*)(a + i)), sum);
    }
    return sum;
}

// Shared-memory staging of the expert rows (sm_90: bulk copies completing on an mbarrier):
// after the top-k every block asks for the up rows of its items and the down rows of its
// hidden range at once, into the dynamic shared memory past attention's, as far as it holds
// them (`%dynamic_smem_size`: MOELANE_CUDA_PERSIST_SMEM bytes); the products read the staged
// rows, in the same order as from global memory. Compiled only with ONE_STAGE_EXPERTS
// defined (a copy of kernels/ through MOELANE_KERNELS_DIR): measured slower than loads
// through the L2 (docs/PERFORMANCE.md), one copy per run of rows, waited for whole, starting
// the products later than the loads it replaces; the code present but unused cost 3%.
#if defined(ONE_STAGE_EXPERTS) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define ONE_STAGE 1
__device__ __forceinline__ unsigned one_dyn_bytes() {
    unsigned v;
    asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(v));
    return v;
}
__device__ __forceinline__ unsigned one_sa(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void one_mbar_init(unsigned long long* b) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(one_sa(b)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void one_mbar_expect(unsigned long long* b, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(one_sa(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void one_mbar_wait(unsigned long long* b, unsigned parity) {
    unsigned ok = 0;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
            : "=r"(ok)
            : "r"(one_sa(b)), "r"(parity)
            : "memory");
    } while (!ok);
}
__device__ __forceinline__ void one_bulk(void* dst, const void* src, unsigned bytes, unsigned long long* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     one_sa(dst)),
                 "l"(src), "r"(bytes), "r"(one_sa(b))
                 : "memory");
}
__device__ __forceinline__ void one_fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#else
#define ONE_STAGE 0
__device__ __forceinline__ unsigned one_dyn_bytes() { return 0; }
__device__ __forceinline__ void one_mbar_init(unsigned long long*) {}
__device__ __forceinline__ void one_mbar_expect(unsigned long long*, unsigned) {}
__device__ __forceinline__ void one_mbar_wait(unsigned long long*, unsigned) {}
__device__ __forceinline__ void one_bulk(void*, const void*, unsigned, unsigned long long*) {}
__device__ __forceinline__ void one_fence_async() {}
#endif

template <typename W>
__device__ __forceinline__ void step_one_body(const OneLayer* __restrict__ lay, int nl, float* x, float* qkv,
                                              float* att, float* part, float* h, float* rlog, float* act,
                                              int* idx, float* wts, const float* __restrict__ cos_t,
                                              const float* __restrict__ sin_t, const int* __restrict__ row_pos,
                                              const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                              unsigned* bar, int H, int nh, int nkv, int hd, int rd, int E,
                                              int K, int I, float eps, float scale, int norm, int S) {
    __shared__ int s_idx[32];
    __shared__ float s_wts[32];
    __shared__ __align__(8) unsigned long long s_mbar[2];
    extern __shared__ __align__(128) unsigned char one_dyn[];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int qd = nh * hd, kvd = nkv * hd, qkv_out = qd + 2 * kvd;
    // the staging area: past attention's floats, 128-byte aligned
    const unsigned st_base = ((unsigned)((ONE_WARPS + 3) * hd * 4) + 127u) & ~127u;
    const unsigned st_dyn = one_dyn_bytes();
    const unsigned st_cap = st_dyn > st_base ? (st_dyn - st_base) & ~127u : 0u;
    unsigned char* const stage = one_dyn + st_base;
    const size_t row_b = (size_t)H * sizeof(W), drow_b = (size_t)I * sizeof(W);
    const bool st_ok = ONE_STAGE && st_cap > 0 && row_b % 16 == 0 && drow_b % 16 == 0;
    unsigned ph_up = 0, ph_dn = 0;
    unsigned s_dn_bytes = 0;
    bool s_dn_st = false;
    const unsigned char* dn_stage = stage;
    if (threadIdx.x == 0 && st_ok) {
        one_mbar_init(&s_mbar[0]);
        one_mbar_init(&s_mbar[1]);
    }
    __syncthreads();
    unsigned target = 0;
    int lo, hi;
    one_range(qkv_out, lo, hi);
    one_prefetch((const W*)lay[0].qkv, lo, hi, H);
    PDL_ENTRY();
#ifdef ONE_TRACE
    long long t_mark = clock64();
#endif
#ifdef ONE_BARRIERS_ONLY
    // a development aid (with ONE_TRACE, through MOELANE_KERNELS_DIR): the step's barriers
    // and nothing else, to time a barrier alone (results are wrong; the layers' loop below
    // is skipped)
    for (int l = 0; l < nl; l++) {
        const int n = 5 + (S > 1) + (l + 1 < nl);
        for (int b = 0; b < n; b++) {
            one_sync(bar, target);
            ONE_MARK(b);
        }
    }
    if (nl < 0)
#endif
    for (int l = 0; l < nl; l++) {
        const OneLayer& L = lay[l];
        // q, k and v: the input norm's rows of qkv (norm_gemv_rows)
        {
            one_range(qkv_out, lo, hi);
            if (lo + w < hi) {
                const float inv = one_inv(x, H, eps, lane);
                for (int j = lo + w; j < hi; j += ONE_WARPS) {
                    const float t = one_dot((const W*)L.qkv + (size_t)j * H, L.in_norm, inv, x, H, lane);
                    if (lane == 0) qkv[j] = t;
                }
            }
            // the o product's and the router's rows, for the phases after attention
            one_range(H, lo, hi);
            one_prefetch((const W*)L.o, lo, hi, qd);
            one_range(E, lo, hi);
            one_prefetch((const W*)L.router, lo, hi, H);
        }
        one_sync(bar, target);
        ONE_MARK(0);
        // attention (attention_decode): a block per (head, range)
        for (int t = blockIdx.x; t < nh * S; t += gridDim.x) {
            decode_head(qkv, L.qn, L.kn, cos_t, sin_t, L.kc, L.vc, row_pos, row_tab, blocks, att, nh, nkv,
                        hd, eps, scale, part, rd, L.sinks, (int)L.window, 0, t / S, t % S, S);
            __syncthreads();
        }
        one_sync(bar, target);
        ONE_MARK(1);
        if (S > 1) {
            // the ranges' partials merged (attention_merge)
            for (int hh = blockIdx.x; hh < nh; hh += gridDim.x)
                if ((int)threadIdx.x < hd) merge_head(part, att, nh, hd, S, L.sinks, 0, hh, threadIdx.x);
            one_sync(bar, target);
            ONE_MARK(2);
        }
        // x += o . att (gemv_rows, beta 1)
        {
            one_range(H, lo, hi);
            for (int j = lo + w; j < hi; j += ONE_WARPS) {
                const float t = one_dot((const W*)L.o + (size_t)j * qd, (const float*)0, 1.f, att, qd, lane);
                if (lane == 0) x[j] = 1.f * __ldcg(x + j) + t;
            }
        }
        one_sync(bar, target);
        ONE_MARK(3);
        // the router's logits on the post-attention norm's rows; block 0 writes the normed
        // row h the experts take (norm_gemv_rows)
        {
            one_range(E, lo, hi);
            if (lo + w < hi || blockIdx.x == 0) {
                const float inv = one_inv(x, H, eps, lane);
                if (blockIdx.x == 0)
                    for (int i = threadIdx.x; i < H; i += blockDim.x) h[i] = L.post_norm[i] * (__ldcg(x + i) * inv);
                for (int j = lo + w; j < hi; j += ONE_WARPS) {
                    const float t = one_dot((const W*)L.router + (size_t)j * H, L.post_norm, inv, x, H, lane);
                    if (lane == 0) rlog[j] = t;
                }
            }
        }
        one_sync(bar, target);
        ONE_MARK(4);
        // every block: the top k (route_topk), then its share of the up-projections (moe_up)
        {
            if (w == 0) topk_row_regs(rlog, s_idx, s_wts, E, K, norm);
            __syncthreads();
            if (blockIdx.x == 0 && (int)threadIdx.x < K) {
                idx[(size_t)l * K + threadIdx.x] = s_idx[threadIdx.x];
                wts[threadIdx.x] = s_wts[threadIdx.x];
            }
            // the staging plan (every thread computes the same one): this block's up items
            // [ulo, ulo + n_up) and, when they fit too, its down rows [dlo, dhi) of every pick
            int ulo, uhi, dlo, dhi;
            one_range(K * I, ulo, uhi);
            one_range(H, dlo, dhi);
            int n_up = 0;
            bool dn_st = false;
            if (st_ok) {
                n_up = min(uhi - ulo, (int)(st_cap / (2 * row_b)));
                dn_st = 2 * (size_t)n_up * row_b + (size_t)K * (dhi - dlo) * drow_b <= st_cap && dhi > dlo;
            }
            unsigned char* const up_g = stage;                          // gate rows
            unsigned char* const up_u = stage + (size_t)n_up * row_b;   // up rows
            unsigned char* const dn_s = stage + 2 * (size_t)n_up * row_b;
            // a pick's rows are staged when its expert is here and 16-byte aligned
            unsigned up_bytes = 0, dn_bytes = 0;
            for (int t = ulo; t < ulo + n_up; t++) {
                const size_t gp = (size_t)L.gu[s_idx[t / I]];
                if (gp != 0 && (gp & 15) == 0) up_bytes += 2 * (unsigned)row_b;
            }
            if (dn_st)
                for (int s = 0; s < K; s++) {
                    const size_t dp = (size_t)L.dn[s_idx[s]];
                    if (dp != 0 && (dp & 15) == 0) dn_bytes += (unsigned)((dhi - dlo) * drow_b);
                }
            if (up_bytes + dn_bytes > 0) {
                // the last layer's reads of the staging area before the copies' writes
                one_fence_async();
                __syncthreads();
                if (threadIdx.x == 0) {
                    if (up_bytes > 0) one_mbar_expect(&s_mbar[0], up_bytes);
                    if (dn_bytes > 0) one_mbar_expect(&s_mbar[1], dn_bytes);
                    // up items in runs of one expert: its gate rows then its up rows
                    for (int t = ulo; t < ulo + n_up;) {
                        const int s = t / I, j = t % I;
                        const int run = min(ulo + n_up, (s + 1) * I) - t;
                        const W* gu = (const W*)L.gu[s_idx[s]];
                        if (gu != 0 && ((size_t)gu & 15) == 0) {
                            one_bulk(up_g + (size_t)(t - ulo) * row_b, gu + (size_t)j * H, (unsigned)(run * row_b), &s_mbar[0]);
                            one_bulk(up_u + (size_t)(t - ulo) * row_b, gu + (size_t)(j + I) * H, (unsigned)(run * row_b), &s_mbar[0]);
                        }
                        t += run;
                    }
                    if (dn_bytes > 0)
                        for (int s = 0; s < K; s++) {
                            const W* dn = (const W*)L.dn[s_idx[s]];
                            if (dn != 0 && ((size_t)dn & 15) == 0)
                                one_bulk(dn_s + (size_t)s * (dhi - dlo) * drow_b, dn + (size_t)dlo * I,
                                         (unsigned)((dhi - dlo) * drow_b), &s_mbar[1]);
                        }
                }
            }
            // the down rows of the next phase that are not staged: asked of the L2 now (1),
            // once the block's up rows are done (2, the default: 1.03-1.05x the first on an
            // H100, whose up rows no longer queue behind them), or not (0)
            if (ONE_DOWN_PREFETCH == 1 && !dn_st)
                for (int s = 0; s < K; s++) {
                    const W* dn = (const W*)L.dn[s_idx[s]];
                    if (dn != 0) one_prefetch(dn, dlo, dhi, I);
                }
            bool up_waited = up_bytes == 0;
            for (int t = ulo + w; t < uhi; t += ONE_WARPS) {
                const int s = t / I, j = t % I;
                const W* gu = (const W*)L.gu[s_idx[s]];
                if (gu == 0) continue;
                const bool eight = sizeof(W) == 2 && (H & 7) == 0 && ((size_t)gu & 15) == 0;
                const W* gr = gu + (size_t)j * H;
                const W* ur = gu + (size_t)(j + I) * H;
                if (t < ulo + n_up && ((size_t)gu & 15) == 0) {
                    if (!up_waited) {
                        one_mbar_wait(&s_mbar[0], ph_up);
                        up_waited = true;
                    }
                    gr = (const W*)(up_g + (size_t)(t - ulo) * row_b);
                    ur = (const W*)(up_u + (size_t)(t - ulo) * row_b);
                }
                const float a = one_up(gr, ur, h, H, eight, lane);
                if (lane == 0) act[(size_t)s * I + j] = a;
            }
            if (up_bytes > 0) {
                if (!up_waited) one_mbar_wait(&s_mbar[0], ph_up);
                ph_up ^= 1u;
            }
            if (ONE_DOWN_PREFETCH == 2 && !dn_st) {
                __syncthreads();
                for (int s = 0; s < K; s++) {
                    const W* dn = (const W*)L.dn[s_idx[s]];
                    if (dn != 0) one_prefetch(dn, dlo, dhi, I);
                }
            }
            s_dn_bytes = dn_bytes;
            s_dn_st = dn_st;
            dn_stage = dn_s;
        }
        one_sync(bar, target);
        ONE_MARK(5);
        // x += the picks' down-projections in rank order (moe_down, moe_combine)
        {
            one_range(H, lo, hi);
            if (s_dn_bytes > 0 && lo + w < hi) one_mbar_wait(&s_mbar[1], ph_dn);
            for (int j = lo + w; j < hi; j += ONE_WARPS) {
                float acc = 0.f;
                // eight picks at a time: every pick's loads issued before any of its sums (the
                // same sums, in rank order)
                for (int s0 = 0; s0 < K; s0 += 8) {
                    float ps[8];
                    bool on[8];
#pragma unroll
                    for (int u = 0; u < 8; u++) {
                        const W* dn = s0 + u < K ? (const W*)L.dn[s_idx[s0 + u]] : (const W*)0;
                        on[u] = dn != 0;
                        ps[u] = 0.f;
                        if (on[u]) {
                            const bool eight = sizeof(W) == 2 && (I & 7) == 0 && ((size_t)dn & 15) == 0;
                            const W* dr = dn + (size_t)j * I;
                            if (s_dn_st && ((size_t)dn & 15) == 0)
                                dr = (const W*)(dn_stage + ((size_t)(s0 + u) * (hi - lo) + (j - lo)) * drow_b);
                            ps[u] = one_down_lane(dr, act + (size_t)(s0 + u) * I, I, eight, lane);
                        }
                    }
#pragma unroll
                    for (int u = 0; u < 8; u++)
                        if (on[u]) acc = fmaf(s_wts[s0 + u], warp_sum(ps[u]), acc);
                }
                if (lane == 0) x[j] = __ldcg(x + j) + acc;
            }
            if (s_dn_bytes > 0) ph_dn ^= 1u;
            if (l + 1 < nl) {
                one_range(qkv_out, lo, hi);
                one_prefetch((const W*)lay[l + 1].qkv, lo, hi, H);
            }
        }
        if (l + 1 < nl) {
            one_sync(bar, target);
            ONE_MARK(6);
        }
    }
    // the last block out sets the counters back (no block polls them any more)
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(bar + 1, 1u) == gridDim.x - 1) {
            bar[0] = 0;
            bar[1] = 0;
            __threadfence();
        }
    }
}

#define STEP_ONE_KERNEL(name, W)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * ONE_WARPS, 1) name(                             \
        const unsigned long long* __restrict__ lay, int nl, float* x, float* qkv, float* att, float* part, \
        float* h, float* rlog, float* act, int* idx, float* wts, const float* __restrict__ cos_t,      \
        const float* __restrict__ sin_t, const int* __restrict__ row_pos, const int* __restrict__ row_tab, \
        const int* __restrict__ blocks, unsigned* bar, int H, int nh, int nkv, int hd, int rd, int E,  \
        int K, int I, float eps, float scale, int norm, int S) {                                      \
        step_one_body<W>((const OneLayer*)lay, nl, x, qkv, att, part, h, rlog, act, idx, wts, cos_t,  \
                         sin_t, row_pos, row_tab, blocks, bar, H, nh, nkv, hd, rd, E, K, I, eps, scale, \
                         norm, S);                                                                    \
    }
STEP_ONE_KERNEL(step_one, float)
STEP_ONE_KERNEL(step_one_bf16, bf16_t)
