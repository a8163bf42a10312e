"""Calling an object that lives in another process, over one socket pair (``multiprocessing.connection``
frames the messages; this module only numbers them).

The wire: a request is ``(call id, method name, args)``, a reply ``(call id, ok, result or exception)``,
each one pickled frame (plain ``pickle``: tensors travel as bytes, never as shared-memory handles).
:class:`Caller` (the calling side) returns a ``Future`` per call and answers them from one reader
thread, in whatever order the replies come; :func:`serve` (the serving side) runs each request on a
worker thread, or inline on its reader thread for the methods named ``inline`` (cheap reads that must
not wait behind a blocked call). A method that returns a ``Future`` is answered when it is done.
An exception raised on the serving side is raised by ``Future.result()`` on the calling side, with the
serving side's traceback as a note. When either side goes away the other sees it: every call pending
or made later fails with :class:`PeerGone`, and ``serve`` returns.

Both ends unpickle what the other sends, so both must be one program's processes: the socket pair is
anonymous (inherited by the child, never bound to an address) and must stay so.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import socket
import threading
import time
import traceback
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any

log = logging.getLogger("kuberl.ipc")
EXIT_CODE_WAIT = 1.0  # seconds a caller waits, once the connection ends, for the process's exit code (the message)


class PeerGone(RuntimeError):
    """The process on the other end of the connection exited (or closed it)."""


def connection_pair() -> tuple[Connection, socket.socket]:
    """(this side's connection, the other side's socket): hand the socket's file descriptor to a child
    process (``pass_fds``), which wraps it with ``Connection(fd)``; close the socket here after that."""
    mine, theirs = socket.socketpair()
    return Connection(mine.detach()), theirs


def _send(conn: Connection, lock: threading.Lock, message: tuple[Any, ...]) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


class Caller:
    """The calling side: ``call(name, *args)`` → a ``Future`` of the served object's ``name(*args)``."""

    def __init__(self, conn: Connection, peer: str, exit_code: Callable[[], int | None] = lambda: None):
        """``peer``: what the other side is, for messages; ``exit_code``: its exit code, once it has one."""
        self._conn, self._peer, self._exit_code = conn, peer, exit_code
        self._send_lock, self._lock = threading.Lock(), threading.Lock()
        self._ids = itertools.count()
        self._pending: dict[int, Future[Any]] = {}
        self._gone: PeerGone | None = None
        self._reader = threading.Thread(target=self._read, name=f"ipc-{peer}", daemon=True)
        self._reader.start()

    def call(self, method: str, *args: Any) -> Future[Any]:
        answer: Future[Any] = Future()
        with self._lock:
            if self._gone is not None:
                answer.set_exception(self._gone)
                return answer
            call_id = next(self._ids)
            self._pending[call_id] = answer
        try:
            _send(self._conn, self._send_lock, (call_id, method, args))
        except OSError as err:
            self._fail_all(err)
        return answer

    def close(self) -> None:
        """Shut the connection down (the serving side sees its end; a bare ``close`` would neither tell
        it nor wake this side's reader) and close it; pending calls fail."""
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self._conn.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)
        self._reader.join(timeout=5)
        self._conn.close()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError) as err:
                self._fail_all(err)
                return
            except Exception as err:  # a reply this side cannot read: nothing after it can be trusted
                log.exception("unreadable reply from the %s process", self._peer)
                self._fail_all(err)
                self._conn.close()
                return
            with self._lock:
                answer = self._pending.pop(call_id, None)
            if answer is None:
                log.error("%s answered call %d, which nobody made", self._peer, call_id)
            elif ok:
                answer.set_result(value)
            else:
                answer.set_exception(value)

    def _fail_all(self, err: BaseException) -> None:
        code, deadline = self._exit_code(), time.monotonic() + EXIT_CODE_WAIT
        while code is None and time.monotonic() < deadline:  # its end of the socket closes before it is reaped
            time.sleep(0.02)
            code = self._exit_code()
        gone = PeerGone(f"the {self._peer} process is gone" + (f" (exit code {code})" if code is not None else "")
                        + f": {type(err).__name__}")
        with self._lock:
            self._gone = self._gone or gone
            pending, self._pending = self._pending, {}
        for answer in pending.values():
            answer.set_exception(gone)


def _portable(err: BaseException) -> BaseException:
    """``err`` with the serving side's traceback as a note, as something pickle can carry."""
    err.add_note("in the serving process:\n" + "".join(traceback.format_exception(err)))
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # an exception type that does not pickle (a required keyword, a lock inside)
        plain = RuntimeError(f"{type(err).__name__}: {err}")
        plain.__notes__ = list(getattr(err, "__notes__", []))
        return plain
    return err


def serve(conn: Connection, target: object, inline: Collection[str] = (), workers: int = 8) -> None:
    """Answer requests for ``target``'s methods until the calling side closes the connection; the
    methods in ``inline`` run on this thread (they must not block), the others on ``workers`` threads
    (those still running then are left: end the process with ``os._exit``, which does not wait for them)."""
    send_lock = threading.Lock()

    def answer(call_id: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            result = getattr(target, method)(*args)
            if isinstance(result, Future):
                result = result.result()
            reply: tuple[Any, ...] = (call_id, True, result)
        except BaseException as err:  # delivered to the caller, who raises it
            reply = (call_id, False, _portable(err))
        try:
            _send(conn, send_lock, reply)
        except OSError:
            log.debug("the caller left before call %d (%s) was answered", call_id, method)
        except Exception as err:  # the result does not pickle: the caller hears why instead of waiting forever
            _send(conn, send_lock, (call_id, False, RuntimeError(f"{method}'s result cannot be sent: {err!r}")))

    pool = ThreadPoolExecutor(workers, thread_name_prefix="ipc-serve")
    try:
        while True:
            try:
                call_id, method, args = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return
            if method in inline:
                answer(call_id, method, args)
            else:
                pool.submit(answer, call_id, method, args)
    finally:  # calls still running (a take that waits for rollouts) answer nobody: not waited for
        pool.shutdown(wait=False, cancel_futures=True)
