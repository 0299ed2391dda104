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
    (header, read call, bookkeeping); ``disk``: bytes/s reading or writing checkpoint files; ``startup``: the
    seconds a command that runs a model spends importing torch and transformers; ``runtime_memory``: the host
    memory such a command holds before any model (Python, torch, transformers; measured with the CPU build
    here, benchmarks/scale.py: a CUDA build's context holds more)."""

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
    runtime_memory: float = 0.45 * 2**30  # host bytes of that import

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
        # measured on this project's 2-core benchmark machine with one torch thread (benchmarks/scale.py fits
        # them; see docs/benchmarks/scale.md): effective rates of the small products tiny-width models run
        flops16=2.0e9,
        flops32=4.0e9,
        flops64=2.0e9,
        bandwidth=5e9,
        memory=0,
        matmul_efficiency=1.0,
        bandwidth_efficiency=1.0,
        op_seconds=4e-5,
        tensor_seconds=4e-5,
        disk=1e9,
        source="calibrated on the benchmark machine (benchmarks/scale.py)",
        startup=5.0,  # CPU seconds of the imports alone (a score that stopped at its output check: 4.8 s)
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
