"""The native engine behind the contract: its process and loop (``process.py``), its answer to
every control (``controls.py``), and what RL changes in it between steps (``updates.py``:
target weights, the weight-sync group, the drafter)."""
