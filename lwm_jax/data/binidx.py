"""Megatron / GPT-NeoX "binidx" token files: a memory-mapped reader and a streaming writer.

A dataset is a pair of files sharing a prefix:

`<prefix>.idx` (little-endian):
  9 bytes  magic b"MMIDIDX\\x00\\x00"
  u64      version (always 1)
  u8       dtype code of the tokens (table `DTYPE_CODES`)
  u64      n_seq: number of sequences
  u64      n_doc_idx: length of `doc_idx`
  int32    sizes[n_seq]      tokens per sequence
  int64    pointers[n_seq]   byte offset of each sequence inside `.bin`
  int64    doc_idx[n_doc_idx] sequence index where each document starts, first entry 0 and
                              last entry n_seq (so n_doc_idx = documents + 1)
  (Megatron's multimodal files append int8 modes[n_seq]; trailing bytes are ignored here.)

`<prefix>.bin`: the tokens of every sequence, back to back, in the dtype above.

RWKV-LM convention: token 0 is the end-of-document marker and is stored at the end of each
document (it is counted in that sequence's size).

Dtype codes follow Megatron-core (`DType` enum): 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
6 float64, 7 float32, 8 uint16. The float codes are refused: token ids are integers, and code 7
meant float64 in older Megatron / GPT-NeoX / RWKV-LM readers, so its meaning is ambiguous.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Iterable

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    8: np.dtype(np.uint16),
}
_FLOAT_CODES = {6: "float64", 7: "float32 (float64 in older Megatron)"}
_CODE_OF_DTYPE = {dt: code for code, dt in DTYPE_CODES.items()}


class BinIdxError(ValueError):
    """A binidx file pair is missing pieces or is inconsistent."""


def _prefix(path: str | os.PathLike) -> Path:
    """Accepts `data/foo`, `data/foo.bin` or `data/foo.idx` and returns `data/foo`."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def dtype_code(dtype) -> int:
    """The binidx dtype code of an integer NumPy dtype (ValueError for others)."""
    dt = np.dtype(dtype)
    if dt not in _CODE_OF_DTYPE:
        names = ", ".join(str(d) for d in _CODE_OF_DTYPE)
        raise ValueError(f"dtype={dt} cannot be stored in binidx; use one of {names}")
    return _CODE_OF_DTYPE[dt]


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    return np.dtype(np.uint16) if vocab_size <= 65536 else np.dtype(np.int32)


