"""World's greedy longest match, fast and exact: cut the input where no token can cross, look
each piece up in a table of pieces already tokenised, tokenise only the new ones.

Why the cut is exact. A token that covers both byte p-1 and byte p holds the pair
(data[p-1], data[p]) at an inner position (between two of its own bytes). `boundary_pairs`
marks every byte pair that occurs at an inner position of no vocabulary entry (8333 of the
65536 pairs are inner pairs of World's entries, so most text has a boundary every ~4 bytes).
Between the bytes of such a pair no token can lie, and no trie walk can go on past it either
(every trie path spells a prefix of an entry, so it too would hold the pair inside). The
greedy tokenisation of the input is therefore the concatenation of the greedy tokenisations
of the pieces between such boundaries, each found on its own.

Lookups. A piece of at most 15 bytes packs exactly into two uint64 words (its bytes, little
endian, and its length in the top byte); a window of ~256 KB of input is cut, packed and looked
up in one NumPy pass (an open-addressing hash table over the packed words; a hit is checked
on both words, so a hash collision can only cost a walk, never change an id), and the ids are
gathered into place with NumPy. Pieces not in the table yet are tokenised by the trie walk and
kept in a dict that joins the table in amortised merges (at most `MAX_TABLE` pieces; past
that, new pieces are walked each time). Longer pieces (deep indentation, long rules of `#`)
go through a dict keyed by their bytes. The tables are the encoder's own state: they only make
later calls faster and never change an id.

Speed on the 2-core development machine, one process, once the table is warm: ~30 MB/s on
Python source and English text, ~35 MB/s on mixed CJK/emoji/Cyrillic text, against ~10 MB/s
for the trie walk alone; a first pass over new text runs at ~12 MB/s.
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import numpy as np

MAX_KEY_BYTES = 15  # a piece this short packs exactly into two uint64 words with its length
MERGE_EVERY = 4096  # new short pieces gathered (at most) before they join the table
MAX_TABLE = 1 << 19  # pieces in the table (~20 MB with their ids)
MAX_LONG = 1 << 16  # long pieces remembered (cleared when full)
WINDOW_BYTES = 1 << 18  # bytes tokenised per NumPy pass (bounds the temporaries)
_MASKS = np.array([(1 << (8 * n)) - 1 for n in range(9)], dtype=np.uint64)
_MIX0, _MIX1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xC2B2AE3D27D4EB4F)
_EMPTY_IDS = np.zeros(0, dtype=np.int32)


def boundary_pairs(tokens: Iterable[bytes]) -> np.ndarray:
    """bool [65536]: entry `a * 256 + b` is True when the byte pair (a, b) occurs inside none
    of `tokens` (so the input may be cut between a and b)."""
    inner = np.zeros(65536, dtype=bool)
    for tok in tokens:
        if len(tok) > 1:
            arr = np.frombuffer(tok, dtype=np.uint8).astype(np.int64)
            inner[arr[:-1] * 256 + arr[1:]] = True
    return ~inner


def _piece_bytes(w0: int, w1: int) -> bytes:
    """The piece packed as (w0, w1) by `PieceEncoder._pack`."""
    return (w0.to_bytes(8, "little") + (w1 & ((1 << 56) - 1)).to_bytes(7, "little"))[:w1 >> 56]


def _mix(w0: np.ndarray, w1: np.ndarray) -> np.ndarray:
    """uint64 hash of packed pieces (wrapping arithmetic)."""
    h = (w0 * _MIX0) ^ (w1 * _MIX1)
    return h ^ (h >> np.uint64(29))


def _groups(w0: np.ndarray, w1: np.ndarray, hashes: np.ndarray
            ) -> tuple[np.ndarray, np.ndarray]:
    """(representatives, group of each) for packed pieces: equal pieces mostly share a group
    (sorted by hash, equal neighbours merged); distinct pieces never share one."""
    order = np.argsort(hashes, kind="stable")
    h, a, b = hashes[order], w0[order], w1[order]
    new = np.ones(len(h), dtype=bool)
    new[1:] = (h[1:] != h[:-1]) | (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    group = np.empty(len(h), dtype=np.int64)
    group[order] = np.cumsum(new) - 1
    return order[new], group


def _exclusive_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x) + 1, dtype=np.int64)
    np.cumsum(x, out=out[1:])
    return out


def _scatter(out: np.ndarray, out_start: np.ndarray, flat: np.ndarray, offs: np.ndarray,
             cnts: np.ndarray) -> None:
    """out[out_start[c] + t] = flat[offs[c] + t] for t < cnts[c], for every piece c."""
    excl = _exclusive_cumsum(cnts)
    total = int(excl[-1])
    if total == 0:
        return
    i = np.arange(total, dtype=np.int64)
    out[i + np.repeat(out_start - excl[:-1], cnts)] = flat[i + np.repeat(offs - excl[:-1], cnts)]


def _flatten(ids: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(flat int32, offsets int64, counts int64) of a list of id lists."""
    cnts = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    offs = _exclusive_cumsum(cnts)
    flat = np.fromiter((i for row in ids for i in row), dtype=np.int32, count=int(offs[-1]))
    return flat, offs[:-1], cnts


