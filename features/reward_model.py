"""A learned reward model (the server's REWARD_MODEL) beside the trainer's rule rewards: the server
scores each (question, completion) pair with it and adds REWARD_MODEL_WEIGHT x the score to the
completion's reward; the trainer computes the group's advantages again from those rewards when it
pulls the group back (step 4, its one home: features/server_client.py's Route).

    REWARD_MODEL=path/to/sequence-classifier python ref_server.py
"""
import torch


def load_reward_model(name, dtype, device):
    """(model, tokenizer): an AutoModelForSequenceClassification, frozen, in eval mode."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(name, dtype=dtype).to(device).eval()
    return model.requires_grad_(False), AutoTokenizer.from_pretrained(name)


def reward_scores(reward_model, question, completions):
    """(G,) the reward model's score of each (question, completion) pair, its first logit."""
    model, tokenizer = reward_model
    device = next(model.parameters()).device
    enc = tokenizer(
        [question] * len(completions), completions, return_tensors="pt", padding=True,
        truncation=True,
    )
    with torch.no_grad():
        return model(**enc.to(device)).logits[:, 0].float().cpu()  # (G,)


def add_reward_model(tensors, meta, reward_model, weight):
    """The group with weight x score added to each reward (its advantages, now stale, left out:
    the trainer computes them again) and the mean score in meta."""
    model_scores = reward_scores(reward_model, meta["question"], meta["completions"])  # (G,)
    scores = tensors["scores"] + weight * model_scores  # (G,)
    tensors = {name: value for name, value in tensors.items() if name != "advantages"}
    tensors["scores"] = scores  # (G,)
    return tensors, {**meta, "reward_model_mean": model_scores.mean().item()}
