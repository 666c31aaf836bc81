"""Constants from the environment: any UPPER_CASE constant of a file, overridden by a variable of the same name.

    ALL_STEPS=2 deepspeed --num_gpus 1 grpo_ref_split.py       # grpo_ref_split.py and ref_server.py call it
"""
import difflib
import json
import os
import sys

TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")  # what a boolean constant accepts


def apply_env_overrides(namespace: dict, file: str) -> None:
    """Replace each UPPER_CASE constant in `namespace` by the environment variable of the same name,
    cast to the constant's type; print what changed, and warn about names that look misspelt."""
    loud = os.environ.get("RANK", "0") == "0"  # under deepspeed every rank would print the same lines
    constants = [n for n in namespace if n.isupper()]
    for name in constants:
        if name not in os.environ:
            continue
        default, raw = namespace[name], os.environ[name]
        try:
            json.dumps(default)
        except TypeError:  # REWARDS holds functions: not a thing an environment variable can say
            sys.exit(f"environment variable {name}: {name} cannot be set from the environment; edit it in {file}")
        try:
            if isinstance(default, bool):  # before int: bool is an int subclass
                if raw.lower() not in TRUE + FALSE:
                    raise ValueError("expected 1/0/true/false")
                value = raw.lower() in TRUE
            elif isinstance(default, (tuple, list)):  # JSON: EXAMPLE='["Q?", "A"]' or 'null'
                value = json.loads(raw)
                value = None if value is None else type(default)(value)
            else:
                value = type(default)(raw)
        except (ValueError, TypeError) as e:
            sys.exit(f"environment variable {name}={raw!r}: not a valid {type(default).__name__} ({e})")
        namespace[name] = value
        if loud and value != default:
            print(f"[{file}] {name} = {value!r} (environment; default {default!r})", file=sys.stderr, flush=True)
    for name in os.environ:  # ALL_STEP=5 would otherwise be ignored without a word
        near = difflib.get_close_matches(name, constants, n=1, cutoff=0.85) if name.isupper() else []
        if loud and near and name not in namespace:
            print(f"[{file}] WARNING: environment variable {name} is not a constant of {file}; did you mean "
                  f"{near[0]}? It is ignored.", file=sys.stderr, flush=True)
