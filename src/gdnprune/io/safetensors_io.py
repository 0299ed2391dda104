"""Minimal safetensors file I/O without torch: read headers, write headers, copy byte ranges.

A safetensors file is ``[8-byte little-endian header length N][N bytes of JSON header][data]``. The
header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative
to the start of the data) and may hold a ``"__metadata__"`` dict of strings. The data regions are
contiguous and cover the whole data section. The JSON may be followed by spaces; safetensors pads it so
that the data starts at a multiple of 8 bytes.

Checkpoint surgery uses this module to copy the bytes of unchanged tensors straight from the source
file to the output file (``os.copy_file_range``, then ``os.sendfile``, then plain reads and writes),
so that those tensors never pass through Python memory. Nothing here imports torch.
"""

from __future__ import annotations

import errno as _errno
import json
import os
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from json.encoder import encode_basestring

__all__ = [
    "CheckpointError",
    "DTYPE_BITS",
    "TensorInfo",
    "ShardHeader",
    "read_header",
    "encode_header",
    "frame_header",
    "header_json",
    "BLOCK",
    "copy_range",
    "write_all",
]

#: Bits per element of every dtype safetensors knows (sub-byte types are packed).
DTYPE_BITS = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}

_MAX_HEADER = 100_000_000  # the limit safetensors itself enforces
_CHUNK = 64 << 20  # bytes per copy call (progress granularity); a multiple of BLOCK
#: Block size that copies align to: a file system that shares extents (XFS with reflink, btrfs) clones the
#: whole blocks of a byte range copied between equal offsets modulo its block size (4 KiB by default).
BLOCK = 4096


