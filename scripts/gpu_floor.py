#!/usr/bin/env python3
"""The primitives that bound a batch-1 MoE step on one GPU, measured with nothing but the
driver and NVRTC (no moelane binary): HBM read bandwidth from all SMs and from fewer, the time
to read one layer's picked experts from a cold L2, the cost of a grid barrier, of a cluster
barrier (2 to 16 blocks), of a flag handed between two SMs, and the latency of one dependent
L2 and HBM load. docs/PERFORMANCE.md ("GPU, batch 1: the floor") combines them into the
shortest a station layer can take under each schedule.

  python3 scripts/gpu_floor.py [--out DIR]

Runs on the GPU machine (libcuda, libnvrtc.so.13 found by the loader); prints a table and
writes floor.json under --out.
"""
import argparse
import ctypes
import json
import os
import statistics
import sys

SRC = r"""
typedef unsigned long long u64;
__device__ __forceinline__ u64 gtimer() { u64 t; asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t)); return t; }
__device__ __forceinline__ unsigned ld_acq(const unsigned* p) {
    unsigned v; asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory"); return v; }
__device__ __forceinline__ void st_rel(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }
__device__ __forceinline__ void red_rel(unsigned* p, unsigned v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" :: "l"(p), "r"(v) : "memory"); }

// Streams n16 16-byte words from p (each read once, evict-first), every block recording its
// first and last globaltimer. One block per SM (the launch asks for more than half an SM's
// shared memory), 1024 threads, four loads in flight a thread.
extern "C" __global__ void hbm_read(const int4* __restrict__ p, u64 n16, unsigned* sink, u64* span) {
    extern __shared__ int pad[];
    u64 t0 = gtimer();
    int acc = 0;
    const u64 stride = (u64)gridDim.x * blockDim.x;
    u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        int4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride), d = __ldcs(p + i + 3 * stride);
        acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
    }
    for (; i < n16; i += stride) { int4 a = __ldcs(p + i); acc ^= a.x ^ a.y ^ a.z ^ a.w; }
    if (acc == 0x5a5a5a5a) sink[0] = acc + pad[0];
    __syncthreads();
    if (threadIdx.x == 0) { span[2 * blockIdx.x] = t0; span[2 * blockIdx.x + 1] = gtimer(); }
}

// Fills n words with a hash of their index (no constant pages for the reads to meet).
extern "C" __global__ void fill_hash(unsigned* p, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u; x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
        p[i] = x;
    }
}

// `rounds` grid barriers (an arrival counter, thread 0 of each block polling it).
extern "C" __global__ void grid_bar(unsigned* ctr, int rounds, u64* cyc) {
    const u64 c0 = clock64();
    for (int r = 0; r < rounds; r++) {
        __syncthreads();
        if (threadIdx.x == 0) {
            red_rel(ctr, 1);
            const unsigned target = (unsigned)(r + 1) * gridDim.x;
            while (ld_acq(ctr) < target) {}
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) cyc[blockIdx.x] = clock64() - c0;
}

// `rounds` cluster barriers; with `gather`, each block first stores a word into the leader's
// shared memory (distributed shared memory) and the leader reads them after the barrier.
#define CLUSTER_BAR(C)                                                                          \
extern "C" __global__ void __cluster_dims__(C, 1, 1) cl_bar##C(int rounds, int gather, u64* cyc, unsigned* sink) { \
    __shared__ unsigned slot[2][16];                                                            \
    unsigned rank; asm volatile("mov.u32 %0, %cluster_ctarank;" : "=r"(rank));                  \
    const u64 c0 = clock64();                                                                   \
    unsigned acc = 0;                                                                           \
    for (int r = 0; r < rounds; r++) {                                                          \
        if (gather && threadIdx.x == 0) {                                                       \
            unsigned local = (unsigned)__cvta_generic_to_shared(&slot[r & 1][rank]), remote;    \
            asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(remote) : "r"(local));   \
            asm volatile("st.shared::cluster.u32 [%0], %1;" :: "r"(remote), "r"(r + rank) : "memory"); \
        }                                                                                       \
        asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory"); \
        if (gather && rank == 0 && threadIdx.x == 0)                                            \
            for (int j = 0; j < C; j++) acc += ((volatile unsigned*)slot[r & 1])[j];            \
    }                                                                                           \
    if (threadIdx.x == 0) cyc[blockIdx.x] = clock64() - c0;                                     \
    if (acc == 0xdeadbeef) sink[0] = acc;                                                       \
}
CLUSTER_BAR(2)
CLUSTER_BAR(4)
CLUSTER_BAR(8)
CLUSTER_BAR(16)

// Two blocks hand a flag back and forth `rounds` times (release store, acquire poll).
extern "C" __global__ void ping_pong(unsigned* flags, int rounds, u64* cyc) {
    if (threadIdx.x != 0) return;
    unsigned* mine = flags + 64 * blockIdx.x;
    unsigned* other = flags + 64 * (1 - blockIdx.x);
    const u64 c0 = clock64();
    for (unsigned r = 1; r <= (unsigned)rounds; r++) {
        if (blockIdx.x == 0) { st_rel(other, r); while (ld_acq(mine) < r) {} }
        else { while (ld_acq(mine) < r) {} st_rel(other, r); }
    }
    cyc[blockIdx.x] = clock64() - c0;
}

// One thread follows `hops` dependent loads through the L2 (ld.cg) over a cycle in p.
extern "C" __global__ void chase(const unsigned* p, int hops, u64* out) {
    unsigned i = 0;
    const u64 c0 = clock64(), t0 = gtimer();
    for (int h = 0; h < hops; h++) i = __ldcg(p + i);
    const u64 c1 = clock64(), t1 = gtimer();
    out[0] = c1 - c0; out[1] = t1 - t0; out[2] = i;
}
"""

CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14
CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38


class Cuda:
    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.nv = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so.13"))
        self.ok(self.cu.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self.ok(self.cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
        self.dev = dev
        ctx = ctypes.c_void_p()
        self.ok(self.cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.ok(self.cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        name = ctypes.create_string_buffer(128)
        self.ok(self.cu.cuDeviceGetName(name, 128, dev), "cuDeviceGetName")
        self.name = name.value.decode()
        self.sms = self.attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.l2 = self.attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)
        self.mod = self.compile(SRC)

    @staticmethod
    def compile_only(src):
        nv = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so.13"))
        prog = ctypes.c_void_p()
        nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"floor.cu", 0, None, None)
        opts = [b"-arch=sm_90", b"-std=c++17"]
        rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        if rc != 0 or log.value.strip():
            print(log.value.decode())
        if rc != 0:
            raise SystemExit("NVRTC failed")

    def ok(self, rc, what):
        if rc != 0:
            s = ctypes.c_char_p()
            self.cu.cuGetErrorString(rc, ctypes.byref(s))
            raise RuntimeError(f"{what}: CUDA error {rc} ({s.value.decode() if s.value else '?'})")

    def attr(self, a):
        v = ctypes.c_int()
        self.ok(self.cu.cuDeviceGetAttribute(ctypes.byref(v), a, self.dev), "cuDeviceGetAttribute")
        return v.value

    def compile(self, src):
        prog = ctypes.c_void_p()
        if self.nv.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"floor.cu", 0, None, None):
            raise RuntimeError("nvrtcCreateProgram failed")
        opts = [b"-arch=sm_90", b"-std=c++17"]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = self.nv.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        self.nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        self.nv.nvrtcGetProgramLog(prog, log)
        if rc != 0:
            raise RuntimeError("NVRTC: " + log.value.decode())
        self.nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        self.nv.nvrtcGetCUBIN(prog, cubin)
        mod = ctypes.c_void_p()
        self.ok(self.cu.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
        return mod

    def func(self, name):
        f = ctypes.c_void_p()
        self.ok(self.cu.cuModuleGetFunction(ctypes.byref(f), self.mod, name.encode()), name)
        return f

    def alloc(self, n):
        p = ctypes.c_uint64()
        self.ok(self.cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), f"cuMemAlloc({n})")
        return p.value

    def fill(self, p, words, value):
        self.ok(self.cu.cuMemsetD32_v2(ctypes.c_uint64(p), ctypes.c_uint(value), ctypes.c_size_t(words)), "cuMemsetD32")

    def upload(self, p, data):
        self.ok(self.cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), data, ctypes.c_size_t(ctypes.sizeof(data))), "HtoD")

    def download(self, p, ctype, n):
        buf = (ctype * n)()
        self.ok(self.cu.cuMemcpyDtoH_v2(buf, ctypes.c_uint64(p), ctypes.c_size_t(ctypes.sizeof(buf))), "DtoH")
        return list(buf)

    def launch(self, f, grid, block, args, smem=0, cooperative=False):
        holders = [a for a in args]
        ptrs = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        fn = self.cu.cuLaunchCooperativeKernel if cooperative else self.cu.cuLaunchKernel
        if cooperative:
            rc = fn(f, grid, 1, 1, block, 1, 1, smem, None, ptrs)
        else:
            rc = fn(f, grid, 1, 1, block, 1, 1, smem, None, ptrs, None)
        self.ok(rc, "launch")
        self.ok(self.cu.cuCtxSynchronize(), "synchronize")


