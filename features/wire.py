"""The wire format between generators, the reference server and trainers: one group of answers as
safetensors bytes with JSON metadata in the header (no pickle, so a payload can never run code on
the other side), and collate, which lays groups of different lengths out as one padded batch for
the loss. Retrying a busy or restarting server is features/retry.py's.

    python -c "from features.wire import UPLOAD_SPEC; print(list(UPLOAD_SPEC))"
"""
import json
from collections import Counter
import struct

import safetensors.torch
import torch

from features import vision

# One group = safetensors tensors (UPLOAD_SPEC) + JSON metadata (META_FIELDS). input_ids holds
# prompt + completion for each of the G rows; the prompt (unpadded) has length plen.
UPLOAD_SPEC = {  # name: (dtype, shape as a function of G rows, L columns, plen)
    "input_ids": (torch.int64, lambda g, l, p: (g, l)),
    "completion_mask": (torch.bool, lambda g, l, p: (g, l - p)),
    "advantages": (torch.float32, lambda g, l, p: (g,)),
    "rewards": (torch.float32, lambda g, l, p: (g,)),
    # optional: the sampling policy's log-probs
    "gen_logps": (torch.float32, lambda g, l, p: (g, l - p)),
    # optional: what vLLM said they were
    "sampler_logps": (torch.float32, lambda g, l, p: (g, l - p)),
}
OPTIONAL = {"gen_logps", "sampler_logps"}
# A question's images (optional): their PNG/JPEG bytes, checked by features/vision.unpack_images.
IMAGE_FIELDS = vision.WIRE_FIELDS
# Every metadata field a group may carry, the one list of them: name: (type, who sets it, meaning).
# Only plen is required; ref_server.py checks the types (features/server_guard.py).
META_FIELDS = {
    "plen": (int, "wire.group_tensors", "the prompt's length: input_ids[:, plen:] are the answers"),
    "question": (str, "wire.group_tensors", "the question, for a REWARD_MODEL"),
    "answers": (list, "wire.group_tensors", "each row's answer text, for a REWARD_MODEL"),
    "temperature": (float, "the trainer's pack_groups", "the sampling temperature: ref_logps' too"),
    "scale_rewards": (str, "the trainer's pack_groups", "SCALE_REWARDS, to redo advantages with"),
    "version": (int, "step 5 (upload_and_pull, RefClient)", "the policy version that sampled it"),
    "rank": (int, "step 5 (upload_and_pull, RefClient)", "the trainer rank that takes it back"),
    "upload_id": (str, "step 5 (upload_and_pull, RefClient)", "a retried upload is queued once"),
    "worker": (str, "RefClient.upload from a genonly worker", "its groups wait apart"),
    "regrouped": (bool, "regroup.RegroupPool", "REGROUP mixed it from several uploads"),
    "reward_model_mean": (float, "reward_model.add_reward_model", "the REWARD_MODEL's mean score"),
}
# metadata: numbers, names, and the answers' text for a reward model
MAX_META_CHARS, MAX_META_DEPTH = 2**22, 8
# how much of a bad input an error message quotes: enough to recognise, never megabytes
QUOTE_CHARS = 200


def sampled_version(meta: dict) -> int:
    """The policy version (training step) of the weights that sampled a group; one uploaded
    without a version counts as the oldest, 0 (the trainer's staleness rule and REGROUP's)."""
    return meta.get("version") or 0


def sampled_by(groups, version, *, max_staleness) -> tuple:
    """(the pulled groups the policy at `version` may train on, the counts dropped). A group that
    other weights sampled (a step late) needs their log-probs as pi_old (gen_logps), else its ratio
    would be 1 as if these weights had sampled it: workers' and regrouped groups carry them. One
    sampled more than max_staleness versions ago is dropped (docs/workers.md), and so is one sampled
    by weights newer than these (a crashed run's leftovers after RESUME, a worker on a later
    published version): its pi_old is not a policy this run has been. A group without a version
    counts as the oldest, 0."""
    def lag(meta):  # versions between the sampling weights and these
        return version - sampled_version(meta)
    fresh = [(tensors, meta) for tensors, meta in groups if 0 <= lag(meta) <= max_staleness]
    usable = [(tensors, meta) for tensors, meta in fresh
              if lag(meta) == 0 or "gen_logps" in tensors]
    ahead = sum(1 for _, meta in groups if lag(meta) < 0)
    stale = len(groups) - len(fresh) - ahead
    return usable, Counter(late_groups_dropped=len(fresh) - len(usable), stale_groups_dropped=stale,
                           ahead_groups_dropped=ahead)


