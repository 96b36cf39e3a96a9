"""trellis: ``trellis.engine``, ``trellis.tasks``, ``trellis.flows`` and ``trellis.deployments``.

The four packages keep their folders at the repository's top level; ``pyproject.toml`` maps them under
this name, so an installed trellis (editable or a wheel) never claims the bare names a user's project
may use for its own packages (a folder called ``tasks/`` is common).
"""

from pathlib import Path

# Run from a checkout without installing (PYTHONPATH=<checkout>, as the GPU benches are), the packages
# are the folders beside this one; an installed wheel has them inside it and needs nothing more.
_checkout = Path(__file__).resolve().parents[1]
if not (Path(__file__).parent / "engine").is_dir() and (_checkout / "engine" / "__init__.py").is_file():
    __path__.append(str(_checkout))
