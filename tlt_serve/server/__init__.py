"""The HTTP front end over an engine running in its own process.

Processes and threads::

    uvicorn event loop (routes)  ──submit/abort/call──▶  sender thread ─┐
          ▲                                                              │ Pipe: list[ToEngine]
          └─ call_soon_threadsafe ◀── reader thread ◀── StepBatch/Reply ─┤ (one pickle per batch)
                                                                         ▼
                              engine process (tlt_serve/backends): messages → step → StepBatch

Where to look:
  sglang/     the SGLang dialect: ``/generate`` (bodies, their validation, the route)
  openai/     the OpenAI dialect: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
  control/    health, info, abort, pause, cache, tokenizer, ``/metrics``; weight updates and
              versions; the drafter (hot-swap, training control, the trainer's feed)
  common/     what every route shares: the bridge to the engine process (``bridge.py``,
              ``streams.py``), a request's jobs (``jobs.py``), the error shape, app state,
              middleware (keys, body size), OpenAPI, weight uploads, the co-located trainer
  app.py      the app: every group's routes, the error shape, middleware
  serve.py    ``tlt-serve serve``: the engine process, uvicorn, the trainer, router membership
"""
