"""The engine's KV cache events as they travel: where from (the configuration, each rank's
address), and the msgpack batches and replay replies, decoded.

Every format vLLM and SGLang have published is read here; docs/simulator.md ("KV cache events")
lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

__all__ = [
    "CLEARED",
    "DEVICE",
    "END_SEQ",
    "MAX_EVENTS_PER_BATCH",
    "MAX_HASHES_PER_EVENT",
    "OTHER",
    "REMOVED",
    "STORED",
    "Batch",
    "DecodeError",
    "Event",
    "KvEventsConfig",
    "decode_batch",
    "epoch_of",
    "hash64",
    "rank_endpoint",
    "replay_item",
]

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"
# Events that name no medium come from the engine's device prefix cache: vLLM's block pool before
# it sent `medium`, SGLang's radix cache (its `medium` defaults to None).
DEVICE = "GPU"
# Anything else a publisher names, as a metric label and a key: a publisher must not mint series.
OTHER = "other"
_KINDS = frozenset((STORED, REMOVED, CLEARED))
_MEDIA = frozenset((DEVICE, "CPU", "CPU_PINNED", "DISK"))  # device pools and offloading tiers
# Bounds on one batch, far above what an engine publishes per step (a 1M-token prompt at 16 tokens
# a block is 62,500 hashes); past them the batch is refused as undecodable (lost, not applied).
MAX_EVENTS_PER_BATCH = 16_384
MAX_HASHES_PER_EVENT = 131_072
_MAX_GROUP = 1_023  # vLLM's KV cache group index: one per attention kind, a handful
_MASK64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's end marker
# SGLang appends its publisher's epoch (a new one per process) to the topic when snapshots are on.
_EPOCH = b"\x00sgl-kv-epoch="
# Positional (array) events: [tag, block_hashes, parent, token_ids, block_size, lora_id, medium,
# lora_name, extra_keys, group_idx] for a store, [tag, block_hashes, medium, group_idx] for a removal
# (vLLM's msgspec `array_like` era; SGLang's stores end at medium, or medium + metadata).
_STORED_MEDIUM, _STORED_GROUP = 6, 9
_REMOVED_MEDIUM, _REMOVED_GROUP = 2, 3


@dataclass(frozen=True)
class KvEventsConfig:
    """Where the engine's events come from, and the bounds on what is kept of them."""

    endpoint: str  # rank 0's address: bound by the sidecar (or connected to, with `connect`)
    replay: str | None = None  # rank 0's replay address (the engine binds it)
    ranks: int = 1
    topic: str = "kv"
    connect: bool = False  # the engine binds `endpoint` (`tcp://*:PORT` in its config)
    # Where the sidecar binds a tcp endpoint: the hosts (names or addresses) whose publishers are
    # admitted, checked by address in the ZMTP handshake (ZAP). Empty: any (ipc:// relies on the
    # socket file's permissions; a connected endpoint is the engine's own).
    publishers: tuple[str, ...] = ()
    # Each rank's (endpoint, replay) as the engine said them (proxy/engines/kv_sources.py): no
    # port + rank rule then; `ranks` is their number. Empty: the rule, from `endpoint` and `replay`.
    rank_endpoints: tuple[tuple[str, str | None], ...] = ()
    learnt_from: str = "configured"  # where the endpoints come from (named on /cache/state)
    max_blocks: int = 262_144  # 64-bit hashes kept per rank; beyond it the rank reports overflow
    replay_timeout_s: float = 2.0  # one replay, from request to end marker
    clock_slack_s: float = 0.0  # how far the engine's clock may lag the sidecar's (other hosts)
    catch_up_s: float = 0.25  # while waiting for a clear, ask the replay socket this often
    # A few MiB per batch and a short queue: at most hwm x max_message_bytes waits unread (M3 of
    # issue 45: 64 MiB x 100,000 let one batch take 1.1 GiB and stall the loop for seconds).
    hwm: int = 128  # live batches ZeroMQ queues before it drops (a gap shows, the replay fills it)
    max_message_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        """Reject addresses and bounds no subscriber could use."""
        for name, value in (("endpoint", self.endpoint), ("replay", self.replay)):
            if value is not None and not value.startswith(("tcp://", "ipc://")):
                raise ValueError(f"kv events {name} must be tcp://HOST:PORT or ipc://PATH, not {value!r}")
        if self.ranks < 1:
            raise ValueError("kv_events_ranks must be >= 1")
        if self.max_blocks < 1 or self.hwm < 1 or self.max_message_bytes < 1:
            raise ValueError("kv events bounds must be >= 1")
        if self.replay_timeout_s <= 0 or self.catch_up_s <= 0 or self.clock_slack_s < 0:
            raise ValueError("replay_timeout_s and catch_up_s must be > 0, clock_slack_s >= 0")


