// The device mailbox between a primary and a sidecar (the `ipc` link): buffers of each
// process opened by the other through CUDA IPC, flags written with release and read with
// acquire semantics at system scope, so that one step's exchanges need no host call per
// layer on either side. Layouts (byte offsets set by the host, `crate::cuda_link`):
//
// request box, the sidecar's memory, written by the primary (u64 words):
//   [0] the step's sequence number (raised last), [1] rows, [2] map epoch, [3] engine step,
//   [8 + ml] MoE layer ml's flag, raised after its data: the round's tag, (seq << 16) |
//   round (a step of more rows than the box holds goes in rounds of at most that many);
//   at idx_off the round's picks [rows * k] (int), at h_off its normed rows [rows * H].
// reply box, the primary's memory, written by the sidecar:
//   [ml] (tag << 8) | code (0: done; else the sidecar's error code);
//   at mark_off one word per pick slot of the round, (tag << 12) | ml where the sidecar
//   wrote that slot's row; at y_off one output row of H per pick slot (only the slots the
//   sidecar computed).
// primary meta (its own memory): [0] seq [1] rows [2] epoch [3] step [4] the longest a
//   wait may spin (ns) [5] status (0, or (layer + 1) << 16 | code of the first failure)
//   [8 + ml] nanoseconds the primary spun on layer ml's reply, summed.
// sidecar meta: [0] the seq being served [1] the longest a wait may spin (ns)
//   [2] status: 0, a code the host set for the primary to see (epoch, failure), or one
//   that stops the program without touching the primary's memory (its own wait ran out,
//   LINK_PEER_FAILED, or the host cancelled, LINK_CANCELLED: the primary has failed the
//   step or is gone, and its box may be freed).

typedef unsigned long long u64;

#define LINK_TIMED_OUT 0xFFull
#define LINK_PEER_FAILED 0xFEull
#define LINK_NOT_COMPUTED 0xFDull
#define LINK_CANCELLED 0xFCull

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ u64 ld_volatile(const u64* p) { return *(volatile const u64*)p; }

// Launched as a programmatic dependent: waits for the kernel before it (its writes
// visible), then lets the next one be scheduled. A no-op when launched without it.
__device__ __forceinline__ void pdl_entry() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Primary, at the start of a step: the step's head into the sidecar's box, then its flag.
extern "C" __global__ void link_post_step(u64* box, const u64* meta) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        box[1] = meta[1];
        box[2] = meta[2];
        box[3] = meta[3];
        __threadfence_system();
        st_release_sys(box, meta[0]);
    }
}

// Primary, after layer ml's router: its picks (nk ints) and normed rows (nh floats) into the
// box; the last block to finish raises the layer's flag. `done` is a counter at 0 between
// launches (the last block sets it back).
extern "C" __global__ void link_post(u64* box, int ml, const int* __restrict__ idx, int nk,
                                     const float* __restrict__ h, int nh, long long idx_off,
                                     long long h_off, const u64* meta, unsigned* done,
                                     int round) {
    pdl_entry();
    int* bi = (int*)((char*)box + idx_off);
    float* bh = (float*)((char*)box + h_off);
    const int tid = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (int i = tid; i < nk; i += stride) bi[i] = idx[i];
    const int n4 = (nh & 3) == 0 ? nh >> 2 : 0;
    for (int i = tid; i < n4; i += stride) ((float4*)bh)[i] = ((const float4*)h)[i];
    for (int i = 4 * n4 + tid; i < nh; i += stride) bh[i] = h[i];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned prev = atomicAdd(done, 1u);
        if (prev == gridDim.x - 1) {
            *done = 0;
            __threadfence_system();
            st_release_sys(box + 8 + ml, (meta[0] << 16) | (u64)round);
        }
    }
}

