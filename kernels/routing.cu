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

// The softmax and top k of one row of router logits (E at most 32 * TOPK_REG, k at most 32)
// by one warp, the row in registers (lane holds entries lane, lane + 32, ...): k rounds of
// argmax (ties to the lower expert), the picks normalised when `norm`, lane j writing pick
// j once. The row is read through the L2 (__ldcg): the fused router's last block reads
// logits other blocks wrote.
#define TOPK_REG 16
__device__ __forceinline__ void topk_row_regs(const float* __restrict__ row, int* __restrict__ idx,
                                              float* __restrict__ wts, int E, int k, int norm) {
    const int lane = threadIdx.x & 31;
    float tot = 0.f;
    float mine = 0.f;  // pick `lane`, written once at the end
    int mi = 0;
    float v[TOPK_REG];
#pragma unroll
    for (int t = 0; t < TOPK_REG; t++) {
        const int i = lane + 32 * t;
        v[t] = i < E ? __ldcg(row + i) : -INFINITY;
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
        // (bv is never NaN: a NaN never passes the comparison above)
        warp_argmax_fast(bv, bi);
        // a row of NaN logits picks nothing above -inf: stay inside the row
        if (bi >= E) bi = 0;
#pragma unroll
        for (int t = 0; t < TOPK_REG; t++)
            if (lane + 32 * t == bi) v[t] = -1.f;
        if (lane == j) {
            mine = bv;
            mi = bi;
        }
        tot += bv;
    }
    if (lane < k) {
        idx[lane] = mi;
        wts[lane] = norm ? mine / tot : mine;
    }
}

// Router: softmax of each row of logits [rows, E], then its top k (descending, ties to the
// lower expert), renormalised when `norm`. One warp per row (no block barriers: the k
// rounds of argmax are shuffles). With `regs` (E at most 32 * TOPK_REG, k at most 32) the
// row stays in registers (topk_row_regs); else in dynamic shared memory (E floats): the
// same arithmetic and picks. grid: rows; block: 32.
//
// gidx (not null): the grid's last row is a guess, the next MoE layer's router on this
// layer's normed rows (see GpuModel::route): its picks go to gidx and gwts, not to idx.
extern "C" __global__ void route_topk(const float* __restrict__ logits, int* __restrict__ idx,
                                      float* __restrict__ wts, int E, int k, int norm, int regs,
                                      int* __restrict__ gidx, float* __restrict__ gwts) {
    PDL_ENTRY();
    extern __shared__ float p[];
    const int r = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + (size_t)r * E;
    int* oi = idx + r * k;
    float* ow = wts + r * k;
    if (gidx != 0 && r == (int)gridDim.x - 1) {
        oi = gidx;
        ow = gwts;
    }
    if (regs && E <= 32 * TOPK_REG && k <= 32) {
        topk_row_regs(row, oi, ow, E, k, norm);
        return;
    }
    float tot = 0.f;
    float mine = 0.f;  // pick `lane` (k <= 32), written once at the end
    int mi = 0;
    {
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
            if (bi >= E) bi = 0;
            keep_pick(j, k, bv, bi, mine, mi, oi, ow);
            if (lane == 0) p[bi] = -1.f;
            tot += bv;
            __syncwarp();
        }
    }
    if (k <= 32) {
        if (lane < k) {
            oi[lane] = mi;
            ow[lane] = norm ? mine / tot : mine;
        }
    } else if (lane == 0 && norm) {
        for (int j = 0; j < k; j++) ow[j] /= tot;
    }
}

// Sigmoid router (glm4_moe, deepseek_v3), one warp per row of logits [rows, E]: p = sigmoid,
// the choice ranks p + bias (bias null: none) among the experts of the topk_group best of
// n_group equal groups (a group scored by the sum of its two best choice scores; the other
// experts out of the running, -inf, as transformers 5 masks them), k rounds of argmax (ties to the lower
// expert); the weights are the picked p, over their sum + 1e-20 when `norm`, times `scale`.
// The same arithmetic, in the same order, as the CPU's. grid: rows; block: 32; dynamic shared
// memory: 2 E + 2 n_group floats.
extern "C" __global__ void route_sigmoid(const float* __restrict__ logits,
                                         const float* __restrict__ bias, int* __restrict__ idx,
                                         float* __restrict__ wts, int E, int k, int norm,
                                         int n_group, int topk_group, float scale) {
    PDL_ENTRY();
    extern __shared__ float sh[];
    float* p = sh;
    float* q = sh + E;
    float* gs = q + E;
    float* keep = gs + n_group;
    const int r = blockIdx.x, lane = threadIdx.x;
    const float* row = logits + (size_t)r * E;
    for (int i = lane; i < E; i += 32) {
        const float s = 1.f / (1.f + expf(-row[i]));
        p[i] = s;
        q[i] = s + (bias ? bias[i] : 0.f);
    }
    __syncwarp();
    if (n_group > 1 && topk_group < n_group) {
        const int per = E / n_group;
        for (int g = lane; g < n_group; g += 32) {
            float a = -INFINITY, b = -INFINITY;
            for (int i = g * per; i < (g + 1) * per; i++) {
                const float x = q[i];
                if (x > a) { b = a; a = x; }
                else if (x > b) b = x;
            }
            gs[g] = a + b;
            keep[g] = 0.f;
        }
        __syncwarp();
        for (int j = 0; j < topk_group; j++) {
            float bv = -INFINITY;
            int bi = 0x7fffffff;
            for (int g = lane; g < n_group; g += 32)
                if (gs[g] > bv) { bv = gs[g]; bi = g; }
            warp_argmax(bv, bi);
            // NaN scores leave no group above -inf: keep inside the groups
            if (bi >= n_group) bi = 0;
            if (lane == 0) { keep[bi] = 1.f; gs[bi] = -INFINITY; }
            __syncwarp();
        }
        for (int i = lane; i < E; i += 32)
            if (keep[i / per] == 0.f) q[i] = -INFINITY;
        __syncwarp();
    }
    float tot = 0.f, mine = 0.f;
    int mi = 0;
    for (int j = 0; j < k; j++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int i = lane; i < E; i += 32)
            if (q[i] > bv) { bv = q[i]; bi = i; }
        warp_argmax(bv, bi);
        // a row of NaN logits picks nothing above -inf: stay inside the row
        if (bi >= E) bi = 0;
        const float w = p[bi];
        keep_pick(j, k, w, bi, mine, mi, idx + r * k, wts + r * k);
        if (lane == 0) q[bi] = -INFINITY;
        tot += w;
        __syncwarp();
    }
    const float den = tot + 1e-20f;
    if (k <= 32) {
        if (lane < k) {
            idx[r * k + lane] = mi;
            wts[r * k + lane] = (norm ? mine / den : mine) * scale;
        }
    } else if (lane == 0) {
        for (int j = 0; j < k; j++) wts[r * k + j] = (norm ? wts[r * k + j] / den : wts[r * k + j]) * scale;
    }
}