class BinIdxDataset:
    """Read-only, memory-mapped view of `<prefix>.bin` / `<prefix>.idx`.

    Nothing is loaded into RAM beyond the index arrays' pages that are touched. Opening validates
    the header, the index length, pointer order/alignment and that `.bin` covers every sequence.

    Attributes:
      prefix: path without extension.
      dtype: token dtype of `.bin`.
      sizes: int32 [n_seq], tokens per sequence (read-only view of the index).
      pointers: int64 [n_seq], byte offset of each sequence in `.bin`.
      doc_idx: int64 [n_doc_idx], sequence index where each document starts (last = n_seq).
    """

    def __init__(self, path: str | os.PathLike):
        self.prefix = _prefix(path)
        self.idx_path = Path(f"{self.prefix}.idx")
        self.bin_path = Path(f"{self.prefix}.bin")
        for p in (self.idx_path, self.bin_path):
            if not p.is_file():
                raise FileNotFoundError(f"{p}: binidx file not found (expected {self.prefix}.idx and .bin)")
        self._read_index()
        self._check_bin()

    # ----------------------------------------------------------------------------- opening
    def _read_index(self) -> None:
        name = self.idx_path
        file_bytes = self.idx_path.stat().st_size
        with open(self.idx_path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            raise BinIdxError(f"{name}: bad magic {head[:len(MAGIC)]!r}, expected {MAGIC!r} (not a binidx .idx file)")
        if len(head) < HEADER_BYTES:
            raise BinIdxError(f"{name}: truncated .idx: header needs {HEADER_BYTES} bytes, file has {file_bytes}")
        (version,) = struct.unpack_from("<Q", head, 9)
        if version != VERSION:
            raise BinIdxError(f"{name}: unsupported binidx version {version} (only version {VERSION} is supported)")
        code = head[17]
        if code in _FLOAT_CODES:
            raise BinIdxError(f"{name}: dtype code {code} ({_FLOAT_CODES[code]}) is not an integer token dtype")
        if code not in DTYPE_CODES:
            raise BinIdxError(f"{name}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = DTYPE_CODES[code]
        n_seq, n_doc = struct.unpack_from("<QQ", head, 18)
        need = HEADER_BYTES + 4 * n_seq + 8 * n_seq + 8 * n_doc
        if file_bytes < need:
            raise BinIdxError(
                f"{name}: truncated .idx: header declares {n_seq} sequences and {n_doc} doc_idx entries "
                f"({need} bytes), file has {file_bytes} bytes")
        mm = np.memmap(self.idx_path, dtype=np.uint8, mode="r")
        off = HEADER_BYTES
        self.sizes = np.frombuffer(mm, dtype="<i4", count=n_seq, offset=off)
        off += 4 * n_seq
        self.pointers = np.frombuffer(mm, dtype="<i8", count=n_seq, offset=off)
        off += 8 * n_seq
        self.doc_idx = np.frombuffer(mm, dtype="<i8", count=n_doc, offset=off)
        self._idx_mm = mm
        if n_seq and int(self.sizes.min()) < 0:
            raise BinIdxError(f"{name}: negative sequence size at sequence {int(np.argmin(self.sizes))}")
        if n_seq > 1 and not np.all(np.diff(self.pointers) >= 0):
            bad = int(np.argmax(np.diff(self.pointers) < 0)) + 1
            raise BinIdxError(f"{name}: non-monotone pointers: pointer[{bad}] < pointer[{bad - 1}]")
        if n_seq and (int(self.pointers[0]) < 0 or np.any(self.pointers % self.dtype.itemsize)):
            raise BinIdxError(f"{name}: pointers must be non-negative multiples of {self.dtype.itemsize} bytes")
        if n_doc and (not np.all(np.diff(self.doc_idx) >= 0) or self.doc_idx[0] < 0 or self.doc_idx[-1] > n_seq):
            raise BinIdxError(f"{name}: doc_idx must be non-decreasing within [0, {n_seq}]")

    def _check_bin(self) -> None:
        bin_bytes = self.bin_path.stat().st_size
        if len(self.sizes):
            ends = self.pointers + self.sizes.astype(np.int64) * self.dtype.itemsize
            need = int(ends.max())
        else:
            need = 0
        if bin_bytes < need:
            raise BinIdxError(
                f"{self.bin_path}: .bin shorter than the index says: needs {need} bytes, file has {bin_bytes}")
        self._data_bytes = need
        if need == 0:  # np.memmap cannot map an empty file
            self.tokens = np.zeros((0,), dtype=self.dtype)
        else:
            self.tokens = np.memmap(self.bin_path, dtype=self.dtype, mode="r",
                                    shape=(need // self.dtype.itemsize,))

    # ----------------------------------------------------------------------------- access
    @property
    def num_tokens(self) -> int:
        """Total tokens over all sequences (sum of `sizes`)."""
        return int(self.sizes.sum(dtype=np.int64))

    @property
    def num_documents(self) -> int:
        return max(len(self.doc_idx) - 1, 0)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i: int) -> np.ndarray:
        """Sequence `i` as a read-only memmap slice (dtype `self.dtype`, shape [sizes[i]])."""
        n = len(self.sizes)
        if not -n <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences in {self.prefix}")
        i %= n
        start = int(self.pointers[i]) // self.dtype.itemsize
        return self.tokens[start: start + int(self.sizes[i])]

    def sequence_bounds(self) -> np.ndarray:
        """int64 [n_seq + 1]: token offsets into `tokens` of each sequence start, plus the end.

        Only meaningful when sequences are stored back to back (as every writer does); checked.
        """
        starts = self.pointers // self.dtype.itemsize
        ends = starts + self.sizes
        if len(starts) > 1 and np.any(starts[1:] != ends[:-1]):
            raise BinIdxError(f"{self.idx_path}: sequences are not stored contiguously")
        first = int(starts[0]) if len(starts) else 0
        return np.concatenate([[first], ends]).astype(np.int64)

    def __repr__(self) -> str:
        return (f"BinIdxDataset({str(self.prefix)!r}, dtype={self.dtype}, sequences={len(self)}, "
                f"tokens={self.num_tokens})")


class BinIdxWriter:
    """Streams documents into `<prefix>.bin` / `<prefix>.idx` with memory bounded by one document.

    Each `add_document` writes one sequence and closes one document. Sizes go to a temporary side
    file while writing; `close()` assembles the index in chunks. Files are written under `.tmp`
    names and renamed on a clean close, so an interrupted run never leaves a valid-looking pair.

        with BinIdxWriter("out/train", dtype=np.uint16) as w:
            w.add_document([5, 6, 7])            # stored as 5 6 7 0 when append_eod=True
    """

    _CHUNK = 1 << 20  # sequences per chunk while assembling the index

    def __init__(self, path: str | os.PathLike, dtype=np.uint16, *, append_eod: bool = False,
                 eod_id: int = 0):
        self.prefix = _prefix(path)
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.append_eod = bool(append_eod)
        self.eod_id = int(eod_id)
        info = np.iinfo(self.dtype)
        self._lo, self._hi = int(info.min), int(info.max)
        if append_eod and not self._lo <= self.eod_id <= self._hi:
            raise ValueError(f"eod_id={eod_id} does not fit dtype {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{self.prefix}.bin.tmp")
        self._sizes_tmp = Path(f"{self.prefix}.sizes.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._sizes = open(self._sizes_tmp, "wb")
        self.num_documents = 0
        self.num_tokens = 0
        self._closed = False

    def add_document(self, tokens: Iterable[int] | np.ndarray) -> int:
        """Appends one document (plus EOD if `append_eod`); returns the tokens written."""
        if self._closed:
            raise ValueError(f"{self.prefix}: writer already closed")
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.size and arr.dtype != self.dtype:
            if arr.dtype.kind not in "iu":
                raise TypeError(f"tokens must be integers, got dtype {arr.dtype}")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < self._lo or hi > self._hi:
                raise ValueError(f"token ids [{lo}, {hi}] do not fit dtype {self.dtype} of {self.prefix}.bin")
        arr = arr.astype(self.dtype, copy=False)
        if self.append_eod:
            arr = np.concatenate([arr, np.asarray([self.eod_id], dtype=self.dtype)])
        if arr.size >= 2**31:
            raise ValueError(f"a document of {arr.size} tokens exceeds binidx's int32 size field")
        self._bin.write(arr.tobytes())
        self._sizes.write(np.int32(arr.size).tobytes())
        self.num_documents += 1
        self.num_tokens += int(arr.size)
        return int(arr.size)

    def close(self) -> None:
        """Writes the index and moves both files into place."""
        if self._closed:
            return
        self._closed = True
        self._bin.close()
        self._sizes.close()
        n = self.num_documents
        idx_tmp = Path(f"{self.prefix}.idx.tmp")
        item = self.dtype.itemsize
        sizes = np.memmap(self._sizes_tmp, dtype=np.int32, mode="r", shape=(n,)) if n else np.zeros(0, np.int32)
        with open(idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, self._code, n, n + 1))
            for s in range(0, n, self._CHUNK):
                f.write(np.ascontiguousarray(sizes[s: s + self._CHUNK]).tobytes())
            offset = 0
            for s in range(0, n, self._CHUNK):
                chunk = sizes[s: s + self._CHUNK].astype(np.int64) * item
                ptr = np.cumsum(chunk) - chunk + offset
                f.write(ptr.astype("<i8").tobytes())
                offset += int(chunk.sum())
            for s in range(0, n + 1, self._CHUNK):
                f.write(np.arange(s, min(s + self._CHUNK, n + 1), dtype="<i8").tobytes())
        del sizes
        os.replace(self._bin_tmp, f"{self.prefix}.bin")
        os.replace(idx_tmp, f"{self.prefix}.idx")
        self._sizes_tmp.unlink()

    def abort(self) -> None:
        """Closes and deletes the partial files (used when an exception interrupts writing)."""
        self._closed = True
        self._bin.close()
        self._sizes.close()
        for p in (self._bin_tmp, self._sizes_tmp, Path(f"{self.prefix}.idx.tmp")):
            p.unlink(missing_ok=True)

    def __enter__(self) -> "BinIdxWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_binidx(path: str | os.PathLike, documents: Iterable[Iterable[int]], dtype=np.uint16, *,
                 append_eod: bool = False, eod_id: int = 0) -> BinIdxDataset:
    """Writes every document of `documents` and returns the opened dataset."""
    with BinIdxWriter(path, dtype, append_eod=append_eod, eod_id=eod_id) as w:
        for doc in documents:
            w.add_document(doc)
    return BinIdxDataset(path)
