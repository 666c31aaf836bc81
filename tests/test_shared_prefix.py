"""SHARED_PREFIX: each group's prompt runs once and its KV cache serves the group's answers. It must
give the log-probs and gradients of the full rows: on the embedded model, with prompts of different
lengths, with gradient checkpointing on and off, and under DeepSpeed ZeRO-2 on 2 ranks at MU = 2."""
import os
import subprocess
import sys

import pytest
import torch

import grpo_ref_split as grpo
from conftest import ROOT, free_port
from features.fast_paths import completion_logits, completion_logps
from features.fast_paths import same_prompt_runs


@pytest.fixture(scope="module")
def smollm(embedded_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(embedded_path, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(embedded_path)


def two_groups(tokenizer, G=4, T=10):
    """Two groups as the trainer collates them: prompts of different lengths (left-padded), ragged
    completions (right-padded). Returns (input_ids, attention_mask, mask)."""
    questions = [
        "What is 3 + 5?",
        "Anna has 12 apples and gives away 4 of them. How many does she keep?",
    ]
    enc = grpo.encode_prompts(tokenizer, [{"question": q} for q in questions])
    assert enc.attention_mask[0].sum() < enc.attention_mask[1].sum()  # the first prompt is padded
    g = torch.Generator().manual_seed(0)
    completions = torch.randint(100, 20000, (2 * G, T), generator=g)  # (B, T)
    mask = torch.ones(2 * G, T, dtype=torch.long)
    # answers that ended early; the second group, all of them
    mask[1, 6:] = mask[G:, 8:] = mask[G + 2, 3:] = 0
    ids = torch.cat([enc.input_ids.repeat_interleave(G, 0), completions], 1)  # (B, P+T)
    attn = torch.cat([enc.attention_mask.repeat_interleave(G, 0), mask], 1)  # (B, P+T)
    return ids, attn, mask.bool()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prefix_gives_the_log_probs_and_gradients_of_full_rows(smollm, checkpointing):
    model, tokenizer = smollm
    ids, attn, mask = two_groups(tokenizer)
    T = mask.shape[1]
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask  # (B, T)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    results = []
    try:
        for shared in (False, True):
            model.zero_grad()
            logps = completion_logps(
                model,
                ids,
                attn,
                T,
                grpo.TEMPERATURE,
                shared_prefix=shared,
                chunk=grpo.fast_paths.LOGP_CHUNK,
                from_hidden=grpo.fast_paths.LOGP_FROM_HIDDEN,
            )  # (B, T)
            # a loss on the GRPO loss's scale: a token mean
            ((logps * weights).sum() / mask.sum()).backward()
            results.append(
                (logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
            )
        # left as found
        assert all(layer.gradient_checkpointing == checkpointing for layer in model.model.layers)
    finally:
        model.gradient_checkpointing_disable()
        model.zero_grad()
    (full, full_grads), (shared, shared_grads) = results
    assert (full[mask] - shared[mask]).abs().max() <= 1e-4
    assert full[mask].min() < -1.0  # real log-probs, not a degenerate case
    for name, g in full_grads.items():
        assert (g - shared_grads[name]).abs().max() <= 1e-4, name
    # the gradient is not trivially 0
    assert full_grads["model.embed_tokens.weight"].abs().max() > 1e-3


def test_generation_from_the_shared_prompt_cache_samples_the_same_answers(
    tiny_model_dir, monkeypatch
):

    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    model, tok = (
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        AutoTokenizer.from_pretrained(tiny_model_dir),
    )
    cfg = GenerationConfig(
        do_sample=True,
        temperature=grpo.TEMPERATURE,
        top_k=0,
        top_p=1.0,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id],
    )
    questions = [
        {"question": q, "gold": "1"}
        for q in ("What is 2 + 3?", "What is 11 + 12, counting carefully?")
    ]
    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    samples = {}
    for shared in (False, True):
        monkeypatch.setattr(grpo.fast_paths, "SHARED_PREFIX", shared)
        torch.manual_seed(5)
        samples[shared] = grpo.generate(model, tok, questions, rollout=grpo.choose_parts().rollout,
                                        gen_config=cfg, eos_ids=[tok.eos_token_id])
    assert torch.equal(samples[False].completion_ids, samples[True].completion_ids)
    assert len(set(samples[True].texts)) > 2  # sampled, not one greedy answer repeated


def test_rows_that_share_a_prompt_are_found_by_comparing_prompts():
    ids = torch.tensor([[0, 5, 6], [0, 5, 6], [4, 5, 6], [4, 5, 6], [0, 5, 6]])  # (B, P)
    attn = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1]])  # (B, P)
    # runs are consecutive rows
    assert same_prompt_runs(ids, attn) == [slice(0, 2), slice(2, 4), slice(4, 5)]
    padded_token = attn.clone()
    padded_token[1, 1] = 0
    assert same_prompt_runs(ids, padded_token) == [
        slice(0, 1),
        slice(1, 2),
        slice(2, 4),
        slice(4, 5),
    ]


def test_a_model_that_ignores_the_kv_cache_is_refused(smollm):
    model, tokenizer = smollm
    ids, attn, mask = two_groups(tokenizer, G=3, T=4)

    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, past_key_values=None, **kw):
            return self.inner(**kw)

    with (
        torch.no_grad(),
        pytest.raises(RuntimeError, match="ignored the prompt's KV cache.*SHARED_PREFIX = False"),
    ):
        completion_logits(NoCache(model), ids, attn, 4, shared_prefix=True)


