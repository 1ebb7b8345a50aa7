"""The EAGLE-3 draft: shapes, the TTT attention structure, vocab, checkpoint files, loss masking."""

import json

import pytest
import torch
from safetensors.torch import load_file

from eaglet.draft.checkpoint import load_training_state, save_training_state
from eaglet.draft.methods.eagle3_checkpoint import load_draft, save_draft
from eaglet.draft.methods.eagle3_model import (
    TTT,
    Eagle3Config,
    Eagle3Draft,
    ttt_attention,
    ttt_attention_mask,
)
from eaglet.draft.methods.eagle3_ttt import ttt_loss, ttt_start, ttt_unroll
from eaglet.draft.methods.loss import position_loss, target_in_vocab, target_probs
from eaglet.draft.train_data import epoch_batches
from eaglet.draft.vocab import DraftVocab, build_draft_vocab, count_tokens

H, V, VD = 32, 50, 20


def tiny_config(**overrides) -> Eagle3Config:
    kw = dict(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        draft_vocab_size=VD,
        target_hidden_size=H,
        rope_theta=10000.0,
        max_position_embeddings=256,
    )
    return Eagle3Config(**(kw | overrides))


@pytest.fixture
def draft() -> Eagle3Draft:
    torch.manual_seed(0)
    model = Eagle3Draft(tiny_config())
    vocab_ids = torch.arange(0, 2 * VD, 2)  # every other target id
    model.set_vocab(vocab_ids - torch.arange(VD), torch.isin(torch.arange(V), vocab_ids))
    return model.eval()


def test_shapes(draft):
    B, T = 2, 7
    aux = torch.randn(B, T, 3 * H)
    embed = torch.randn(V, H)
    hidden = draft.fuse(aux)
    assert hidden.shape == (B, T, H)
    positions = torch.arange(T).expand(B, T)
    out, cache = draft(torch.randn(B, T, H), hidden, positions, None, ttt_attention_mask(T, 0))
    assert out.shape == (B, T, H)
    assert len(cache) == 1 and cache[0][0].shape == (B, 2, T, 8)  # [B, n_kv, T, head_dim]
    assert draft.compute_logits(out).shape == (B, T, VD)
    step_logits = ttt_unroll(draft, embed, torch.randint(0, V, (B, T)), hidden, ttt_length=3)
    assert [s.shape for s in step_logits] == [(B, T, VD)] * 3
    assert draft.to_target_ids(torch.tensor([0, 1, 5])).tolist() == [0, 2, 10]


def test_ttt_mask_values():
    m = ttt_attention_mask(3, 2)
    expected = [
        [1, 0, 0, 1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1, 0, 0, 1],
    ]
    assert m.int().tolist() == expected


def _unroll_with_cache(draft, emb_steps, hidden, T, cache_edit=None):
    """Three TTT steps by hand; `cache_edit(cache)` may change the cache before the last step."""
    positions = torch.arange(T)[None]
    cache = []
    for i, emb in enumerate(emb_steps):
        if i == len(emb_steps) - 1 and cache_edit is not None:
            cache = cache_edit(cache)
        hidden, cache = draft(emb, hidden, positions + i, cache, ttt_attention_mask(T, i))
    return hidden  # [1, T, H], output of the last step


