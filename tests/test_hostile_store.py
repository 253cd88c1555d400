"""Hostile inputs to the store-based control plane (issue 22, item 1): forged, replayed, malformed and
oversized records; counters a forger pushed; a job secret given wrongly. Each case asserts the typed
error (RecordRejected naming the key, ValueError, ...) or the documented behaviour (the record is
refused, logged in the reject log, and changes nothing: docs/elastic.md, "Threat model"), then a
correct round trip."""
from __future__ import annotations

import os
import stat
import struct
import threading
import time
from typing import Any, Callable, List

import pytest

from pyep.ep.control import ControlTimeout, StoreControl, make_control
from pyep.ep.errors import RecordRejected
from pyep.ep.records import (HEADER, MAC_BYTES, SECRET_FILE_VAR, SECRET_VAR, PeerSizeRejected, RecordCodec, RejectLog,
                             read_secret_file, resolve_job_secret, unpack)
from test_elastic_store import SECRET, SHAPE, _client, _master, _threads

OTHER_JOB = b"another-job-secret-with-the-same-store"


def _buffers(master: Any, prefix: str, world: int = 2, **kw: Any) -> List[Any]:
    from pyep.ep.ll import EpBuffer
    args = dict(backend="reference", timeout_us=20_000_000, store_prefix=prefix, rejoin_lead_calls=0,
                job_secret=SECRET, **SHAPE)
    args.update(kw)
    return _threads(world, lambda r: EpBuffer(store=_client(master.port), rank=r, world_size=world, **args))