def rank_addresses(config: KvEventsConfig, rank: int) -> tuple[str, str | None]:
    """Rank `rank`'s (endpoint, replay): as the engine said them, else by the port + rank rule."""
    if config.rank_endpoints:
        return config.rank_endpoints[rank]
    replay = None if config.replay is None else rank_endpoint(config.replay, rank)
    return rank_endpoint(config.endpoint, rank), replay


def rank_endpoint(endpoint: str, rank: int) -> str:
    """The address of rank `rank`: tcp port + rank; ipc path + `_dp{rank}` (vLLM's offset rule)."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"{endpoint!r} has no port to offset by the rank")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class DecodeError(ValueError):
    """A payload that is not an event batch in any of the known formats."""


@dataclass(frozen=True, slots=True)
class Event:
    """One KV cache event: its type, and for stores and removals the blocks and where they live."""

    kind: str
    hashes: tuple[int, ...] = ()
    medium: str = DEVICE
    group: int = 0


@dataclass(frozen=True, slots=True)
class Batch:
    """One published batch: the engine's timestamp, its events, the rank it names."""

    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None = None


def hash64(value: Any) -> int:
    """A block hash as an unsigned 64-bit int.

    vLLM sends u64 ints by default and raw bytes under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (its own
    int form is the bytes' low 64 bits, which is what this takes); SGLang sends signed int64s.
    """
    if isinstance(value, bool):
        raise DecodeError("a block hash is a bool")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK64
    raise DecodeError(f"a block hash is a {type(value).__name__}")


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not a list")
    if len(value) > MAX_HASHES_PER_EVENT:
        raise DecodeError(f"an event of {len(value)} block hashes (at most {MAX_HASHES_PER_EVENT})")
    return tuple(hash64(h) for h in value)


def _medium(value: Any) -> str:
    if not isinstance(value, str) or not value:
        return DEVICE
    return value if value in _MEDIA else OTHER


def _group(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        return 0
    if not 0 <= value <= _MAX_GROUP:
        raise DecodeError(f"a group_idx of {value} (0 to {_MAX_GROUP})")
    return value


def _kind(value: str) -> str:
    return value if value in _KINDS else OTHER


def _at(items: list[Any], index: int) -> Any:
    return items[index] if len(items) > index else None


def _event(raw: Any) -> Event:
    """One event, map-tagged by "type" (vLLM 0.32+) or a positional array (older vLLM, SGLang)."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise DecodeError("an event map without a string 'type'")
        if kind in (STORED, REMOVED):
            return Event(
                kind,
                _hashes(raw.get("block_hashes")),
                _medium(raw.get("medium")),
                _group(raw.get("group_idx")),
            )
        return Event(_kind(kind))
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        if kind == STORED:
            return Event(
                kind, _hashes(_at(raw, 1)), _medium(_at(raw, _STORED_MEDIUM)), _group(_at(raw, _STORED_GROUP))
            )
        if kind == REMOVED:
            return Event(
                kind,
                _hashes(_at(raw, 1)),
                _medium(_at(raw, _REMOVED_MEDIUM)),
                _group(_at(raw, _REMOVED_GROUP)),
            )
        return Event(_kind(kind))
    raise DecodeError("an event is neither a tagged map nor a tagged array")


def decode_batch(payload: bytes) -> Batch:
    """Decode one msgpack batch: `[ts, events, dp_rank]`, or the same as a map."""
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise DecodeError(f"not msgpack: {exc}") from exc
    if isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], _at(raw, 2)
    elif isinstance(raw, dict):
        ts, events = raw.get("ts"), raw.get("events")
        rank = raw.get("data_parallel_rank", raw.get("attn_dp_rank"))
    else:
        raise DecodeError("a batch is neither [ts, events, rank] nor a map")
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not isinstance(events, list):
        raise DecodeError("a batch without a numeric ts and a list of events")
    if len(events) > MAX_EVENTS_PER_BATCH:
        raise DecodeError(f"a batch of {len(events)} events (at most {MAX_EVENTS_PER_BATCH})")
    return Batch(float(ts), tuple(_event(e) for e in events), rank if isinstance(rank, int) else None)


def epoch_of(topic: bytes) -> bytes | None:
    """SGLang's publisher epoch in a topic frame, if it carries one."""
    at = topic.find(_EPOCH)
    return None if at < 0 else topic[at + len(_EPOCH) :].split(b"\x00", 1)[0]


def replay_item(frames: list[bytes]) -> tuple[int, bytes] | None:
    """One replay reply as (seq, payload); None for the end marker.

    vLLM 0.32+ sends `[b"", topic, seq, payload]` and ends with `[b"", b"", -1, b""]`; older vLLM and
    SGLang leave the topic out.
    """
    if len(frames) not in (3, 4) or frames[0] != b"":
        raise DecodeError(f"a replay reply of {len(frames)} frames")
    seq_bytes, payload = frames[-2], frames[-1]
    if seq_bytes == END_SEQ:
        return None
    if len(seq_bytes) != 8:
        raise DecodeError("a replay seq that is not 8 bytes")
    return int.from_bytes(seq_bytes, "big"), payload
