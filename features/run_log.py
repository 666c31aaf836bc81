"""Log: the run log: what each step measures (the loss's metrics, the completions' rewards and
lengths, the seconds of each phase), averaged over ranks, as a line under the progress bar and in
OUTPUT_DIR/metrics.jsonl, the sampled completions in completions.jsonl, optional TensorBoard
scalars. docs/metrics.md says what each metric means; features/curves.py draws them.

    python scripts/show_completions.py output/completions.jsonl    # a step's completions, readable
"""
import contextlib
import importlib
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from features import env_overrides
from features.question_sampler import question_id
from features.vllm_engine import vllm_gap
from features.wire import sampled_version

LOG_COMPLETIONS_STEPS = 1  # every this many steps, each completion as a line of completions.jsonl
TENSORBOARD = False  # True = every metric also as a TensorBoard scalar under OUTPUT_DIR/tb
env_overrides.apply_env_overrides(globals(), "features/run_log.py")


# of the one sampled completion printed under each step: enough to see the format appear
SAMPLE_CHARS = 200


def check_tensorboard(enabled: bool):
    """TENSORBOARD = True needs the package: stop before any model loads if it is missing."""
    if not enabled:
        return
    try:
        importlib.import_module("torch.utils.tensorboard")
    except ImportError as e:
        sys.exit(f"TENSORBOARD=1 needs the tensorboard package ({e}): pip install tensorboard, "
                 "or TENSORBOARD=0")


def open_jsonl(output_dir, name, resumed_step=0):
    """output_dir/name for appending lines {"step": ...}. A fresh run keeps an earlier run's file
    under a new name; a resumed run keeps the lines up to its checkpoint's step (later lines were
    never saved)."""
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, name)
    if os.path.exists(path) and resumed_step:
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        return open(path, "a")
    if os.path.exists(path):
        stem, ext = os.path.splitext(name)
        os.rename(path, os.path.join(output_dir, f"{stem}.{int(os.path.getmtime(path))}{ext}"))
    return open(path, "w")


def open_on_rank_0(rank, output_dir, reward_names, *, resumed_step=0):
    """Rank 0's RunLog with this module's LOG_COMPLETIONS_STEPS and TENSORBOARD; None on the
    others (log_step gathers their completions to rank 0)."""
    if rank != 0:
        return None
    return RunLog(output_dir, reward_names, resumed_step=resumed_step, tensorboard=TENSORBOARD,
                  completions_every=LOG_COMPLETIONS_STEPS)


class RunLog:
    """Rank 0's record of a run: metrics.jsonl, completions.jsonl (every `completions_every` steps;
    0 = never) and, with tensorboard, every metric as a scalar under output_dir/tb (`tensorboard
    --logdir output/tb`)."""

    def __init__(self, output_dir, reward_names, *, resumed_step=0, completions_every=1,
                 tensorboard=False):
        self.reward_names = list(reward_names)
        self.completions_every = completions_every
        self.metrics = open_jsonl(output_dir, "metrics.jsonl", resumed_step)
        self.completions = None  # completions.jsonl, unless completions_every is 0
        if completions_every > 0:
            self.completions = open_jsonl(output_dir, "completions.jsonl", resumed_step)
        self.tb = None
        if tensorboard:  # check_tensorboard made sure it imports; purge_step drops unsaved steps
            from torch.utils.tensorboard import SummaryWriter

            purge = resumed_step + 1 if resumed_step else None
            self.tb = SummaryWriter(os.path.join(output_dir, "tb"), purge_step=purge)

    def write(self, step, m):
        rounded = {k: round(v, 6) for k, v in m.items()}
        self.metrics.write(json.dumps({"step": step, **rounded}) + "\n")
        self.metrics.flush()
        if self.tb is not None:
            for k, v in m.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def step(self, step, m, records):
        """One line under the progress bar, one sampled completion, a line of metrics.jsonl, and
        (every completions_every steps) `records`, every rank's completion records, in
        completions.jsonl."""
        if self.completions is not None and step % self.completions_every == 0:
            self.completions.writelines(json.dumps(a) + "\n" for a in records)
            self.completions.flush()
        kl = f"kl {m['kl']:.4f} | " if "kl" in m else ""
        parts = " | ".join(f"{name} {m[name]:.2f}" for name in self.reward_names)
        tqdm.write(f"step {step:4d} | loss {m['loss']:+.4f} | reward {m['reward']:.3f} | {parts} | "
                   f"{kl}clip {m['clip_low']:.3f}/{m['clip_high']:.3f} | lr {m['lr']:.2e} | "
                   f"len {m['length']:.1f} | {m['seconds']:.1f}s")
        if "tool_calls" in records[0]:  # TOOLS: how the completions used them, on a line of its own
            m = m | tool_stats(records)
            tool_line(m)
        if "env" in records[0]:  # ENVIRONMENTS: each one's share and rewards, every rank's
            m = m | environment_stats(records)
        a = records[-1]  # the newest rollout's last: a person watching sees the format appear
        tqdm.write(f"  sample | reward {a['reward']:.2f} | {a['question'][:60]!r} -> "
                   f"{a['completion'][:SAMPLE_CHARS]!r}")
        self.write(step, m)

    def eval(self, step, m, n_questions):
        scores = " | ".join(f"{k[5:]} {v:.3f}" for k, v in m.items())
        tqdm.write(f"eval {step:4d} | held-out {scores} | {n_questions} questions, greedy")
        self.write(step, m)

    def close(self):
        """Close the files, and say where the run left them."""
        for f in (self.metrics, self.completions, self.tb):
            if f is not None:
                f.close()
        print(f"done: checkpoints, metrics.jsonl, completions.jsonl and curves.png in "
              f"{os.path.dirname(self.metrics.name) or '.'}/", flush=True)


