"""`training.model`: a local folder of a saved model, or a hub name; told apart without torch.

The trainer checks it before anything distributed starts, and `jobgen validate` on the login node.
"""

from __future__ import annotations

import os
import re

from jobgen.errors import UserError

HUB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def check_model_reference(model: str) -> None:
    """Before anything distributed: a local path must exist and look like a saved model."""
    if os.path.isdir(model):
        if not os.path.exists(os.path.join(model, "config.json")):
            raise UserError(f"training.model: {model!r} is a directory without config.json; expected a saved model")
        return
    if os.path.exists(model):
        raise UserError(f"training.model: {model!r} is a file; expected a model directory or a hub name")
    if not HUB_NAME.match(model) or os.path.isdir(model.split("/")[0]):
        raise UserError(f"training.model: path {model!r} does not exist (and it is not a hub name like org/name)")
