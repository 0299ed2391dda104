"""``distill_checkpoint``: :func:`~gdnprune.distill.api.distill` on Hugging Face folders — the folders and
the corpus checked before any model loads, the windows read from the token cache, the student and the teacher
loaded (into their shards under FSDP2), the output folder written with the files of the student's folder."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import (
    AutoConfig,
    AutoTokenizer,
    TrainerCallback,
)

from ..checkpoint.folder import MANIFEST_NAME
from ..checkpoint.output import copy_other_files, plan_other_files
from ..corpus import check_data, data_spec
from ..corpus.dataset import WindowDataset, first_windows, open_windows
from ..io.loading import load_pretrained
from ..runtime.fileio import write_json_atomic
from .api import as_config, distill, process_rank
from .fsdp import (
    check_shardable,
    load_sharded_models,
    student_dtype,
)
from .memory import meta_model
from .options import (
    DistillConfig,
    check_batch,
    check_options,
    check_run,
    check_same_vocabulary,
    fsdp_asked,
)
from .output import read_tensors
from .records import (
    check_output_folder,
    run_manifest,
)

__all__ = ["CARRIED_PREFIXES", "default_seq_len", "distill_checkpoint", "stored_dtype"]


_MAX_SEQ_LEN = 2048  # default window length of distill_checkpoint, unless the model supports less

# files of the student folder that the trained model replaces (weight files are never copied)
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "gdnprune.json",
)
#: tensors transformers does not load that the output carries over from the student unchanged
CARRIED_PREFIXES = ("mtp.",)


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def default_seq_len(config) -> int:
    """The window length :func:`distill_checkpoint` uses by default: the model's ``max_position_embeddings``,
    at most 2048."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return min(_MAX_SEQ_LEN, getattr(text, "max_position_embeddings", None) or _MAX_SEQ_LEN)


