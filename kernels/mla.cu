// Multi-head latent attention (DeepSeek-V2/V3, Kimi K2), absorbed, on a latent KV cache: a
// position keeps its normed latent (r = kv_lora_rank floats) and its rotated key (rope =
// qk_rope_head_dim floats), shared by every head. A head scores the latent with its query's
// nope part taken through its key rows of kv_b_proj (q_lat = W_uk q_nope, `head_gemv`), adds
// the rotary parts' product, and reads its value from the softmax-weighted latent through its
// value rows (`head_gemv` again). The CPU backend's mla_attention, in the same steps.

// The latents' norms use transformers' fixed eps (q_a_layernorm, kv_a_layernorm).
#define MLA_EPS 1e-6f
// Latent floats a lane keeps in registers (kv_lora_rank <= 32 * MLA_RPL) and rotary dims a
// lane handles (qk_rope_head_dim <= 64): the host checks both.
#define MLA_RPL 16
#define MLA_WARPS 8

// RoPE of one rotary vector v [rope] at pos, in place, by the block's threads: pairs (2i,
// 2i+1) when interleaved (DeepSeek's rope_interleave), else (i, i + rope/2); tables
// [max_pos, rope/2]. Callers sync before and after.
__device__ __forceinline__ void mla_rope(float* v, const float* __restrict__ cos_t,
                                         const float* __restrict__ sin_t, int pos, int rope,
                                         int interleave) {
    const int half = rope / 2;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const int ia = interleave ? 2 * i : i, ib = interleave ? 2 * i + 1 : i + half;
        const float c = cos_t[(size_t)pos * half + i], s = sin_t[(size_t)pos * half + i];
        const float a = v[ia], b = v[ib];
        v[ia] = a * c - b * s;
        v[ib] = b * c + a * s;
    }
}

// Per row: the q bottleneck's RMSNorm in place (tq [rows, q_lora], when tq is not null), then
// the compressed kv row ckv [rows, r + rope]: RMSNorm of its latent, RoPE of its key, both
// into the cache slot of the row's position (kc: [blocks * 16, r + rope]). grid: rows; block:
// 256; shared: r + rope + 33 floats.
extern "C" __global__ void mla_prep(float* __restrict__ tq, const float* __restrict__ qa_norm,
                                    int q_lora, const float* __restrict__ ckv,
                                    const float* __restrict__ kv_norm, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, const int* __restrict__ row_pos,
                                    const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                    float* __restrict__ kc, int r, int rope, int interleave) {
    PDL_ENTRY();
    extern __shared__ float sm[];
    float* red = sm + r + rope;
    const int row = blockIdx.x, cd = r + rope;
    if (tq) {
        float* t = tq + (size_t)row * q_lora;
        const float inv = row_inv_rms(t, q_lora, MLA_EPS, red);
        for (int i = threadIdx.x; i < q_lora; i += blockDim.x) t[i] = qa_norm[i] * (t[i] * inv);
    }
    const float* c = ckv + (size_t)row * cd;
    const float inv = row_inv_rms(c, r, MLA_EPS, red);
    for (int i = threadIdx.x; i < cd; i += blockDim.x) sm[i] = i < r ? kv_norm[i] * (c[i] * inv) : c[i];
    __syncthreads();
    const int pos = row_pos[row];
    mla_rope(sm + r, cos_t, sin_t, pos, rope, interleave);
    __syncthreads();
    const size_t off = ((size_t)blocks[row_tab[row] + pos / KV_BLOCK] * KV_BLOCK + pos % KV_BLOCK) * cd;
    for (int i = threadIdx.x; i < cd; i += blockDim.x) kc[off + i] = sm[i];
}

// y[row, head, j] = sum_c w[head, j, c] * x[row * xs + head * xh + c], j < out, c < in: a
// product per head with the head's own matrix (w: [heads, out, in], the checkpoint's dtype).
// grid: (rows, heads, ceil(out / 8)); block: 256, a warp per output.
template <typename W>
__device__ __forceinline__ void head_gemv_body(const W* __restrict__ w, const float* __restrict__ x,
                                               float* __restrict__ y, int in, int out, int xs,
                                               int xh, int ys) {
    PDL_ENTRY();
    const int row = blockIdx.x, head = blockIdx.y, lane = threadIdx.x & 31;
    const int j = blockIdx.z * 8 + (threadIdx.x >> 5);
    if (j >= out) return;
    const W* wr = w + ((size_t)head * out + j) * in;
    const float* xr = x + (size_t)row * xs + (size_t)head * xh;
    float s = 0.f;
    for (int c = lane; c < in; c += 32) s = fmaf(wload1(wr + c), xr[c], s);
    s = warp_sum(s);
    if (lane == 0) y[(size_t)row * ys + (size_t)head * out + j] = s;
}

