"""Many processes with ``torch.distributed``: the launcher's ranks, the process group, shares, sums, failures.

gdnprune's statistics are sums (float64 sums over tokens, token counts), so data parallelism is exact up
to float summation order: every rank runs its own share of the work (:func:`shard_indices`), the sums are
added over the ranks (:func:`all_reduce_sum`), and everything derived from them (orders, scores, plans)
is computed afterwards, the same on every rank. Scoring uses this module; plan sensitivity can split its
windows or candidates the same way.

* **Launchers.** ``torchrun`` (``torch.distributed.run``) and ``accelerate launch`` (``torchrun``
  underneath for GPUs; ``mpirun`` for multi-CPU) put the rank layout in the environment: ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (or the MPI
  equivalents, ``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ...). :func:`launch_info` reads it;
  :func:`init_process_group` joins the group when it describes more than one process and no group
  exists yet (gloo on a CPU machine; ``cpu:gloo,cuda:nccl`` where CUDA is available, so that CPU
  tensors travel over gloo and CUDA tensors over NCCL). One process without a launcher needs nothing:
  every function here is then a no-op or answers for rank 0 of 1.
* **Timeouts.** The group gets a timeout (:data:`DEFAULT_TIMEOUT` unless given): a collective that waits
  longer for a rank raises instead of hanging forever.
* **Failures.** A rank that raises must not leave the others waiting in a collective. Code that can fail
  on one rank only (reading data, loading a model, forward passes, writing a file) runs inside
  :func:`fail_together`; at the end of the block the ranks exchange their state (one collective), and
  when any rank failed, every rank raises: the failing rank its own exception, the others
  :class:`RankFailedError` with that rank's number and message. An exception is exchanged once: blocks
  may nest, and an exception that was already exchanged passes through the outer blocks without
  another collective. The rule that keeps the ranks in step: every other collective (a sum, a gather)
  comes right after a successful exchange, with nothing that can fail in between, and every rank makes
  the same calls. ``KeyboardInterrupt`` (Ctrl-C, SIGTERM under the CLI) is never exchanged: the
  interrupted rank stops at once, and the others see its connections close.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .fileio import USER_ERRNOS

__all__ = [
    "DEFAULT_TIMEOUT",
    "LaunchInfo",
    "RankFailedError",
    "USER_ERRNOS",
    "launch_info",
    "init_process_group",
    "process_group",
    "is_distributed",
    "rank",
    "world_size",
    "is_main_process",
    "shard_indices",
    "all_reduce_sum",
    "exchange",
    "fail_together",
    "local_gpus",
    "gpu_block",
]

#: how long a collective waits for the slowest rank before it raises (model loading included)
DEFAULT_TIMEOUT = timedelta(minutes=30)

# the variables of torchrun / accelerate first, then those of MPI launchers (as accelerate reads them)
_RANK = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")
_WORLD = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_LOCAL_RANK = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK")
_LOCAL_WORLD = (
    "LOCAL_WORLD_SIZE",
    "MPI_LOCALNRANKS",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)

_EXCHANGED = "_gdnprune_exchanged"  # attribute set on an exception once the ranks have seen it
_timeout_in_use: timedelta | None = None  # the timeout of the group this module initialised (for messages)
_groups_created = 0  # groups this process created (every rank creates the same number)


class RankFailedError(RuntimeError):
    """Another rank failed (or did not answer in time); raised on the ranks that did not fail themselves.

    Attributes: ``rank`` (the failing rank, None when a collective timed out or lost a rank without a
    word; the message then says so), ``world_size``, ``reason`` (that rank's message, ``Type: text`` for
    errors that are not user errors), ``user_error`` (the failing rank raised a ``ValueError``, or an
    ``OSError`` about a path the user gave: :data:`USER_ERRNOS`; a full disk is not the user's error).
    """

    def __init__(self, rank: int | None, world_size: int, reason: str, user_error: bool = False):
        self.rank, self.world_size, self.reason, self.user_error = rank, world_size, reason, user_error
        super().__init__(reason if rank is None else f"rank {rank} failed: {reason}")


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in a multi-process launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _env_int(env: Mapping[str, str], names: Sequence[str]) -> tuple[str, int] | None:
    for name in names:
        text = env.get(name)
        if text is None or text.strip() == "":
            continue
        try:
            return name, int(text)
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r}: expected an integer") from None
    return None


def launch_info(environ: Mapping[str, str] | None = None) -> LaunchInfo | None:
    """The rank layout a launcher put in the environment, or None for a single process.

    ``WORLD_SIZE`` (or an MPI equivalent) above 1 means a multi-process launch; then ``RANK`` must be
    there too. ``LOCAL_RANK`` defaults to ``RANK`` and ``LOCAL_WORLD_SIZE`` to ``WORLD_SIZE`` (one node).

    Raises:
        ValueError: a variable that is not an integer, a world size above 1 without a rank, or a rank
            outside ``[0, world size)``.
    """
    env = os.environ if environ is None else environ
    world = _env_int(env, _WORLD)
    if world is None or world[1] <= 1:
        return None
    found = _env_int(env, _RANK)
    if found is None:
        raise ValueError(f"{world[0]}={world[1]} describes a multi-process launch, but no RANK is set")
    rank_ = found[1]
    if not 0 <= rank_ < world[1]:
        raise ValueError(f"{found[0]}={rank_} is outside [0, {world[1]}) ({world[0]}={world[1]})")
    local = _env_int(env, _LOCAL_RANK)
    local_world = _env_int(env, _LOCAL_WORLD)
    return LaunchInfo(
        rank=rank_,
        world_size=world[1],
        local_rank=rank_ if local is None else local[1],
        local_world_size=world[1] if local_world is None else local_world[1],
    )


def _as_timedelta(timeout: timedelta | float | None) -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        value = timeout
    else:
        value = timedelta(seconds=float(timeout))
    if value.total_seconds() <= 0:
        raise ValueError(f"the process group timeout must be positive, got {value.total_seconds()} s")
    return value


def init_process_group(*, timeout: timedelta | float | None = None, backend: str | None = None) -> bool:
    """Join the launcher's process group if the environment describes one and none is initialised yet.

    Args:
        timeout: how long a collective waits for the slowest rank (a ``timedelta`` or seconds; default
            :data:`DEFAULT_TIMEOUT`).
        backend: the ``torch.distributed`` backend; default ``"cpu:gloo,cuda:nccl"`` where CUDA is
            available, else ``"gloo"``.

    Returns:
        True when this call created the group (the caller then owns it: :func:`process_group` destroys
        it at the end); False for a single process or a group that already exists (a user's own, or
        accelerate's).

    Raises:
        ValueError: the launch variables are malformed or ``MASTER_ADDR`` / ``MASTER_PORT`` are missing.
        RankFailedError: the processes did not all join within ``timeout``.
    """
    global _timeout_in_use, _groups_created

    info = launch_info()
    if info is None or (dist.is_available() and dist.is_initialized()):
        return False
    if not dist.is_available():
        raise ValueError(
            f"a launcher started {info.world_size} processes, but this torch build has no torch.distributed"
        )
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(
            f"a multi-process launch (world size {info.world_size}) needs {' and '.join(missing)} "
            "in the environment; start the processes with torchrun or accelerate launch"
        )
    value = _as_timedelta(timeout)
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    # the env:// rendezvous, with this process's own key prefix per group: a group created again in the same
    # process (the CLI called twice) would otherwise find the previous group's addresses in the store
    try:
        store, rank_, world = next(
            dist.rendezvous("env://", rank=info.rank, world_size=info.world_size, timeout=value)
        )
        _groups_created += 1
        dist.init_process_group(
            backend=backend,
            store=dist.PrefixStore(f"gdnprune/{_groups_created}", store),
            rank=rank_,
            world_size=world,
            timeout=value,
        )
    except RuntimeError as exc:  # the store or the backend could not reach every rank in time
        detail = _short(exc)
        raise RankFailedError(
            None,
            info.world_size,
            f"rank {info.rank} could not form the process group of {info.world_size} processes at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {value.total_seconds():g} s ({detail})",
        ) from None
    _timeout_in_use = value
    return True


@contextlib.contextmanager
def process_group(*, timeout: timedelta | float | None = None, backend: str | None = None) -> Iterator[bool]:
    """:func:`init_process_group` for the duration of a block; yields whether this process runs with others.

    A group created here is destroyed at the end of the block; an existing one is left alone.
    """
    global _timeout_in_use
    owned = init_process_group(timeout=timeout, backend=backend)
    try:
        yield is_distributed()
    finally:
        if owned:
            _timeout_in_use = None
            dist.destroy_process_group()


def is_distributed(group: Any = None) -> bool:
    """Whether a process group with more than one process is initialised."""

    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank(group: Any = None) -> int:
    """This process's rank in the initialised group (0 without one)."""

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def world_size(group: Any = None) -> int:
    """The number of processes in the initialised group (1 without one)."""

    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def is_main_process(group: Any = None) -> bool:
    """Rank 0 (or a single process): the one that writes files and shows progress."""
    return rank(group) == 0


def shard_indices(n: int, rank: int, world: int) -> range:
    """The share of ``n`` items (calibration windows, candidates) that rank ``rank`` of ``world`` takes.

    A contiguous block; the first ``n % world`` ranks take one item more. The blocks of ranks 0, 1, ...
    tile ``range(n)`` in order, so concatenating the shares gives the items in their original order
    (a rank may get an empty range when ``n < world``).
    """
    n, rank, world = int(n), int(rank), int(world)
    if n < 0 or world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"shard_indices needs n >= 0 and 0 <= rank < world, got n={n}, rank={rank}, world={world}"
        )
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def _collective_device(group: Any) -> torch.device:
    """Where the buffers of a collective live: host memory when the group has a CPU backend (gloo), else
    the current CUDA device (an NCCL-only group, e.g. one that accelerate created)."""

    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or "mpi" in backend or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _timeout_text() -> str:
    if _timeout_in_use is None:
        return "the process group's timeout"
    return f"{_timeout_in_use.total_seconds():g} s"


def _short(exc: BaseException) -> str:
    """An error from torch.distributed in one line, without the C++ source locations."""
    return re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", " ".join(str(exc).split()))[:300]


def _run_collective(fn, what: str, group: Any):
    """Run one collective; a timeout or a lost peer becomes a :class:`RankFailedError` that says so."""
    try:
        return fn()
    except RuntimeError as exc:  # DistBackendError, gloo timeouts and closed connections are RuntimeErrors
        detail = _short(exc)
        error = RankFailedError(
            None,
            world_size(group),
            f"gave up waiting for the other ranks in {what}: one did not answer within {_timeout_text()} or "
            f"stopped without a word ({detail})",
        )
        setattr(error, _EXCHANGED, True)
        raise error from None


def all_reduce_sum(tensors: Sequence[torch.Tensor], *, group: Any = None) -> list[torch.Tensor]:
    """Sum every tensor over the ranks, in place; returns the list. A no-op with one process.

    Tensors of one dtype travel together in one flat buffer (one collective per dtype), through host
    memory when the group has gloo (so tensors on several devices, as under a device map, mix freely).
    Every rank must pass tensors of the same dtypes and shapes, in the same order. Float64 sums over
    ranks differ from a single process's running sum only by summation order.
    """

    tensors = list(tensors)
    if not tensors or not is_distributed(group):
        return tensors
    device = _collective_device(group)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for members in by_dtype.values():
        flat = torch.cat([tensors[i].detach().reshape(-1).to(device) for i in members])
        _run_collective(
            lambda flat=flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group), "a sum", group
        )
        offset = 0
        for i in members:
            t = tensors[i]
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
    return tensors


