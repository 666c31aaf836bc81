"""Does the vision demo's policy read the image? The controls a reviewer asks for (issue 58), on the
demo's own 128 held-out shapes questions and a trained checkpoint: greedy accuracy on the images
as they are, on their colour-swapped twins (the same picture with its two colours exchanged, the
gold the other colour: a size-blind policy that knows which two colours are shown is right on at
most one of the pair), on position-swapped twins (each square drawn at the other's centre, the
gold kept: a rule that reads where a colour sits, not its size, flips its answer), on shuffled
images (each question shown another question's image, its own gold kept) and on a blank image.
The claim rests on "both twins right": chance for a size-blind rule is 0, for a blind guess among
the 4 colours 1/16.

    python bench/vision_controls.py CHECKPOINT [SEED]    # e.g. /tmp/vision_demo/aligned_s42/step_30
"""
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EVAL_SIZE = 128  # the demo's held-out questions (bench/run_vision_demo.sh: EVAL_SIZE=128)
WHITE = (255, 255, 255)  # the shapes' background


def swap_colours(data: bytes) -> bytes:
    """PNG bytes with the image's two non-white colours exchanged, pixel for pixel."""
    from PIL import Image

    from rewards import png_bytes

    image = Image.open(io.BytesIO(data)).convert("RGB")
    shown = sorted({colour for _, colour in image.getcolors(maxcolors=4096)} - {WHITE})
    if len(shown) != 2:
        raise ValueError(f"a shapes image shows 2 colours besides white, this one {len(shown)}")
    first, second = shown
    swapped = {first: second, second: first}
    image.putdata([swapped.get(pixel, pixel) for pixel in image.getdata()])
    return png_bytes(image)


def blank_image() -> bytes:
    """A white shapes-sized PNG: nothing to read."""
    from PIL import Image

    from rewards import SHAPES_SIZE, png_bytes

    return png_bytes(Image.new("RGB", (SHAPES_SIZE, SHAPES_SIZE), WHITE))


def other_colour(question: dict) -> str:
    """The colour of the smaller shape: the twin's gold."""
    from PIL import Image

    from rewards import COLOURS

    image = Image.open(io.BytesIO(question["images"][0])).convert("RGB")
    names = {rgb: name for name, rgb in COLOURS.items()}
    shown = {names[colour] for _, colour in image.getcolors(maxcolors=4096) if colour != WHITE}
    (other,) = shown - {question["gold"]}
    return other


def held_out_layouts(held_out: list, seed: int) -> list:
    """The held-out questions' layouts (rewards.ShapesLayout), replayed from the task's seed:
    each must draw its question's image to the byte, or the controls would ask of other pictures."""
    import rewards

    layouts = rewards.shapes_layouts(rewards.SHAPES_QUESTIONS, seed)[-len(held_out):]
    for number, (question, layout) in enumerate(zip(held_out, layouts), 1):
        if rewards.draw_shapes(layout) != question["images"][0]:
            raise ValueError(f"held-out question {number}: its image is not the layout that "
                             f"seed {seed} replays (another SHAPES_QUESTIONS or EVAL_SIZE?)")
    return layouts


def control_sets(held_out: list, layouts: list) -> dict:
    """{name: questions}: the held-out set as it is, the colour-swapped twins, the position-swapped
    twins (from each question's layout), shuffled images (each shows the next question's image)
    and a blank image, every question's text the same."""
    from rewards import draw_shapes

    twins = [{**q, "images": [swap_colours(q["images"][0])], "gold": other_colour(q)}
             for q in held_out]
    moved = [{**q, "images": [draw_shapes(layout.positions_swapped())]}
             for q, layout in zip(held_out, layouts)]
    shifted = held_out[1:] + held_out[:1]
    shuffled = [{**q, "images": other["images"]} for q, other in zip(held_out, shifted)]
    blank = [{**q, "images": [blank_image()]} for q in held_out]
    return {"original": held_out, "twins": twins, "positions": moved, "shuffled": shuffled,
            "blank": blank}


def right_answers(model, tokenizer, questions, eos_ids) -> list:
    """1.0 or 0.0 per question: the greedy answer names the gold colour (reward_word, the demo's
    reward), as the trainer's evaluation runs it."""
    import grpo_ref_split as grpo
    from features import evaluation
    from rewards import reward_word

    texts, _ = evaluation.held_out_answers(model, questions, encode=grpo.encode_prompts,
                                           decode=grpo.decode, eos_ids=eos_ids,
                                           pad_id=tokenizer.pad_token_id,
                                           max_new_tokens=grpo.MAX_NEW_TOKENS, tokenizer=tokenizer)
    return [reward_word(text, q["gold"]) for text, q in zip(texts, questions)]


def controls(checkpoint: str, seed: int) -> dict:
    """Each control's accuracy, and the share of questions right on both twins of each kind."""
    import torch

    import grpo_ref_split as grpo
    import rewards

    _, held_out = rewards.split_held_out(rewards.load_questions("shapes", seed), EVAL_SIZE)
    layouts = held_out_layouts(held_out, seed)
    model, tokenizer, eos_ids, _ = grpo.load_policy(checkpoint, torch.device("cpu"))
    right = {name: right_answers(model, tokenizer, questions, eos_ids)
             for name, questions in control_sets(held_out, layouts).items()}
    out = {name: sum(values) / len(values) for name, values in right.items()}
    for twins, both in (("twins", "both_twins"), ("positions", "both_positions")):
        right_on_both = [a * b for a, b in zip(right["original"], right[twins])]
        out[both] = sum(right_on_both) / len(right_on_both)
    return out


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else 42
    # The demo's prompt: its system prompt and the answer tag the trainer prefills.
    os.environ.setdefault("SYSTEM_PROMPT", "Answer inside <answer> </answer> tags.")
    os.environ.setdefault("THINK_PREFILL", "<answer>")
    os.environ.setdefault("EXAMPLE", "null")
    os.environ.setdefault("MAX_NEW_TOKENS", "8")
    print(json.dumps(controls(sys.argv[1], seed)), flush=True)


if __name__ == "__main__":
    main()
