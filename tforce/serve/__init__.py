"""`tforce serve`: an OpenAI-compatible HTTP server over one loaded model pair (docs/serve.md).

- requests.py: OpenAI request bodies checked into `Ask`s; `ApiError`, the error shape;
- responses.py: the response objects and server-sent-event chunks in OpenAI's shapes;
- jobs.py: a request's work as the worker takes it (its prompt ids, sampling, where its events go);
- worker.py: the models and the one Session they share, generating one request at a time on a thread
  of its own, reusing the KV cache of the longest prefix the next prompt shares with what it holds;
- batch.py: with --max-batch, the requests that join a running batch as its rows (continuous batching);
- app.py: the Starlette application (routes, API key, body size, streaming, disconnects);
- server.py: uvicorn around it, with a clean stop on SIGTERM / SIGINT.

Only this package imports the web stack (the `serve` extra), so the rest of tforce runs without it.
"""