def u64(v):
    return ctypes.c_uint64(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--layer-expert-bytes", type=float, default=23.6e6,
                    help="bytes of one layer's picked experts (station in bf16: 6 x 3.93 MB)")
    ap.add_argument("--compile-only", action="store_true", help="compile the kernels with NVRTC and stop (no GPU needed)")
    a = ap.parse_args()
    if a.compile_only:
        Cuda.compile_only(SRC)
        print("compiled")
        return 0
    g = Cuda()
    res = {"device": g.name, "sms": g.sms, "l2_bytes": g.l2}
    print(f"device {g.name}: {g.sms} SMs, L2 {g.l2 / 2**20:.0f} MiB")

    # -- HBM: a 4 GiB buffer streamed whole (best of 5), then windows of one layer's expert
    # bytes, each window cold (the windows cycle through the buffer, 80x the L2)
    total = 4 << 30
    buf = g.alloc(total)
    g.launch(g.func("fill_hash"), 4 * g.sms, 1024, [u64(buf), u64(total // 4)])
    sink = g.alloc(64)
    span = g.alloc(16 * 1024)
    hbm = g.func("hbm_read")
    g.ok(g.cu.cuFuncSetAttribute(hbm, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 140 * 1024), "smem attr")

    def stream(nblocks, offset, nbytes):
        g.launch(hbm, nblocks, 1024, [u64(buf + offset), u64(nbytes // 16), u64(sink), u64(span)], smem=140 * 1024)
        s = g.download(span, ctypes.c_uint64, 2 * nblocks)
        return (max(s[1::2]) - min(s[0::2])) * 1e-9

    full = {}
    for n in [g.sms, 96, 64, 32, 16, 8]:
        n = min(n, g.sms)
        best = min(stream(n, 0, total) for _ in range(5))
        full[n] = total / best
        print(f"HBM read, {n:3d} SMs: {full[n] / 1e12:.2f} TB/s")
    res["hbm_read_tbps_by_sms"] = {str(k): v / 1e12 for k, v in full.items()}
    win = int(a.layer_expert_bytes) // 4096 * 4096
    nwin = total // win
    layer = {}
    for n in [g.sms, 96, 64]:
        n = min(n, g.sms)
        ts = [stream(n, (k % nwin) * win, win) for k in range(3 * nwin)]
        layer[n] = statistics.median(ts[nwin:])
        print(f"one layer's experts ({win / 1e6:.1f} MB) from a cold L2, {n:3d} SMs: "
              f"{layer[n] * 1e6:.2f} us (median of {len(ts) - nwin}; {win / layer[n] / 1e12:.2f} TB/s)")
    res["layer_expert_read_us_by_sms"] = {str(k): v * 1e6 for k, v in layer.items()}

    # -- clock: cycles per ns from the chase kernel (one thread, dependent loads)
    cyc = g.alloc(8 * 4096)
    chase = g.func("chase")

    def chase_ns(nbytes, nlines, hops, warm):
        # a random cycle through nlines distinct 128-byte lines of an nbytes buffer: every hop
        # a new line
        import random
        rnd = random.Random(7)
        lines = rnd.sample(range(nbytes // 128), nlines)
        p = g.alloc(nbytes)
        one = ctypes.c_uint()
        for j, ln in enumerate(lines):
            one.value = lines[(j + 1) % nlines] * 32
            g.ok(g.cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p + ln * 128), ctypes.byref(one), ctypes.c_size_t(4)), "HtoD")
        # the chase starts at index 0 of its pointer: make line 0 of the buffer point to the first
        one.value = lines[0] * 32
        if 0 not in lines:
            g.ok(g.cu.cuMemcpyHtoD_v2(ctypes.c_uint64(p), ctypes.byref(one), ctypes.c_size_t(4)), "HtoD")
        if warm:
            g.launch(chase, 1, 1, [u64(p), ctypes.c_int(nlines), u64(cyc)])
        g.launch(chase, 1, 1, [u64(p), ctypes.c_int(hops), u64(cyc)])
        c, t, _ = g.download(cyc, ctypes.c_uint64, 3)
        g.cu.cuMemFree_v2(ctypes.c_uint64(p))
        return c / hops, t / hops

    l2c, l2t = chase_ns(8 << 20, 4096, 20000, True)
    ghz = l2c / l2t
    print(f"one dependent L2 load: {l2c:.0f} cycles, {l2t:.0f} ns (clock {ghz:.2f} GHz)")
    hc, ht = chase_ns(1 << 30, 4096, 4096, False)
    print(f"one dependent HBM load (1 GiB, random lines): {hc:.0f} cycles, {ht:.0f} ns")
    res.update(clock_ghz=ghz, l2_load_ns=l2t, hbm_load_ns=ht)

    # -- grid barrier, one block of 256 a SM, 2000 rounds
    ctr = g.alloc(4096)
    gb = g.func("grid_bar")
    rounds = 2000
    vals = []
    for _ in range(3):
        g.fill(ctr, 1024, 0)
        g.launch(gb, g.sms, 256, [u64(ctr), ctypes.c_int(rounds), u64(cyc)], cooperative=True)
        vals.append(max(g.download(cyc, ctypes.c_uint64, g.sms)) / rounds)
    gbar = min(vals)
    print(f"grid barrier ({g.sms} blocks): {gbar:.0f} cycles, {gbar / ghz / 1000:.2f} us")
    res["grid_barrier_us"] = gbar / ghz / 1000

    # -- cluster barriers
    res["cluster_barrier_us"] = {}
    res["cluster_gather_us"] = {}
    for c in [2, 4, 8, 16]:
        f = g.func(f"cl_bar{c}")
        if c == 16:
            g.ok(g.cu.cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1), "non-portable")
        nblocks = max(c, (g.sms // 2) // c * c)
        for gather in (0, 1):
            vals = []
            for _ in range(3):
                g.launch(f, nblocks, 256, [ctypes.c_int(rounds), ctypes.c_int(gather), u64(cyc), u64(sink)])
                vals.append(statistics.median(g.download(cyc, ctypes.c_uint64, nblocks)) / rounds)
            v = min(vals)
            key = "cluster_gather_us" if gather else "cluster_barrier_us"
            res[key][str(c)] = v / ghz / 1000
            print(f"cluster of {c:2d}: {'gather into the leader + ' if gather else ''}barrier "
                  f"{v:.0f} cycles, {v / ghz / 1000:.3f} us")

    # -- a flag between two SMs, there and back
    pp = g.func("ping_pong")
    vals = []
    for _ in range(3):
        g.fill(ctr, 1024, 0)
        g.launch(pp, 2, 32, [u64(ctr), ctypes.c_int(rounds), u64(cyc)], cooperative=True)
        vals.append(max(g.download(cyc, ctypes.c_uint64, 2)) / rounds / 2)
    hand = min(vals)
    print(f"a flag from one SM to another (release store, acquire poll): {hand:.0f} cycles, "
          f"{hand / ghz / 1000:.3f} us one way")
    res["flag_handoff_us"] = hand / ghz / 1000

    with open(os.path.join(a.out, "floor.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
