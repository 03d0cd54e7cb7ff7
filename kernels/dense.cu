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

// x[r] = emb[tok[r]]. grid: rows.
extern "C" __global__ void embed_rows(const float* __restrict__ emb, const int* __restrict__ tok,
                                      float* __restrict__ x, int h) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const float* e = emb + (size_t)tok[r] * h;
    for (int i = threadIdx.x; i < h; i += blockDim.x) x[(size_t)r * h + i] = e[i];
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
    float s = 0.f;
    for (int i = threadIdx.x; i < h; i += blockDim.x) s = fmaf(xr[i], xr[i], s);
    s = block_sum(s, red);
    const float inv = 1.f / sqrtf(s / (float)h + eps);
    for (int i = threadIdx.x; i < h; i += blockDim.x) yr[i] = w[i] * (xr[i] * inv);
}

// A step kernel's slot with its work left out (`MOELANE_CUDA_HOLLOW`, a diagnostic: the
// results are wrong): launched with the replaced kernel's grid, it only waits and releases.
extern "C" __global__ void hollow_step() { PDL_ENTRY(); }

// One head vector (hd floats, one warp): RMSNorm with weight nwt, then rotate-half RoPE for
// position pos (tables [max_pos, hd/2]), into dst (may be v itself: every read comes before
// the warp's barrier, every write after).
__device__ __forceinline__ void norm_rope(const float* v, const float* __restrict__ nwt,
                                          float* dst, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, int pos, int hd,
                                          float eps) {
    const int lane = threadIdx.x & 31, half = hd / 2;
    // every value this lane needs (hd <= 128) in one round of loads, then the arithmetic
    float sq[4], lo[2], hi[2], glo[2], ghi[2], c[2], sn[2];
#pragma unroll
    for (int t = 0; t < 4; t++) sq[t] = lane + 32 * t < hd ? v[lane + 32 * t] : 0.f;
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const int i = lane + 32 * t;
        const bool ok = i < half;
        lo[t] = ok ? v[i] : 0.f;
        hi[t] = ok ? v[i + half] : 0.f;
        glo[t] = ok ? nwt[i] : 0.f;
        ghi[t] = ok ? nwt[i + half] : 0.f;
        c[t] = ok ? cos_t[(size_t)pos * half + i] : 0.f;
        sn[t] = ok ? sin_t[(size_t)pos * half + i] : 0.f;
    }
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < 4; t++)
        if (lane + 32 * t < hd) s = fmaf(sq[t], sq[t], s);
    s = warp_sum(s);
    // in place (dst == v) with half not a multiple of 32, a lane writes what another read
    __syncwarp();
    const float inv = 1.f / sqrtf(s / (float)hd + eps);
#pragma unroll
    for (int t = 0; t < 2; t++) {
        const int i = lane + 32 * t;
        if (i < half) {
            const float a = glo[t] * (lo[t] * inv), b = ghi[t] * (hi[t] * inv);
            dst[i] = a * c[t] - b * sn[t];
            dst[i + half] = b * c[t] + a * sn[t];
        }
    }
}

