"""The engine's KV cache events: `subscribers.py` the subscribers of every rank (`KvEvents`),
`rank.py` one rank's sockets and replays, `state.py` a rank's blocks and clears, `wire.py` the
wire formats, `index.py` the block index between resets and its setup, `witness.py` the events
witness of a reset."""
