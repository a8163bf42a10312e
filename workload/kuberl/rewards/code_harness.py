"""The two sides of ``kuberl.rewards:code``, each run in a sandbox of its own (stdlib only: the
sandboxed interpreter has no site-packages and may read nothing but the standard library).

``program`` side (``argv: program FILE REQUESTS_FD REPLIES_FD``) imports the completion's program as a
module named ``solution`` (so an ``if __name__ == "__main__":`` block does not run), announces its
top-level names, then answers calls on them, one JSON line per request.

``tests`` side (``argv: tests FILE REQUESTS_FD REPLIES_FD RESULT_FD``) runs the row's tests, statement by
statement, in a namespace where the program's functions and classes are stand-ins that call across
the pipes. Only plain data crosses back — values ``ast.literal_eval`` accepts, built from exact
builtin types — so an object whose ``__eq__`` always answers True arrives as an opaque handle that
equals nothing. Names the program defines that shadow a builtin are not imported (``sorted``,
``len`` … stay the real ones). After the last statement has run, and only then, this side writes
``RESULT count`` to RESULT_FD, a pipe only it holds; :mod:`.code` pays on that line alone.

Mutable arguments (list, dict, set) are copied back after a call, so tests of in-place functions hold.
An exception the program raises arrives as the builtin exception of the same name where there is one
(``ValueError`` …), else as :class:`RemoteError`.
"""

import ast
import builtins
import json
import os
import sys
import types

RESULT = "kuberl-code-result"
PLAIN = (int, float, complex, str, bytes, bool, type(None))
MAX_DEPTH = 100


class RemoteError(Exception):
    """The program raised, ended or answered nonsense."""


# --- the program's side -----------------------------------------------------------------------

def is_plain(value, depth=0):
    """Whether ``value`` is made of exact builtin types only (no subclass can hide an ``__eq__``)."""
    if depth > MAX_DEPTH:
        return False
    kind = type(value)
    if kind in PLAIN:
        return True
    if kind in (list, tuple, set, frozenset):
        return all(is_plain(item, depth + 1) for item in value)
    if kind is dict:
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    return False


class Objects:
    """The program's objects as the tests side refers to them: ``{"name": …}`` for its top-level names,
    ``{"handle": n}`` for anything else it returned that is not plain data, ``{"literal": repr}``."""

    def __init__(self, namespace):
        self.namespace, self.held = namespace, []

    def encode(self, value):
        if is_plain(value):
            text = repr(value)
            try:
                if ast.literal_eval(text) == value:
                    return {"literal": text}
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass  # nan, inf: sent as a handle, which equals nothing
        self.held.append(value)
        return {"handle": len(self.held) - 1, "type": type(value).__name__}

    def decode(self, ref):
        if "handle" in ref:
            return self.held[ref["handle"]]
        if "name" in ref:
            return self.namespace[ref["name"]]
        return ast.literal_eval(ref["literal"])

    def announce(self):
        """Each public name: ``{"module": name}``, ``{"callable": true}`` or ``{"value": encoded}``."""
        names = {}
        for name, value in list(self.namespace.items()):
            if name.startswith("__"):
                continue
            if isinstance(value, types.ModuleType):
                names[name] = {"module": value.__name__}
            elif callable(value):
                names[name] = {"callable": True}
            else:
                names[name] = {"value": self.encode(value)}
        return names


def serve(program_file, requests, replies):
    namespace = {"__name__": "solution", "__builtins__": builtins}
    objects = Objects(namespace)

    def reply(message):
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    try:
        with open(program_file, "rb") as source:
            exec(compile(source.read(), "solution.py", "exec"), namespace)
        names = objects.announce()
    except BaseException as err:  # the program's failure, SystemExit included: nothing passes
        reply({"error": f"{type(err).__name__}: {err}"[:500]})
        return
    reply({"names": names})
    for line in requests:
        request = json.loads(line)
        try:
            target = objects.decode(request["target"])
            if request["op"] == "getattr":
                value, args = getattr(target, request["attr"]), []
            else:
                args = [objects.decode(arg) for arg in request["args"]]
                value = target(*args, **{key: objects.decode(arg) for key, arg in request["kwargs"].items()})
            reply({"value": objects.encode(value), "args": [objects.encode(arg) for arg in args]})
        except BaseException as err:  # reported to the tests side, which raises it there
            reply({"error": type(err).__name__, "message": str(err)[:500]})


