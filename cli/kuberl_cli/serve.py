"""``kuberl serve FILE``: the Tinker-compatible training API (``kuberl.tinker``) for the model of a manifest,
on this machine, so a researcher runs a Tinker cookbook loop against it with the real ``tinker`` SDK.

Each client gets its own API key: from ``--keys PATH`` (a JSON file, client name → key, or a directory of
one file per client, as a Kubernetes Secret is mounted; each key ``tml-`` and at least 32 characters, as the
SDK checks), or made here, one per ``--clients`` name, each written to
``<dir>/<client>.key`` (mode 0600) — never printed. The server listens on 127.0.0.1 unless ``--host``
says otherwise.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
from pathlib import Path

KEY_PREFIX = "tml-"  # the SDK refuses a key without it
MIN_KEY_CHARS = 32


class ServeError(ValueError):
    pass


def read_keys(path: Path) -> dict[str, str]:
    """The clients' keys as key → client, from ``path``: a JSON object (client → key), or a directory with a
    file per client holding its key — a Kubernetes Secret mounted as a volume (its ``..data`` links and other
    dot-files are not clients). ServeError naming the client otherwise."""
    where = f"--keys {path}"
    try:
        if path.is_dir():
            doc = {f.name: f.read_text().strip() for f in sorted(path.iterdir())
                   if not f.name.startswith(".") and f.is_file()}
        else:
            doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ServeError(f"{where}: {err}") from err
    if not isinstance(doc, dict) or not doc:
        raise ServeError(f"{where}: write a JSON object, client name → API key (or a directory of one file per "
                         "client)")
    for client, key in doc.items():
        if not isinstance(key, str) or not key.startswith(KEY_PREFIX) or len(key) < MIN_KEY_CHARS:
            raise ServeError(f"{where}: {client}'s key must be a string starting {KEY_PREFIX!r} of at least "
                             f"{MIN_KEY_CHARS} characters")
    if len(set(doc.values())) != len(doc):
        raise ServeError(f"{where}: two clients share a key")
    if not all(isinstance(c, str) and c.replace("-", "").isalnum() for c in doc):
        raise ServeError(f"{where}: client names are letters, digits and '-' (they name storage keys)")
    return {key: client for client, key in doc.items()}


def made_keys(clients: list[str], directory: Path) -> dict[str, str]:
    """A new key per client, each in ``directory/<client>.key`` (0600); key → client."""
    keys = {}
    for client in clients:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        path = directory / f"{client}.key"
        path.touch(mode=0o600)
        path.write_text(key)
        keys[key] = client
    return keys


def client_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or len(set(names)) != len(names) or not all(n.replace("-", "").isalnum() for n in names):
        raise ServeError(f"--clients {text!r}: distinct names of letters, digits and '-', comma-separated")
    return names


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number of tokens, at least 1")
    return int(text)


def cmd_serve(args: argparse.Namespace) -> int:
    from kuberl.local.processes import RunError
    from kuberl.local.run import load_experiment

    try:
        spec = load_experiment(Path(args.file), args.set or []).spec
        directory = Path(tempfile.mkdtemp(prefix="kuberl-serve-"))
        if args.keys:
            keys = read_keys(Path(args.keys))
        else:
            keys = made_keys(client_names(args.clients), directory)
            for client in keys.values():
                print(f"client {client}: export TINKER_API_KEY=$(cat {directory / (client + '.key')})")
        states = spec.checkpoint.uri or (directory / "states").as_uri() + "/"
    except (RunError, ServeError) as err:
        print(f"kuberl serve: {err}", file=sys.stderr)
        return 1
    from kuberl.settings import from_environment
    from kuberl.tinker.serve import run, served_name
    from kuberl.tinker.service import Limits

    print(f"serving {served_name(spec.model)} at http://{args.host}:{args.port} "
          f"(tinker.ServiceClient(base_url=...)); training states in {states}; Ctrl-C stops it", flush=True)
    try:
        run(spec.model, spec.seed, spec.trainer.accelerator, keys, args.host, args.port, states, from_environment(),
            Limits(tokens_per_minute=args.tokens_per_minute))
    except KeyboardInterrupt:
        pass
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from kuberl.api.contract import TINKER_PORT

    p = sub.add_parser("serve", help="a manifest's model behind the Tinker-compatible training API, on this machine "
                       "(drive it from your own loop with the tinker SDK)")
    p.add_argument("file", metavar="FILE", help="the RLExperiment manifest (YAML): its spec.model, seed and "
                   "trainer.accelerator (cpu, or this machine's first NVIDIA GPU)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a spec field (repeatable)")
    p.add_argument("--port", type=int, default=TINKER_PORT, help=f"the API's port (default {TINKER_PORT})")
    p.add_argument("--host", default="127.0.0.1", help="the address it listens on (default: this machine only)")
    p.add_argument("--clients", default="local", metavar="NAME[,NAME]",
                   help="one API key per client, made now (default: one client, 'local')")
    p.add_argument("--keys", metavar="PATH", help="the clients' keys instead: a JSON file (client name → key), or a "
                   "directory of one file per client holding its key (a Kubernetes Secret mounted as a volume)")
    p.add_argument("--tokens-per-minute", type=_positive, metavar="N", help="each client's share: tokens trained "
                   "(forward/backward) and sampled (prompt + generated) a minute; beyond it, told when to retry "
                   "(default: no limit)")
    p.set_defaults(func=cmd_serve)
