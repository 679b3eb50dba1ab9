"""What one engine rank's cache holds according to its KV cache events, and how far to trust it.

Pure: no sockets, no clock of its own (callers pass times in). `proxy/witnesses/kv_events/subscribers.py` feeds it what
it receives, and asks `judge_rank` whether a rank's cache was emptied after a marker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from proxy.witnesses.kv_events.wire import CLEARED, REMOVED, STORED, Batch, Event

__all__ = ["ClearResult", "Marker", "RankClear", "RankMark", "RankSnapshot", "RankState", "judge_rank"]


Verdict = Literal["apply", "duplicate", "gap", "restart"]


@dataclass(frozen=True)
class RankSnapshot:
    """What one engine rank's cache holds according to its events, and how far that can be trusted.

    `blocks` counts live blocks per medium (stored minus removed since the last AllBlocksCleared);
    it is the cache's content only when `vouches`: every batch since a known-empty start was
    applied (`synced`) and the set never outgrew its cap (`overflow`).
    """

    rank: int
    up: bool  # the subscriber's socket is open
    connected: bool  # a publisher is connected to it
    publishers: int  # publishers connected now: one is the engine; a second is an alarm
    synced: bool
    overflow: bool
    blocks: Mapping[str, int]
    last_seq: int | None
    batches: int
    events: Mapping[str, int]  # per event type, since the subscriber started
    clears: int
    cleared_seq: int | None
    cleared_ts: float | None  # the engine's clock, from its batch
    cleared_at: float | None  # the sidecar's wall clock, when it was applied
    stored_since_clear: int
    gaps: int
    replayed_gaps: int
    unreplayed_gaps: int
    restarts: int
    decode_errors: int
    unknown_removals: int  # removals of blocks never seen stored (a sign of history missed)
    extra_publishers: int  # times a publisher connected while another one was (an alarm)
    refused_publishers: int  # handshakes refused by the publisher address check
    foreign: bool  # a second publisher came since the last clear received from a lone publisher

    @property
    def vouches(self) -> bool:
        """Whether `blocks` is the cache's content, not a lower bound or a guess (never while two
        publishers share the socket, nor after, until a clear from a lone one: either one's
        batches could be the other's forgery)."""
        return self.synced and not self.overflow and self.publishers <= 1 and not self.foreign


@dataclass
class RankState:
    """The live block set of one rank and the bookkeeping that says whether it is complete.

    `synced` turns true at a known-empty start (the engine's seq 0, an empty replay buffer, an
    AllBlocksCleared) and false at anything that loses a batch (an unfilled gap, an undecodable
    payload). Over `max_blocks` the set is dropped and `overflow` holds until the next known-empty
    start: from then on the set could only be a guess.
    """

    rank: int
    max_blocks: int
    up: bool = False
    peers: int = 0
    extra_publishers: int = 0
    refused_publishers: int = 0
    foreign: bool = False  # see RankSnapshot.foreign
    synced: bool = False
    overflow: bool = False
    applied: int | None = None  # the last seq applied to the set (this incarnation)
    live: int | None = None  # the last seq seen on the live socket (restart detection)
    incarnation: int = 0  # counts the engine lives this state has followed
    origin_ts: float | None = None  # the ts of this incarnation's seq 0: who it is
    epoch: bytes | None = None  # SGLang's publisher epoch, when its topic carries one
    batches: int = 0
    clears: int = 0
    cleared_seq: int | None = None
    cleared_ts: float | None = None
    cleared_at: float | None = None
    cleared_mono: float | None = None
    cleared_incarnation: int = -1
    stored_since_clear: int = 0
    gaps: int = 0
    replayed_gaps: int = 0
    unreplayed_gaps: int = 0
    restarts: int = 0
    decode_errors: int = 0
    unknown_removals: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    _sets: dict[tuple[str, int], set[int]] = field(default_factory=dict)
    _size: int = 0

    def classify(self, seq: int) -> Verdict:
        """What a seq arriving on the live socket means.

        A publisher sends each seq once and in order, so a seq at or below the last live one is
        a new engine (its seq starts at 0 again); one at or below the last applied was already
        applied through a replay; one past the next is a gap.
        """
        if self.live is not None and seq <= self.live:
            return "restart"
        expected = 0 if self.applied is None else self.applied + 1
        if seq < expected:
            return "duplicate"
        return "apply" if seq == expected else "gap"

    def forget(self) -> None:
        """Drop what this incarnation's history built (a restart, a rebuild from seq 0)."""
        self._drop_set()
        self.applied = None
        self.live = None
        self.synced = False
        self.origin_ts = None

    def restarted(self) -> None:
        """A new engine life: its cache started empty, its seq at 0."""
        self.forget()
        self.restarts += 1
        self.incarnation += 1

    def lost(self) -> None:
        """Batches went missing for good: the set may lack stores or removals."""
        self.synced = False

    def apply(self, seq: int, batch: Batch, wall: float, mono: float) -> None:
        """Apply one batch, the next in order, to the set."""
        if self.applied is None and seq == 0:
            # The engine's first batch: what came before it is nothing.
            self._drop_set()
            self.synced = True
            self.origin_ts = batch.ts
        self.applied = seq
        self.batches += 1
        for event in batch.events:
            self.counts[event.kind] += 1
            if event.kind == STORED:
                self._store(event)
            elif event.kind == REMOVED:
                self._remove(event)
            elif event.kind == CLEARED:
                self._drop_set()
                self.synced = True
                self.foreign = self.peers > 1  # whose clear it was is known only with one publisher
                self.clears += 1
                self.cleared_seq, self.cleared_ts = seq, batch.ts
                self.cleared_at, self.cleared_mono = wall, mono
                self.cleared_incarnation = self.incarnation
                self.stored_since_clear = 0

    def skip(self, seq: int) -> None:
        """A batch that could not be decoded: it is lost, and the stream goes on after it."""
        self.applied = seq
        self.decode_errors += 1
        self.lost()

    def _store(self, event: Event) -> None:
        self.stored_since_clear += len(event.hashes)
        if self.overflow or not event.hashes:
            return  # an empty store makes no set: a set per (medium, group) holds at least one block
        blocks = self._sets.setdefault((event.medium, event.group), set())
        for h in event.hashes:
            if h in blocks:
                continue
            if self._size >= self.max_blocks:
                self._drop_set()
                self.overflow = True
                return
            blocks.add(h)
            self._size += 1

    def _remove(self, event: Event) -> None:
        if self.overflow:
            return
        blocks = self._sets.get((event.medium, event.group))
        for h in event.hashes:
            if blocks is not None and h in blocks:
                blocks.discard(h)
                self._size -= 1
            else:
                self.unknown_removals += 1
        if blocks is not None and not blocks:
            del self._sets[(event.medium, event.group)]

    def _drop_set(self) -> None:
        self._sets.clear()
        self._size = 0
        self.overflow = False

    def blocks(self) -> dict[str, int]:
        """Live blocks per medium."""
        per: Counter[str] = Counter()
        for (medium, _), blocks in self._sets.items():
            per[medium] += len(blocks)
        return {medium: n for medium, n in per.items() if n}

    def snapshot(self) -> RankSnapshot:
        """A frozen copy of what this rank's state says now."""
        return RankSnapshot(
            rank=self.rank,
            up=self.up,
            connected=self.peers > 0,
            publishers=self.peers,
            synced=self.synced,
            overflow=self.overflow,
            blocks=MappingProxyType(self.blocks()),
            last_seq=self.applied,
            batches=self.batches,
            events=MappingProxyType(dict(self.counts)),
            clears=self.clears,
            cleared_seq=self.cleared_seq,
            cleared_ts=self.cleared_ts,
            cleared_at=self.cleared_at,
            stored_since_clear=self.stored_since_clear,
            gaps=self.gaps,
            replayed_gaps=self.replayed_gaps,
            unreplayed_gaps=self.unreplayed_gaps,
            restarts=self.restarts,
            decode_errors=self.decode_errors,
            unknown_removals=self.unknown_removals,
            extra_publishers=self.extra_publishers,
            refused_publishers=self.refused_publishers,
            foreign=self.foreign,
        )