// Per row of qkv [rows, q_dim + 2 kv_dim]: RMSNorm of each q and k head, RoPE (rotate-half,
// tables [max_pos, hd/2]), then K and V into the cache. grid: rows; block: 32 * (nh + nkv).
extern "C" __global__ void qk_rope_kv(float* __restrict__ qkv, const float* __restrict__ qn,
                                      const float* __restrict__ kn, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, const int* __restrict__ row_pos,
                                      const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                      float* __restrict__ kc, float* __restrict__ vc,
                                      int nh, int nkv, int hd, float eps) {
    PDL_ENTRY();
    const int r = blockIdx.x, w = threadIdx.x >> 5;
    const int qd = nh * hd, kvd = nkv * hd;
    float* row = qkv + (size_t)r * (qd + 2 * kvd);
    const int pos = row_pos[r];
    if (w < nh + nkv) {
        float* v = w < nh ? row + w * hd : row + qd + (w - nh) * hd;
        norm_rope(v, w < nh ? qn : kn, v, cos_t, sin_t, pos, hd, eps);
    }
    __syncthreads();
    const size_t off = ((size_t)blocks[row_tab[r] + pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK) * kvd;
    for (int i = threadIdx.x; i < kvd; i += blockDim.x) {
        kc[off + i] = row[qd + i];
        vc[off + i] = row[qd + kvd + i];
    }
}

#define ATT_AHEAD 4  // positions whose K/V rows a warp has in flight at once

// One (row, head) of attention over positions [lo, hi): warps take them in turn with an
// online softmax (q in registers, lane + 32 d), merged by warp 0 into out[0..hd), or, when
// `part` is not null, into the unnormalised partial part = (max score, sum of weights,
// weighted values [hd]) that attention_merge combines with the other ranges' (a range
// without positions gives (-inf, 0, 0)). cur_k / cur_v, when not null, stand in for the
// cache's entries at pos. sacc holds nw * hd floats.
__device__ void attend(const float (&qv)[4], const float* __restrict__ kc,
                       const float* __restrict__ vc, const int* __restrict__ tab, int pos,
                       int lo, int hi, int kvd, int goff, int hd, float scale,
                       const float* cur_k, const float* cur_v, float* sacc, float* sm,
                       float* sl, float* __restrict__ out, float* __restrict__ part) {
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float m = -INFINITY, l = 0.f;
    // a warp's positions are w, w + nw, ... in order; it loads ATT_AHEAD of them at once
    // (their K and V rows in registers), then folds them in one by one: the chain of
    // dependent loads is ATT_AHEAD times shorter, the arithmetic and its order unchanged
    for (int j0 = lo + w; j0 < hi; j0 += ATT_AHEAD * nw) {
        float kk[ATT_AHEAD][4], vv[ATT_AHEAD][4];
#pragma unroll
        for (int u = 0; u < ATT_AHEAD; u++) {
            const int j = j0 + u * nw;
            const float* kr = cur_k;
            const float* vr = cur_v;
            if (j < hi && !(j == pos && cur_k != 0)) {
                const size_t off = ((size_t)tab[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK) * kvd + goff;
                kr = kc + off;
                vr = vc + off;
            }
#pragma unroll
            for (int d = 0; d < 4; d++) {
                const int i = lane + 32 * d;
                const bool ok = j < hi && i < hd;
                kk[u][d] = ok ? kr[i] : 0.f;
                vv[u][d] = ok ? vr[i] : 0.f;
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_AHEAD; u++) {
            if (j0 + u * nw >= hi) break;
            float s = 0.f;
            for (int d = 0; d < 4; d++) {
                const int i = lane + 32 * d;
                if (i < hd) s = fmaf(qv[d], kk[u][d], s);
            }
            s = warp_sum(s) * scale;
            const float mn = fmaxf(m, s);
            const float corr = expf(m - mn);
            const float p = expf(s - mn);
            l = l * corr + p;
            for (int d = 0; d < 4; d++) {
                const int i = lane + 32 * d;
                if (i < hd) acc[d] = acc[d] * corr + p * vv[u][d];
            }
            m = mn;
        }
    }
    if (lane == 0) { sm[w] = m; sl[w] = l; }
    for (int d = 0; d < 4; d++) {
        const int i = lane + 32 * d;
        if (i < hd) sacc[w * hd + i] = acc[d];
    }
    __syncthreads();
    if (w == 0) {
        float mx = -INFINITY;
        for (int k = 0; k < nw; k++) mx = fmaxf(mx, sm[k]);
        const bool none = mx == -INFINITY;
        float tot = 0.f;
        if (!none)
            for (int k = 0; k < nw; k++) tot += sl[k] * expf(sm[k] - mx);
        if (part != 0 && lane == 0) {
            part[0] = mx;
            part[1] = tot;
        }
        for (int d = 0; d < 4; d++) {
            const int i = lane + 32 * d;
            if (i >= hd) continue;
            float o = 0.f;
            if (!none)
                for (int k = 0; k < nw; k++) o += sacc[k * hd + i] * expf(sm[k] - mx);
            if (part != 0)
                part[2 + i] = o;
            else
                out[i] = o / tot;
        }
    }
}

// Causal attention of each row over its sequence's positions 0..=pos, one block per
// (row, head), warps taking positions in turn with an online softmax, merged at the end.
// `tiles` is unused (the parameters are attention_tiled's). grid: (rows, nh); block:
// 32 * nw; dynamic shared memory: nw * hd floats. hd <= 128.
extern "C" __global__ void attention(const float* __restrict__ qkv, const float* __restrict__ kc,
                                     const float* __restrict__ vc, const int* __restrict__ row_pos,
                                     const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                     const int* __restrict__ tiles, float* __restrict__ out,
                                     int nh, int nkv, int hd, float scale) {
    PDL_ENTRY();
    extern __shared__ float sacc[];
    __shared__ float sm[32], sl[32];
    const int r = blockIdx.x, hh = blockIdx.y;
    const int qd = nh * hd, kvd = nkv * hd;
    const int g = hh / (nh / nkv);
    const float* q = qkv + (size_t)r * (qd + 2 * kvd) + hh * hd;
    const int pos = row_pos[r];
    const int* tab = blocks + row_tab[r];
    const int lane = threadIdx.x & 31;
    float qv[4];
    for (int d = 0; d < 4; d++) {
        const int i = lane + 32 * d;
        qv[d] = i < hd ? q[i] : 0.f;
    }
    attend(qv, kc, vc, tab, pos, 0, pos + 1, kvd, g * hd, hd, scale, 0, 0, sacc, sm, sl,
           out + (size_t)r * qd + hh * hd, 0);
}

// Causal attention for prefill, a tile of up to ATT_TILE rows of one sequence per block (the
// host lists the tiles: first row, row count): each block reads the K/V rows of positions
// 0..=the tile's last position once, ATT_CHUNK at a time, into shared memory, for all its
// rows (one block per row read them once per row). A warp takes ATT_TILE / nw rows; lane j
// scores position j0 + j of the chunk (masked past the row's position), the online softmax
// moves by the chunk, and lanes then own output dimensions lane + 32 i. Rows' q, K and V were
// written by qk_rope_kv. grid: (tiles, nh); block: 256; dynamic shared memory:
// (ATT_TILE hd + ATT_CHUNK (2 hd + 1) + 8 ATT_CHUNK) floats. hd <= 128.
#define ATT_TILE 16
#define ATT_TPW 2  // rows per warp: ATT_TILE / 8 warps
#define ATT_CHUNK 32
extern "C" __global__ void __launch_bounds__(256) attention_tiled(
    const float* __restrict__ qkv, const float* __restrict__ kc, const float* __restrict__ vc,
    const int* __restrict__ row_pos, const int* __restrict__ row_tab, const int* __restrict__ blocks,
    const int* __restrict__ tiles, float* __restrict__ out, int nh, int nkv, int hd, float scale) {
    PDL_ENTRY();
    extern __shared__ float sh[];
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int r0 = tiles[2 * blockIdx.x], cnt = tiles[2 * blockIdx.x + 1], hh = blockIdx.y;
    const int qd = nh * hd, kvd = nkv * hd, g = hh / (nh / nkv);
    const int* tab = blocks + row_tab[r0];
    float* qs = sh;                              // [ATT_TILE][hd]
    float* ks = qs + ATT_TILE * hd;              // [ATT_CHUNK][hd + 1] (padded: no bank conflicts)
    float* vs = ks + ATT_CHUNK * (hd + 1);       // [ATT_CHUNK][hd]
    float* ps = vs + ATT_CHUNK * hd;             // [nw][ATT_CHUNK]
    int last = 0;
    for (int t = 0; t < cnt; t++) last = max(last, row_pos[r0 + t]);
    for (int e = threadIdx.x; e < ATT_TILE * hd; e += blockDim.x) {
        const int t = e / hd, d = e % hd;
        qs[e] = t < cnt ? qkv[(size_t)(r0 + t) * (qd + 2 * kvd) + hh * hd + d] : 0.f;
    }
    const int per = ATT_TPW;
    float m[ATT_TPW], l[ATT_TPW], acc[ATT_TPW][4];
#pragma unroll
    for (int u = 0; u < ATT_TPW; u++) {
        m[u] = -INFINITY;
        l[u] = 0.f;
        for (int i = 0; i < 4; i++) acc[u][i] = 0.f;
    }
    for (int j0 = 0; j0 <= last; j0 += ATT_CHUNK) {
        __syncthreads();
        for (int e = threadIdx.x; e < ATT_CHUNK * hd; e += blockDim.x) {
            const int jj = e / hd, d = e % hd, j = j0 + jj;
            float kv = 0.f, vv = 0.f;
            if (j <= last) {
                const size_t off = ((size_t)tab[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK) * kvd + g * hd + d;
                kv = kc[off];
                vv = vc[off];
            }
            ks[jj * (hd + 1) + d] = kv;
            vs[jj * hd + d] = vv;
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < ATT_TPW; u++) {
            const int t = w * per + u;
            if (t >= cnt) break;
            const int pos = row_pos[r0 + t], j = j0 + lane;
            const bool ok = j <= pos;
            float sc = -INFINITY;
            if (ok) {
                float a = 0.f;
                for (int d = 0; d < hd; d++) a = fmaf(qs[t * hd + d], ks[lane * (hd + 1) + d], a);
                sc = a * scale;
            }
            const float cm = warp_max(sc);
            if (cm == -INFINITY) continue;  // no position of this chunk is visible to the row
            const float mn = fmaxf(m[u], cm);
            const float corr = expf(m[u] - mn);
            const float p = ok ? expf(sc - mn) : 0.f;
            l[u] = l[u] * corr + warp_sum(p);
            ps[w * ATT_CHUNK + lane] = p;
            __syncwarp();
            for (int i = 0; i < 4; i++) {
                const int d = lane + 32 * i;
                if (d >= hd) continue;
                float a = acc[u][i] * corr;
                for (int jj = 0; jj < ATT_CHUNK; jj++) a = fmaf(ps[w * ATT_CHUNK + jj], vs[jj * hd + d], a);
                acc[u][i] = a;
            }
            __syncwarp();
            m[u] = mn;
        }
    }
#pragma unroll
    for (int u = 0; u < ATT_TPW; u++) {
        const int t = w * per + u;
        if (t >= cnt) break;
        for (int i = 0; i < 4; i++) {
            const int d = lane + 32 * i;
            if (d < hd) out[(size_t)(r0 + t) * qd + hh * hd + d] = acc[u][i] / l[u];
        }
    }
}

// Decode attention with the q/k norm, RoPE and KV write folded in (one kernel instead of
// two), for steps where every row is its sequence's only new token: the block of (row, head)
// norms and rotates its q head and its group's k head itself, the first head of each group
// writes K/V to the cache, and the current position is read from shared memory (another
// block's cache write may not be visible yet); earlier positions come from the cache.
// With S = gridDim.z > 1 (long contexts), block z takes the z-th of S equal ranges of the
// row's positions and writes its partial to part [rows, nh, S, hd + 2] (attention_merge
// then writes out), so a long context is read by S blocks at once, not one.
// grid: (rows, nh, S); block: 32 * nw; dynamic shared memory: (nw + 3) * hd floats. hd <= 128.
extern "C" __global__ void __launch_bounds__(512, 2) attention_decode(const float* __restrict__ qkv, const float* __restrict__ qn,
                                            const float* __restrict__ kn, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, float* __restrict__ kc,
                                            float* __restrict__ vc, const int* __restrict__ row_pos,
                                            const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                            float* __restrict__ out, int nh, int nkv, int hd,
                                            float eps, float scale, float* __restrict__ part) {
    PDL_ENTRY();
    extern __shared__ float sh[];
    __shared__ float sm[32], sl[32];
    const int r = blockIdx.x, hh = blockIdx.y;
    const int qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
    const int g = hh / group;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    float* sq = sh + nw * hd;
    float* sk = sq + hd;
    float* sv = sk + hd;
    const float* row = qkv + (size_t)r * (qd + 2 * kvd);
    const int pos = row_pos[r];
    const int* tab = blocks + row_tab[r];
    if (w < 2) {
        // warp 0: q head hh; warp 1: k head g (RMSNorm, then rotate-half RoPE)
        const float* v = w == 0 ? row + hh * hd : row + qd + g * hd;
        norm_rope(v, w == 0 ? qn : kn, w == 0 ? sq : sk, cos_t, sin_t, pos, hd, eps);
    } else if (w == 2) {
        for (int i = lane; i < hd; i += 32) sv[i] = row[qd + kvd + g * hd + i];
    }
    __syncthreads();
    if (hh % group == 0 && blockIdx.z == 0) {
        const size_t off = ((size_t)tab[pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK) * kvd + g * hd;
        for (int i = threadIdx.x; i < hd; i += blockDim.x) {
            kc[off + i] = sk[i];
            vc[off + i] = sv[i];
        }
    }
    float qv[4];
    for (int d = 0; d < 4; d++) {
        const int i = lane + 32 * d;
        qv[d] = i < hd ? sq[i] : 0.f;
    }
    const int S = gridDim.z, per = (pos + 1 + S - 1) / S;
    const int lo = min(pos + 1, (int)blockIdx.z * per), hi = min(pos + 1, lo + per);
    attend(qv, kc, vc, tab, pos, lo, hi, kvd, g * hd, hd, scale, sk, sv, sh, sm, sl,
           out + (size_t)r * qd + hh * hd,
           S > 1 ? part + (((size_t)r * nh + hh) * S + blockIdx.z) * (hd + 2) : 0);
}

// out[r, head hh] from the S partials of attention_decode: the softmax-weighted values of
// every range rescaled to the largest score. grid: (rows, nh); block: >= hd threads.
extern "C" __global__ void attention_merge(const float* __restrict__ part, float* __restrict__ out,
                                           int nh, int hd, int S) {
    PDL_ENTRY();
    const int r = blockIdx.x, hh = blockIdx.y, i = threadIdx.x;
    if (i >= hd) return;
    const float* p = part + ((size_t)r * nh + hh) * S * (hd + 2);
    float mx = -INFINITY;
    for (int z = 0; z < S; z++)
        if (p[(size_t)z * (hd + 2) + 1] > 0.f) mx = fmaxf(mx, p[(size_t)z * (hd + 2)]);
    float tot = 0.f, o = 0.f;
    for (int z = 0; z < S; z++) {
        const float* q = p + (size_t)z * (hd + 2);
        if (q[1] > 0.f) {
            const float f = expf(q[0] - mx);
            tot += q[1] * f;
            o += q[2 + i] * f;
        }
    }
    out[(size_t)r * nh * hd + hh * hd + i] = o / tot;
}

// Pick j of a row's top k: lane j keeps it (written at the end, normalised there, with no
// read-back of what was stored), or with k > 32 lane 0 stores it now.
__device__ __forceinline__ void keep_pick(int j, int k, float bv, int bi, float& mine, int& mi,
                                          int* __restrict__ idx, float* __restrict__ wts) {
    const int lane = threadIdx.x & 31;
    if (k <= 32) {
        if (lane == j) {
            mine = bv;
            mi = bi;
        }
    } else if (lane == 0) {
        idx[j] = bi;
        wts[j] = bv;
    }
}

// Router: softmax of each row of logits [rows, E], then its top k (descending, ties to the
// lower expert), renormalised when `norm`. One warp per row (no block barriers: the k
// rounds of argmax are shuffles). With `regs` (E at most 32 * TOPK_REG) the row stays in
// registers; else in dynamic shared memory (E floats): the same arithmetic and picks.
// grid: rows; block: 32.
#define TOPK_REG 16
extern "C" __global__ void route_topk(const float* __restrict__ logits, int* __restrict__ idx,
                                      float* __restrict__ wts, int E, int k, int norm, int regs) {
    PDL_ENTRY();
    extern __shared__ float p[];
    const int r = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + (size_t)r * E;
    float tot = 0.f;
    float mine = 0.f;  // pick `lane` (k <= 32), written once at the end
    int mi = 0;
    if (regs && E <= 32 * TOPK_REG) {
        // the row in registers (lane holds entries lane, lane + 32, ...): one round of loads,
        // then the same arithmetic and the same picks (ties to the lower id) as below
        float v[TOPK_REG];
#pragma unroll
        for (int t = 0; t < TOPK_REG; t++) {
            const int i = lane + 32 * t;
            v[t] = i < E ? row[i] : -INFINITY;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int t = 0; t < TOPK_REG; t++) mx = fmaxf(mx, v[t]);
        mx = warp_max(mx);
        float s = 0.f;
#pragma unroll
        for (int t = 0; t < TOPK_REG; t++) {
            if (lane + 32 * t < E) {
                v[t] = expf(v[t] - mx);
                s += v[t];
            }
        }
        s = warp_sum(s);
        const float inv = 1.f / s;
#pragma unroll
        for (int t = 0; t < TOPK_REG; t++)
            if (lane + 32 * t < E) v[t] *= inv;
        for (int j = 0; j < k; j++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
#pragma unroll
            for (int t = 0; t < TOPK_REG; t++)
                if (v[t] > bv) { bv = v[t]; bi = lane + 32 * t; }
            warp_argmax(bv, bi);
#pragma unroll
            for (int t = 0; t < TOPK_REG; t++)
                if (lane + 32 * t == bi) v[t] = -1.f;
            keep_pick(j, k, bv, bi, mine, mi, idx + r * k, wts + r * k);
            tot += bv;
        }
    } else {
        float mx = -INFINITY;
        for (int i = lane; i < E; i += 32) mx = fmaxf(mx, row[i]);
        mx = warp_max(mx);
        float s = 0.f;
        for (int i = lane; i < E; i += 32) {
            const float e = expf(row[i] - mx);
            p[i] = e;
            s += e;
        }
        s = warp_sum(s);
        const float inv = 1.f / s;
        for (int i = lane; i < E; i += 32) p[i] *= inv;
        __syncwarp();
        for (int j = 0; j < k; j++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int i = lane; i < E; i += 32)
                if (p[i] > bv) { bv = p[i]; bi = i; }
            warp_argmax(bv, bi);
            keep_pick(j, k, bv, bi, mine, mi, idx + r * k, wts + r * k);
            if (lane == 0) p[bi] = -1.f;
            tot += bv;
            __syncwarp();
        }
    }
    if (k <= 32) {
        if (lane < k) {
            idx[r * k + lane] = mi;
            wts[r * k + lane] = norm ? mine / tot : mine;
        }
    } else if (lane == 0 && norm) {
        for (int j = 0; j < k; j++) wts[r * k + j] /= tot;
    }
}

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

// MoE up-projection for all picks of this layer whose expert this GPU holds (table entry
// non-zero): act[s, j] = silu(gate_e[j] . h[row]) * (up_e[j] . h[row]), row = s/k, or rows[s]
// when given (a sidecar's picks name their activation rows). One warp per row j,
// 8 rows per block. grid: (nk, ceil(I/8)). `distinct`: the caller knows every slot's expert
// differs (the picks of one row), so each block leads its slot without checking.
extern "C" __global__ void moe_up(const int* __restrict__ idx, const unsigned long long* __restrict__ gu_tab,
                                  const float* __restrict__ h, float* __restrict__ act,
                                  int nk, int k, int H, int I, int vec4,
                                  const int* __restrict__ rows, int distinct) {
    PDL_ENTRY();
    __shared__ int flag;
    const int s = blockIdx.x;
    const int e = idx[s];
    const float* gu = (const float*)gu_tab[e];
    if (gu == 0 || !(distinct || leads_expert(idx, s, e, &flag))) return;
    const int j = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (j >= I) return;
    const float* g = gu + (size_t)j * H;
    const float* u = gu + (size_t)(j + I) * H;
    const int end = distinct ? s + 1 : nk;
    for (int t0 = s; t0 < end; t0 += 32) {
        unsigned mask = distinct ? 1u : __ballot_sync(0xffffffffu, t0 + lane < nk && idx[t0 + lane] == e);
        while (mask) {
            const int t = t0 + __ffs(mask) - 1;
            mask &= mask - 1;
            const float* x = h + (size_t)(rows ? rows[t] : t / k) * H;
            float sg = 0.f, su = 0.f;
            if (vec4) {
#pragma unroll 4
                for (int i = lane * 4; i < H; i += 128) {
                    const float4 gv = *(const float4*)(g + i);
                    const float4 uv = *(const float4*)(u + i);
                    const float4 xv = *(const float4*)(x + i);
                    sg = fma4(gv, xv, sg);
                    su = fma4(uv, xv, su);
                }
            } else {
                for (int i = lane; i < H; i += 32) {
                    sg = fmaf(g[i], x[i], sg);
                    su = fmaf(u[i], x[i], su);
                }
            }
            sg = warp_sum(sg);
            su = warp_sum(su);
            if (lane == 0) act[(size_t)t * I + j] = sg / (1.f + expf(-sg)) * su;
        }
    }
}

// MoE down-projection: y[s, j] = down_e[j] . act[s], as moe_up. grid: (nk, ceil(H/8)).
// Thread 0 asks the L2 for the 8 down-projection rows of this block's expert before the
// wait: the picks were written two kernels back (the router), whose completion the
// up-projection waited for before it let this kernel launch, so they are final here (a
// sidecar's picks are copied before its up-projection).
__device__ __forceinline__ void prefetch_down_rows(const int* __restrict__ idx,
                                                   const unsigned long long* __restrict__ dn_tab,
                                                   int H, int I) {
    if (threadIdx.x == 0) {
        const float* dn = (const float*)dn_tab[idx[blockIdx.x]];
        const int j0 = blockIdx.y * (blockDim.x >> 5);
        const int rows = min((int)(blockDim.x >> 5), H - j0);
        if (dn != 0 && rows > 0) prefetch_l2(dn + (size_t)j0 * I, (unsigned)((size_t)rows * I * 4));
    }
}

// PRE (moe_down_pre, with vec4): each warp loads the first W_AHEAD float4s per lane of its
// down row into registers before the wait, as gemv_rows (same products, same order); the
// registers this takes cost occupancy, so large batches take moe_down.
template <bool PRE>
__device__ __forceinline__ void moe_down_body(const int* __restrict__ idx,
                                              const unsigned long long* __restrict__ dn_tab,
                                              const float* __restrict__ act, float* __restrict__ y,
                                              int nk, int H, int I, int vec4, int distinct) {
    const int s = blockIdx.x;
    const int j = blockIdx.y * (blockDim.x >> 5) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    float4 wa[W_AHEAD];
    bool pre = false;
    if (PRE) {
        // the picks are final before the wait (see prefetch_down_rows)
        const float* dn = (const float*)dn_tab[idx[s]];
        pre = vec4 && dn != 0 && j < H;
        if (pre) load_ahead(wa, dn + (size_t)j * I, I, lane);
    }
    if (!(PRE && vec4 && I <= 128 * W_AHEAD)) prefetch_down_rows(idx, dn_tab, H, I);
    PDL_ENTRY();
    __shared__ int flag;
    const int e = idx[s];
    const float* dn = (const float*)dn_tab[e];
    if (dn == 0 || !(distinct || leads_expert(idx, s, e, &flag))) return;
    if (j >= H) return;
    const float* d = dn + (size_t)j * I;
    const int end = distinct ? s + 1 : nk;
    for (int t0 = s; t0 < end; t0 += 32) {
        unsigned mask = distinct ? 1u : __ballot_sync(0xffffffffu, t0 + lane < nk && idx[t0 + lane] == e);
        while (mask) {
            const int t = t0 + __ffs(mask) - 1;
            mask &= mask - 1;
            const float* a = act + (size_t)t * I;
            float sum = 0.f;
            if (vec4) {
                int i0 = lane * 4;
                if (PRE && pre) {
                    // the activation row in one round of loads, then the products
                    float4 ar[W_AHEAD];
                    load_row(ar, a, I, lane);
#pragma unroll
                    for (int u = 0; u < W_AHEAD; u++, i0 += 128)
                        if (i0 < I) sum = fma4(wa[u], ar[u], sum);
                }
#pragma unroll 4
                for (int i = i0; i < I; i += 128) {
                    const float4 dv = *(const float4*)(d + i);
                    const float4 av = *(const float4*)(a + i);
                    sum = fma4(dv, av, sum);
                }
            } else {
                for (int i = lane; i < I; i += 32) sum = fmaf(d[i], a[i], sum);
            }
            sum = warp_sum(sum);
            if (lane == 0) y[(size_t)t * H + j] = sum;
        }
    }
}

extern "C" __global__ void moe_down(const int* __restrict__ idx, const unsigned long long* __restrict__ dn_tab,
                                    const float* __restrict__ act, float* __restrict__ y,
                                    int nk, int H, int I, int vec4, int distinct) {
    moe_down_body<false>(idx, dn_tab, act, y, nk, H, I, vec4, distinct);
}

extern "C" __global__ void moe_down_pre(const int* __restrict__ idx, const unsigned long long* __restrict__ dn_tab,
                                        const float* __restrict__ act, float* __restrict__ y,
                                        int nk, int H, int I, int vec4, int distinct) {
    moe_down_body<true>(idx, dn_tab, act, y, nk, H, I, vec4, distinct);
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
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ wts, int k, int H) {
    PDL_ENTRY();
    const int r = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= H) return;
    float acc = 0.f;
    for (int j = 0; j < k; j++) acc += wts[r * k + j] * y[((size_t)r * k + j) * H + c];
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

// out[r] = argmax of logits row r (ties to the lower id). grid: rows.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int* __restrict__ out, int V) {
    PDL_ENTRY();
    __shared__ float red[33];
    __shared__ int redi[33];
    const float* row = logits + (size_t)blockIdx.x * V;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (row[i] > bv) { bv = row[i]; bi = i; }
    block_argmax(bv, bi, red, redi);
    if (threadIdx.x == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0 : bi;
}

// Block-wide sum of doubles (every thread gets it). red: 33 doubles of shared memory.
__device__ double block_sum_d(double v, double* red) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[w] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double t = 0.0;
        for (int k = 0; k < nw; k++) t += red[k];
        red[32] = t;
    }
    __syncthreads();
    return red[32];
}

// Sum of the probabilities p[i] >= tau of one row (block-wide).
__device__ double mass_ge(const float* p, int V, float tau, double* red) {
    double a = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (p[i] >= tau) a += p[i];
    return block_sum_d(a, red);
}

// The largest probability value tau (a float in (0, 1]) whose mass_ge, capped at `cap`
// where tau == `at` (the nucleus keeps only part of the ties at its edge) and at `all`
// below it, still reaches `target`: a binary search over the float bits, 30 steps.
__device__ float edge_value(const float* p, int V, double target, float at, double cap,
                            double all, double* red) {
    unsigned lo = at > 0.f ? __float_as_uint(at) : 1u, hi = 0x3f800000u;
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        const float tau = __uint_as_float(mid);
        double m = mass_ge(p, V, tau, red);
        if (at > 0.f && tau == at) m = cap;
        if (at > 0.f && tau < at) m = all;
        if (m >= target) lo = mid; else hi = mid - 1;
    }
    return __uint_as_float(lo);
}

// The index of the j-th (1-based) element equal to v, in index order; -1 when fewer. Each
// thread scans a contiguous chunk, so a prefix count over threads gives the order.
__device__ int nth_equal(const float* p, int V, float v, int j, int* redi) {
    const int per = (V + blockDim.x - 1) / blockDim.x;
    const int i0 = min(V, threadIdx.x * per), i1 = min(V, i0 + per);
    int c = 0;
    for (int i = i0; i < i1; i++) c += p[i] == v;
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int x = c;  // inclusive scan within the warp
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();
    if (lane == 31) redi[w] = x;
    __syncthreads();
    if (threadIdx.x == 0) {
        int t = 0;
        for (int k = 0; k < nw; k++) { const int y = redi[k]; redi[k] = t; t += y; }
        redi[32] = -1;
    }
    __syncthreads();
    const int before = redi[w] + x - c;  // equal elements before this thread's chunk
    if (before < j && j <= before + c) {
        int k = before;
        for (int i = i0; i < i1; i++)
            if (p[i] == v && ++k == j) { redi[32] = i; break; }
    }
    __syncthreads();
    return redi[32];
}

// Sampling of each logit row on the GPU, with the host sampler's rule (sampling.rs):
// greedy (argmax, ties to the lower id) when the temperature is 0 or not finite; else
// probabilities p = exp((l - max) / t), the nucleus = the most probable tokens (ties by id)
// until their share reaches top_p, and the token where the running mass of the nucleus, in
// that order, reaches u times its total. The order is never sorted: the nucleus edge and the
// drawn token are found by value (binary searches over block-wide sums), ties by index.
// spec: per row (temperature, top_p, u) as doubles; probs: [rows, V] scratch. grid: rows;
// block: 1024.
extern "C" __global__ void sample_rows(const float* __restrict__ logits, const double* __restrict__ spec,
                                       float* __restrict__ probs, int* __restrict__ out, int V) {
    PDL_ENTRY();
    __shared__ float redf[33];
    __shared__ int redi[33];
    __shared__ double redd[33];
    const int r = blockIdx.x;
    const float* l = logits + (size_t)r * V;
    float* p = probs + (size_t)r * V;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (l[i] > bv) { bv = l[i]; bi = i; }
    block_argmax(bv, bi, redf, redi);
    const int greedy = bi == 0x7fffffff ? 0 : bi;
    const double t = spec[3 * r], top_p = spec[3 * r + 1], u = spec[3 * r + 2];
    if (!(t > 0.0) || isinf(t) || bv == -INFINITY) {
        if (threadIdx.x == 0) out[r] = greedy;
        return;
    }
    const float tf = (float)t;
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        float e = expf((l[i] - bv) / tf);
        if (!(e > 0.f)) e = 0.f;
        p[i] = e;
        s += e;
    }
    __syncthreads();
    s = block_sum_d(s, redd);
    if (!(s > 0.0) || isinf(s)) {
        if (threadIdx.x == 0) out[r] = greedy;
        return;
    }
    // the nucleus: every p > edge, and the first `ties` of those equal to it (by id)
    float edge = 0.f;
    int ties = 0x7fffffff;
    double kept = s;
    const double tp = top_p != top_p ? 1.0 : fmax(fmin(top_p, 1.0), 1.17549435e-38);
    if (tp < 1.0) {
        const double target = tp * s;
        edge = edge_value(p, V, target, 0.f, 0.0, 0.0, redd);
        const double above = edge < 1.f ? mass_ge(p, V, __uint_as_float(__float_as_uint(edge) + 1), redd) : 0.0;
        ties = max(1, (int)ceil((target - above) / (double)edge));
        kept = above + (double)ties * edge;
    }
    // the drawn token: the same search inside the nucleus, for u times its mass
    const double target = u * kept;
    const float v = edge_value(p, V, target, edge, kept, kept, redd);
    const double above = v < 1.f ? mass_ge(p, V, __uint_as_float(__float_as_uint(v) + 1), redd) : 0.0;
    int j = max(1, (int)ceil((target - above) / (double)v));
    if (v == edge) j = min(j, ties);
    int tok = nth_equal(p, V, v, j, redi);
    if (tok < 0) tok = nth_equal(p, V, v, 1, redi);  // rounding at the last tie: the first
    if (threadIdx.x == 0) out[r] = tok < 0 ? greedy : tok;
}

