"""Issue 30's objectives and sampling rules, each against a hand computation: Dr. GRPO's loss, the
reward scalings, the mismatch modes, the entropy from the chunked pass, pass@k, the difficulty-aware
sampler and the rollout bound.

    bash scripts/test.sh -k objectives
"""
import itertools
import math
import random
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_ref_split as grpo
import objectives
from conftest import (
    ROOT,
    ServerProcess,
    free_port,
    kill_group,
    metrics,
    train,
    trainer_env,
    wait_for,
)
from features import env_overrides, fast_paths, question_sampler
from features.evaluation import pass_at_k, sampled_scores
from features.question_sampler import QuestionSampler, out_of_rollouts
from features.regroup import RegroupPool
from objectives import mismatch_weights
from reference_loss import torch_loss


# ----------------------------------------------------------------------------- Dr. GRPO
def lengths_batch():
    """Three answers of 4, 2 and 1 tokens (T = 4), on-policy (ratio 1), beta 0: each token's loss is
    -A."""
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)  # (3, 4)
    logps = (-torch.rand(3, 4, generator=torch.Generator().manual_seed(0))).requires_grad_()
    return logps, mask, torch.tensor([1.0, -2.0, 0.5])


def test_dr_grpo_sums_tokens_over_a_constant_and_differs_from_grpo_by_each_answers_length():
    logps, mask, adv = lengths_batch()
    kw = dict(ref_logps=None, pi_old_logps=None, advantages=adv, mask=mask, beta=0.0, clip_eps=0.2)
    dr = torch_loss(logps=logps, loss_type="dr_grpo", max_tokens=8, **kw)
    (g_dr,) = torch.autograd.grad(dr, logps)
    # token sum / (G x MAX_NEW_TOKENS)
    assert dr.item() == pytest.approx(-(4 * 1.0 + 2 * -2.0 + 1 * 0.5) / (3 * 8))
    # every token 1 / (G L), whatever its answer's length
    want = torch.where(mask, -adv[:, None] / (3 * 8), 0.0)
    assert torch.allclose(g_dr, want)
    gr = torch_loss(logps=logps, loss_type="grpo", **kw)
    (g_grpo,) = torch.autograd.grad(gr, logps)
    # GRPO: each answer's token mean, then the mean
    assert gr.item() == pytest.approx(-(1.0 - 2.0 + 0.5) / 3)
    # The paper's point (arXiv 2503.20783, sec. 3.1): GRPO's token weight 1 / (G |o_i|) favours
    # short answers; Dr. GRPO's is 1 / (G L). Per token the gradients differ by exactly |o_i| / L.
    length = mask.sum(1, keepdim=True).float()  # (3, 1)
    assert torch.allclose(torch.where(mask, g_grpo * length / 8, 0.0), g_dr)
    dapo = torch_loss(logps=logps, loss_type="dapo", **kw)
    assert dapo.item() == pytest.approx(-(4 * 1.0 + 2 * -2.0 + 0.5) / 7)  # and DAPO: / the 7 tokens


def test_dr_grpo_normalizer_counts_answers_of_every_rank():
    logps, mask, adv = lengths_batch()
    kw = dict(
        ref_logps=None,
        pi_old_logps=None,
        advantages=adv,
        mask=mask,
        beta=0.0,
        clip_eps=0.2,
        max_tokens=8,
    )
    alone = torch_loss(logps=logps, loss_type="dr_grpo", **kw)
    # 6 answers over the ranks / world
    shared = torch_loss(logps=logps, loss_type="dr_grpo", normalizer=6.0, **kw)
    assert shared.item() == pytest.approx(alone.item() * 3 / 6)


def test_the_loss_refuses_unknown_types_and_modes():
    logps, mask, adv = lengths_batch()
    kw = dict(ref_logps=None, pi_old_logps=None, advantages=adv, mask=mask, beta=0.0, clip_eps=0.2)
    for bad in (
        dict(loss_type="dr-grpo"),
        dict(tis_mode="sequence"),
        dict(loss_type="dr_grpo", max_tokens=0),
    ):
        with pytest.raises(ValueError, match="loss_type"):
            torch_loss(logps=logps, **kw, **bad)