extern "C" __global__ void head_gemv(const float* __restrict__ w, const float* __restrict__ x,
                                     float* __restrict__ y, int in, int out, int xs, int xh, int ys) {
    head_gemv_body(w, x, y, in, out, xs, xh, ys);
}

extern "C" __global__ void head_gemv_bf16(const bf16_t* __restrict__ w, const float* __restrict__ x,
                                          float* __restrict__ y, int in, int out, int xs, int xh,
                                          int ys) {
    head_gemv_body(w, x, y, in, out, xs, xh, ys);
}

// One (row, head) of absorbed attention over the row's positions 0..=pos: the score of
// position j is (q_lat . latent_j + rot(q_rope) . key_j) * scale; the output is the
// softmax-weighted sum of the latents, lat [rows, heads, r]. q_lat: [rows, heads, r]; q:
// [rows, heads * qk], the head's rotary part at nope..qk (rotated here for pos). Warps take
// positions in turn with an online softmax (the latent's dims lane + 32 t in registers), then
// merge. grid: (rows, heads); block: 32 * MLA_WARPS; shared: r + rope + MLA_WARPS * (r + 2).
extern "C" __global__ void mla_attend(const float* __restrict__ q_lat, const float* __restrict__ q,
                                      const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                      const float* __restrict__ kc, const int* __restrict__ row_pos,
                                      const int* __restrict__ row_tab, const int* __restrict__ blocks,
                                      float* __restrict__ lat, int heads, int r, int rope, int nope,
                                      int interleave, float scale) {
    PDL_ENTRY();
    extern __shared__ float sm[];
    float* qs = sm;                 // [r + rope]: q_lat, then the rotated q_rope
    float* parts = sm + r + rope;   // per warp: m, l, acc[r]
    const int row = blockIdx.x, head = blockIdx.y;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    const int cd = r + rope, qk = nope + rope, pos = row_pos[row];
    const float* ql = q_lat + ((size_t)row * heads + head) * r;
    const float* qr = q + (size_t)row * heads * qk + (size_t)head * qk + nope;
    for (int i = threadIdx.x; i < cd; i += blockDim.x) qs[i] = i < r ? ql[i] : qr[i - r];
    __syncthreads();
    mla_rope(qs + r, cos_t, sin_t, pos, rope, interleave);
    __syncthreads();
    float qv[MLA_RPL], acc[MLA_RPL];
#pragma unroll
    for (int t = 0; t < MLA_RPL; t++) {
        qv[t] = lane + 32 * t < r ? qs[lane + 32 * t] : 0.f;
        acc[t] = 0.f;
    }
    const float qr0 = lane < rope ? qs[r + lane] : 0.f;
    const float qr1 = lane + 32 < rope ? qs[r + lane + 32] : 0.f;
    const int* tab = blocks + row_tab[row];
    float m = -INFINITY, l = 0.f;
    for (int j = w; j <= pos; j += nw) {
        const float* cj = kc + ((size_t)tab[j / KV_BLOCK] * KV_BLOCK + j % KV_BLOCK) * cd;
        float cv[MLA_RPL];
        float s = 0.f;
#pragma unroll
        for (int t = 0; t < MLA_RPL; t++) {
            cv[t] = lane + 32 * t < r ? cj[lane + 32 * t] : 0.f;
            s = fmaf(qv[t], cv[t], s);
        }
        if (lane < rope) s = fmaf(qr0, cj[r + lane], s);
        if (lane + 32 < rope) s = fmaf(qr1, cj[r + lane + 32], s);
        s = warp_sum(s) * scale;
        const float mn = fmaxf(m, s);
        const float corr = expf(m - mn), p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int t = 0; t < MLA_RPL; t++) acc[t] = fmaf(acc[t], corr, p * cv[t]);
        m = mn;
    }
    float* mine = parts + (size_t)w * (r + 2);
    if (lane == 0) {
        mine[0] = m;
        mine[1] = l;
    }
#pragma unroll
    for (int t = 0; t < MLA_RPL; t++)
        if (lane + 32 * t < r) mine[2 + lane + 32 * t] = acc[t];
    __syncthreads();
    float big = -INFINITY;
    for (int k = 0; k < nw; k++) big = fmaxf(big, parts[(size_t)k * (r + 2)]);
    float tot = 0.f;
    for (int k = 0; k < nw; k++) {
        const float* p = parts + (size_t)k * (r + 2);
        if (p[1] > 0.f) tot += p[1] * expf(p[0] - big);
    }
    float* o = lat + ((size_t)row * heads + head) * r;
    for (int d = threadIdx.x; d < r; d += blockDim.x) {
        float v = 0.f;
        for (int k = 0; k < nw; k++) {
            const float* p = parts + (size_t)k * (r + 2);
            if (p[1] > 0.f) v = fmaf(p[2 + d], expf(p[0] - big), v);
        }
        o[d] = v / tot;
    }
}
