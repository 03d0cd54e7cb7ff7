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

// How many p[i] >= tau in one row (block-wide; exact in a double).
__device__ double count_ge(const float* p, int V, float tau, double* red) {
    double c = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) c += p[i] >= tau ? 1.0 : 0.0;
    return block_sum_d(c, red);
}

// The k-th largest probability (k >= 1): the largest tau in (0, 1] with at least k of p >=
// tau, a binary search over the float bits; 0 when fewer than k are above 0.
__device__ float kth_value(const float* p, int V, int k, double* red) {
    unsigned lo = 1u, hi = 0x3f800000u;
    while (lo < hi) {
        const unsigned mid = lo + (hi - lo + 1) / 2;
        if (count_ge(p, V, __uint_as_float(mid), red) >= (double)k) lo = mid; else hi = mid - 1;
    }
    const float v = __uint_as_float(lo);
    return count_ge(p, V, v, red) >= (double)k ? v : 0.f;
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
// probabilities p = exp((l - max) / t), the top_k most probable (ties by id; all when top_k
// is 0), of those the nucleus = the most probable (ties by id) until their share of the
// top_k's mass reaches top_p, and the token where the running mass of the nucleus, in that
// order, reaches u times its total. The order is never sorted: the top-k edge, the nucleus
// edge and the drawn token are found by value (binary searches over block-wide counts and
// sums), ties by index. spec: per row (temperature, top_p, top_k, u) as doubles; probs:
// [rows, V] scratch. grid: rows; block: 1024.
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
    const double t = spec[4 * r], top_p = spec[4 * r + 1], top_k = spec[4 * r + 2], u = spec[4 * r + 3];
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
    // the top k: every p > kedge, and the first `kties` of those equal to it (by id); its
    // mass `ks`. (k at or past the tokens above 0: no cut, as the host keeps them all.)
    float kedge = 0.f;
    int kties = 0x7fffffff;
    double ks = s;
    if (top_k >= 1.0 && top_k < (double)V) {
        const int k = (int)top_k;
        const float v = kth_value(p, V, k, redd);
        if (v > 0.f) {  // else fewer than k are above 0: all of those are kept
            const float nv = __uint_as_float(__float_as_uint(v) + 1);
            const double n_above = v < 1.f ? count_ge(p, V, nv, redd) : 0.0;
            kedge = v;
            kties = k - (int)n_above;  // >= 1: fewer than k are above v
            ks = (v < 1.f ? mass_ge(p, V, nv, redd) : 0.0) + (double)kties * v;
        }
    }
    // the nucleus (inside the top k): every p > edge, and the first `ties` of those equal to
    // it (by id)
    float edge = kedge;
    int ties = kties;
    double kept = ks;
    const double tp = top_p != top_p ? 1.0 : fmax(fmin(top_p, 1.0), 1.17549435e-38);
    if (tp < 1.0) {
        const double target = tp * ks;
        edge = edge_value(p, V, target, kedge, ks, ks, redd);
        const double above = edge < 1.f ? mass_ge(p, V, __uint_as_float(__float_as_uint(edge) + 1), redd) : 0.0;
        ties = max(1, (int)ceil((target - above) / (double)edge));
        if (edge == kedge) ties = min(ties, kties);
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

