"""The plan's progress bars (issue 32): one bar per stage, each with its total known when it starts, none
growing its total and none reaching 100% twice; read from stderr as the user sees it."""

from __future__ import annotations

import re

import torch
from helpers import random_dense_model

from gdnprune.plan import plan_model
from gdnprune.scoring import score_model

BAR = re.compile(r"^(?P<desc>[^\r\n|]*?):\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<total>\d+)")


def test_every_bar_of_a_halving_plan_keeps_its_total_and_ends_full(capsys):
    model = random_dense_model("qwen3_5", seed=1)
    ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(2))
    scores = score_model(model, [ids], progress=False, blocks=True)
    capsys.readouterr()
    plan_model(
        model,
        [ids[i : i + 1] for i in range(8)],
        scores,
        budget_params=0.7,
        dim_step="1/2",
        blocks=("gdn", "mlp"),
        progress=True,
    )
    err = capsys.readouterr().err
    seen: dict[str, list[tuple[int, int]]] = {}
    for piece in re.split(r"[\r\n]+", err):
        found = BAR.match(piece.strip())
        if found:
            seen.setdefault(found["desc"].strip(), []).append((int(found["n"]), int(found["total"])))
    rungs = [d for d in seen if d.startswith("sensitivity")]
    assert len(rungs) >= 2, seen.keys()  # successive halving: several rungs, one bar each
    for desc, states in seen.items():
        totals = {t for _, t in states}
        assert len(totals) == 1, (desc, states)  # the total never grows
        assert states[-1][0] == states[-1][1], (desc, states)  # each bar ends full
        full = next(k for k, (n, t) in enumerate(states) if n == t)
        assert all(n == t for n, t in states[full:]), (desc, states)  # full once, at the end
