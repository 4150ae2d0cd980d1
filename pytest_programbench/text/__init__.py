"""Text the harness shows: sizes written and read as people do (``64m``, ``1.5 GiB``), and names or output from a
hostile submission made printable (undecodable bytes as ``\\xNN``) before they reach a report, a JUnit property, a
message, summary.json or the terminal."""
