"""Expert importance (REAP and frequency) and block influence from one forward (issue 23).

References are computed here by brute force from the weights: the router's softmax and top-k, each chosen
expert's SwiGLU output token by token; block influence from ``output_hidden_states``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_same, moe_block_inputs, random_dense_model, token_ids
from tiny_models import logits

from gdnprune import checkpoint as ck
from gdnprune.io.loading import load_pretrained
from gdnprune.io.scores_file import read_scores, save_scores
from gdnprune.model.subblock_surgery import find_model_blocks
from gdnprune.scoring.api import score_model
from gdnprune.scoring.experts import block_influence

pytestmark = [pytest.mark.filterwarnings("ignore::gdnprune.checkpoint.UnsortedInputWarning")]


def _brute_force(model, batches):
    """Per MoE prefix: (count [E], sum of gate weight x ||expert output|| [E], tokens, removal error [E]),
    token by token; the removal error of expert e sums, over the tokens routed to it, the squared change of
    the routed output when the router picks among every expert but e (its softmax and top-k recomputed)."""
    inputs = moe_block_inputs(model, batches)
    blocks = find_model_blocks(model, ("experts",))
    out = {}
    for b in blocks:
        moe = model.get_submodule(b.prefix)
        W, k, E = moe.gate.weight.double(), moe.gate.top_k, b.shape.num_experts
        norm = getattr(moe.gate, "norm_topk_prob", True)
        gu, down = moe.experts.gate_up_proj.double(), moe.experts.down_proj.double()
        count, total = torch.zeros(E, dtype=torch.float64), torch.zeros(E, dtype=torch.float64)
        removal = torch.zeros(E, dtype=torch.float64)
        tokens = 0
        for x in torch.cat([t.reshape(-1, t.shape[-1]) for t in inputs[b.prefix]]).double():
            tokens += 1
            experts, top, ys, full = _routed(W, k, gu, down, x, list(range(E)), norm)
            for g, e, y in zip(top, experts, ys):
                count[e] += 1
                total[e] += g * y.norm()
                removal[e] += (
                    (_routed(W, k, gu, down, x, [j for j in range(E) if j != e], norm)[3] - full).pow(2).sum()
                )
        out[b.prefix] = (count, total, tokens, removal)
    return out


def _routed(W, k, gu, down, x, allowed, normalize=True):
    """The router's choice among ``allowed`` experts (softmax, top-k, renormalised if ``normalize``) and the
    routed output."""
    top, chosen = torch.topk(torch.softmax(W[allowed] @ x, dim=-1), k)
    top = top / top.sum() if normalize else top
    experts = [allowed[c] for c in chosen.tolist()]
    inter = gu.shape[1] // 2
    ys = [down[e] @ (F.silu(gu[e][:inter] @ x) * (gu[e][inter:] @ x)) for e in experts]
    return experts, top.tolist(), ys, sum(g * y for g, y in zip(top.tolist(), ys))


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_next", "qwen3_next-unnormalized"])
def test_reap_frequency_and_removal_equal_a_token_by_token_computation(model_type):
    model = random_dense_model(model_type.split("-")[0], seed=3)
    if model_type.endswith(
        "-unnormalized"
    ):  # a router that keeps the softmax weights of its top-k as they are
        for module in model.modules():
            if hasattr(module, "norm_topk_prob"):
                module.norm_topk_prob = False
    batches = [token_ids(seed=i, seq=9) for i in range(2)]
    reference = _brute_force(model, batches)
    for method, measure in (("projection", "removal_frequency"), ("activation", "frequency")):
        scores = score_model(model, batches, method=method, blocks=True, progress=False)
        for prefix, (count, total, tokens, removal) in reference.items():
            payload = scores["layers"][prefix]
            assert payload["kind"] == "experts" and payload["expert_measure"] == measure
            reap = torch.where(count > 0, total / count.clamp_min(1), torch.zeros_like(total))
            torch.testing.assert_close(
                torch.tensor(payload["expert_reap"], dtype=torch.float64), reap, rtol=1e-4, atol=1e-9
            )
            torch.testing.assert_close(
                torch.tensor(payload["expert_frequency"], dtype=torch.float64), count / tokens
            )
            torch.testing.assert_close(
                torch.tensor(payload["expert_removal"], dtype=torch.float64),
                removal / tokens,
                rtol=1e-4,
                atol=1e-10,
            )
            wanted = removal * count if measure == "removal_frequency" else count
            order = payload["expert_order_most_important_first"]
            assert all(wanted[a] >= wanted[b] - 1e-9 for a, b in zip(order, order[1:]))


def test_reap_and_removal_rank_a_busy_expert_with_a_tiny_output_last_and_frequency_does_not():
    model = random_dense_model("qwen3_5_moe", seed=5)
    batches = [token_ids(seed=i, seq=12) for i in range(2)]
    scores = score_model(model, batches, method="activation", blocks=True, progress=False)
    prefix = "model.layers.0.mlp"
    busiest = scores["layers"][prefix]["expert_order_most_important_first"][0]
    with torch.no_grad():  # the expert still gets routed, but writes almost nothing
        model.get_submodule(prefix).experts.down_proj[busiest] *= 1e-4
    reap = score_model(model, batches, method="projection", blocks=True, progress=False)["layers"][prefix]
    frequency = score_model(model, batches, method="activation", blocks=True, progress=False)["layers"][
        prefix
    ]
    assert int(torch.tensor(reap["expert_reap"]).argmin()) == busiest
    assert int(torch.tensor(reap["expert_removal"]).argmin()) == busiest  # removing it changes little
    assert frequency["expert_order_most_important_first"][0] == busiest


def test_score_writes_expert_orders_that_sort_applies(tmp_path):
    model = random_dense_model("qwen3_5_moe", seed=7)
    model.save_pretrained(tmp_path / "src")
    scores = score_model(model, [token_ids(seed=1, seq=16)], blocks=True, progress=False)
    save_scores(scores, tmp_path / "scores.json")
    read = read_scores(tmp_path / "scores.json")
    assert any(p.get("kind") == "experts" for p in read["layers"].values())
    manifest = ck.sort_checkpoint(
        tmp_path / "src", tmp_path / "scores.json", tmp_path / "sorted", progress=False
    )
    assert {p for p, e in manifest["blocks"].items() if e["kind"] == "experts"}
    ids = token_ids(seed=2)
    assert_same(logits(load_pretrained(tmp_path / "sorted"), ids), logits(model, ids))


def test_block_influence_is_one_minus_the_cosine_of_each_layer_input_and_output():
    model = random_dense_model("qwen3_5", seed=2)
    batches = [token_ids(seed=i, seq=8) for i in range(2)]
    influence = block_influence(model, batches)
    assert sorted(influence) == [0, 1, 2, 3]
    sums = torch.zeros(3, dtype=torch.float64)
    n = 0
    with torch.no_grad():
        for ids in batches:
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states  # [0]: embeddings
            for i in range(3):  # the last entry has the final norm applied: layers 0..2 only
                sums[i] += (1 - F.cosine_similarity(hidden[i].double(), hidden[i + 1].double(), dim=-1)).sum()
            n += ids.numel()
    for i in range(3):
        assert abs(influence[i] - float(sums[i] / n)) < 1e-9
    with torch.no_grad():  # a layer whose branches write nothing leaves the stream as it is: influence 0
        layer = model.model.layers[2]
        layer.linear_attn.out_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    assert abs(block_influence(model, batches)[2]) < 1e-12