// Primary, before layer ml's combine: waits for the sidecar's reply (or the bound, or an
// earlier failure), adds the spin to the layer's counter (block 0), and copies the reply's
// rows into the pick slots this GPU did not compute (its expert table's entry is null).
// grid: up to 32 blocks over the nk slots (few blocks spin: on one GPU the sidecar's
// kernels need the rest).
extern "C" __global__ void link_join(const u64* reply, int ml, u64* meta, const float* cold_y,
                                     float* y, const int* __restrict__ idx,
                                     const u64* __restrict__ gu_tab, int H, const u64* mark,
                                     int nk, int round) {
    __shared__ int ok;
    const u64 seq = (meta[0] << 16) | (u64)round;
    if (threadIdx.x == 0) {
        const u64 limit = meta[4], t0 = now_ns();
        u64 code = 0;
        for (;;) {
            const u64 w = ld_acquire_sys(reply + ml);
            if ((w >> 8) == seq) {
                code = w & 0xff;
                break;
            }
            if (ld_volatile(meta + 5) != 0) {
                code = 0x100;  // an earlier layer failed: this one is not waited for
                break;
            }
            if (now_ns() - t0 > limit) {
                code = LINK_TIMED_OUT;
                break;
            }
        }
        if (blockIdx.x == 0) atomicAdd(meta + 8 + ml, now_ns() - t0);
        if (code != 0 && code != 0x100) atomicCAS(meta + 5, 0ull, ((u64)(ml + 1) << 16) | code);
        ok = code == 0;
    }
    __syncthreads();
    if (!ok) return;
    const u64 want = (seq << 12) | (u64)ml;
    for (int s = blockIdx.x; s < nk; s += gridDim.x) {
        if (gu_tab[idx[s]] != 0) continue;
        if (mark[s] != want) {
            // the sidecar did not compute this slot: the two maps disagree
            if (threadIdx.x == 0) atomicCAS(meta + 5, 0ull, ((u64)(ml + 1) << 16) | LINK_NOT_COMPUTED);
            continue;
        }
        const float* src = cold_y + (size_t)s * H;
        float* dst = y + (size_t)s * H;
        for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
    }
}

// Sidecar, before layer ml's experts: waits until the primary raised the layer's flag with
// the sequence number being served (or the bound, or an earlier failure: then the status
// says so and the reply carries it).
extern "C" __global__ void link_wait(const u64* box, int ml, u64* smeta, int round) {
    if (threadIdx.x == 0 && blockIdx.x == 0) {
        const u64 seq = (smeta[0] << 16) | (u64)round, limit = smeta[1], t0 = now_ns();
        while (ld_acquire_sys(box + 8 + ml) != seq) {
            if (ld_volatile(smeta + 2) != 0) return;
            if (now_ns() - t0 > limit) {
                atomicCAS(smeta + 2, 0ull, ((u64)(ml + 1) << 16) | LINK_PEER_FAILED);
                return;
            }
        }
    }
}

// Sidecar, after layer ml's experts: copies the rows of the slots it computed (its table's
// entry non-null) into the primary's reply rows, then the last block raises the reply word
// with the status's code. grid: one block per pick slot; `done` as in link_post.
extern "C" __global__ void link_reply(u64* reply, int ml, const u64* smeta, const float* y,
                                      float* peer_y, const int* __restrict__ idx,
                                      const u64* __restrict__ gu_tab, int H, unsigned* done,
                                      u64* mark, int round) {
    pdl_entry();
    const u64 st = ld_volatile(smeta + 2);
    const u64 tag = (smeta[0] << 16) | (u64)round;
    // the primary is not waiting (it failed the step, or is gone): nothing goes there
    if ((st & 0xff) == LINK_PEER_FAILED || (st & 0xff) == LINK_CANCELLED) return;
    const int s = blockIdx.x;
    if (st == 0 && gu_tab != 0 && gu_tab[idx[s]] != 0) {
        const float* src = y + (size_t)s * H;
        float* dst = peer_y + (size_t)s * H;
        if ((H & 3) == 0) {
            for (int i = threadIdx.x; i < H / 4; i += blockDim.x)
                ((float4*)dst)[i] = ((const float4*)src)[i];
        } else {
            for (int i = threadIdx.x; i < H; i += blockDim.x) dst[i] = src[i];
        }
        if (threadIdx.x == 0) mark[s] = (tag << 12) | (u64)ml;
    }
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned prev = atomicAdd(done, 1u);
        if (prev == gridDim.x - 1) {
            *done = 0;
            __threadfence_system();
            const u64 code = st & 0xff;
            st_release_sys(reply + ml, (tag << 8) | code);
        }
    }
}
