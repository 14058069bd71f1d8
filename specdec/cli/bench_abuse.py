"""`specdec bench serve --workload abuse` (specdec.bench.serve_abuse) from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from specdec.cli.exit_codes import FAILED, OK, USAGE

__all__ = ["add_abuse_args", "bench_abuse"]


def add_abuse_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the abuse workload (--workload abuse; also --long-prompts, --long-tokens, --engine)")
    g.add_argument(
        "--abuse-token-file",
        default=None,
        metavar="FILE",
        help="client A's bearer token (the wall of long prompts), its first line; without it A sends B's "
        "credentials and the router sees one client (it tells clients apart by token, else by address)",
    )
    g.add_argument("--victim-after", type=float, default=3.0, metavar="S", help="B's request this long after A's")
    g.add_argument("--burst", type=int, default=200, help="calls B sends at once on one channel")
    g.add_argument("--unread-streams", type=int, default=4, help="streams that take one chunk and never read again")
    g.add_argument("--unread-tokens", type=int, default=900, help="max_tokens of a never-reading stream")
    g.add_argument(
        "--unread-wait",
        type=float,
        default=120.0,  # AbuseOptions.unread_wait_s (the CLI loads no grpc: not imported here)
        metavar="S",
        help="how long the never-reading streams read nothing before they read on (the server ends them "
        "router.stream_write_timeout_s after a write blocks; with --server-log the wait ends once it has)",
    )
    g.add_argument(
        "--kill-target",
        type=int,
        default=None,
        metavar="PID",
        help="also the restart scenario: SIGKILL to this target worker process (on this machine) while "
        "--restart-streams streams of --restart-tokens prompt tokens run; the stall against their prefill",
    )
    g.add_argument("--restart-streams", type=int, default=2, help="restart: concurrent long streams")
    g.add_argument("--restart-tokens", type=int, default=3500, help="restart: prompt tokens per stream")
    g.add_argument("--restart-max-tokens", type=int, default=64, help="restart: tokens each stream generates")
    g.add_argument(
        "--server-log",
        default=None,
        metavar="PATH",
        help="the service's log file (its stderr, access log included): the never-reading streams' access "
        "lines by status, and the ERROR lines the run left",
    )


def _progress(msg: str) -> None:
    print(f"... {msg}", file=sys.stderr, flush=True)


def _reference(args: argparse.Namespace, info: dict):
    """The one-forward prefill of the wall's prompts in this process (--engine), or None."""
    if not args.engine:
        return None
    from specdec.core.model_source import local_files

    target = args.engine_target or info["target"]
    local_files(target)  # its files must be here: say so now, not after the service scenarios
    dtype = args.engine_dtype or info.get("dtype") or "float32"

    def reference(prompts: list[list[int]]) -> dict:
        from specdec.bench.runner import unchunked_prefills

        return unchunked_prefills(target, prompts, dtype=dtype, threads=args.engine_threads, progress=_progress)

    return reference


def bench_abuse(args: argparse.Namespace, prompts, address: str) -> int:
    import grpc

    from specdec.bench import serve as bs
    from specdec.bench.serve_abuse import AbuseOptions
    from specdec.bench.serve_abuse import bench_abuse as run
    from specdec.bench.serve_abuse_report import format_abuse
    from specdec.bench.serve_restart import RestartOptions
    from specdec.rpc.client_credentials import ClientCredentials

    options = AbuseOptions(
        long_prompts=AbuseOptions.long_prompts if args.long_prompts is None else args.long_prompts,
        long_tokens=AbuseOptions.long_tokens if args.long_tokens is None else args.long_tokens,
        victim_after_s=args.victim_after,
        burst=args.burst,
        unread_streams=args.unread_streams,
        unread_tokens=args.unread_tokens,
        unread_wait_s=args.unread_wait,
        timeout=args.timeout,
        warmup=not args.no_warmup,
    )
    restart = None
    try:
        options.check()
        if args.kill_target is not None:
            ro = RestartOptions(
                streams=args.restart_streams,
                tokens=args.restart_tokens,
                max_tokens=args.restart_max_tokens,
                timeout=args.timeout,
            )
            ro.check()
            restart = (args.kill_target, ro)
        if args.server_log and not os.path.isfile(args.server_log):
            raise ValueError(f"--server-log {args.server_log}: no such file")
        abuse_credentials = None
        if args.abuse_token_file:
            abuse_credentials = ClientCredentials.load(
                args.abuse_token_file, None, tls=args.tls, ca=args.ca, cert=args.cert, key=args.key
            )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE
    try:
        info = bs.server_info(address, args.credentials)
    except (ConnectionError, bs.BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    try:
        reference = _reference(args, info)
    except Exception as exc:  # noqa: BLE001 - the model's files are not here: which flag fixes it
        print(f"error: --engine needs the target's files here ({exc}); point --engine-target at them", file=sys.stderr)
        return USAGE
    url = args.metrics_url
    url = f"http://{address.rsplit(':', 1)[0]}:9400/metrics" if url == "auto" else None if url == "none" else url
    try:
        result = run(
            address,
            prompts,
            options,
            credentials=args.credentials,
            abuse_credentials=abuse_credentials,
            metrics_url=url,
            server_log=args.server_log,
            reference=reference,
            restart=restart,
            progress=_progress,
        )
    except ConnectionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return FAILED
    except grpc.RpcError as exc:  # a call the scenarios need (Tokenize) was refused: credentials, a wrong server
        print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return FAILED
    result["server"] = info
    print(format_abuse(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}", file=sys.stderr)
    return OK
