"""The Hugging Face Hub as this machine reaches it: one short request, never a minute of retries.

`ask_hub(model, revision)` makes the request huggingface_hub's `model_info` makes
(GET {HF_ENDPOINT}/api/models/ORG/NAME/revision/REVISION), then fetches the config.json of the
commit it names (GET {HF_ENDPOINT}/ORG/NAME/resolve/COMMIT/config.json), each with a timeout of
PROBE_SECONDS and no retry, with the standard library only (a login node may lack the train
extra, and huggingface_hub's own client retries a refused connection for 23 s, logging each try).
Its answers are read as huggingface_hub.utils.hf_raise_for_status reads them: the X-Error-Code
header (RepoNotFound, RevisionNotFound, GatedRepo), and a 401 from the repo API as not found (the
hub's answer, without a token, for a repo that is missing, private or gated).

The endpoint, the token and offline mode are huggingface_hub.constants': HF_ENDPOINT (a mirror),
HF_TOKEN else the token file (HF_TOKEN_PATH, else HF_HOME/token), HF_HUB_OFFLINE.
"""

from __future__ import annotations

import difflib
import json
import os
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Mapping, Optional

from jobgen.errors import UserError
from jobgen.job.hub_cache import DEFAULT_REVISION, OFFLINE_VARIABLES, CachedModel, hf_home

DEFAULT_ENDPOINT = "https://huggingface.co"
PROBE_SECONDS = 5.0  # a hub that answers does so in well under a second; a firewall that drops packets never does
LISTED_FOR_MATCH = 1000  # an organization's models compared for "did you mean"


@dataclass(frozen=True)
class HubAnswer:
    """What the hub said of a model at a revision. `unreachable`: why it could not be asked ('' when
    it answered); `error_code`: its X-Error-Code for a model it does not give (RepoNotFound,
    RevisionNotFound, GatedRepo); `commit` and `config` (its config.json) for one it gives."""

    endpoint: str
    model: str
    revision: str = DEFAULT_REVISION
    unreachable: str = ""
    error_code: str = ""
    commit: Optional[str] = None
    config: Optional[dict] = None
    offline: bool = False  # not asked: HF_HUB_OFFLINE (named in `unreachable`) switches the hub off here

    @property
    def found(self) -> bool:
        return not self.unreachable and not self.error_code


def check_downloadable(cached: CachedModel, fix: str, answer: Optional[HubAnswer] = None) -> HubAnswer:
    """Before a download of a model that `cached` (its look-up in the cache) lacks: UserError, one
    line, where the hub cannot be reached (`fix` says what to do instead) or has no such model.
    `answer`: the hub's, where the caller asked it already."""
    answer = answer or ask_hub(cached.model, cached.revision)
    if answer.unreachable:
        raise UserError(f"training.model: {cached.at()} is not in {cached.cache.path} ({cached.cache.chosen_by}) and "
                        f"{unreachable_words(answer)}: {fix}")
    refusal = hub_refusal(answer)
    if refusal:
        raise UserError(refusal)
    return answer


def unreachable_words(answer: HubAnswer) -> str:
    if answer.offline:
        return f"the hub is switched off here ({answer.unreachable})"
    return f"the hub ({answer.endpoint}) cannot be reached from here ({answer.unreachable})"


def hub_refusal(answer: HubAnswer) -> Optional[str]:
    """One line for a model the hub answered it does not give; None where it gave it, or could not be asked."""
    model, where = answer.model, f"the hub ({answer.endpoint})"
    if answer.unreachable or not answer.error_code:
        return None
    if answer.error_code == "RevisionNotFound":
        return (f"training.model_revision: {answer.revision!r} is not a branch, tag or commit of {model} on {where}; "
                f"give one of its branches (main), tags or commits")
    if answer.error_code == "GatedRepo":
        return (f"training.model: {model} is gated on {where} and the token here has no access: accept its terms "
                "on its page with your account, then give that account's token (HF_TOKEN, or `hf auth login`)")
    if answer.error_code == "RepoNotFound":
        match = close_match(model)
        hint = f" (did you mean {match!r}?)" if match else ""
        return (f"training.model: {model!r} is not a model on {where}{hint}; check its name, or, for a private model, "
                "give a token with access to it (HF_TOKEN, or `hf auth login`)")
    if answer.error_code == "InvalidCredentials":
        return (f"training.model: {where} refused the token here (HF_TOKEN, else the token file) as invalid; "
                "give a valid one (`hf auth login`), or unset it for a public model")
    return f"training.model: {where} answered {answer.error_code} for {model} at revision {answer.revision}"


def quiet_retries() -> None:
    """huggingface_hub logs each retry of a request (two dozen lines for a refused connection):
    on a command's terminal only its final error, which jobgen turns into one line, is kept."""
    import logging

    logging.getLogger("huggingface_hub.utils._http").setLevel(logging.ERROR)


