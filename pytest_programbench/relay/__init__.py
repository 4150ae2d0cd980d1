"""The model relay: the agent's only way out of its sandbox, and the meter of what it spent.

``relay`` (:class:`ModelRelay`, one per task) takes each call from ``server`` (the agent-facing HTTP/1.1 server,
h11's wire work, its caps and refusals), checks it against ``apis`` (the model calls it forwards, in one table, and
the cleanroom rule) with ``body_scan`` (what a body asks the provider to do, read in one bounded pass), and forwards
it through ``upstream`` (the one place it goes, the httpx client and the retry policy). On the way: ``budget`` bounds
the request bytes held at once, ``slots`` the requests in flight across the run (``--pb-model-concurrency``),
``rate`` its requests and tokens per minute, ``spend`` what it spent against ``--pb-budget``; ``held`` counts the
seconds the harness held a request back (given back to the agent's clock). ``metering`` reads each response's usage
and tool calls, ``recording`` keeps one record per request and their sum, bounded by ``records``; ``replay`` records
a conversation and answers it again offline. Into the sandbox: ``relay_tunnel`` (one ``docker exec`` carrying every
connection) and ``relay_bridge`` (stdlib-only, Python 3.7, run inside the sandbox).
"""
