"""REGROUP (simple_GRPO's regroup_ver): the reference server pools each question's completions
across uploads and sends out groups that have reward variance, so a question whose group all scored
the same still teaches once a later upload brings a different reward. A regrouped group carries its
rewards, not advantages: the trainer computes them (step 4, its one home) when it pulls the group
back (features/server_client.py's Route).

    REGROUP=1 python ref_server.py
"""
import hashlib
import threading

import torch

from features.wire import IMAGE_FIELDS, OPTIONAL, sampled_version


class RegroupPool:
    """Per question, up to pool_size completion rows in upload order; at most `questions`
    questions, the least recently uploaded forgotten first."""

    def __init__(self, pool_size, questions):
        self.pool_size = pool_size
        self.questions = questions
        self.pools = {}  # (prompt hash, temperature) -> completion rows; insertion order = recency
        self.lock = threading.Lock()
        self.regrouped = 0  # groups sent out

    def add(self, tensors, meta):
        """Add this upload's completions to its question's pool, and take out a group of as many
        completions, with different rewards (advantages left to the trainer), when the pool has
        one; else None.

        Completions leave the pool when sent: none is trained twice. Each keeps its own
        pi_old_logps, so the clipped ratio stays right for older completions, and its own policy
        version (an upload without one counts as the oldest, 0): the group's version is its oldest
        completion's. """
        g = tensors["input_ids"].shape[0]
        plen = meta["plen"]
        prompt = tensors["input_ids"][0, :plen]  # (plen,) one prompt per group: the question
        images = {name: tensors[name] for name in IMAGE_FIELDS if name in tensors}  # the group's
        digest = hashlib.sha256(prompt.numpy().tobytes())
        for name in sorted(images):  # the same text with other images is another question
            digest.update(images[name].numpy().tobytes())
        key = (digest.hexdigest(), meta.get("temperature", 1.0))
        completions = meta.get("completions") or [None] * g
        per_row = [name for name in tensors if name != "advantages" and name not in images]
        rows = [{name: tensors[name][i] for name in per_row}  # advantages are redone
                | {"version": sampled_version(meta), "completion": completions[i], "images": images}
                for i in range(g)]
        with self.lock:
            pool = (self.pools.pop(key, []) + rows)[-self.pool_size :]
            scores = torch.stack([r["scores"] for r in pool])  # (n,)
            picked = []
            if len(pool) >= g and scores.unique().numel() > 1:
                order = torch.randperm(len(pool)).tolist()
                picked = order[:g]
                if scores[picked].unique().numel() == 1:  # swap in a completion with another reward
                    picked[-1] = next(i for i in order[g:] if scores[i] != scores[picked[0]])
                self.regrouped += 1
            chosen = [pool[i] for i in picked]
            pool = [r for i, r in enumerate(pool) if i not in picked]
            if pool:
                # re-inserted last: dicts keep order, so the first key is the stalest
                self.pools[key] = pool
            while len(self.pools) > self.questions:
                self.pools.pop(next(iter(self.pools)))
        return self._group(chosen, g, plen, meta) if chosen else None

    @staticmethod
    def _group(chosen, g, plen, meta):
        tlen = max(len(r["completion_mask"]) for r in chosen)  # from several uploads: the longest

        def padded(name, width, fill):  # (G, width) each row padded with `fill` to `width`
            rows = [torch.cat([r[name], r[name].new_full((width - len(r[name]),), fill)])
                    for r in chosen]
            return torch.stack(rows)

        out = dict(input_ids=padded("input_ids", plen + tlen, 0),  # (G, plen + tlen), pads masked
                   completion_mask=padded("completion_mask", tlen, False),  # (G, tlen)
                   scores=torch.stack([r["scores"] for r in chosen]))  # (G,)
        for name in OPTIONAL:  # pi_old_logps, vllm_logps: kept if every chosen completion has them
            if all(name in r for r in chosen):
                out[name] = padded(name, tlen, 0.0)  # (G, tlen)
        out.update(chosen[0]["images"])  # one question's pool: its completions share its images
        completions = [r["completion"] for r in chosen]  # each one's own text, for a REWARD_MODEL
        meta = {k: v for k, v in meta.items() if k != "completions"}
        if None not in completions:
            meta["completions"] = completions
        return out, {**meta, "version": min(r["version"] for r in chosen), "regrouped": True}