def test_ttt_attention_sees_only_causal_step0_and_own_diagonal(draft):
    """Step 2 at index t: step-0 keys <= t and step-1/step-2 keys at t only."""
    torch.manual_seed(1)
    T, t = 6, 3
    emb_steps = [torch.randn(1, T, H) for _ in range(3)]
    hidden = torch.randn(1, T, H)
    base = _unroll_with_cache(draft, emb_steps, hidden, T)

    def perturb(step: int, index: int):
        def edit(cache):
            cache = [(k.clone(), v.clone()) for k, v in cache]
            cache[step][0][:, :, index] += 5.0  # one key, every kv head
            return cache

        return _unroll_with_cache(draft, emb_steps, hidden, T, edit)[0, t]

    for step, index in [(0, 4), (0, 5), (1, 2), (1, 4), (1, 0)]:  # not visible from (step 2, t)
        torch.testing.assert_close(perturb(step, index), base[0, t], rtol=0, atol=0)
    for step, index in [(0, 0), (0, 3), (1, 3)]:  # visible
        assert not torch.allclose(perturb(step, index), base[0, t])


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_ttt_pattern_equals_the_dense_mask_in_values_and_gradients(kv_heads):
    """`TTT` (causal step-0 block plus one diagonal score per later step) computes what SDPA
    computes under `ttt_attention_mask`, forward and backward, at every step, with and without
    grouped kv heads."""
    torch.manual_seed(3)
    draft = Eagle3Draft(tiny_config(num_key_value_heads=kv_heads)).double()
    B, T, steps = 2, 9, 4
    embs = [torch.randn(B, T, H, dtype=torch.float64) for _ in range(steps)]
    aux = torch.randn(B, T, 3 * H, dtype=torch.float64)

    def unroll(pattern):
        draft.zero_grad()
        hidden, cache, outputs = draft.fuse(aux), [], []
        for i, emb in enumerate(embs):
            mask = TTT if pattern == TTT else ttt_attention_mask(T, i)
            hidden, cache = draft(emb, hidden, torch.arange(T)[None] + i, cache, mask)
            outputs.append(hidden)
        sum((draft.compute_logits(o) * (j + 1)).sum() for j, o in enumerate(outputs)).backward()
        return outputs, {n: p.grad.clone() for n, p in draft.named_parameters()}

    dense_out, dense_grads = unroll("dense")
    ttt_out, ttt_grads = unroll(TTT)
    for dense, fused in zip(dense_out, ttt_out, strict=True):
        torch.testing.assert_close(fused, dense, rtol=1e-10, atol=1e-10)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(ttt_grads[name], grad, rtol=1e-9, atol=1e-10, msg=name)