# ----------------------------------------------------------------------------- reward scaling
def test_each_reward_scaling_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 3.0, 1.0, 1.0, 1.0])  # two groups of 4
    centred = [0.75, -0.25, -0.25, -0.25, 1.5, -0.5, -0.5, -0.5]  # r - its group's mean (0.25, 1.5)
    g1, g2 = math.sqrt(0.25), math.sqrt(1.0)  # unbiased stds of (1, 0, 0, 0) and (3, 1, 1, 1)
    batch = math.sqrt(sum((x - 0.875) ** 2 for x in r.tolist()) / 7)  # unbiased std of all 8
    eps = 1e-4
    assert torch.allclose(objectives.centred_in_groups(r, 4), torch.tensor(centred))
    assert torch.allclose(
        grpo.advantages_in_groups(r, 4),
        torch.tensor([c / ((g1 if i < 4 else g2) + eps) for i, c in enumerate(centred)]),
    )
    halves = [({"scores": r[:4]}, {}), ({"scores": r[4:]}, {})]
    scaled = objectives.scale_to_step(halves, torch.zeros(0), "cpu", std_eps=eps)
    for (tensors, _), want in zip(scaled, (centred[:4], centred[4:])):  # each, the step's std
        assert torch.allclose(tensors["advantages"], torch.tensor([c / (batch + eps)
                                                                   for c in want]))


def test_a_regrouped_group_gets_the_trainers_own_reward_scaling(monkeypatch):
    """A regrouped group comes back with its rewards alone; the trainer gives it step 4 as it gives
    its own groups (server_client.with_advantages): no std division for Dr. GRPO's "none"; for
    "batch" only centred, since the trainer divides by its step's std later; GRPO's group std."""
    from features.server_client import with_advantages

    def regrouped():
        pool = RegroupPool(pool_size=8, questions=4)
        ids = torch.randint(0, 50, (4, 7), generator=torch.Generator().manual_seed(1))
        ids[:, :3] = ids[0, :3]
        first = dict(
            input_ids=ids,
            completion_mask=torch.ones(4, 4, dtype=torch.bool),
            scores=torch.zeros(4),
            advantages=torch.zeros(4),
        )
        assert pool.add(first, {"plen": 3}) is None  # equal rewards: held back
        second = dict(first, scores=torch.tensor([2.0, 2.0, 2.0, 2.0]))
        return pool.add(second, {"plen": 3})

    monkeypatch.setattr(grpo, "NUM_PRE_Q", 4)
    for setting, scale in (("none", 1.0), ("batch", 1.0), ("group", None)):
        monkeypatch.setattr(grpo, "SCALE_REWARDS", setting)
        group = regrouped()
        assert "advantages" not in group[0]
        [(out, _)] = with_advantages(lambda *_: [group], grpo.choose_parts().advantages)([], 0, 0)
        want = out["scores"] - out["scores"].mean()  # (4,)
        scale = out["scores"].std().item() + 1e-4 if scale is None else scale
        assert torch.allclose(out["advantages"], want / scale)


# ----------------------------------------------------------------------------- mismatch modes
def test_each_mismatch_mode_weighs_tokens_and_answers_by_hand():
    """rho = pi_old / pi_vllm per token. Answer 0 has a token below 1/2 and answer 1 one above 2
    (the band for cap 2); answers 2 and 3 have every token inside it, but their products lie above
    and below it; row 4 was not sampled by vLLM (weight 1, whatever its values)."""
    log_rho = torch.tensor(
        [[0.1, -0.9, 0.3], [0.2, 1.0, -0.1], [0.5, 0.4, 0.3], [-0.3, -0.3, -0.3], [5.0, 5.0, 5.0]]
    )  # (5, 3)
    old = torch.zeros(5, 3)
    sampler = old - log_rho
    mask = torch.ones(5, 3, dtype=torch.bool)
    mask[4, 2] = False
    rows = torch.tensor([True, True, True, True, False])
    rho = log_rho.exp()
    w = lambda mode: mismatch_weights(old, sampler, rows, mask, mode=mode, cap=2.0)  # noqa: E731
    ones = torch.ones(3)
    assert torch.allclose(w("token_truncate")[:4], rho[:4].clamp(max=2.0)) and torch.equal(
        w("token_truncate")[4], ones
    )
    tm = w("token_mask")
    # e^-0.9 = 0.41 < 1/2 and e^1 = 2.72 > 2: those tokens only
    assert tm[0, 1] == 0 and tm[1, 1] == 0
    keep = torch.ones(5, 3, dtype=torch.bool)
    keep[0, 1] = keep[1, 1] = False
    assert torch.allclose(tm[:4][keep[:4]], rho[:4][keep[:4]]) and torch.equal(tm[4], ones)
    # e^-0.5, e^1.1, e^1.2, e^-0.9: the answers' ratios
    seq = [math.exp(sum(r)) for r in log_rho.tolist()[:4]]
    assert torch.allclose(
        w("sequence_truncate")[:4], torch.tensor(seq)[:, None].clamp(max=2.0).expand(4, 3)
    )
    sm = w("sequence_mask")
    # 3.0, 3.3 and 0.41: out whole
    assert torch.allclose(sm[0], torch.full((3,), seq[0])) and (sm[1:4] == 0).all()
    assert torch.equal(sm[4], ones)


