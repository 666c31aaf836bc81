"""PADDING_FREE (features/packing.py): rows packed end to end give the padded rectangle's per-token
log-probs, entropies and gradients, on the lesson's definition (per_token_logps) and on the fast
paths, shared prefix on and off; the server packs the same way; what cannot pack is refused.

Every comparison runs in float64 on a tiny random Llama. Why 1e-9: the two paths compute each
kept token's value from the same inputs (same tokens, same positions, same keys seen), and differ
only in the order of the sums inside attention (a softmax over a masked row of another length)
and the matmuls (other shapes, other blocking). Each such sum has at most a few hundred terms of
size about 1, so its rounding error is a few hundred x 2^-53, about 1e-13; through two layers and
a log_softmax over the 49,152-token vocabulary it stays below 1e-11. A real difference (a token
seeing another row's, a position off by one) moves a log-prob by 1e-3 or more.
"""
import pytest
import torch

import grpo_ref_split as grpo
from conftest import set_setting, tiny_config
from features import fast_paths, packing
from features.fast_paths import completion_logps
from features.wire import completion_attention
from ref_server import RefServer

TOLERANCE = 1e-9  # float64: see the docstring
# The lesson's per_token_logps casts the logits to float32 (.float()) before its log_softmax: it
# agrees with a float64 path to float32's rounding, 2^-20 ~ 9.5e-7 at log-probs of size ~11 (the
# vocabulary's log 49,152), plus the log_softmax's sum over 49,152 float32 terms: a few ulps.
FLOAT32_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama(tokenizer):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config(tokenizer)).double().eval()


def ragged_batch(prompt_lengths=(7, 3), G=4, T=12, seed=0):
    """Groups as collate lays them out: prompts of different lengths left-padded to end at column
    P, answers right-padded to T, each row attending up to its last trained token. Row by row:
    a whole answer cut at T; a one-token answer; an answer with a tool result inside (untrained
    tokens between trained ones); an answer with nothing trained (cut, MASK_TRUNCATED), and
    ordinary lengths. Returns (input_ids (B, L), attention_mask (B, L), mask (B, T))."""
    g = torch.Generator().manual_seed(seed)
    P = max(prompt_lengths)
    B = G * len(prompt_lengths)
    ids = torch.zeros(B, P + T, dtype=torch.long)
    prompt_attention = torch.zeros(B, P, dtype=torch.long)
    lengths = [T, 1, 9, 0, 5, 12, 2, 7][:B]  # each answer's trained extent
    mask = torch.zeros(B, T, dtype=torch.bool)
    for row, length in enumerate(lengths):
        mask[row, :length] = True
    mask[2, 3:6] = False  # a tool result: inside the answer, attended, not trained
    for q, plen in enumerate(prompt_lengths):
        rows = slice(q * G, (q + 1) * G)
        prompt = torch.randint(100, 20000, (plen,), generator=g)
        ids[rows, P - plen : P] = prompt
        prompt_attention[rows, P - plen :] = 1
    ids[:, P:] = torch.randint(100, 20000, (B, T), generator=g)
    attention = torch.cat([prompt_attention, completion_attention(mask)], 1)  # (B, L)
    return ids, attention, mask


def logps_and_gradient(model, ids, attention, mask, **path):
    """(logps (B, T), entropies (B, T), {parameter: gradient}) of sum(w * logps) over the trained
    tokens, w fixed random weights: the loss's shape, any advantage."""
    model.zero_grad()
    logps, entropy = completion_logps(model, ids, attention, mask.shape[1], 0.7, chunk=5,
                                      with_entropy=True, **path)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1),
                          dtype=torch.float64)  # (B, T)
    (logps * weights * mask).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return logps.detach(), entropy, grads


def assert_packed_equals_padded(model, **path):
    """ragged_batch through `path` padded and packed: the same log-probs, entropies and gradients
    on every trained token; the packed values finite."""
    ids, attention, mask = ragged_batch()
    padded = logps_and_gradient(model, ids, attention, mask, **path)
    packed = logps_and_gradient(model, ids, attention, mask, padding_free=True, **path)
    assert_equal_on_trained(padded[0], packed[0], mask)
    assert_equal_on_trained(padded[1], packed[1], mask)
    assert_same_gradients(padded[2], packed[2])
    assert torch.isfinite(packed[0]).all() and torch.isfinite(packed[1]).all()


