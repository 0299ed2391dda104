"""The streaming engine: output shard plans, the GDN gather jobs, and the byte copies behind a transform.

Every output shard has the same file name and holds the same tensors as the source shard. The bytes of
tensors that are not GDN tensors (attention, MLP/MoE, embeddings, vision tower, ``mtp.*``) are copied
from the source file to the output file by byte range in the kernel (``copy_file_range``), so they come
out byte-identical and never enter the process. GDN tensors are gathered one at a time with the layout
tables (:mod:`gdnprune.layouts`) and the canonical indices of :mod:`gdnprune.geometry` — the same ones
the torch API uses — as byte gathers, which need no dtype support: a gather along rows (projections,
conv, per-head vectors) writes the memory-mapped source rows, runs of consecutive rows coalesced, with
vectored ``pwritev`` calls (one kernel copy, no gathered copy in memory); a gather along columns
(``out_proj``) reads the memory-mapped source with ``numpy.take`` and writes the result with ``pwrite``.
A GDN layer whose tensors straddle two shards needs nothing special. Each output file is written as
``[header][unchanged tensors][GDN tensors]``: the header space is reserved up front (an upper bound,
padded with spaces as safetensors allows) and filled in last.

:mod:`gdnprune.checkpoint.transform` drives it with two threads: the main thread copies the unchanged
bytes (:func:`copy_unchanged`), a worker runs :meth:`GDNWork.prepare` and then GDN jobs; when the main
thread is done copying it takes GDN jobs too. Nothing here imports torch.

OLMo-hybrid stores its fused conv on disk as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (transformers
writes equal thirds, whatever the q/k/v sizes). They are read as one conv (concatenated in that order),
gathered, and written back split into the real q, k and v sizes; transformers concatenates them again on
load.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..safetensors_io import DTYPE_BITS, ShardHeader, TensorInfo, copy_range, encode_header, header_size_bound, \
    write_all, write_vectors
from .folder import Checkpoint, CheckpointError, GDNLayer

__all__ = ["LayerPlan", "ShardPlan", "GDNWork", "InputChangedError", "plan_layer", "plan_shards",
           "copy_unchanged", "write_header", "check_unchanged"]


@dataclass
class LayerPlan:
    """What happens to one GDN layer: its geometry after the gather, the canonical indices, the orders."""

    layer: GDNLayer
    target: Any  # GDNShape after the gather
    indices: dict  # canonical indices for shape -> target, with didx (gdnprune.geometry.check_indices)
    permutation: Any  # the four orders (numpy) or None


def plan_layer(layer: GDNLayer, target, orders) -> LayerPlan:
    """The :class:`LayerPlan` of ``layer`` cut to ``target`` (a checked GDNShape) after ``orders`` (or None)."""
    from .. import geometry

    if orders is None:
        indices = geometry.prefix_indices(layer.shape, target)
    else:
        indices = geometry.order_indices(orders, layer.shape, target)
    return LayerPlan(layer, target, geometry.check_indices(indices, layer.shape, target), orders)


@dataclass
class ShardPlan:
    """One output shard, laid out as ``[header (reserved)][unchanged tensors][GDN tensors]``.

    The unchanged part is known from the source header; ``gdn_entries`` (name -> dtype, shape, begin,
    end, relative to the data section) is filled in by :class:`GDNWork` once the GDN shapes are known.
    """

    index: int
    src: ShardHeader
    dst: str
    unchanged: list[TensorInfo]
    gdn: list[str]
    reserve: int
    gdn_entries: dict = field(default_factory=dict)

    @property
    def data_start(self) -> int:
        return 8 + self.reserve

    @property
    def unchanged_bytes(self) -> int:
        return sum(t.nbytes for t in self.unchanged)

    def entries(self) -> list[tuple]:
        """``(name, dtype, shape, begin, end)`` of every output tensor, in file order."""
        out, position = [], 0
        for t in self.unchanged:
            out.append((t.name, t.dtype, t.shape, position, position + t.nbytes))
            position += t.nbytes
        return out + [(name, *self.gdn_entries[name]) for name in self.gdn]


def plan_shards(ckpt: Checkpoint, gdn_names: set[str], tmp: Path) -> list[ShardPlan]:
    """Output plan of every shard; GDN tensors go last, larger dtypes first (keeps tensors aligned)."""
    max_value = 2 * ckpt.total_bytes + 1  # bounds every offset and dimension of the output headers
    plans = []
    for i, shard in enumerate(ckpt.shards):
        unchanged = [t for t in shard.tensors.values() if t.name not in gdn_names]
        gdn = sorted((n for n in shard.tensors if n in gdn_names),
                     key=lambda n: (-DTYPE_BITS[shard.tensors[n].dtype], shard.tensors[n].start))
        bound_entries = [(t.name, t.dtype, t.shape) for t in unchanged]
        bound_entries += [(n, shard.tensors[n].dtype, [None] * len(shard.tensors[n].shape)) for n in gdn]
        reserve = header_size_bound(bound_entries, shard.metadata, max_value=max_value)
        plans.append(ShardPlan(i, shard, str(tmp / os.path.basename(shard.path)), unchanged, gdn, reserve))
    return plans


def copy_unchanged(plan: ShardPlan, on_chunk: Callable[[int], None]) -> None:
    """Copy the unchanged tensors of one shard in the kernel, coalescing runs contiguous in the source."""
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        src = os.open(plan.src.path, os.O_RDONLY)
        try:
            os.lseek(fd, plan.data_start, os.SEEK_SET)
            runs: list[list[int]] = []
            for t in plan.unchanged:
                if runs and runs[-1][1] == t.start:
                    runs[-1][1] = t.end
                else:
                    runs.append([t.start, t.end])
            for begin, end in runs:
                try:
                    copy_range(src, fd, begin, end - begin, on_chunk=on_chunk)
                except OSError as exc:
                    if os.fstat(src).st_size < end:
                        raise InputChangedError(
                            f"{plan.src.path}: input changed while reading: the file is now shorter than its "
                            f"header says; do not modify a checkpoint while gdnprune reads it") from None
                    raise exc
        finally:
            os.close(src)
    finally:
        os.close(fd)


def write_header(plan: ShardPlan) -> int:
    """Write the shard's header into its reserved space (last, when every tensor is in place)."""
    entries = plan.entries()
    try:
        header = encode_header(entries, plan.src.metadata, size=plan.reserve)
    except ValueError as exc:  # the reserve is an upper bound: this would be a bug
        raise RuntimeError(f"internal error: {exc}") from None
    fd = os.open(plan.dst, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        write_all(fd, header, 0)
        os.ftruncate(fd, plan.data_start + (entries[-1][4] if entries else 0))
    finally:
        os.close(fd)
    return len(header)


class GDNWork:
    """The GDN half of a transform.

    Built from the layer plans, it places every output GDN tensor in its shard (so the shard headers are
    known). Then :meth:`run` may be called from several threads: each takes the next job (one on-disk
    tensor, or all pieces of a fused tensor stored split) and writes it at its final offset (see
    :func:`_write_job`). No torch: the indices come from :mod:`gdnprune.geometry` and the gathers are byte
    gathers of source tensors read with ``pread`` (a file truncated meanwhile gives an error, never a
    SIGBUS as a memory map would).
    """

    def __init__(self, ckpt: Checkpoint, shards: list[ShardPlan], plans: dict[str, LayerPlan]):
        self.ckpt, self.shards, self.plans = ckpt, shards, plans
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.jobs: list[tuple[LayerPlan, str]] = []
        self.next_job = 0
        self.bytes_done = 0
        self.total_bytes = 0
        self._shard_of: dict[str, ShardPlan] = {}
        owner = {plan.layer.name(s): (plan, s) for plan in plans.values() for s in plan.layer.tensors}
        if set(owner) != {n for shard in shards for n in shard.gdn}:
            raise RuntimeError("internal error: the copy plan and the GDN layers disagree")
        jobs_seen = set()
        for shard in self.shards:
            position = shard.unchanged_bytes
            for name in shard.gdn:
                plan, suffix = owner[name]
                dtype = shard.src.tensors[name].dtype
                shape = _out_shape(plan.layer, suffix, plan.target)
                nbytes = _numel(shape) * DTYPE_BITS[dtype] // 8
                shard.gdn_entries[name] = (dtype, shape, position, position + nbytes)
                position += nbytes
                self.total_bytes += nbytes
                self._shard_of[name] = shard
                job = (plan.layer.prefix, _fused_of(plan.layer, suffix) or suffix)
                if job not in jobs_seen:  # the pieces of a split fused tensor are one job
                    jobs_seen.add(job)
                    self.jobs.append((plan, job[1]))
        # The main thread copies the unchanged bytes shard by shard from the first; the GDN jobs start from
        # the last shard, so that the two threads write different files (writes to one file serialise,
        # presumably on its inode lock: measured 1.9 s of waiting on the benchmark checkpoint) until they meet.
        self.jobs.reverse()

    def run(self, after_job: Callable[[], None] | None = None) -> None:
        """Run jobs until none is left, :attr:`stop` is set or some thread failed."""
        files = _SourceFiles(self.ckpt)
        try:
            while not self.stop.is_set() and self.error is None:
                with self.lock:
                    if self.next_job >= len(self.jobs):
                        return
                    plan, suffix = self.jobs[self.next_job]
                    self.next_job += 1
                written = _write_job(plan, suffix, files, self._destination)
                with self.lock:
                    self.bytes_done += written
                if after_job is not None:
                    after_job()
        finally:
            files.close()

    def _destination(self, plan: LayerPlan, suffix: str) -> tuple[str, int, tuple[int, ...]]:
        """Output file, absolute offset and planned shape of on-disk tensor ``suffix`` of a layer."""
        name = plan.layer.name(suffix)
        shard = self._shard_of[name]
        _, shape, begin, _ = shard.gdn_entries[name]
        return shard.dst, shard.data_start + begin, shape


class InputChangedError(CheckpointError):
    """A source shard changed (truncated, rewritten) while it was being read."""


class _SourceFiles:
    """Read-only file descriptors of the source shards, at most two open at a time (one set per thread)."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.open: dict[int, int] = {}

    def read(self, name: str) -> tuple[TensorInfo, bytearray]:
        """The header entry of tensor ``name`` and its bytes, read with ``pread``."""
        i = self.ckpt.shard_of(name)
        if i not in self.open:
            if len(self.open) >= 2:
                os.close(self.open.pop(next(iter(self.open))))
            self.open[i] = os.open(self.ckpt.shards[i].path, os.O_RDONLY)
        info = self.ckpt.tensor(name)
        buffer = bytearray(info.nbytes)
        view, done = memoryview(buffer), 0
        while done < info.nbytes:
            n = os.preadv(self.open[i], [view[done:]], info.start + done)
            if n == 0:
                raise InputChangedError(
                    f"{self.ckpt.shards[i].path}: input changed while reading: the file ends before tensor "
                    f"{name!r} (bytes {info.start}-{info.end}); do not modify a checkpoint while gdnprune reads it")
            done += n
        return info, buffer

    def close(self) -> None:
        for fd in self.open.values():
            os.close(fd)
        self.open.clear()


def _byte_view(info: TensorInfo, data: bytearray, axis: int):
    """A zero-copy numpy view of a tensor's bytes in which gathering along ``axis`` is a byte gather.

    Axis 0: ``[rows, row bytes]`` of uint8; other axes: the tensor's shape with an unsigned integer of the
    dtype's width (GDN tensors are F16/BF16/F32/F64, checked by :func:`find_gdn_layers`).
    """
    import numpy as np

    if axis == 0:
        return np.frombuffer(data, dtype=np.uint8).reshape(info.shape[0], -1)
    width = DTYPE_BITS[info.dtype] // 8
    return np.frombuffer(data, dtype=f"<u{width}").reshape(info.shape)


def _write_job(plan: LayerPlan, suffix: str, files: _SourceFiles, destination) -> int:
    """Gather on-disk tensor ``suffix`` of a layer (or all pieces of the split fused tensor ``suffix``) to
    the plan's target and write it at its place in the output; returns the bytes written.

    A row gather (axis 0) is written straight from the source rows read into memory, runs of consecutive
    rows coalesced, with vectored writes (:func:`~gdnprune.safetensors_io.write_vectors`: no gathered copy
    in memory); a column gather (``out_proj``) and a split fused tensor are gathered with
    ``numpy.take`` and written with ``pwrite``.
    """
    import numpy as np

    from ..layouts import get_layout, segment_size

    layer = plan.layer
    rule = get_layout(layer.layout).rule(suffix)
    index = rule.gather_index(layer.shape, plan.target, plan.indices)
    pieces = layer.splits.get(suffix, (suffix,))
    infos = [files.read(layer.name(p)) for p in pieces]  # shapes and dtypes were checked by find_gdn_layers
    if len(pieces) == 1:
        info, data = infos[0]
        dst, offset, shape = destination(plan, suffix)
        if index.size != shape[rule.axis]:
            raise RuntimeError(f"internal error: {info.name} gathers {index.size} rows, planned {shape}")
        if rule.axis == 0:
            row = info.nbytes // info.shape[0]
            starts = np.flatnonzero(np.diff(index, prepend=-2) != 1)  # where a run of consecutive rows begins
            lengths = np.diff(starts, append=index.size) * row
            begin = index[starts] * row
            runs = list(map(memoryview(data).__getitem__, map(slice, begin.tolist(), (begin + lengths).tolist())))
            fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o666)
            try:
                return write_vectors(fd, runs, offset)
            finally:
                os.close(fd)
        out = {suffix: np.take(_byte_view(info, data, rule.axis), index, axis=rule.axis)}
    else:  # a fused tensor stored split (OLMo-hybrid's q/k/v conv): gather the concatenation, split again
        whole = np.concatenate([_byte_view(info, data, rule.axis) for info, data in infos], axis=rule.axis)
        gathered = np.take(whole, index, axis=rule.axis)
        bounds = np.cumsum([segment_size(kind, plan.target) for kind in rule.segments])[:-1]
        out = dict(zip(pieces, np.split(gathered, bounds, axis=rule.axis)))
    written = 0
    for p, array in out.items():
        dst, offset, shape = destination(plan, p)
        if array.shape[rule.axis] != shape[rule.axis]:
            raise RuntimeError(f"internal error: {layer.name(p)} gathered to {array.shape}, planned {shape}")
        data = np.ascontiguousarray(array)
        fd = os.open(dst, os.O_WRONLY | os.O_CREAT, 0o666)
        try:
            written += write_all(fd, data.reshape(-1).view(np.uint8), offset)
        finally:
            os.close(fd)
    return written


def _fused_of(layer: GDNLayer, suffix: str) -> str | None:
    """The fused tensor that on-disk tensor ``suffix`` is a piece of, or None."""
    return next((fused for fused, pieces in layer.splits.items() if suffix in pieces), None)


def _out_shape(layer: GDNLayer, suffix: str, target) -> tuple[int, ...]:
    """Shape of on-disk tensor ``suffix`` of ``layer`` after the gather to geometry ``target``."""
    from ..layouts import get_layout, segment_size

    layout = get_layout(layer.layout)
    fused = _fused_of(layer, suffix)
    if fused is None:
        rule = layout.rule(suffix)
        length = rule.length(target)
    else:
        rule = layout.rule(fused)
        length = segment_size(rule.segments[layer.splits[fused].index(suffix)], target)
    shape = list(layer.tensors[suffix].shape)
    shape[rule.axis] = length
    return tuple(shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_unchanged(ckpt: Checkpoint) -> None:
    """Raise :class:`InputChangedError` when a source shard's size or modification time differs from when
    its header was read (the output would mix old and new bytes)."""
    for shard in ckpt.shards:
        try:
            st = os.stat(shard.path)
        except OSError as exc:
            raise InputChangedError(f"{shard.path}: input changed while reading: {exc.strerror or exc}") from None
        if (st.st_size, st.st_mtime_ns) != (shard.file_size, shard.mtime_ns):
            raise InputChangedError(
                f"{shard.path}: input changed while reading (size {shard.file_size} -> {st.st_size} bytes, "
                f"modified again); do not modify a checkpoint while gdnprune reads it")