def log_step(step, m, records, log, device):
    """Every rank calls it: the metrics averaged over ranks and every rank's completion records go
    to rank 0's `log` (None on the other ranks). Returns the averaged metrics, the same on every
    rank."""
    m = reduce_over_ranks(m, device)
    gathered = [None] * torch.distributed.get_world_size() if log is not None else None
    torch.distributed.gather_object(records, gathered, dst=0)
    if log is not None:
        log.step(step, m, [a for rank_completions in gathered for a in rank_completions])
    return m


def reduce_over_ranks(values: dict, device) -> dict:
    """Each metric's mean over ranks; the max for max_* metrics."""
    keys = sorted(values)  # every rank must send the same order
    total = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    peak = total.clone()
    torch.distributed.all_reduce(total)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    n = torch.distributed.get_world_size()
    mean = total / n  # (K,)
    return {k: (peak[i] if k.startswith("max_") else mean[i]).item() for i, k in enumerate(keys)}


@torch.no_grad()
def weight_gap(model) -> float:
    """|this rank's weight sums - rank 0's|, largest: ZeRO-2 hands every rank the same full weights
    after each step, so it is 0; a rank that drifted (another node's kernels, a lost reduction)
    would train a different model without a word. Sums in float64 without a float64 copy of any
    weight; one read of the weights (none on 1 rank)."""
    if torch.distributed.get_world_size() == 1:
        return 0.0
    sums = torch.stack([p.sum(dtype=torch.float64) for p in model.parameters()])  # (n_params,)
    first = sums.clone()
    torch.distributed.broadcast(first, src=0)
    return (sums - first).abs().max().item()


@torch.no_grad()
def loss_metrics(loss, b, *, ratio, entropy, kl, advantages, clip_eps, clip_eps_high) -> dict:
    """A (micro-)batch's loss metrics at the weights before the step, each x the batch's share of
    the step's (its completions, or its tokens for per-token ones), so the step's sum over
    micro-batches is the whole batch's value: loss; clip_low/high (tokens the clip cut: ratio below
    1 - clip_eps with A < 0, above 1 + clip_eps_high with A > 0); ratio_drift (|ratio - 1| per
    completion, 0 on-policy); entropy (per token); kl (k3 per completion; kl None: none). b: the
    batch (mask, share, token_share); ratio, entropy, kl, advantages (B, T)."""
    mask = b.mask
    tokens = b.token_share
    n = mask.sum().clamp(min=1)  # ()
    per_completion = mask.sum(-1).clamp(min=1)  # (B,)
    low = (ratio < 1 - clip_eps) & (advantages < 0) & mask  # (B, T)
    high = (ratio > 1 + clip_eps_high) & (advantages > 0) & mask  # (B, T)
    entropy_mean = (torch.where(mask, entropy, 0.0).sum() / n).item()
    drift = (torch.where(mask, (ratio - 1).abs(), 0.0).sum(-1) / per_completion).mean().item()
    metrics = dict(loss=loss.item() * (b.share > 0), clip_low=(low.sum() / n).item() * tokens,
                   clip_high=(high.sum() / n).item() * tokens, entropy=entropy_mean * tokens,
                   ratio_drift=drift * b.share)
    if kl is not None:
        kl_mean = (torch.where(mask, kl, 0.0).sum(-1) / per_completion).mean().item()
        metrics["kl"] = kl_mean * b.share
    return metrics