// Synthetic weights from a counter hash (the `station` preset): w[i] for i < n, a matrix of
// `cols` columns, zero where col < zero_cols or row < zero_rows, else an Irwin-Hall(4)
// approximate normal times `scale` (already times sqrt(3)). Every operation is exact or a
// single rounding in a fixed order, so the CPU mirror (synth::hashed_fill) gives the same bits.
__device__ __forceinline__ unsigned long long splitmix(unsigned long long z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void gen_weights(float* __restrict__ w, unsigned long long n, int cols,
                                       int zero_cols, int zero_rows, unsigned long long key,
                                       float scale) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned long long row = i / cols, col = i % cols;
        float v = 0.f;
        if (col >= (unsigned long long)zero_cols && row >= (unsigned long long)zero_rows) {
            const unsigned long long a = splitmix(key + 2 * i), b = splitmix(key + 2 * i + 1);
            const float u1 = __uint2float_rn((unsigned)(a >> 40)) * 5.9604645e-8f;
            const float u2 = __uint2float_rn((unsigned)((a >> 8) & 0xffffffu)) * 5.9604645e-8f;
            const float u3 = __uint2float_rn((unsigned)(b >> 40)) * 5.9604645e-8f;
            const float u4 = __uint2float_rn((unsigned)((b >> 8) & 0xffffffu)) * 5.9604645e-8f;
            const float s = __fadd_rn(__fadd_rn(u1, u2), __fadd_rn(u3, u4));
            v = __fmul_rn(__fsub_rn(s, 2.f), scale);
        }
        w[i] = v;
    }
}

// Reads n4 float4s and writes one partial sum per block (the read-bandwidth probe of
// `moelane bench decode`: a decode step mostly reads). grid: any; block: 256.
extern "C" __global__ void read_probe(const float4* __restrict__ a, unsigned long long n4,
                                      float* __restrict__ out) {
    __shared__ float red[33];
    float s = 0.f;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        const float4 v = a[i];
        s += (v.x + v.y) + (v.z + v.w);
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}