def test_ttt_pattern_under_bfloat16_autocast_matches_the_dense_mask():
    """Under CPU bfloat16 autocast (train.precision) the `TTT` pattern runs, and its outputs and
    gradients stay within bfloat16 rounding of the dense masked SDPA's."""
    torch.manual_seed(4)
    draft = Eagle3Draft(tiny_config(num_key_value_heads=2))
    B, T, steps = 2, 17, 3
    embs = [torch.randn(B, T, H) for _ in range(steps)]
    aux = torch.randn(B, T, 3 * H)

    def unroll(pattern):
        draft.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden, cache, logits = draft.fuse(aux), [], []
            for i, emb in enumerate(embs):
                mask = TTT if pattern == TTT else ttt_attention_mask(T, i)
                hidden, cache = draft(emb, hidden, torch.arange(T)[None] + i, cache, mask)
                logits.append(draft.compute_logits(hidden).float())
        sum(x.logsumexp(-1).mean() for x in logits).backward()
        return logits, {n: p.grad.clone() for n, p in draft.named_parameters()}

    dense_logits, dense_grads = unroll("dense")
    ttt_logits, ttt_grads = unroll(TTT)
    for dense, fused in zip(dense_logits, ttt_logits, strict=True):
        torch.testing.assert_close(fused, dense, rtol=0.02, atol=0.02)
    for name, grad in dense_grads.items():
        assert (ttt_grads[name] - grad).norm() <= 0.02 * grad.norm(), name


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_ttt_attention_with_later_steps_from_start_equals_the_dense_mask(kv_heads):
    """Queries at indices start..T-1 (a later TTT step that skips the prompt): the step-0 keys
    before start are all visible, those after are causal, each later step's key diagonal; the
    CPU kernel gives SDPA's values and gradients under `ttt_attention_mask(..., start)`."""
    torch.manual_seed(8)
    B, h, T, D, start, steps = 2, 4, 11, 8, 4, 3
    q = torch.randn(B, h, T - start, D, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(B, kv_heads, T, D, dtype=torch.float64, requires_grad=True)]
    keys += [
        torch.randn(B, kv_heads, T - start, D, dtype=torch.float64, requires_grad=True)
        for _ in range(steps - 1)
    ]
    values = [torch.randn_like(k, requires_grad=True) for k in keys]
    leaves = [q, *keys, *values]

    def run(fused: bool):
        if fused:
            out = ttt_attention(q, keys, values)
        else:
            mask = ttt_attention_mask(T, steps - 1, start=start)
            out = torch.nn.functional.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                enable_gqa=kv_heads != h,
            )  # fmt: skip
        grads = torch.autograd.grad((out * torch.arange(out.numel()).view_as(out)).sum(), leaves)
        return out, grads

    dense, dense_grads = run(False)
    fused, fused_grads = run(True)
    torch.testing.assert_close(fused, dense, rtol=1e-10, atol=1e-10)
    for a, b in zip(fused_grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_ttt_start_is_the_first_index_a_later_step_can_count():
    """Step i >= 1 at index t counts only when x_{t+2+i} is model output: with the earliest
    answer at index a in the batch and TTT length L, nothing below a - L - 1 can count."""
    mask = torch.zeros(3, 20, dtype=torch.bool)
    mask[0, 12:], mask[1, 9:15], mask[2, 17:] = True, True, True
    assert ttt_start(mask, 4) == 9 - 4 - 1
    assert ttt_start(mask[:, :], 1) == 0  # no later steps
    assert ttt_start(mask[2:], 3) == 17 - 3 - 1
    assert ttt_start(torch.zeros(2, 5, dtype=torch.bool), 4) == 0  # min(T - L - 1, ...) < 0
    assert ttt_start(torch.ones(2, 5, dtype=torch.bool), 4) == 0


def test_later_steps_from_ttt_start_give_the_whole_unrolls_loss_and_gradients(draft):
    """Skipping the later steps' indices below `ttt_start` changes nothing the loss reads: the
    loss, the per-step stats and every gradient equal the unroll over all indices."""
    torch.manual_seed(9)
    draft = draft.double().train()
    B, T, L = 3, 16, 4
    embed = torch.randn(V, H, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T))
    aux = torch.randn(B, T, 3 * H, dtype=torch.float64)
    lengths = torch.tensor([16, 14, 12])
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    loss_mask[0, 11:16], loss_mask[1, 10:14], loss_mask[2, 12:12] = True, True, True
    in_vocab = torch.rand(B, T) > 0.2
    probs = torch.randn(B, T, VD, dtype=torch.float64).softmax(-1)
    start = ttt_start(loss_mask, L)
    assert start == 10 - L - 1

    def loss_and_grads(first: int):
        draft.zero_grad()
        logits = ttt_unroll(draft, embed, ids, draft.fuse(aux), L, first)
        assert [x.shape[1] for x in logits] == [T] + [T - first] * (L - 1)
        loss, stats = ttt_loss(logits, probs, in_vocab, loss_mask, lengths, 0.8, start=first)
        loss.backward()
        return loss, stats, {n: p.grad.clone() for n, p in draft.named_parameters()}

    whole_loss, whole_stats, whole_grads = loss_and_grads(0)
    part_loss, part_stats, part_grads = loss_and_grads(start)
    torch.testing.assert_close(part_loss, whole_loss, rtol=1e-10, atol=1e-12)
    assert part_stats.count == whole_stats.count and sum(whole_stats.count) > 0
    for name, grad in whole_grads.items():
        torch.testing.assert_close(part_grads[name], grad, rtol=1e-8, atol=1e-12, msg=name)
    with pytest.raises(ValueError, match="before start"):  # a start past a counted index
        ttt_loss(
            ttt_unroll(draft, embed, ids, draft.fuse(aux), L, start + 3),
            probs, in_vocab, loss_mask, lengths, 0.8, start=start + 3,
        )  # fmt: skip


def test_an_unknown_attention_pattern_is_refused(draft):
    with pytest.raises(ValueError, match="unknown attention pattern 'causal'"):
        draft(torch.randn(1, 3, H), torch.randn(1, 3, H), torch.arange(3)[None], None, "causal")


