"""The one format of every record pyep writes to a c10d store, the per-job secret that authenticates
it, and the log of records refused (docs/elastic.md, "Threat model").

A record is

    magic b"PYR1" | writer rank u32 | writer generation u64 | call u64 | payload length u32 | payload | MAC

with MAC = HMAC-SHA256(job secret, DOMAIN | len(key) u32 | key | header | payload). The key holds the
buffer's store prefix (the job's namespace), so a record cannot be moved to another key or buffer;
the writer and its generation are in the MAC, so one rank's record cannot pass for another's, nor a
dead process's for its restarted successor's; `call` is the round or call the record belongs to where
there is one (0 elsewhere). Sizes are checked before anything is decoded, and every failure is a
`RecordRejected` naming the key: parsing a record never raises a builtin exception.

The secret: `EpBuffer(store=..., job_secret=b"...")`, else the file named by PYEP_JOB_SECRET_FILE (mode
0600, owned by this user; `pyep launch` and `pyep drill` write one per job), else PYEP_JOB_SECRET (hex).
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Iterable, List, Mapping, Optional, Set, Tuple

from .errors import RecordRejected

log = logging.getLogger("pyep.ep.records")

SECRET_FILE_VAR = "PYEP_JOB_SECRET_FILE"
SECRET_VAR = "PYEP_JOB_SECRET"
MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 1024
_MAX_SECRET_FILE = 4 * MAX_SECRET_BYTES      # hex text and a newline fit with room to spare

MAGIC = b"PYR1"
HEADER = struct.Struct("<4sIQQI")
MAC_BYTES = 32
DOMAIN = b"pyep-store-record/1\0"
MAX_GENERATION = 1 << 62
MAX_RECORD_PAYLOAD = (1 << 32) - 1           # the length field's range; each reader bounds it far lower
REJECT_LOG_SIZE = 256


# ---------------------------------------------------------------------------------------- the secret
def new_job_secret() -> bytes:
    """A fresh random job secret (what `pyep launch` and `pyep drill` create per job)."""
    return secrets.token_bytes(32)


def _secret_from_hex(text: str, where: str) -> bytes:
    try:
        raw = bytes.fromhex(text.strip())
    except ValueError:
        raise ValueError(f"{where} must hold the job secret as hex digits") from None
    return check_secret(raw, where)


def check_secret(secret: Any, where: str = "job_secret") -> bytes:
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"{where} must be bytes, got {type(secret).__name__}")
    if not MIN_SECRET_BYTES <= len(secret) <= MAX_SECRET_BYTES:
        raise ValueError(f"{where} must be {MIN_SECRET_BYTES} to {MAX_SECRET_BYTES} bytes, got {len(secret)}")
    return bytes(secret)


def read_secret_file(path: str) -> bytes:
    """The secret in `path` (hex). Refuses a file others may read or write, one owned by another user,
    a link, or anything that is not a small regular file: the secret is what keeps a forger who can
    reach the store from writing records the ranks accept."""
    where = f"{SECRET_FILE_VAR}={path!r}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise ValueError(f"{where}: cannot open the job secret file ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{where}: not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError(f"{where}: owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
        if st.st_mode & 0o077:
            raise ValueError(f"{where}: mode {stat.S_IMODE(st.st_mode):04o} lets others read it; it must be 0600")
        if st.st_size > _MAX_SECRET_FILE:
            raise ValueError(f"{where}: {st.st_size} bytes, more than a job secret ({_MAX_SECRET_FILE} at most)")
        data = os.read(fd, _MAX_SECRET_FILE + 1)
    finally:
        os.close(fd)
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError(f"{where} must hold the job secret as hex digits") from None
    return _secret_from_hex(text, where)


def resolve_job_secret(job_secret: Optional[bytes], environ: Optional[Mapping[str, str]] = None) -> bytes:
    """The job secret of a store-based buffer: the argument, else the environment. Never None: a
    store-based buffer does not run unauthenticated."""
    if job_secret is not None:
        return check_secret(job_secret)
    env = os.environ if environ is None else environ
    path = env.get(SECRET_FILE_VAR, "")
    if path:
        return read_secret_file(path)
    text = env.get(SECRET_VAR, "")
    if text:
        return _secret_from_hex(text, SECRET_VAR)
    raise ValueError(f"a store-based EpBuffer needs the job's secret (it authenticates every store record): pass "
                     f"job_secret=<bytes, the same on every rank>, or set {SECRET_FILE_VAR} to a file (mode 0600) "
                     f"holding it as hex, or {SECRET_VAR} to the hex; `pyep launch` and `pyep drill` create one per "
                     f"job (docs/elastic.md, 'Threat model')")


# ---------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class Record:
    key: str
    writer: int
    generation: int
    call: int
    payload: bytes


class RecordCodec:
    """Seals and opens records with one job secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = check_secret(secret)

    def _mac(self, key: str, header: bytes, payload: bytes) -> bytes:
        k = key.encode("utf-8")
        h = hmac.new(self._secret, DOMAIN + len(k).to_bytes(4, "little") + k + header, hashlib.sha256)
        h.update(payload)
        return h.digest()

    def seal(self, key: str, writer: int, generation: int, call: int, payload: bytes) -> bytes:
        payload = bytes(payload)
        if not 0 <= writer < 1 << 32 or not 1 <= generation <= MAX_GENERATION or not 0 <= call < 1 << 64:
            raise ValueError(f"record {key!r}: writer {writer}, generation {generation} or call {call} out of range")
        if len(payload) > MAX_RECORD_PAYLOAD:
            raise ValueError(f"record {key!r}: payload of {len(payload)} bytes is too large for a store record")
        header = HEADER.pack(MAGIC, writer, generation, call, len(payload))
        return header + payload + self._mac(key, header, payload)

    def open(self, key: str, raw: Any, max_payload: int, writers: Optional[Iterable[int]] = None,
             generation: Optional[int] = None, call: Optional[int] = None) -> Record:
        """The record in `raw`, read at `key`; RecordRejected unless it is well framed, within
        `max_payload`, authentic, and from one of `writers` with the given generation and call."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise RecordRejected(key, f"not a byte string ({type(raw).__name__})")
        n = len(raw)
        if n < HEADER.size + MAC_BYTES:
            raise RecordRejected(key, f"{n} bytes, shorter than any record ({HEADER.size + MAC_BYTES})")
        if n > HEADER.size + max_payload + MAC_BYTES:
            raise RecordRejected(key, f"{n} bytes, over the bound of {max_payload} payload bytes for this key")
        raw = bytes(raw)
        magic, writer, gen, rcall, length = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise RecordRejected(key, "not a pyep store record (bad magic)")
        if length != n - HEADER.size - MAC_BYTES:
            raise RecordRejected(key, f"declares {length} payload bytes but holds {n - HEADER.size - MAC_BYTES}")
        payload = raw[HEADER.size:HEADER.size + length]
        if not hmac.compare_digest(raw[-MAC_BYTES:], self._mac(key, raw[:HEADER.size], payload)):
            raise RecordRejected(key, "authentication failed: not written by a rank of this job (another job's "
                                      "secret, a forgery, or altered in the store)")
        allowed = None if writers is None else set(writers)
        if allowed is not None and writer not in allowed:
            raise RecordRejected(key, f"written by rank {writer}, expected {sorted(allowed)}")
        if not 1 <= gen <= MAX_GENERATION:
            raise RecordRejected(key, f"writer generation {gen} out of range")
        if generation is not None and gen != generation:
            raise RecordRejected(key, f"written by generation {gen} of rank {writer}, expected generation {generation} "
                                      f"(a record of another process of that rank)")
        if call is not None and rcall != call:
            raise RecordRejected(key, f"belongs to call/round {rcall}, expected {call}")
        return Record(key, writer, gen, rcall, payload)


def unpack(rec: Record, fmt: struct.Struct) -> Tuple[Any, ...]:
    """A fixed-size payload; RecordRejected naming the key when its size differs."""
    if len(rec.payload) != fmt.size:
        raise RecordRejected(rec.key, f"payload of {len(rec.payload)} bytes, expected {fmt.size}")
    return fmt.unpack(rec.payload)


# ---------------------------------------------------------------------------------------- reject log
class RejectLog:
    """The records this process refused, newest last (bounded), each logged once with a warning: a
    forged key that a wait polls a thousand times is one entry."""

    def __init__(self, size: int = REJECT_LOG_SIZE) -> None:
        self._entries: Deque[RecordRejected] = deque(maxlen=size)
        self._seen: Set[Tuple[str, bytes]] = set()
        self.total = 0

    def add(self, exc: RecordRejected, raw: Any = b"") -> None:
        digest = hashlib.sha256(bytes(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else repr(raw).encode())
        mark = (exc.key, digest.digest()[:16])
        if mark in self._seen:
            return
        if len(self._seen) >= 8 * REJECT_LOG_SIZE:
            self._seen.clear()
        self._seen.add(mark)
        self._entries.append(exc)
        self.total += 1
        log.warning("%s", exc)

    @property
    def entries(self) -> List[RecordRejected]:
        return list(self._entries)

    def keys(self) -> List[str]:
        return [e.key for e in self._entries]

    def __len__(self) -> int:
        return len(self._entries)


class PeerSizeRejected(RecordRejected):
    """A peer announced a payload size outside the bound of an exchange (pyep.ep._dist): refused before
    anything of that size is allocated. `rank` is the peer."""

    def __init__(self, what: str, rank: int, size: int, bound: int) -> None:
        self.rank, self.size, self.bound = rank, size, bound
        super().__init__(what, f"rank {rank} announced {size} bytes, outside 0 .. {bound}; nothing was allocated")