@torch.no_grad()
def vllm_metrics(b, *, pi_old_logps, weights) -> dict:
    """With vLLM, each x the batch's token share: vllm_gap (the two engines' mismatch on the
    sampled tokens) and tis_masked (the share of tokens whose importance weight TIS_MODE made 0).
    pi_old_logps, weights (B, T); weights None: none."""
    mask = b.mask
    n = mask.sum().clamp(min=1)  # ()
    gap = vllm_gap(pi_old_logps, b.extra.vllm_logps, b.extra.vllm_rows, mask)
    masked = 0.0 if weights is None else (((weights == 0) & mask).sum() / n).item()
    return dict(vllm_gap=gap * b.token_share, tis_masked=masked * b.token_share)


@torch.no_grad()
def teacher_metrics(b, *, pi_old_logps, token_advantages=None) -> dict:
    """With a teacher (DISTILL_COEF), each x the batch's token share: teacher_kl (the mean of
    log pi_old - log teacher over tokens, the reverse KL's estimate), teacher_better (the share
    of tokens the teacher finds likelier) and, given the (B, T) token_advantages the surrogate used,
    teacher_share: rms(teacher term) / (rms(group term) + rms(teacher term)) over the completion
    tokens, how much of the advantages' size is the teacher's (DISTILL_SCALE "matched": 0.5; the
    rewards waiting, TEACHER_FIRST_KL: 1). pi_old_logps (B, T)."""
    mask = b.mask
    n = mask.sum().clamp(min=1)  # ()
    gap = torch.where(mask, pi_old_logps - b.extra.teacher_logps, 0.0)  # (B, T) log ratio
    metrics = dict(teacher_kl=(gap.sum() / n).item() * b.token_share,
                   teacher_better=(((gap < 0) & mask).sum() / n).item() * b.token_share)
    if token_advantages is not None:
        group = torch.where(mask, b.advantages[:, None], 0.0)  # (B, T) the rewards' term
        teacher = token_advantages - b.advantages[:, None]  # (B, T) the teacher's term
        term = torch.where(mask, teacher, 0.0)  # (B, T)
        group_rms = (group.square().sum() / n).sqrt()  # ()
        term_rms = (term.square().sum() / n).sqrt()  # ()
        share = term_rms / (group_rms + term_rms).clamp(min=1e-12)  # ()
        metrics["teacher_share"] = share.item() * b.token_share
    return metrics


def completion_records(step, rank, generated, each, rewards, advantages) -> list:
    """One dict per sampled completion, a line of completions.jsonl: what the model wrote and how it
    scored. generated: the trainer's Rollout; each: {reward name: its N values}; rewards, advantages
    (N,)."""
    extra = generated.extra  # what a variant's rollout adds (features/variant_fields.py)
    tool = {k: getattr(extra, k) for k in ("tool_calls", "tool_errors", "turns")
            if getattr(extra, k) is not None}
    if extra.envs and extra.envs[0] is not None:  # ENVIRONMENTS: each completion's own
        tool["env"] = extra.envs
    ids = {}  # a question with images: what the sampler knows it by (question_sampler)
    if extra.images:
        ids["question_id"] = [question_id(text, images)
                              for text, images in zip(generated.questions, extra.images)]
    return [dict(step=step, rank=rank, question=generated.questions[i], gold=generated.golds[i],
                 completion=generated.texts[i], reward=rewards[i].item(),
                 **{name: values[i] for name, values in each.items()},
                 advantage=advantages[i].item(), length=generated.lengths[i],
                 truncated=generated.truncated[i], **{k: values[i] for k, values in tool.items()},
                 **{k: values[i] for k, values in ids.items()})
            for i in range(len(rewards))]


