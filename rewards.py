"""The task: questions with gold answers, and the rewards that score a model's completions.

Questions come from a built-in, seeded addition task (no download), a GSM8K-style JSONL file or
the hub; for a vision-language model, questions with images: geometry3k (the hub, or a local
JSONL with image files beside it) or the built-in "shapes" (docs/vision.md). Each reward takes
the text the model wrote (with the trainer's `<think>` prefill put back in front) and returns a
float, so a reader can check any completion by hand:

    python -c "import rewards; print(rewards.reward_correct('<answer>42</answer>', '42'))"

Every reward is called as f(completion, gold, question) -> float; the trainer's REWARDS lists
(function, weight) pairs and sums the weighted values.
"""
import dataclasses
import json
import math
import numbers
import os
import random
import sys
import re
import threading
from collections.abc import Callable

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

TOOL_CLOSE = "</tool>"  # how a tool call ends; features/tools.py uses the same (a test checks)

# One <think> block, then one <answer> block, nothing else around them (the EOS is stripped by
# decoding). Tags may not nest or repeat: a model that learns to emit "<answer>" twice gets 0.
FORMAT_RE = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def reward_format(completion: str, gold: str | None = None, question: str | None = None) -> float:
    """1.0 when the text is exactly <think>...</think> <answer>...</answer>, else 0.0."""
    text = completion.strip()
    if FORMAT_RE.fullmatch(text) is None or any(text.count(tag) != 1 for tag in TAGS):
        return 0.0
    return 1.0


def extract_answer(completion: str) -> str | None:
    """The content of the last <answer>...</answer>, else the last number in the text, else None."""
    answers = ANSWER_RE.findall(completion)
    if answers:
        return answers[-1].strip()
    found = NUMBER_RE.findall(completion)
    return found[-1] if found else None


def reward_correct(completion: str, gold: str, question: str | None = None) -> float:
    """1.0 when the extracted answer equals `gold` mathematically (math-verify), else 0.0."""
    answer = extract_answer(completion)
    if answer is None or not answer:
        return 0.0
    return 1.0 if same_value(answer, gold) else 0.0


# How math-verify reads a LaTeX answer whole: as math mode, then as a plain expression. Bare,
# it would take the first number it finds (3\sqrt{2} read as 3).
LATEX = (LatexExtractionConfig(), ExprExtractionConfig())