class CheckpointError(ValueError):
    """A checkpoint folder or file that cannot be used: unreadable, corrupt, or not what was expected."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file, as its header describes it.

    Attributes:
        name: the tensor name (state-dict key).
        dtype: the safetensors dtype string (``"BF16"``, ``"F32"``, ...).
        shape: the tensor shape.
        start: absolute byte offset of the first data byte in the file.
        end: absolute byte offset one past the last data byte.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return self.end - self.start

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class ShardHeader:
    """The parsed header of one safetensors file.

    Attributes:
        path: the file.
        header_size: ``N``, the length of the JSON header (data starts at ``8 + N``).
        metadata: the ``__metadata__`` dict, or None.
        tensors: tensor name -> :class:`TensorInfo`, ordered by data offset.
        file_size: size of the file in bytes.
        mtime_ns: modification time of the file when the header was read.
    """

    path: str
    header_size: int
    metadata: dict[str, str] | None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    file_size: int = 0
    mtime_ns: int = 0

    @property
    def data_start(self) -> int:
        """Absolute offset of the data section."""
        return 8 + self.header_size


def _fail(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"{path}: not a valid safetensors file: {what}")


#: headers already read, by file identity (device, inode, size, modification time): a command reads a model's
#: headers more than once (its checks, the model's loading), and parsing tens of thousands of entries costs
#: seconds each time. A file that changes gets a new key.
_HEADERS: dict[tuple[int, int, int, int], ShardHeader] = {}
_HEADERS_KEPT = 256


def read_header(path: str | os.PathLike) -> ShardHeader:
    """Read and validate the header of the safetensors file ``path`` (reads only the header bytes; a file read
    before and unchanged since, by identity, size and modification time, is not read again).

    Checks what safetensors checks: a sane header length, a JSON object of tensor entries with a known
    dtype, a shape of non-negative integers and ``data_offsets`` whose length matches dtype and shape,
    and data regions that tile the data section exactly up to the end of the file.

    Raises:
        CheckpointError: the file cannot be read or is not a valid safetensors file.
    """
    path = os.fspath(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    known = _HEADERS.get(key)
    if known is not None and known.path == path:
        return known
    header = _read_header(path)
    if len(_HEADERS) >= _HEADERS_KEPT:
        _HEADERS.pop(next(iter(_HEADERS)))
    _HEADERS[key] = header
    return header


def _read_header(path: str) -> ShardHeader:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, f"file has {size} bytes, expected at least 8")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise _fail(path, f"header length {n} does not fit in a file of {size} bytes")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(path, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _fail(path, f"header is a JSON {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise _fail(path, "__metadata__ must map strings to strings")
    entries = []
    for name, entry in header.items():  # one pass of plain checks: a 512-expert model has 75,944 entries
        try:
            dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError):  # not an object (JSON's others refuse string keys), or a key missing
            raise _fail(
                path, f"tensor {name!r}: expected dtype, shape and data_offsets, found {entry!r}"[:300]
            ) from None
        bits = DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
        if bits is None:
            raise _fail(path, f"tensor {name!r}: unknown dtype {dtype!r}")
        numel = 1
        for d in shape if type(shape) is list else (None,):
            if type(d) is not int or d < 0:
                raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
            numel *= d
        if (
            type(offsets) is not list
            or len(offsets) != 2
            or type(offsets[0]) is not int
            or type(offsets[1]) is not int
        ):
            raise _fail(path, f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        expected = (numel * bits + 7) // 8
        if end - begin != expected:
            raise _fail(
                path,
                f"tensor {name!r}: {dtype} {list(shape)} needs {expected} bytes, "
                f"data_offsets {offsets} give {end - begin}",
            )
        entries.append(TensorInfo(name, dtype, tuple(shape), 8 + n + begin, 8 + n + end))
    entries.sort(key=lambda t: (t.start, t.end))
    position = 8 + n
    for info in entries:
        if info.start != position:
            raise _fail(
                path,
                f"tensor {info.name!r}: data starts at {info.start - 8 - n}, expected "
                f"{position - 8 - n} (overlapping or missing data)",
            )
        position = info.end
    if position != size:
        raise _fail(path, f"data section ends at byte {position} but the file has {size} bytes (truncated?)")
    return ShardHeader(path, n, metadata, {t.name: t for t in entries}, size, st.st_mtime_ns)


def header_json(
    entries: Iterable[tuple[str, str, Sequence[int], int, int]], metadata: Mapping | None
) -> bytes:
    """The JSON header of a safetensors file, unpadded: ``__metadata__`` first, then each entry ``(name, dtype,
    shape, begin, end)`` in the given order (what ``json.dumps`` of the header object writes, compact and
    UTF-8, without building 76k entry objects first). ``ValueError`` for a name given twice."""
    quote = encode_basestring
    parts = []
    if metadata is not None:
        parts.append(
            '"__metadata__":' + json.dumps(dict(metadata), separators=(",", ":"), ensure_ascii=False)
        )
    names: set[str] = set()
    for name, dtype, shape, begin, end in entries:
        dims = ",".join(str(int(d)) for d in shape)
        parts.append(
            f'{quote(name)}:{{"dtype":{quote(dtype)},"shape":[{dims}],"data_offsets":[{int(begin)},{int(end)}]}}'
        )
        names.add(name)
    if len(names) != len(parts) - (metadata is not None) or "__metadata__" in names:
        raise ValueError("safetensors header: expected each tensor name once (and none named __metadata__)")
    return ("{" + ",".join(parts) + "}").encode("utf-8")


def frame_header(raw: bytes, *, size: int | None = None) -> bytes:
    """The first ``8 + N`` bytes of a safetensors file from its JSON header ``raw`` (:func:`header_json`):
    the length prefix and the JSON padded with spaces, to a multiple of 8 bytes as safetensors does, or to
    exactly ``size`` bytes (a multiple of 8 reserved in advance).

    Raises:
        ValueError: the header does not fit in ``size`` bytes, or ``size`` is not a multiple of 8.
    """
    if size is None:
        size = len(raw) + (-len(raw) % 8)
    if size % 8 or len(raw) > size:
        raise ValueError(f"safetensors header of {len(raw)} bytes does not fit in {size} reserved bytes")
    return struct.pack("<Q", size) + raw + b" " * (size - len(raw))


def encode_header(
    entries: Iterable[tuple[str, str, Sequence[int], int, int]],
    metadata: Mapping[str, str] | None,
    *,
    size: int | None = None,
) -> bytes:
    """:func:`frame_header` of :func:`header_json`: ``entries`` are ``(name, dtype, shape, begin, end)`` with
    offsets relative to the data section."""
    return frame_header(header_json(entries, metadata), size=size)


def write_all(fd: int, data, offset: int | None = None) -> int:
    """Write the whole bytes-like ``data`` to ``fd`` (at ``offset`` with pwrite, else at the file position)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        if offset is None:
            done += os.write(fd, view[done:])
        else:
            done += os.pwrite(fd, view[done:], offset + done)
    return done


