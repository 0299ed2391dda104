"""Scoring on real tiny transformers models: hook correctness, orders, payloads, invariances."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
import transformers
from tiny_models import build_model, clone_state_dict, logits, make_config

from gdnprune.checkpoint import slice_checkpoint, transform_checkpoint
from gdnprune.gated_delta_net import GDNPermutation, GDNShape, permute_gated_delta_net_state_dict
from gdnprune.io.scores_file import gdn_entries
from gdnprune.model.layouts import find_gdn_modules
from gdnprune.model.subblock_geometry import KINDS
from gdnprune.scoring import (
    GDN_ONLY,
    greedy_lane_orders,
    greedy_removal_order,
    score_checkpoint,
    score_model,
    scores_to_permutations,
)

SHAPE = GDNShape(num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6)
KERNEL_MODULE = {
    "qwen3_5": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_5_vl": "transformers.models.qwen3_5.modeling_qwen3_5",
    "qwen3_next": "transformers.models.qwen3_next.modeling_qwen3_next",
    "olmo_hybrid": "transformers.models.olmo_hybrid.modeling_olmo_hybrid",
}


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, 128, (4, 72), generator=torch.Generator().manual_seed(0))


def _score(model, ids, method="projection", batch_size=2, **kwargs):
    """The scores of the GDN layers alone, unless ``blocks`` says otherwise."""
    batches = [ids[i : i + batch_size] for i in range(0, ids.shape[0], batch_size)]
    return score_model(model, batches, method=method, progress=False, **{"blocks": GDN_ONLY, **kwargs})


# --------------------------------------------------------------------------------------------------
# greedy removal


def _reference_greedy(gram: torch.Tensor) -> list[int]:
    """Plain-Python greedy: drop the element that least increases |sum of dropped|^2."""
    n, dropped = gram.shape[0], []
    for _ in range(n):
        best = min(
            (i for i in range(n) if i not in dropped),
            key=lambda i: (float(gram[dropped + [i]][:, dropped + [i]].sum()), -i),
        )
        dropped.append(best)
    return dropped[::-1]


def test_greedy_removal_matches_reference_and_sees_redundancy():
    g = torch.Generator().manual_seed(1)
    for n in (1, 3, 6):
        vecs = torch.randn(n, 5, generator=g, dtype=torch.float64)
        gram = vecs @ vecs.T
        assert greedy_removal_order(gram).tolist() == _reference_greedy(gram)
    # two anti-correlated elements nearly cancel: once one is dropped the other is dropped too, and the
    # independent element survives although its own energy is below the first one's
    v, w = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 0.95**0.5], dtype=torch.float64)
    vecs = torch.stack([v, -0.95 * v, w])
    assert greedy_removal_order(vecs @ vecs.T).tolist() == [2, 0, 1]
    # a diagonal Gram is just a sort by energy, ties keep index order
    assert greedy_removal_order(torch.diag(torch.tensor([1.0, 3.0, 1.0, 2.0]))).tolist() == [1, 3, 0, 2]


def test_greedy_lane_orders_remove_one_lane_per_group_per_round():
    g = torch.Generator().manual_seed(2)
    vecs = torch.randn(12, 7, generator=g, dtype=torch.float64)
    orders = greedy_lane_orders(vecs @ vecs.T, 3)
    assert orders.shape == (3, 4)
    assert all(sorted(row) == [0, 1, 2, 3] for row in orders.tolist())
    # no cross-group terms: each group reduces to the plain greedy of its own block
    block = torch.block_diag(*[(v @ v.T) for v in vecs.reshape(3, 4, 7)])
    expected = [greedy_removal_order(block[4 * k : 4 * k + 4, 4 * k : 4 * k + 4]).tolist() for k in range(3)]
    assert greedy_lane_orders(block, 3).tolist() == expected


# --------------------------------------------------------------------------------------------------
# payloads on every model family; sorting with them preserves the function


@pytest.mark.parametrize(
    "model_type,method",
    [
        ("qwen3_5", "projection"),
        ("qwen3_5_vl", "projection"),
        ("qwen3_5_moe", "activation"),
        ("qwen3_next", "projection"),
        ("olmo_hybrid", "projection"),
        ("olmo_hybrid", "activation"),
    ],
)
def test_payloads_sort_model_and_preserve_logits(model_type, method, ids):
    model = build_model(model_type, SHAPE)
    scores = _score(model, ids, method)
    assert scores["format"] == "gdnprune-scores" and scores["version"] == 1
    assert scores["method"] == method and scores["num_tokens"] == ids.numel()
    prefixes = [p for p, _ in find_gdn_modules(model)]
    assert list(scores["layers"]) == prefixes
    sd = clone_state_dict(model)
    perms = scores_to_permutations(scores)
    for prefix, payload in scores["layers"].items():
        assert payload["shape"] == SHAPE.as_dict()
        assert torch.tensor(payload["value_lane_scores"]).shape == (2, 2)
        assert torch.tensor(payload["key_dim_scores"]).shape == (2, 8)
        perm = GDNPermutation.from_score_payload(payload, SHAPE)
        assert perm == perms[prefix]
        permute_gated_delta_net_state_dict(sd, prefix=prefix, shape=SHAPE, permutation=perm)
    sorted_model = build_model(model_type, SHAPE, randomize=False)
    sorted_model.load_state_dict(sd)
    assert (logits(sorted_model, ids) - logits(model, ids)).abs().max() < 1e-4


# --------------------------------------------------------------------------------------------------
# hook correctness against the tensors the kernel and out_proj actually see


def _direct_loss_gradients(model, ids: torch.Tensor) -> torch.Tensor:
    """d(summed next-token loss)/d(final norm input) [B, T, H] by autograd through the real model."""
    seen = {}
    norm = model.get_decoder().norm
    handle = norm.register_forward_pre_hook(lambda m, a: seen.__setitem__("h", a[0]))
    try:
        with torch.enable_grad():
            out = model(input_ids=ids, use_cache=False)
            loss = F.cross_entropy(
                out.logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum"
            )
            (grad,) = torch.autograd.grad(loss, seen["h"])
    finally:
        handle.remove()
    return grad.detach()


@pytest.mark.parametrize(
    "model_type,value_measure,key_measure,extra",
    [
        ("qwen3_5", "head_rms", "qk_rms", {}),
        ("qwen3_5", "gram", "qk_gram", {"loss_token_stride": 1}),
        ("qwen3_5_vl", "loss_gram", "qk_rms", {"key_group_measure": "loss_gram", "loss_token_stride": 3}),
        ("qwen3_next", "energy", "qk_energy", {"lane_measure": "energy_gram"}),
        ("olmo_hybrid", "head_rms", "qk_gram", {}),
    ],
)
def test_projection_statistics_match_brute_force(
    model_type, value_measure, key_measure, extra, ids, monkeypatch
):
    model = build_model(model_type, SHAPE)
    grads = _direct_loss_gradients(model, ids)
    modeling = importlib.import_module(KERNEL_MODULE[model_type])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    kernel = modeling.torch_chunk_gated_delta_rule

    def spy(query, key, value, **kwargs):
        seen.append((query.detach().clone(), key.detach().clone()))
        return kernel(query, key, value, **kwargs)

    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", spy)
    outs: list[torch.Tensor] = []
    (prefix, gdn), *_ = find_gdn_modules(model)
    out_proj = gdn.out_proj if hasattr(gdn, "out_proj") else gdn.o_proj
    handle = out_proj.register_forward_pre_hook(lambda m, a: outs.append(a[0].detach().clone()))
    try:
        payload = _score(
            model,
            ids,
            "projection",
            batch_size=4,
            value_dim_measure=value_measure,
            key_dim_measure=key_measure,
            **extra,
        )["layers"][prefix]
    finally:
        handle.remove()

    def close(key, expected, rtol=1e-5):
        torch.testing.assert_close(
            torch.tensor(payload[key], dtype=torch.float64), expected, rtol=rtol, atol=1e-9
        )

    q, k = seen[0]  # the first GDN layer's kernel inputs: [B, T, Hk, dk]
    o = outs[0].double().reshape(-1, SHAPE.num_value_heads, SHAPE.value_head_dim)
    N = o.shape[0]
    W = out_proj.weight.detach().double().reshape(-1, SHAPE.num_value_heads, SHAPE.value_head_dim)
    contrib = torch.einsum("nhe,khe->nhk", o, W)  # per-head contributions [N, Hv, H]
    per_dim = torch.einsum("nhe,khe->nek", o, W)  # per-value-channel contributions summed over heads
    # the loss-aware Grams: tokens t < T-1 with (t + window) % stride == 0, g . c summed over tokens
    stride = extra.get("loss_token_stride", 8)
    B, T = ids.shape
    pos = torch.arange(T)[None, :] + torch.arange(B)[:, None]
    chosen = ((pos % stride == 0) & (torch.arange(T) < T - 1)[None, :]).flatten()
    g = grads.double().flatten(0, 1)[chosen]
    g_heads = torch.einsum("nk,nhk->nh", g, contrib[chosen])
    g_dims = torch.einsum("nk,nek->ne", g, per_dim[chosen])
    loss_gram, loss_dim_gram = g_heads.T @ g_heads, g_dims.T @ g_dims
    n_loss = int(chosen.sum())
    assert payload.get("loss_tokens", n_loss) == n_loss
    energy_gram = torch.einsum("nhk,ngk->hg", contrib, contrib)
    lane_gram, lane_n = (
        (energy_gram, N) if extra.get("lane_measure") == "energy_gram" else (loss_gram, n_loss)
    )
    group_gram, group_n = (
        (loss_gram, n_loss) if extra.get("key_group_measure") == "loss_gram" else (energy_gram, N)
    )
    close("value_lane_scores", (lane_gram.diagonal() / lane_n).reshape(2, 2))
    group_gram = group_gram.reshape(2, 2, 2, 2).sum((1, 3))
    close("key_group_scores", group_gram.diagonal() / group_n)
    dim_gram = (
        loss_dim_gram if value_measure == "loss_gram" else torch.einsum("nek,nfk->ef", per_dim, per_dim)
    )
    if value_measure == "head_rms":
        per_head_dim = o[..., None] * W.permute(1, 2, 0)  # [N, Hv, dv, H]: W[:, (h, e)] o_(h, e)
        value_scores = per_head_dim.pow(2).sum(-1).mean(0).sqrt().sum(0)
    else:
        value_scores = dim_gram.diagonal() / (n_loss if value_measure == "loss_gram" else N)
    close("value_dim_scores", value_scores)

    def l2(x):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    qn, kn = l2(q).flatten(0, 1), l2(k).flatten(0, 1)  # [N, Hk, dk]
    q_energy, k_energy = qn.pow(2).mean(0), kn.pow(2).mean(0)
    key_scores = q_energy.sqrt() + k_energy.sqrt() if key_measure == "qk_rms" else q_energy * k_energy
    close("key_dim_scores", key_scores, rtol=1e-4)
    # the orders: greedy on the brute-force Gram matrices, or a sort by the scores
    assert payload["value_lane_order_most_important_first"] == greedy_lane_orders(lane_gram, 2).tolist()
    assert payload["key_group_order_most_important_first"] == greedy_removal_order(group_gram).tolist()
    greedy_dims = value_measure in ("gram", "loss_gram")
    expected_dims = greedy_removal_order(dim_gram) if greedy_dims else value_scores.argsort(descending=True)
    assert payload["value_dim_order_most_important_first"] == expected_dims.tolist()
    if key_measure == "qk_gram":
        expected_keys = [
            greedy_removal_order(qn[:, g].T @ qn[:, g] * (kn[:, g].T @ kn[:, g])).tolist()
            for g in range(SHAPE.num_key_heads)
        ]
    else:
        expected_keys = key_scores.argsort(dim=-1, descending=True).tolist()
    assert payload["key_dim_order_most_important_first"] == expected_keys


def _zero_rows(param: torch.Tensor, rows) -> None:
    with torch.no_grad():
        param[rows] = 0


@pytest.mark.parametrize("lane_measure", ["loss_gram", "energy_gram"])
def test_zeroed_value_head_and_group_rank_last(lane_measure, ids):
    model = build_model("qwen3_5", SHAPE)
    (p0, m0), (p1, m1) = find_gdn_modules(model)
    dv = SHAPE.value_head_dim
    with torch.no_grad():
        m0.out_proj.weight[:, 1 * dv : 2 * dv] = 0  # value head 1 = group 0, lane 1
        m1.out_proj.weight[:, 0 : 2 * dv] = 0  # both heads of group 0
    scores = _score(model, ids, lane_measure=lane_measure)
    assert scores["measures"]["value_lane"] == lane_measure
    layers = scores["layers"]
    assert layers[p0]["value_lane_order_most_important_first"][0][-1] == 1
    assert layers[p0]["value_lane_scores"][0][1] == 0.0
    assert layers[p1]["value_lane_scores"][0] == [0.0, 0.0]
    assert min(layers[p1]["value_lane_scores"][1]) > 0
    assert layers[p1]["key_group_order_most_important_first"][-1] == 0
    assert layers[p1]["key_group_scores"][0] == 0.0


def test_loss_aware_lanes_discount_output_the_head_cannot_see(ids):
    """Lane 0 of group 1 writes 4x the energy of lane 1, but only into hidden dims that no other module
    writes, the final norm zeroes and lm_head ignores (the loss sees them only through the norm's scale):
    first by energy, last by the loss-aware Gram."""
    model = build_model("qwen3_5", SHAPE)
    (_, m0), (prefix, m) = find_gdn_modules(model)
    dv, dead = SHAPE.value_head_dim, slice(0, 8)
    hidden = model.config.hidden_size
    writers = [
        x for x in model.model.modules() if isinstance(x, torch.nn.Linear) and x.out_features == hidden
    ]
    assert len(writers) == 8  # 2 GDN out_proj, 2 attention o_proj, 4 MLP down_proj
    with torch.no_grad():
        model.model.embed_tokens.weight[:, dead] = 0
        for writer in writers:
            writer.weight[dead] = 0
        model.model.norm.weight[dead] = -1.0  # Qwen3.5's norm scales by (1 + weight)
        model.lm_head.weight[:, dead] = 0
        w = m.out_proj.weight
        w[:, 2 * dv : 3 * dv] = 0
        w[dead, 2 * dv : 3 * dv] = torch.randn(8, dv, generator=torch.Generator().manual_seed(3))
    e0, e1 = _score(model, ids, lane_measure="energy_gram")["layers"][prefix]["value_lane_scores"][1]
    with torch.no_grad():
        w[:, 2 * dv : 3 * dv] *= (4 * e1 / e0) ** 0.5  # lane 0's output energy: 4x lane 1's
    energy = _score(model, ids, lane_measure="energy_gram")["layers"][prefix]
    loss = _score(model, ids, lane_measure="loss_gram")["layers"][prefix]
    e0, e1 = energy["value_lane_scores"][1]
    assert e0 == pytest.approx(4 * e1, rel=1e-6)
    assert energy["value_lane_order_most_important_first"][1] == [0, 1]
    assert loss["value_lane_order_most_important_first"][1] == [1, 0]
    l0, l1 = loss["value_lane_scores"][1]
    assert l0 < 0.6 * l1


def test_models_without_a_final_norm_fall_back_to_the_energy_gram(ids):
    model = build_model("qwen4_exp", SHAPE)  # hyper-connections: no decoder.norm before lm_head
    with pytest.warns(RuntimeWarning, match="no final norm"):
        fallback = _score(model, ids)
    assert fallback["measures"]["value_lane"] == "energy_gram"
    assert fallback["layers"] == _score(model, ids, lane_measure="energy_gram")["layers"]


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("method", ["projection", "activation"])
def test_zeroed_key_and_value_channels_rank_last(model_type, method, ids):
    model = build_model(model_type, SHAPE)
    (prefix, m), *_ = find_gdn_modules(model)
    Hk, dk, dv = SHAPE.num_key_heads, SHAPE.key_head_dim, SHAPE.value_head_dim
    g, d, e = 1, 3, 2
    if model_type == "qwen3_5":
        w = m.in_proj_qkv.weight
        q_row, k_row = g * dk + d, Hk * dk + g * dk + d
        v_rows = [2 * Hk * dk + h * dv + e for h in range(SHAPE.num_value_heads)]
    else:  # fused per group: [q_g, k_g, v_g (r*dv), z_g (r*dv)]
        w = m.in_proj_qkvz.weight
        r = SHAPE.value_heads_per_group
        per = 2 * dk + 2 * r * dv
        q_row, k_row = g * per + d, g * per + dk + d
        v_rows = [gg * per + 2 * dk + j * dv + e for gg in range(Hk) for j in range(r)]
    _zero_rows(w, [q_row, k_row, *v_rows])
    payload = _score(model, ids, method)["layers"][prefix]
    assert payload["key_dim_order_most_important_first"][g][-1] == d
    assert payload["key_dim_scores"][g][d] == 0.0
    assert payload["value_dim_order_most_important_first"][-1] == e
    assert payload["value_dim_scores"][e] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("method", ["projection", "activation"])
def test_duplicated_value_head_is_scored_like_its_original(method, ids):
    model = build_model("qwen3_5", SHAPE)
    (prefix, m), *_ = find_gdn_modules(model)
    Hk, dk, dv = SHAPE.num_key_heads, SHAPE.key_head_dim, SHAPE.value_head_dim
    src, dst = 2, 3  # lanes 0 and 1 of group 1
    with torch.no_grad():
        for lin, base in ((m.in_proj_qkv, 2 * Hk * dk), (m.in_proj_z, 0)):
            lin.weight[base + dst * dv : base + (dst + 1) * dv] = lin.weight[
                base + src * dv : base + (src + 1) * dv
            ]
        c = m.conv1d.weight
        c[2 * Hk * dk + dst * dv : 2 * Hk * dk + (dst + 1) * dv] = c[
            2 * Hk * dk + src * dv : 2 * Hk * dk + (src + 1) * dv
        ]
        for p in (m.in_proj_a.weight, m.in_proj_b.weight, m.A_log, m.dt_bias):
            p[dst] = p[src]
        m.out_proj.weight[:, dst * dv : (dst + 1) * dv] = m.out_proj.weight[:, src * dv : (src + 1) * dv]
    payload = _score(model, ids, method)["layers"][prefix]
    a, b = payload["value_lane_scores"][1]
    assert a == pytest.approx(b, rel=1e-6)
    assert a > 0


def test_orders_follow_a_function_preserving_permutation(ids):
    """Scoring a permuted model gives the permuted orders (catches any index mix-up in the hooks)."""
    model = build_model("qwen3_next", SHAPE)
    scores = _score(model, ids)
    perm = GDNPermutation.random(SHAPE, generator=torch.Generator().manual_seed(5))
    sd = clone_state_dict(model)
    for prefix in scores["layers"]:
        permute_gated_delta_net_state_dict(sd, prefix=prefix, shape=SHAPE, permutation=perm)
    permuted = build_model("qwen3_next", SHAPE, randomize=False)
    permuted.load_state_dict(sd)
    new_scores = _score(permuted, ids)
    G, L, K, V = perm.key_groups, perm.value_lanes, perm.key_dim, perm.value_dim
    for prefix, old in scores["layers"].items():
        new = {k: torch.tensor(v) for k, v in new_scores["layers"][prefix].items() if "order" in k}
        assert (
            G[new["key_group_order_most_important_first"]].tolist()
            == old["key_group_order_most_important_first"]
        )
        for p in range(SHAPE.num_key_heads):
            old_g = int(G[p])
            lanes = L[old_g][new["value_lane_order_most_important_first"][p]].tolist()
            assert lanes == old["value_lane_order_most_important_first"][old_g]
            dims = K[old_g][new["key_dim_order_most_important_first"][p]].tolist()
            assert dims == old["key_dim_order_most_important_first"][old_g]
        assert (
            V[new["value_dim_order_most_important_first"]].tolist()
            == old["value_dim_order_most_important_first"]
        )


@pytest.mark.parametrize(
    "method,extra",
    [
        ("projection", {}),
        ("activation", {}),
        (
            "projection",
            {"value_dim_measure": "loss_gram", "key_group_measure": "loss_gram", "loss_token_stride": 5},
        ),
    ],
)
def test_batch_size_invariance(method, extra, ids):
    model = build_model("qwen3_5", SHAPE)
    one = _score(model, ids, method, batch_size=1, **extra)
    four = _score(model, ids, method, batch_size=4, **extra)
    assert one["num_tokens"] == four["num_tokens"] == ids.numel()
    for prefix, a in one["layers"].items():
        b = four["layers"][prefix]
        for key, value in a.items():
            if key.endswith("_scores"):
                torch.testing.assert_close(torch.tensor(value), torch.tensor(b[key]), rtol=1e-5, atol=1e-12)
            elif "order" in key:
                assert value == b[key], key


def test_attention_mask_excludes_padding(ids):
    model = build_model("qwen3_5", SHAPE)
    full = _score(model, ids[:2, :64], batch_size=2)
    padded = torch.cat([ids[:2, :64], torch.zeros(2, 8, dtype=torch.long)], dim=1)
    mask = torch.ones_like(padded)
    mask[:, 64:] = 0
    masked = score_model(
        model, [{"input_ids": padded, "attention_mask": mask}], progress=False, blocks=GDN_ONLY
    )
    assert masked["num_tokens"] == full["num_tokens"] == 128
    for prefix, a in full["layers"].items():
        torch.testing.assert_close(
            torch.tensor(masked["layers"][prefix]["value_lane_scores"]),
            torch.tensor(a["value_lane_scores"]),
            rtol=1e-5,
            atol=1e-12,
        )


def test_random_method_is_seeded_and_needs_no_forward():
    model = build_model("qwen3_5", SHAPE)
    a = score_model(model, [], method="random", seed=3, progress=False, blocks=GDN_ONLY)
    b = score_model(model, [], method="random", seed=3, progress=False, blocks=GDN_ONLY)
    c = score_model(model, [], method="random", seed=4, progress=False, blocks=GDN_ONLY)
    assert a == b and a["layers"] != c["layers"]
    for payload in a["layers"].values():
        perm = GDNPermutation.from_score_payload(payload, SHAPE)
        scores = torch.tensor(payload["key_dim_scores"])
        assert torch.equal(scores.argsort(dim=-1, descending=True), perm.key_dim)


def test_bad_arguments_raise_value_error(ids):
    model = build_model("qwen3_5", SHAPE)
    with pytest.raises(ValueError, match="unknown scoring method"):
        score_model(model, [ids], method="magnitude", progress=False)
    with pytest.raises(ValueError, match="unknown lane_measure"):
        score_model(model, [ids], lane_measure="fisher", progress=False)
    with pytest.raises(ValueError, match="loss_token_stride"):
        score_model(model, [ids], loss_token_stride=0, progress=False)
    with pytest.raises(ValueError, match="no token with a next-token target"):
        score_model(model, [ids[:, :1]], progress=False)
    with pytest.raises(ValueError, match="no calibration tokens"):
        score_model(model, [], progress=False)
    with pytest.raises(ValueError, match="no GatedDeltaNet layers"):
        score_model(torch.nn.Linear(2, 2), [ids], progress=False)
    with pytest.raises(ValueError, match="input_ids"):
        score_model(model, [torch.zeros(2, 3, 4)], progress=False)


# --------------------------------------------------------------------------------------------------
# statistics: shares add up to the whole (what ranks and partial files rely on); the loss-token stride


@pytest.mark.parametrize(
    "method,extra",
    [
        ("projection", {"loss_token_stride": 3}),
        ("projection", {"value_dim_measure": "gram", "key_dim_measure": "qk_gram"}),
        ("projection", {"value_dim_measure": "energy", "lane_measure": "energy_gram"}),
        (
            "projection",
            {"value_dim_measure": "loss_gram", "key_group_measure": "loss_gram", "loss_token_stride": 5},
        ),
        ("activation", {}),
    ],
)
def test_statistics_of_shares_add_up_to_the_whole(method, extra, ids):
    from gdnprune.scoring import measure_statistics, scores_from_statistics

    model = build_model("qwen3_5", SHAPE)
    extra = {"blocks": GDN_ONLY, **extra}  # the GDN layers' statistics
    whole = measure_statistics(model, [ids[:2], ids[2:]], method=method, progress=False, **extra)
    first = measure_statistics(model, [ids[:1]], method=method, progress=False, **extra)
    rest = measure_statistics(
        model, [ids[1:3], ids[3:]], method=method, progress=False, window_offset=1, **extra
    )
    empty = measure_statistics(model, [], method=method, progress=False, **extra)  # a rank with no windows
    assert first.measures == whole.measures and list(first.layers) == list(whole.layers)
    for prefix, layer in whole.layers.items():
        assert sorted(layer.stats) == sorted(first.layers[prefix].stats) == sorted(empty.layers[prefix].stats)
        for name, value in layer.stats.items():
            parts = (
                first.layers[prefix].stats[name],
                rest.layers[prefix].stats[name],
                empty.layers[prefix].stats[name],
            )
            total = parts[0] + parts[1] + parts[2]
            assert total.dtype == value.dtype and total.device.type == "cpu"
            torch.testing.assert_close(total, value, rtol=1e-12, atol=1e-12)
            first.layers[prefix].stats[name] = total
    expected = score_model(model, [ids], method=method, progress=False, **extra)
    merged = scores_from_statistics(first)
    assert merged["world_size"] == expected["world_size"] == 1
    for prefix, payload in expected["layers"].items():
        for key, value in payload.items():
            if key.endswith("_scores"):
                torch.testing.assert_close(
                    torch.tensor(merged["layers"][prefix][key]), torch.tensor(value), rtol=1e-9, atol=0
                )
            else:
                assert merged["layers"][prefix][key] == value, key
    with pytest.raises(ValueError, match="statistic 'head_gram' should have shape"):
        from gdnprune.scoring.payload import layer_payload

        layer = next(iter(whole.layers.values()))
        layer_payload(
            {**layer.stats, "head_gram": torch.zeros(3, 3, dtype=torch.float64)},
            prefix="p",
            shape=layer.shape,
            layout=layer.layout,
            method="projection",
            measures={
                "key_group": "energy_gram",
                "value_lane": "energy_gram",
                "key_dim": "qk_rms",
                "value_dim": "head_rms",
            },
        )


def test_the_default_loss_token_stride_bounds_the_vocabulary_cost(ids):
    from gdnprune.scoring.loss_head import MAX_DEFAULT_LOSS_TOKEN_STRIDE, default_loss_token_stride

    def forward_params(model):
        skip = {id(model.lm_head.weight), id(model.get_input_embeddings().weight)}
        return sum(p.numel() for p in model.parameters() if id(p) not in skip)

    strides = {}
    for vocab in (128, 1024, 4096, 65536):
        config = make_config("qwen3_5", SHAPE)
        config.vocab_size = vocab
        with torch.device("meta"):
            model = transformers.Qwen3_5ForCausalLM(config)
        stride = strides[vocab] = default_loss_token_stride(model, model.lm_head)
        cost = 2 * vocab * config.hidden_size
        assert stride in (8, 16, 32, 64)
        if stride < MAX_DEFAULT_LOSS_TOKEN_STRIDE:  # the smallest stride within an eighth of the forward
            assert cost * 8 <= forward_params(model) * stride
        if stride > 8:
            assert cost * 8 > forward_params(model) * (stride // 2)
    assert strides[128] == 8 and strides[65536] == 64 and sorted(strides.values()) == list(strides.values())
    # score_model uses it, records it and measures one token in that many (by the global window index)
    config = make_config("qwen3_5", SHAPE)
    config.vocab_size = 4096
    model = build_model("qwen3_5", SHAPE, config=config)
    scores = _score(model, ids, "projection")
    stride = scores["measures"]["loss_token_stride"]
    assert stride == strides[4096] > 8
    B, T = ids.shape
    pos = torch.arange(T)[None, :] + torch.arange(B)[:, None]
    expected = int(((pos % stride == 0) & (torch.arange(T) < T - 1)[None, :]).sum())
    assert all(p["loss_tokens"] == expected for p in scores["layers"].values())


# ---- the kinds of block to score, and the old keywords ------------------------------------------------------


def test_blocks_names_the_kinds_to_order_and_none_is_every_kind(ids):
    model = build_model("qwen3_5_moe", SHAPE, seed=5)
    every = _score(model, ids[:2], method="activation", blocks=None)
    gdn = list(gdn_entries(every["layers"]))
    kinds = {v["kind"] for k, v in every["layers"].items() if k not in gdn}
    assert kinds == {"attention", "shared_expert", "experts"}  # every kind this MoE model has
    default = score_model(model, [ids[:2]], method="activation", progress=False)
    assert default["layers"] == every["layers"]  # the library default: every kind, as `gdnprune score`
    assert list(_score(model, ids[:2], method="activation", blocks=GDN_ONLY)["layers"]) == gdn
    named = _score(model, ids[:2], method="activation", blocks=["gdn", "experts", "depth"])
    assert {v.get("kind") for v in named["layers"].values()} == {None, "experts"}
    for key in gdn:
        assert named["layers"][key] == every["layers"][key]  # the other kinds change no GDN order
    with pytest.warns(FutureWarning, match="blocks=True"):
        old = _score(model, ids[:2], method="activation", blocks=True)
    assert old["layers"] == every["layers"] and set(KINDS) >= kinds
    for bad, match in ((["mlp"], "must include 'gdn'"), (["gdn", "ffn"], "must name some of")):
        with pytest.raises(ValueError, match=match):
            _score(model, ids[:2], method="activation", blocks=bad)


def test_score_checkpoints_old_keywords_warn_and_still_work(tmp_path):
    for old, value, new in (
        ("refine", "lanes", "lane_search"),
        ("refine_samples", 4, "lane_search_samples"),
        ("compensation", True, "compensate"),
    ):
        with pytest.warns(FutureWarning, match=f"`{old}` is deprecated.*`{new}`"):
            with pytest.raises(ValueError, match="not a model folder"):  # the call went through
                score_checkpoint(tmp_path / "nothing", tmp_path / "text.txt", **{old: value})
        with pytest.raises(TypeError, match=f"`{old}` and `{new}`"):
            score_checkpoint(tmp_path / "nothing", tmp_path / "text.txt", **{old: value, new: value})
    with pytest.raises(ValueError, match="unknown refinement"):
        score_checkpoint(tmp_path / "nothing", tmp_path / "text.txt", refine="heads")
    for function, extra in ((slice_checkpoint, {}), (transform_checkpoint, {"operation": "slice"})):
        with pytest.warns(FutureWarning, match="`compensation` is deprecated.*`compensation_stats`"):
            with pytest.raises((ValueError, OSError)):  # the statistics are `compensation_stats` now
                function(
                    tmp_path / "no", tmp_path / "out", target={"num_key_heads": 1}, compensation="s", **extra
                )
