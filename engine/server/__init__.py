"""The replica server: the OpenAI API of one engine over HTTP (aiohttp on uvloop).

    protocol.py  request bodies -> validated values (pure); errors are kvgate.openai_wire's ApiError
    render.py    token deltas -> OpenAI responses and stream chunks (pure)
    context.py   settings, lifecycle (ready, draining) and what every handler shares
    adapter_access.py  who may call the adapter endpoints (token, loopback) and the roots lora_path may name
    serving.py   /v1/completions and /v1/chat/completions: generate, answer or stream
    metrics.py   /metrics: kvgate_engine_* in a per-app Prometheus registry
    app.py       build_app(engine, settings): routes, error and admission middleware
    main.py      `kvgate engine`: arguments, model loading, serving, drain on SIGTERM

Importing this package loads neither aiohttp nor torch; import the modules you need.
"""