def encode_batch(tensors: dict, meta: dict) -> bytes:
    """safetensors bytes of `tensors` with `meta` as JSON in the header: no pickle."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    return safetensors.torch.save(tensors, metadata={"json": json.dumps(meta)})


def decode_batch(data: bytes) -> tuple[dict, dict]:
    """Inverse of encode_batch. Raises ValueError with the reason on anything malformed."""
    if len(data) < 8:
        raise ValueError(f"body is not safetensors: {len(data)} bytes, no header")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise ValueError("body is not safetensors: header length past the end (truncated?)")
    try:
        header = json.loads(data[8 : 8 + header_len])
        tensors = safetensors.torch.load(data)
    except Exception as e:
        raise ValueError(f"body is not safetensors: {e}") from None
    raw = (header.get("__metadata__") or {}).get("json", "{}")
    if len(raw) > MAX_META_CHARS:
        raise ValueError(f"metadata of {len(raw)} characters; at most {MAX_META_CHARS}")
    try:
        meta = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as e:
        detail = str(e)[:QUOTE_CHARS]
        raise ValueError(f"metadata is not JSON, or nested too deeply: {detail}") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    if _depth(meta) > MAX_META_DEPTH:
        raise ValueError(f"metadata nested deeper than {MAX_META_DEPTH} levels")
    return tensors, meta


def _depth(x) -> int:
    """Nesting depth of JSON values, without recursion (a hostile document may be thousands
    deep)."""
    depth, level = 0, [x]
    while level:
        depth += 1
        values = [c.values() if isinstance(c, dict) else c for c in level
                  if isinstance(c, (dict, list))]
        level = [v for children in values for v in children]
    return depth - 1


def collate(groups, pad_id, *, teacher=False, image_processor=None):
    """Groups of different prompt and completion lengths as one left/right-padded batch. Optional
    log-probs come with the rows that carry them (gen_rows, sampler_rows (B,) bool), never with a
    value that means "missing". teacher: the server's log-probs are a teacher's (teacher_logps),
    never a reference's (ref_logps None). image_processor: a vision model's, for the groups'
    images as each row's pixels (vision_inputs; {} for text)."""
    P = max(meta["plen"] for _, meta in groups)
    T = max(g["input_ids"].shape[1] - meta["plen"] for g, meta in groups)
    B = sum(g["input_ids"].shape[0] for g, _ in groups)
    b = dict(input_ids=torch.full((B, P + T), pad_id),
             attention_mask=torch.zeros(B, P + T, dtype=torch.long),
             mask=torch.zeros(B, T, dtype=torch.bool),
             advantages=torch.cat([g["advantages"] for g, _ in groups]))
    # (B, T) each
    logps = {name: torch.zeros(B, T) for name in ("ref_logps", "gen_logps", "sampler_logps")}
    # (B,) each: the rows that carry it
    given = {name: torch.zeros(B, dtype=torch.bool) for name in logps}
    row = 0
    for g, meta in groups:
        n, plen = g["input_ids"].shape[0], meta["plen"]
        tlen = g["input_ids"].shape[1] - plen
        # prompts end at column P
        b["input_ids"][row : row + n, P - plen : P + tlen] = g["input_ids"]
        b["attention_mask"][row : row + n, P - plen : P + tlen] = 1
        b["mask"][row : row + n, :tlen] = g["completion_mask"]
        for name in [name for name in logps if name in g]:
            logps[name][row : row + n, :tlen], given[name][row : row + n] = g[name], True
        row += n
    # None: BETA = 0, never asked for
    server_logps = logps["ref_logps"] if given["ref_logps"].all() else None
    b["ref_logps"] = None if teacher else server_logps
    b["teacher_logps"] = server_logps if teacher else None
    for name, rows in (("gen_logps", "gen_rows"), ("sampler_logps", "sampler_rows")):
        b[name], b[rows] = (logps[name], given[name]) if given[name].any() else (None, None)
    b["vision_inputs"] = {}  # text: no pixel inputs
    if image_processor is not None or any(carries_images(g) for g, _ in groups):
        b["vision_inputs"] = vision.group_vision_inputs(groups, image_processor)  # or refused
    return b


def carries_images(tensors: dict) -> bool:
    """Whether an upload's tensors hold a question's images (IMAGE_FIELDS); text never does."""
    return any(name in tensors for name in IMAGE_FIELDS)


def group_tensors(sampled, ids, kept, group_size, rewards, advantages, gen_logps, meta) -> list:
    """The kept groups of a rollout (the trainer's Rollout) as (tensors, meta) in UPLOAD_SPEC's
    layout: each prompt without its left padding, the columns every answer finished before dropped.
    ids (B, P + T) prompt + answer rows; kept: group indices; gen_logps (K, T) the kept rows'
    pi_old, or None; meta: fields every group carries."""
    G, P, mask = group_size, sampled.prompt_ids.shape[1], sampled.mask
    groups = []
    for j, q in enumerate(kept):
        r = slice(q * G, (q + 1) * G)
        plen = int(sampled.prompt_mask[q * G].sum())  # the prompt without its left padding
        tlen = int(mask[r].any(0).nonzero().max()) + 1  # drop columns every row has finished before
        tensors = dict(input_ids=ids[r, P - plen : P + tlen].cpu(),  # (G, plen + tlen)
                       completion_mask=mask[r, :tlen].cpu(),  # (G, tlen)
                       advantages=advantages[r], rewards=rewards[r])  # (G,), (G,)
        if gen_logps is not None:
            tensors["gen_logps"] = gen_logps[j * G : (j + 1) * G, :tlen]  # (G, tlen)
        if sampled.sampler_logps is not None:  # vLLM's own: the loss's importance weights
            tensors["sampler_logps"] = sampled.sampler_logps[r, :tlen]  # (G, tlen)
        if sampled.images:  # the question's images, as their own bytes (features/vision.py)
            tensors.update(vision.pack_images(sampled.images[q * G]))
        groups.append((tensors, {"plen": plen, "question": sampled.questions[q * G],
                                 "answers": sampled.texts[r], **meta}))  # for a reward model
    return groups


def global_count(masks, *, token_mean: bool) -> float:
    """The trainer's reduce_loss normalizer: the step's answers (token_mean: tokens) in its (B, T)
    masks on all ranks, / the ranks: each weighs the same wherever it landed, as ZeRO-2 averages
    gradients."""
    count = sum(int(m.sum()) if token_mean else m.shape[0] for m in masks)
    n = torch.tensor(float(count), dtype=torch.float64, device=masks[0].device)  # NCCL: GPU only
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(n)
        n /= torch.distributed.get_world_size()
    return n.item()
