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
        _check_readable(model)
        return
    if os.path.exists(model):
        raise UserError(f"training.model: {model!r} is a file; expected a model directory or a hub name")
    if not HUB_NAME.match(model) or os.path.isdir(model.split("/")[0]):
        raise UserError(f"training.model: path {model!r} does not exist (and it is not a hub name like org/name)")


def _check_readable(model: str) -> None:
    """Every file of a saved model must be readable by the user the job runs as: transformers
    reports an unreadable weights file as missing."""
    try:
        names = sorted(os.listdir(model))
    except OSError as exc:
        raise UserError(f"training.model: cannot list {model!r} as user {_user()}: {exc.strerror}; give that user read and search access to it") from None
    for name in names:
        path = os.path.join(model, name)
        if os.path.isfile(path) and not os.access(path, os.R_OK):
            info = os.stat(path)
            raise UserError(
                f"training.model: {path!r} is not readable by user {_user()} (owner {_user(info.st_uid)}, mode {info.st_mode & 0o777:04o}): "
                f"give that user read access, e.g. chmod a+r {path}"
            )


def _user(uid: int | None = None) -> str:
    import pwd

    uid = os.getuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)