def assert_equal_on_trained(want, got, mask, tolerance=TOLERANCE):
    diff = (want - got).abs()[mask.bool()]
    assert diff.max() < tolerance, f"largest difference {diff.max():.3e}"


def assert_same_gradients(want, got, tolerance=TOLERANCE):
    for name in want:
        scale = want[name].abs().max().clamp(min=1.0)
        assert (want[name] - got[name]).abs().max() < tolerance * scale, name


@pytest.mark.parametrize("shared_prefix", [False, True])
@pytest.mark.parametrize("from_hidden", [False, True])
def test_packed_rows_give_the_padded_rectangles_values_and_gradients(llama, shared_prefix,
                                                                     from_hidden):
    assert_packed_equals_padded(llama, shared_prefix=shared_prefix, from_hidden=from_hidden)


def test_packed_path_equals_the_lessons_definition_in_value_and_gradient(llama, monkeypatch):
    """The trainer's logps_of with PADDING_FREE on (and every other fast path on) against the
    lesson's per_token_logps on the padded rectangle: what step 6 trains on."""
    monkeypatch.setattr(packing, "PADDING_FREE", True)
    monkeypatch.setattr(grpo, "TEMPERATURE", 0.7)
    ids, attention, mask = ragged_batch(prompt_lengths=(5, 9, 2), G=2, T=8, seed=3)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2),
                          dtype=torch.float64)  # (B, T)
    out = {}
    for name, logps_of in (("definition", grpo.per_token_logps), ("packed", grpo.logps_for_run())):
        llama.zero_grad()
        logps, entropy = logps_of(llama, ids, attention, mask.shape[1], True)  # (B, T) each
        (logps * weights * mask).sum().backward()
        out[name] = (logps.detach(), entropy,
                     {n: p.grad.clone() for n, p in llama.named_parameters()})
    assert grpo.logps_for_run() is not grpo.per_token_logps  # the fast path is what ran
    assert_equal_on_trained(out["definition"][0], out["packed"][0], mask, FLOAT32_TOLERANCE)
    assert_equal_on_trained(out["definition"][1], out["packed"][1], mask, FLOAT32_TOLERANCE)
    assert_same_gradients(out["definition"][2], out["packed"][2], FLOAT32_TOLERANCE)


def test_a_small_bound_packs_several_rows_and_changes_nothing(llama, monkeypatch):
    """PACK_TOKENS below the longest row: a row longer than the bound runs alone, the others two
    or three to a packed row; the values are the same."""
    ids, attention, mask = ragged_batch()
    lengths = [end - start for start, end in packing.row_spans(attention, mask.shape[1])]
    bins = packing.first_fit(lengths, 12)
    assert max(lengths) > 12 and any(len(members) > 1 for members in bins)
    padded, _, _ = logps_and_gradient(llama, ids, attention, mask, from_hidden=True)
    monkeypatch.setattr(packing, "PACK_TOKENS", 12)
    packed, _, _ = logps_and_gradient(llama, ids, attention, mask, from_hidden=True,
                                      padding_free=True)
    assert_equal_on_trained(padded, packed, mask)


def test_first_fit_puts_the_longest_first_each_into_the_first_bin_with_room():
    assert packing.first_fit([3, 4, 5, 9, 1, 1], 9) == [[3], [2, 1], [0, 4, 5]]
    assert packing.first_fit([12, 2], 5) == [[0], [1]]  # longer than the bound: alone
    assert packing.first_fit([], 8) == []


def test_a_token_never_sees_another_rows_tokens(llama):
    """Changing every token of one row leaves every other row's packed log-probs unchanged."""
    ids, attention, mask = ragged_batch()
    with torch.no_grad():
        before = completion_logps(llama, ids, attention, mask.shape[1], 1.0, chunk=0,
                                  from_hidden=False, padding_free=True)
        changed = ids.clone()
        changed[2] = (changed[2] + 7) % 20000
        after = completion_logps(llama, changed, attention, mask.shape[1], 1.0, chunk=0,
                                 from_hidden=False, padding_free=True)
    others = torch.arange(len(ids)) != 2
    assert torch.equal(before[others] * mask[others], after[others] * mask[others])
    assert not torch.equal(before[2] * mask[2], after[2] * mask[2])


