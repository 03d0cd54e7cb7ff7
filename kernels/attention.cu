// One head vector (hd floats, one warp): RMSNorm with weight nwt (none when nwt is null: a
// family without q/k norm), then rotate-half RoPE of its first rd dimensions (all of them
// but in a partial-rotary family; tables [max_pos, rd/2]) for position pos, the rest passed
// through, into dst (may be v itself: every read comes before the warp's barrier, every
// write after).
__device__ __forceinline__ void norm_rope(const float* v, const float* __restrict__ nwt,
                                          float* dst, const float* __restrict__ cos_t,
                                          const float* __restrict__ sin_t, int pos, int hd,
                                          int rd, float eps) {
    const int lane = threadIdx.x & 31;
    const bool nrm = nwt != nullptr;
    if (rd == hd) {
        // the whole head rotated: each lane loads its pairs (i, i + hd/2) once
        const int half = hd / 2;
        float sq[4], lo[2], hi[2], glo[2], ghi[2], c[2], sn[2];
#pragma unroll
        for (int t = 0; t < 4; t++) sq[t] = lane + 32 * t < hd ? v[lane + 32 * t] : 0.f;
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int i = lane + 32 * t;
            const bool ok = i < half;
            lo[t] = ok ? v[i] : 0.f;
            hi[t] = ok ? v[i + half] : 0.f;
            glo[t] = ok ? (nrm ? nwt[i] : 1.f) : 0.f;
            ghi[t] = ok ? (nrm ? nwt[i + half] : 1.f) : 0.f;
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
        const float inv = nrm ? 1.f / sqrtf(s / (float)hd + eps) : 1.f;
#pragma unroll
        for (int t = 0; t < 2; t++) {
            const int i = lane + 32 * t;
            if (i < half) {
                const float a = glo[t] * (lo[t] * inv), b = ghi[t] * (hi[t] * inv);
                dst[i] = a * c[t] - b * sn[t];
                dst[i + half] = b * c[t] + a * sn[t];
            }
        }
        return;
    }
    // part of the head rotated: each lane's dimensions i = lane + 32 t, each one's rotation
    // partner, weights and angle, then the same arithmetic
    const int rh = rd / 2;
    float x[4], px[4], g[4], pg[4], c[4], sn[4];
#pragma unroll
    for (int t = 0; t < 4; t++) {
        const int i = lane + 32 * t;
        const bool ok = i < hd, rot = i < rd;
        const int j = i < rh ? i + rh : i - rh, f = i < rh ? i : i - rh;
        x[t] = ok ? v[i] : 0.f;
        g[t] = ok ? (nrm ? nwt[i] : 1.f) : 0.f;
        px[t] = rot ? v[j] : 0.f;
        pg[t] = rot ? (nrm ? nwt[j] : 1.f) : 0.f;
        c[t] = rot ? cos_t[(size_t)pos * rh + f] : 1.f;
        sn[t] = rot ? sin_t[(size_t)pos * rh + f] : 0.f;
    }
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < 4; t++)
        if (lane + 32 * t < hd) s = fmaf(x[t], x[t], s);
    s = warp_sum(s);
    __syncwarp();
    const float inv = nrm ? 1.f / sqrtf(s / (float)hd + eps) : 1.f;
#pragma unroll
    for (int t = 0; t < 4; t++) {
        const int i = lane + 32 * t;
        if (i < hd) {
            const float a = g[t] * (x[t] * inv), b = pg[t] * (px[t] * inv);
            if (i < rh) dst[i] = a * c[t] - b * sn[t];
            else if (i < rd) dst[i] = a * c[t] + b * sn[t];
            else dst[i] = a;
        }
    }
}

