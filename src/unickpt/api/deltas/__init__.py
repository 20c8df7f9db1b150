"""The per-step delta log, behind ``CheckpointManager(log_deltas=True)``: :mod:`.log` keeps
the entries on disk (each an ordinary checkpoint; written in the background, folded away
once a full checkpoint covers them, the replayable run found and verified), :mod:`.replay`
says what a step's entry holds, captures it and replays it in any loop."""

__all__: list[str] = []