def test_a_masked_answer_leaves_the_loss_and_its_gradient():
    # answer 1's token 0: rho 4.5, outside [0.5, 2]
    log_rho = torch.tensor([[0.1, 0.2], [1.5, 0.0]])
    logps = torch.full((2, 2), -1.0, requires_grad=True)
    kw = dict(
        ref_logps=None,
        pi_old_logps=None,
        advantages=torch.tensor([1.0, -1.0]),
        mask=torch.ones(2, 2).bool(),
        beta=0.0,
        clip_eps=0.2,
        vllm_logps=logps.detach() - log_rho,
        tis_cap=2.0,
    )
    loss = torch_loss(logps=logps, tis_mode="sequence_mask", **kw)
    (g,) = torch.autograd.grad(loss, logps)
    assert (g[1] == 0).all() and (g[0] != 0).all()  # the whole answer 1 is out
    seq = math.exp(0.3)
    # answer 0's mean, over 2 answers
    assert loss.item() == pytest.approx(-(seq * 1.0 + seq * 1.0) / 2 / 2)


# ----------------------------------------------------------------------------- entropy
class Sizes(TorchDispatchMode):
    """The element count of every tensor any op makes."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_entropy_from_the_chunked_pass_equals_the_full_logits_and_never_makes_them(temperature):
    B, T, V, H = 4, 8, 500, 16
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    # (B, T, V) the direct computation
    full = torch.log_softmax(hidden @ weight.T / temperature, -1)
    want = -(full.exp() * full).sum(-1)  # (B, T)
    with Sizes() as sizes:
        logps, entropy = fast_paths.hidden_logps(
            hidden, weight, ids, temperature, chunk=4, with_entropy=True
        )
    assert torch.allclose(entropy, want, atol=1e-5) and torch.allclose(
        logps, full.gather(-1, ids[..., None])[..., 0]
    )
    assert sizes.largest < B * T * V  # chunks of (4, V) and the (V, H) weight: never (B, T, V)
    assert sizes.largest <= max(4 * V, V * H)
    logits = hidden @ weight.T
    # the logits path
    chunked = fast_paths.chunked_logps(logits, ids, temperature, chunk=3, with_entropy=True)[1]
    plain = fast_paths.chunked_logps(logits, ids, temperature, chunk=0, with_entropy=True)[1]
    assert torch.allclose(chunked, want, atol=1e-5) and torch.allclose(plain, want, atol=1e-5)


def test_entropy_is_log_v_for_a_uniform_policy_and_zero_for_a_certain_one():
    ids = torch.zeros(1, 2, dtype=torch.long)
    logits = torch.stack([torch.zeros(10), torch.tensor([100.0] + [0.0] * 9)])[None]  # (1, 2, 10)
    entropy = fast_paths.chunked_logps(logits, ids, 1.0, chunk=1, with_entropy=True)[1]
    assert entropy[0, 0].item() == pytest.approx(math.log(10)) and entropy[
        0, 1
    ].item() == pytest.approx(0, abs=1e-6)


# ----------------------------------------------------------------------------- pass@k
def pass_at_k_by_enumeration(n, c, k):
    """The share of all k-subsets of n samples (c right) that hold a right one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize(
    "n, c, k", [(4, 0, 2), (4, 1, 2), (4, 2, 2), (4, 1, 4), (5, 2, 3), (8, 3, 1), (6, 6, 4)]
)
def test_pass_at_k_is_the_unbiased_estimator(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(pass_at_k_by_enumeration(n, c, k))
    assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_refuses_impossible_counts():
    for n, c, k in ((4, 5, 2), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_sampled_scores_give_mean_at_k_and_pass_at_k_per_question(monkeypatch):
    from transformers import GenerationConfig

    questions = [{"question": "q0", "gold": "1"}, {"question": "q1", "gold": "2"}]
    right = [1, 0, 0, 0, 1, 1, 1, 0]  # question 0: 1 of 4 right, question 1: 3 of 4
    monkeypatch.setattr(
        "features.evaluation.held_out_answers", lambda *a, **k: ([str(x) for x in right], [0] * 8)
    )
    def score(texts, asked, played=None):
        return None, {"reward_correct": [float(t) for t in texts]}
    out = sampled_scores(
        None, questions, 4, GenerationConfig(do_sample=True, temperature=0.7), score, {},
        correct="reward_correct"
    )
    assert out["reward_correct_mean@4"] == [0.25, 0.75]
    assert out["pass@2"] == [pytest.approx(0.5), pytest.approx(1.0)] and out["pass@4"] == [1.0, 1.0]
    assert "pass@1" not in out  # it would equal the mean@4
    with pytest.raises(ValueError, match="EVAL_SAMPLES"):
        sampled_scores(None, questions, 4, GenerationConfig(do_sample=False), score, {})


# ----------------------------------------------------------------------------- the question sampler
QUESTIONS = [{"question": f"q{i}", "gold": str(i)} for i in range(50)]


def records(outcomes, group_size=4):
    """Answer records of one rollout: {question text: varied?} -> G answers each, rewards equal or
    not."""
    return [
        {"question": q, "reward": float(varied and i == 0)}
        for q, varied in outcomes.items()
        for i in range(group_size)
    ]


def test_the_uniform_sampler_draws_exactly_what_random_sample_drew():
    sampler, rng = QuestionSampler(QUESTIONS, 7), random.Random(7)
    for n in (4, 4, 2, 4):
        assert sampler.draw(n) == rng.sample(QUESTIONS, n)
        sampler.record(records({"q1": True}), 4)  # records nothing in uniform mode
    assert sampler.pool == {} and sampler.uniform == set()


def test_the_difficulty_sampler_replays_varied_questions_and_sets_uniform_ones_aside():
    sampler = QuestionSampler(QUESTIONS, 0, "difficulty")
    first = [q["question"] for q in sampler.draw(4)]
    assert len(set(first)) == 4
    sampler.record(records({first[0]: True, first[1]: False, first[2]: True, first[3]: True}), 4)
    assert list(sampler.pool) == [first[0], first[2], first[3]] and sampler.uniform == {first[1]}
    second = [q["question"] for q in sampler.draw(4)]
    assert second[:3] == [first[0], first[2], first[3]]  # ceil(4 x 0.75) = 3 replays, oldest first
    assert second[3] not in first and len(set(second)) == 4  # a new question
    sampler.record(
        records({second[0]: True, second[1]: False, second[2]: True, second[3]: True}), 4
    )
    # re-inserted in turn; first[2] now uniform: out
    assert list(sampler.pool) == [second[0], second[2], second[3]]
    third = [q["question"] for q in sampler.draw(4)]
    sampler.record(records({q: True for q in third}), 4)
    # varied three times in a row: replayed MAX_REPLAYS = 2 times, then out
    assert first[0] not in sampler.pool
    assert question_sampler.MAX_REPLAYS == 2


def test_the_samplers_know_questions_of_one_text_apart_by_their_images():
    """Issue 58: the samplers keyed on the question's text, so four pictures asked "Which colour
    is larger?" were one entry, and a replay of one could be another picture. A question's id is
    its text and its images' digest; an answer record carries it (run_log.completion_records)."""
    pictures = [f"picture {i}".encode() for i in range(4)]
    same_text = [{"question": "Find x.", "gold": str(i), "images": [data]}
                 for i, data in enumerate(pictures)]
    ids = [question_sampler.id_of(q) for q in same_text]
    assert len(set(ids)) == 4 and question_sampler.id_of({"question": "q1"}) == "q1"
    sampler = QuestionSampler(same_text, 0, "difficulty")
    drawn = sampler.draw(4)
    varied = question_sampler.id_of(drawn[2])  # only the third picture's group had variance
    answers = [{"question": "Find x.", "question_id": question_sampler.id_of(q),
                "reward": float(q is drawn[2] and i == 0),
                "reward_correct": float(q is drawn[2] and i == 0)}
               for q in drawn for i in range(4)]
    sampler.record(answers, 4)
    assert list(sampler.pool) == [varied] and len(sampler.uniform) == 3
    assert sampler.draw(1) == [drawn[2]]  # the replay is that picture, not another
    learnable = QuestionSampler(same_text, 0, "learnability", pass_key="reward_correct")
    learnable.record(answers, 4)
    assert learnable.pass_rates == {question_sampler.id_of(q): 0.25 if q is drawn[2] else 0.0
                                    for q in drawn}


def test_the_difficulty_sampler_draws_uniform_questions_less_often():
    sampler = QuestionSampler(QUESTIONS[:10], 3, "difficulty")
    sampler.record(records({f"q{i}": False for i in range(5)}), 4)  # q0..q4 uniform, q5..q9 unseen
    drawn = [q["question"] for _ in range(400) for q in sampler.draw(1)]
    uniform_share = sum(t in {f"q{i}" for i in range(5)} for t in drawn) / len(drawn)
    keep = question_sampler.UNIFORM_KEEP
    # weights 0.1 against 1
    assert uniform_share == pytest.approx(5 * keep / (5 * keep + 5), abs=0.05)


def test_the_sampler_state_round_trips_and_reads_an_older_checkpoints_rng_state():
    sampler = QuestionSampler(QUESTIONS, 1, "difficulty")
    sampler.record(records({"q3": True, "q4": False}), 4)
    state = sampler.getstate()
    after = [sampler.draw(4) for _ in range(3)]
    again = QuestionSampler(QUESTIONS, 99, "difficulty")
    again.setstate(state)
    assert [again.draw(4) for _ in range(3)] == after and again.uniform == {"q4"}
    old = QuestionSampler(QUESTIONS, 5)
    # a checkpoint saved before the sampler: the rng state alone
    old.setstate(random.Random(11).getstate())
    assert old.draw(3) == random.Random(11).sample(QUESTIONS, 3)
    with pytest.raises(ValueError, match="SAMPLER"):
        QuestionSampler(QUESTIONS, 0, "hard")
    with pytest.raises(ValueError, match="cannot draw 51"):
        QuestionSampler(QUESTIONS, 0, "difficulty").draw(51)


def test_a_small_dataset_mostly_in_the_pool_still_gives_distinct_questions():
    sampler = QuestionSampler(QUESTIONS[:5], 2, "difficulty")
    sampler.record(records({f"q{i}": True for i in range(4)}), 4)  # 4 of 5 pooled
    drawn = [q["question"] for q in sampler.draw(5)]
    assert sorted(drawn) == [f"q{i}" for i in range(5)]


def test_running_out_of_rollouts_stops_with_none_and_warns_with_some(capsys):
    with pytest.raises(
        SystemExit, match="20 rollouts in a row gave no group with different rewards"
    ):
        out_of_rollouts(0, 20, 4)
    out_of_rollouts(3, 20, 4)  # DYNAMIC_SAMPLING: trains on the 3
    assert "warning: 20 rollouts in a row gave only 3 of the 4 groups" in capsys.readouterr().out


def test_a_constant_outside_its_choices_stops_the_run_before_any_model_loads(monkeypatch, tmp_path):
    monkeypatch.setattr(grpo, "OUTPUT_DIR", str(tmp_path))
    for module, name, bad in (
        (grpo, "LOSS_TYPE", "drgrpo"),
        (grpo, "SCALE_REWARDS", "std"),
        (objectives, "TIS_MODE", "mask"),
        (grpo.question_sampler, "SAMPLER", "easy"),
    ):
        with monkeypatch.context() as m:
            m.setattr(module, name, bad)
            with pytest.raises(SystemExit, match=f"{name} = '{bad}': one of"):
                grpo.check_settings()
    monkeypatch.setattr(grpo.fast_paths, "USE_TRITON", True)
    monkeypatch.setattr(objectives, "TIS_MODE", "sequence_mask")
    with pytest.raises(SystemExit, match="USE_TRITON has no per-completion ratio"):
        grpo.check_settings()
    with pytest.raises(SystemExit, match="X = 3: one of 1, 2"):
        env_overrides.check_choice("X", 3, (1, 2))


def test_the_sampler_state_survives_a_checkpoints_weights_only_load(tmp_path):
    sampler = QuestionSampler(QUESTIONS, 1, "difficulty")
    sampler.record(records({"q3": True, "q4": False}), 4)
    # as checkpoints.save_checkpoint does
    torch.save({"python": sampler.getstate()}, tmp_path / "rng.pt")
    again = QuestionSampler(QUESTIONS, 2, "difficulty")
    again.setstate(torch.load(tmp_path / "rng.pt", weights_only=True)["python"])
    assert (
        again.pool == sampler.pool
        and again.uniform == sampler.uniform
        and again.draw(4) == sampler.draw(4)
    )


# ----------------------------------------------------------------------------- whole runs
def completions(out):
    import json

    return [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]


def varied_groups(answers, group_size):
    """{(step, rank): [varied?] of each group that rank sampled at that step}."""
    out = {}
    for i in range(0, len(answers), group_size):
        g = answers[i : i + group_size]
        out.setdefault((g[0]["step"], g[0]["rank"]), []).append(len({a["reward"] for a in g}) > 1)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2])  # two ranks check all one would, and the mean over ranks
