"""The streaming engine: output shard plans, the GDN gather jobs, and the byte copies behind a transform.

Every output shard has the same file name and holds the same tensors, in the same order, as the source
shard; only the GDN tensors change (their bytes, and their size when slicing). The bytes of tensors that
are not GDN tensors (attention, MLP/MoE, embeddings, vision tower, ``mtp.*``) are copied from the source
file to the output file by byte range in the kernel (``copy_file_range``), so they come out
byte-identical and never enter the process; the header is padded so that they keep their source offsets
modulo the block size, and a file system that shares extents (XFS with reflink, btrfs) clones them
instead of copying (:class:`ShardPlan`). GDN tensors are gathered one at a time with the layout tables
(:mod:`gdnprune.model.layouts`) and the canonical indices of :mod:`gdnprune.model.geometry` — the same ones the torch
API uses — as byte gathers, which need no dtype support (:func:`_write_job`): the source tensor is read
with ``pread`` into a reusable buffer (never memory-mapped: a file truncated meanwhile gives an error, not
a SIGBUS); rows are written with vectored ``pwritev`` calls, runs of consecutive rows coalesced, or copied
in the kernel when the runs are long; columns (``out_proj``) are gathered with ``numpy.take``. A GDN layer
whose tensors straddle two shards needs nothing special. The header is written last.

:mod:`gdnprune.checkpoint.transform` drives it with two threads: the main thread copies the unchanged
bytes (:func:`copy_unchanged`), shard by shard from the first; a worker runs GDN jobs (:meth:`GDNWork.run`)
from the last shard, then copies unchanged pieces of the large shards from their end until it meets the
main thread (:meth:`ShardPlan.claim`), so that both cores copy until the end; a main thread done first
takes GDN jobs too. Nothing here imports torch.

OLMo-hybrid stores its fused conv on disk as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (transformers
writes equal thirds, whatever the q/k/v sizes). They are read as one conv (concatenated in that order),
gathered, and written back split into the real q, k and v sizes; transformers concatenates them again on
load.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..io.safetensors_io import (
    BLOCK,
    DTYPE_BITS,
    ShardHeader,
    TensorInfo,
    copy_range,
    frame_header,
    header_json,
    write_all,
    write_vectors,
)
from ..model import geometry
from ..model.layouts import scale_name, segment_size
from .codecs import from_float, to_float
from .folder import Checkpoint, CheckpointError, GDNLayer

__all__ = [
    "LayerPlan",
    "ShardPlan",
    "GDNWork",
    "InputChangedError",
    "plan_layer",
    "plan_shards",
    "copy_unchanged",
    "write_header",
    "check_unchanged",
]


@dataclass
class LayerPlan:
    """What happens to one GDN layer: its geometry after the gather, the canonical indices, the orders."""

    layer: GDNLayer
    target: Any  # GDNShape after the gather
    indices: dict  # canonical indices for shape -> target, with didx (gdnprune.model.geometry.check_indices)
    permutation: Any  # the four orders (numpy) or None
    dequantize: frozenset = (
        frozenset()
    )  # FP8 weight suffixes written dequantised in BF16 (their scales dropped)
    hidden: Any = None  # the hidden channels' HiddenCut (gdnprune.model.hidden): one more gather, or None

    def scale_of(self, weight: str) -> str:

        return scale_name(weight)

    def gathers(self, suffix: str) -> list[tuple[int, Any]]:
        """``(axis, source index)`` of on-disk tensor ``suffix``: its layout's axis, then its hidden axes."""
        out = []
        rule = self.layer.rule(suffix)
        if rule is not None:
            out.append((rule.axis, rule.gather_index(self.layer.shape, self.target, self.indices)))
        if self.hidden is not None:
            out += self.hidden.gathers(self.layer.name(suffix))
        return out

    @property
    def dropped(self) -> set[str]:
        """Suffixes of the layer that the output does not have (the scales of dequantised weights)."""
        return {self.scale_of(w) for w in self.dequantize}


def plan_layer(layer: GDNLayer, target, orders) -> LayerPlan:
    """The :class:`LayerPlan` of ``layer`` cut to ``target`` (a checked GDNShape) after ``orders`` (or None)."""

    if orders is None:
        indices = geometry.prefix_indices(layer.shape, target)
    else:
        indices = geometry.order_indices(orders, layer.shape, target)
    return LayerPlan(layer, target, geometry.check_indices(indices, layer.shape, target), orders)


