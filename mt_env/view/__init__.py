"""A run's recorded trajectories in the browser: a self-contained static page, no server.

    python -m mt_env.view runs/quickstart          # builds runs/quickstart/viewer/index.html and opens it

`build` writes ``index.html`` — the run's curves (``metrics.jsonl``) and a summary row per recorded episode,
embedded, with the page's script and styles — and one ``data/<kind>_<step>.js`` per recorded step file
(`mt_env.trajectories`), which the page loads with a ``<script>`` tag when an episode of that step is opened or
searched (a page opened from ``file://`` may not ``fetch`` its neighbours in Chromium; a script tag may). The index
grows with the number of episodes, never with their tokens: it opens at once however long the episodes are. A
rebuild rewrites the index and only the step scripts older than their step files. See docs/viewer.md.
"""

from __future__ import annotations

from .build import build

__all__ = ["build"]