def copy_range(
    src_fd: int,
    dst_fd: int,
    offset: int,
    count: int,
    *,
    dst_offset: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> None:
    """Copy ``count`` bytes at ``offset`` of ``src_fd`` to ``dst_offset`` of ``dst_fd`` (default: its current
    position, which then moves past the copy).

    Uses ``os.copy_file_range`` (the kernel copies without the data entering this process, or shares the
    blocks on a file system with reflinks), falls back to ``os.sendfile`` and then to chunked
    ``pread``/``write``. The calls cover at most 64 MiB and begin at multiples of :data:`BLOCK` of the
    source after the first (which ends at one): a call whose offsets are not both block-aligned is copied
    whole, so this way every block of a range with ``dst_offset - offset`` a multiple of :data:`BLOCK`
    can be shared. ``on_chunk(n)`` is called after each call (progress, interruption checks).
    """
    end = offset + count
    if dst_offset is None:
        dst_offset = os.lseek(dst_fd, 0, os.SEEK_CUR)
        os.lseek(dst_fd, count, os.SEEK_CUR)
    shift = dst_offset - offset
    method = _copy_method
    while offset < end:
        n = min(end - offset, (BLOCK - offset % BLOCK) if offset % BLOCK else _CHUNK)
        done = method(src_fd, dst_fd, offset, n, offset + shift)
        if done is None:  # this method is not available here: try the next one
            method = _FALLBACKS[method]
            continue
        if done == 0:
            raise OSError(f"unexpected end of file while copying {n} bytes at offset {offset}")
        offset += done
        if on_chunk is not None:
            on_chunk(done)


def write_vectors(fd: int, buffers: Sequence, offset: int) -> int:
    """Write ``buffers`` (bytes or 1-D byte memoryviews) one after the other at ``offset`` of ``fd``.

    ``os.pwritev`` with up to ``IOV_MAX`` buffers per call (one kernel copy, e.g. straight from memory-mapped
    source rows into the page cache); one ``pwrite`` per buffer where ``pwritev`` does not exist. Returns
    the bytes written.
    """
    if not _HAVE_PWRITEV:
        total = 0
        for b in buffers:
            total += write_all(fd, b, offset + total)
        return total
    pending = list(buffers)
    total = i = 0
    while i < len(pending):
        batch = pending[i : i + _IOV_MAX]
        n = os.pwritev(fd, batch, offset + total)
        total += n
        if n == sum(map(len, batch)):
            i += len(batch)
            continue
        if n == 0:
            raise OSError(f"pwritev wrote nothing at offset {offset + total}")
        for b in batch:  # a short write: skip what was written, resume inside the first unfinished buffer
            if n < len(b):
                pending[i] = memoryview(b)[n:]
                break
            n -= len(b)
            i += 1
    return total


def _copy_file_range(src_fd: int, dst_fd: int, offset: int, n: int, dst_offset: int) -> int | None:
    try:
        return os.copy_file_range(src_fd, dst_fd, n, offset, dst_offset)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _UNSUPPORTED:
            raise
        return None


def _sendfile(src_fd: int, dst_fd: int, offset: int, n: int, dst_offset: int) -> int | None:
    try:
        os.lseek(dst_fd, dst_offset, os.SEEK_SET)
        return os.sendfile(dst_fd, src_fd, offset, n)
    except (AttributeError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _UNSUPPORTED:
            raise
        return None


def _read_write(src_fd: int, dst_fd: int, offset: int, n: int, dst_offset: int) -> int:
    data = os.pread(src_fd, min(n, 16 << 20), offset)
    if data:
        write_all(dst_fd, data, dst_offset)
    return len(data)


_UNSUPPORTED = {
    _errno.EXDEV,
    _errno.ENOSYS,
    _errno.EINVAL,
    _errno.EOPNOTSUPP,
    _errno.ENOTSUP,
    _errno.EBADF,
    _errno.EPERM,
}
_FALLBACKS = {_copy_file_range: _sendfile, _sendfile: _read_write}
_copy_method = _copy_file_range
_HAVE_PWRITEV = hasattr(os, "pwritev")
_IOV_MAX = (
    min(1024, os.sysconf("SC_IOV_MAX")) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
)