@dataclass
class ShardPlan:
    """One output shard: the tensors of the source shard in the source's order, GDN tensors at their
    gathered size (:meth:`lay_out`, once the GDN shapes are known).

    Runs of unchanged tensors are contiguous in both files: ``runs`` (``(source offset, output offset,
    length)``, absolute), split into ``pieces`` of at most 64 MiB that two threads can share (:meth:`claim`).
    The header is padded with spaces (as safetensors allows) so that the data section starts where most
    unchanged bytes land at the same offset modulo :data:`~gdnprune.io.safetensors_io.BLOCK` as in the
    source: a file system that shares extents (XFS with reflink, btrfs) then clones those blocks instead
    of copying them, and ext4 copies whole pages. A sort changes no size, so its output has the source's
    layout and every unchanged block can be shared. ``gdn_entries``: name -> dtype, shape, begin, end
    (relative to the data section) of every GDN tensor.
    """

    index: int
    src: ShardHeader
    dst: str
    gdn: list[str]
    header: bytes = b""
    runs: list[tuple[int, int, int]] = field(default_factory=list)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    gdn_entries: dict = field(default_factory=dict)
    _entries: list[tuple] = field(default_factory=list, repr=False)
    _claimed: list[int] = field(
        default_factory=lambda: [0, 0], repr=False
    )  # pieces taken from the front, back
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def data_start(self) -> int:
        return len(self.header)

    @property
    def unchanged_bytes(self) -> int:
        return sum(length for _, _, length in self.runs)

    def entries(self) -> list[tuple]:
        """``(name, dtype, shape, begin, end)`` of every output tensor, in file order."""
        return list(self._entries)

    def lay_out(
        self,
        gdn_shapes: Mapping[str, tuple[int, ...]],
        dtypes: Mapping[str, str] | None = None,
        dropped: Collection[str] = frozenset(),
        names: Mapping[str, str | None] | None = None,
    ) -> None:
        """Place every tensor (GDN tensor ``name`` gets shape ``gdn_shapes[name]`` and dtype ``dtypes[name]``
        when given; tensors in ``dropped`` are left out; ``names`` renames source tensors in the output, a
        gather over names: per-expert tensors renumbered, layers renumbered after a removal) and build the
        header."""
        entries: list[tuple[str, str, tuple[int, ...], int, int]] = []
        runs: list[list[int]] = []
        position = 0
        dtypes, names = dtypes or {}, names or {}
        for t in self.src.tensors.values():  # ordered by offset
            new_name = names.get(t.name, t.name)
            if t.name in dropped or new_name is None:
                continue
            dtype = dtypes.get(t.name, t.dtype)
            if t.name in gdn_shapes:
                shape = tuple(gdn_shapes[t.name])
                nbytes = math.prod(shape) * DTYPE_BITS[dtype] // 8  # GDN dtypes are whole bytes
                self.gdn_entries[t.name] = (dtype, shape, position, position + nbytes)
            else:
                shape, nbytes = t.shape, t.nbytes
                if runs and runs[-1][0] + runs[-1][2] == t.start and runs[-1][1] + runs[-1][2] == position:
                    runs[-1][2] += nbytes
                elif nbytes:
                    runs.append([t.start, position, nbytes])
            entries.append((new_name, dtype, shape, position, position + nbytes))
            position += nbytes
        raw = header_json(entries, self.src.metadata)
        data_start = _aligned_start(len(frame_header(raw)), runs)
        self.header = frame_header(raw, size=data_start - 8)
        self.runs = [(src, data_start + dst, length) for src, dst, length in runs]
        self.pieces = []
        for src, dst, length in self.runs:  # cut at source offsets that are multiples of _PIECE (and BLOCK)
            begin, end = src, src + length
            while begin < end:
                stop = min(end, (begin // _PIECE + 1) * _PIECE)
                self.pieces.append((begin, dst + begin - src, stop - begin))
                begin = stop
        self._entries = entries

    def claim(self, back: bool = False) -> tuple[int, int, int] | None:
        """The next piece of unchanged bytes that no thread has taken, from the front (the main thread's
        order) or from the back (the GDN worker's, once its jobs are done); None when all are taken."""
        with self._lock:
            front, taken = self._claimed
            if front + taken >= len(self.pieces):
                return None
            self._claimed[back] += 1
            return self.pieces[len(self.pieces) - 1 - taken] if back else self.pieces[front]


#: unchanged bytes are copied in pieces of at most this size (a multiple of BLOCK), which two threads may share
_PIECE = 64 << 20
#: the GDN worker helps copy the unchanged bytes of shards that hold at least this many (smaller copies are
#: not worth a second thread writing into the same files)
_SHARE_MIN = 2 * _PIECE


def _aligned_start(minimum: int, runs: list) -> int:
    """The data start (at least ``minimum``, a multiple of 8 as safetensors writes it) that puts the most
    whole blocks of the unchanged ``runs`` (source offset, offset in the data section, length) at their
    source offset modulo :data:`BLOCK`; ``minimum`` when no run spans a whole block."""
    shared: dict[int, int] = {}
    for src, dst, length in runs:
        residue = (src - dst) % BLOCK
        blocks = (src + length) // BLOCK - -(-src // BLOCK)
        if residue % 8 == 0 and blocks > 0:
            shared[residue] = shared.get(residue, 0) + blocks
    if not shared:
        return minimum
    best = max(shared, key=lambda r: (shared[r], -((r - minimum) % BLOCK)))
    return minimum + (best - minimum) % BLOCK


def plan_shards(ckpt: Checkpoint, gdn_names: set[str], tmp: Path) -> list[ShardPlan]:
    """The output shards (one per source shard, same file name in ``tmp``); :class:`GDNWork` lays them out."""
    return [
        ShardPlan(
            i, shard, str(tmp / os.path.basename(shard.path)), [n for n in shard.tensors if n in gdn_names]
        )
        for i, shard in enumerate(ckpt.shards)
    ]


def copy_unchanged(plan: ShardPlan, on_chunk: Callable[[int], None]) -> None:
    """Copy the unchanged tensors of one shard in the kernel (shared, not copied, where the file system can)."""
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        src = os.open(plan.src.path, os.O_RDONLY)
        try:
            while (piece := plan.claim()) is not None:
                _copy(src, fd, plan.src.path, piece, on_chunk)
        finally:
            os.close(src)
    finally:
        os.close(fd)


def _copy(src: int, dst: int, path: str, piece: tuple[int, int, int], on_chunk=None) -> None:
    """:func:`copy_range` of ``piece`` (source offset in ``path``, output offset, length); a file that became
    shorter than its header says is an :class:`InputChangedError`."""
    begin, dst_offset, length = piece
    try:
        copy_range(src, dst, begin, length, dst_offset=dst_offset, on_chunk=on_chunk)
    except OSError as exc:
        if os.fstat(src).st_size < begin + length:
            raise InputChangedError(
                f"{path}: input changed while reading: the file is now shorter than its header says; do not "
                f"modify a checkpoint while gdnprune reads it"
            ) from None
        raise exc


def write_header(plan: ShardPlan) -> int:
    """Write the shard's header (last, when every tensor is in place); returns its size."""
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        write_all(fd, plan.header, 0)
        os.ftruncate(fd, plan.data_start + (plan._entries[-1][4] if plan._entries else 0))
    finally:
        os.close(fd)
    return len(plan.header)


class GDNWork:
    """The GDN half of a transform.

    Built from the layer plans, it lays out every output shard (:meth:`ShardPlan.lay_out`: the GDN shapes
    are known). Then :meth:`run` may be called from several threads: each takes the next job (one on-disk
    tensor, or all pieces of a fused tensor stored split) and writes it at its final offset (see
    :func:`_write_job`). No torch: the indices come from :mod:`gdnprune.model.geometry` and the gathers are byte
    gathers of source tensors read with ``pread`` (a file truncated meanwhile gives an error, never a
    SIGBUS as a memory map would) or copied in the kernel.
    """

    def __init__(
        self,
        ckpt: Checkpoint,
        shards: list[ShardPlan],
        plans: dict[str, LayerPlan],
        *,
        names: Mapping[str, str | None] | None = None,
    ):
        self.ckpt, self.shards, self.plans, self.names = ckpt, shards, plans, dict(names or {})
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.jobs: list[tuple[LayerPlan, str]] = []
        self.next_job = 0
        self.bytes_done = 0
        self._shard_of: dict[str, ShardPlan] = {}
        owner = {plan.layer.name(s): (plan, s) for plan in plans.values() for s in plan.layer.tensors}
        if set(owner) != {n for shard in shards for n in shard.gdn}:
            raise RuntimeError("internal error: the copy plan and the GDN layers disagree")
        jobs_seen = set()
        for shard in self.shards:
            shapes, dtypes, dropped = {}, {}, set()
            for name in shard.gdn:
                plan, suffix = owner[name]
                if suffix in plan.dropped:
                    dropped.add(name)
                    continue
                if suffix in plan.dequantize:
                    dtypes[name] = "BF16"
                shapes[name] = _out_shape(plan, suffix)
                self._shard_of[name] = shard
                job = (plan.layer.prefix, _fused_of(plan.layer, suffix) or suffix)
                if job not in jobs_seen:  # the pieces of a split fused tensor are one job
                    jobs_seen.add(job)
                    self.jobs.append((plan, job[1]))
            shard.lay_out(shapes, dtypes, dropped, self.names)
        self.total_bytes = sum(
            end - begin for shard in shards for _, _, begin, end in shard.gdn_entries.values()
        )
        self.dropped = {plan.layer.name(s) for plan in plans.values() for s in plan.dropped}
        self.dropped |= {name for name, new in self.names.items() if new is None}
        # The main thread copies the unchanged bytes shard by shard from the first; the GDN jobs start from
        # the last shard, so that the two threads write different files (writes to one file serialise,
        # presumably on its inode lock: measured 1.9 s of waiting on the benchmark checkpoint) until they meet.
        self.jobs.reverse()

    def run(self, after_job: Callable[[], None] | None = None) -> None:
        """Run jobs until none is left, :attr:`stop` is set or some thread failed; then help copy the
        unchanged bytes of the large shards, from the last shard's end (:meth:`ShardPlan.claim`)."""
        files = _SourceFiles(self.ckpt)
        try:
            while not self.stop.is_set() and self.error is None:
                with self.lock:
                    if self.next_job >= len(self.jobs):
                        break
                    plan, suffix = self.jobs[self.next_job]
                    self.next_job += 1
                self._done(_write_job(plan, suffix, files, self._destination), after_job)
            for shard in reversed(self.shards):
                if shard.unchanged_bytes >= _SHARE_MIN:
                    self._help_copy(shard, files, after_job)
        finally:
            files.close()

    def _help_copy(self, shard: ShardPlan, files: _SourceFiles, after_job) -> None:
        """Copy unchanged pieces of ``shard`` from its end until the main thread's copy meets them."""
        fd = None
        try:
            while not self.stop.is_set() and self.error is None and (piece := shard.claim(back=True)):
                fd = os.open(shard.dst, os.O_WRONLY | os.O_CREAT, 0o666) if fd is None else fd
                src, path = files.fd(next(iter(shard.src.tensors)))
                _copy(src, fd, path, piece)
                self._done(piece[2], after_job)
        finally:
            if fd is not None:
                os.close(fd)

    def _done(self, written: int, after_job: Callable[[], None] | None) -> None:
        with self.lock:
            self.bytes_done += written
        if after_job is not None:
            after_job()

    def _destination(self, plan: LayerPlan, suffix: str) -> tuple[str, int, tuple[int, ...]]:
        """Output file, absolute offset and planned shape of on-disk tensor ``suffix`` of a layer."""
        name = plan.layer.name(suffix)
        shard = self._shard_of[name]
        _, shape, begin, _ = shard.gdn_entries[name]
        return shard.dst, shard.data_start + begin, shape


#: a row gather whose runs of consecutive rows average at least this many bytes is copied in the kernel, run
#: by run (one copy, no read of the rows it drops); below it one read and vectored writes cost less
_KERNEL_RUN = 64 << 10


class InputChangedError(CheckpointError):
    """A source shard changed (truncated, rewritten) while it was being read."""


class _SourceFiles:
    """One thread's read-only file descriptors of the source shards (at most two open at a time) and its two
    reusable buffers (source bytes, gathered bytes): a tensor read into a fresh allocation pays for page
    faults, zeroing and an unmap (with a TLB shootdown of the other thread) every time."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.open: dict[int, int] = {}
        self.buffers: list = [b"", b""]

    def fd(self, name: str) -> tuple[int, str]:
        """A read-only descriptor and the path of the shard that holds tensor ``name``."""
        i = self.ckpt.shard_of(name)
        if i not in self.open:
            if len(self.open) >= 2:
                os.close(self.open.pop(next(iter(self.open))))
            self.open[i] = os.open(self.ckpt.shards[i].path, os.O_RDONLY)
        return self.open[i], self.ckpt.shards[i].path

    def buffer(self, which: int, nbytes: int) -> memoryview:
        """``nbytes`` of reusable buffer ``which`` (0: source bytes, 1: gathered bytes), valid until the next call."""
        if len(self.buffers[which]) < nbytes:
            self.buffers[which] = b""  # release the old one first
            self.buffers[which] = np.empty(nbytes, dtype=np.uint8)  # not zeroed (bytearray would)
        return memoryview(self.buffers[which])[:nbytes]

    def read(self, names: list[str]) -> list[tuple[TensorInfo, memoryview]]:
        """The header entries of tensors ``names`` and their bytes, read with ``pread`` into buffer 0 (valid
        until the next read)."""
        infos = [self.ckpt.tensor(n) for n in names]
        view, out, position = self.buffer(0, sum(i.nbytes for i in infos)), [], 0
        for info in infos:
            fd, path = self.fd(info.name)
            done = 0
            while done < info.nbytes:
                n = os.preadv(fd, [view[position + done : position + info.nbytes]], info.start + done)
                if n == 0:
                    raise InputChangedError(
                        f"{path}: input changed while reading: the file ends before tensor {info.name!r} (bytes "
                        f"{info.start}-{info.end}); do not modify a checkpoint while gdnprune reads it"
                    )
                done += n
            out.append((info, view[position : position + info.nbytes]))
            position += info.nbytes
        return out

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()
        self.buffers = [b"", b""]


def _byte_view(info: TensorInfo, data, axis: int):
    """A zero-copy numpy view of a tensor's bytes in which gathering along ``axis`` is a byte gather.

    Axis 0: ``[rows, row bytes]`` of uint8; other axes: the tensor's shape with an unsigned integer of the
    dtype's width (GDN tensors are F16/BF16/F32/F64, checked by :func:`find_gdn_layers`).
    """

    if axis == 0:
        return np.frombuffer(data, dtype=np.uint8).reshape(info.shape[0], -1)
    width = DTYPE_BITS[info.dtype] // 8
    return np.frombuffer(data, dtype=f"<u{width}").reshape(info.shape)


def _runs(index, unit: int):
    """Runs of consecutive entries of ``index``: their starts (in units of ``unit`` bytes) and lengths in bytes."""

    starts = np.flatnonzero(np.diff(index, prepend=-2) != 1)
    return index[starts] * unit, np.diff(starts, append=index.size) * unit


def _take_blocks(array, index, axis: int, out):
    """``numpy.take(array, index, axis)`` into ``out``, moving whole blocks where ``index`` allows it: when
    every run of consecutive indices has a length and a start that are multiples of ``b``, the gather is
    one of blocks of ``b`` elements (a head of ``dv`` columns of ``out_proj``, say), ``b`` times fewer moves."""

    begin, lengths = _runs(index, 1)
    b = math.gcd(array.shape[axis], *begin.tolist(), *lengths.tolist()) or 1
    split = array.shape[:axis] + (array.shape[axis] // b, b) + array.shape[axis + 1 :]
    out_split = out.shape[:axis] + (out.shape[axis] // b, b) + out.shape[axis + 1 :]
    # mode="clip" gathers straight into `out` ("raise" buffers it); the indices were checked by check_indices
    np.take(array.reshape(split), index[::b] // b, axis=axis, out=out.reshape(out_split), mode="clip")
    return out


def _write_job(plan: LayerPlan, suffix: str, files: _SourceFiles, destination) -> int:
    """Gather on-disk tensor ``suffix`` of a layer (or all pieces of the split fused tensor ``suffix``) to
    the plan's target and write it at its place in the output; returns the bytes written.

    A row gather alone (axis 0) whose runs of consecutive rows are long (a slice of whole heads) is copied
    run by run in the kernel; one of short runs (a sort: single channels) reads the source tensor and writes
    the rows with vectored writes (:func:`~gdnprune.io.safetensors_io.write_vectors`: no gathered copy in
    memory). A column gather (``out_proj``), a gather along several axes (a block's own axis and the hidden
    channels) and a split fused tensor are gathered with ``numpy.take`` (whole blocks where the index allows)
    and written with ``pwrite``.
    """

    layer = plan.layer
    gathers = plan.gathers(suffix)
    if suffix in plan.dequantize:
        return _write_dequantized(plan, suffix, gathers, files, destination)
    pieces = layer.splits.get(suffix, (suffix,))
    if len(pieces) == 1:
        info = files.ckpt.tensor(layer.name(suffix))  # shape and dtype were checked by find_gdn_layers
        dst, offset, shape = destination(plan, suffix)
        if [axis for axis, _ in gathers] == [0]:
            ((_, index),) = gathers
            if index.size != shape[0]:
                raise RuntimeError(f"internal error: {info.name} gathers {index.size} rows, planned {shape}")
            begin, lengths = _runs(index, info.nbytes // info.shape[0] if info.shape[0] else 0)
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o666)
            try:
                if lengths.size and int(lengths.sum()) >= _KERNEL_RUN * lengths.size:
                    src, path = files.fd(info.name)
                    for b, n, at in zip(
                        begin.tolist(), lengths.tolist(), (offset + np.cumsum(lengths) - lengths).tolist()
                    ):
                        _copy(src, fd, path, (info.start + b, at, n))
                    return int(lengths.sum())
                ((_, data),) = files.read([info.name])
                runs = list(map(data.__getitem__, map(slice, begin.tolist(), (begin + lengths).tolist())))
                return write_vectors(fd, runs, offset)
            finally:
                os.close(fd)
        ((_, data),) = files.read([info.name])
        out = {suffix: _take_axes(info, data, gathers, files)}
    else:  # a fused tensor stored split (OLMo-hybrid's q/k/v conv): gather the concatenation, split again
        ((axis, index),) = gathers  # the conv has no hidden axis
        rule = layer.rule(suffix)
        infos = files.read([layer.name(p) for p in pieces])
        whole = np.concatenate([_byte_view(info, data, axis) for info, data in infos], axis=axis)
        gathered = np.take(whole, index, axis=axis)
        bounds = np.cumsum([segment_size(kind, plan.target) for kind in rule.segments])[:-1]
        out = dict(zip(pieces, np.split(gathered, bounds, axis=axis)))
    written = 0
    for p, array in out.items():
        dst, offset, shape = destination(plan, p)
        if array.shape[0] != shape[0] or (array.ndim == len(shape) and tuple(array.shape) != tuple(shape)):
            raise RuntimeError(f"internal error: {layer.name(p)} gathered to {array.shape}, planned {shape}")
        contiguous = np.ascontiguousarray(array)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            written += write_all(fd, contiguous.reshape(-1).view(np.uint8), offset)
        finally:
            os.close(fd)
    return written


def _take_axes(info: TensorInfo, data, gathers: list, files: _SourceFiles):
    """The tensor's bytes gathered along every axis of ``gathers`` in turn (one axis: a byte view; several: the
    elements), the last gather into the reusable buffer 1."""
    width = DTYPE_BITS[info.dtype] // 8
    array = _byte_view(info, data, gathers[0][0]) if len(gathers) == 1 else np.frombuffer(data, f"<u{width}")
    array = array.reshape(info.shape) if len(gathers) > 1 else array
    for k, (axis, index) in enumerate(gathers):
        shape = array.shape[:axis] + (index.size,) + array.shape[axis + 1 :]
        last = k == len(gathers) - 1
        buffer = files.buffer(1, math.prod(shape) * array.itemsize) if last else None
        out = (
            np.empty(shape, array.dtype)
            if buffer is None
            else np.frombuffer(buffer, array.dtype).reshape(shape)
        )
        array = _take_blocks(array, index, axis, out)
    return array


def _fp8_table(dtype: str):
    """The float32 value of every byte of an FP8 format (e4m3fn: no infinities, NaN at 0x7F/0xFF; e5m2)."""

    bits = np.arange(256, dtype=np.uint32)
    sign = np.where(bits & 0x80, -1.0, 1.0)
    mant_bits, bias = (3, 7) if dtype == "F8_E4M3" else (2, 15)
    exponent = (bits >> mant_bits) & ((1 << (7 - mant_bits)) - 1)
    mantissa = (bits & ((1 << mant_bits) - 1)) / float(1 << mant_bits)
    value = np.where(
        exponent == 0,
        mantissa * 2.0 ** (1 - bias),
        (1 + mantissa) * 2.0 ** (exponent.astype(np.float64) - bias),
    )
    value = sign * value
    if dtype == "F8_E4M3":
        value[(bits & 0x7F) == 0x7F] = np.nan
    else:
        top = exponent == (1 << (7 - mant_bits)) - 1
        value[top] = np.where(mantissa[top] == 0, sign[top] * np.inf, np.nan)
    return value.astype(np.float32)


def _write_dequantized(plan: LayerPlan, suffix: str, gathers: list, files: _SourceFiles, destination) -> int:
    """An FP8 weight gathered (along every axis of ``gathers``) and written in BF16: each byte decoded, times
    its block's scale."""

    layer = plan.layer
    (info, data), (scale_info, scale_data) = files.read(
        [layer.name(suffix), layer.name(plan.scale_of(suffix))]
    )
    weight = _fp8_table(info.dtype)[np.frombuffer(data, dtype=np.uint8)].reshape(info.shape)
    scale = (
        to_float(scale_data, scale_info.dtype, scale_info.shape)
        if scale_info.dtype != "F8_E8M0"
        else np.exp2(np.frombuffer(scale_data, dtype=np.uint8).astype(np.float64) - 127).reshape(
            scale_info.shape
        )
    )
    rows, cols = info.shape
    block_rows, block_cols = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
    full = np.repeat(np.repeat(scale, block_rows, axis=0)[:rows], block_cols, axis=1)[:, :cols]
    values = weight.astype(np.float64) * full
    for axis, index in gathers:
        values = np.take(values, index, axis=axis)
    dst, offset, shape = destination(plan, suffix)
    if values.shape != tuple(shape):
        raise RuntimeError(f"internal error: {info.name} dequantised to {values.shape}, planned {shape}")
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        return write_all(fd, from_float(values, "BF16"), offset)
    finally:
        os.close(fd)


def _fused_of(layer: GDNLayer, suffix: str) -> str | None:
    """The fused tensor that on-disk tensor ``suffix`` is a piece of, or None."""
    return next((fused for fused, pieces in layer.splits.items() if suffix in pieces), None)


def _out_shape(plan: LayerPlan, suffix: str) -> tuple[int, ...]:
    """Shape of on-disk tensor ``suffix`` of a layer after its gathers (a split fused tensor's piece: its segment)."""
    layer = plan.layer
    shape = list(layer.tensors[suffix].shape)
    fused = _fused_of(layer, suffix)
    if fused is None:
        for axis, index in plan.gathers(suffix):
            shape[axis] = int(index.size)
    else:
        rule = layer.rule(fused)
        shape[rule.axis] = segment_size(rule.segments[layer.splits[fused].index(suffix)], plan.target)
    return tuple(shape)


def check_unchanged(ckpt: Checkpoint) -> None:
    """Raise :class:`InputChangedError` when a source shard's size or modification time differs from when
    its header was read (the output would mix old and new bytes)."""
    for shard in ckpt.shards:
        try:
            st = os.stat(shard.path)
        except OSError as exc:
            raise InputChangedError(
                f"{shard.path}: input changed while reading: {exc.strerror or exc}"
            ) from None
        if (st.st_size, st.st_mtime_ns) != (shard.file_size, shard.mtime_ns):
            raise InputChangedError(
                f"{shard.path}: input changed while reading (size {shard.file_size} -> {st.st_size} bytes, "
                f"modified again); do not modify a checkpoint while gdnprune reads it"
            )
