"""A stand-in for the Hugging Face Hub, since the real one is unreachable from the tests: a local
HTTP server (HF_ENDPOINT points at it) speaking the part of the hub's API that jobgen asks, and
answering as the hub does, as huggingface_hub.utils._http.hf_raise_for_status reads it:

    GET /api/models/ORG/NAME/revision/REV     200 model info ({"id", "sha", "siblings"}); a model it
                                               does not have: 401 with X-Error-Code RepoNotFound (the
                                               hub's answer without a token); a revision it does not
                                               have: 404 with X-Error-Code RevisionNotFound
    GET /ORG/NAME/resolve/REV/config.json      the config, with X-Repo-Commit; 404 EntryNotFound
    GET /api/models?author=ORG | ?search=TEXT  [{"id", "modelId"}] of the matching models
    HEAD of any file                           404 EntryNotFound (its files come from the cache)
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class HubStandIn:
    """`models`: name -> its config.json; each has one branch, main, at COMMIT. `requests` records
    each path asked, so a test can tell the hub was asked."""

    def __init__(self, models: dict[str, dict]) -> None:
        self.models = models
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "HubStandIn":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                hub.requests.append(self.path)
                url = urllib.parse.urlsplit(self.path)
                parts = [urllib.parse.unquote(part) for part in url.path.strip("/").split("/")]
                if parts[:2] == ["api", "models"] and len(parts) == 2:
                    query = urllib.parse.parse_qs(url.query)
                    author, search = query.get("author", [""])[0], query.get("search", [""])[0].lower()
                    found = [name for name in hub.models
                             if (author and name.split("/")[0] == author) or (search and search in name.lower())]
                    return self._json(200, [{"id": name, "modelId": name} for name in found])
                if parts[:2] == ["api", "models"] and len(parts) == 6 and parts[4] == "revision":
                    name, revision = "/".join(parts[2:4]), parts[5]
                    if name not in hub.models:
                        return self._refuse(401, "RepoNotFound", "Repository not found")
                    if revision not in ("main", COMMIT):
                        return self._refuse(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    return self._json(200, {"id": name, "modelId": name, "sha": COMMIT,
                                            "siblings": [{"rfilename": "config.json"}]})
                if len(parts) == 5 and parts[2] == "resolve" and parts[4] == "config.json":
                    name = "/".join(parts[:2])
                    if name in hub.models and parts[3] in ("main", COMMIT):
                        return self._json(200, hub.models[name], {"X-Repo-Commit": COMMIT})
                    return self._refuse(404, "EntryNotFound", "Entry not found")
                self._refuse(404, "", "Not found")

            def do_HEAD(self) -> None:  # noqa: N802: a file's metadata; this stand-in serves no files but config.json
                hub.requests.append("HEAD " + self.path)
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("X-Error-Message", "Entry not found")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def _json(self, status: int, body: object, headers: dict | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def _refuse(self, status: int, code: str, message: str) -> None:
                data = json.dumps({"error": message}).encode()
                self.send_response(status)
                if code:
                    self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:  # quiet: the test reads `requests`
                pass

        return Handler