def test_ttt_unroll_equals_inference_at_every_index(draft):
    """What TTT computes at index t equals drafting after the prefix x_0..x_t: step 0 over the
    prefix, then single-position steps at t with the draft's hidden and position t + i."""
    torch.manual_seed(2)
    T, steps = 6, 3
    embed = torch.randn(V, H)
    ids = torch.randint(0, V, (1, T + steps))
    hidden = torch.randn(1, T, H)
    with torch.no_grad():
        unrolled = ttt_unroll(draft, embed, ids, hidden, steps)
        for t in range(T):
            emb0 = embed[ids[:, 1 : t + 2]]  # [1, t+1, H]
            pos = torch.arange(t + 1)[None]
            h, cache = draft(emb0, hidden[:, : t + 1], pos, None, ttt_attention_mask(t + 1, 0))
            h = h[:, -1:]
            logits = [draft.compute_logits(h)[0, 0]]
            for i in range(1, steps):
                emb = embed[ids[:, t + 1 + i]][:, None]  # [1, 1, H]
                h, cache = draft(emb, h, torch.tensor([[t + i]]), cache, None)
                logits.append(draft.compute_logits(h)[0, 0])
            for i in range(steps):
                torch.testing.assert_close(unrolled[i][0, t], logits[i], rtol=1e-5, atol=1e-5)


def test_vocab_counts_caps_and_maps():
    ids = torch.tensor([7, 7, 7, 3, 3, 9, 1, 1, 1, 1, 4])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 1])  # the four 1s are prompt tokens
    counts = count_tokens(ids, mask, target_vocab_size=12)
    assert counts[1] == 0 and counts[7] == 3 and counts[3] == 2

    vocab = build_draft_vocab(counts, size=2)
    assert vocab.token_ids == (3, 7)  # two most frequent, ascending
    assert vocab.coverage == pytest.approx(5 / 7)
    assert vocab.counted_tokens == 7

    capped = build_draft_vocab(counts, size=100)  # only 4 distinct ids were seen
    assert capped.size == 4 and capped.token_ids == (3, 4, 7, 9)
    assert capped.coverage == 1.0

    tie = build_draft_vocab(counts, size=3)  # 4 and 9 tie at one: the lower id wins
    assert tie.token_ids == (3, 4, 7)

    for v in (vocab, capped, tie):
        d2t, t2d = v.d2t, v.t2d
        assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool and len(t2d) == 12
        assert (torch.arange(v.size) + d2t).tolist() == list(v.token_ids)
        assert t2d.nonzero().flatten().tolist() == list(v.token_ids)
        assert int(t2d.sum()) == v.size

    with pytest.raises(ValueError):
        build_draft_vocab(torch.zeros(12, dtype=torch.int64), size=4)


def test_vocab_save_load(tmp_path):
    vocab = build_draft_vocab(torch.tensor([0, 5, 0, 2, 9]), size=2)
    vocab.save(tmp_path / "vocab.json")
    assert DraftVocab.load(tmp_path / "vocab.json") == vocab
    assert DraftVocab.from_d2t(vocab.d2t, 5).token_ids == vocab.token_ids


