// The LL combine's reduce alone, with no protocol around it: for every token, K rows gathered from the
// receive slots (token, k) -- or, for "own" slots, from rows of the expert output x -- weighted, summed in
// fp32 (k ascending, one multiply and one add a term) and written as BF16. It asks what the one-GPU reduce
// can reach and which warp layout reaches it: two "ranks" are two streams of this process, each a grid of
// `blocks` blocks, so two grids of 66 blocks fill an H100 as two ranks under MPS do (ll_combine.cu's
// reduce runs 512 threads a block at 128 registers, one block an SM).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 tools/dev/ll_reduce_rate.cu -o /tmp/ll_reduce_rate && /tmp/ll_reduce_rate
//
// Layouts (one warp an item; lane l takes 16 bytes of each of the item's K rows per column step):
//   item256  -- (token, 256 channels), one 16-byte load per row and lane: the kernel's layout;
//   item512  -- (token, 512 channels), two loads per row and lane (16 in flight for K = 8);
//   two256   -- two item256 items per warp, their loads issued together.
// Each runs at 512 threads a block (as the kernel); item256 also at 1024 (what a kernel of at most 64
// registers could run; item512 spills there). Bytes
// counted: every row read (K x 2H a token) plus the output written (2H a token), per rank.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

#define CHECK(x)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            std::exit(1);                                                                         \
        }                                                                                         \
    } while (0)

constexpr int kK = 8;

struct Rank {
    const uint8_t* slots;   // [T][K_max] slots of msg bytes
    const uint8_t* x;       // own rows: [x_rows][2H]
    const int* src;         // [T][K]: own row index in x, or -1 (the slot in `slots`)
    const float* w;         // [T][K]
    __nv_bfloat16* out;     // [T][H]
    int T, H, k_max, msg;
};

__device__ __forceinline__ int4 ld_row(const void* p) {
    int4 v;
    asm volatile("ld.global.L1::no_allocate.L2::256B.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

__device__ __forceinline__ const uint8_t* row_of(const Rank& r, int t, int k) {
    const int s = __ldg(r.src + t * kK + k);
    return s >= 0 ? r.x + (size_t)s * 2 * r.H : r.slots + ((size_t)t * r.k_max + k) * r.msg;
}

__device__ __forceinline__ void add_row(float* acc, int4 y, float w) {
    const uint32_t v[4] = {(uint32_t)y.x, (uint32_t)y.y, (uint32_t)y.z, (uint32_t)y.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) {
        acc[2 * q] = __fadd_rn(acc[2 * q], __fmul_rn(w, lo(v[q])));
        acc[2 * q + 1] = __fadd_rn(acc[2 * q + 1], __fmul_rn(w, hi(v[q])));
    }
}

__device__ __forceinline__ void store(const Rank& r, int t, int col, const float* acc) {
    int4 o;
    uint32_t* ow = reinterpret_cast<uint32_t*>(&o);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
        ow[j] = *reinterpret_cast<const uint32_t*>(&b);
    }
    *reinterpret_cast<int4*>(reinterpret_cast<uint8_t*>(r.out) + ((size_t)t * (r.H / 8) + col) * 16) = o;
}

// Item `it`'s token and first column, or false past the end.
__device__ __forceinline__ bool item_at(long it, long items, int chunks, int per_item, int& t, int& c0) {
    if (it >= items) return false;
    t = (int)(it / chunks);
    c0 = (int)(it % chunks) * per_item;
    return true;
}

// kCols 16-byte columns per lane and row in one item; kItems items per warp step.
template <int kCols, int kItems, int kThreads>
__global__ void __launch_bounds__(kThreads, 1) reduce(Rank r) {
    const int lane = threadIdx.x & 31, warps = kThreads / 32, warp = threadIdx.x >> 5;
    const int cols = r.H / 8, per_item = 32 * kCols;
    const int chunks = (cols + per_item - 1) / per_item;
    const long items = (long)r.T * chunks;
    const long stride = (long)gridDim.x * warps * kItems;
    for (long base = ((long)blockIdx.x * warps + warp) * kItems; base < items; base += stride) {
        int4 y[kItems][kK][kCols];
        float w[kItems][kK];
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
            int t, c0;
            if (!item_at(base + i, items, chunks, per_item, t, c0)) continue;
#pragma unroll
            for (int k = 0; k < kK; ++k) {
                const uint8_t* row = row_of(r, t, k);
                w[i][k] = __ldg(r.w + t * kK + k);
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    const int col = c0 + c * 32 + lane;
                    if (col < cols) y[i][k][c] = ld_row(row + (size_t)col * 16);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
            int t, c0;
            if (!item_at(base + i, items, chunks, per_item, t, c0)) continue;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                const int col = c0 + c * 32 + lane;
                if (col >= cols) continue;
                float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
                for (int k = 0; k < kK; ++k) add_row(acc, y[i][k][c], w[i][k]);
                store(r, t, col, acc);
            }
        }
    }
}

struct Variant {
    const char* name;
    void (*kernel)(Rank);
    int threads;
};

