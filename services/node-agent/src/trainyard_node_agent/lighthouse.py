"""A fault-tolerant job's torchft Lighthouse, as a process of its own: ``python -m trainyard_node_agent.lighthouse``.

The Lighthouse is torchft's quorum server (Rust, in ``torchft._torchft``): each replica's Manager asks it for the
quorum of every step. It keeps no state a restart loses (the managers ask again). The node agent that hosts a
fault-tolerant attempt's rank 0 runs one per attempt (:class:`~trainyard_node_agent.replicas.Lighthouses`). The
extension module is loaded alone, without the ``torchft`` package (which imports torch): ~15 MB, not ~400.
It dies with the agent that started it (``PR_SET_PDEATHSIG``); the next agent starts it again.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import signal
import sys
import threading
from pathlib import Path
from types import ModuleType


def load_extension() -> ModuleType:
    """``torchft._torchft`` without importing the ``torchft`` package (and torch)."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("torchft is not installed on this node (pip install torchft==0.2.0)")
    for directory in spec.submodule_search_locations:
        for path in sorted(Path(directory).glob("_torchft*.so")):
            ext = importlib.util.spec_from_file_location("torchft._torchft", path)
            if ext is not None and ext.loader is not None:
                module = importlib.util.module_from_spec(ext)
                ext.loader.exec_module(module)
                return module
    raise ImportError("torchft is installed without its _torchft extension")


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainyard_node_agent.lighthouse",
        description="Run one fault-tolerant job's torchft Lighthouse until SIGTERM (the node agent starts it).")
    parser.add_argument("--bind", required=True, help="host:port to listen on, e.g. 0.0.0.0:29517")
    parser.add_argument("--min-replicas", type=int, required=True, help="fewest replicas a quorum may have")
    parser.add_argument("--join-timeout-ms", type=int, default=100,
                        help="how long a quorum waits for more replicas to join once min-replicas are there")
    parser.add_argument("--quorum-tick-ms", type=int, default=100)
    parser.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                        help="a replica silent this long is left out of the next quorum")
    args = parser.parse_args(argv)
    _die_with_parent()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    ext = load_extension()
    server = ext.LighthouseServer(bind=args.bind, min_replicas=args.min_replicas,
                                  join_timeout_ms=args.join_timeout_ms, quorum_tick_ms=args.quorum_tick_ms,
                                  heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    print(f"lighthouse listening on {args.bind} (min replicas {args.min_replicas})", flush=True)
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
