"""`drvqwen serve`: an OpenAI-compatible HTTP server with fill-in-the-middle for editors.

    app.py        the Starlette routes: /v1/chat/completions, /v1/completions, /infill,
                  /v1/models, /health, /metrics; the API key; the body size limit
    validate.py   request JSON → a `GenerationRequest` (prompt ids, sampling, stops), every bad
                  field a 4xx naming it
    prompts.py    chat messages → ChatML ids, /infill → the Qwen2.5-Coder (repo-level) FIM ids
    worker.py     the one thread that owns the model (GPU engine or CPU reference): a bounded
                  FIFO queue of jobs, one sequence at a time, KV pages back after each job
    responses.py  the OpenAI response and stream-chunk shapes, server-sent events
    metrics.py    Prometheus counters and histograms (requests, tokens, TTFT, ITL, queue wait)
    api_errors.py the OpenAI-style JSON error
    settings.py   host, port, key, queue and size limits
    main.py       load the model, start the worker, bind, run uvicorn

The runtime is single-stream, so one sequence runs at a time and requests wait their turn in
arrival order; the HTTP side (uvicorn's event loop) never touches the model.
"""