def test_checkpoint_round_trip_and_config(draft, tmp_path):
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p))  # not the init values
    save_draft(draft, tmp_path / "draft", [2, 5, 9], "hf_hidden_states_index")

    weights = load_file(str(tmp_path / "draft" / "model.safetensors"))
    assert set(weights) == {
        "midlayer.self_attn.q_proj.weight",
        "midlayer.self_attn.k_proj.weight",
        "midlayer.self_attn.v_proj.weight",
        "midlayer.self_attn.o_proj.weight",
        "midlayer.mlp.gate_proj.weight",
        "midlayer.mlp.up_proj.weight",
        "midlayer.mlp.down_proj.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "fc.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
    }
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    assert weights["midlayer.self_attn.k_proj.weight"].shape == (2 * 8, 2 * H)
    assert weights["midlayer.self_attn.o_proj.weight"].shape == (H, 4 * 8)
    assert weights["fc.weight"].shape == (H, 3 * H)
    assert weights["lm_head.weight"].shape == (VD, H)
    assert weights["d2t"].dtype == torch.int64 and weights["d2t"].shape == (VD,)
    assert weights["t2d"].dtype == torch.bool and weights["t2d"].shape == (V,)

    config = json.loads((tmp_path / "draft" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
    assert config["vocab_size"] == V and config["draft_vocab_size"] == VD
    assert config["hidden_size"] == H and config["target_hidden_size"] == H
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2
    assert config["head_dim"] == 8 and config["intermediate_size"] == 48
    assert config["tie_word_embeddings"] is False and config["hidden_act"] == "silu"
    assert config["torch_dtype"] == "float32"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 5, 9]
    assert config["eagle_config"] == {
        "eagle_aux_hidden_state_layer_ids": [2, 5, 9],
        "use_aux_hidden_state": True,
    }
    assert config["eaglet"] == {"aux_layer_convention": "hf_hidden_states_index"}
    # the architecture variants are said outright (vLLM reads each; eaglet trains none)
    for key in ("norm_before_fc", "norm_before_residual", "norm_output"):
        assert config[key] is False
    for key in ("rms_norm_eps", "rope_theta", "max_position_embeddings"):
        assert key in config

    loaded, loaded_config = load_draft(tmp_path / "draft")
    assert loaded_config == config
    for (name, a), (name_b, b) in zip(
        draft.state_dict().items(), loaded.state_dict().items(), strict=True
    ):
        assert name == name_b and a.dtype == b.dtype and torch.equal(a, b), name
    x, h = torch.randn(1, 5, H), torch.randn(1, 5, H)
    pos, mask = torch.arange(5)[None], ttt_attention_mask(5, 0)
    assert torch.equal(draft(x, h, pos, None, mask)[0], loaded.eval()(x, h, pos, None, mask)[0])


def test_training_state_round_trip(draft, tmp_path):
    opt = torch.optim.AdamW(draft.parameters(), lr=1e-3, betas=(0.9, 0.95))
    draft.compute_logits(draft.fuse(torch.randn(1, 4, 3 * H))).sum().backward()
    opt.step()
    vocab = DraftVocab.from_d2t(draft.d2t, V)
    save_training_state(tmp_path / "state", draft, opt, vocab, {"step": 1, "epoch": 0})

    torch.manual_seed(5)
    fresh = Eagle3Draft(tiny_config())
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    meta, loaded_vocab = load_training_state(tmp_path / "state", fresh, fresh_opt)
    assert meta["step"] == 1 and loaded_vocab.token_ids == vocab.token_ids
    for a, b in zip(draft.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    sa, sb = opt.state_dict(), fresh_opt.state_dict()
    assert sa["param_groups"][0]["lr"] == sb["param_groups"][0]["lr"] == 1e-3
    for idx, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][idx][key]), key
    assert not any(p.suffix in (".pt", ".bin", ".pkl") for p in (tmp_path / "state").iterdir())


def test_loss_mask_shift_at_reasoning_answer_boundary():
    """Step i at index t predicts x_{t+2+i}: it is trained iff loss_mask[t+2+i] (the predicted
    token is model output), its soft target is the target's distribution at t+1+i."""
    T, vd, first = 10, 6, 4  # x_0..x_3 prompt, x_4.. produced by the model; length 9
    loss_mask = torch.zeros(1, T, dtype=torch.bool)
    loss_mask[0, first:] = True
    lengths = torch.tensor([9])
    torch.manual_seed(3)
    target_probs = torch.randn(1, T, vd).softmax(-1)
    in_vocab = torch.ones(1, T, dtype=torch.bool)
    in_vocab[0, 6] = False  # the target's argmax at position 6 is outside the draft vocab
    step_logits = [torch.randn(1, T, vd, requires_grad=True) for _ in range(2)]

    loss, stats = ttt_loss(step_logits, target_probs, in_vocab, loss_mask, lengths, 0.8)
    loss.backward()
    trained = [(s.grad[0].abs().sum(-1) > 0).nonzero().flatten().tolist() for s in step_logits]
    # step 0: t=2 predicts x_4 (first model token) -> trained; t=1 predicts x_3 -> not.
    # t=5 is dropped (target at 6 outside vocab); t=7 would predict x_9, past the length.
    assert trained[0] == [2, 3, 4, 6]
    # step 1: t=1 predicts x_4 -> trained, t=0 not; t=4 dropped (target at 6); t=6 past length.
    assert trained[1] == [1, 2, 3, 5]
    assert stats.count == [4, 4]

    # gradient of the soft cross-entropy at step 0, t=2: (softmax(q) - p_target[3]) / count
    q = step_logits[0].detach()[0, 2].softmax(-1)
    torch.testing.assert_close(step_logits[0].grad[0, 2], (q - target_probs[0, 3]) / 4)
    torch.testing.assert_close(
        step_logits[1].grad[0, 1],
        0.8 * (step_logits[1].detach()[0, 1].softmax(-1) - target_probs[0, 3]) / 4,
    )


