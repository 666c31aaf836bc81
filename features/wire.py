"""Guard: the wire format between generators, the reference server and trainers: one group of
completions as safetensors bytes with JSON metadata in the header (no pickle, so a payload can
never run code on the other side), and what a group must be before any of it reaches a model
(validate_group: every field's type, shape and bound). The trainer packs its groups
(group_tensors) and lays pulled ones out for the loss (collate); retrying a busy or restarting
server is features/retry.py's.

    python -c "from features.wire import UPLOAD_SPEC; print(list(UPLOAD_SPEC))"
"""
import json
import struct

import safetensors.torch
import torch

from features import vision

# What a server's /health says it speaks; a trainer refuses another at start (check_reference).
# 2: each completion's reward sum travels as "scores", the lesson's name (format 1 called it
# "rewards").
WIRE_FORMAT = 2
# One group = safetensors tensors (UPLOAD_SPEC) + JSON metadata (META_FIELDS). input_ids holds
# prompt + completion for each of the G rows; the prompt (unpadded) has length plen.
UPLOAD_SPEC = {  # name: (dtype, shape as a function of G rows, L columns, plen)
    "input_ids": (torch.int64, lambda g, l, p: (g, l)),
    "completion_mask": (torch.bool, lambda g, l, p: (g, l - p)),
    "advantages": (torch.float32, lambda g, l, p: (g,)),
    "scores": (torch.float32, lambda g, l, p: (g,)),  # each completion's sum of REWARDS
    # optional: pi_old, the sampling policy's log-probs
    "pi_old_logps": (torch.float32, lambda g, l, p: (g, l - p)),
    # optional: what vLLM said they were
    "vllm_logps": (torch.float32, lambda g, l, p: (g, l - p)),
}
OPTIONAL = {"pi_old_logps", "vllm_logps"}
# A question's images (optional): their PNG/JPEG bytes, checked by features/vision.unpack_images.
IMAGE_FIELDS = vision.WIRE_FIELDS
# Every metadata field a group may carry, the one list of them: name: (type, who sets it, meaning).
# Only plen is required; validate_group checks the types (ref_server.py calls it).
META_FIELDS = {
    "plen": (int, "the trainer's group_tensors",
             "the prompt's length: input_ids[:, plen:] completion"),
    "question": (str, "the trainer's group_tensors", "the question, for a REWARD_MODEL"),
    "completions": (list, "the trainer's group_tensors",
                    "each row's sampled text, for a REWARD_MODEL"),
    "temperature": (float, "the trainer's pack_groups", "the sampling temperature: ref_logps' too"),
    "version": (int, "step 5 (upload_and_pull, RefClient)", "the policy version that sampled it"),
    "rank": (int, "step 5 (upload_and_pull, RefClient)", "the trainer rank that takes it back"),
    "upload_id": (str, "step 5 (upload_and_pull, RefClient)", "a retried upload is queued once"),
    "worker": (str, "RefClient.upload from a genonly worker", "its groups wait apart"),
    "regrouped": (bool, "regroup.RegroupPool", "REGROUP mixed it from several uploads"),
    "reward_model_mean": (float, "reward_model.add_reward_model", "the REWARD_MODEL's mean score"),
    "teacher_top_k": (int, "the trainer's pack_groups", "DISTILL_TOP_K: a teacher's k likeliest"),
}
MAX_META_CHARS = 2**22  # metadata: numbers, names, and the completions' text for a reward model
MAX_META_DEPTH = 8  # JSON nesting levels of the metadata
# how much of a bad input an error message quotes: enough to recognise, never megabytes
QUOTE_CHARS = 200
MAX_NAME_CHARS = 200  # metadata worker and upload_id: a name, never a payload
TEMPERATURE_RANGE = (0.01, 100)  # below 0.01, logits / T overflow to inf and the log-probs are NaN
MAX_RANKS = 4096  # trainer ranks a server keeps ready queues for
MAX_TOP_K = 64  # teacher_top_k: tokens per completion token a teacher sends back, (G, T, k) twice
CHECKED_META = ("version", "rank", "worker", "upload_id", "regrouped", "question", "completions",
                "teacher_top_k")
