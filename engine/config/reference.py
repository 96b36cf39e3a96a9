"""The configuration reference, written from the models themselves: every section of ``TrellisConfig``
with each field's type, default, bounds and description, each section's own checks, and the
cross-field rules of ``engine.config.rules`` with the messages they raise. The docs site calls
``config_reference()`` when it is built (``docs/hooks/generated_pages.py``), so the page cannot drift
from the code; ``reference_keys()`` lists every key, for the test that holds the page to it.
``python -m trellis.engine.config.reference`` prints the page."""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import AfterValidator, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from trellis.engine.config.base import _absolute_if_local, _no_masked_secrets, checked_runtime_env
from trellis.engine.config.rules import RULES
from trellis.engine.config.trellis import TrellisConfig

# The value types a field may be declared with, as the page names them (anchors of its last section).
VALUE_TYPES: dict[Callable[..., Any], tuple[str, str]] = {
    _absolute_if_local: ("path or URI", "#location"),
    _no_masked_secrets: ("storage options", "#storage-options"),
}
BOUNDS = {annotated_types.Gt: ">", annotated_types.Ge: "≥", annotated_types.Lt: "<", annotated_types.Le: "≤"}


def sections(root: type[BaseModel] = TrellisConfig) -> dict[type[BaseModel], list[str]]:
    """Every model under ``root`` with the keys it sits at, in the order a reader meets them."""
    found: dict[type[BaseModel], list[str]] = {root: [""]}
    queue: list[tuple[type[BaseModel], str]] = [(root, "")]
    while queue:
        model, prefix = queue.pop(0)
        for name, field in model.model_fields.items():
            for nested, suffix in _models_in(field.annotation):
                key = f"{prefix}{name}{suffix}"
                if nested not in found:
                    found[nested] = []
                    queue.append((nested, key + "."))
                found[nested].append(key)
    return found


def reference_keys(root: type[BaseModel] = TrellisConfig) -> list[str]:
    """Every key of the configuration, dotted (``tasks[].reward.timeout_s``): what the page must document."""
    keys = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            keys.append(prefix + name)
            for nested, suffix in _models_in(field.annotation):
                walk(nested, f"{prefix}{name}{suffix}.")

    walk(root, "")
    return keys


