"""A variant: the fields the variants add to the lesson's Rollout and Batch, each record's `extra`.

A default step leaves every field here empty (None, {}), so the lesson's records show only what
GRPO carries between steps; vLLM, the calculator, the environments, images and the teacher fill
their own fields here. No command: grpo_ref_split.py imports it.
"""
from dataclasses import dataclass, field

import torch


@dataclass
class RolloutExtras:
    """What a rollout other than the plain one knows about step 2's B completions."""
    vllm_logps: torch.Tensor | None = None  # (B, T) vLLM's log-probs of its own tokens
    tool_calls: list | None = None  # TOOLS: calls each completion made
    tool_errors: list | None = None  # TOOLS: error results each completion got
    played: list | None = None  # multi-turn ENVIRONMENTS: each completion's rewards over its turns
    turns: list | None = None  # multi-turn ENVIRONMENTS: the steps each completion's episode took
    envs: list | None = None  # ENVIRONMENTS: each completion's environment
    vision_inputs: dict = field(default_factory=dict)  # each row's pixels (features/vision.py)
    images: list | None = None  # each completion's question's images (PNG/JPEG bytes), to upload


@dataclass
class BatchExtras:
    """What the loss's variants read beside GRPO's terms, row for row with the Batch's B rows."""
    vllm_logps: torch.Tensor | None = None  # (B, T) vLLM's, on vllm_rows (objectives.TIS_CAP)
    vllm_rows: torch.Tensor | None = None  # (B,) bool
    scores: torch.Tensor | None = None  # (B,) each completion's summed reward (teacher_mix)
    teacher_logps: torch.Tensor | None = None  # (B, T) DISTILL_COEF: the server's, never in k3
    teacher_on: bool = True  # False: the teacher's term left after TEACHER_STEPS (teacher_mix)
    teacher_topk_ids: torch.Tensor | None = None  # (B, T, k) DISTILL_TOP_K: its likeliest tokens
    teacher_topk_logps: torch.Tensor | None = None  # (B, T, k) and their log-probs
    vision_inputs: dict = field(default_factory=dict)  # each row's pixels; {} = text