def stored_dtype(folder: str | Path) -> torch.dtype | None:
    """The dtype a model folder stores its floating-point weights in (the first such tensor's), or None."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                mapped = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}.get(dtype)
                if mapped is not None:
                    return mapped
    return None


def _load_model(path: Path, dtype, device_map=None):
    """The model class named in ``config.json`` (whole vision-language models too), else AutoModelForCausalLM;
    per-layer GDN geometries (a gdnprune plan's output) through :func:`gdnprune.load_pretrained`."""
    try:
        return load_pretrained(
            path, dtype=dtype, **({} if device_map is None else {"device_map": device_map})
        )
    except (OSError, RuntimeError, ValueError) as exc:
        raise ValueError(f"{path}: transformers cannot load it: {' '.join(str(exc).split())[:500]}") from None


def _check_folders(student_dir: Path, teacher_dir: Path, output_dir: Path) -> None:
    for name, folder in (("student", student_dir), ("teacher", teacher_dir)):
        if not (folder / "config.json").is_file():
            raise ValueError(f"{name}: expected a Hugging Face model folder with config.json, found {folder}")
        if any(
            _same_file(above, folder) for above in (output_dir.absolute(), *output_dir.absolute().parents)
        ):
            raise ValueError(
                f"output folder {output_dir}: expected a folder outside the {name} folder {folder}, "
                f"found it is (or is inside) that folder"
            )


def _tokenizers(student_dir: Path, teacher_dir: Path):
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    try:
        teacher_tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    except (OSError, ValueError):
        teacher_tokenizer = None
        warnings.warn(
            f"no tokenizer in {teacher_dir}: only the vocabulary sizes of teacher and student are compared",
            stacklevel=3,
        )
    check_same_vocabulary(student_tokenizer=tokenizer, teacher_tokenizer=teacher_tokenizer)
    return tokenizer, teacher_tokenizer


def _evenly(dataset: WindowDataset, count: int | None) -> WindowDataset:
    """``count`` evenly spaced windows of ``dataset`` (all when None or more than it has)."""
    if count is None or count >= len(dataset):
        return dataset
    step = len(dataset) // count
    return dataset.select(range(0, step * count, step))


def distill_checkpoint(
    student_dir: str | Path,
    teacher_dir: str | Path,
    data: Any,
    output_dir: str | Path | None = None,
    *,
    config: DistillConfig | None = None,
    seq_len: int | None = None,
    num_samples: int | None = None,
    eval_data: Any = None,
    eval_samples: int | None = None,
    data_cache: str | Path | None = None,
    dtype: str | torch.dtype = torch.float32,
    teacher_dtype: str | torch.dtype | None = None,
    teacher_device_map: Any = None,
    callbacks: Sequence[TrainerCallback] = (),
    data_progress: bool | None = None,
    sharded_loading: bool = True,
    **legacy: Any,
) -> dict[str, Any]:
    """:func:`distill` on Hugging Face folders: the student in ``student_dir`` from the teacher in ``teacher_dir``,
    into ``output_dir`` (default ``config.output_dir``), with the options of ``config``.

    ``data`` (and ``eval_data``): files, folders, globs or a mixture (:func:`gdnprune.corpus.data_spec`),
    checked before any model loads, tokenised once with the student's tokenizer into the memory-mapped
    cache in ``data_cache`` (default :func:`gdnprune.corpus.default_cache_dir`; a bar on the first process
    unless ``data_progress`` is False, default ``config.progress``) and read window by window, each
    process only its own; ``seq_len`` tokens per window (default :func:`default_seq_len`);
    ``num_samples``: evenly spaced training windows; ``eval_samples``: the first held-out windows. A corpus
    with fewer windows than a step takes is refused before any model loads, with the numbers; one that
    the run goes over more than once is said with a warning. The student loads in ``dtype`` (the
    optimizer's master weights), the teacher in ``teacher_dtype`` (default: the same), spread by
    ``teacher_device_map`` if given. Under FSDP2 (``sharded_loading``, the default) each model is built
    on the ``meta`` device, sharded, and each process reads only its own rows from the safetensors files
    (:func:`gdnprune.io.sharded_loading.load_sharded`): no process holds a whole student or teacher. FP8 block-scaled
    weights are dequantized as read, MoE experts stored one tensor per expert are stacked as read (and
    OLMo-hybrid's ``q/k/v_conv1d`` concatenated, as transformers converts them), a text
    model reads a vision-language folder's prefixed tensors, a bf16/fp16 student under mixed precision gets
    float32 master weights (as accelerate upcasts it), and a student under gradient checkpointing has its
    layers wrapped before it is sharded. A quantization other than FP8 blocks is refused; a folder that
    stores a tensor in another form loads whole on every process and is sharded after (a warning line
    names the tensor). Teacher and student must share their tokenizer. The output folder is
    checked before any model is loaded.

    The output is a normal HF folder: the trained weights (in the dtype the student folder stores, unless
    ``config.output_dtype`` says otherwise) and config (``per_layer_config`` kept), the student's ``mtp.*``
    tensors unchanged, the tokenizer, every other file of ``student_dir`` that is not a weight file, the
    ``gdnprune.json`` record of the run, the log and the plot (and the checkpoints, if kept). The output
    may not be, or lie inside, the student or teacher folder. The older form (the options as keywords)
    warns and works for one release.
    """
    if isinstance(output_dir, DistillConfig):  # distill_checkpoint(student, teacher, data, config)
        config, output_dir = output_dir, None
    config = as_config(config if config is not None else DistillConfig(), legacy)
    if output_dir is not None:
        config = config.replace(output_dir=output_dir)
    student_dir, teacher_dir = Path(student_dir), Path(teacher_dir)
    output_dir = Path(config.output_dir) if config.output_dir is not None else None
    if output_dir is None:
        raise ValueError("output_dir: expected the folder to write, found None")
    _check_folders(student_dir, teacher_dir, output_dir)
    check_output_folder(output_dir, config.resume, config.overwrite)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sharding = check_options(
        world_size=world,
        fsdp=fsdp_asked(config.fsdp),
        teacher_sharding=config.teacher_sharding,
        teacher_device_map=teacher_device_map,
        mixed_precision=config.mixed_precision,
        cpu_offload=config.cpu_offload,
    )
    check_batch(config.batch_size, config.micro_batch_size, world)  # before the corpus is tokenised
    tokenizer, teacher_tokenizer = _tokenizers(student_dir, teacher_dir)
    spec, eval_spec = data_spec(data), None if eval_data is None else data_spec(eval_data)
    files = check_data(spec, tokenizer=tokenizer)
    eval_files = None if eval_spec is None else check_data(eval_spec, tokenizer=tokenizer)
    seq_len = seq_len or default_seq_len(AutoConfig.from_pretrained(student_dir))
    main = process_rank() == 0
    windows = _evenly(
        open_windows(
            spec,
            tokenizer,
            seq_len=seq_len,
            cache_dir=data_cache,
            files=files,
            progress=main and (config.progress if data_progress is None else data_progress),
        ),
        num_samples,
    )
    _check_corpus_size(config, len(windows), seq_len, world)
    eval_windows = None
    if eval_spec is not None:
        eval_windows = first_windows(
            eval_spec, tokenizer, seq_len=seq_len, num_windows=eval_samples, files=eval_files
        )
    teacher_dtype = dtype if teacher_dtype is None else teacher_dtype
    student, teacher = _load_models(
        student_dir, teacher_dir, dtype, teacher_dtype, teacher_device_map, config, sharding, sharded_loading
    )
    carried = (
        {k: v for p in CARRIED_PREFIXES for k, v in read_tensors(student_dir, p).items()} if main else {}
    )
    if config.output_dtype is None:
        config = config.replace(output_dtype=stored_dtype(student_dir))
    result = distill(
        student,
        teacher,
        windows,
        config,
        eval_data=eval_windows,
        tokenizer=tokenizer,
        teacher_tokenizer=teacher_tokenizer,
        extra_tensors=carried,
        callbacks=callbacks,
    )
    if not result["interrupted"] and main:
        others, _ = plan_other_files(student_dir, skip=set(_MODEL_FILES))
        copy_other_files(student_dir, output_dir, [f for f in others if not (output_dir / f).exists()])
        manifest = run_manifest(student_dir, teacher_dir, spec, result, sorted(carried))
        write_json_atomic(output_dir / MANIFEST_NAME, manifest)
    return result


def _load_models(
    student_dir: Path,
    teacher_dir: Path,
    dtype: str | torch.dtype,
    teacher_dtype: str | torch.dtype,
    teacher_device_map: Any,
    config: DistillConfig,
    sharding: str,
    sharded_loading: bool,
) -> tuple[Any, Any]:
    """The student and the teacher of :func:`distill_checkpoint`: under FSDP2 with ``sharded_loading`` read
    straight into their shards (what FSDP2 cannot wrap said first, in the run's dtypes), else loaded whole."""
    if fsdp_asked(config.fsdp):  # what FSDP2 cannot wrap is said before any weight is read
        check_shardable(meta_model(student_dir, student_dtype(dtype, config.mixed_precision)), "student")
        if sharding == "shard":
            check_shardable(meta_model(teacher_dir, teacher_dtype), "teacher")
    if fsdp_asked(config.fsdp) and sharded_loading:
        from accelerate import PartialState  # lazy: only under FSDP2

        PartialState()  # the process group the shards live on (the Trainer's arguments find it made)
        student, teacher = load_sharded_models(
            student_dir, teacher_dir, dtype, teacher_dtype, config=config, teacher_sharded=sharding == "shard"
        )
        student = student if student is not None else _load_model(student_dir, dtype)
        teacher = (
            teacher if teacher is not None else _load_model(teacher_dir, teacher_dtype, teacher_device_map)
        )
    else:
        student = _load_model(student_dir, dtype)
        teacher = _load_model(teacher_dir, teacher_dtype, teacher_device_map)
    return student, teacher


def _check_corpus_size(config: DistillConfig, windows: int, seq_len: int, world: int) -> None:
    """Refuse a corpus too small for one step, and say when the run goes over it more than once."""
    steps, _ = check_run(config, windows, seq_len, world)
    asked = steps * config.batch_size
    if asked > windows:
        warnings.warn(
            f"the training data gives {windows:,} windows of {seq_len} tokens ({windows * seq_len:,} tokens); "
            f"{steps:,} steps x {config.batch_size} windows ask for {asked:,}, so the run goes over it "
            f"{asked / windows:.1f} times",
            stacklevel=3,
        )
