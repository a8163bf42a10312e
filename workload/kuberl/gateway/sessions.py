"""Agent sessions → rewarded trajectories, grouped for GRPO (pure state; the server is the I/O).

A session is one episode of the agent (``X-KubeRL-Session``). Every completion it asks for is
recorded: the prompt tokens are rendered from its messages; when they extend what the session
holds so far (its earlier prompt + completions), only the new tokens are appended — as context
(loss mask 0) — and the completion's tokens follow as the policy's (mask 1, with their log-probs
and versions). When they do not (the agent rewrote its history), the session starts a new segment.
The agent ends a session with a reward; the session's last segment (the stretch that led to it)
becomes its trajectory — earlier segments are not trained on, nor kept (``prefix_breaks`` counts them).

Sessions join groups (``X-KubeRL-Group``, e.g. the task id; without one, sessions fill anonymous
groups in arrival order). A group holds ``group_size`` sessions; its first session takes a slot
from the staleness budget (``admit``: None means no slot, the server answers 429). A group is
done when all its seats are taken and every session in it ended; a session idle for longer than
``timeout`` seconds ends without a reward, and a group that has not filled its seats within
``timeout`` closes the empty ones. Only a group of ``group_size`` rewarded episodes is trained on
(GRPO's baseline is the group's mean): any other is dropped and its slot reopens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..agent.workflow import Episode
from ..inference.contract import FINISH_STOP
from ..rollout.types import Group, Trajectory

if TYPE_CHECKING:
    import torch

ANONYMOUS = ""


@dataclass
class Segment:
    prompt_ids: list[int]
    episode: Episode = field(default_factory=Episode)
    finish_reason: str = FINISH_STOP

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.episode.output_ids


@dataclass
class Session:
    """One episode. Memory: only the current segment is kept (an earlier one is never trained on), and
    it grows only by a turn that the policy completed, so a session holds at most one model context
    of tokens, however many times its history is rewritten; a turn the replica refused changes
    nothing. The whole table: at most (groups admitted) × ``group_size`` sessions (``SessionTable``)."""

    id: str
    touched: float
    segment: Segment | None = None
    reward: float | None = None
    ended: bool = False
    prefix_breaks: int = 0
    generated_tokens: int = 0  # over all segments, for the reward reply
    busy: bool = False  # a completion is being generated: one call at a time per session

    def extends(self, prompt_ids: list[int]) -> bool:
        """Whether a completion's rendered prompt continues the current segment (else: a rewrite)."""
        return self.segment is not None and prompt_ids[:len(self.segment.ids)] == self.segment.ids

    def tokens_left(self, prompt_ids: list[int], max_new_tokens: int) -> int:
        """What the segment that ``prompt_ids`` continues (or starts) may still generate."""
        used = len(self.segment.episode.output_ids) if self.segment is not None and self.extends(prompt_ids) else 0
        return max_new_tokens - used

    def context(self, prompt_ids: list[int]) -> list[int]:
        """Take a completion's rendered prompt: its new tokens join the segment as context, or (a
        rewrite) it starts a new segment in place of the old one; returns the tokens to generate from."""
        if self.segment is not None and self.extends(prompt_ids):
            self.segment.episode.context(prompt_ids[len(self.segment.ids):])
        else:
            self.prefix_breaks += self.segment is not None
            self.segment = Segment(list(prompt_ids))
        return self.segment.ids

    def policy(self, ids: list[int], logprobs: list[float], versions: list[int], finish_reason: str,
               routes: torch.Tensor | None = None) -> None:
        """The policy's completion of the current segment (``routes``: its generation's, from the
        segment's first position)."""
        assert self.segment is not None, "context() first"
        self.segment.episode.policy(ids, logprobs, versions, routes)
        self.segment.finish_reason = finish_reason
        self.generated_tokens += len(ids)

    def tool_called(self) -> None:
        if self.segment is not None:
            self.segment.episode.tool_calls += 1

    @property
    def stored_tokens(self) -> int:
        return len(self.segment.ids) if self.segment is not None else 0

    def trajectory(self, group_id: int) -> Trajectory | None:
        """The rewarded episode's last segment (None: no reward, or the policy wrote nothing in it)."""
        s = self.segment
        if self.reward is None or s is None or not any(s.episode.mask):
            return None
        return Trajectory(s.prompt_ids, s.episode.output_ids, s.episode.logprobs, s.episode.versions, self.reward,
                          group_id, s.finish_reason, info={"tool_calls": str(s.episode.tool_calls)},
                          loss_mask=s.episode.mask, routes=s.episode.routes_of(s.prompt_ids))


@dataclass
class SessionGroup:
    id: int
    key: str
    size: int
    opened: float
    seats: int = 0  # size, until closed early
    sessions: list[Session] = field(default_factory=list)
    client: str = ""  # who opened it (the remote address of its first session's call)

    def idle_since(self) -> float | None:
        """When its last call ended, if none is in flight and none of its sessions ended; else None."""
        if any(s.busy or s.ended for s in self.sessions):
            return None
        return max(s.touched for s in self.sessions)

    def __post_init__(self) -> None:
        self.seats = self.seats or self.size

    @property
    def done(self) -> bool:
        return len(self.sessions) >= self.seats and all(s.ended for s in self.sessions)

    def result(self) -> Group | None:
        """The group's trajectories when all ``size`` episodes were rewarded, else None."""
        trajectories = [s.trajectory(self.id) for s in self.sessions]
        complete = [t for t in trajectories if t is not None]
        return Group(complete) if len(complete) == self.size else None


