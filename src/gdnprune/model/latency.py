"""Latency at a serving workload: the whole model, the part outside its decoder layers, and one block.

A :class:`Workload` names what is timed: ``prefill:BATCH:CONTEXT`` is one forward of ``BATCH x CONTEXT``
tokens; ``decode:BATCH:CONTEXT`` is one generation step of ``BATCH`` sequences (one new token each) whose
cache already holds ``CONTEXT`` tokens (the GDN layers' conv and delta-rule states, the attention layers'
key-value cache). Every timing runs the model's own modules on the device they are on, so with the kernels
the model uses (flash-linear-attention on a GPU when transformers finds it; its PyTorch fallback
otherwise): warm-up calls, then the median of timed repeats (``torch.cuda.synchronize`` around each on a
GPU).

:class:`LatencyHarness` times, at one workload:

* :meth:`~LatencyHarness.model_latency`: a whole forward (logits of the last position only, as generation
  computes them);
* :meth:`~LatencyHarness.fixed_latency`: the same forward with every decoder layer passed through: token
  embedding, rotary tables, masks, final norm and ``lm_head``, the part no plan changes;
* :meth:`~LatencyHarness.block_latency`: one block, i.e. any module inside a decoder layer (a GDN module,
  attention, the MLP or MoE block, a shared expert) or a whole decoder layer, or a module that replaces one
  (a cut candidate), called with the arguments the decoder layer gives the original (recorded from one
  forward of the model) and fresh random hidden states of the recorded shape; at decode, its own cache is
  filled first by one prefill call of ``CONTEXT`` tokens through the timed module, so a cut module gets a
  cache of its own shape;
* :meth:`~LatencyHarness.block_latencies`: many candidates, with one recording forward for all.

Results are :class:`Timing` dataclasses (seconds; bytes). Nothing here prints.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicIndexedLayer, DynamicLayer, DynamicSlidingWindowLayer

from .forwards import Passthrough, decoder_layers, hidden_argument, input_device, with_hidden

__all__ = [
    "PHASES",
    "WorkloadError",
    "Workload",
    "parse_workload",
    "Timing",
    "LatencyHarness",
    "model_latency",
    "block_latencies",
]

#: the phases a workload can name
PHASES = ("prefill", "decode")


class WorkloadError(ValueError):
    """A workload that is malformed or out of range."""


@dataclass(frozen=True)
class Workload:
    """What a latency is measured on: ``phase`` (``prefill`` or ``decode``), ``batch`` sequences, ``context``
    tokens (prefill: the tokens of each sequence; decode: the tokens already in each sequence's cache)."""

    phase: str
    batch: int
    context: int

    def __post_init__(self) -> None:
        if self.phase not in PHASES:
            raise WorkloadError(f"phase: expected one of {', '.join(PHASES)}, got {self.phase!r}")
        for name in ("batch", "context"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise WorkloadError(f"{name}: expected an integer >= 1, got {value!r}")

    @property
    def tokens(self) -> int:
        """Tokens one timed call processes: ``batch * context`` for prefill, ``batch`` for decode."""
        return self.batch * self.context if self.phase == "prefill" else self.batch

    def __str__(self) -> str:
        return f"{self.phase}:{self.batch}:{self.context}"


def parse_workload(text: str) -> Workload:
    """``PHASE:BATCH:CONTEXT`` (e.g. ``prefill:1:2048``, ``decode:8:4096``) as a :class:`Workload`."""
    parts = str(text).strip().split(":")
    if len(parts) != 3:
        raise WorkloadError(
            f"`workload`: expected PHASE:BATCH:CONTEXT (e.g. prefill:1:2048 or decode:8:4096), got {text!r}"
        )
    phase, batch, context = parts
    numbers = []
    for name, value in (("batch", batch), ("context", context)):
        try:
            numbers.append(int(value))
        except ValueError:
            raise WorkloadError(
                f"`workload` {text!r}: {name} must be an integer >= 1 (PHASE:BATCH:CONTEXT), got {value!r}"
            ) from None
    try:
        return Workload(phase.strip().lower(), numbers[0], numbers[1])
    except WorkloadError as exc:
        raise WorkloadError(f"`workload` {text!r}: {exc}") from None


@dataclass(frozen=True)
class Timing:
    """One measured latency.

    ``seconds``: the median of ``repeats`` (seconds per timed call: one prefill forward, or one decode step
    of every sequence); ``device``: where it ran; ``peak_memory_bytes``: on a GPU
    ``torch.cuda.max_memory_allocated`` during the warm-up and timed calls (weights included), on a CPU the
    peak resident set of the process over them (Linux ``VmHWM``, reset before the first call), None where not
    measurable; ``memory_growth_bytes``: that
    peak less the value before the first call.
    """

    workload: Workload
    seconds: float
    repeats: tuple[float, ...]
    device: str
    peak_memory_bytes: int | None = None
    memory_growth_bytes: int | None = None

    @property
    def tokens_per_second(self) -> float:
        """Tokens processed per second (decode: tokens generated, one per sequence per step)."""
        return self.workload.tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def ms_per_token(self) -> float:
        """Milliseconds per token: ``1000 / tokens_per_second``."""
        return 1000.0 * self.seconds / self.workload.tokens

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (the keys of ``gdnprune bench``'s results.json)."""
        return {
            "workload": str(self.workload),
            "phase": self.workload.phase,
            "batch": self.workload.batch,
            "context": self.workload.context,
            "seconds": self.seconds,
            "repeats": list(self.repeats),
            "tokens_per_second": self.tokens_per_second,
            "ms_per_token": self.ms_per_token,
            "device": self.device,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_growth_bytes": self.memory_growth_bytes,
        }


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; None off Linux."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_peak_rss() -> bool:
    """Reset this process's peak resident set (``VmHWM``) to its current size (Linux >= 4.0: ``5`` into
    ``/proc/self/clear_refs``); False where that is not possible. No thread samples memory while a timing
    runs: a sampler would take the interpreter lock from the forwards it times."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def _memory_watch(device: torch.device) -> Iterator[dict[str, int | None]]:
    """Yields a dict whose ``peak`` and ``growth`` are filled on exit (see :class:`Timing`)."""
    found: dict[str, int | None] = {"peak": None, "growth": None}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield found
        torch.cuda.synchronize(device)
        top = torch.cuda.max_memory_allocated(device)
        found.update(peak=int(top), growth=int(top - before))
        return
    start = _status_bytes("VmRSS")
    measurable = start is not None and _reset_peak_rss()
    yield found
    peak = _status_bytes("VmHWM") if measurable else None
    if peak is not None and start is not None:
        found.update(peak=peak, growth=max(0, peak - start))


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    workload: Workload,
    device: torch.device,
    call: Callable[[], Any],
    *,
    warmup: int,
    repeats: int,
    after: Callable[[], None] | None = None,
) -> Timing:
    """``warmup`` untimed calls, then ``repeats`` timed ones (``after`` runs after each call, untimed)."""
    times = []
    with torch.no_grad(), _memory_watch(device) as memory:
        for _ in range(warmup):
            call()
            if after is not None:
                after()
        for _ in range(repeats):
            _synchronize(device)
            start = time.perf_counter()
            call()
            _synchronize(device)
            times.append(time.perf_counter() - start)
            if after is not None:
                after()
    return Timing(
        workload=workload,
        seconds=float(statistics.median(times)),
        repeats=tuple(times),
        device=str(device),
        peak_memory_bytes=memory["peak"],
        memory_growth_bytes=memory["growth"],
    )


def trim_cache(cache: Cache, context: int) -> None:
    """Cut every key-value layer of ``cache`` back to its first ``context`` tokens (the GDN states have no
    length and stay as they are): the cache a decode step started from, for the next timed step."""
    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, DynamicLayer) or not getattr(layer, "is_initialized", False):
            continue
        extra = layer.get_seq_length() - context
        if extra <= 0:
            continue
        # the key-value part's own crop (a hybrid layer's `crop` would crop its GDN states too)
        kind: Any = next(
            k for k in (DynamicIndexedLayer, DynamicSlidingWindowLayer, DynamicLayer) if isinstance(layer, k)
        )
        kind.crop(layer, -extra)


#: stands for the cache in a recorded call (the cache of the call is chosen when the call is replayed)
_CACHE = object()


@dataclass
class _Call:
    """A module call recorded without its hidden states: the other arguments, where the hidden states go
    and their shape and dtype."""

    args: tuple
    kwargs: dict
    shape: tuple[int, ...]
    dtype: torch.dtype


def _strip(args: tuple, kwargs: dict) -> _Call:
    hidden = hidden_argument(args, kwargs)
    args, kwargs = with_hidden(args, kwargs, hidden.new_empty(0))  # a placeholder: every replay replaces it

    def mark(value: Any) -> Any:
        return _CACHE if isinstance(value, Cache) else value

    return _Call(
        tuple(mark(a) for a in args),
        {k: mark(v) for k, v in kwargs.items()},
        tuple(hidden.shape),
        hidden.dtype,
    )


@dataclass
class _Recording:
    """The calls of the recorded modules: ``prefill`` (decode: the call that filled the cache), ``step``."""

    prefill: dict[int, _Call] = field(default_factory=dict)
    step: dict[int, _Call] = field(default_factory=dict)


class LatencyHarness:
    """Latencies of ``model`` and of its blocks at one :class:`Workload`, on the device the model is on.

    Args:
        model: a loaded causal LM (transformers), in eval mode, on one device.
        workload: what is timed.
        repeats: timed calls per latency (their median is reported); warmup: untimed calls before them.
        seed: seed of the random token ids and hidden states (the content does not change the work, except
            for the routing of MoE layers).

    Attributes: ``calls`` counts the timed and warm-up calls made so far (every latency adds
    ``warmup + repeats``), for tests and progress.
    """

    def __init__(
        self, model: torch.nn.Module, workload: Workload, *, repeats: int = 5, warmup: int = 2, seed: int = 0
    ):
        if repeats < 1 or warmup < 0:
            raise ValueError(f"`repeats` must be >= 1 and `warmup` >= 0, got {repeats} and {warmup}")
        self.model = model.eval()
        self.workload = workload
        self.repeats, self.warmup = repeats, warmup
        self.device = input_device(model)
        self.blocks = decoder_layers(model)
        self.calls = 0
        generator = torch.Generator().manual_seed(seed)
        embedding: Any = model.get_input_embeddings()  # type: ignore[operator]
        vocab = int(embedding.num_embeddings)
        self._ids = torch.randint(0, vocab, (workload.batch, workload.context), generator=generator)
        self._next = torch.randint(0, vocab, (workload.batch, 1), generator=generator)
        self._generator = generator
        self._hidden: dict[tuple, torch.Tensor] = {}
        self._recorded = _Recording()
        self._cache: Cache | None = None

    # -- the model's forwards ------------------------------------------------------------------------------

    def _forward(self, ids: torch.Tensor, cache: Cache | None) -> Any:
        kwargs: dict[str, Any] = {"input_ids": ids.to(self.device), "logits_to_keep": 1}
        if cache is None:
            kwargs["use_cache"] = self.workload.phase == "decode"
        else:
            kwargs.update(past_key_values=cache, use_cache=True)
        return self.model(**kwargs)

    def _record(self, modules: Sequence[torch.nn.Module]) -> None:
        """One forward (decode: the prefill that fills a new cache, then one step) with the calls of
        ``modules`` recorded; the new cache (decode) becomes the model's cache."""
        target: dict[int, _Call] = {}

        def hook(module, args, kwargs):
            target.setdefault(id(module), _strip(args, kwargs))

        handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in modules]
        try:
            with torch.no_grad():
                if self.workload.phase == "prefill":
                    target = self._recorded.step
                    self._forward(self._ids, None)
                    return
                target = self._recorded.prefill
                self._cache = None  # free the old cache before the new one is made
                self._cache = self._forward(self._ids, None).past_key_values
                target = self._recorded.step
                self._forward(self._next, self._cache)
                trim_cache(self._cache, self.workload.context)
        finally:
            for handle in handles:
                handle.remove()

    def _model_cache(self) -> Cache:
        if self._cache is None:
            self._record([])
        assert self._cache is not None
        return self._cache

    def _count(self, call: Callable[[], Any]) -> Callable[[], Any]:
        def counted() -> Any:
            self.calls += 1
            return call()

        return counted

    def model_latency(self) -> Timing:
        """The whole model's forward at the workload (logits of the last position only)."""
        if self.workload.phase == "prefill":
            return _measure(
                self.workload,
                self.device,
                self._count(lambda: self._forward(self._ids, None)),
                warmup=self.warmup,
                repeats=self.repeats,
            )
        cache = self._model_cache()
        return _measure(
            self.workload,
            self.device,
            self._count(lambda: self._forward(self._next, cache)),
            warmup=self.warmup,
            repeats=self.repeats,
            after=lambda: trim_cache(cache, self.workload.context),
        )

    def fixed_latency(self) -> Timing:
        """The forward with every decoder layer passed through: embeddings, rotary tables, masks, final norm
        and ``lm_head`` (what :meth:`model_latency` costs beyond the decoder layers)."""
        cache = self._model_cache() if self.workload.phase == "decode" else None
        ids = self._ids if cache is None else self._next
        originals = list(self.blocks)
        try:
            for j in range(len(originals)):
                self.blocks[j] = Passthrough()
            return _measure(
                self.workload,
                self.device,
                self._count(lambda: self._forward(ids, cache)),
                warmup=self.warmup,
                repeats=self.repeats,
            )
        finally:
            for j, original in enumerate(originals):
                self.blocks[j] = original

    # -- blocks ----------------------------------------------------------------------------------------------

    def _random_hidden(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (shape, dtype)
        if key not in self._hidden:
            self._hidden[key] = torch.randn(shape, generator=self._generator).to(self.device, dtype)
        return self._hidden[key]

    def _replay(self, call: _Call, module: torch.nn.Module, cache: Cache | None) -> Callable[[], Any]:
        hidden = self._random_hidden(call.shape, call.dtype)
        args = tuple(cache if a is _CACHE else a for a in call.args)
        kwargs = {k: (cache if v is _CACHE else v) for k, v in call.kwargs.items()}
        args, kwargs = with_hidden(args, kwargs, hidden)
        return lambda: module(*args, **kwargs)

    def prepare(self, modules: Sequence[torch.nn.Module]) -> None:
        """Record the calls of ``modules`` (blocks of this model) not recorded yet, in one forward."""
        missing = [m for m in dict.fromkeys(modules) if id(m) not in self._recorded.step]
        for module in missing:
            if not any(sub is module for block in self.blocks for sub in block.modules()):
                raise ValueError(
                    f"the {type(module).__name__} module is not inside one of the decoder's layers"
                )
        if missing:
            self._record(missing)
        for module in missing:
            if id(module) not in self._recorded.step:
                raise ValueError(
                    f"the {type(module).__name__} module was not called in a forward of the model"
                )

    def block_latency(self, module: torch.nn.Module, replacement: torch.nn.Module | None = None) -> Timing:
        """The latency of ``module`` (a block of this model: a sub-module of a decoder layer, or the layer),
        or of ``replacement`` called in its place (a cut module, on the model's device), at the workload."""
        self.prepare([module])
        timed = module if replacement is None else replacement
        step = self._recorded.step[id(module)]
        if self.workload.phase == "prefill":
            cache = None
        else:  # its own cache of `context` tokens, of the timed module's shapes
            cache_class: Any = type(self._model_cache())
            cache = cache_class(config=self.model.config)
            with torch.no_grad():
                self._replay(self._recorded.prefill[id(module)], timed, cache)()
        return _measure(
            self.workload,
            self.device,
            self._count(self._replay(step, timed, cache)),
            warmup=self.warmup,
            repeats=self.repeats,
            after=None if cache is None else (lambda: trim_cache(cache, self.workload.context)),
        )

    def block_latencies(
        self,
        candidates: Sequence[tuple[torch.nn.Module, torch.nn.Module | None]],
        *,
        progress: Callable[[int], None] | None = None,
    ) -> list[Timing]:
        """:meth:`block_latency` of every ``(module, replacement or None)``, in order, after one recording
        forward for all the modules; ``progress(1)`` after each (e.g. a tqdm bar's ``update``)."""
        self.prepare([module for module, _ in candidates])
        timings = []
        for module, replacement in candidates:
            timings.append(self.block_latency(module, replacement))
            if progress is not None:
                progress(1)
        return timings


def model_latency(
    model: torch.nn.Module, workload: Workload, *, repeats: int = 5, warmup: int = 2, seed: int = 0
) -> Timing:
    """:meth:`LatencyHarness.model_latency` in one call."""
    return LatencyHarness(model, workload, repeats=repeats, warmup=warmup, seed=seed).model_latency()


def block_latencies(
    model: torch.nn.Module,
    workload: Workload,
    candidates: Sequence[tuple[torch.nn.Module, torch.nn.Module | None]],
    *,
    repeats: int = 5,
    warmup: int = 2,
    seed: int = 0,
) -> list[Timing]:
    """:meth:`LatencyHarness.block_latencies` in one call."""
    harness = LatencyHarness(model, workload, repeats=repeats, warmup=warmup, seed=seed)
    return harness.block_latencies(candidates)