def _models_in(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The models a field holds, with ``[]`` for a list of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
        return
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (list, tuple):
        for nested, _ in _models_in(args[0]):
            yield nested, "[]"
    elif origin in (Union, types.UnionType):
        for arg in args:
            yield from _models_in(arg)


def anchor(model: type[BaseModel]) -> str:
    return model.__name__.lower()


def type_text(annotation: Any, metadata: list[Any] = ()) -> str:
    """A field's type as a reader writes it in YAML."""
    for item in metadata:
        if isinstance(item, AfterValidator) and item.func in VALUE_TYPES:
            name, link = VALUE_TYPES[item.func]
            return f"[{name}]({link})"
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return type_text(args[0], list(args[1:]))
    if origin is Literal:
        return "one of " + ", ".join(f"`{json.dumps(arg)}`" for arg in args)
    if origin in (Union, types.UnionType):
        present = [type_text(arg) for arg in args if arg is not type(None)]
        return " or ".join(present) + (" or `null`" if type(None) in args else "")
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return f"list of {type_text(args[0])}"
    if origin is tuple:
        return "[" + ", ".join(type_text(arg) for arg in args) + "]"
    if origin is dict:
        return "mapping" if args[1] is Any else f"mapping of {type_text(args[0])} to {type_text(args[1])}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{anchor(annotation)})"
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def default_text(field: FieldInfo) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "its defaults"
    if isinstance(value, tuple):
        value = list(value)
    text = json.dumps(value) if not isinstance(value, str) or "\n" in value else value
    return f"`{text}`"


def bounds_text(field: FieldInfo) -> str:
    """The field's own constraints: bounds and patterns (choices show in its type)."""
    found = []
    for item in field.metadata:
        for kind, sign in BOUNDS.items():
            if isinstance(item, kind):
                found.append(f"{sign} {getattr(item, sign_name(kind))}")
        if getattr(item, "pattern", None):
            found.append(f"matches `{item.pattern}`")
    return ", ".join(found)


def sign_name(kind: type) -> str:
    return kind.__name__.lower()


def cell(text: str) -> str:
    """One line of a table cell. A pipe ends the cell unless escaped, except inside a code span, where
    the table reads it as text (and an escape would show)."""
    parts = " ".join(text.split()).split("`")
    return "`".join(part if index % 2 else part.replace("|", "\\|") for index, part in enumerate(parts))


def model_section(model: type[BaseModel], keys: list[str]) -> list[str]:
    title = "Top level" if keys == [""] else ", ".join(f"`{key}`" for key in keys)
    lines = [f"## {title} {{#{anchor(model)}}}", "", f"`{model.__module__}.{model.__name__}`", ""]
    if model.__doc__ and model is not BaseModel:
        lines += [inspect.cleandoc(model.__doc__), ""]
    lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        kind = ", ".join(part for part in (type_text(field.annotation, field.metadata), bounds_text(field)) if part)
        row = [f"`{name}`", kind, default_text(field), describe(field)]
        lines.append("| " + " | ".join(cell(part) for part in row) + " |")
    checks = [check for check in section_checks(model) if check]
    if checks:
        lines += ["", "Checked on load:", ""] + [f"- {message}" for message in checks]
    return lines + [""]


def describe(field: FieldInfo) -> str:
    """The field's description; a section without one is described by its model's first sentence."""
    if field.description:
        return field.description
    for nested, _ in _models_in(field.annotation):
        if nested.__doc__:
            return inspect.cleandoc(nested.__doc__).split(". ")[0].rstrip(".") + "."
    return ""


def section_checks(model: type[BaseModel]) -> list[str]:
    """The messages of a section's own validators (the run-wide rules are listed apart)."""
    decorators = model.__pydantic_decorators__
    found = []
    for decorator in [*decorators.model_validators.values(), *decorators.field_validators.values()]:
        if decorator.func.__name__ != "_check_rules":
            found += messages(decorator.func)
    return found


def messages(function: Callable[..., Any], known: dict[str, str] | None = None) -> list[str]:
    """The problems a validator reports, read from its source in order: the strings it raises or
    appends. A placeholder shows as written (``{sync}``), or as its value where that is known (a
    module constant, an argument the caller passed as a literal); an expression shows as ``{…}``.
    Helpers it calls from this package (``checked_runtime_env``) are read too, with their arguments."""
    function = inspect.unwrap(getattr(function, "__func__", function))
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    known = {**_constants(function), **(known or {})}
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _reports(node):
            found += [(node.lineno, _message_text(node.args[0], known))]
        elif isinstance(node, ast.Return) and node.value is not None:
            found += [(node.lineno, _message_text(item, known)) for item in _listed(node.value)]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == checked_runtime_env.__name__:
            found += [(node.lineno, text) for text in messages(checked_runtime_env, _literal_arguments(checked_runtime_env, node))]
    return list(dict.fromkeys(text for _, text in sorted(found, key=lambda item: item[0]) if text))


def _constants(function: Callable[..., Any]) -> dict[str, str]:
    return {name: repr(value) for name, value in function.__globals__.items() if name.isupper() and isinstance(value, str)}


def _literal_arguments(helper: Callable[..., Any], call: ast.Call) -> dict[str, str]:
    names = list(inspect.signature(helper).parameters)
    return {names[i]: arg.value for i, arg in enumerate(call.args) if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}


def _reports(call: ast.Call) -> bool:
    callee = call.func
    return (isinstance(callee, ast.Name) and callee.id == "ValueError") or (isinstance(callee, ast.Attribute) and callee.attr == "append")


def _listed(value: ast.expr) -> list[ast.expr]:
    if isinstance(value, ast.List):
        return list(value.elts)
    if isinstance(value, ast.IfExp):
        return _listed(value.body) + _listed(value.orelse)
    return []


def _message_text(node: ast.expr, known: dict[str, str]) -> str:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if not isinstance(node, ast.JoinedStr):
        return ""
    return "".join(part.value if isinstance(part, ast.Constant) else _placeholder(part.value, known) for part in node.values)


def _placeholder(value: ast.expr, known: dict[str, str]) -> str:
    written = ast.unparse(value)
    if written in known:
        return known[written]
    simple = isinstance(value, ast.Name) or (isinstance(value, ast.Attribute) and isinstance(value.value, (ast.Name, ast.Attribute)))
    return "{" + (written if simple else "…") + "}"


def rules_section() -> list[str]:
    lines = [
        "## Rules across sections {#rules}",
        "",
        "Checked when a config is loaded, after each section's own checks (`engine/config/rules.py`). Every "
        "problem found is reported at once, one line each, and `trellis train` then exits with code 2 before "
        "anything starts. `{...}` stands for the value found.",
        "",
    ]
    for rule in RULES:
        lines += [f"### {rule.__name__.removesuffix('_problems').capitalize()} {{#rule-{rule.__name__}}}", ""]
        if rule.__doc__:
            lines += [inspect.cleandoc(rule.__doc__), ""]
        lines += [f"- {cell(message)}" for message in messages(rule)] + [""]
    return lines


def value_types_section() -> list[str]:
    return [
        "## Value types",
        "",
        "### Path or URI {#location}",
        "",
        inspect.cleandoc(_absolute_if_local.__doc__ or ""),
        "",
        "### Storage options {#storage-options}",
        "",
        "fsspec options (e.g. `{endpoint_url: \"http://minio:9000\"}`). Every JSON dump of the config masks the "
        "entries that look secret (Prefect flow-run parameters, checkpoints), and a masked value read back is refused:",
        "",
        *[f"- {cell(message)}" for message in messages(_no_masked_secrets)],
        "",
    ]


def config_reference() -> str:
    """The whole page, Markdown."""
    lines = [
        "---",
        "hide: [navigation]",  # the tables want the width
        "---",
        "",
        "# Configuration reference",
        "",
        "One frozen pydantic model, `trellis.engine.config.TrellisConfig`, read from YAML (`trellis train my.yaml "
        "--set optim.lr=1e-4`). Unknown keys are errors, with the nearest known key suggested. Field names follow "
        "XTuner v1's RL trainer where the field exists there. This page is generated from the models each time "
        "the site is built (`engine/config/reference.py`), so it lists every key there is.",
        "",
    ]
    for model, keys in sections().items():
        lines += model_section(model, keys)
    return "\n".join(lines + rules_section() + value_types_section())


if __name__ == "__main__":
    print(config_reference())