def math_timeout() -> int | None:
    """Seconds math-verify may spend on one parse: it bounds its sympy work with signal.alarm,
    which only the main thread may set; elsewhere (a server worker, say) it runs without one
    rather than crash."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def same_value(answer: str, gold: str, *, latex: bool = False) -> bool:
    """Whether `answer` and `gold` are the same value to math-verify; latex: both are LaTeX
    (geometry3k's 3\\sqrt{2}, \\frac{40}{3}), each read whole in $...$."""
    timeout = math_timeout()
    config = {}  # plain: math-verify's default extraction
    if latex:
        answer = f"${answer}$"
        gold = f"${gold}$"
        config = {"extraction_config": LATEX}
    try:
        gold_parsed = parse(gold, parsing_timeout=timeout, **config)
        answer_parsed = parse(answer, parsing_timeout=timeout, **config)
        return bool(verify(gold_parsed, answer_parsed, timeout_seconds=timeout))
    except Exception:  # sympy can raise on adversarial strings; a wrong answer, not a crash
        return False


def boxed_answer(completion: str) -> str | None:
    """The content of the last \\boxed{...} (braces inside it balanced), else None."""
    start = completion.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed{"), len(completion)):
        if completion[i] == "{":
            depth += 1
        elif completion[i] == "}" and depth == 0:
            return completion[start + len("\\boxed{") : i].strip()
        elif completion[i] == "}":
            depth -= 1
    return None


def reward_boxed(completion: str, gold: str, question: str | None = None) -> float:
    """EasyR1's accuracy on geometry3k: 1.0 when the last \\boxed{...} after the thinking
    (after_thinking) states `gold`, both read whole as LaTeX (3\\sqrt{2} is not 3), else 0.0. A box
    that holds an equation states its first value (\\boxed{x = 7} states 7) and only if every other
    side agrees with it: exactly, or as its decimal to the digits written (\\boxed{3\\sqrt{2} =
    4.24} states 3\\sqrt{2}); a false one (\\boxed{5 = 7}) states nothing. A box that ends in an
    operator (\\boxed{5+}), holds another relation (<, \\le, \\ne, \\to, :, \\pm...) or an
    empty side (\\boxed{= 5}) states nothing: math-verify would read each as 5."""
    answer = boxed_answer(after_thinking(completion))
    if not answer or answer.endswith(DANGLING) or OTHER_RELATION.search(answer):
        return 0.0
    sides = equation_sides(answer)
    if not all(sides):  # "= 5", "5 \\approx": a side with nothing on it
        return 0.0
    values = [side for side in sides if not is_label(side)]
    if not values or not same_value(values[0], gold, latex=True):
        return 0.0
    agree = all(agrees(side, values[0]) for side in values[1:])
    return 1.0 if agree else 0.0


DANGLING = ("+", "-", "*", "/", "^", "=", ",", "\\times", "\\cdot", "\\div")  # nothing after
# A relation other than = and \approx (an inequality, a limit, a ratio, plus-minus): no one value
OTHER_RELATION = re.compile(
    r"[<>:]|\\(?:leq|geq|neq|le|ge|ne|lt|gt|to|rightarrow|sim|pm|mp)(?![a-zA-Z])")


def after_thinking(completion: str) -> str:
    """What the completion says after its thinking, as the format rule reads it: the text after the
    last </think>; none while a <think> is still open; the whole text when it never thinks."""
    if "</think>" in completion:
        return completion.rsplit("</think>", 1)[1]
    if "<think>" in completion:
        return ""
    return completion


def equation_sides(answer: str) -> list:
    """The sides of a boxed equation, split at = or \\approx outside braces; one for a value."""
    sides, depth, start = [], 0, 0
    for match in re.finditer(r"[{}]|=|\\approx", answer):
        if match.group() == "{":
            depth += 1
        elif match.group() == "}":
            depth -= 1
        elif depth == 0:
            sides.append(answer[start : match.start()].strip())
            start = match.end()
    return sides + [answer[start:].strip()]


def is_label(side: str) -> bool:
    """Whether a side names what the value is (x, AB, m \\angle ABC) rather than stating one: no
    digit and no constant in it."""
    return not re.search(r"\d|\\pi|\\infty|\\circ", side)


def agrees(side: str, value: str) -> bool:
    """Whether `side` is `value` (both LaTeX), exactly or as its decimal to the digits written:
    |side - value| at most half a unit of its last digit."""
    if same_value(side, value, latex=True):
        return True
    decimal = re.fullmatch(r"-?\d+\.(\d+)", side)
    exact = numeric_value(value)
    if decimal is None or exact is None:
        return False
    return abs(float(side) - exact) <= 0.5 * 10 ** -len(decimal.group(1)) + 1e-12


def numeric_value(latex: str) -> float | None:
    """The value of a LaTeX expression as a float (math-verify, then sympy), or None."""
    try:
        parsed = parse(f"${latex}$", extraction_config=LATEX, parsing_timeout=math_timeout())
        return float(parsed[0].evalf()) if parsed else None
    except Exception:  # not a number (a set, an interval, a symbol): no decimal to agree with
        return None


BOXED_FORMAT_RE = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def reward_think_boxed(completion: str, gold: str | None = None, question=None) -> float:
    """EasyR1's format rule: 1.0 for <think>...</think> and then a \\boxed{...} answer, else 0.0."""
    return 1.0 if BOXED_FORMAT_RE.fullmatch(completion.strip()) else 0.0


def reward_word(completion: str, gold: str, question: str | None = None) -> float:
    """1.0 when the <answer> holds exactly the gold word (case and a final full stop aside): the
    shapes task's colours, which math-verify does not read."""
    answers = ANSWER_RE.findall(completion)
    if not answers:
        return 0.0
    return 1.0 if answers[-1].strip().rstrip(".").lower() == gold.strip().lower() else 0.0


def reward_tool_cost(completion: str, gold=None, question=None) -> float:
    """-1.0 per tool call (each </tool> the model wrote): with a small weight, a call costs a
    little, so that the model learns to call only where the tool makes it right (TOOLS,
    features/tools.py)."""
    return -float(completion.count(TOOL_CLOSE))


# The rewards that are above 0 exactly when a completion is right: what pass rates, the learnability
# sampler and pass@k count as solved (a task's own correctness reward, the first of REWARDS).
CORRECTNESS = ("reward_correct", "reward_boxed", "reward_word")


def correctness_reward(names) -> str | None:
    """The first of the reward names `names` that says whether a completion is right (CORRECTNESS),
    or None: a task scored by format or cost alone has no notion of solved."""
    return next((name for name in names if name in CORRECTNESS), None)


def checked_reward(fn, completion: str, gold: str, question: str) -> float:
    """fn(completion, gold, question) as a float; a reward that raises or gives no finite number
    stops the run, naming the function and the completion: nothing is silently turned into 0."""
    try:
        value = fn(completion, gold, question)
    except Exception as e:
        sys.exit(f"reward {fn.__name__} raised {e!r} on the completion {completion!r}")
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # numpy floats are fine
        sys.exit(f"reward {fn.__name__} returned {value!r}, not a finite number, "
                 f"on the completion {completion!r}")
    return float(value)


def score(reward_fns, texts, golds, questions):
    """(each completion's weighted sum of the rewards, {name: each one's value}) of N completions;
    reward_fns: [(f, weight)] (the trainer's REWARDS). A reward that fails stops the run, named
    (checked_reward)."""
    if not len(texts) == len(golds) == len(questions):  # zip would quietly score only a part
        raise ValueError(f"{len(texts)} completions for {len(golds)} gold answers "
                         f"and {len(questions)} questions")
    each = {}  # reward name -> each completion's value
    for fn, _ in reward_fns:
        each[fn.__name__] = [checked_reward(fn, text, gold, question)
                             for text, gold, question in zip(texts, golds, questions)]
    return [sum(w * each[fn.__name__][i] for fn, w in reward_fns) for i in range(len(texts))], each


def extract_gsm8k_answer(solution: str) -> str:
    """GSM8K's gold answer: the text after '####', commas removed ('1,000' -> '1000')."""
    if "####" not in solution:
        raise ValueError(f"not a GSM8K solution (no '####'): {solution[:80]!r}")
    return solution.split("####")[-1].strip().replace(",", "")


# ----------------------------------------------------------------------------- questions
NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Finn", "Grace", "Hugo", "Iris", "Jack", "Lena",
         "Omar"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "shells"]
TEMPLATES = [
    "{n} has {a} {x}. {n} gets {b} more {x}. How many {x} does {n} have now?",
    "There are {a} {x} in a box and {b} {x} on the table. How many {x} are there in total?",
    "{n} collected {a} {x} on Monday and {b} {x} on Tuesday. How many {x} did {n} collect?",
    "What is {a} + {b}?",
]


# A dozen wordings the built-in task never uses: the same sums asked otherwise, to tell a policy
# that learned addition from one that learned the task's phrasing (reworded, bench/probe_wordings).
UNSEEN_TEMPLATES = [
    "Add {a} and {b}.",
    "Compute the sum of {a} and {b}.",
    "{a} plus {b} equals what?",
    "If you put {a} {x} together with {b} {x}, how many {x} is that?",
    "A shelf holds {a} {x}. Someone places {b} more on it. Count the {x} on the shelf.",
    "{n} owns {a} {x} and is handed another {b}. What is the total number of {x} {n} owns?",
    "Find the total: {a} {x} plus {b} {x}.",
    "How much is {b} added to {a}?",
    "The first jar has {a} {x}; the second has {b}. How many {x} are in both jars together?",
    "{n} walked {a} blocks, then {b} blocks more. How many blocks did {n} walk altogether?",
    "Sum {a} with {b}. What number do you get?",
    "What do you get when {a} is increased by {b}?",
]


def reworded(questions: list[dict], seed: int) -> list[dict]:
    """The built-in task's questions asked in UNSEEN_TEMPLATES, each its own sum (its last two
    numbers, checked against its gold) and gold, seeded: the held-out set in wordings training
    never saw; "wording" names each one's template (its index)."""
    rng = random.Random(seed)
    out = []
    for question in questions:
        a, b = (int(v) for v in re.findall(r"\d+", question["question"])[-2:])
        if a + b != int(question["gold"]):
            raise ValueError(f"not a sum of two numbers: {question['question']!r}")
        template = rng.randrange(len(UNSEEN_TEMPLATES))  # its index: "wording"
        text = UNSEEN_TEMPLATES[template].format(n=rng.choice(NAMES), x=rng.choice(ITEMS), a=a,
                                                 b=b)
        out.append({**question, "question": text, "wording": template})
    return out


LARGE = (100, 999)  # "arithmetic_mixed": operands this 135M model rarely adds right in its head


def make_arithmetic(n: int, max_operand: int, seed: int, mixed: bool = False) -> list[dict]:
    """`n` GSM8K-format addition word problems ({"question", "answer": "... #### N"}), seeded.
    mixed: half of them (at random) with LARGE operands, each question tagged "small" or "large"."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        large = mixed and rng.random() < 0.5
        low, high = LARGE if large else (1, max_operand)
        a, b = rng.randint(low, high), rng.randint(low, high)
        question = rng.choice(TEMPLATES).format(n=rng.choice(NAMES), x=rng.choice(ITEMS), a=a, b=b)
        tag = {}  # "arithmetic_mixed" tags each question with the size of its operands
        if mixed:
            tag = {"tag": "large" if large else "small"}
        out.append({"question": question, "answer": f"{a} + {b} = {a + b}\n#### {a + b}", **tag})
    return out


def load_questions(dataset: str, seed: int, arith_max: int = 20) -> list[dict]:
    """A list of {"question", "gold"} (and "tag" where the task has kinds of questions, "images"
    where it has images): "arithmetic" (operands 1..arith_max), "arithmetic_mixed" (half of them
    100..999), "shapes", a GSM8K-style .jsonl, a .jsonl of questions with images, or a hub id."""
    if dataset == "shapes" or is_geometry_shaped(dataset):
        return image_questions(dataset, seed)
    if dataset.endswith(".jsonl") and jsonl_has_images(dataset):
        return image_questions(dataset, seed)
    if dataset in ("arithmetic", "arithmetic_mixed"):
        rows = make_arithmetic(5000, arith_max, seed, mixed=dataset == "arithmetic_mixed")
    elif dataset.endswith(".jsonl"):
        rows = []
        with open(dataset) as f:
            for i, line in enumerate(f, 1):
                try:
                    if line.strip():
                        row = json.loads(line)
                        rows.append({"question": str(row["question"]),
                                     "answer": str(row["answer"])})
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{dataset}:{i}: need a JSON object with 'question' "
                                     f"and 'answer' ({e})")
    else:
        import datasets

        config = () if os.path.isdir(dataset) else ("main",)  # a local mirror: its own files
        rows = list(datasets.load_dataset(dataset, *config, split="train"))
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no questions")
    tags = [{"tag": r["tag"]} if "tag" in r else {} for r in rows]
    return [{"question": r["question"], "gold": extract_gsm8k_answer(r["answer"]), **tag}
            for r, tag in zip(rows, tags)]


# ------------------------------------------------------------------------- questions with images
IMAGE_HUB_DATASET = "hiyouga/geometry3k"  # EasyR1's: problem (with <image>), answer, images
IMAGE_MARK = "<image>"  # where a question's image stands in its text (features/vision.py's too)
IMAGE_FORMATS = ("PNG", "JPEG")  # the image files a .jsonl may name
MAX_IMAGE_FILE_BYTES = 16 * 2**20  # one image file's size
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
           "yellow": (235, 200, 20)}  # the shapes task's colours: chance is 1 / 4
SHAPES_SIZE = 64  # pixels on each side of a shapes image
SHAPES_QUESTIONS = 5000  # the shapes task's questions (pictures), held-out ones included
SHAPES_BIG_SIDES = (26, 34)  # the larger square's side in pixels, lowest and highest
SHAPES_SMALL_SIDES = (10, 16)  # the smaller square's side in pixels, lowest and highest
SHAPES_QUESTION = f"{IMAGE_MARK}What colour is the larger shape?"
CAPTION_QUESTION = f"{IMAGE_MARK}Which colours are in the image?"


@dataclasses.dataclass(frozen=True)
class ShapesLayout:
    """One shapes picture: two squares of different colours and sizes, each at a centre (x, y)."""
    big: str  # the larger square's colour: the gold
    small: str  # the smaller square's colour
    big_side: int  # pixels
    small_side: int  # pixels
    big_centre: tuple  # (x, y) in pixels
    small_centre: tuple  # (x, y) in pixels

    def positions_swapped(self) -> "ShapesLayout":
        """The same squares, each at the other's centre (the vision demo's position control)."""
        return dataclasses.replace(self, big_centre=self.small_centre,
                                   small_centre=self.big_centre)


def shapes_layout(rng: random.Random) -> ShapesLayout:
    """Two squares at random on a white square. Both centres are drawn alike, from where the
    largest square fits, and a coin then says which one holds the larger square: where a square
    sits says nothing about its size, so no position rule ("the one nearest the centre", "the one
    on the left") beats a coin, and either square fits at the other's centre."""
    big, small = rng.sample(sorted(COLOURS), 2)
    big_side = rng.randint(*SHAPES_BIG_SIDES)
    small_side = rng.randint(*SHAPES_SMALL_SIDES)
    low = SHAPES_BIG_SIDES[1] // 2  # a centre from which the largest square fits the picture
    high = SHAPES_SIZE - low
    apart = (big_side + small_side) // 2 + 2  # a white gap between the squares, either way round
    while True:
        first = (rng.randint(low, high), rng.randint(low, high))
        second = (rng.randint(low, high), rng.randint(low, high))
        if max(abs(first[0] - second[0]), abs(first[1] - second[1])) >= apart:
            break
    if rng.random() < 0.5:
        first, second = second, first
    return ShapesLayout(big, small, big_side, small_side, big_centre=first, small_centre=second)


def draw_shapes(layout: ShapesLayout) -> bytes:
    """PNG bytes of a layout: its two squares on white."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SHAPES_SIZE, SHAPES_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    squares = [(layout.big, layout.big_side, layout.big_centre),
               (layout.small, layout.small_side, layout.small_centre)]
    for colour, side, (x, y) in squares:
        left = x - side // 2
        top = y - side // 2
        draw.rectangle([left, top, left + side - 1, top + side - 1], fill=COLOURS[colour])
    return png_bytes(image)


def shapes_layouts(n: int, seed: int) -> list[ShapesLayout]:
    """The `n` seeded layouts of make_shapes(n, seed), in its order."""
    rng = random.Random(seed)
    return [shapes_layout(rng) for _ in range(n)]


def make_shapes(n: int, seed: int, captions: bool = False) -> list[dict]:
    """`n` seeded shapes questions: "What colour is the larger shape?" (gold: its colour), or with
    captions=True the caption pass's "Which colours are in the image?" (gold: both colours in a
    random order, so a caption never tells which shape is the larger)."""
    rows = []
    caption_order = random.Random(f"caption order {seed}")
    for layout in shapes_layouts(n, seed):
        data = draw_shapes(layout)
        if captions:
            pair = caption_order.sample([layout.big, layout.small], 2)
            rows.append({"question": CAPTION_QUESTION, "gold": f"{pair[0]} and {pair[1]}",
                         "images": [data]})
        else:
            rows.append({"question": SHAPES_QUESTION, "gold": layout.big, "images": [data]})
    return rows


def jsonl_has_images(path: str) -> bool:
    """Whether any row of a .jsonl carries "images", or names its question "problem" (a file of
    questions with images, some of its rows text ones: its first row may be one)."""
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError:
                return False  # read as GSM8K-style, whose loader names the line
            if isinstance(row, dict) and ("images" in row or "problem" in row):
                return True
    return False


def is_geometry_shaped(dataset: str) -> bool:
    """Whether DATASET names questions with images in geometry3k's shape (problem, answer,
    images): the hub's, a local .parquet of it, or a local mirror of the hub's folder (its .parquet
    files)."""
    if dataset == IMAGE_HUB_DATASET:
        return True
    files = [dataset] if dataset.endswith(".parquet") else []
    if os.path.isdir(dataset):
        files = sorted(os.path.join(root, name) for root, _, names in os.walk(dataset)
                       for name in names if name.endswith(".parquet"))
    if not files:
        return False
    import pyarrow.parquet

    return "images" in pyarrow.parquet.read_schema(files[0]).names


def geometry_questions(dataset: str) -> list[dict]:
    """geometry3k-shaped questions from the hub, a .parquet or a mirror folder: its train split,
    and its test split marked {"split": "test"} (the held-out questions, split_held_out)."""
    import datasets

    if dataset.endswith(".parquet"):
        splits = {"train": datasets.load_dataset("parquet", data_files=dataset, split="train")}
    else:  # the hub id or a folder: every split it has (a folder's from its files' names)
        loaded = datasets.load_dataset(dataset)
        splits = {name: loaded[name] for name in ("train", "test") if name in loaded}
    rows = []
    for split, data in splits.items():
        for i, row in enumerate(data, 1):
            images = [image_bytes(image) for image in row["images"]]
            where = f"{dataset} {split} row {i}"
            question = marked(str(row["problem"]), len(images), where=where)
            held_out = {"split": "test"} if split == "test" else {}
            rows.append({"question": question, "gold": str(row["answer"]), "images": images,
                         **held_out})
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no questions")
    return rows


def image_bytes(image) -> bytes:
    """An image of a dataset row as PNG or JPEG bytes: a decoded PIL image (the hub's Image
    feature) re-encoded as PNG, or the bytes a parquet file holds ({"bytes": ...}) as they are
    (features/vision.py checks them as the data loads)."""
    if isinstance(image, dict) and isinstance(image.get("bytes"), bytes):
        return image["bytes"]
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    return png_bytes(image)


def image_questions(dataset: str, seed: int) -> list[dict]:
    """Questions with images as {"question", "gold", "images": [PNG/JPEG bytes]}: "shapes", the
    hub's geometry3k, or a .jsonl of {"problem" (or "question"), "answer", "images": [file names
    beside the .jsonl]} (a row without images is a text question: a step may mix both). Every
    image is checked (format, pixels) as it loads."""
    if dataset == "shapes":
        return make_shapes(SHAPES_QUESTIONS, seed)
    if is_geometry_shaped(dataset):
        return geometry_questions(dataset)
    rows = []
    folder = os.path.dirname(os.path.abspath(dataset))
    with open(dataset) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question = str(row["problem"] if "problem" in row else row["question"])
                names = row.get("images") or []  # none or []: a text question among them
                images = [read_image(os.path.join(folder, name)) for name in names]
                question = marked(question, len(images), where=f"{dataset}:{i}")
                shown = {"images": images} if images else {}
                rows.append({"question": question, "gold": str(row["answer"]), **shown})
            except (json.JSONDecodeError, KeyError, TypeError, OSError, ValueError) as e:
                raise ValueError(f"{dataset}:{i}: need a JSON object with 'problem' (or "
                                 f"'question'), 'answer' and 'images' (files beside it): {e}")
    if not rows:
        raise ValueError(f"dataset {dataset!r} has no questions")
    return rows


def marked(question: str, n_images: int, *, where: str) -> str:
    """The question with one IMAGE_MARK per image, where the processor puts each image's tokens.
    A question without marks gets them in front (as TRL places a row's images before its text);
    a question whose marks do not count its images is refused here, at load, not at a processor's
    error mid-run."""
    marks = question.count(IMAGE_MARK)
    if marks == 0:
        return IMAGE_MARK * n_images + question
    if marks != n_images:
        raise ValueError(f"{where}: {marks} {IMAGE_MARK} marks in the question but {n_images} "
                         "images: one mark per image, in order (or none: all images first)")
    return question


def read_image(path: str) -> bytes:
    """An image file's bytes: a PNG or JPEG (its header read) of at most MAX_IMAGE_FILE_BYTES.
    Its pixels are counted and decoded where the prompt is built (features/vision.open_image)."""
    from PIL import Image

    if os.path.getsize(path) > MAX_IMAGE_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_IMAGE_FILE_BYTES} bytes")
    with Image.open(path) as image:  # the header only; a file that is no image fails here
        if image.format not in IMAGE_FORMATS:
            raise ValueError(f"{path}: {image.format}, not one of {IMAGE_FORMATS}")
    with open(path, "rb") as f:
        return f.read()


def png_bytes(image) -> bytes:
    """PNG bytes of a PIL image (the hub's images arrive decoded; the shapes task draws them)."""
    import io

    buffer = io.BytesIO()
    image.convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


@dataclasses.dataclass(frozen=True)
class Task:
    """A run's task as main's set-up hands it to the steps (grpo_ref_split.choose_task). The default
    is DATASET's questions scored by REWARDS, through the lesson's own functions (named below);
    environments.py's mix of tasks is another task, handed in the same way."""
    load: Callable  # () -> (training questions, held-out questions): load_dataset
    sampler: Callable  # (questions, seed) -> the draw's state, kept in checkpoints: QuestionSampler
    draw: Callable  # 1. (sampler, n) -> n training questions: draw_questions
    prompt: Callable  # 2. (tokenizer, question) -> the prompt's text: question_prompt
    score: Callable  # 3. (texts, asked, played=None) -> (scores, {name: values}): score_completions
    rewards: tuple  # 3. (name, weight) of each reward score gives: the log's and GDPO's columns
    answer_held_out: Callable | None = None  # log: how held-out questions are answered; greedily


def split_held_out(questions: list[dict], n: int) -> tuple[list[dict], list[dict]]:
    """(train, held_out): the last n questions (of the dataset's test split where it has one,
    {"split": "test"}), and the rest minus any the same (question_key)."""
    tested = [q for q in questions if q.get("split") == "test"]
    if tested:  # the dataset's own test split: held out, never trained on
        questions = [q for q in questions if q.get("split") != "test"]
        if n < 1 or not questions:
            raise ValueError(f"EVAL_SIZE={n}, {len(questions)} training questions beside a test "
                             "split: need EVAL_SIZE >= 1 and a training split")
        held_out = [{k: v for k, v in q.items() if k != "split"} for q in tested[-n:]]
        seen = {question_key(q) for q in held_out}
        return [q for q in questions if question_key(q) not in seen], held_out
    if not 0 < n < len(questions):
        raise ValueError(f"EVAL_SIZE={n}: need 1..{len(questions) - 1} held-out questions "
                         f"out of {len(questions)}")
    held_out = questions[-n:]
    seen = {question_key(q) for q in held_out}
    return [q for q in questions[:-n] if question_key(q) not in seen], held_out


def question_key(question: dict) -> tuple:
    """What makes two questions the same: their text, and their images where they have any."""
    return question["question"], tuple(question.get("images") or ())