def sample_stats(records, group_size, reward_names) -> dict:
    """Means over the completion records of every rollout a step sampled (one that re-sampled after
    all-equal groups counts both): reward, reward_std (within groups), zero_var_groups (the share of
    groups whose completions all scored the same: they train nothing), each reward's mean, length,
    max_length, truncated."""
    # (N,) N = rollouts x Q_BATCH_SIZE x NUM_PRE_Q
    rewards = torch.tensor([a["reward"] for a in records])
    lengths = torch.tensor([float(a["length"]) for a in records])  # (N,)
    spread = rewards.view(-1, group_size).std(1, correction=int(group_size > 1))  # (groups,)
    stats = dict(reward=rewards.mean().item(), reward_std=spread.mean().item(),
                 zero_var_groups=(spread == 0).double().mean().item(),
                 length=lengths.mean().item(), max_length=lengths.max().item(),
                 truncated=sum(a["truncated"] for a in records) / len(records))
    return stats | {name: sum(a[name] for a in records) / len(records) for name in reward_names}


# a completion record's numbers that are not rewards (completion_records); every other number is one
NOT_REWARDS = ("step", "rank", "reward", "advantage", "length", "truncated", "turns",
               "tool_calls", "tool_errors")


def tag_of(name: str) -> str:
    """An environment's name in metric names (eval_reward_correct_<tag>): no ":", "/" or "."."""
    return name.replace(":", "_").replace("/", "_").replace(".", "_")


def environment_stats(records) -> dict:
    """ENVIRONMENTS: for each environment (by its tag) among the completions of every rank, its
    share of them (share_<tag>), their mean reward (reward_<tag>) and each named reward's mean
    (<name>_<tag>; 0 for a reward another environment gives)."""
    out = {}
    for env in sorted({a["env"] for a in records}):
        mine = [a for a in records if a["env"] == env]
        tag = tag_of(env)
        out[f"share_{tag}"] = len(mine) / len(records)
        out[f"reward_{tag}"] = sum(a["reward"] for a in mine) / len(mine)
        names = [k for k, v in mine[0].items() if k not in NOT_REWARDS
                 and isinstance(v, (int, float)) and not isinstance(v, bool)]
        for name in names:
            out[f"{name}_{tag}"] = sum(a[name] for a in mine) / len(mine)
    return out


def tool_line(m):
    """The line under a step that says how its completions used the tools (TOOLS)."""
    tqdm.write(f"  tools  | {m['tool_share']:.0%} of completions called one, "
               f"{m['tool_calls']:.2f} calls and {m['tool_errors']:.2f} errors per completion")


def tool_stats(records) -> dict:
    """TOOLS: tool_calls and tool_errors per completion, tool_share (completions with a call) and
    reward_correct's mean over the completions with a call and without one (correct_with_tool,
    correct_without_tool; absent where none), over every rank's completions of the step. {} without
    tools."""
    if not records or "tool_calls" not in records[0]:
        return {}
    n = len(records)
    used = [a for a in records if a["tool_calls"] > 0]
    out = dict(tool_calls=sum(a["tool_calls"] for a in records) / n, tool_share=len(used) / n,
               tool_errors=sum(a["tool_errors"] for a in records) / n)
    unused = [a for a in records if not a["tool_calls"]]
    for name, part in (("correct_with_tool", used), ("correct_without_tool", unused)):
        if part and "reward_correct" in part[0]:
            out[name] = sum(a["reward_correct"] for a in part) / len(part)
    return out


def clock() -> float:
    """Seconds, after waiting for queued GPU work (else a timer sees only the kernel launches)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def timed(metrics, key: str):
    """Add the seconds the block takes to metrics[key] (a Counter: the trainer's one way of
    gathering metrics)."""
    start = clock()
    yield
    metrics[key] += clock() - start


def step_metrics(m, groups, records, *, step, attempts, began, group_size,
                 reward_names) -> dict:
    """The step's metrics with the derived ones: sample_stats over every rollout's completions,
    rollouts, completions generated and trained (this rank's: their ratio over a run is the
    rollouts' cost per completion that trains), groups, staleness, reward_model (the server's
    REWARD_MODEL mean score; the reward metric holds the rule rewards only), train_s, seconds."""
    trained = sum(len(t["advantages"]) for t, _ in groups)
    out = dict(m, **sample_stats(records, group_size, reward_names), rollouts=attempts,
               groups=len(groups), completions_generated=len(records), completions_trained=trained,
               train_s=m["fwd_bwd_s"] + m["optim_s"],
               staleness=sum(step - 1 - sampled_version(meta) for _, meta in groups) / len(groups),
               seconds=clock() - began)
    scores = [meta["reward_model_mean"] for _, meta in groups if "reward_model_mean" in meta]
    if scores:
        out["reward_model"] = sum(scores) / len(scores)
    return out