// Per row of qkv [rows, q_dim + 2 kv_dim]: RMSNorm of each q and k head, RoPE (rotate-half,
// tables [max_pos, hd/2]), then K and V into the cache. grid: rows; block: 32 * min(nh + nkv, 16).
extern "C" __global__ void qk_rope_kv(float* __restrict__ qkv, const float* __restrict__ qn,
                                      const float* __restrict__ kn, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, const int* __restrict__ row_pos,
                                      const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                      float* __restrict__ kc, float* __restrict__ vc,
                                      int nh, int nkv, int hd, float eps, int rd) {
    PDL_ENTRY();
    const int r = blockIdx.x, w = threadIdx.x >> 5;
    const int qd = nh * hd, kvd = nkv * hd;
    float* row = qkv + (size_t)r * (qd + 2 * kvd);
    const int pos = row_pos[r];
    // a warp per head, in turn when there are more heads than warps
    for (int hh = w; hh < nh + nkv; hh += blockDim.x >> 5) {
        float* v = hh < nh ? row + hh * hd : row + qd + (hh - nh) * hd;
        norm_rope(v, hh < nh ? qn : kn, v, cos_t, sin_t, pos, hd, rd, eps);
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
                       float* sl, float* __restrict__ out, float* __restrict__ part, float sink) {
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
        // a sink logit (gpt_oss) joins the final softmax's sum, not its values; a partial
        // leaves it to attention_merge
        if (part == 0 && !none) mx = fmaxf(mx, sink);
        float tot = part == 0 && !none ? expf(sink - mx) : 0.f;
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

// The first position a row at pos sees: 0, or with a sliding window of `window` positions
// (window > 0) the last window positions, itself included.
__device__ __forceinline__ int first_seen(int pos, int window) {
    return window > 0 ? max(0, pos + 1 - window) : 0;
}

// Causal attention of each row over its sequence's positions first_seen(pos)..=pos, one block
// per (row, head), warps taking positions in turn with an online softmax, merged at the end
// (with head hh's sink logit, sinks[hh], in the sum when sinks is not null). `tiles` is unused
// (the parameters are attention_tiled's). grid: (rows, nh); block: 32 * nw; dynamic shared
// memory: nw * hd floats. hd <= 128.
extern "C" __global__ void attention(const float* __restrict__ qkv, const float* __restrict__ kc,
                                     const float* __restrict__ vc, const int* __restrict__ row_pos,
                                     const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                     const int* __restrict__ tiles, float* __restrict__ out,
                                     int nh, int nkv, int hd, float scale,
                                     const float* __restrict__ sinks, int window) {
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
    attend(qv, kc, vc, tab, pos, first_seen(pos, window), pos + 1, kvd, g * hd, hd, scale, 0, 0,
           sacc, sm, sl, out + (size_t)r * qd + hh * hd, 0, sinks ? sinks[hh] : -INFINITY);
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
    const int* __restrict__ tiles, float* __restrict__ out, int nh, int nkv, int hd, float scale,
    const float* __restrict__ sinks, int window) {
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
    int last = 0, first = 1 << 30;
    for (int t = 0; t < cnt; t++) {
        last = max(last, row_pos[r0 + t]);
        first = min(first, first_seen(row_pos[r0 + t], window));
    }
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
    for (int j0 = first - first % ATT_CHUNK; j0 <= last; j0 += ATT_CHUNK) {
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
            const bool ok = j <= pos && j >= first_seen(pos, window);
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
    // a sink logit joins the sum: rescale to the larger of the running max and the sink
    const float sink = sinks ? sinks[hh] : -INFINITY;
#pragma unroll
    for (int u = 0; u < ATT_TPW; u++) {
        const int t = w * per + u;
        if (t >= cnt) break;
        const float mx = fmaxf(m[u], sink), f = expf(m[u] - mx);
        const float tot = l[u] * f + expf(sink - mx);
        for (int i = 0; i < 4; i++) {
            const int d = lane + 32 * i;
            if (d < hd) out[(size_t)(r0 + t) * qd + hh * hd + d] = acc[u][i] * f / tot;
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
// (row r, head hh, range z of S) of attention_decode, as a block's body: also the
// persistent step's (step_one.cu), which reads qkv after a grid barrier (so no __restrict__
// on it: those loads must not take the read-only path).
__device__ __forceinline__ void decode_head(const float* qkv, const float* __restrict__ qn,
                                            const float* __restrict__ kn, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, float* __restrict__ kc,
                                            float* __restrict__ vc, const int* __restrict__ row_pos,
                                            const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                            float* __restrict__ out, int nh, int nkv, int hd,
                                            float eps, float scale, float* __restrict__ part, int rd,
                                            const float* __restrict__ sinks, int window, int r, int hh,
                                            int z, int S) {
    extern __shared__ float sh[];
    __shared__ float sm[32], sl[32];
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
        norm_rope(v, w == 0 ? qn : kn, w == 0 ? sq : sk, cos_t, sin_t, pos, hd, rd, eps);
    } else if (w == 2) {
        for (int i = lane; i < hd; i += 32) sv[i] = row[qd + kvd + g * hd + i];
    }
    __syncthreads();
    if (hh % group == 0 && z == 0) {
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
    const int first = first_seen(pos, window);
    const int per = (pos + 1 - first + S - 1) / S;
    const int lo = min(pos + 1, first + z * per), hi = min(pos + 1, lo + per);
    attend(qv, kc, vc, tab, pos, lo, hi, kvd, g * hd, hd, scale, sk, sv, sh, sm, sl,
           out + (size_t)r * qd + hh * hd,
           S > 1 ? part + (((size_t)r * nh + hh) * S + z) * (hd + 2) : 0,
           sinks ? sinks[hh] : -INFINITY);
}

extern "C" __global__ void __launch_bounds__(512, 2) attention_decode(const float* __restrict__ qkv, const float* __restrict__ qn,
                                            const float* __restrict__ kn, const float* __restrict__ cos_t,
                                            const float* __restrict__ sin_t, float* __restrict__ kc,
                                            float* __restrict__ vc, const int* __restrict__ row_pos,
                                            const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                            float* __restrict__ out, int nh, int nkv, int hd,
                                            float eps, float scale, float* __restrict__ part, int rd,
                                            const float* __restrict__ sinks, int window) {
    PDL_ENTRY();
    decode_head(qkv, qn, kn, cos_t, sin_t, kc, vc, row_pos, row_tab, blocks, out, nh, nkv, hd, eps,
                scale, part, rd, sinks, window, blockIdx.x, blockIdx.y, blockIdx.z, gridDim.z);
}

// out[r, head hh] from the S partials of attention_decode: the softmax-weighted values of
// every range rescaled to the largest score. grid: (rows, nh); block: >= hd threads.
// Thread i (< hd) of attention_merge's (row r, head hh); `part` is read through the L2
// (__ldcg): the persistent step merges partials other blocks of its grid wrote.
__device__ __forceinline__ void merge_head(const float* part, float* __restrict__ out, int nh, int hd,
                                           int S, const float* __restrict__ sinks, int r, int hh, int i) {
    const float* p = part + ((size_t)r * nh + hh) * S * (hd + 2);
    float mx = -INFINITY;
    for (int z = 0; z < S; z++)
        if (__ldcg(p + (size_t)z * (hd + 2) + 1) > 0.f) mx = fmaxf(mx, __ldcg(p + (size_t)z * (hd + 2)));
    // head hh's sink logit (none: -inf) joins the sum
    const float sink = sinks ? sinks[hh] : -INFINITY;
    mx = fmaxf(mx, sink);
    float tot = expf(sink - mx), o = 0.f;
    for (int z = 0; z < S; z++) {
        const float* q = p + (size_t)z * (hd + 2);
        const float l = __ldcg(q + 1);
        if (l > 0.f) {
            const float f = expf(__ldcg(q) - mx);
            tot += l * f;
            o += __ldcg(q + 2 + i) * f;
        }
    }
    out[(size_t)r * nh * hd + hh * hd + i] = o / tot;
}

extern "C" __global__ void attention_merge(const float* __restrict__ part, float* __restrict__ out,
                                           int nh, int hd, int S, const float* __restrict__ sinks) {
    PDL_ENTRY();
    const int i = threadIdx.x;
    if (i >= hd) return;
    merge_head(part, out, nh, hd, S, sinks, blockIdx.x, blockIdx.y, i);
}
