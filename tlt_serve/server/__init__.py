"""HTTP front end over an engine running in its own process.

Processes and threads::

    uvicorn event loop (routes)  ──submit/abort/call──▶  sender thread ─┐
          ▲                                                              │ Pipe: list[ToEngine]
          └─ call_soon_threadsafe ◀── reader thread ◀── StepBatch/Reply ─┤ (one pickle per batch)
                                                                         ▼
                                  engine process: drain messages → engine.step() → StepBatch

Modules:
  messages.py        typed IPC messages (AddRequest, Abort, AbortAll, Control, Shutdown;
                     Ready, Failed, StepBatch, Reply, Fatal)
  engine_proc.py     the engine process loop; control handlers (pause, stats, flush...)
  engine_weights.py  weight-update control handlers (disk, uploaded file, gloo group)
  bridge.py          EngineClient: starts the process, routes outputs to per-request streams
  streams.py         per-request output streams on the event loop
  protocol*.py       msgspec request/response bodies (SGLang-native, control, OpenAI)
  inputs*.py         request bodies → (rid, prompt ids, SamplingParams), validated up front
  results.py         submit/collect/merge helpers, client-disconnect handling
  routes_*.py        FastAPI routes; app.py builds the app; cli.py is ``tlt-serve serve``
  uploads.py         chunked safetensors uploads for /update_weights_from_tensor
"""
