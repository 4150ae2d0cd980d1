"""Model relay overhead: the scripted model server called directly against the same server through the relay.

    python bench/bench_relay.py [--requests N] [--api chat|responses|anthropic]

Per request (streamed, the shape each CLI agent uses) on one keep-alive connection: the time to the first
server-sent event and to the last byte, directly and through :class:`ModelRelay` (its TCP listener, as host-loop
agents reach it; the sandbox bridge adds one more loopback hop). Prints median and p90 of each and the relay's added
time; the target is < 2 ms added and no added delay to the first event. Writes JSON to
``bench/results/bench_relay-<UTC>.json``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pytest_programbench.relay.relay import ModelRelay
from tests.scripted_models import ScriptedModels, Step

PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}


def measure(address: tuple[str, int], api: str, count: int) -> tuple[list[float], list[float]]:
    first, total = [], []
    conn = http.client.HTTPConnection(*address, timeout=60)
    body = json.dumps({"model": "m", "stream": True, "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": "hi"}], "input": []}).encode()
    for _ in range(count):
        started = time.perf_counter()
        conn.request("POST", PATHS[api], body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        line = response.readline()  # the first event's first line
        first.append(time.perf_counter() - started)
        assert line, "no event"
        response.read()
        total.append(time.perf_counter() - started)
        if response.will_close:  # the scripted server closes after each stream
            conn.close()
            conn = http.client.HTTPConnection(*address, timeout=60)
    conn.close()
    return first, total


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"median_ms": round(statistics.median(ordered) * 1000, 3),
            "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--api", choices=sorted(PATHS), default="chat")
    args = parser.parse_args()
    steps = [Step("hello", None, 10, 2)]
    with ScriptedModels(steps) as server, ModelRelay(server.base_url, unix=False, tcp=True) as relay:
        direct_address = ("127.0.0.1", int(server.base_url.split(":")[2].split("/")[0]))
        relay_address = relay.tcp_address
        assert relay_address is not None
        measure(direct_address, args.api, 20)  # warm-up
        measure(relay_address, args.api, 20)
        direct = measure(direct_address, args.api, args.requests)
        relayed = measure(relay_address, args.api, args.requests)
    result = {"api": args.api, "requests": args.requests,
              "direct": {"first_event": summary(direct[0]), "total": summary(direct[1])},
              "relay": {"first_event": summary(relayed[0]), "total": summary(relayed[1])}}
    result["added_ms"] = {kind: {stat: round(result["relay"][kind][stat] - result["direct"][kind][stat], 3)
                                 for stat in ("median_ms", "p90_ms")} for kind in ("first_event", "total")}
    print(json.dumps(result, indent=2))
    out = Path(__file__).parent / "results" / f"bench_relay-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
