"""``unickpt launch``'s command line: torchrun's flags (torchrun's names, both spellings)
and live recovery's, one Typer command, resolved into a typed
:class:`~.launch_args.LaunchArgs` for :func:`~.launch.run_node`.

:mod:`unickpt.cli` registers :func:`launch` as its ``launch`` command; :func:`parse` reads
a command line through the same command without starting anything. Everything after the
script's path is the script's, untouched, even tokens that look like launcher flags
(``allow_interspersed_args=False``); a ``--`` before the script ends the launcher's flags
(torchrun's). Errors are usage errors: exit 2 and one line on stderr saying why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated, Any, NoReturn

import typer

from .launch_args import JOIN_TIMEOUT_S, MASTER_PORT, RDZV_PORT, SHUTDOWN_TIMEOUT_S, SIGNALS_TO_HANDLE, LaunchArgs

PROG = "unickpt launch"

# torchrun flags unickpt launch does not take: why, and what to do instead (one line each)
REFUSED = {
    "--local-addr": "the workers reach the job's store at --master-addr/--rdzv-endpoint: drop --local-addr",
    "--logs-specs": "use --log-dir, --tee and --redirects (torchrun's default logs spec)",
    "--run-path": "give the script's path (or -m MODULE) instead of --run-path",
    "--local-ranks-filter-regex": "use --local-ranks-filter 0,1",
    "--numa-binding": "bind the workers yourself (numactl in --no-python mode)",
    "--event-log-handler": "unickpt launch prints its events on stderr: drop the flag",
    "--virtual-local-rank": "every worker sees its own LOCAL_RANK: drop the flag",
}
RDZV_CONF_TAKEN = {"join_timeout", "read_timeout", "is_host"}

# \b: a paragraph the help prints as written (not re-wrapped)
EPILOG = """\
\b
multi-node: on every node
  unickpt launch --nnodes 2 --node-rank N --rdzv-backend c10d --rdzv-endpoint HOST:PORT train.py
  (HOST:PORT: node 0's address, where its launcher hosts the job's store; torchrun's
  --master-addr/--master-port spelling works too). Generation 0 starts once every node
  joined; a node missing after --join-timeout ends the job (exit 1, named), as does a
  worker not at unickpt.run --join-timeout after its peers gathered.
  torchrun's flags are read from PET_<FLAG> too when not given (PET_NNODES,
  PET_NODE_RANK, PET_MASTER_ADDR, ...: as Kubeflow's PyTorchJob sets them).