def _call(buf: Any, call: int, world: int = 2) -> List[int]:
    """One dispatch + combine checked against the reference definition; returns the mask after it."""
    import torch

    from pyep.ep.elastic.drill_rank import _check_dispatch, _expected_combine, _expert, inputs as _inputs
    a = {"T": 8, "H": 128, "E": 6, "K": 3, "seed": 7}
    r = buf.rank
    active = torch.ones(world, dtype=torch.int32)
    x, idx, w = _inputs(a["seed"], call, r, 8, 128, 6, 3)
    recv, cnt, handle, _, _ = buf.dispatch(x, idx, use_fp8=False, active_ranks=active)
    _check_dispatch(a, call, r, world, [True] * world, recv, cnt, handle)
    out, _, _ = buf.combine(_expert(recv, r * (6 // world)), idx, w, handle, active_ranks=active)
    assert torch.equal(out.view(torch.int16), _expected_combine(a, call, r, world, [True] * world).view(torch.int16))
    return [int(v) for v in active.tolist()]


def _round_trip(bufs: List[Any], calls: int = 2) -> None:
    for c in range(calls):
        call = bufs[0].next_call
        assert _threads(len(bufs), lambda r: _call(bufs[r], call, len(bufs)), 120.0) == [[1] * len(bufs)] * len(bufs)


def _wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------- the record format
CODEC = RecordCodec(SECRET)
KEY = "job/x/boot/1/r/1"
GOOD = CODEC.seal(KEY, 1, 1, 1, b"payload")


def _flip_mac(raw: bytes) -> bytes:
    return raw[:-1] + bytes([raw[-1] ^ 1])


MALFORMED = {
    "not-bytes": ("a string", "not a byte string"),
    "empty": (b"", "shorter than any record"),
    "truncated": (GOOD[:HEADER.size + 3], "shorter than any record"),
    "oversized": (GOOD[:HEADER.size] + b"x" * 100 + GOOD[-MAC_BYTES:], "over the bound"),
    "bad-magic": (b"XXXX" + GOOD[4:], "bad magic"),
    "length-lies": (GOOD[:HEADER.size - 4] + struct.pack("<I", 3) + GOOD[HEADER.size:], "declares 3 payload bytes"),
    "mac-flipped": (_flip_mac(GOOD), "authentication failed"),
    "another-jobs-secret": (RecordCodec(OTHER_JOB).seal(KEY, 1, 1, 1, b"payload"), "authentication failed"),
    "moved-from-another-key": (CODEC.seal("job/x/boot/1/r/0", 1, 1, 1, b"payload"), "authentication failed"),
    "other-writer": (CODEC.seal(KEY, 0, 1, 1, b"payload"), "written by rank 0"),
    "dead-generation": (CODEC.seal(KEY, 1, 2, 1, b"payload"), "generation 2"),
    "other-round": (CODEC.seal(KEY, 1, 1, 9, b"payload"), "round 9"),
    "plain-integer": (b"1000", "shorter than any record"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_record_refused_naming_the_key(case: str) -> None:
    raw, why = MALFORMED[case]
    with pytest.raises(RecordRejected, match=why) as info:
        CODEC.open(KEY, raw, 16, writers=[1], generation=1, call=1)
    assert info.value.key == KEY and KEY in str(info.value)
    assert CODEC.open(KEY, GOOD, 16, writers=[1], generation=1, call=1).payload == b"payload"


def test_fixed_size_payload_and_reject_log() -> None:
    rec = CODEC.open(KEY, CODEC.seal(KEY, 1, 1, 1, b"\x01\x02\x03"), 16)
    with pytest.raises(RecordRejected, match="payload of 3 bytes, expected 8"):
        unpack(rec, struct.Struct("<q"))
    assert unpack(CODEC.open(KEY, CODEC.seal(KEY, 1, 1, 1, struct.pack("<q", -5)), 16), struct.Struct("<q")) == (-5,)
    # A wait polls a forged key many times: one entry. The log is bounded.
    log = RejectLog(size=4)
    for _ in range(100):
        log.add(RecordRejected("k", "forged"), b"same bytes")
    assert len(log) == 1 and log.keys() == ["k"]
    for i in range(10):
        log.add(RecordRejected(f"k{i}", "forged"), b"x")
    assert len(log) == 4 and log.keys()[-1] == "k9" and log.total == 11


# ---------------------------------------------------------------------------------------- the job secret
def test_secret_missing_is_a_clear_error(monkeypatch: Any) -> None:
    """No secret: a clear error saying how to give one, never an unauthenticated buffer."""
    from pyep.ep.ll import EpBuffer
    monkeypatch.delenv(SECRET_FILE_VAR, raising=False)
    monkeypatch.delenv(SECRET_VAR, raising=False)
    master = _master()
    with pytest.raises(ValueError, match=f"job_secret=.*{SECRET_FILE_VAR}.*{SECRET_VAR}"):
        EpBuffer(store=master, rank=0, world_size=1, backend="reference", **SHAPE)
    monkeypatch.setenv(SECRET_VAR, SECRET.hex())
    assert StoreControl(master, 0, 1, "t/nosecret").codec.open("k", StoreControl(
        master, 0, 1, "t/nosecret", SECRET).seal("k", b"v"), 1).payload == b"v"


@pytest.mark.parametrize("bad, exc, why", [
    ("a string", TypeError, "must be bytes"), (b"short", ValueError, "16 to 1024 bytes"),
    (b"x" * 2000, ValueError, "16 to 1024 bytes")], ids=["str", "too-short", "too-long"])
def test_secret_argument_checked(bad: Any, exc: type, why: str) -> None:
    with pytest.raises(exc, match=why):
        resolve_job_secret(bad, {})
    assert resolve_job_secret(SECRET, {}) == SECRET


@pytest.mark.parametrize("text", ["not hex at all", "abcd", "\xff\xfe"], ids=["not-hex", "too-short", "not-ascii"])
def test_secret_env_hex_checked(text: str) -> None:
    with pytest.raises(ValueError, match=SECRET_VAR):
        resolve_job_secret(None, {SECRET_VAR: text})
    assert resolve_job_secret(None, {SECRET_VAR: SECRET.hex()}) == SECRET


def _secret_file(tmp_path: Any, mode: int = 0o600, text: str = SECRET.hex()) -> str:
    path = tmp_path / "job.secret"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=["0644", "0640", "0604"])
def test_secret_file_readable_by_others_refused(tmp_path: Any, mode: int) -> None:
    path = _secret_file(tmp_path, mode)
    with pytest.raises(ValueError, match=f"mode {mode:04o} lets others read it"):
        read_secret_file(path)
    os.chmod(path, 0o600)
    assert resolve_job_secret(None, {SECRET_FILE_VAR: path}) == SECRET


def test_secret_file_link_fifo_owner_size_refused(tmp_path: Any) -> None:
    real = _secret_file(tmp_path)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match="cannot open"):
        read_secret_file(str(link))                     # a link planted in place of the file
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="not a regular file"):
        read_secret_file(str(fifo))                     # and no hang waiting for a writer
    big = tmp_path / "big"
    big.write_text("ab" * 10_000)
    big.chmod(0o600)
    with pytest.raises(ValueError, match="more than a job secret"):
        read_secret_file(str(big))
    with pytest.raises(ValueError, match="cannot open"):
        read_secret_file(str(tmp_path / "missing"))
    if os.geteuid() == 0:
        os.chown(real, 4321, -1)
        with pytest.raises(ValueError, match="owned by uid 4321"):
            read_secret_file(real)
        os.chown(real, 0, -1)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o600 and read_secret_file(real) == SECRET


def test_secret_goes_with_a_store_only() -> None:
    with pytest.raises(ValueError, match="job_secret= goes with store="):
        make_control(None, None, None, None, "p", SECRET)
    master = _master()
    assert make_control(None, master, 0, 1, "t/only", SECRET).kind == "store"


# ---------------------------------------------------------------------------------------- set-up exchanges
def test_forged_boot_round_values_are_refused_then_replaced() -> None:
    """Values an attacker placed at the keys of a boot round before the ranks (not JSON, not an int,
    a huge number, another job's record) are refused and logged; the ranks' own writes replace them
    and the round returns the right data."""
    master = _master()
    store = _client(master.port)
    ctl = [StoreControl(_client(master.port), r, 2, "t/boot-forged", SECRET) for r in range(2)]
    forged = {1: b"99999999999999999999999999", 2: b"\xff\xfe not utf-8", 3: b"[" * 5000}
    for rnd, raw in forged.items():
        base = ctl[0].key("boot", rnd, "min")
        store.set(f"{base}/1", raw)
    base = ctl[0].key("boot", 4, "min")
    store.set(f"{base}/1", RecordCodec(OTHER_JOB).seal(f"{base}/1", 1, 1, 4, struct.pack("<q", -7)))
    for rnd in (1, 2, 3, 4):
        base = ctl[0].key("boot", rnd, "min")
        out: List[Any] = [None, None]
        t0 = threading.Thread(target=lambda: out.__setitem__(0, ctl[0].all_min(5, 30.0, "min")), daemon=True)
        t0.start()
        _wait_for(lambda: f"{base}/1" in ctl[0].rejects.keys(), f"rank 0 refused the forged value of round {rnd}")
        out[1] = ctl[1].all_min(3, 30.0, "min")
        t0.join(30)
        assert out == [3, 3]


def test_forged_shared_value_is_replaced_once() -> None:
    master = _master()
    store = _client(master.port)
    ctl = [StoreControl(_client(master.port), r, 2, "t/shared", SECRET) for r in range(2)]
    store.set(ctl[0].key("shared", "fabric"), b"\x01" * 8)
    got = _threads(2, lambda r: ctl[r].shared_value("fabric", lambda: f"made by {r}".encode(), 10.0))
    assert got[0] == got[1] and got[0] in (b"made by 0", b"made by 1")
    assert ctl[0].key("shared", "fabric") in ctl[0].rejects.keys() + ctl[1].rejects.keys()


def test_wait_timeout_names_the_refused_key() -> None:
    master = _master()
    c = StoreControl(_client(master.port), 0, 2, "t/refused", SECRET)
    key = c.key("member", "gpu", 1)
    c.store.set(key, b'["host", "uuid"]')
    with pytest.raises(ControlTimeout) as info:
        c.wait_records([key], [1], 0.2, "GPU identities", 4096)
    assert info.value.missing == [1] and info.value.refused == [key] and "refused" in str(info.value)
    StoreControl(_client(master.port), 1, 2, "t/refused", SECRET).put(key, b'["host", "uuid"]')
    assert c.wait_records([key], [1], 5.0, "GPU identities", 4096)[0].payload == b'["host", "uuid"]'


def _hostile_rank_sends_a_huge_size() -> Any:
    import torch
    import torch.distributed as dist

    from pyep.ep._dist import all_gather_bytes
    rank = dist.get_rank()
    if rank == 1:
        lens = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(lens, torch.tensor([1 << 40], dtype=torch.int64))      # announces 1 TiB
        err = None
    else:
        with pytest.raises(PeerSizeRejected) as info:
            all_gather_bytes(dist.group.WORLD, b"mine", 30.0, "set-up exchange")
        err = (info.value.rank, info.value.size, str(info.value))
    return err, all_gather_bytes(dist.group.WORLD, f"ok {rank}".encode(), 30.0, "after")


def test_all_gather_bytes_bounds_a_peers_size_before_allocating() -> None:
    from multiproc import run_distributed
    res = run_distributed(_hostile_rank_sends_a_huge_size, 2)
    (rank, size, msg), after = res[0]
    assert rank == 1 and size == 1 << 40 and "rank 1 announced 1099511627776 bytes" in msg
    assert after == [b"ok 0", b"ok 1"] and res[1][1] == after


# ---------------------------------------------------------------------------------------- membership
def _forge(store: Any, prefix: str, secret: Any, fp: str) -> List[str]:
    """What a forger who can reach the store (and, with `secret`, holds another job's secret) writes to
    make survivors admit a phantom generation 2 of live rank 1: the generation slot, an announcement,
    an index slot, `prepared`, call #A, `act` and `ready`."""
    from pyep.ep.elastic.membership import _AT, Announcement
    codec = RecordCodec(secret) if secret is not None else None
    writes = {
        f"{prefix}/gen/1/2": (1, 2, b"n" * 16), f"{prefix}/annidx/1": (1, 2, b"n" * 16),
        f"{prefix}/ann/1/2": (1, 2, Announcement(1, 2, 2, fp, "reference", b"").encode()),
        f"{prefix}/prepared/1/2/0": (0, 1, b""), f"{prefix}/at/1/2": (0, 1, _AT.pack(3, 0)),
        f"{prefix}/act/1/2/0": (0, 1, b""), f"{prefix}/ready/1/2": (1, 2, b""),
        f"{prefix}/reject/1/2": (0, 1, b"refused"),
    }
    for key, (writer, gen, payload) in writes.items():
        store.set(key, codec.seal(key, writer, gen, 3, payload) if codec else payload)
    return list(writes)


@pytest.mark.parametrize("secret", [None, OTHER_JOB], ids=["unsealed", "another-jobs-secret"])
def test_phantom_generation_of_a_live_rank_is_not_admitted(secret: Any) -> None:
    """The measured attack: a forged announcement plus `ready` made a survivor admit a phantom
    generation of a live rank; both ranks then marked each other and returned wrong results."""
    from pyep.ep.elastic.membership import buffer_fingerprint
    master = _master()
    prefix = f"t/phantom-{secret is None}"
    bufs = _buffers(master, prefix)
    _round_trip(bufs, 1)
    _forge(_client(master.port), prefix, secret, buffer_fingerprint(bufs[0].config, 2))
    assert bufs[0].poll_rejoin() == [] and bufs[0].admit_pending() == []
    assert f"{prefix}/annidx/1" in [e.key for e in bufs[0].rejected_records]
    assert bufs[0].generation == 1 and bufs[1].generation == 1
    _round_trip(bufs, 3)           # both still active on both, results equal to the definition
    for b in bufs:
        b.destroy()


def _restart_and_admit(master: Any, prefix: str, bufs: List[Any]) -> Any:
    """A real restarted process of rank 1 joins; the survivor admits it. Returns the new buffer."""
    from pyep.ep.ll import EpBuffer
    out: List[Any] = []
    errs: List[BaseException] = []

    def restart() -> None:
        try:
            b = EpBuffer(store=_client(master.port), rank=1, world_size=2, backend="reference", timeout_us=20_000_000,
                         store_prefix=prefix, rejoin_lead_calls=0, job_secret=SECRET, **SHAPE)
            out.append((b, b.join(60.0)))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errs.append(exc)
    t = threading.Thread(target=restart, daemon=True)
    t.start()
    admitted: List[int] = []
    deadline = time.monotonic() + 90
    while not admitted and not errs and time.monotonic() < deadline:
        admitted = bufs[0].admit_pending()
        time.sleep(0.01)
    t.join(60)
    if errs:
        raise errs[0]
    assert admitted == [1] and out and out[0][1] == bufs[0].next_call
    return out[0][0]


def test_counter_pushed_ahead_does_not_block_a_rejoin() -> None:
    """`add(anncount, 1000)` blocked every later rejoin; forged index slots and a forged refusal do not
    either: the restarted rank is admitted and both ranks compute correctly."""
    master = _master()
    prefix = "t/anncount"
    bufs = _buffers(master, prefix)
    store = _client(master.port)
    store.add(f"{prefix}/anncount", 1000)
    for i in (1, 2, 3):
        store.set(f"{prefix}/annidx/{i}", b"1:2")
    store.set(f"{prefix}/reject/1/2", b"go away")
    bufs[0].poll_rejoin()
    newcomer = _restart_and_admit(master, prefix, bufs)
    assert newcomer.generation == 2
    assert {f"{prefix}/annidx/{i}" for i in (1, 2, 3)} <= {e.key for e in bufs[0].rejected_records}
    _round_trip([bufs[0], newcomer], 2)
    for b in (bufs[0], bufs[1], newcomer):
        b.destroy()


def test_non_integer_generation_keeps_the_connection() -> None:
    """A non-integer `gen/1` made the store drop rank 0's connection (store.add on it). Nothing adds
    any more; a forged generation slot is taken over by the real restarted process."""
    master = _master()
    prefix = "t/gen-nonint"
    bufs = _buffers(master, prefix)
    store = _client(master.port)
    store.set(f"{prefix}/gen/1", b"not a number")
    store.set(f"{prefix}/gen/1/2", b"junk in generation 2's slot")
    store.set(f"{prefix}/gen/0/2", b"\x00" * 70)
    assert bufs[0].poll_rejoin() == []
    newcomer = _restart_and_admit(master, prefix, bufs)
    assert newcomer.generation == 2                   # the forged slot was not a process of rank 1
    _round_trip([bufs[0], newcomer], 2)
    for b in (bufs[0], bufs[1], newcomer):
        b.destroy()


def test_forged_at_and_act_do_not_release_a_newcomer() -> None:
    """While a real newcomer waits, a forged call #A (out of range, or unsealed) and forged `act`
    keys do not make it start: it joins at the call the survivors agreed on."""
    from pyep.ep.elastic.membership import _AT
    master = _master()
    prefix = "t/at"
    bufs = _buffers(master, prefix)
    store = _client(master.port)
    codec = RecordCodec(SECRET)
    # Authentic framing (a rank of this job), impossible values: refused by the protocol's checks.
    store.set(f"{prefix}/at/1/2", codec.seal(f"{prefix}/at/1/2", 0, 1, 0, _AT.pack(0, 7)))
    store.set(f"{prefix}/act/1/2/0", b"1")
    newcomer = _restart_and_admit(master, prefix, bufs)
    assert newcomer.next_call == bufs[0].next_call
    _round_trip([bufs[0], newcomer], 2)
    for b in (bufs[0], bufs[1], newcomer):
        b.destroy()


def test_index_slots_forged_empty_and_real() -> None:
    """read_index: a forged slot is skipped (and logged), an empty value stops the scan (a newcomer may
    still claim it), a real one after them is found."""
    from pyep.ep.elastic.slots import claim_index_slot, read_index
    master = _master()
    c0 = StoreControl(_client(master.port), 0, 2, "t/idx", SECRET)
    c1 = StoreControl(_client(master.port), 1, 2, "t/idx", SECRET)
    c1.generation = 2
    c0.store.set(c0.key("annidx", 1), b"junk")
    c0.store.set(c0.key("annidx", 2), b"")
    assert read_index(c0, 0) == (1, []) and c0.key("annidx", 1) in c0.rejects.keys()
    assert claim_index_slot(c1, 5.0) == 2          # the empty slot
    assert read_index(c0, 1) == (2, [(1, 2)])


def test_announcement_nested_too_deeply() -> None:
    from pyep.ep.elastic.membership import Announcement, BadAnnouncement, decode_announcement
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(BadAnnouncement, match="not a pyep membership document"):
        decode_announcement(deep, 1, 2, "fp", "reference", 2, 1)
    good = Announcement(1, 2, 2, "fp", "reference", b"x")
    assert decode_announcement(good.encode(), 1, 2, "fp", "reference", 2, 1) == good


# ---------------------------------------------------------------------------------------- the mailbox
def test_seven_byte_mail_value_is_refused_and_the_call_completes() -> None:
    """A 7-byte value at a mail key raised a raw RuntimeError in mailbox.py and left the masks split.
    Now it is refused (unsealed, or sealed but not whole rows) and the real row that replaces it is
    used: the call completes with every rank active and the right data."""
    master = _master()
    prefix = "t/mail7"
    bufs = _buffers(master, prefix)
    store = _client(master.port)
    call = bufs[0].next_call
    key = f"{prefix}/mail/0/d{call}/1.1"
    store.set(key, b"7 bytes")
    res: List[Any] = [None]
    t = threading.Thread(target=lambda: res.__setitem__(0, _call(bufs[0], call)), daemon=True)
    t.start()
    _wait_for(lambda: key in [e.key for e in bufs[0].rejected_records], "rank 0 refused the 7-byte value")
    assert _call(bufs[1], call) == [1, 1]
    t.join(60)
    assert res[0] == [1, 1]
    _round_trip(bufs, 1)
    for b in bufs:
        b.destroy()


def test_heartbeat_forged_replayed_or_malformed() -> None:
    from pyep.ep.elastic.mailbox import StoreMailbox
    master = _master()
    c0 = StoreControl(_client(master.port), 0, 2, "t/alive", SECRET)
    c1 = StoreControl(_client(master.port), 1, 2, "t/alive", SECRET)
    box = StoreMailbox(c0)
    key = c0.key("alive", 1)
    now = struct.pack("<d", time.time())
    for raw in (repr(time.time()).encode(), b"nan", RecordCodec(OTHER_JOB).seal(key, 1, 1, 0, now),
                c1.codec.seal(key, 1, 2, 0, now), c1.seal(key, struct.pack("<d", float("nan"))),
                c1.seal(key, b"\x00" * 3)):
        c0.store.set(key, raw)
        assert box._beating(1) is False
    assert len(c0.rejects) == 6            # unsealed x2, another job's, a dead generation's, NaN, 3 bytes
    c1.put(key, now)
    assert box._beating(1) is True


def test_mail_rows_of_a_dead_generation_or_not_whole_are_not_read() -> None:
    from pyep.ep.elastic.mailbox import StoreMailbox
    master = _master()
    c0 = StoreControl(_client(master.port), 0, 2, "t/deadmail", SECRET)
    box = StoreMailbox(c0)
    box.generations = [1, 2]
    key = box._key(0, "d5", 1, 2)
    c0.store.set(key, c0.codec.seal(key, 1, 1, 0, b"\x00" * 8))      # generation 1's row at generation 2's key
    assert box._rows(key, 1, 8) is None and "generation 1" in str(c0.rejects.entries[-1])
    c0.store.set(key, c0.codec.seal(key, 1, 2, 0, b"7 bytes"))        # authentic framing, not whole rows
    assert box._rows(key, 1, 8) is None and "not whole rows of 8" in str(c0.rejects.entries[-1])
    c0.store.set(key, c0.codec.seal(key, 1, 2, 0, b"\x00" * 16))
    assert box._rows(key, 1, 8) == b"\x00" * 16


def test_generation_slot_fought_over_is_a_typed_error() -> None:
    """A writer that replaces the generation slot with junk before every claim: after the bound, a
    MembershipError naming the slot (never a hang or a raw error); on a store left alone, generation 1."""
    from pyep.ep.elastic.slots import claim_generation
    from pyep.ep.errors import MembershipError
    master = _master()

    class Fought:
        def __init__(self, store: Any) -> None:
            self.inner = store

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            self.inner.set(key, b"junk")
            return b"junk"
    c = StoreControl(Fought(_client(master.port)), 0, 2, "t/fought", SECRET)
    with pytest.raises(MembershipError, match="t/fought/gen/0/1 kept holding invalid records"):
        claim_generation(c, 0.2)
    assert claim_generation(StoreControl(_client(master.port), 0, 2, "t/fought", SECRET), 5.0) == 1
