// Normal mode, before the data moves: the layout kernel (get_dispatch_layout), the per-channel routing
// (send_head, rows per channel) and the count exchange between the ranks of the node (notify), which
// also fills the prefix matrices of the handle and the host-visible received-row counts.
#if !defined(PYEP_LL_CPU_SIM)   // tests/ll_sim/normal_sim.cpp compiles the kernels as host C++
#include <cuda_runtime.h>
#endif

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/normal_gate.cuh"
#include "kernels/normal_pull.cuh"

namespace pyep {
namespace normal {
namespace {

constexpr int kLayoutThreads = 256;
constexpr int kNotifyThreads = 256;
static_assert(kNotifyThreads / 32 >= kMaxRanks, "gate_read_tags: a warp a peer");

// One thread per token: its ranks (a bit mask), per-expert and per-rank counts in shared memory,
// flushed with one atomic per non-zero counter and block. Ids outside [-1, E) count as -1 and are
// recorded (the first one wins), never used as an index.
// With a mask, an inactive rank is left out: its column stays false, its count and its experts' counts 0,
// and the tokens routed to it are counted in `dropped` (docs/elastic.md, "Normal mode").
__global__ void __launch_bounds__(kLayoutThreads) normal_layout_kernel(NormalStatic s, LayoutArgs a) {
    int* counts = reinterpret_cast<int*>(ll::dynamic_smem());   // [E] experts, then [R] ranks, then [R] dropped
    const int E = a.num_experts, R = s.num_ranks, El = E / R, K = a.num_topk;
    const uint32_t on = mask_bits(s);
    for (int i = threadIdx.x; i < E + 2 * R; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk);
    bool* in_rank = reinterpret_cast<bool*>(a.is_token_in_rank);
    for (int t = blockIdx.x * blockDim.x + threadIdx.x; t < a.num_tokens; t += gridDim.x * blockDim.x) {
        uint32_t mask = 0;
        for (int k = 0; k < K; ++k) {
            const int64_t v = topk[(int64_t)t * K + k];
            if (v == -1) continue;
            if (v < -1 || v >= E) {
                record_error(s, kErrExpertId, t, k, (int)v);
                continue;
            }
            if (in_mask(on, (int)(v / El))) atomicAdd(&counts[v], 1);
            mask |= 1u << (int)(v / El);
        }
        for (int r = 0; r < R; ++r) {
            const bool routed = (mask >> r) & 1u, in = routed && in_mask(on, r);
            in_rank[(int64_t)t * R + r] = in;
            if (in) atomicAdd(&counts[E + r], 1);
            else if (routed) atomicAdd(&counts[E + R + r], 1);
        }
    }
    __syncthreads();
    int* per_expert = reinterpret_cast<int*>(a.num_tokens_per_expert);
    int* per_rank = reinterpret_cast<int*>(a.num_tokens_per_rank);
    for (int i = threadIdx.x; i < E + R; i += blockDim.x) {
        if (counts[i]) atomicAdd(i < E ? per_expert + i : per_rank + (i - E), counts[i]);
    }
    for (int r = threadIdx.x; r < R; r += blockDim.x) add_dropped(a.dropped, r, counts[E + R + r]);
}

// Block c, warp d: the positions of channel c's tokens in the stream to rank d (send_head) and the
// stream's row count (stored in channel_prefix_matrix; notify turns the counts into prefixes). Warp 0
// also checks the channel's top-k ids: dispatch may get topk_idx that did not go through the layout
// kernel, and an id outside [-1, E) must be reported, not silently dropped. With check_layout the
// caller's layout tensors are values to check too: warp d compares is_token_in_rank[:, d] with what
// topk_idx says, warp 0 counts the entries per expert for notify to compare with num_tokens_per_expert.
// With a mask, an inactive peer d gets no stream: send_head[:, d] = -1, no rows, and the tokens
// is_token_in_rank routes to it are counted in `dropped` (a layout made with an older mask is accepted:
// its column is ignored, not checked).
__global__ void normal_route_kernel(NormalStatic s, NotifyArgs a) {
    const int c = blockIdx.x, d = threadIdx.x / 32, lane = threadIdx.x % 32, R = s.num_ranks;
    if (d >= R) return;
    int t0, t1;
    channel_range(a.num_tokens, a.num_channels, c, t0, t1);
    const bool* in_rank = reinterpret_cast<const bool*>(a.is_token_in_rank);
    int* send_head = reinterpret_cast<int*>(a.send_head);
    const bool on = in_mask(mask_bits(s), d);
    if (!on) {
        // Dropped: the tokens topk_idx routes to d (the reference backend's count), else -- a cached
        // dispatch has no top-k -- those is_token_in_rank routes to it.
        const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk);
        const int El = a.num_experts > 0 ? a.num_experts / R : 1;
        int n = 0;
        for (int t = t0 + lane; t < t1; t += 32) {
            bool routed = false;
            if (topk) for_valid_ids(topk, t, a.num_topk, a.num_experts, [&](int64_t v) { routed = routed || v / El == d; });
            else routed = in_rank[(int64_t)t * R + d];
            n += routed ? 1 : 0;
            send_head[(int64_t)t * R + d] = -1;
        }
        for (int o = 16; o; o >>= 1) n += __shfl_xor_sync(0xffffffffu, n, o);
        if (lane == 0) add_dropped(a.dropped, d, n);
    }
    const int pos = on ? route_to_peer(in_rank, send_head, R, d, t0, t1, lane) : 0;
    if (lane == 0) reinterpret_cast<int*>(a.channel_prefix_matrix)[d * a.num_channels + c] = pos;
    if (!a.topk) return;
    const int64_t* topk = reinterpret_cast<const int64_t*>(a.topk);
    const int E = a.num_experts, K = a.num_topk, El = E / R;
    if (d == 0)
        check_topk_ids(topk, K, E, t0, t1, lane, [&](int row, int k, int v) { record_error(s, kErrExpertId, row, k, v); });
    if (!a.check_layout) return;
    int* per_expert = reinterpret_cast<int*>(s.layout_scratch);
    for (int t = t0 + lane; t < t1; t += 32) {
        bool wants = false;
        for_valid_ids(topk, t, K, E, [&](int64_t v) {
            wants = wants || v / El == d;
            if (d == 0) atomicAdd(per_expert + v, 1);
        });
        const bool said = in_rank[(int64_t)t * R + d];
        if (on && said != wants) record_error(s, kErrInRank, t, d, said ? 1 : 0);
    }
}

// One block: the call gate (normal_gate.cuh: tags, flags by call parity, the void decision) with this
// rank's counts in the same slots. Each rank writes its counts and tag into every peer's notify slot of
// this call's parity, then the call number as the slot's flag (release, after a system fence); it
// waits for every peer's flag and reads the slots. Parity double-buffering is enough: a rank cannot
// start notify k+2 before every peer has published flag k+1, which each peer does only after it
// finished reading the slots of call k. The call number lives on the device (kWsSeq), not in the launch
// arguments: a CUDA graph replays the same arguments, and every replay must still be a new call.
// gate_only: the gate alone (a cached dispatch, a combine, a call refused on the host).
struct NotifyShared {
    GateShared g;
    int rows_to[kMaxRanks];   // this rank's rows for each peer: the sum over channels, so that the row
                              // layout follows is_token_in_rank alone
};

__global__ void __launch_bounds__(kNotifyThreads) normal_notify_kernel(NormalStatic s, NotifyArgs a) {
    const int R = s.num_ranks, me = s.rank, C = a.num_channels, El = a.gate_only ? 0 : a.num_experts / R;
    int* ws = reinterpret_cast<int*>(s.workspace);
    NotifyShared& sh = block_shared<NotifyShared>();
    GateShared& g = sh.g;
    if (threadIdx.x == 0) gate_begin(s, a, g);
    __syncthreads();
    const int parity = (int)(g.seq & 1u), NI = (int)s.notify_ints;
    const int* per_expert = reinterpret_cast<const int*>(a.num_tokens_per_expert);
    int* cpm = reinterpret_cast<int*>(a.channel_prefix_matrix);
    int* rows_to = sh.rows_to;
    if (threadIdx.x < R && !a.gate_only) {
        int n = 0;
        for (int c = 0; c < C; ++c) n += cpm[threadIdx.x * C + c];
        rows_to[threadIdx.x] = n;
        const int* claimed = reinterpret_cast<const int*>(a.num_tokens_per_rank);
        if (claimed && in_mask(g.mine, threadIdx.x) && claimed[threadIdx.x] != n)
            record_error(s, kErrRankCount, threadIdx.x, claimed[threadIdx.x], n);
    }
    // The caller's per-expert counts: never negative, and (check_layout) what topk_idx says.
    const int* counted = reinterpret_cast<const int*>(s.layout_scratch);
    for (int e = threadIdx.x; e < El * R; e += blockDim.x) {
        if (per_expert[e] < 0) record_error(s, kErrExpertCount, e, per_expert[e], -1);
        else if (a.check_layout && in_mask(g.mine, e / El) && per_expert[e] != counted[e])
            record_error(s, kErrExpertCount, e, per_expert[e], counted[e]);
    }
    __syncthreads();
    // Slot layout (layout.py NOTIFY_INTS): [kMaxRanks] rows per rank, [kMaxChannels] rows per channel
    // for the slot's owner, [kMaxLocalExperts] entries per local expert of the slot's owner, the tag.
    const int fields = a.gate_only ? 0 : kMaxRanks + kMaxChannels + El;
    for (int i = threadIdx.x; i < R * fields; i += blockDim.x) {
        const int d = i / fields, j = i % fields;
        if (d != me && !in_mask(g.mine, d)) continue;   // nothing goes to a rank out of the call
        int v;
        if (j < kMaxRanks) v = j < R ? rows_to[j] : 0;
        else if (j < kMaxRanks + kMaxChannels) v = (j - kMaxRanks) < C ? cpm[d * C + (j - kMaxRanks)] : 0;
        else v = per_expert[d * El + (j - kMaxRanks - kMaxChannels)];
        words(peer_buf(s, d), s.off_notify)[(parity * R + me) * NI + j] = v;
    }
    // Extra words, the same for every peer, after the tag (normal_internode.md).
    const int* extra = reinterpret_cast<const int*>(a.extra);
    for (int i = threadIdx.x; i < R * a.extra_ints; i += blockDim.x) {
        if (i / a.extra_ints != me && !in_mask(g.mine, i / a.extra_ints)) continue;
        words(peer_buf(s, i / a.extra_ints), s.off_notify)[(parity * R + me) * NI + kNotifyExtra + i % a.extra_ints] =
            extra[i % a.extra_ints];
    }
    publish_pull_offer(s, a, parity, g.mine);
    gate_write_tags(s, a, g);
    __syncthreads();
    if (threadIdx.x < R) {
        const int d = threadIdx.x;
        gate_publish_and_wait(s, a, g, d);
        int acc = 0;   // this rank's rows per channel for d -> inclusive prefix
        for (int c = 0; c < C && !a.gate_only; ++c) {
            acc += cpm[d * C + c];
            cpm[d * C + c] = acc;
        }
    }
    __syncthreads();
    fence_acq_rel_sys();
    gate_read_tags(s, g);
    __syncthreads();
    if (threadIdx.x == 0) gate_decide(s, a, g);
    __syncthreads();
    const bool aborted = g.is_void;
    if (threadIdx.x == 0 && a.tag_out) {
        reinterpret_cast<int*>(a.tag_out)[0] = (int)g.seq;
        reinterpret_cast<int*>(a.tag_out)[1] = aborted ? kHandleVoid : (int)g.epoch;
    }
    if (a.gate_only) return;
    // A peer this rank routed rows to but the gate left out (marked, or left out by a peer's tag): its
    // rows are dropped here, as if the route had found it inactive -- no stream, send_head -1.
    for (int d = 0; d < R && !aborted; ++d) {
        if (d == me || !in_mask(g.mine, d) || in_mask(g.cmask, d)) continue;
        if (threadIdx.x == 0) add_dropped(a.dropped, d, rows_to[d]);
        for (int c = threadIdx.x; c < C; c += blockDim.x) cpm[d * C + c] = 0;
        int* send_head = reinterpret_cast<int*>(a.send_head);
        for (int t = threadIdx.x; t < a.num_tokens; t += blockDim.x) send_head[(int64_t)t * R + d] = -1;
    }
    const int* slots = words(reinterpret_cast<uint8_t*>(s.buf), s.off_notify) + parity * R * NI;
    int* host = reinterpret_cast<int*>(s.host_counts);
    // A source out of the call wrote nothing this call (its slots hold an older call's counts): 0 rows.
    const uint32_t cm = g.cmask;
    auto counted_src = [&](int i) { return !aborted && in_mask(cm, i); };
    if (threadIdx.x < R) {
        // Column j of the rank prefix matrix; the row offsets of source j's channels here.
        const int j = threadIdx.x;
        int* rpm = reinterpret_cast<int*>(a.rank_prefix_matrix);
        int acc = 0;
        for (int i = 0; i < R; ++i) {
            acc += counted_src(i) && in_mask(cm, j) ? slots[i * NI + j] : 0;
            rpm[i * R + j] = acc;
        }
        int row = 0;   // counted from the first row of source j (DeepEP's convention)
        int* rcp = reinterpret_cast<int*>(a.recv_channel_prefix_matrix);
        for (int c = 0; c < C; ++c) {
            rcp[j * C + c] = row;
            row += counted_src(j) ? slots[j * NI + kMaxRanks + c] : 0;
        }
    }
    int* extra_out = reinterpret_cast<int*>(a.extra_out);
    for (int i = threadIdx.x; i < R * a.extra_ints; i += blockDim.x)
        extra_out[i] = counted_src(i / a.extra_ints) ? slots[(i / a.extra_ints) * NI + kNotifyExtra + i % a.extra_ints] : 0;
    // Host-visible counts only for a call whose host waits for them (num_worst_tokens == 0): a
    // worst-case-sized call never writes there, so it cannot overwrite the counts of a later call.
    const bool host_waits = a.num_worst_tokens == 0;
    for (int e = threadIdx.x; e < El && host_waits; e += blockDim.x) {
        int n = 0;
        for (int i = 0; i < R; ++i) n += counted_src(i) ? slots[i * NI + kMaxRanks + kMaxChannels + e] : 0;
        host[2 + e] = (n + a.expert_alignment - 1) / a.expert_alignment * a.expert_alignment;
    }
    if (threadIdx.x == 0) {
        int rows = 0;
        for (int i = 0; i < R; ++i) rows += counted_src(i) ? slots[i * NI + me] : 0;
        ws[kWsRows] = rows;
        if (host_waits) host[1] = rows;
        if (a.num_worst_tokens > 0 && rows > a.num_worst_tokens)
            record_error(s, kErrWorstTokens, rows, a.num_worst_tokens, 0);
    }
    __syncthreads();
    if (threadIdx.x == 0 && host_waits) {
        __threadfence_system();
        // The host cleared it before the launch and waits: 1 counts ready, 2 the call is void (the tag
        // record says why).
        *reinterpret_cast<volatile int*>(host) = aborted ? 2 : 1;
    }
}

#if !defined(PYEP_LL_CPU_SIM)
void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
#endif

}  // namespace

// Host checks, plain C++ (the CPU simulation runs them too).
void check_static(const NormalStatic& s) {
    auto bad = [](const std::string& m) { throw std::invalid_argument("normal buffer: " + m); };
    if (s.num_ranks < 1 || s.num_ranks > kMaxRanks) bad("num_ranks must be in [1, 8]");
    if (s.rank < 0 || s.rank >= s.num_ranks) bad("rank outside [0, num_ranks)");
    if (!s.buf || !s.peer_base || !s.err || !s.host_counts || !s.workspace || !s.tag_record || !s.layout_scratch)
        bad("pointers must be set");
    if (s.ring_off % 128 || s.buf % 128) bad("the buffer and its ring offset must be 128-byte aligned");
    if (s.slot_bytes == 0 || s.slot_bytes % 128) bad("slot_bytes must be a positive multiple of 128");
    if (s.pool_hi && (!s.off_direct || s.pool_lo % 128 || s.pool_lo < s.ring_off + s.ring_capacity ||
                      s.pool_hi <= s.pool_lo))
        bad("the output pool must be a 128-byte aligned range past the rings, with its descriptors");
}

uint64_t dispatch_row_bytes(int hidden, int fp8, int num_topk) { return DispatchRow(hidden, fp8, num_topk).bytes; }
uint64_t combine_row_bytes(int hidden, int num_topk) { return CombineRow(hidden, num_topk).bytes; }

void check_rings(const NormalStatic& s, const char* what, int num_channels, int ring_tokens, uint64_t row_bytes,
                 int hidden) {
    auto bad = [what](const std::string& m) { throw std::invalid_argument(std::string(what) + ": " + m); };
    if (num_channels < 1 || num_channels > kMaxChannels) bad("num_channels must be in [1, 64]");
    if (row_bytes > s.slot_bytes)
        bad("a row of hidden " + std::to_string(hidden) + " does not fit the buffer's " + std::to_string(s.slot_bytes) +
            "-byte slots");
    const uint64_t need = (uint64_t)num_channels * s.num_ranks * ring_tokens * s.slot_bytes;
    if (need > s.ring_capacity)
        bad("the rings need " + std::to_string(need) + " bytes, the buffer has " + std::to_string(s.ring_capacity));
}

#if !defined(PYEP_LL_CPU_SIM)

void launch_layout(const NormalStatic& s, const LayoutArgs& a, uint64_t stream) {
    check_static(s);
    if (a.num_experts < s.num_ranks || a.num_experts % s.num_ranks) throw std::invalid_argument("bad num_experts");
    if (a.num_topk < 1 || a.num_topk > kMaxTopk) throw std::invalid_argument("num_topk must be in [1, 16]");
    auto st = reinterpret_cast<cudaStream_t>(stream);
    check(cudaMemsetAsync(reinterpret_cast<void*>(a.num_tokens_per_rank), 0, 4ull * s.num_ranks, st), "memset");
    check(cudaMemsetAsync(reinterpret_cast<void*>(a.num_tokens_per_expert), 0, 4ull * a.num_experts, st), "memset");
    if (a.num_tokens == 0) return;
    const int smem = 4 * (a.num_experts + 2 * s.num_ranks);
    if (smem > 48 * 1024) check(cudaFuncSetAttribute(normal_layout_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                                "cudaFuncSetAttribute(layout)");
    const int blocks = std::min(132, (a.num_tokens + kLayoutThreads - 1) / kLayoutThreads);
    normal_layout_kernel<<<blocks, kLayoutThreads, smem, st>>>(s, a);
    check(cudaGetLastError(), "normal layout launch");
}

void launch_notify(const NormalStatic& s, const NotifyArgs& a, uint64_t stream) {
    check_static(s);
    if (a.reason_len < 0 || a.reason_len > kTagReasonBytes) throw std::invalid_argument("reason_len must be in [0, 128]");
    auto st = reinterpret_cast<cudaStream_t>(stream);
    if (a.gate_only) {
        normal_notify_kernel<<<1, kNotifyThreads, 0, st>>>(s, a);
        check(cudaGetLastError(), "normal gate launch");
        return;
    }
    if (a.num_channels < 1 || a.num_channels > kMaxChannels) throw std::invalid_argument("num_channels must be in [1, 64]");
    if (a.num_experts % s.num_ranks || a.num_experts / s.num_ranks > kMaxLocalExperts)
        throw std::invalid_argument("num_experts must be a multiple of num_ranks with at most 1024 per rank");
    if (a.expert_alignment < 1) throw std::invalid_argument("expert_alignment must be >= 1");
    if ((int)s.notify_ints < kNotifyExtra + std::max(a.extra_ints, 0) || a.extra_ints < 0 || (a.extra_ints && (!a.extra || !a.extra_out)))
        throw std::invalid_argument("notify slot too small for the extra words, or extra pointers missing");
    if (a.check_layout && !a.topk) throw std::invalid_argument("check_layout needs topk_idx");
    if (a.check_layout)   // the route kernel counts topk_idx's entries per expert here
        check(cudaMemsetAsync(reinterpret_cast<void*>(s.layout_scratch), 0, 4ull * a.num_experts, st), "memset");
    normal_route_kernel<<<a.num_channels, 32 * s.num_ranks, 0, st>>>(s, a);
    check(cudaGetLastError(), "normal route launch");
    normal_notify_kernel<<<1, kNotifyThreads, 0, st>>>(s, a);
    check(cudaGetLastError(), "normal notify launch");
}
#endif  // !PYEP_LL_CPU_SIM

}  // namespace normal
}  // namespace pyep
