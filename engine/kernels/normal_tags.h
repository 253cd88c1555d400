// Call tags of the normal mode's exchanges (pyep/ep/normal/tags.py holds the same layout and explains
// it; docs/normal_mode.md "Call-tagged exchanges"): every rank numbers its exchanging calls on the
// device, and every exchange starts with a tag per rank (generation, call number, kind, shape
// signature, status, reason) so that ranks never pair messages of different calls. Host and device
// functions only (no CUDA headers): tests compile this file with g++.
#pragma once

#include <stdint.h>

#include "mlx5gda/portable.h"

namespace pyep {
namespace normal {

// ---- the tag (int32 words; tags.py encode/decode) --------------------------------------------------
constexpr int kTagMagic = 0x4E544147;   // "NTAG"
constexpr int kTagSigInts = 8;
constexpr int kTagReasonBytes = 128;
constexpr int kTagOffSig = 6, kTagOffReasonLen = kTagOffSig + kTagSigInts, kTagOffReason = 16;
constexpr int kTagInts = kTagOffReason + kTagReasonBytes / 4;
// Word 15: the rank's active-ranks bits at the call (bit r: rank r active; all set without a mask). A
// rank takes the AND of every answering peer's bits (docs/elastic.md, "Normal mode").
constexpr int kTagOffMask = kTagOffReasonLen + 1;
enum TagKind : int { kKindLayout = 1, kKindDispatch = 2, kKindCached = 3, kKindCombine = 4 };
// OK: made; REFUSED: refused on its host; PROXY: void because a rank it exchanged with earlier in this
// call refused (origin names it); NOTICE: written into a peer that is at another call.
enum TagStatus : int { kTagOk = 0, kTagRefused = 1, kTagProxy = 2, kTagNotice = 3 };
// Signature words 6 and 7 are the handle's dispatch (call number, generation) for a cached dispatch
// or a combine, read on the device (a CUDA graph replays the handle of its own dispatch). A void
// dispatch marks its handle with generation kHandleVoid: a call that uses it is void too (on every rank:
// every rank's dispatch was void), by a refusal made on the device.
constexpr int kTagSigHandle = 6;
constexpr int kHandleVoid = -1;

// ---- the device words of a buffer (NormalStatic::workspace / RelayStatic::workspace) -----------------
constexpr int kWsRows = 0;     // rows this rank receives (latest notify)
constexpr int kWsSeq = 1;      // call number of the latest exchanging call (0 after clean())
constexpr int kWsEpoch = 2;    // generation: set by clean() on the host
constexpr int kWsVoid = 3;     // 1 when the latest call is void (a rank refused it, or ranks disagree)
constexpr int kWsClaim = 4;    // first-error-wins claim of the error record (normal_common.cuh)
constexpr int kWsOrigin = 5;   // the rank whose refusal voided the latest call (-1: a call mismatch)
constexpr int kWsMask = 6;     // the latest call's active ranks (bits), set by its gate; a kernel that
                               // marks a peer clears its bit, so the call's other blocks stop waiting

// ---- the tag record (pinned host int32 [kTagRecordInts]) -------------------------------------------
// What a void call leaves for the host, last void wins, written as a seqlock: the details, then (after
// a system fence) the void count, which only grows. The host reads the count, the details and the
// count again (equal: consistent) and raises one error for all calls voided since it last looked.
constexpr int kRecVoids = 0;        // calls voided so far (never reset but by clean())
constexpr int kRecMismatches = 1;   // of them, calls where ranks were at different calls (sticky)
constexpr int kRecKind = 2;         // 1: a peer refused, 2: a call mismatch
constexpr int kRecPeer = 3;         // the peer whose tag decided it (global rank across nodes)
constexpr int kRecCall = 4, kRecEpoch = 5, kRecMyKind = 6;   // this rank's call
constexpr int kRecPeerCall = 7;     // the peer's call number when not in its tag (flags, relay records)
constexpr int kRecTag = 16;         // the peer's tag words (kTagInts)
constexpr int kTagRecordInts = kRecTag + kTagInts;
enum RecordKind : int { kRecRefused = 1, kRecMismatch = 2 };

// ---- call numbers ----------------------------------------------------------------------------------
// +1, skipping 0 (a zeroed slot or flag must never look like a call) by going from 0xffffffff to 2,
// which keeps the parity alternating (slots are chosen by parity).
PYEP_HD uint32_t next_call(uint32_t prev) {
    const uint32_t s = prev + 1u;
    return s == 0u ? 2u : s;
}

// Whether v is the call k (1 or 2) steps before s, or "nothing yet" where s is among the first calls:
// around the wrap the numbers before 2 and 3 are 0xffffffff / 0xfffffffe or 1 / nothing.
PYEP_HD bool call_is_back(uint32_t v, uint32_t s, uint32_t k) {
    const int64_t b = (int64_t)s - (int64_t)k;
    if (b >= 2) return v == (uint32_t)b;
    if (b == 1) return v == 1u || v == 0xffffffffu;
    if (b == 0) return v == 0u || v == 0xfffffffeu;
    return v == 0u;
}

// A peer's two flags (its call numbers, by parity) as seen by a rank at call `seq`: `mine` is the flag
// of seq's parity, `other` the other one. In step, the peer has posted seq (ARRIVED), or not yet: then
// its flags still hold its two calls before seq. Anything else means it is at another call (OTHER).
// Why `other == seq + 1` with `mine != seq` is OTHER too: a peer posts seq + 1 only after seq (release
// order), and the caller reads `other` before `mine` (acquire), so a peer in step shows seq in `mine`.
enum GateState : int { kGateWait = 0, kGateArrived = 1, kGateOther = 2 };
PYEP_HD int gate_classify(uint32_t mine, uint32_t other, uint32_t seq) {
    if (mine == seq) return kGateArrived;
    return call_is_back(mine, seq, 2) && call_is_back(other, seq, 1) ? kGateWait : kGateOther;
}

// Whether call a comes after call b (modulo 2^32, the wrap's skip of 0 included).
PYEP_HD bool call_is_after(uint32_t a, uint32_t b) { return (int32_t)(a - b) > 0; }

// The peer's call number a rank reports when it finds the peer at another call: the later of its two
// flags (the one it posted last). Only a peer that is ahead is told (gate_publish_and_wait says why).
PYEP_HD uint32_t gate_peer_call(uint32_t mine, uint32_t other) { return call_is_after(mine, other) ? mine : other; }

// ---- the relay's count record: one 8-byte word per (sender, receiver) and call ---------------------
// (seq << 32) | generation (3 bits) << 29 | kind (3 bits) << 26 | status (2 bits) << 24 | rows (24 bits);
// a void record (REFUSED / PROXY) carries the refusing rank in the rows field, a NOTICE the sender's call
// number is not carried (the receiver reports it from its own flags). The kind is what tells a combine
// from a dispatch of the same call number where no node gate does (one rank per node). Three bits of the
// generation suffice: clean() zeroes the slots, so only a record in flight across a clean can be stale.
constexpr uint32_t kRecordRowBits = 24;
constexpr uint32_t kRecordMaxRows = (1u << kRecordRowBits) - 1u;
constexpr uint32_t kRecordEpochMask = 7u;
PYEP_HD uint64_t relay_count_record(uint32_t seq, uint32_t epoch, int kind, int status, uint32_t rows) {
    const uint32_t low = ((epoch & kRecordEpochMask) << 29) | (((uint32_t)kind & 7u) << 26) |
                         (((uint32_t)status & 3u) << 24) | (rows & kRecordMaxRows);
    return ((uint64_t)seq << 32) | low;
}
PYEP_HD uint32_t record_seq(uint64_t r) { return (uint32_t)(r >> 32); }
PYEP_HD uint32_t record_epoch(uint64_t r) { return ((uint32_t)r >> 29) & kRecordEpochMask; }
PYEP_HD int record_kind(uint64_t r) { return (int)(((uint32_t)r >> 26) & 7u); }
PYEP_HD int record_status(uint64_t r) { return (int)(((uint32_t)r >> 24) & 3u); }
PYEP_HD uint32_t record_rows(uint64_t r) { return (uint32_t)r & kRecordMaxRows; }

}  // namespace normal
}  // namespace pyep
