"""mlx-vlm's own processing modules, run on the handler side without MLX.

Where only mlx-vlm has a family's processor (numpy and PIL over a transformers class), the
handler runs that module as it is: loaded from its file, never through the ``mlx_vlm``
package (whose ``__init__`` imports MLX), under a private package name whose ``..base`` is a
stand-in holding the helpers such modules take from mlx-vlm's (MLX-bound) ``models.base``:
`load_chat_template`, as mlx-vlm's, `install_auto_processor_patch`, a no-op here (the handler
names its processor class itself), and `to_mlx`, which makes numpy arrays here. A module
importing anything else from mlx-vlm fails to load, with the ImportError saying what.

Such a module may patch the transformers class it builds on (mlx-vlm's do, at import, as
they do wherever mlx-vlm loads that model: the engine's import of the model does the same).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

PACKAGE = "servicer._mlx_vlm_processing"


def load_chat_template(tokenizer: Any, model_path: Any) -> Any:
    """The checkpoint's chat_template.json or chat_template.jinja on `tokenizer`, as
    mlx-vlm's `models.base.load_chat_template` does."""
    model_dir = Path(model_path)
    as_json, as_jinja = model_dir / "chat_template.json", model_dir / "chat_template.jinja"
    if as_json.exists():
        tokenizer.chat_template = json.loads(as_json.read_text())["chat_template"]
    elif as_jinja.exists():
        tokenizer.chat_template = as_jinja.read_text()
    return tokenizer


def to_mlx(data: dict[str, Any]) -> dict[str, Any]:
    """mlx-vlm's conversion of a processor's outputs to MLX arrays: numpy arrays here."""
    import numpy as np

    return {k: np.asarray(v) if isinstance(v, list) else v for k, v in data.items()}


def install_auto_processor_patch(*_: Any, **__: Any) -> None:
    """mlx-vlm's hook into transformers' AutoProcessor: not wanted on the handler side."""


def _package(name: str, path: Path | None) -> types.ModuleType:
    module = sys.modules.get(name)
    if module is None:
        module = types.ModuleType(name)
        module.__path__ = [str(path)] if path is not None else []
        sys.modules[name] = module
    return module


def mlx_vlm_module(name: str) -> types.ModuleType:
    """mlx-vlm's module `name` (e.g. "mlx_vlm.models.X.processing_X"), loaded once from its
    file without the mlx_vlm package, its ``..base`` the stand-in above."""
    parts = name.split(".")
    if parts[:2] != ["mlx_vlm", "models"] or len(parts) != 4:
        raise ImportError(f"{name!r} is not a module of an mlx-vlm model (mlx_vlm.models.X.Y)")
    private = f"{PACKAGE}.{parts[2]}.{parts[3]}"
    if private in sys.modules:
        return sys.modules[private]
    found = importlib.util.find_spec("mlx_vlm")  # the package's location, not run
    if found is None or not found.submodule_search_locations:
        raise ImportError("mlx-vlm is not installed")
    models = Path(next(iter(found.submodule_search_locations))) / "models"
    _package(PACKAGE, models)
    base = _package(f"{PACKAGE}.base", None)
    base.load_chat_template = load_chat_template
    base.install_auto_processor_patch = install_auto_processor_patch
    base.to_mlx = to_mlx
    _package(f"{PACKAGE}.{parts[2]}", models / parts[2])
    spec = importlib.util.spec_from_file_location(private, models / parts[2] / f"{parts[3]}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no file for {name}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[private] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[private]
        raise
    return module
