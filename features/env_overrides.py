"""Constants from the environment: any UPPER_CASE constant of a file, overridden by a variable of
the same name. Each file with settings calls it once, under its constants: the trainer, the server
and each feature module (features/vllm_engine.py for USE_VLLM...).

    ALL_STEPS=2 USE_VLLM=1 deepspeed --num_gpus 1 grpo_ref_split.py
"""
import ast
import difflib
import inspect
import json
import os
import sys

TRUE = ("1", "true", "yes")  # what a boolean constant accepts as True
FALSE = ("0", "false", "no")  # and as False; anything else is refused


def apply_env_overrides(namespace: dict, file: str, functions=None) -> None:
    """Replace each UPPER_CASE constant in `namespace` by the environment variable of the same name,
    cast to the constant's type; print what changed, and warn about names that look misspelt.
    functions: {constant: module} for constants that hold functions or (function, weight) pairs; the
    environment names the module's functions in JSON: REWARDS='[["reward_correct", 2.0]]'
    TOOLS='["calculator"]'."""
    functions = functions or {}
    # under deepspeed every rank would print the same lines
    loud = os.environ.get("RANK", "0") == "0"
    constants = [n for n in namespace if n.isupper()]
    own = own_constants(namespace)
    imported = [n for n in constants if n not in own and n in os.environ]
    if imported:  # it would change this file's copy and not the module's: the two would differ
        sys.exit(
            f"environment variable {imported[0]}: {imported[0]} is not a setting of {file} (it is "
            "imported from another module there); edit it where it is defined"
        )
    constants = [n for n in constants if n in own]
    for name in constants:
        if name not in os.environ:
            continue
        default = namespace[name]
        raw = os.environ[name]
        try:
            json.dumps(default)
        except TypeError:  # holds functions, and is not a list of them by name
            if name not in functions:
                sys.exit(
                    f"environment variable {name}: {name} cannot be set from the environment; edit "
                    f"it in {file}"
                )
        try:
            if name in functions:
                value = [named_functions(x, functions[name]) for x in json.loads(raw)]
            elif isinstance(default, bool):  # before int: bool is an int subclass
                if raw.lower() not in TRUE + FALSE:
                    raise ValueError("expected 1/0/true/false")
                value = raw.lower() in TRUE
            elif isinstance(default, (tuple, list)):  # JSON: EXAMPLE='["Q?", "A"]' or 'null'
                value = json.loads(raw)
                value = None if value is None else type(default)(value)
            else:
                value = type(default)(raw)
        except (ValueError, TypeError) as e:
            sys.exit(
                f"environment variable {name}={raw!r}: not a valid {type(default).__name__} ({e})"
            )
        except KeyError as e:
            sys.exit(f"environment variable {name}={raw!r}: {e.args[0]}")
        namespace[name] = value
        if loud and value != default:
            print(
                f"[{file}] {name} = {named(value)} (environment; default {named(default)})",
                file=sys.stderr,
                flush=True,
            )
    for name in os.environ:  # ALL_STEP=5 would otherwise be ignored without a word
        near = (
            difflib.get_close_matches(name, constants, n=1, cutoff=0.85) if name.isupper() else []
        )
        if loud and near and name not in namespace:
            print(
                f"[{file}] WARNING: environment variable {name} is not a constant of {file}; did "
                f"you mean {near[0]}? It is ignored.",
                file=sys.stderr,
                flush=True,
            )


def own_constants(namespace: dict) -> set:
    """The UPPER_CASE names the module of `namespace` assigns itself at its top level (read from its
    source), not those it imports; every UPPER_CASE name when there is no source file (a plain
    dict)."""
    path = namespace.get("__file__")
    if not path or not os.path.exists(path):
        return {n for n in namespace if n.isupper()}
    with open(path) as f:
        tree = ast.parse(f.read())
    own = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            names = target.elts if isinstance(target, ast.Tuple) else [target]
            own |= {t.id for t in names if isinstance(t, ast.Name) and t.id.isupper()}
    return own


def check_choice(name: str, value, options) -> None:
    """Stop with a clear message when a constant that names one of a few options holds none of them:
    check_choice("LOSS_TYPE", LOSS_TYPE, ("grpo", "dapo", "dr_grpo"))."""
    if value not in options:
        sys.exit(f"{name} = {value!r}: one of {', '.join(map(repr, options))}")


def named_functions(x, module):
    """A JSON value with each function name replaced by the function of `module` it names; lists
    become tuples (a (function, weight) pair). KeyError, naming the choices, for a name that is not
    a function there."""
    if isinstance(x, list):
        return tuple(named_functions(v, module) for v in x)
    if isinstance(x, str):
        functions = {
            k: v
            for k, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not k.startswith("_")
        }
        if x not in functions:
            raise KeyError(
                f"{x!r} is not a function of {module.__name__} (it has: "
                f"{', '.join(sorted(functions))})"
            )
        return functions[x]
    return x


def named(value) -> str:
    """repr of a constant's value, with each function written as its name: [(reward_correct,
    2.0)]."""
    if callable(value):
        return value.__name__
    if isinstance(value, (list, tuple)):
        inner = ", ".join(named(v) for v in value)
        return (
            f"[{inner}]"
            if isinstance(value, list)
            else f"({inner}{',' if len(value) == 1 else ''})"
        )
    return repr(value)
