// Normal-mode intranode dispatch: 2C blocks, an even block sends channel c's tokens, an odd block
// receives channel c from every source. Inside a block, warp group g (kWarps / R warps) serves peer g.
// A row travels once: the sender stores it over NVLink into the ring (channel c, source = sender) in
// the receiver's buffer and publishes the ring's tail; the receiver copies it to its final row and
// publishes its head in the sender's buffer. docs/normal_mode.md states the invariants.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "kernels/normal_common.cuh"

namespace pyep {
namespace normal {
namespace {

struct Group {
    int g, wi, W, lane;
    __device__ bool leader() const { return wi == 0 && lane == 0; }
};

// Sender of channel c to peer d. Tokens are routed 32 at a time (one ballot per window); the j-th row
// of a window goes to warp j % W, so rows of one window are written in parallel and the window is
// complete at the group barrier. The tail is published once `chunk` rows are pending, before any wait
// for ring space (else a full ring could wait on rows the receiver was never told about), and at the end.
__device__ void dispatch_send(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                              const Group& G) {
    const int R = s.num_ranks, me = s.rank, d = G.g, Q = a.ring_tokens, K = a.num_topk;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    const int count = prefix_count(reinterpret_cast<const int*>(a.channel_prefix_matrix), a.num_channels, d, c);
    uint8_t* ring = ring_of(s, peer_buf(s, d), c, me, Q, row.bytes);
    int* tail = tail_of(s, peer_buf(s, d), c, me);
    const int* head = head_of(s, reinterpret_cast<uint8_t*>(s.buf), c, d);
    const uint32_t base = (uint32_t)*tx_of(s, c, d);
    const bool* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
    const uint8_t* x = reinterpret_cast<const uint8_t*>(a.x);
    const float* scales = reinterpret_cast<const float*>(a.x_scales);
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk_idx);
    const float* weights = reinterpret_cast<const float*>(a.topk_weights);
    const int groups = a.hidden / 128;

    // Every call starts on an empty ring: the receiver consumed everything sent before.
    bool failed = false;
    if (G.leader() && !wait_counter(head, base, s.timeout_ns)) {
        record_error(s, kErrPeerTimeout, d, kPhaseDispatch, c);
        failed = true;
    }
    if (group_sync_or(G.g, G.W, failed)) return;