// Two ranks' reduces at once, one stream each; median microseconds of `iters` runs.
float time_pair(const Variant& v, const Rank* ranks, int blocks, int smem, cudaStream_t* st, int iters) {
    cudaEvent_t a, b, d;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    CHECK(cudaEventCreate(&d));
    std::vector<float> us;
    for (int i = 0; i < iters + 2; ++i) {
        CHECK(cudaEventRecord(a, st[0]));
        CHECK(cudaStreamWaitEvent(st[1], a, 0));
        for (int j = 0; j < 2; ++j) v.kernel<<<blocks, v.threads, smem, st[j]>>>(ranks[j]);
        CHECK(cudaEventRecord(d, st[1]));
        CHECK(cudaStreamWaitEvent(st[0], d, 0));
        CHECK(cudaEventRecord(b, st[0]));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        if (i >= 2) us.push_back(ms * 1000.0f);
    }
    CHECK(cudaGetLastError());
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
}

}  // namespace

int main() {
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int H = 7168, k_max = 16, msg = ((2 * H + 16 + 127) / 128) * 128, E_l = 144, R = 2;
    const Variant variants[] = {
        {"item256 x512", reduce<1, 1, 512>, 512},   {"item512 x512", reduce<2, 1, 512>, 512},
        {"two256 x512", reduce<1, 2, 512>, 512},    {"item256 x1024", reduce<1, 1, 1024>, 1024},
    };
    // One block an SM, as the kernel's 128 registers a thread make it: each block asks for more than
    // half of an SM's shared memory (which it does not use).
    const int smem = 120 * 1024;
    for (const auto& v : variants)
        CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

    // The copy rate of this GPU (read + write bytes), for scale.
    {
        const size_t n = 256u << 20;
        void *p, *q;
        CHECK(cudaMalloc(&p, n));
        CHECK(cudaMalloc(&q, n));
        cudaEvent_t a, b;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&b));
        CHECK(cudaMemcpy(q, p, n, cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(a));
        for (int i = 0; i < 10; ++i) CHECK(cudaMemcpyAsync(q, p, n, cudaMemcpyDeviceToDevice));
        CHECK(cudaEventRecord(b));
        CHECK(cudaEventSynchronize(b));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, a, b));
        std::printf("copy rate: %.0f GB/s (read + write, 256 MB device to device)\n", 2.0 * n * 10 / (ms * 1e6));
        CHECK(cudaFree(p));
        CHECK(cudaFree(q));
    }

    cudaStream_t st[2];
    for (auto& s : st) CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    std::mt19937 gen(1);
    std::printf("%-5s %-4s %-15s %-7s %9s %13s %13s\n", "T", "own", "layout", "blocks", "us", "GB/s a rank",
                "TB/s both");
    for (int T : {128, 256}) {
        for (int own : {0, 1}) {
            Rank ranks[2];
            std::vector<void*> bufs;
            for (int j = 0; j < 2; ++j) {
                const int x_rows = E_l * R * T;
                uint8_t *slots, *x;
                int* src;
                float* w;
                __nv_bfloat16* out;
                CHECK(cudaMalloc(&slots, (size_t)T * k_max * msg));
                CHECK(cudaMalloc(&x, (size_t)x_rows * 2 * H));
                CHECK(cudaMalloc(&src, (size_t)T * kK * 4));
                CHECK(cudaMalloc(&w, (size_t)T * kK * 4));
                CHECK(cudaMalloc(&out, (size_t)T * H * 2));
                CHECK(cudaMemset(slots, 0x3c, (size_t)T * k_max * msg));
                CHECK(cudaMemset(x, 0x3c, (size_t)x_rows * 2 * H));
                // Half of a token's experts are this rank's (uniform routing over 2 ranks): with own rows
                // those come from x at rows spread as the dispatch packs them (expert-major).
                std::vector<int> h_src((size_t)T * kK);
                std::vector<float> h_w((size_t)T * kK, 0.125f);
                std::uniform_int_distribution<int> pick(0, x_rows - 1);
                for (int t = 0; t < T; ++t)
                    for (int k = 0; k < kK; ++k) h_src[t * kK + k] = own && (gen() & 1) ? pick(gen) : -1;
                CHECK(cudaMemcpy(src, h_src.data(), h_src.size() * 4, cudaMemcpyHostToDevice));
                CHECK(cudaMemcpy(w, h_w.data(), h_w.size() * 4, cudaMemcpyHostToDevice));
                ranks[j] = Rank{slots, x, src, w, out, T, H, k_max, msg};
                bufs.insert(bufs.end(), {slots, x, src, w, out});
            }
            const double bytes = (double)T * (kK + 1) * 2 * H;   // per rank
            for (const auto& v : variants) {
                for (int blocks : {sms / 2, sms}) {
                    for (const Rank& r : ranks) CHECK(cudaMemset(r.out, 0, (size_t)T * H * 2));
                    const float us = time_pair(v, ranks, blocks, smem, st, 20);
                    // Every row holds 0x3c3c (bf16 0.01147...) and the 8 weights are 1/8: every output
                    // element is that value again, exactly -- and 0 where a layout missed a column.
                    std::vector<uint16_t> h_out((size_t)T * H);
                    CHECK(cudaMemcpy(h_out.data(), ranks[1].out, h_out.size() * 2, cudaMemcpyDeviceToHost));
                    const long bad = std::count_if(h_out.begin(), h_out.end(), [](uint16_t u) { return u != 0x3c3c; });
                    if (bad) std::printf("%s: %ld of %zu outputs wrong\n", v.name, bad, h_out.size());
                    std::printf("%-5d %-4d %-15s %-7d %9.1f %13.0f %13.2f\n", T, own, v.name, blocks, us,
                                bytes / (us * 1e3), 2 * bytes / (us * 1e6));
                }
            }
            for (void* p : bufs) CHECK(cudaFree(p));
        }
    }
    return 0;
}
