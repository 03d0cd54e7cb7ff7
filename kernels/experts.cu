// Expert FFN for many (token, expert) picks at once: one thread block per pick.
//   out[p] = down_e . (silu(gate_e . x) * (up_e . x)),  x = acts[rows[p]]
// Weights are f32 or bf16 (expert_swiglu_bf16), row-major, as the expert bank holds them:
//   gate_up [2I, H] (rows 0..I gate, I..2I up), down [H, I].
// Each warp computes whole output rows with lane-strided dot products reduced by shuffles,
// so each weight is read once per pick, coalesced. Shared memory holds x (H floats) and
// the activation (I floats).
template <typename W>
__device__ __forceinline__ void expert_swiglu_body(
    const float* __restrict__ acts,
    const int* __restrict__ rows,
    const unsigned long long* __restrict__ gate_up,
    const unsigned long long* __restrict__ down,
    float* __restrict__ out,
    int hidden,
    int inter)
{
    extern __shared__ float sh[];
    float* xs = sh;
    float* a = sh + hidden;
    const int p = blockIdx.x;
    const float* x = acts + (size_t)rows[p] * hidden;
    const W* gu = (const W*)gate_up[p];
    const W* dn = (const W*)down[p];
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) xs[i] = x[i];
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int j = warp; j < inter; j += nw) {
        const W* g = gu + (size_t)j * hidden;
        const W* u = gu + (size_t)(j + inter) * hidden;
        float sg = 0.f, su = 0.f;
        for (int i = lane; i < hidden; i += 32) {
            float xi = xs[i];
            sg = fmaf(wload1(g + i), xi, sg);
            su = fmaf(wload1(u + i), xi, su);
        }
        for (int o = 16; o > 0; o >>= 1) {
            sg += __shfl_xor_sync(0xffffffffu, sg, o);
            su += __shfl_xor_sync(0xffffffffu, su, o);
        }
        if (lane == 0) a[j] = sg / (1.f + expf(-sg)) * su;
    }
    __syncthreads();
    for (int j = warp; j < hidden; j += nw) {
        const W* d = dn + (size_t)j * inter;
        float s = 0.f;
        for (int i = lane; i < inter; i += 32) s = fmaf(wload1(d + i), a[i], s);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) out[(size_t)p * hidden + j] = s;
    }
}

extern "C" __global__ void expert_swiglu(const float* __restrict__ acts, const int* __restrict__ rows,
                                         const unsigned long long* __restrict__ gate_up,
                                         const unsigned long long* __restrict__ down,
                                         float* __restrict__ out, int hidden, int inter) {
    expert_swiglu_body<float>(acts, rows, gate_up, down, out, hidden, inter);
}

extern "C" __global__ void expert_swiglu_bf16(const float* __restrict__ acts, const int* __restrict__ rows,
                                              const unsigned long long* __restrict__ gate_up,
                                              const unsigned long long* __restrict__ down,
                                              float* __restrict__ out, int hidden, int inter) {
    expert_swiglu_body<bf16_t>(acts, rows, gate_up, down, out, hidden, inter);
}