def test_rows_that_cannot_pack_are_refused_with_the_reason(llama):
    ids, attention, mask = ragged_batch()
    holed = attention.clone()
    holed[0, -5] = 0  # a hole inside a row's answer
    with pytest.raises(ValueError, match="hole"):
        packing.row_spans(holed, mask.shape[1])
    no_prompt = attention.clone()
    no_prompt[1, : -mask.shape[1]] = 0
    with pytest.raises(ValueError, match="no prompt token"):
        packing.row_spans(no_prompt, mask.shape[1])


def test_padding_free_with_a_vision_model_is_refused_at_start(monkeypatch):
    monkeypatch.setattr(packing, "PADDING_FREE", True)
    with pytest.raises(SystemExit, match="PADDING_FREE.*vision"):
        packing.check_settings(images=True)
    packing.check_settings(images=False)  # text packs
    with pytest.raises(ValueError, match="padding_free take text"):
        fast_paths.completion_logits(None, torch.ones(1, 3, dtype=torch.long),
                                     torch.ones(1, 3), 1, padding_free=True,
                                     vision_inputs={"pixel_values": torch.zeros(1)})


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_the_server_packs_its_reference_forward_to_the_same_values(llama, shared_prefix):
    """ref_server.py with PADDING_FREE: one uploaded group (its prompt unpadded, its answers
    right-padded), each row attending up to its last trained token, the same reference log-probs
    as the padded forward; the teacher's top-k too."""
    ids, attention, mask = ragged_batch(prompt_lengths=(6,), G=4, T=12)
    plen = 6
    group = ids[:, -(plen + 12):]  # (G, plen + T) the group as uploaded
    want = RefServer(llama, "t", shared_prefix=shared_prefix, logp_chunk=5,
                     padding_free=False).reference_logps(group, plen, 0.7, (), mask)
    server = RefServer(llama, "t", shared_prefix=shared_prefix, logp_chunk=5, padding_free=True)
    got = server.reference_logps(group, plen, 0.7, (), mask)
    assert_equal_on_trained(want, got, mask)
    top = RefServer(llama, "t", shared_prefix=shared_prefix,
                    padding_free=False).teacher_topk(group, plen, 0.7, 3, (), mask)
    packed_top = server.teacher_topk(group, plen, 0.7, 3, (), mask)
    rows = mask.bool()
    assert torch.equal(top[0][rows], packed_top[0][rows])
    assert (top[1] - packed_top[1]).abs()[rows].max() < TOLERANCE


def test_collate_attends_each_answer_up_to_its_last_trained_token():
    """The layout packing reads: a row's attention ends with its last trained token (a tool
    result before it included); the padded forward's values on trained tokens do not change,
    since no earlier position attends a later one."""
    mask = torch.tensor([[True, False, True, False], [False, False, False, False]])
    assert completion_attention(mask).tolist() == [[1, 1, 1, 0], [0, 0, 0, 0]]
    tensors = dict(input_ids=torch.arange(2 * 6).view(2, 6) + 5, completion_mask=mask,
                   advantages=torch.zeros(2), scores=torch.zeros(2))
    batch = grpo.collate([(tensors, {"plen": 2})], pad_id=0)
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 0]]


def test_the_trainer_packs_when_asked(llama, monkeypatch):
    """With PADDING_FREE the model sees packed rows: fewer rows than the batch, none longer than
    its longest row, holding every marked token of the rows with a token to train (the row with
    none runs nothing)."""
    seen = []
    hook = llama.model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0]))
    try:
        ids, attention, mask = ragged_batch()
        set_setting(monkeypatch, "TEMPERATURE", 0.7)
        monkeypatch.setattr(packing, "PADDING_FREE", True)
        monkeypatch.setattr(fast_paths, "SHARED_PREFIX", False)
        with torch.no_grad():
            grpo.logps_for_run()(llama, ids, attention, mask.shape[1])
    finally:
        hook.remove()
    (packed,) = seen
    longest = int(attention.sum(1).max())
    assert packed.shape[0] < ids.shape[0] and packed.shape[1] == longest
    real = int(attention[mask.any(1)].sum())
    assert packed.numel() < ids.numel() and packed.numel() - real < longest  # slack < one row


