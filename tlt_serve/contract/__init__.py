"""The contract between the HTTP front end and an engine process, imported by both sides.

- ``messages.py``: what travels on the pipe (requests, aborts, step batches, start-up).
- ``controls.py``: one typed message per control and per reply, the control error.
- ``reports.py``: what an engine reports of itself (``EngineInfo``, ``StatsSnapshot``).
"""