@dataclass(frozen=True)
class RankMark:
    """One rank's position when a marker was taken."""

    incarnation: int
    seq: int | None
    restarts: int
    unreplayed_gaps: int
    extra_publishers: int = 0


@dataclass(frozen=True)
class Marker:
    """Taken just before a reset is sent: a clear counts only if the engine published it later."""

    wall: float
    mono: float
    ranks: tuple[RankMark, ...]


@dataclass(frozen=True)
class RankClear:
    """What one rank's events say about its cache since a marker."""

    rank: int
    cleared: bool  # an AllBlocksCleared published after the marker was applied
    restarted: bool  # the engine restarted (its cache started empty) since the marker
    seq: int | None  # the clear's seq
    ts: float | None  # the clear's batch time, on the engine's clock
    elapsed_s: float | None  # from the marker to the clear's arrival, on the sidecar's clock
    seq_from: int | None  # the last seq applied at the marker
    seq_to: int | None  # the last seq applied now
    blocks: Mapping[str, int]  # live blocks per medium now (stored after the clear)
    stored_since_clear: int
    unreplayed_gaps: int  # since the marker
    synced: bool
    overflow: bool
    connected: bool
    extra_publishers: int = 0  # a second publisher connected since the marker (or is now)

    @property
    def vouches(self) -> bool:
        """The cache was emptied after the marker, every batch since then is known, and they all
        came while one publisher, the engine, was connected."""
        return (
            (self.cleared or self.restarted)
            and self.synced
            and not self.overflow
            and not self.unreplayed_gaps
            and not self.extra_publishers
        )


@dataclass(frozen=True)
class ClearResult:
    """`cleared_since`'s answer: one entry per rank."""

    ranks: tuple[RankClear, ...]
    timed_out: bool
    elapsed_s: float

    @property
    def vouches(self) -> bool:
        """Every rank vouches that its cache was emptied after the marker."""
        return all(r.vouches for r in self.ranks)


def judge_rank(st: RankState, m: RankMark, marker: Marker, clock_slack_s: float) -> RankClear:
    """What `st` says about its cache since `marker` (`m`: its own position then)."""
    published_after = st.cleared_ts is not None and st.cleared_ts >= marker.wall - clock_slack_s
    later_seq = st.cleared_incarnation > m.incarnation or (
        st.cleared_incarnation == m.incarnation
        and st.cleared_seq is not None
        and (m.seq is None or st.cleared_seq > m.seq)
    )
    cleared = published_after and later_seq
    return RankClear(
        rank=st.rank,
        cleared=cleared,
        restarted=st.restarts > m.restarts,
        seq=st.cleared_seq if cleared else None,
        ts=st.cleared_ts if cleared else None,
        elapsed_s=st.cleared_mono - marker.mono if cleared and st.cleared_mono is not None else None,
        seq_from=m.seq,
        seq_to=st.applied,
        blocks=MappingProxyType(st.blocks()),
        stored_since_clear=st.stored_since_clear,
        unreplayed_gaps=st.unreplayed_gaps - m.unreplayed_gaps,
        synced=st.synced,
        overflow=st.overflow,
        connected=st.peers > 0,
        extra_publishers=st.extra_publishers - m.extra_publishers + max(0, st.peers - 1),
    )
