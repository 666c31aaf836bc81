"""A learned reward model (the server's REWARD_MODEL) beside the trainer's rule rewards: the server
scores each (question, answer) pair with it, adds REWARD_MODEL_WEIGHT x the score to the answer's
reward, and redoes the group's advantages, since only the server knows the last reward.

    REWARD_MODEL=path/to/sequence-classifier python ref_server.py
"""
import torch

from features.advantages import group_advantages, upload_scale


def load_reward_model(name, dtype, device):
    """(model, tokenizer): an AutoModelForSequenceClassification, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(name, dtype=dtype).to(device).eval()
    return model.requires_grad_(False), AutoTokenizer.from_pretrained(name)


def reward_scores(reward_model, question, answers):
    """(G,) the reward model's score of each (question, answer) pair, its first logit."""
    model, tokenizer = reward_model
    device = next(model.parameters()).device
    enc = tokenizer(
        [question] * len(answers), answers, return_tensors="pt", padding=True, truncation=True
    )
    with torch.no_grad():
        return model(**enc.to(device)).logits[:, 0].float().cpu()  # (G,)


def add_reward_model(tensors, meta, reward_model, weight):
    """The group with weight x score added to each reward, advantages redone, and the mean score in
    meta."""
    scores = reward_scores(reward_model, meta["question"], meta["answers"])  # (G,)
    rewards = tensors["rewards"] + weight * scores  # (G,)
    # "batch": the trainer divides by its step's std
    scale = upload_scale(meta.get("scale_rewards", "group"))
    advantages = group_advantages(rewards, len(scores), scale)  # (G,)
    tensors = {**tensors, "rewards": rewards, "advantages": advantages}
    return tensors, {**meta, "reward_model_mean": scores.mean().item()}
