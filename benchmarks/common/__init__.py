"""What the benchmark tools share, a module by what it is:

  results  the stamp on every result (machine, date, commit, command), the tools' command
           lines, writing a result as JSON with its PNG beside it, plotting helpers
  servers  free ports, ``tlt-serve serve`` and a vLLM peer started and stopped
  watch    what a running server reports (its counters, whether it has drained) and the
           memory and CPU of its processes
  prompts  the benchmark prompt set (chat / reasoning / code), its tokenizer, requests of it
  drift    the drifting target versions (the default model fine-tuned stage after stage)
  load     HTTP load on a server: rollout, Poisson and closed-loop modes, both dialects
  timing   one request's timing as its client saw it, and what a run's timings sum to
"""