def test_dynamic_sampling_trains_every_rank_on_a_full_batch_of_varied_groups(
    server, tiny_model_dir, tmp_path, ranks
):
    """DYNAMIC_SAMPLING: each rank rolls out new questions until it holds Q_BATCH_SIZE (2) groups
    with different rewards; groups with equal rewards are generated, logged and never trained.
    SAMPLER=difficulty rides along (its records go into the checkpoints). The loss's normalisation
    over ranks is tests/test_grpo_math.py's."""
    run = train(
        tiny_model_dir,
        server.url,
        tmp_path,
        ranks,
        DYNAMIC_SAMPLING=1,
        SAMPLER="difficulty",
        ALL_STEPS=3,
        EVAL_STEPS=0,
        LR="3e-3",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = metrics(tmp_path)[0]
    assert [m["groups"] for m in lines] == [2.0] * 3  # the mean over ranks of 2 each
    assert all(m["completions_trained"] == 2 * 4 for m in lines)
    by_rank = varied_groups(completions(tmp_path), 4)
    # every rank logged every step
    assert sorted(by_rank) == [(s, r) for s in (1, 2, 3) for r in range(ranks)]
    for (step, rank), varied in by_rank.items():
        # stopped at the second varied group
        assert sum(varied) == 2 and varied[-1], (step, rank, varied)
    # the metrics are means over ranks
    generated = sum(m["completions_generated"] for m in lines) * ranks
    assert generated == 4 * sum(len(v) for v in by_rank.values())


@pytest.mark.slow
def test_dynamic_sampling_with_regroup_and_a_worker(tiny_model_dir, tmp_path):
    """REGROUP's server (which sends only groups with different rewards, mixed across uploads) and a
    genonly worker whose groups a trainer rank takes as extras: with DYNAMIC_SAMPLING the run trains
    on at least Q_BATCH_SIZE groups each step."""
    srv = ServerProcess(tiny_model_dir, free_port(), tmp_path / "server.log", REGROUP="1")
    log = open(tmp_path / "worker.log", "w")
    worker = subprocess.Popen(
        [sys.executable, "grpo_ref_split.py", "genonly"],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=trainer_env(tiny_model_dir, srv.url, tmp_path / "out", WORKER_MAX_QUEUED=2),
    )
    try:
        wait_for(lambda: srv.health()["ready_workers"] > 0, timeout=300)
        run = train(
            tiny_model_dir,
            srv.url,
            tmp_path / "out",
            1,
            DYNAMIC_SAMPLING=1,
            EVAL_STEPS=0,
            EXTRA_GROUPS=2,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        lines = metrics(tmp_path / "out")[0]
        assert len(lines) == 2 and all(m["groups"] >= 2 for m in lines)
        assert any(m["groups"] > 2 for m in lines)  # the worker's groups came as extras
    finally:
        kill_group(worker)
        log.close()
        srv.stop()
