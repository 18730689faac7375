"""`drvqwen serve`: an OpenAI-compatible HTTP server with fill-in-the-middle for editors.

    app.py         the Starlette routes: /v1/chat/completions, /v1/completions, /infill,
                   /v1/models[/{id}], /health, /metrics; the API key; JSON bodies only; the
                   body size limit
    middleware.py  around the routes: the Host check (DNS rebinding), one log line per
                   request, a quiet end at shutdown
    validate.py    request JSON → a `GenerationRequest` (prompt ids, sampling, stops, llama.cpp's
                   editor controls), every bad field a 4xx naming it
    prompts.py     chat messages → ChatML ids, /infill → the Qwen2.5-Coder (repo-level) FIM ids,
                   trimmed to the context as llama.cpp's server trims them
    worker.py      the one thread that owns the model (GPU engine or CPU reference): a bounded
                   FIFO queue of jobs, one sequence at a time, KV pages back after each job
    answer_text.py an answer's text token by token: detokenized, cut at stop strings, ended at
                   a line under n_indent
    responses.py   the OpenAI response and stream-chunk shapes, llama.cpp's /infill object,
                   server-sent events
    metrics.py     Prometheus counters and histograms (requests, tokens, TTFT, ITL, queue wait)
    api_errors.py  the OpenAI-style JSON error
    settings.py    host, port, key, queue and size limits, the Host names served
    main.py        load the model, start the worker, bind, run uvicorn (and stop it on Ctrl-C)

The runtime is single-stream, so one sequence runs at a time and requests wait their turn in
arrival order; the HTTP side (uvicorn's event loop) never touches the model.
"""