def hub_endpoint(env: Mapping[str, str] = os.environ) -> str:
    return (env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def offline_value(env: Mapping[str, str] = os.environ) -> str:
    """HF_HUB_OFFLINE's (or TRANSFORMERS_OFFLINE's) value where it switches the hub off
    (huggingface_hub.constants' rule), else ''."""
    for name in OFFLINE_VARIABLES:
        value = env.get(name) or ""
        if value.upper() in {"1", "ON", "YES", "TRUE"}:
            return f"{name}={value}"
    return ""


def ask_hub(model: str, revision: str = DEFAULT_REVISION, env: Mapping[str, str] = os.environ,
            timeout: float = PROBE_SECONDS) -> HubAnswer:
    """What the hub at `env`'s endpoint says of `model` at `revision` (see the module docstring)."""
    endpoint = hub_endpoint(env)
    offline = offline_value(env)
    if offline:
        return HubAnswer(endpoint, model, revision, unreachable=offline, offline=True)
    token = _token(env)
    quoted = urllib.parse.quote(revision, safe="")
    status, headers, body = _get(f"{endpoint}/api/models/{model}/revision/{quoted}", token, timeout)
    if status is None:
        return HubAnswer(endpoint, model, revision, unreachable=body.decode())
    if status >= 500:
        return HubAnswer(endpoint, model, revision, unreachable=f"it answered HTTP {status}")
    code = headers.get("X-Error-Code") or ""
    if status == 401 and headers.get("X-Error-Message") == "Invalid credentials in Authorization header":
        code = "InvalidCredentials"
    elif status == 401 and not code:  # hf_raise_for_status takes a repo API's 401 for RepoNotFound
        code = "RepoNotFound"
    if status >= 400 and not code:  # the hub names its refusals: this is a proxy, or HF_ENDPOINT is not a hub
        return HubAnswer(endpoint, model, revision, unreachable=f"it answered HTTP {status} without the hub's X-Error-Code")
    if status >= 400:
        return HubAnswer(endpoint, model, revision, error_code=code or f"HTTP {status}")
    try:
        commit = json.loads(body).get("sha") or revision
    except (ValueError, AttributeError):
        return HubAnswer(endpoint, model, revision, unreachable=f"{endpoint} did not answer as the hub does (not JSON)")
    status, _, body = _get(f"{endpoint}/{model}/resolve/{urllib.parse.quote(commit, safe='')}/config.json", token, timeout)
    config = None
    if status == 200:
        try:
            config = json.loads(body)
        except ValueError:
            config = None
    return HubAnswer(endpoint, model, revision, commit=commit, config=config if isinstance(config, dict) else None)


def close_match(model: str, env: Mapping[str, str] = os.environ, timeout: float = PROBE_SECONDS) -> Optional[str]:
    """The hub model whose name is closest to `model`'s (a typo), among its organization's models
    and, failing that, those the hub's search finds by its name; None where there is none."""
    organization, name = model.split("/", 1)
    endpoint, token = hub_endpoint(env), _token(env)
    for query in ({"author": organization, "limit": LISTED_FOR_MATCH}, {"search": name, "limit": LISTED_FOR_MATCH}):
        status, _, body = _get(f"{endpoint}/api/models?{urllib.parse.urlencode(query)}", token, timeout)
        try:
            names = [entry.get("id") or entry.get("modelId") for entry in json.loads(body)] if status == 200 else []
        except (ValueError, AttributeError):
            names = []
        by_lower = {str(found).lower(): str(found) for found in names if found and found != model}
        match = difflib.get_close_matches(model.lower(), list(by_lower), n=1, cutoff=0.8)
        if match:
            return by_lower[match[0]]
    return None


def _get(url: str, token: Optional[str], timeout: float) -> tuple[Optional[int], Mapping[str, str], bytes]:
    """(status, headers, body); (None, {}, why) where the request got no answer."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.headers, b""
    except urllib.error.URLError as error:
        reason = error.reason
        why = reason.strerror if isinstance(reason, OSError) and reason.strerror else str(reason)
    except (socket.timeout, TimeoutError):
        why = f"no answer in {timeout:g} s"
    except (OSError, ValueError) as error:  # a reset connection, a malformed HF_ENDPOINT
        why = str(error) or type(error).__name__
    if why in ("timed out", "_ssl.c:989: The handshake operation timed out"):
        why = f"no answer in {timeout:g} s"
    return None, {}, why.encode()


def _token(env: Mapping[str, str]) -> Optional[str]:
    if env.get("HF_TOKEN"):
        return env["HF_TOKEN"]
    path = env.get("HF_TOKEN_PATH") or os.path.join(hf_home(env), "token")
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or None
    except OSError:
        return None
