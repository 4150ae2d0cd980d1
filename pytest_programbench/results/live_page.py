"""``live.html`` in the run directory while a session runs: a static page that reloads itself every few seconds,
with what the terminal's progress view says (counts, ETA, each task in flight with its phase and clocks), rewritten
by the controller's view as it polls the workers' files; at the end, written once more without the reload, with a
link to report.html. No server: a browser opens the file.

The task names and phases come from the workers' files: every value is escaped (control bytes made printable, then
markup escaped).
"""

from __future__ import annotations

import html
import time
from pathlib import Path

from pytest_programbench.core.atomic import atomic_write_text
from pytest_programbench.text.printable import printable

LIVE_FILE = "live.html"
RELOAD_S = 5  # the page reloads itself this often while the session runs
WRITE_EVERY_S = 2.0  # at most this often (the view polls every second)

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
{refresh}<title>ProgramBench run: {state}</title>
<style>
  body {{ font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #1d2330;
         background: #fafbfc; }}
  h1 {{ font-size: 22px; margin: 0 0 4px; }} .muted {{ color: #6a7385; }}
  pre {{ white-space: pre-wrap; overflow-wrap: anywhere; background: #fff; border: 1px solid #dde2ea;
        border-radius: 6px; padding: 10px; font: 13px/1.5 ui-monospace, "SFMono-Regular", Menlo, monospace; }}
  @media (max-width: 760px) {{ body {{ margin: 10px; }} }}
</style>
</head>
<body>
<h1>ProgramBench run <span id="state" data-state="{state}">{state}</span></h1>
<div class="muted" id="updated">{updated}</div>
<pre id="progress">{lines}</pre>
{end}
</body>
</html>
"""


class LivePage:
    """The page of one run directory; :meth:`write` is called from the view's polling thread."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LIVE_FILE
        self._last = 0.0

    def write(self, lines: list[str], *, finished: bool = False) -> None:
        now = time.monotonic()
        if not finished and now - self._last < WRITE_EVERY_S:
            return
        self._last = now
        state = "finished" if finished else "running"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        updated = (f"finished {stamp}" if finished else
                   f"updated {stamp}; this page reloads every {RELOAD_S} s while the session runs")
        end = ('<p id="end">The session has ended: <a href="report.html">its report</a>.</p>' if finished else "")
        text = "\n".join(html.escape(printable(line)) for line in lines) or "(no task has started yet)"
        atomic_write_text(self.path, _PAGE.format(
            refresh="" if finished else f'<meta http-equiv="refresh" content="{RELOAD_S}">\n', state=state,
            updated=html.escape(updated), lines=text, end=end))
