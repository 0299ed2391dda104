"""The devices ``gdnprune estimate`` predicts wall time on: peak rates from the vendors' figures, and the share of
them a run reaches, as data. No torch.

A GPU's entry holds its peak dense matrix throughput (bf16, and the fp32 and fp64 rates the scorer's
float64 statistics run at), its memory bandwidth and size, and one efficiency factor per kind of work
(matrix products, memory-bound passes) with the overhead of one kernel launch as the Python side of
transformers issues them. The CPU entry holds the rates measured on the machine the benchmarks ran on
(``benchmarks/scale.py`` fits them; its result is written here by hand, with the date), so a CPU prediction
is this machine's: another CPU scales it by its own throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Device", "DEVICES", "device"]


@dataclass(frozen=True)
class Device:
    """Throughputs in FLOP/s and bytes/s; ``memory`` in bytes (0: the host's); ``matmul_efficiency`` and
    ``bandwidth_efficiency``: the shares of the peaks reached; ``op_seconds``: the fixed cost of one module
    call or kernel (Python, dispatch, launch); ``tensor_seconds``: the host's cost per tensor of a checkpoint
    read into a model or scanned (header, read call, bookkeeping); ``stream_tensor_seconds``: per tensor that
    ``slice`` / ``sort`` stream from one file into another (no model: a ``pread`` or a write of its bytes);
    ``convert_tensor_seconds``: per tensor that transformers' own loading reads into a model (its conversion
    operations copied per tensor: what ``distill`` pays per expert tensor); ``disk``: bytes/s reading checkpoint
    files; ``write``: bytes/s serializing a checkpoint or an optimizer state (safetensors' and ``torch.save``'s
    copies and checksums: CPU-bound); ``startup``: the seconds a command that runs a model spends importing
    torch and transformers; ``light_startup``: the seconds of a command that does not (``inspect``, ``slice``,
    ``sort``); ``harness_startup``: what ``eval`` adds to it (lm-eval's harness); ``launch``: what a run of
    several processes adds (torchrun, the process group, FSDP2's wrapping); ``convert_tensor_bytes``: the host
    memory transformers' own loading holds per converted tensor (its copied operations)."""

    name: str
    kind: str  # "cpu" or "cuda"
    flops16: float
    flops32: float
    flops64: float
    bandwidth: float
    memory: int
    matmul_efficiency: float
    bandwidth_efficiency: float
    op_seconds: float
    tensor_seconds: float
    disk: float
    source: str
    startup: float = 8.0  # seconds a command takes to import torch and transformers before its work
    light_startup: float = 0.3  # seconds of a command that needs neither
    stream_tensor_seconds: float = 1e-5
    convert_tensor_seconds: float = 2e-4
    write: float = 1e9
    harness_startup: float = 1.0
    launch: float = 10.0
    convert_tensor_bytes: float = 10e3

    def flops(self, dtype_bytes: int) -> float:
        """Matrix throughput reached for a compute dtype of ``dtype_bytes`` bytes."""
        peak = {2: self.flops16, 4: self.flops32, 8: self.flops64}[dtype_bytes]
        return peak * self.matmul_efficiency


_GIB = 1 << 30
_HOPPER = "https://glennklockwood.com/garden/processors/h100 (989.4 TFLOPS bf16, 66.9 fp32, 66.9 fp64 matrix)"
#: per-kernel overhead of eager PyTorch on a GPU, matrix and bandwidth shares typical of transformers' eager
#: modeling at batch sizes of thousands of tokens (assumed, not measured here: no GPU was available)
_GPU = dict(matmul_efficiency=0.4, bandwidth_efficiency=0.7, op_seconds=2e-5, tensor_seconds=2e-5, disk=2e9)

DEVICES: dict[str, Device] = {
    "cpu": Device(
        name="cpu",
        kind="cpu",
        # this project's 2-core benchmark machine with one torch thread: the matrix rates measured on products
        # of 64 tokens by 1024-6144 wide weights (the fixed cost of a call apart: op_seconds), the fixed costs
        # fitted to the measured stages (benchmarks/scale.py --fit; docs/benchmarks/scale.md), 2026-12-06
        flops16=25e9,  # bf16 products run upcast
        flops32=50e9,
        flops64=25e9,
        bandwidth=5e9,
        memory=0,
        matmul_efficiency=1.0,
        bandwidth_efficiency=1.0,
        op_seconds=3.1e-5,
        tensor_seconds=4.6e-5,
        disk=2.4e9,
        source="measured and fitted on the benchmark machine (benchmarks/scale.py)",
        startup=6.0,  # CPU seconds of the imports alone
        light_startup=0.28,
        stream_tensor_seconds=1.0e-5,
        convert_tensor_seconds=3.5e-4,
        write=0.59e9,
        harness_startup=1.0,
        launch=5.2,
        convert_tensor_bytes=5e3,
    ),
    "h100": Device(
        "h100",
        "cuda",
        989.4e12,
        66.9e12,
        66.9e12,
        3.35e12,
        80 * 10**9,
        source=_HOPPER + ", 3.35 TB/s, 80 GB",
        **_GPU,
    ),
    "h200": Device(
        "h200",
        "cuda",
        989.4e12,
        66.9e12,
        66.9e12,
        4.8e12,
        141 * 10**9,
        source=_HOPPER + "; 4.8 TB/s, 141 GB: https://www.saulelectric.com/nvidia-h200.html",
        **_GPU,
    ),
    "a100": Device(
        "a100",
        "cuda",
        312e12,
        19.5e12,
        19.5e12,
        2.039e12,
        80 * 10**9,
        source="https://glennklockwood.com/garden/processors/A100 (312 TFLOPS bf16, 19.5 fp32 and fp64, 2.039 TB/s, 80 GB)",
        **_GPU,
    ),
}


def device(name: str) -> Device:
    """The device called ``name`` (``cpu``, ``h100``, ``h200``, ``a100``; case-insensitive)."""
    found = DEVICES.get(name.lower())
    if found is None:
        raise ValueError(f"unknown device {name!r}; expected one of {', '.join(DEVICES)}")
    return found