META_TYPES = {name: META_FIELDS[name][0] for name in CHECKED_META}  # optional fields' types


def sampled_version(meta: dict) -> int:
    """The policy version (training step) of the weights that sampled a group; one uploaded
    without a version counts as the oldest, 0 (the trainer's staleness rule and REGROUP's)."""
    return meta.get("version") or 0


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
    depth = 0
    level = [x]
    while level:
        depth += 1
        values = [c.values() if isinstance(c, dict) else c for c in level
                  if isinstance(c, (dict, list))]
        level = [v for children in values for v in children]
    return depth - 1


def completion_attention(completion_mask: torch.Tensor) -> torch.Tensor:
    """(G, T) long: 1 on each completion's columns up to its last token that trains (tool results
    before it included), 0 on the padding after it, which no forward of the group need attend."""
    written = completion_mask.int().flip(1).cumsum(1).flip(1)  # (G, T) trained tokens from here on
    return written.clamp(max=1)  # (G, T)


def carries_images(tensors: dict) -> bool:
    """Whether an upload's tensors hold a question's images (IMAGE_FIELDS); text never does."""
    return any(name in tensors for name in IMAGE_FIELDS)


def check_logps(values, name: str, *, rows: int, tokens: int) -> None:
    """ValueError unless a group's per-token log-probs (ref_logps from a server, pi_old_logps
    or vllm_logps from a worker) are finite float32 of the group's (rows, tokens) shape."""
    if values.dtype != torch.float32 or tuple(values.shape) != (rows, tokens):
        raise ValueError(f"{name} must be float32 {(rows, tokens)}, got {values.dtype} "
                         f"{tuple(values.shape)}")
    if not torch.isfinite(values).all():
        raise ValueError(f"{name} has NaN or inf values")


def check_teacher_topk(tensors: dict, *, top_k: int, completion_tokens: int, vocab_size) -> None:
    """ValueError unless a teacher's reply carries its k likeliest tokens of each completion token
    as asked: teacher_topk_ids (G, T, k) int64 below vocab_size, teacher_topk_logps (G, T, k) finite
    float32 log-probs (<= 0). What a trainer reads from a server is checked before it is used."""
    ids = tensors.get("teacher_topk_ids")
    logps = tensors.get("teacher_topk_logps")
    if ids is None or logps is None:
        raise ValueError("the teacher sent no top-k tokens: a server older than DISTILL_TOP_K?")
    rows = tensors["completion_mask"].shape[0]
    shape = (rows, completion_tokens, top_k)
    if ids.dtype != torch.int64 or tuple(ids.shape) != shape:
        raise ValueError(f"teacher_topk_ids must be int64 {shape}, got {ids.dtype} "
                         f"{tuple(ids.shape)}")
    if logps.dtype != torch.float32 or tuple(logps.shape) != shape:
        raise ValueError(f"teacher_topk_logps must be float32 {shape}, got {logps.dtype} "
                         f"{tuple(logps.shape)}")
    if ids.numel() and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        raise ValueError(f"teacher_topk_ids outside the vocabulary [0, {vocab_size})")
    if not torch.isfinite(logps).all() or (logps > 0).any():
        raise ValueError("teacher_topk_logps must be finite log-probs (<= 0)")
    mass = logps.double().exp().sum(-1)  # (G, T) what the k hold of the teacher's distribution
    if (mass > 1 + 1e-4).any():  # its tail bin (objectives.topk_reverse_kl) would be negative
        raise ValueError(f"teacher_topk_logps hold {mass.max().item():.4f} of a distribution: "
                         "k log-probs of one softmax sum to at most 1")


