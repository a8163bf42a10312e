"""Container logs for the API emulator (``pods/{name}/log``): what the kubelet would stream, from text
a test or the kubelet stand-in wrote — ``tailLines`` and ``limitBytes`` applied as the kubelet does
(the last lines, then the first ``limitBytes`` of them), ``previous`` for the container before its
last restart, 400 for a container with no such log."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp.web

LogKey = tuple[str | None, str, str, bool]  # namespace, pod, container, previous


@dataclass
class PodLogs:
    texts: dict[LogKey, str] = field(default_factory=dict)  # a test's own
    directory: Path | None = None  # the kubelet stand-in's: <directory>/pods/<pod>/container.log

    def text(self, key: LogKey) -> str | None:
        if key in self.texts:
            return self.texts[key]
        _, pod, _, previous = key
        path = self.directory / "pods" / pod / "container.log" if self.directory else None
        return path.read_text(errors="replace") if path is not None and not previous and path.exists() else None

    def respond(self, namespace: str | None, pod: str, params: Any) -> aiohttp.web.Response:
        container, previous = params.get("container", ""), params.get("previous") in ("true", "1")
        text = self.text((namespace, pod, container, previous))
        if text is None:
            which = "previous terminated container" if previous else "container"
            return aiohttp.web.json_response({"kind": "Status", "status": "Failure", "code": 400, "reason":
                                              "BadRequest", "message": f"{which} {container!r} in pod {pod!r} "
                                              "not found"}, status=400)
        if "tailLines" in params:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(params["tailLines"]):]) if int(params["tailLines"]) else ""
        if "limitBytes" in params:
            text = text.encode()[:int(params["limitBytes"])].decode(errors="replace")
        return aiohttp.web.Response(text=text, content_type="text/plain")