@pytest.fixture(scope="module")
def zero2_steps(tiny_model_dir, tmp_path_factory):
    """zero2_steps(ranks, checkpointing): tests/zero2_gradient.py's results, {(SHARED_PREFIX,
    TRAIN_MICRO_BATCH): {"grads", "weights", "pi_old_logps", "mask", "parts", "loss"}}, one launch
    (~1
    min) per argument pair."""
    done = {}

    def run(ranks=2, checkpointing="0"):
        if (ranks, checkpointing) not in done:
            out = tmp_path_factory.mktemp("zero2") / "steps.pt"
            cmd = [
                os.path.join(os.path.dirname(sys.executable), "deepspeed"),
                "--num_gpus",
                str(ranks),
                "--master_port",
                str(free_port()),
                "tests/zero2_gradient.py",
                str(out),
            ]
            env = {
                **os.environ,
                "MODEL_PATH": str(tiny_model_dir),
                "MU": "2",
                "GRADIENT_CHECKPOINTING": checkpointing,
            }
            proc = subprocess.run(
                cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[ranks, checkpointing] = torch.load(out)
        return done[ranks, checkpointing]

    return run


def assert_same(want, got, what, tolerance=1e-5):
    """Each tensor of `got` within tolerance x the largest magnitude in `want`."""
    scale = max(t.abs().max() for t in want.values())
    assert scale > 0
    for name, t in want.items():
        assert (t - got[name]).abs().max() <= tolerance * scale, f"{what}: {name}"


@pytest.mark.slow
def test_shared_prefix_under_zero2_on_two_ranks_with_mu_two(zero2_steps):
    """MU = 2 makes prepare_batch take pi_old_logps with the same forward; the loss then uses
    them."""
    full = zero2_steps()[0, 0]
    for checkpointing in ("0", "1"):
        shared = zero2_steps(2, checkpointing)[1, 0]
        known = full["mask"].bool()  # (B, T) the answers' tokens, both ranks' rows
        assert torch.equal(known, shared["mask"].bool()) and known.sum() > 0.5 * known.numel()
        assert (full["pi_old_logps"][known] - shared["pi_old_logps"][known]).abs().max() <= 1e-4
        assert_same(full["grads"], shared["grads"], f"gradient checkpointing {checkpointing}")


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2])  # one rank's micro-batches: every part of these, no repeat
def test_micro_batches_give_the_gradient_and_step_of_one_batch(zero2_steps, ranks):
    """TRAIN_MICRO_BATCH = 1 and 2 groups against all at once, shared prompt on and off. Rank 0
    holds 3 groups and rank 1 holds 2: rank 1 runs a repeat with loss x 0 to keep ZeRO-2's
    reductions in step."""
    steps = zero2_steps(ranks)
    for shared in (0, 1):
        whole = steps[shared, 0]
        assert whole["parts"] == 1
        for micro in (1, 2):
            part = steps[shared, micro]
            assert part["parts"] == (3 if micro == 1 else 2)  # rank 0's count (rank 1 matched it)
            assert abs(part["loss"] - whole["loss"]) <= 1e-5 * abs(whole["loss"])
            # A quiet run puts the two within 3e-7 of the largest entry; one CI run under load moved
            # the whole batch's own gradient by 2.5e-5 of it (the same step, so fp32 reductions
            # split otherwise, not the micro-batches). A wrong share of a part would be off by a
            # third or more.
            assert_same(
                whole["grads"],
                part["grads"],
                f"shared {shared}, micro-batch {micro}: gradient",
                tolerance=1e-4,
            )
            assert_same(
                whole["weights"], part["weights"], f"shared {shared}, micro-batch {micro}: weights"
            )
        # the step changed the weights (the comparison means something)
        assert whole["moved"] > 1e-7


def test_the_layer_flags_it_switches_are_the_ones_transformers_reads(model):
    """features/fast_paths.layer_flags writes gradient_checkpointing and _can_checkpoint_with_cache
    into transformers' decoder layers for one block. If transformers stopped reading either name,
    the prompt's forward would silently checkpoint (dropping its cache): this fails loudly instead,
    and the writes are undone after the block."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from features import fast_paths

    # what this transformers reads
    assert set(fast_paths._flags_read()) == set(fast_paths.LAYER_FLAGS)
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert len(layers) == model.config.num_hidden_layers
    before = [dict(layer.__dict__) for layer in layers]
    with fast_paths.layer_flags(
        model, gradient_checkpointing=False, _can_checkpoint_with_cache=True
    ):
        assert all(layer.__dict__["_can_checkpoint_with_cache"] is True for layer in layers)
    assert [dict(layer.__dict__) for layer in layers] == before
    fast_paths._flags_read.cache_clear()
    real = fast_paths.LAYER_FLAGS
    try:
        fast_paths.LAYER_FLAGS = ("gradient_checkpointing", "_renamed_by_a_new_transformers")
        with pytest.raises(RuntimeError, match="does not read"):
            with fast_paths.layer_flags(model, _can_checkpoint_with_cache=True):
                pass
    finally:
        fast_paths.LAYER_FLAGS = real
        fast_paths._flags_read.cache_clear()