# --- the tests' side --------------------------------------------------------------------------

class Channel:
    """The tests side's end of the pipes to the program."""

    def __init__(self, requests, replies):
        self.requests, self.replies = requests, replies

    def receive(self):
        line = self.replies.readline()
        if not line:
            raise RemoteError("the program ended")
        reply = json.loads(line)
        if "error" in reply:
            error = getattr(builtins, str(reply["error"]), None)
            kind = error if isinstance(error, type) and issubclass(error, Exception) else RemoteError
            raise kind(str(reply.get("message", reply["error"])))
        return reply

    def ask(self, request):
        try:
            self.requests.write(json.dumps(request) + "\n")
            self.requests.flush()
        except OSError:
            raise RemoteError("the program ended") from None
        return self.receive()

    def value(self, encoded):
        """Plain data as the tests' own objects (``literal_eval``: nothing runs), else a stand-in."""
        if "handle" in encoded:
            return Remote(self, {"handle": int(encoded["handle"])}, str(encoded.get("type")))
        return ast.literal_eval(str(encoded["literal"]))

    def encode(self, value):
        if isinstance(value, Remote):
            return object.__getattribute__(value, "_ref")
        if not is_plain(value):
            raise TypeError(f"only plain data can be passed to the program, not {type(value).__name__}")
        return {"literal": repr(value)}

    def call(self, ref, args, kwargs):
        reply = self.ask({"op": "call", "target": ref, "args": [self.encode(a) for a in args],
                          "kwargs": {k: self.encode(v) for k, v in kwargs.items()}})
        for mine, theirs in zip(args, reply.get("args", []), strict=False):
            copy_back(mine, self.value(theirs))
        return self.value(reply["value"])

    def getattr(self, ref, name):
        return self.value(self.ask({"op": "getattr", "target": ref, "attr": name})["value"])


def copy_back(mine, theirs):
    """An in-place change the program made to a mutable argument, made to the tests' own object."""
    if type(mine) is list and type(theirs) is list:
        mine[:] = theirs
    elif type(mine) is type(theirs) and type(mine) in (dict, set):
        mine.clear()
        mine.update(theirs)


class Remote:
    """A stand-in for one of the program's objects: calls and attributes go across; it equals only itself."""

    def __init__(self, channel, ref, label):
        object.__setattr__(self, "_channel", channel)
        object.__setattr__(self, "_ref", ref)
        object.__setattr__(self, "_label", label)

    def __call__(self, *args, **kwargs):
        return object.__getattribute__(self, "_channel").call(object.__getattribute__(self, "_ref"), args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return object.__getattribute__(self, "_channel").getattr(object.__getattribute__(self, "_ref"), name)

    def __repr__(self):
        return f"<the program's {object.__getattribute__(self, '_label')}>"


def namespace_for(channel, names):
    """The tests' globals: the program's names (builtins keep their own), as stand-ins or plain values."""
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    for name, kind in names.items():
        if hasattr(builtins, name):
            continue
        if "module" in kind:
            try:
                namespace[name] = __import__(str(kind["module"]))
            except ImportError:
                continue
        elif "value" in kind:
            namespace[name] = channel.value(kind["value"])
        else:
            namespace[name] = Remote(channel, {"name": name}, name)
    return namespace


def run_tests(tests_file, channel, result):
    """Each statement in turn; the result line only after the last one ran without raising."""
    with open(tests_file, "rb") as source:
        statements = ast.parse(source.read(), "tests.py").body
    namespace = namespace_for(channel, channel.receive()["names"])
    for statement in statements:
        exec(compile(ast.Module(body=[statement], type_ignores=[]), "tests.py", "exec"), namespace)
    result.write(f"{RESULT} {len(statements)}\n")
    result.flush()


def main(argv):
    side, path = argv[1], argv[2]
    if side == "program":
        serve(path, os.fdopen(int(argv[3]), "r"), os.fdopen(int(argv[4]), "w"))
    else:
        channel = Channel(os.fdopen(int(argv[3]), "w"), os.fdopen(int(argv[4]), "r"))
        run_tests(path, channel, os.fdopen(int(argv[5]), "w"))


if __name__ == "__main__":
    main(sys.argv)
