"""The wire format between generators, the reference server and trainers: one group of answers as safetensors
bytes with JSON metadata in the header (no pickle, so a payload can never run code on the other side), and
collate, which lays groups of different lengths out as one padded batch for the loss.

    python -c "from features.wire import UPLOAD_SPEC; print(list(UPLOAD_SPEC))"
"""
import json
import struct

import safetensors.torch
import torch

# One group = safetensors tensors + JSON metadata {"plen": int, "temperature": float, ...free fields}.
# input_ids holds prompt + completion for each of the G rows; the prompt (unpadded) has length plen.
UPLOAD_SPEC = {  # name: (dtype, shape as a function of G rows, L columns, plen)
    "input_ids": (torch.int64, lambda g, l, p: (g, l)),
    "completion_mask": (torch.bool, lambda g, l, p: (g, l - p)),
    "advantages": (torch.float32, lambda g, l, p: (g,)),
    "rewards": (torch.float32, lambda g, l, p: (g,)),
    "gen_logps": (torch.float32, lambda g, l, p: (g, l - p)),  # optional: the sampling policy's log-probs
    "sampler_logps": (torch.float32, lambda g, l, p: (g, l - p)),  # optional: what vLLM said they were
}
OPTIONAL = {"gen_logps", "sampler_logps"}
MAX_META_CHARS, MAX_META_DEPTH = 2**22, 8  # metadata: numbers, names, and the answers' text for a reward model
QUOTE_CHARS = 200  # how much of a bad input an error message quotes: enough to recognise, never megabytes


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
        raise ValueError(f"metadata is not JSON, or nested too deeply: {str(e)[:QUOTE_CHARS]}") from None
    if not isinstance(meta, dict):
        raise ValueError("metadata must be a JSON object")
    if _depth(meta) > MAX_META_DEPTH:
        raise ValueError(f"metadata nested deeper than {MAX_META_DEPTH} levels")
    return tensors, meta


def _depth(x) -> int:
    """Nesting depth of JSON values, without recursion (a hostile document may be thousands deep)."""
    depth, level = 0, [x]
    while level:
        depth += 1
        level = [v for c in level if isinstance(c, (dict, list)) for v in (c.values() if isinstance(c, dict) else c)]
    return depth - 1


def collate(groups, pad_id):
    """Groups of different prompt and completion lengths as one left/right-padded batch. Optional log-probs come
    with the rows that carry them (gen_rows, sampler_rows (B,) bool), never with a value that means "missing"."""
    P = max(meta["plen"] for _, meta in groups)
    T = max(g["input_ids"].shape[1] - meta["plen"] for g, meta in groups)
    B = sum(g["input_ids"].shape[0] for g, _ in groups)
    b = dict(input_ids=torch.full((B, P + T), pad_id), attention_mask=torch.zeros(B, P + T, dtype=torch.long),
             mask=torch.zeros(B, T, dtype=torch.bool), advantages=torch.cat([g["advantages"] for g, _ in groups]))
    logps = {name: torch.zeros(B, T) for name in ("ref_logps", "gen_logps", "sampler_logps")}  # (B, T) each
    given = {name: torch.zeros(B, dtype=torch.bool) for name in logps}  # (B,) each: the rows that carry it
    row = 0
    for g, meta in groups:
        n, plen = g["input_ids"].shape[0], meta["plen"]
        tlen = g["input_ids"].shape[1] - plen
        b["input_ids"][row : row + n, P - plen : P + tlen] = g["input_ids"]  # prompts end at column P
        b["attention_mask"][row : row + n, P - plen : P + tlen] = 1
        b["mask"][row : row + n, :tlen] = g["completion_mask"]
        for name in [name for name in logps if name in g]:
            logps[name][row : row + n, :tlen], given[name][row : row + n] = g[name], True
        row += n
    b["ref_logps"] = logps["ref_logps"] if given["ref_logps"].all() else None  # None: BETA = 0, never asked for
    for name, rows in (("gen_logps", "gen_rows"), ("sampler_logps", "sampler_rows")):
        b[name], b[rows] = (logps[name], given[name]) if given[name].any() else (None, None)
    return b


def pack_groups(rollout, ids, kept, group_size, rewards, advantages, gen_logps, meta) -> list:
    """The kept groups of a rollout (the trainer's Rollout) as (tensors, meta) in UPLOAD_SPEC's layout: each prompt
    without its left padding, the columns every answer finished before dropped. ids (B, P + T) prompt + answer
    rows; kept: group indices; gen_logps (K, T) the kept rows' pi_old, or None; meta: fields every group carries."""
    G, P, mask = group_size, rollout.prompt_ids.shape[1], rollout.mask
    groups = []
    for j, q in enumerate(kept):
        r = slice(q * G, (q + 1) * G)
        plen = int(rollout.prompt_mask[q * G].sum())  # the prompt without its left padding
        tlen = int(mask[r].any(0).nonzero().max()) + 1  # drop columns every row has finished before
        tensors = dict(input_ids=ids[r, P - plen : P + tlen].cpu(), completion_mask=mask[r, :tlen].cpu(),
                       advantages=advantages[r], rewards=rewards[r])  # (G, plen + tlen), (G, tlen), (G,), (G,)
        if gen_logps is not None:
            tensors["gen_logps"] = gen_logps[j * G : (j + 1) * G, :tlen]  # (G, tlen)
        if rollout.sampler_logps is not None:  # vLLM's own: the loss's importance weights
            tensors["sampler_logps"] = rollout.sampler_logps[r, :tlen]  # (G, tlen)
        groups.append((tensors, {"plen": plen, "question": rollout.questions[q * G],
                                 "answers": rollout.texts[r], **meta}))  # question and answers: a reward model's
    return groups
