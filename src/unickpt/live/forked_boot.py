"""Imported first by ``unickpt launch``'s fork server (:mod:`.forked`), and only there.

The server dies with the launcher that started it (so its forked workers, which die with
the server, never outlive a lost node's launcher), and ignores the signals that stop a
job: it shares the launcher's process group, so a Ctrl-C, or SLURM's SIGTERM or SIGUSR1,
sent to that group reaches it too, and the launcher forwards them to its workers itself
(each forked worker restores Python's own handling of them, :data:`forked.STOP_SIGNALS`)."""

import signal

from .forked import STOP_SIGNALS, die_with_parent

die_with_parent()
for _sig in STOP_SIGNALS:
    signal.signal(_sig, signal.SIG_IGN)
