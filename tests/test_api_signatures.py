"""One vocabulary in the Python API (issue 19, part 3): the paths are positional, in one order (inputs first,
the output last), everything else is keyword-only and visible in the signature; old call forms still work."""

from __future__ import annotations

import importlib
import inspect
import json
import sys
import warnings

import pytest
from helpers import BYTES_TARGET, build_source, scores_for

#: function -> its positional parameters (the paths, inputs first, the output last)
PUBLIC = {
    "gdnprune.checkpoint.inspect_checkpoint": ["model_dir"],
    "gdnprune.checkpoint.sort_checkpoint": ["model_dir", "scores", "output_dir"],
    "gdnprune.checkpoint.slice_checkpoint": ["model_dir", "output_dir"],
    "gdnprune.checkpoint.transform_checkpoint": ["model_dir", "output_dir"],
    "gdnprune.checkpoint.verify_checkpoints": ["model_a", "model_b"],
    "gdnprune.scoring.score_checkpoint": ["model_dir", "data"],
    "gdnprune.scoring.measure_checkpoint": ["model_dir", "data"],
    "gdnprune.plan.plan_checkpoint": ["model_dir", "data", "scores"],
    "gdnprune.prune.prune_checkpoint": ["model_dir", "data", "output_dir"],
    "gdnprune.distill.distill_checkpoint": ["student_dir", "teacher_dir", "data", "output_dir"],
    "gdnprune.demo.run_demo": ["output"],
}
#: functions that still take **kwargs: each names where they go in its docstring
KNOWN_VAR_KEYWORD = {
    "gdnprune.plan.plan_checkpoint",  # plan_model's options; being restructured (issue 19, part 1)
    "gdnprune.distill.distill_checkpoint",  # distill's own options (steps, lr, fsdp, ...), listed in its docstring
    "gdnprune.demo.run_demo",  # only the deprecated calibration_windows / validation_windows
}
#: old names of a concept that has one name now (see docs/cli.md)
RETIRED_KEYWORDS = {"calibration_windows", "validation_windows", "num_sequences"}
KNOWN_RETIRED = {("gdnprune.checkpoint.verify_checkpoints", "num_sequences")}  # deprecated, still accepted


def _function(name):
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_paths_positional_everything_else_keyword_only(name):
    params = inspect.signature(_function(name)).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert positional == PUBLIC[name]
    assert not any(p.kind is p.VAR_POSITIONAL for p in params)
    assert any(p.kind is p.VAR_KEYWORD for p in params) == (name in KNOWN_VAR_KEYWORD)
    retired = {p.name for p in params} & RETIRED_KEYWORDS
    assert {(name, r) for r in retired} <= KNOWN_RETIRED


def test_a_positional_target_still_works_with_a_warning(tmp_path):
    from gdnprune.checkpoint import slice_checkpoint

    src = build_source(tmp_path / "model", "qwen3_next")
    with pytest.warns(FutureWarning, match="target="):
        old = slice_checkpoint(src, tmp_path / "old", BYTES_TARGET, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        new = slice_checkpoint(src, tmp_path / "new", target=BYTES_TARGET, progress=False)
    assert old["layers"] == new["layers"]
    for shard in sorted((tmp_path / "new").glob("*.safetensors")):
        assert shard.read_bytes() == (tmp_path / "old" / shard.name).read_bytes()
    with pytest.raises(TypeError, match="by keyword"):
        slice_checkpoint(src, tmp_path / "x", BYTES_TARGET, target=BYTES_TARGET)


def test_one_name_for_reading_scores(tmp_path):
    import gdnprune.checkpoint as ck
    from gdnprune import scoring
    from gdnprune.io import scores_file as scores

    assert scoring.load_scores is scores.load_scores and ck.read_scores is scores.read_scores
    assert "load_scores" not in ck.__all__
    with pytest.warns(FutureWarning, match="read_scores"):
        assert ck.load_scores is scores.read_scores


def test_sort_checkpoint_shows_its_keywords(tmp_path):
    from gdnprune.checkpoint import sort_checkpoint

    src = build_source(tmp_path / "model", "qwen3_next")
    path = tmp_path / "scores.json"
    path.write_text(json.dumps(scores_for(src, "qwen3_next")))
    with pytest.raises(TypeError):
        sort_checkpoint(src, path, tmp_path / "out", no_such_option=True)
    manifest = sort_checkpoint(src, path, tmp_path / "out", progress=False, manifest_extra={"note": 1})
    assert manifest["note"] == 1 and manifest["sorted"] is True


OLD_MODULE_NAMES = {  # written out here, not read from gdnprune.runtime.deprecation: the table under test
    "gdnprune.blocks": "gdnprune.model.subblock_geometry",
    "gdnprune.block_surgery": "gdnprune.model.subblock_surgery",
    "gdnprune.scoring.blocks": "gdnprune.scoring.subblocks",
    "gdnprune.scores": "gdnprune.io.scores_file",
    "gdnprune.plans": "gdnprune.io.plan_file",
    "gdnprune.depth": "gdnprune.model.layer_removal",
    "gdnprune.refine": "gdnprune.quality.lane_search",
}


@pytest.mark.parametrize("old", sorted(OLD_MODULE_NAMES))
def test_a_renamed_module_still_imports_with_a_warning(old):
    """The twin-sounding modules were renamed (issue 27); the old names import the new module for a release."""
    sys.modules.pop(old, None)
    with pytest.warns(FutureWarning, match=OLD_MODULE_NAMES[old]):
        module = importlib.import_module(old)
    assert module is importlib.import_module(OLD_MODULE_NAMES[old])
    sys.modules.pop(old, None)


def test_prune_takes_the_scoring_options_as_one_object_and_the_old_keywords_still_work(tmp_path):
    """``prune_checkpoint(scoring=ScoringOptions(...))``: the fields are ``score_checkpoint``'s keywords with
    their defaults, not repeated in ``prune_checkpoint``'s signature; the old keywords fold into the object
    with a warning."""
    import dataclasses

    from gdnprune.prune import prune_checkpoint
    from gdnprune.scoring import ScoringOptions, score_checkpoint

    fields = dataclasses.fields(ScoringOptions)
    scoring = inspect.signature(score_checkpoint).parameters
    assert all(scoring[f.name].default == f.default for f in fields)
    assert {f.name for f in fields}.isdisjoint(inspect.signature(prune_checkpoint).parameters)
    assert ScoringOptions(seed=3).keywords() == {**ScoringOptions().keywords(), "seed": 3}
    paths = (tmp_path / "nothing", tmp_path / "text.txt", tmp_path / "out")
    # the old keyword reaches the object: its check of the method is what refuses it
    with pytest.warns(FutureWarning, match=r"scoring=ScoringOptions\(method=\.\.\.\)"):
        with pytest.raises(ValueError, match="unknown scoring method 'bogus'"):
            prune_checkpoint(*paths, target=BYTES_TARGET, method="bogus")
    with pytest.raises(TypeError, match="give them all in `scoring`"):
        prune_checkpoint(*paths, target=BYTES_TARGET, scoring=ScoringOptions(), seed=1)
    assert not paths[2].exists()