class PieceEncoder:
    """Greedy longest-match ids of byte strings, computed piece by piece (module docstring).

    Args:
      walk: the reference greedy walk, bytes -> list of ids (`WorldTokenizer.encode_bytes_trie`).
      cut_between: bool [65536] from `boundary_pairs` of the same vocabulary.
    """

    def __init__(self, walk: Callable[[bytes], list[int]], cut_between: np.ndarray):
        if cut_between.shape != (65536,) or cut_between.dtype != bool:
            raise ValueError(f"cut_between must be bool [65536], got {cut_between.dtype} "
                             f"{cut_between.shape}")
        self._walk = walk
        self._cut_between = cut_between
        # the table [T]: pieces of <= MAX_KEY_BYTES
        self._hash = np.zeros(0, dtype=np.uint64)
        self._w0 = np.zeros(0, dtype=np.uint64)  # bytes 0..7 of the piece
        self._w1 = np.zeros(0, dtype=np.uint64)  # bytes 8..14, length in the top byte
        self._offs = np.zeros(0, dtype=np.int64)  # start of the piece's ids in _flat
        self._cnts = np.zeros(0, dtype=np.int64)  # number of ids of the piece
        self._flat = np.zeros(0, dtype=np.int32)
        self._slots = np.zeros(0, dtype=np.int64)  # open-addressing index: slot -> row
        self._slot_bits = 0
        self._recent: dict[tuple[int, int], list[int]] = {}  # not merged into the table yet
        self._long: dict[bytes, list[int]] = {}  # pieces longer than MAX_KEY_BYTES

    def encode(self, data: bytes) -> np.ndarray:
        """int32 [n_tokens] ids of one byte string."""
        return self.encode_many([data])[0]

    def encode_many(self, datas: Sequence[bytes]) -> list[np.ndarray]:
        """int32 ids of each byte string, tokenised independently, `WINDOW_BYTES` at a time."""
        out: list[np.ndarray | None] = [None] * len(datas)
        group: list[int] = []
        size = 0
        for k, data in enumerate(datas):
            if len(data) > WINDOW_BYTES:  # one long document: cut at boundaries, in windows
                parts = self._split(data)
                ids = [self._window(parts[i:i + 1])[0] for i in range(len(parts))]
                out[k] = np.concatenate(ids) if ids else _EMPTY_IDS.copy()
                continue
            group.append(k)
            size += len(data)
            if size >= WINDOW_BYTES:
                out_group = self._window([datas[i] for i in group])
                for i, ids in zip(group, out_group):
                    out[i] = ids
                group, size = [], 0
        if group:
            for i, ids in zip(group, self._window([datas[i] for i in group])):
                out[i] = ids
        return out

    def _split(self, data: bytes) -> list[bytes]:
        """`data` cut into parts of about WINDOW_BYTES, each cut at a boundary (exact)."""
        a_N = np.frombuffer(data, dtype=np.uint8)
        parts, start = [], 0
        while len(data) - start > WINDOW_BYTES:
            at = start + WINDOW_BYTES
            near = a_N[at - 1:at + 4096].astype(np.int64)
            ok = np.flatnonzero(self._cut_between[(near[:-1] << 8) | near[1:]])
            if len(ok) == 0:  # no boundary nearby (a long run of one pattern): look further
                near = a_N[at - 1:].astype(np.int64)
                ok = np.flatnonzero(self._cut_between[(near[:-1] << 8) | near[1:]])
                if len(ok) == 0:
                    break
            parts.append(data[start:at + int(ok[0])])
            start = at + int(ok[0])
        parts.append(data[start:])
        return parts

    def _window(self, datas: list[bytes]) -> list[np.ndarray]:
        """One NumPy pass over a few documents (their concatenation is cut at their starts)."""
        sizes = np.fromiter(map(len, datas), dtype=np.int64, count=len(datas))
        doc_starts = _exclusive_cumsum(sizes)
        n = int(doc_starts[-1])
        if n == 0:
            return [_EMPTY_IDS.copy() for _ in datas]
        data = b"".join(datas)
        a_N = np.frombuffer(data, dtype=np.uint8)
        cut_N = np.empty(n, dtype=bool)
        cut_N[0] = True
        cut_N[1:] = self._cut_between[(a_N[:-1].astype(np.int64) << 8) | a_N[1:]]
        cut_N[doc_starts[:-1][sizes > 0]] = True  # documents never share a piece
        starts_P = np.flatnonzero(cut_N)
        lens_P = np.diff(starts_P, append=n)
        n_p = len(starts_P)
        offs_P = np.zeros(n_p, dtype=np.int64)
        cnts_P = np.zeros(n_p, dtype=np.int64)
        ext_P = np.full(n_p, -1, dtype=np.int64)  # index into ext_ids; -1: in the table
        ext_ids: list[list[int]] = []

        short_S = np.flatnonzero(lens_P <= MAX_KEY_BYTES)
        w0_S, w1_S, hash_S = self._pack(a_N, starts_P[short_S], lens_P[short_S])
        row_S = self._lookup(w0_S, w1_S, hash_S)
        hit_S = row_S >= 0
        offs_P[short_S[hit_S]] = self._offs[row_S[hit_S]]
        cnts_P[short_S[hit_S]] = self._cnts[row_S[hit_S]]
        miss_S = ~hit_S
        if miss_S.any():
            reps, group_M = _groups(w0_S[miss_S], w1_S[miss_S], hash_S[miss_S])
            ext_ids.extend(self._short_ids(w0, w1) for w0, w1 in
                           zip(w0_S[miss_S][reps].tolist(), w1_S[miss_S][reps].tolist()))
            ext_P[short_S[miss_S]] = group_M
        long_L = np.flatnonzero(lens_P > MAX_KEY_BYTES)
        if len(long_L):
            first = len(ext_ids)
            ends = (starts_P[long_L] + lens_P[long_L]).tolist()
            ext_ids.extend(self._long_ids(data[s:e]) for s, e in zip(starts_P[long_L].tolist(), ends))
            ext_P[long_L] = first + np.arange(len(long_L))
        tab_P = ext_P < 0
        if ext_ids:
            ext_flat, ext_offs, ext_cnts = _flatten(ext_ids)
            offs_P[~tab_P] = ext_offs[ext_P[~tab_P]]
            cnts_P[~tab_P] = ext_cnts[ext_P[~tab_P]]
        tok_start_P = _exclusive_cumsum(cnts_P)
        out = np.empty(int(tok_start_P[-1]), dtype=np.int32)
        _scatter(out, tok_start_P[:-1][tab_P], self._flat, offs_P[tab_P], cnts_P[tab_P])
        if ext_ids:
            _scatter(out, tok_start_P[:-1][~tab_P], ext_flat, offs_P[~tab_P], cnts_P[~tab_P])
        if len(self._recent) >= min(MERGE_EVERY, max(64, len(self._hash) // 8)):
            self._merge()  # amortised: the table at least grows by an eighth each time
        return np.split(out, tok_start_P[np.searchsorted(starts_P, doc_starts[1:-1])])

    @staticmethod
    def _pack(a_N: np.ndarray, starts: np.ndarray, lens: np.ndarray):
        """(w0, w1, hash) uint64 of the pieces a_N[starts : starts + lens], lens <= 15: w0 holds
        bytes 0..7, w1 bytes 8..14 and the length in its top byte (exact: no two pieces share
        both words); the hash mixes both (pieces may share it: lookups check both words)."""
        padded = np.zeros(len(a_N) + 16, dtype=np.uint8)
        padded[:len(a_N)] = a_N
        words_N = np.ndarray(shape=(len(a_N) + 8,), dtype="<u8", buffer=padded, strides=(1,))
        n = lens.astype(np.int64)
        w0 = words_N[starts] & _MASKS[np.minimum(n, 8)]
        w1 = (words_N[starts + 8] & _MASKS[np.maximum(n - 8, 0)]) | (n.astype(np.uint64) << np.uint64(56))
        return w0, w1, _mix(w0, w1)

    def _lookup(self, w0: np.ndarray, w1: np.ndarray, hashes: np.ndarray) -> np.ndarray:
        """Row of each piece in the table, -1 where absent: open addressing, linear probing
        over `_slots` (slot -> row, -1 empty), all pieces probed together."""
        row = np.full(len(w0), -1, dtype=np.int64)
        if len(self._hash) == 0:
            return row
        mask = len(self._slots) - 1
        slot = (hashes >> np.uint64(64 - self._slot_bits)).astype(np.int64)
        todo = np.arange(len(w0))
        while len(todo):
            r = self._slots[slot]
            found = r >= 0
            found[found] = self._hash[r[found]] == hashes[todo[found]]
            row[todo[found]] = r[found]
            go_on = (r >= 0) & ~found
            todo, slot = todo[go_on], (slot[go_on] + 1) & mask
        hit = row >= 0
        hit[hit] = (self._w0[row[hit]] == w0[hit]) & (self._w1[row[hit]] == w1[hit])
        return np.where(hit, row, -1)

    def _build_slots(self) -> None:
        """The open-addressing index of the table: at most half full."""
        bits = max(10, int(2 * len(self._hash) - 1).bit_length())
        slots = np.full(1 << bits, -1, dtype=np.int64)
        mask = len(slots) - 1
        todo = np.arange(len(self._hash))
        slot = (self._hash >> np.uint64(64 - bits)).astype(np.int64)
        while len(todo):  # each round: one winner per free slot, the others probe on
            free = slots[slot] < 0
            cand, first = np.unique(slot[free], return_index=True)
            slots[cand] = todo[free][first]
            placed = np.zeros(len(todo), dtype=bool)
            placed[np.flatnonzero(free)[first]] = True
            todo, slot = todo[~placed], (slot[~placed] + 1) & mask
        self._slots, self._slot_bits = slots, bits

    def _short_ids(self, w0: int, w1: int) -> list[int]:
        ids = self._recent.get((w0, w1))
        if ids is None:
            ids = self._walk(_piece_bytes(w0, w1))
            if len(self._hash) + len(self._recent) < MAX_TABLE:
                self._recent[(w0, w1)] = ids
        return ids

    def _long_ids(self, piece: bytes) -> list[int]:
        ids = self._long.get(piece)
        if ids is None:
            if len(self._long) >= MAX_LONG:
                self._long.clear()
            ids = self._long[piece] = self._walk(piece)
        return ids

    def _merge(self) -> None:
        """Moves the recent pieces into the table. A piece whose hash is already taken
        (by another piece) stays out: it is walked each time it appears, still exactly."""
        keys = np.array(list(self._recent.keys()), dtype=np.uint64).reshape(-1, 2)
        flat, offs, cnts = _flatten(list(self._recent.values()))
        self._recent.clear()
        w0, w1 = keys[:, 0], keys[:, 1]
        hashes = _mix(w0, w1)
        _, first = np.unique(hashes, return_index=True)
        keep = np.zeros(len(hashes), dtype=bool)
        keep[first] = True
        keep &= ~np.isin(hashes, self._hash)
        order = np.argsort(np.concatenate([self._hash, hashes[keep]]), kind="stable")
        self._hash = np.concatenate([self._hash, hashes[keep]])[order]
        self._w0 = np.concatenate([self._w0, w0[keep]])[order]
        self._w1 = np.concatenate([self._w1, w1[keep]])[order]
        self._offs = np.concatenate([self._offs, len(self._flat) + offs[keep]])[order]
        self._cnts = np.concatenate([self._cnts, cnts[keep]])[order]
        self._flat = np.concatenate([self._flat, flat])
        self._build_slots()