\b
output: every worker line comes whole, as "[rankN]: ..." (torchrun's --tee prefix).

\b
Ctrl-C / SIGTERM (and SIGHUP, SIGQUIT: --signals-to-handle): forwarded once to every worker
(each in its own process group), SIGKILL after --shutdown-timeout; exit 128 + the
signal (130 / 143). The snapshots a node's keeper holds stay in
memory: the same command resumes from them; `unickpt snapshots --free` frees them.
"""

SETTINGS: dict[str, Any] = {
    "allow_interspersed_args": False,  # the first positional is the script: the rest is its own
    "help_option_names": ["-h", "--help"],
}
# what `unickpt launch` is, for unickpt.cli's registration and this module's own command
COMMAND: dict[str, Any] = {
    "name": "launch",
    "short_help": "Start a node's workers (torchrun's flags); survivors of a failure go on, same processes.",
    "epilog": EPILOG,
    "context_settings": SETTINGS,
}


def _pet(*names: str, **kwargs: Any) -> Any:
    """One of torchrun's options, which torchrun also reads from ``PET_<NAME>`` (its
    ``--nproc-per-node`` from ``PET_NPROC_PER_NODE``, as Kubeflow's PyTorchJob sets them)
    when the command line does not give it: the same here, so that a platform that
    configures torchrun through the environment configures unickpt launch the same way."""
    long = next(n for n in names if n.startswith("--"))
    return typer.Option(*names, envvar="PET_" + long[2:].replace("-", "_").upper(), show_envvar=False, **kwargs)


def _nnodes(text: Any) -> int:
    """torchrun's ``--nnodes``: N, or N:N (an elastic MIN:MAX range is refused, saying why)."""
    text = str(text)
    lo, sep, hi = text.partition(":")
    if not lo.strip().isdigit() or (sep and hi.strip() != lo.strip()):
        raise typer.BadParameter(
            f"{text!r}: unickpt launch starts on exactly N nodes (--nnodes N); an elastic MIN:MAX range is live "
            "recovery here: the job goes on without a lost node (down to --min-ranks ranks) and a node started "
            "again joins it")
    return int(lo)


def _refuse(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
    """A torchrun flag unickpt launch does not take: a usage error saying why (eager: before
    any other error of the command line)."""
    if value not in (None, False):
        flag = next(o for o in param.opts if o in REFUSED)
        source = ctx.get_parameter_source(param.name or "")
        given = f" (given by ${param.envvar})" if source is not None and source.name == "ENVIRONMENT" else ""
        ctx.fail(f"{flag} is not supported{given}: {REFUSED[flag]}")
    return value


def _refused(flag: str) -> Any:
    """The hidden option of a REFUSED flag, torchrun's spellings (a value, or none where the
    parameter is a bool: torchrun's flags)."""
    names = sorted({flag, "--" + flag[2:].replace("-", "_")})
    return _pet(*names, hidden=True, is_eager=True, callback=_refuse, show_default=False)


def launch(
    ctx: typer.Context,
    script: Annotated[str, typer.Argument(metavar="SCRIPT", show_default=False,
                                          help="the training script (a path; with -m a module; with --no-python a program)")],
    script_args: Annotated[list[str] | None, typer.Argument(metavar="SCRIPT_ARGS", show_default=False,
                                                            help="the script's arguments, passed through untouched")] = None,
    standalone: Annotated[bool, _pet("--standalone", help="one node, the store on a free local port")] = False,
    nnodes: Annotated[int, _pet("--nnodes", parser=_nnodes, metavar="N", help="the job's nodes: N (or torchrun's N:N)")] = 1,
    node_rank: Annotated[int | None, _pet(
        "--node-rank", "--node_rank", metavar="N", show_default=False,
        help="this node's index, 0 .. nnodes-1 (node 0 hosts the job's store; needed with --nnodes > 1)")] = None,
    master_addr: Annotated[str, _pet("--master-addr", "--master_addr", metavar="HOST", help="node 0's address")] = "127.0.0.1",
    master_port: Annotated[int, _pet("--master-port", "--master_port", metavar="PORT", help="the job's store port on node 0")] = MASTER_PORT,
    rdzv_backend: Annotated[str, _pet("--rdzv-backend", "--rdzv_backend", metavar="BACKEND",
                                              help="c10d (or static): the job's store on node 0 at --rdzv-endpoint")] = "static",
    rdzv_endpoint: Annotated[str, _pet(
        "--rdzv-endpoint", "--rdzv_endpoint", show_default=False, metavar="HOST[:PORT]",
        help=f"node 0's address (port {RDZV_PORT} when left out): same as --master-addr/--master-port")] = "",
    rdzv_id: Annotated[str, _pet("--rdzv-id", "--rdzv_id", metavar="ID",
                                         help="the job's id (TORCHELASTIC_RUN_ID; names --log-dir's folder)")] = "none",
    rdzv_conf: Annotated[str, _pet(
        "--rdzv-conf", "--rdzv_conf", show_default=False, metavar="KEY=VALUE,...",
        help="join_timeout (as --join-timeout), read_timeout and is_host are taken; others refused")] = "",
    nproc_per_node: Annotated[str, _pet(
        "--nproc-per-node", "--nproc_per_node", metavar="N",
        help="workers on this node: N, gpu (one per GPU), cpu (one per CPU) or auto (gpu when there are GPUs, else cpu)")] = "1",
    max_restarts: Annotated[int, _pet(
        "--max-restarts", "--max_restarts", metavar="N",
        help="a script under unickpt.run: replacement workers this node may start over the job (they join the "
             "survivors); a plain script: times the whole group is restarted after a failure (torchrun's)")] = 0,
    hang_timeout: Annotated[float | None, typer.Option(
        "--hang-timeout", metavar="SECONDS", show_default=False,
        help="kill a worker of unickpt.run that shows no progress for this many seconds while stopped (its beats "
             "thread silent too); 0: never [default: 30, or half of $UNICKPT_LIVE_PG_TIMEOUT when that is shorter]")] = None,
    min_ranks: Annotated[int, typer.Option("--min-ranks", metavar="N", help="end the job below this many ranks")] = 1,
    store: Annotated[str | None, typer.Option(
        "--store", metavar="HOST:PORT", show_default=False,
        help="the job's store, hosted by `unickpt store --port PORT` on HOST (which also coordinates the job): no "
             "node hosts it, so the loss of node 0 is a node loss like any other")] = None,
    join_timeout: Annotated[float, typer.Option(
        "--join-timeout", metavar="SECONDS", help="seconds generation 0 waits for every node to join (torchrun's default), and a "
                "generation's members for one that never reaches unickpt.run")] = JOIN_TIMEOUT_S,
    shutdown_timeout: Annotated[float, _pet(
        "--shutdown-timeout", "--shutdown_timeout", metavar="SECONDS",
        help="after a handled signal (Ctrl-C, SIGTERM), seconds before the workers are killed")] = SHUTDOWN_TIMEOUT_S,
    monitor_interval: Annotated[float | None, _pet(
        "--monitor-interval", "--monitor_interval", metavar="SECONDS", show_default=False,
        help="accepted for torchrun's command lines; not needed: exits are seen at once (SIGCHLD)")] = None,
    start_method: Annotated[str, _pet(
        "--start-method", "--start_method", metavar="METHOD",
        help="spawn: every worker a fresh interpreter (torchrun's default); forkserver: every worker (a replacement "
             "too) forked from a server that imported torch, torch.distributed and FSDP once, while the nodes "
             "joined (and the --preload modules): it starts in a fraction of a second")] = "spawn",
    preload: Annotated[str, typer.Option(
        "--preload", metavar="MODULE,...", show_default=False,
        help="with --start-method forkserver: also import these modules in the server, e.g. lightning,transformers "
             "(none may initialise a GPU at import)")] = "",
    tee: Annotated[str, _pet(
        "-t", "--tee", metavar="STREAMS", help="also write these streams to per-rank files under --log-dir: 0 none, 1 stdout, 2 stderr, "
                            "3 both, or LOCAL:VALUE,... per local rank")] = "0",
    redirects: Annotated[str, _pet(
        "-r", "--redirects", metavar="STREAMS", help="write these streams to the per-rank files only, not the console (values as --tee)")] = "0",
    log_dir: Annotated[str | None, _pet(
        "--log-dir", "--log_dir", metavar="DIR", show_default=False,
        help="where per-rank files go: LOG_DIR/RDZV_ID_XXXXXXXX/attempt_N/LOCAL_RANK/{stdout,stderr}.log (default: a new "
             "temporary folder, named on stderr)")] = None,
    local_ranks_filter: Annotated[str | None, _pet(
        "--local-ranks-filter", "--local_ranks_filter", metavar="RANKS", show_default=False,
        help="show only these local ranks' lines on the console (0,1); the files keep all")] = None,
    signals_to_handle: Annotated[str, _pet(
        "--signals-to-handle", "--signals_to_handle", metavar="SIGNALS",
        help="the signals that stop the job (forwarded once to every worker; exit 128 + the signal), e.g. "
             "add SIGUSR1 for SLURM")] = SIGNALS_TO_HANDLE,
    duplicate_stdout_filters: Annotated[str, _pet(
        "--duplicate-stdout-filters", "--duplicate_stdout_filters", metavar="TEXT,...", show_default=False,
        help="also write the workers' stdout lines holding one of these texts (',,' for a comma) to "
             "<log-dir>/<rdzv-id>_XXXXXXXX/attempt_<n>/filtered_stdout.log")] = "",
    duplicate_stderr_filters: Annotated[str, _pet(
        "--duplicate-stderr-filters", "--duplicate_stderr_filters", metavar="TEXT,...", show_default=False,
        help="the same for stderr lines: filtered_stderr.log")] = "",
    no_python: Annotated[bool, _pet(
        "--no-python", "--no_python", help="run the script as a program, not with python (its interpreter is the user's)")] = False,
    module: Annotated[bool, _pet("-m", "--module", help="run the script as a module (python -m)")] = False,
    role: Annotated[str, _pet("--role", metavar="NAME", help="the workers' role, their ROLE_NAME (torchrun's; "
                                                         "every worker has the one role)")] = "default",
    local_addr: Annotated[str | None, _refused("--local-addr")] = None,
    logs_specs: Annotated[str | None, _refused("--logs-specs")] = None,
    run_path: Annotated[bool, _refused("--run-path")] = False,
    local_ranks_filter_regex: Annotated[str | None, _refused("--local-ranks-filter-regex")] = None,
    numa_binding: Annotated[str | None, _refused("--numa-binding")] = None,
    event_log_handler: Annotated[str | None, _refused("--event-log-handler")] = None,
    virtual_local_rank: Annotated[bool, _refused("--virtual-local-rank")] = False,
) -> None:
    """torchrun's static launch, where a failure costs the survivors nothing: one launcher a
    node starts the node's workers with torchrun's environment (a plain torch script runs
    unchanged); under unickpt.run the survivors of a lost worker or node go on, the same
    processes. Example: unickpt launch --standalone --nproc-per-node 4 train.py --lr 1e-3"""
    from .output import parse_filter, parse_needles, parse_std  # here: every unickpt command imports this module

    if start_method not in ("spawn", "forkserver"):
        ctx.fail(f"--start-method {start_method} is not supported: the launcher runs threads and hosts the job's "
                 "store, so it never forks itself; use forkserver (workers forked from a server that imported torch) "
                 "or spawn (fresh interpreters, torchrun's default)")
    modules = tuple(m.strip() for m in preload.split(",") if m.strip())
    if modules and start_method != "forkserver":
        ctx.fail("--preload needs --start-method forkserver (a spawned worker imports what it needs itself)")
    if start_method == "forkserver" and no_python:
        ctx.fail("--start-method forkserver runs a Python script or module: not with --no-python")
    from .forked import missing_modules

    if missing := missing_modules(list(modules)):
        ctx.fail(f"--preload: no module named {', '.join(missing)} in this environment")
    if no_python and module:
        ctx.fail("--no-python and -m exclude each other (torchrun's rule)")
    if min_ranks < 1 or max_restarts < 0 or join_timeout <= 0 or shutdown_timeout < 0 or (hang_timeout or 0) < 0:
        ctx.fail("need --min-ranks >= 1, --max-restarts >= 0, --join-timeout > 0, --shutdown-timeout >= 0 and "
                 "--hang-timeout >= 0 (0: never)")
    try:
        tee_spec, redirects_spec = parse_std(tee, "--tee"), parse_std(redirects, "--redirects")
        local_filter = parse_filter(local_ranks_filter)
        signals = _signals(signals_to_handle)
    except ValueError as e:
        ctx.fail(str(e))
    duplicate = {name: needles for name, text in (("stdout", duplicate_stdout_filters), ("stderr", duplicate_stderr_filters))
                 if (needles := parse_needles(text))}
    where = _rendezvous(ctx, nnodes, node_rank, master_addr, master_port, rdzv_backend, rdzv_endpoint, rdzv_conf, store,
                        standalone, join_timeout)
    if log_dir is not None:  # checked before any worker starts (a failure there left a worker without its launcher)
        _check_log_dir(ctx, log_dir)
    if not role.strip():
        ctx.fail("--role needs a name")
    args = LaunchArgs(script=script, script_args=list(script_args or ()), module=module, no_python=no_python, role=role,
                      standalone=standalone, store=store, rdzv_id=rdzv_id, nproc_per_node=_nproc(ctx, nproc_per_node),
                      max_restarts=max_restarts, hang_timeout=hang_timeout, min_ranks=min_ranks,
                      shutdown_timeout=shutdown_timeout, log_dir=log_dir, tee_spec=tee_spec,
                      redirects_spec=redirects_spec, local_filter=local_filter, signals=signals,
                      duplicate=duplicate, start_method=start_method, preload=modules, **where)
    if args.min_ranks > args.nnodes * args.nproc_per_node:
        ctx.fail(f"--min-ranks {args.min_ranks} is more than the job's {args.nnodes * args.nproc_per_node} rank(s) "
                 f"(--nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node}): it could never train")
    if callable(ctx.obj):  # parse(): the resolved arguments, nothing started
        raise typer.Exit(ctx.obj(args) or 0)
    from .launch import run_node

    raise typer.Exit(run_node(args))


def _rendezvous(ctx: typer.Context, nnodes: int, node_rank: int | None, master_addr: str, master_port: int,
                rdzv_backend: str, rdzv_endpoint: str, rdzv_conf: str, store: str | None, standalone: bool,
                join_timeout: float) -> dict[str, Any]:
    """torchrun's rendezvous flags onto the static ones: the job's store on node 0 (or at
    ``--store``). Returns LaunchArgs' nnodes, node_rank, master_addr, master_port and
    join_timeout."""
    if rdzv_backend not in ("static", "c10d"):
        ctx.fail(f"--rdzv-backend {rdzv_backend} is not supported: unickpt launch's rendezvous is node 0's c10d "
                 "store; use --rdzv-backend c10d --rdzv-endpoint HOST:PORT (node 0's address)")
    if rdzv_endpoint:
        host, sep, port = rdzv_endpoint.rpartition(":")
        if sep and not port.isdigit() and not rdzv_endpoint.endswith("]"):  # [v6] alone takes the default port
            ctx.fail(f"--rdzv-endpoint {rdzv_endpoint}: the port {port!r} is not a number (HOST:PORT, or HOST for "
                     f"port {RDZV_PORT})")
        if not sep or not port.isdigit():
            host, port = rdzv_endpoint, str(RDZV_PORT)
        master_addr, master_port = host or "127.0.0.1", int(port)
    for item in filter(None, (x.strip() for x in rdzv_conf.split(","))):
        name, _, value = item.partition("=")
        if name not in RDZV_CONF_TAKEN:
            ctx.fail(f"--rdzv-conf {name} is not supported: unickpt launch waits for exactly --nnodes nodes "
                     f"(--join-timeout); it takes {', '.join(sorted(RDZV_CONF_TAKEN))}")
        if name == "join_timeout":
            try:
                join_timeout = float(value)
            except ValueError:
                ctx.fail(f"--rdzv-conf join_timeout={value!r}: expected seconds")
    if store is not None:  # the store (and coordinator) on a host of its own: `unickpt store`
        host, sep, port = store.rpartition(":")
        if not host or not sep or not port.isdigit():
            ctx.fail(f"--store {store}: expected HOST:PORT (where `unickpt store --port PORT` runs)")
        if standalone:
            ctx.fail("--store and --standalone: --standalone hosts the store in this launcher; give one of them")
        master_addr, master_port = host, int(port)
    if standalone:
        if nnodes != 1:
            ctx.fail(f"--standalone runs one node, not --nnodes {nnodes}: give --nnodes {nnodes} with --node-rank and "
                     "--rdzv-endpoint (or --master-addr/--master-port) on each node instead")
        nnodes, node_rank, master_addr, master_port = 1, 0, "127.0.0.1", 0
    if not 0 <= master_port <= 65535:
        ctx.fail(f"port {master_port} (--master-port or --rdzv-endpoint) is not a TCP port: give 1-65535")

    if node_rank is None:
        if nnodes > 1:
            ctx.fail(f"--nnodes {nnodes} needs --node-rank N on every node (0 on the node at {master_addr}, which "
                     "hosts the job's store)")
        node_rank = 0
    if not 0 <= node_rank < nnodes:
        ctx.fail(f"need 0 <= --node-rank < --nnodes, not --node-rank {node_rank} with --nnodes {nnodes}")
    return {"nnodes": nnodes, "node_rank": node_rank, "master_addr": master_addr, "master_port": master_port,
            "join_timeout": join_timeout}


def _check_log_dir(ctx: typer.Context, log_dir: str) -> None:
    """--log-dir is a directory this launcher can write in, or one it can make (its nearest
    existing parent is a writable directory); else a usage error. Nothing is created here."""
    there = os.path.abspath(log_dir)
    while not os.path.lexists(there):
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        ctx.fail(f"--log-dir {log_dir}: {there} is not a directory")
    if not os.access(there, os.W_OK | os.X_OK):
        ctx.fail(f"--log-dir {log_dir}: {there} is not writable")


def _signals(text: str) -> tuple[int, ...]:
    """torchrun's ``--signals-to-handle``: signal names separated by commas (``SIGTERM``);
    ValueError for a name that is no signal, or one a process cannot handle (SIGKILL,
    SIGSTOP) or that the launcher needs for itself (SIGCHLD)."""
    import signal

    out = []
    for name in filter(None, (x.strip() for x in text.split(","))):
        sig = signal.Signals.__members__.get(name.upper())
        if sig is None or sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            why = "is no signal name" if sig is None else "cannot be handled here"
            raise ValueError(f"--signals-to-handle {text!r}: {name} {why}; give names like SIGTERM,SIGINT,SIGUSR1")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


def _nproc(ctx: typer.Context, text: str) -> int:
    """torchrun's --nproc-per-node: N, gpu, cpu or auto."""
    if text.isdigit() and int(text) >= 1:
        return int(text)
    if text in ("gpu", "auto"):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
        if text == "gpu":
            ctx.fail("--nproc-per-node gpu: this node has no CUDA GPU (use a number, cpu or auto)")
    if text in ("cpu", "auto"):
        return os.cpu_count() or 1
    source = ctx.get_parameter_source("nproc_per_node")
    given = " (given by $PET_NPROC_PER_NODE)" if source is not None and source.name == "ENVIRONMENT" else ""
    ctx.fail(f"--nproc-per-node {text!r}{given}: expected a number >= 1, gpu, cpu or auto")


_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
_app.command(**COMMAND)(launch)


def parse(argv: list[str]) -> LaunchArgs:
    """``argv`` (what follows ``unickpt launch``) read by the command, nothing started: the
    resolved arguments. A usage error, or ``--help``, exits as the command does (SystemExit:
    2 with the reason on stderr; 0 with the help on stdout)."""
    got: list[LaunchArgs] = []
    try:
        main(argv, run=got.append)
    except SystemExit:
        if not got:
            raise
    return got[0]


def main(argv: list[str] | None = None, run: Callable[[LaunchArgs], Any] | None = None) -> NoReturn:
    """``unickpt launch`` on its own (``python -m unickpt.live.launch_cli ARGS``): exits with
    the launcher's status. ``run`` replaces :func:`~.launch.run_node` (the tests' parse)."""
    typer.main.get_command(_app).main(args=argv, prog_name=PROG, obj=run)
    raise AssertionError  # main exits (standalone mode)


if __name__ == "__main__":
    main()