# ------------------------------------------------------------------------ what a group must be
class TooLarge(ValueError):
    """An upload over a size limit: 413."""


def validate_group(tensors: dict, meta: dict, vocab_size: int, max_rows: int, max_len: int,
                   max_tokens: int) -> dict:
    """The group's metadata with null fields dropped (null = not given); raise ValueError (TooLarge
    for a size limit) naming the first problem in an uploaded group."""
    missing = [k for k in UPLOAD_SPEC if k not in tensors and k not in OPTIONAL]
    if missing:
        raise ValueError(f"missing tensors: {missing}")
    unknown = sorted(set(tensors) - set(UPLOAD_SPEC) - set(IMAGE_FIELDS))
    if unknown:
        raise ValueError(f"unexpected tensors: {unknown}")
    if carries_images(tensors):  # text uploads carry none
        vision.unpack_images(tensors)  # the images' fields, counts and sizes; decoded by the server
    ids = tensors["input_ids"]
    if ids.dtype != torch.int64 or ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D int64, got {ids.dtype} {tuple(ids.shape)}")
    g, l = ids.shape
    if not 1 <= g <= max_rows:
        raise ValueError(f"input_ids has {g} rows; 1 to {max_rows} allowed")
    if l > max_len or g * l > max_tokens:
        raise TooLarge(f"group of {g} x {l} tokens: at most {max_len} per row (the model's "
                       f"positions) and {max_tokens} in all (MAX_GROUP_TOKENS)")
    plen = meta.get("plen")
    if type(plen) is not int or not 1 <= plen < l:
        raise ValueError(f"metadata plen must be an int in 1..{l - 1} (sequence length {l}), "
                         f"got {plen!r}")
    temperature = meta.get("temperature", 1.0)
    lowest, highest = TEMPERATURE_RANGE
    if type(temperature) not in (int, float) or not lowest <= temperature <= highest:
        raise ValueError(f"metadata temperature must be a number in {list(TEMPERATURE_RANGE)}, "
                         f"got {temperature!r}")
    for name, kind in META_TYPES.items():  # absent or null: the field is not given
        value = meta.get(name)
        named = name in ("worker", "upload_id")  # names, never payloads
        if value is not None and (type(value) is not kind or named and len(value) > MAX_NAME_CHARS):
            article = "an" if kind.__name__[0] in "aeiou" else "a"
            wanted = f"{article} {kind.__name__}"
            if kind is str:
                wanted = f"a string of at most {MAX_NAME_CHARS} characters"
            shown = str(value)[:MAX_NAME_CHARS // 2]
            raise ValueError(f"metadata {name} must be {wanted}, got {shown!r}")
    rank = meta.get("rank")
    if rank is not None and not 0 <= rank < MAX_RANKS:  # each rank gets a ready queue of its own
        raise ValueError(f"metadata rank must be an int in 0..{MAX_RANKS - 1}, got {rank!r}")
    top_k = meta.get("teacher_top_k")
    if top_k is not None and not 1 <= top_k <= MAX_TOP_K:  # the reply is (G, T, k) twice
        raise ValueError(f"metadata teacher_top_k must be an int in 1..{MAX_TOP_K}, got {top_k}")
    completions = meta.get("completions")
    if completions is not None and (len(completions) != g
                                    or not all(isinstance(c, str) for c in completions)):
        raise ValueError(f"metadata completions must be a list of {g} strings, one per row")
    for name, (dtype, shape) in UPLOAD_SPEC.items():
        if name not in tensors:
            continue
        t = tensors[name]
        if t.dtype != dtype or tuple(t.shape) != shape(g, l, plen):
            raise ValueError(f"{name} must be {dtype} {shape(g, l, plen)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"{name} has NaN or inf values")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"input_ids outside the vocabulary [0, {vocab_size}): "
                         f"{ids.min()}..{ids.max()}")
    return {k: v for k, v in meta.items() if v is not None}
