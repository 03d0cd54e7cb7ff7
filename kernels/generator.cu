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
