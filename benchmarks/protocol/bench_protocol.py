"""Daemon round trips: the wire protocol, and what CacheEngine and the vLLM scheduler cost.

Every section starts its own `lmcached serve` and, as the baseline measured in the same
run, a raw Unix-socket echo server (selectors, non-blocking, one subprocess) that echoes a
4-byte-length-prefixed frame as large as the section's requests. Ops are interleaved in
rounds so that the echo baseline and the daemon ops see the same machine conditions, and
timed twice: with the client, the daemon and the echo server pinned to one CPU (the
software path alone: a wake-up across CPUs costs ~40-50 us on these VMs and the scheduler
places the two servers differently from run to run), then unpinned.

This script parses the options and runs the sections; each lives in its own module:
  wire                     protocol_wire.py: PING, LOOKUP, ACQUIRE+RELEASE, ALLOC+COMMIT
                           of 64 chunks by one blocking client, then N client processes
  engine, scheduler        protocol_round_trips.py: round trips per operation of
  (round-trips = both)     CacheEngine and the vLLM connector's scheduler side
  shared                   protocol_harness.py (private servers, CPU placement, stats),
                           protocol_echo.py (the raw echo server and its client)

    python -m benchmarks.protocol.bench_protocol [--section all|wire|round-trips|engine|scheduler]
                                        [--quick] [--iterations N] [--clients 8] [--json PATH]

The daemons and echo servers are always stopped (SIGTERM, then SIGKILL by pid);
no socket and no /dev/shm/lmcached.* segment is left behind.
"""

import argparse
import json
import sys
import time

from benchmarks.protocol.protocol_round_trips import run_round_trips
from benchmarks.protocol.protocol_wire import run_wire

SECTIONS = ("all", "wire", "round-trips", "engine", "scheduler")


def main() -> int:
    """Run the sections `--section` names; exit status 1 if any left something behind."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Prints, per section, a table of p50/p99 latencies and their ratio to the raw "
               "echo round trip measured in the same run; the wire section also says whether "
               "LOOKUP-64 is within 2x of it, the engine and scheduler sections how many "
               "round trips each op costs.",
    )
    parser.add_argument("--section", choices=SECTIONS, default="all",
                        help="what to measure: the wire protocol, the engine's and the vLLM "
                             "scheduler's round trips (round-trips = both), or all [all]")
    parser.add_argument("--quick", action="store_true",
                        help="fewer iterations (each of wire and round-trips then runs "
                             "in under ~35 s on 2 busy cores)")
    parser.add_argument("--iterations", type=int,
                        help="timed iterations per single-client op [default: wire 10000, "
                             "round-trips 5000; quick 2000 and 600]")
    parser.add_argument("--rounds", type=int,
                        help="interleaved rounds the iterations are split into "
                             "[default 10, quick 4]")
    parser.add_argument("--clients", type=int, default=8,
                        help="concurrent client processes of the wire section [default 8]")
    parser.add_argument("--client-iterations", type=int,
                        help="timed iterations per op per concurrent client "
                             "[default 3000, quick 1000]")
    parser.add_argument("--json", metavar="PATH",
                        help="also write the engine and scheduler figures to PATH as JSON")
    args = parser.parse_args()

    started = time.monotonic()
    leftovers: list[str] = []
    if args.section in ("all", "wire"):
        run_wire(args, leftovers)
        print()
    engine = args.section in ("all", "round-trips", "engine")
    scheduler = args.section in ("all", "round-trips", "scheduler")
    if engine or scheduler:
        result = run_round_trips(args, engine, scheduler, leftovers)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    print(f"total {time.monotonic() - started:.1f} s; leftovers: "
          f"{', '.join(leftovers) if leftovers else 'none'}")
    return 0 if not leftovers else 1


if __name__ == "__main__":
    sys.exit(main())