def test_tv_loss_is_one_minus_the_acceptance_of_a_sampled_draft_token():
    """train.loss=tv: per position 1/2 sum |p - q| = 1 - sum min(p, q), the chance a token
    sampled from the draft is rejected; zero when the draft matches the target; kl_tv adds the
    soft cross-entropy; an unknown name is refused."""
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    q = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.1, 0.8]])
    tv = position_loss(p, q.log(), "tv")
    accepted = torch.minimum(p, q).sum()  # 0.7 + 1.0
    torch.testing.assert_close(tv, 2 - accepted)
    assert position_loss(p[1:], q[1:].log(), "tv").item() == pytest.approx(0.0, abs=1e-7)
    kl = position_loss(p, q.log(), "kl")
    torch.testing.assert_close(kl, -(p * q.log()).sum())
    torch.testing.assert_close(position_loss(p, q.log(), "kl_tv"), kl + tv)
    with pytest.raises(ValueError, match="unknown loss 'js'"):
        position_loss(p, q.log(), "js")


def test_target_labels_restrict_to_draft_vocab():
    torch.manual_seed(4)
    final, lm_head = torch.randn(2, 3, H), torch.randn(V, H)
    vocab_ids = torch.tensor([1, 4, 9, 30])
    t2d = torch.isin(torch.arange(V), vocab_ids)
    probs = target_probs(final, lm_head[vocab_ids])
    in_vocab = target_in_vocab(final, lm_head, t2d, chunk=4)
    logits = final @ lm_head.T
    torch.testing.assert_close(probs, logits[..., vocab_ids].softmax(-1))
    assert torch.equal(in_vocab, t2d[logits.argmax(-1)])


def test_global_denominators_split_a_batch_without_changing_its_gradient():
    """Two halves of a batch, each normalized by the whole batch's counts, give the whole
    batch's loss and gradient: what micro-batches and data-parallel shares rely on."""
    torch.manual_seed(5)
    B, T, vd = 4, 9, 6
    loss_mask = torch.rand(B, T) > 0.3
    in_vocab = torch.rand(B, T) > 0.2
    lengths = torch.tensor([9, 7, 8, 5])
    probs = torch.randn(B, T, vd).softmax(-1)
    logits = [torch.randn(B, T, vd, requires_grad=True) for _ in range(3)]
    whole, stats = ttt_loss(logits, probs, in_vocab, loss_mask, lengths, 0.8)
    whole.backward()
    expected = [g.grad.clone() for g in logits]
    for g in logits:
        g.grad = None
    halves = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        part, _ = ttt_loss(
            [g[rows] for g in logits],
            probs[rows],
            in_vocab[rows],
            loss_mask[rows],
            lengths[rows],
            0.8,
            denominators=stats.count,
        )
        part.backward()
        halves += part.item()
    assert halves == pytest.approx(whole.item(), rel=1e-5)
    for g, e in zip(logits, expected, strict=True):
        torch.testing.assert_close(g.grad, e)


def test_length_buckets_keep_every_window_once_and_cut_the_padding():
    """train.length_buckets: each epoch still holds every window exactly once, in an order set
    by (seed, epoch) alone; a batch's rows have about the same length, so the padded batches
    hold far fewer padding tokens than random batches; and the batches are shuffled, not
    shortest first."""
    g = torch.Generator().manual_seed(6)
    lengths = torch.randint(20, 400, (1000,), generator=g).tolist()

    def padding(batches):
        padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
        return 1 - sum(lengths) / padded

    random_batches = epoch_batches(1000, 8, seed=0, epoch=1)
    bucketed = epoch_batches(1000, 8, seed=0, epoch=1, lengths=lengths)
    assert sorted(i for b in bucketed for i in b) == list(range(1000))
    assert len(bucketed) == len(random_batches) == 125
    assert bucketed == epoch_batches(1000, 8, seed=0, epoch=1, lengths=lengths)
    assert bucketed != epoch_batches(1000, 8, seed=0, epoch=2, lengths=lengths)
    assert padding(random_batches) > 0.3 and padding(bucketed) < 0.05
    longest = [max(lengths[i] for i in b) for b in bucketed]
    assert longest != sorted(longest)