def exchange(value: Any = None, error: BaseException | None = None, *, group: Any = None) -> list[Any]:
    """The collective the ranks agree through: every rank gives a picklable ``value`` or the exception
    that stopped it; returns every rank's value (a list of one without a group).

    When any rank gave an exception, every rank raises: this rank its own ``error`` (re-raised), the
    others :class:`RankFailedError` naming the lowest failing rank and its message. Exceptions that went
    through an exchange are marked, so :func:`fail_together` does not exchange them again.
    """

    if not is_distributed(group):
        if error is not None:
            raise error
        return [value]
    note = None
    if error is not None:
        text = " ".join(str(error).split()) or type(error).__name__
        user = isinstance(error, ValueError) or (isinstance(error, OSError) and error.errno in USER_ERRNOS)
        if isinstance(error, RankFailedError):
            user = error.user_error
        elif not user:
            text = f"{type(error).__name__}: {text}"
        note = (text, user)
    gathered: list[Any] = [None] * world_size(group)
    try:
        _run_collective(
            lambda: dist.all_gather_object(gathered, (note, None if error else value), group=group),
            "an exchange between ranks",
            group,
        )
    except RankFailedError:
        if error is None:
            raise
    if error is not None:  # this rank's own error wins, told or not
        setattr(error, _EXCHANGED, True)
        raise error
    for r, (failed, _) in enumerate(gathered):
        if failed is not None:
            exc = RankFailedError(r, len(gathered), failed[0], failed[1])
            setattr(exc, _EXCHANGED, True)
            raise exc
    return [v for _, v in gathered]


