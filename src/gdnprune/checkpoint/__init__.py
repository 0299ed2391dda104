"""Checkpoint surgery on Hugging Face folders of GDN hybrid models: inspect, sort, slice, verify.

The public API (the ``gdnprune`` subcommands are thin layers over it):

* :func:`inspect_checkpoint` — every block a plan can cut (GDN layers, attention, MLP, experts, decoder
  layers: prefix, layout, geometry, parameters) and the totals;
* :func:`transform_checkpoint` — the one streaming engine: permute (sort) and/or cut (slice) every GDN
  layer of a checkpoint folder into a new folder;
* :func:`sort_checkpoint` / :func:`slice_checkpoint` — the two operations of the command line;
* :func:`verify_checkpoints` — load two folders with transformers and compare their logits;
* :func:`read_manifest`, :func:`find_gdn_layers`, :func:`open_checkpoint`, :func:`read_scores` (the orders
  ``sort`` accepts; :func:`gdnprune.io.scores_file.load_scores` reads and checks a whole file of ``gdnprune score``).

The rooms: :mod:`.folder` reads a folder (headers only), :mod:`.inspection` describes it, :mod:`.engine` streams tensors,
:mod:`.output` owns the output folder, :mod:`.transform` drives a transform, :mod:`.verify` runs
models. Only :mod:`.verify` imports torch (inside its functions).
"""

import warnings

from ..io.safetensors_io import CheckpointError
from ..io.scores_file import ScoresError, matching_prefixes, read_scores
from ..model.targets import TargetError
from .folder import (
    CONFIG_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    PASSTHROUGH_PREFIXES,
    SINGLE_NAME,
    Checkpoint,
    GDNLayer,
    find_gdn_layers,
    open_checkpoint,
    read_manifest,
)
from .inspection import inspect_checkpoint
from .output import OutputError
from .transform import (
    KernelShapeWarning,
    MissingScoresWarning,
    PassthroughWarning,
    UnsortedInputWarning,
    slice_checkpoint,
    sort_checkpoint,
    transform_checkpoint,
)
from .verify import verify_checkpoints

__all__ = [
    "CheckpointError",
    "ScoresError",
    "TargetError",
    "OutputError",
    "UnsortedInputWarning",
    "MissingScoresWarning",
    "PassthroughWarning",
    "KernelShapeWarning",
    "Checkpoint",
    "GDNLayer",
    "open_checkpoint",
    "find_gdn_layers",
    "inspect_checkpoint",
    "read_scores",
    "matching_prefixes",
    "read_manifest",
    "transform_checkpoint",
    "sort_checkpoint",
    "slice_checkpoint",
    "verify_checkpoints",
    "CONFIG_NAME",
    "INDEX_NAME",
    "MANIFEST_NAME",
    "PASSTHROUGH_PREFIXES",
    "SINGLE_NAME",
]


def __getattr__(name: str):
    # ``gdnprune.checkpoint.load_scores`` was ``read_scores`` under another name, while
    # ``gdnprune.scoring.load_scores`` (= ``gdnprune.io.scores_file.load_scores``) also checks the file: one name each now
    if name == "load_scores":
        warnings.warn(
            "gdnprune.checkpoint.load_scores is deprecated: it is gdnprune.io.scores_file.read_scores (the orders "
            "that sort accepts); gdnprune.io.scores_file.load_scores reads and checks a whole scores file",
            FutureWarning,
            stacklevel=2,
        )
        return read_scores
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