def fair_share(held: dict[str, list[SessionGroup]], waiting: set[str]) -> int:
    """⌈open groups ÷ clients holding one or waiting for one⌉."""
    clients = held.keys() | waiting
    return -(-sum(map(len, held.values())) // max(1, len(clients)))


@dataclass
class SessionTable:
    group_size: int
    timeout: float
    sessions: dict[str, tuple[Session, SessionGroup]] = field(default_factory=dict)
    filling: dict[str, SessionGroup] = field(default_factory=dict)  # key → its group with free seats
    expired: int = 0
    reclaimed: int = 0  # groups taken back from a client holding more than its share (``reclaim``)

    @property
    def stored_tokens(self) -> int:
        """Tokens the table holds: ≤ (groups admitted) × group_size × the model's context."""
        return sum(session.stored_tokens for session, _ in self.sessions.values())

    def get(self, session_id: str) -> Session | None:
        found = self.sessions.get(session_id)
        return found[0] if found else None

    def group_of(self, session_id: str) -> SessionGroup:
        return self.sessions[session_id][1]

    def join(self, session_id: str, key: str | None, now: float, admit: Callable[[], int | None],
             client: str = "") -> Session | None:
        """The session ``session_id`` (new ones join ``key``'s group; a new group is ``client``'s);
        None: no staleness budget."""
        if (found := self.sessions.get(session_id)) is not None:
            found[0].touched = now
            return found[0]
        key = ANONYMOUS if key is None else key
        group = self.filling.get(key)
        if group is None:
            group_id = admit()
            if group_id is None:
                return None
            group = self.filling[key] = SessionGroup(group_id, key, self.group_size, now, client=client)
        session = Session(session_id, now)
        group.sessions.append(session)
        self.sessions[session_id] = (session, group)
        if len(group.sessions) >= group.seats:
            del self.filling[key]
        return session

    def forget(self, session_id: str) -> SessionGroup | None:
        """Take back a session that holds nothing yet (its first call was refused): its seat is free
        again; its group when that is now empty — dropped, so the group's staleness slot reopens at
        once instead of when the session times out. A session with a turn, or ended, is kept."""
        found = self.sessions.get(session_id)
        if found is None or found[0].segment is not None or found[0].ended:
            return None
        session, group = found
        del self.sessions[session_id]
        group.sessions.remove(session)
        if not group.sessions:
            return self._release(group)
        if group.key not in self.filling and len(group.sessions) < group.seats:
            self.filling[group.key] = group
        return None

    def end(self, session_id: str, reward: float | None) -> SessionGroup | None:
        """End a session (``reward`` None: untrained); its group when that is now done."""
        session, group = self.sessions[session_id]
        session.reward, session.ended = reward, True
        return self._release(group) if group.done else None

    def expire(self, now: float) -> list[SessionGroup]:
        """End idle sessions and close the empty seats of old groups; the groups now done."""
        for session, _ in list(self.sessions.values()):
            if not session.ended and now - session.touched > self.timeout:
                session.ended = True
                self.expired += 1
        for key, group in list(self.filling.items()):
            if now - group.opened > self.timeout:
                group.seats = len(group.sessions)
                del self.filling[key]
        groups = {id(g): g for _, g in self.sessions.values() if g.done}
        return [self._release(g) for g in groups.values()]

    def open_groups(self) -> dict[str, list[SessionGroup]]:
        """Each client's groups not yet done."""
        held: dict[str, list[SessionGroup]] = {}
        for group in {id(g): g for _, g in self.sessions.values() if not g.done}.values():
            held.setdefault(group.client, []).append(group)
        return held

    def reclaim(self, asking: str, now: float, idle: float) -> SessionGroup | None:
        """One group taken back so that ``asking`` (a client waiting for a slot) gets one: the oldest
        group idle for ``idle`` seconds or more (no call in flight, none ended) of the client holding the
        most open groups beyond its fair share (open groups ÷ clients holding or asking), so a client
        whose sessions were abandoned cannot hold the staleness budget against the others until they time
        out. A lone client is never reclaimed from. The group is ended unrewarded (dropped: its slot reopens)."""
        held = self.open_groups()
        fair = fair_share(held, {asking})
        over = sorted(((len(owned), client) for client, owned in held.items()
                       if client != asking and len(owned) > fair), reverse=True)
        for _, client in over:
            idle_ones = sorted((since, g.id, g) for g in held[client]
                               if (since := g.idle_since()) is not None and now - since >= idle)
            if idle_ones:
                group = idle_ones[0][2]
                for session in group.sessions:
                    session.ended = True
                group.seats = len(group.sessions)
                self.reclaimed += 1
                return self._release(group)
        return None

    def _release(self, group: SessionGroup) -> SessionGroup:
        for session in group.sessions:
            self.sessions.pop(session.id, None)
        if self.filling.get(group.key) is group:
            del self.filling[group.key]
        return group