@contextlib.contextmanager
def fail_together(*, group: Any = None) -> Iterator[None]:
    """Run a block on every rank; when it raises on any rank, it raises on every rank (see :func:`exchange`).

    One collective at the end of the block when several processes run (none otherwise), so every rank
    must enter the block. An exception that already went through an exchange (a nested block) and
    ``KeyboardInterrupt`` pass through without another collective.
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - every failure is told to the other ranks
        if getattr(exc, _EXCHANGED, False):
            raise
        exchange(error=exc, group=group)
        raise  # pragma: no cover - exchange re-raises
    else:
        exchange(group=group)


def local_gpus(info: LaunchInfo | None = None, *, group: Any = None) -> list[int] | None:
    """The visible CUDA devices this rank may spread its own model copy over (a device map), or None for all.

    Without a multi-process launch or without CUDA: None (every visible device). Under a launcher, the
    ranks of one machine
    compare their ``CUDA_VISIBLE_DEVICES`` (through :func:`exchange`, so every rank must call this):

    * the same on every rank of the machine (also when unset): the visible GPUs are split in equal
      blocks by local rank, local rank ``l`` of ``L`` taking ``[l*G//L, (l+1)*G//L)`` of the ``G`` visible
      GPUs (an empty block, with fewer GPUs than ranks, is a ``ValueError``);
    * different per rank (a wrapper gave each rank its own GPUs): None, every GPU this rank sees.
    """
    info = launch_info() if info is None else info
    if info is None or not is_distributed(group):
        return None
    mine = (socket.gethostname(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    views = exchange(mine, group=group)
    same_host = [v for v in views if v[0] == mine[0]]
    if any(v[1] != mine[1] for v in same_host):
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_block(info.local_rank, info.local_world_size, count) if count else None


def gpu_block(local_rank: int, local_world_size: int, count: int) -> list[int]:
    """GPUs ``[r*G//L, (r+1)*G//L)`` of the ``G = count`` visible ones for local rank ``r`` of ``L``.

    Raises:
        ValueError: the block is empty (fewer GPUs than processes on the machine).
    """
    L, r = int(local_world_size), int(local_rank)
    block = list(range(r * count // L, (r + 1) * count // L))
    if not block:
        raise ValueError(
            f"local rank {r} of {L} gets no GPU: only {count} GPU(s) visible on this machine; "
            "start fewer processes per machine or give each rank its own CUDA_VISIBLE_DEVICES"
        )
    return block