    int sent = 0, published = 0;
    for (int wbase = t0; wbase < t1; wbase += kScanWindow) {
        const int t = wbase + G.lane;
        const bool in = t < t1 && in_rank[(int64_t)t * R + d];
        const uint32_t mask = __ballot_sync(0xffffffffu, in);
        const int n = __popc(mask);
        if (n == 0) continue;                       // the same for every warp of the group
        if (sent + n > Q || sent - published >= a.chunk_tokens) {
            if (G.leader() && sent > published) st_release_sys(tail, (int)(base + sent));
            published = sent;
        }
        if (sent + n > Q && G.lane == 0) {          // wait for room: head >= base + sent + n - Q
            if (!wait_counter(head, base + (uint32_t)(sent + n - Q), s.timeout_ns)) {
                record_error(s, kErrPeerTimeout, d, kPhaseDispatch, c);
                failed = true;
            }
        }
        failed = __shfl_sync(0xffffffffu, failed, 0);
        if (!failed) {
            uint32_t rest = mask;
            for (int j = 0; rest; ++j) {
                const int bit = __ffs(rest) - 1;
                rest &= rest - 1;
                if (j % G.W != G.wi) continue;
                const int tok = wbase + bit;
                uint8_t* dst = ring + (uint64_t)((sent + j) % Q) * row.bytes;
                warp_copy(dst, x + (uint64_t)tok * row.payload, row.payload, G.lane);
                if (a.fp8)
                    for (int i = G.lane; i < groups; i += 32)
                        reinterpret_cast<float*>(dst + row.scales)[i] = scales[(int64_t)tok * groups + i];
                if (G.lane < K) {
                    reinterpret_cast<int*>(dst + row.ids)[G.lane] = topk ? (int)topk[(int64_t)tok * K + G.lane] : -1;
                    reinterpret_cast<float*>(dst + row.weights)[G.lane] = weights ? weights[(int64_t)tok * K + G.lane] : 0.f;
                }
                if (G.lane == 0) reinterpret_cast<int*>(dst + row.src)[0] = tok;
            }
        }
        // The window's rows are written, or a warp gave up waiting and the group stops together.
        if (group_sync_or(G.g, G.W, failed)) return;
        sent += n;
    }
    if (G.leader()) {
        if (sent > published) st_release_sys(tail, (int)(base + sent));
        if (sent != count) record_error(s, kErrBadHandle, c, count, sent);
        *tx_of(s, c, d) = (int)(base + count);
    }
}

// Receiver of channel c from source src: rows [start, end) of the output, contiguous in ring order.
__device__ void dispatch_recv(const NormalStatic& s, const DispatchArgs& a, const DispatchRow& row, int c,
                              const Group& G, int* sh_flag) {
    const int R = s.num_ranks, me = s.rank, src = G.g, Q = a.ring_tokens, K = a.num_topk, C = a.num_channels;
    const int* rcp = reinterpret_cast<const int*>(a.recv_channel_prefix_matrix);
    const int* rpm = reinterpret_cast<const int*>(a.rank_prefix_matrix);
    const int start = rcp[src * C + c];
    const int end = c + 1 < C ? rcp[src * C + c + 1] : rpm[src * R + me];
    const int count = end - start;
    uint8_t* own = reinterpret_cast<uint8_t*>(s.buf);
    const uint8_t* ring = ring_of(s, own, c, src, Q, row.bytes);
    const int* tail = tail_of(s, own, c, src);
    int* head = head_of(s, peer_buf(s, src), c, me);
    const uint32_t base = (uint32_t)*rx_of(s, c, src);
    const int El = a.num_local_experts, lo = me * El, groups = a.hidden / 128;
    uint8_t* out_x = reinterpret_cast<uint8_t*>(a.recv_x);
    float* out_scales = reinterpret_cast<float*>(a.recv_x_scales);
    int64_t* out_idx = reinterpret_cast<int64_t*>(a.recv_topk_idx);
    float* out_w = reinterpret_cast<float*>(a.recv_topk_weights);
    int* out_src = reinterpret_cast<int*>(a.recv_src_idx);

    int done = 0;
    while (done < count) {
        if (G.leader()) {
            int avail = -1;
            if (wait_counter(tail, base + (uint32_t)done + 1, s.timeout_ns)) {
                const int published = (int)((uint32_t)ld_acquire_sys(tail) - base);
                avail = min(published, count) - done;
            } else {
                record_error(s, kErrPeerTimeout, src, kPhaseDispatch, c);
            }
            sh_flag[G.g] = avail;
        }
        group_sync(G.g, G.W);
        const int avail = sh_flag[G.g];
        if (avail < 0) return;
        for (int j = G.wi; j < avail; j += G.W) {
            const int i = done + j;
            const int out = start + i;
            if (out >= a.num_out_rows) continue;    // more rows than num_worst_tokens: recorded by notify
            const uint8_t* r = ring + (uint64_t)(i % Q) * row.bytes;
            warp_copy(out_x + (uint64_t)out * row.payload, r, row.payload, G.lane);
            if (a.fp8)
                for (int g = G.lane; g < groups; g += 32)
                    out_scales[(int64_t)out * groups + g] = reinterpret_cast<const float*>(r + row.scales)[g];
            if (out_idx && G.lane < K) {
                const int id = reinterpret_cast<const int*>(r + row.ids)[G.lane];
                const bool local = id >= lo && id < lo + El;
                out_idx[(int64_t)out * K + G.lane] = local ? id - lo : -1;
                if (out_w) out_w[(int64_t)out * K + G.lane] = local ? reinterpret_cast<const float*>(r + row.weights)[G.lane] : 0.f;
            }
            if (out_src && G.lane == 0) out_src[out] = reinterpret_cast<const int*>(r + row.src)[0];
        }
        group_sync(G.g, G.W);                       // every read of these slots is done
        if (G.leader()) st_release_sys(head, (int)(base + done + avail));
        done += avail;
    }
    if (G.leader()) *rx_of(s, c, src) = (int)(base + count);
}

__global__ void __launch_bounds__(kThreads, 1) normal_dispatch_kernel(NormalStatic s, DispatchArgs a) {
    __shared__ int sh_flag[kMaxRanks];
    const int c = blockIdx.x >> 1;
    const bool sender = (blockIdx.x & 1) == 0;
    if (!sender && a.num_worst_tokens > 0 && a.recv_src_idx) {
        // Rows past the real count (num_worst_tokens): no expert, no weight, no source.
        const int rows = reinterpret_cast<const int*>(s.workspace)[0], K = a.num_topk;
        for (int r = rows + c * kThreads + threadIdx.x; r < a.num_out_rows; r += a.num_channels * kThreads) {
            reinterpret_cast<int*>(a.recv_src_idx)[r] = -1;
            for (int k = 0; k < K && a.recv_topk_idx; ++k) {
                reinterpret_cast<int64_t*>(a.recv_topk_idx)[(int64_t)r * K + k] = -1;
                if (a.recv_topk_weights) reinterpret_cast<float*>(a.recv_topk_weights)[(int64_t)r * K + k] = 0.f;
            }
        }
    }
    const int W = kWarps / s.num_ranks, warp = threadIdx.x / 32;
    const Group G{warp / W, warp % W, W, (int)threadIdx.x % 32};
    if (G.g >= s.num_ranks) return;                 // warps left over when R does not divide kWarps
    const DispatchRow row(a.hidden, a.fp8, a.num_topk);
    if (sender) dispatch_send(s, a, row, c, G);
    else dispatch_recv(s, a, row, c, G, sh_flag);
}

}  // namespace

void check_static(const NormalStatic& s);

void launch_dispatch(const NormalStatic& s, const DispatchArgs& a, uint64_t stream) {
    check_static(s);
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal dispatch: " + m); };
    if (a.num_channels < 1 || a.num_channels > kMaxChannels) bad("num_channels must be in [1, 64]");
    if (a.ring_tokens < kScanWindow) bad("the ring must hold at least 32 rows");
    if (a.chunk_tokens < 1) bad("chunk_tokens must be >= 1");
    if (a.hidden < 128 || a.hidden % 128) bad("hidden must be a positive multiple of 128");
    if (a.num_topk < 0 || a.num_topk > kMaxTopk) bad("num_topk must be in [0, 16]");
    if (!a.x || !a.is_token_in_rank || !a.recv_x || (a.fp8 && (!a.x_scales || !a.recv_x_scales))) bad("missing tensor");
    const uint64_t need = (uint64_t)a.num_channels * s.num_ranks * a.ring_tokens * dispatch_row_bytes(a.hidden, a.fp8, a.num_topk);
    if (need > s.ring_capacity)
        bad("the rings need " + std::to_string(need) + " bytes, the buffer has " + std::to_string(s.ring_capacity));
    normal_dispatch_kernel<<<2 * a.num_channels, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(s, a);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) throw std::runtime_error(std::string("normal dispatch launch: ") + cudaGetErrorString(e));
}

}  // namespace normal
}  // namespace pyep
