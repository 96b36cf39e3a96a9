"""A user's own functions, named in a config as ``module:function`` (importable from the directory
the run is launched from) or ``path/to/file.py:function`` (relative to that directory).

Workers receive that directory as their working directory (``engine.run.code_bundle``), so the same
spec resolves the same way on the driver and in every worker.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from trellis.engine.errors import SettingError


class UserCodeError(SettingError):
    """A function named in the config cannot be used; the message says why, without a traceback."""


def split_spec(spec: str) -> tuple[str, str]:
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute or not attribute.isidentifier():
        raise UserCodeError(f"{spec!r} must look like 'package.module:function' or 'path/to/file.py:function'.")
    return target, attribute


def is_file_spec(target: str) -> bool:
    return target.endswith(".py")


def load_attribute(spec: str, base_dir: str | Path | None = None) -> tuple[Any, ModuleType]:
    """What ``spec`` names, and its module; ``base_dir`` (default: the current directory) is where
    relative file specs live and where modules are looked up first."""
    target, attribute = split_spec(spec)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    module = _load_file(spec, base / target) if is_file_spec(target) else _import_module(spec, target, base)
    value = getattr(module, attribute, None)
    if value is None:
        raise UserCodeError(f"{spec!r}: {module.__file__} defines no {attribute!r}.")
    return value, module


def load_function(spec: str, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """The callable ``spec`` names (see ``load_attribute``)."""
    function, module = load_attribute(spec, base_dir)
    attribute = split_spec(spec)[1]
    if not callable(function):
        raise UserCodeError(f"{spec!r}: {attribute!r} in {module.__file__} is a {type(function).__name__}, not a function.")
    return function


def check_takes_one_argument(spec: str, function: Callable[..., Any], what: str) -> None:
    """A reward function is called with one positional argument: refuse any other signature."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # a builtin without a signature: called as it is
    try:
        signature.bind({})
    except TypeError:
        raise UserCodeError(
            f"{spec!r} has the signature {function.__name__}{signature}; {what} takes exactly one argument."
        ) from None


def origin(spec: str, base_dir: str | Path | None = None) -> Path | None:
    """The file that defines ``spec``'s module (None for a built-in module), without importing it."""
    target, _ = split_spec(spec)
    base = Path(base_dir) if base_dir is not None else Path.cwd()
    if is_file_spec(target):
        return (base / target).resolve()
    with first_on_path(base):
        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            return None
    return Path(found.origin).resolve() if found is not None and found.origin not in (None, "built-in", "frozen") else None


def _import_module(spec: str, target: str, base: Path) -> ModuleType:
    with first_on_path(base):
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as error:
            if error.name is not None and (target == error.name or target.startswith(f"{error.name}.")):
                raise UserCodeError(
                    f"{spec!r}: no module {target!r} in {base} or the installed packages (is the run launched from the "
                    f"folder that holds it?){_renamed(target)}"
                ) from None
            raise UserCodeError(f"{spec!r}: importing {target!r} failed: {_short(error)}") from None
        except Exception as error:  # the user's module raised while it was imported
            raise UserCodeError(f"{spec!r}: importing {target!r} failed: {_short(error)}") from None


def _renamed(target: str) -> str:
    """A hint for a spec written before trellis's packages moved under ``trellis.``."""
    if target.split(".")[0] not in ("engine", "tasks", "flows", "deployments"):
        return "."
    try:
        found = importlib.util.find_spec(f"trellis.{target}")
    except ImportError:
        found = None
    return f"; trellis's own is 'trellis.{target}'." if found is not None else "."


def _load_file(spec: str, path: Path) -> ModuleType:
    path = path.resolve()
    if not path.is_file():
        raise UserCodeError(f"{spec!r}: {path} does not exist.")
    name = f"_trellis_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        with first_on_path(path.parent):
            module_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise UserCodeError(f"{spec!r}: loading {path} failed: {_short(error)}") from None
    return module


def _short(error: BaseException) -> str:
    """The exception and where in the user's code it was raised, in one line."""
    frames = traceback.extract_tb(error.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" (at {error.filename}:{error.lineno})"
    return f"{type(error).__name__}: {error}{where}"


class first_on_path:
    """``directory`` first on ``sys.path`` for the duration (and kept there if it was already)."""

    def __init__(self, directory: Path) -> None:
        self._directory = str(directory.resolve())
        self._added = False

    def __enter__(self) -> None:
        if self._directory not in sys.path:
            sys.path.insert(0, self._directory)
            self._added = True

    def __exit__(self, *exc: object) -> None:
        if self._added and self._directory in sys.path:
            sys.path.remove(self._directory)