def test_the_memory_plan_counts_packed_rows_longer_than_a_padded_row():
    """The plan's worst case (every answer MAX_NEW_TOKENS long) has no padding to leave out, and
    packed rows no longer than a padded row (PACK_TOKENS 0) cost what the rectangle does; rows
    packed longer add their block-causal masks, a byte a (query, key) pair."""
    from features import memory_plan

    shape = memory_plan.ModelShape(params=135_000_000, trainable=135_000_000, layers=30,
                                   hidden=576, kv_width=192, vocab=49152, saved_per_token=1e4,
                                   saved_per_token_fp32=2e4)
    padded = memory_plan.Setting(q_batch_size=2, num_pre_q=4, prompt_tokens=100,
                                 max_new_tokens=200)
    tokens = memory_plan.step_tokens(padded)
    without = memory_plan.plan(shape, padded, 80 * 2**30)[2]
    for pack_tokens, masks in ((0, 0), (300, 0), (1024, -(-tokens // 1024) * 1024**2)):
        packed = memory_plan.Setting(**{**padded.__dict__, "padding_free": True,
                                        "pack_tokens": pack_tokens})
        with_packing = memory_plan.plan(shape, packed, 80 * 2**30)[2]
        assert with_packing.trainer - without.trainer == masks
    assert "packed" in with_packing.what


def test_the_shared_prompts_packed_answers_refuse_a_flash_attention_model(llama, monkeypatch):
    """flash-attention would drop the 4-D mask and let each answer see the others: refused."""
    ids, attention, mask = ragged_batch(prompt_lengths=(6,))
    monkeypatch.setattr(llama.config, "_attn_implementation", "flash_attention_2")
    with pytest.raises(ValueError, match="flash-attention takes no 4-D mask"):
        packing.group_states(llama, ids, attention, mask.shape[1])


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_packed_rows_under_gradient_checkpointing_give_the_same_gradients(tokenizer,
                                                                          shared_prefix):
    """GRADIENT_CHECKPOINTING recomputes each layer in backward: the packed rows (and the shared
    prompt's cache they read) recompute to the same values as the padded rectangle's."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tokenizer)).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_packed_equals_padded(model, shared_prefix=shared_prefix, from_hidden=True)


def test_flash_attention_loads_only_where_packed_rows_need_no_mask(monkeypatch, tmp_path):
    """packing.attention_implementation: flash-attention 2 only with PADDING_FREE on, the shared
    prompt's 4-D mask off, a CUDA device and flash_attn installed; else None (the default, sdpa).
    The trainer's and the server's loads pass it to from_pretrained."""
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())  # "installed"
    choose = packing.attention_implementation
    assert choose("cuda", padding_free=True, shared_prefix=False) == "flash_attention_2"
    assert choose("cuda:0", padding_free=True, shared_prefix=False) == "flash_attention_2"
    assert choose("cuda", padding_free=True, shared_prefix=True) is None  # its 4-D mask
    assert choose("cuda", padding_free=False, shared_prefix=False) is None  # rectangles
    assert choose("cpu", padding_free=True, shared_prefix=False) is None  # no kernel on CPU
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # not installed
    assert choose("cuda", padding_free=True, shared_prefix=False) is None
    # what the loads hand transformers: the trainer's (policy) and the server's (vision.load_any)
    import transformers
    from transformers import LlamaConfig

    from features import policy, vision
    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path)  # a text model's config
    asked = []
    class Asked(Exception):
        pass
    def from_pretrained(path, **kwargs):  # what a load would hand transformers, then no load
        asked.append(kwargs.get("attn_implementation"))
        raise Asked
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    with pytest.raises(Asked):
        policy.load_for_sampling(str(tmp_path), "cpu", base_path=str(tmp_path), temperature=1.0,
                                 max_new_tokens=4, attn_implementation="flash_attention_2")
    with pytest.raises(Asked):
        vision.load_any(str(tmp_path), "cpu", attn_implementation="flash_attention_2")
    assert asked == ["flash_attention_2", "flash_attention_2"]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(packing, "PADDING_FREE", True)
    monkeypatch.setattr(fast_paths, "SHARED_PREFIX", False)
    monkeypatch.setattr(grpo.policy, "load_for_sampling", lambda *a, **kwargs: kwargs)
    assert grpo.load_policy(str(tmp_path), "cuda")["attn_implementation"] == "flash_attention_2"
    monkeypatch.setattr(fast_paths, "SHARED_PREFIX", True)  # the default: sdpa
    assert grpo.load_policy(str(tmp_path), "cuda")["attn_implementation"] is None
