"""Text the harness shows: sizes written and read as people do (``64m``, ``1.5 GiB``), and names or output from a
sandbox or a hostile submission made printable (control bytes as ``\\x1b``, undecodable bytes as ``\\xNN``) before
they reach a report, a JUnit property, a message, a log, summary.json or the terminal."""
