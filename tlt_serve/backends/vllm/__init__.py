"""vLLM's engine behind the contract: its process (``process.py``: builds ``AsyncLLM`` from
``args.py``), the loop around it (``loop.py``), its answer to every control (``controls.py``,
``weights.py``, ``drafter_swap.py``), what it serves now (``state.py``), the stats it
reports (``stat_logger.py``), capture (``samples.py``), and what runs inside vLLM's worker
process (``worker.py``, ``eagle_patch.py``). Nothing here imports vLLM until it runs."""
