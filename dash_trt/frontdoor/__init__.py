"""The OpenAI front door (``dash-triton openai``) in front of a Triton server serving the DASH
repository, on FastAPI, uvicorn and pydantic.

Endpoints (every path but ``/health`` needs ``Authorization: Bearer KEY`` when a key is set;
``/metrics`` not with ``--public-metrics``): ``GET /v1/models[/{id}]``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (images and PDFs answered by the document model), ``POST /v1/ocr``
(uploads), ``GET /health`` (200 when the Triton models are ready), ``GET /metrics``
(Prometheus). Each handler's module says what it takes.

The HTTP layer is uvicorn's (h11): chunked bodies, bad ``Content-Length`` and pipelining are
handled as HTTP says. On top of it: a listen backlog of 2048; bodies larger than
``--max-body-mb`` answered 413 before they are read; a request whose headers do not arrive
within ``--header-timeout`` seconds, or whose body stalls past ``--body-timeout`` or is not
complete within ``--body-deadline`` of its first byte however it trickles, is closed
(a slow client holds no worker); JSON endpoints take ``application/json`` only (a form post
from a web page cannot drive the server); refusals are 4xx on the streaming path too (the first
answer from Triton is awaited before the event stream starts), 5xx only for outages; a client
that disconnects cancels its Triton request (the engine frees its blocks).

The rooms, from the door inwards:

- :mod:`.cli`: ``add_parser``, ``openai_main`` (the ``dash-triton openai`` subcommand);
- :mod:`.server`: :class:`~.server.FrontDoor` (uvicorn), ``OpenAIServer``;
- :mod:`.app`: :func:`~.app.create_app`, the routes and error handlers behind the HTTP guard;
- :mod:`.http_guard`: the API key, body caps, header and body timeouts, content types, counting;
- :mod:`.routes`: each URL and its handler; :mod:`.completions`, :mod:`.chat`, :mod:`.ocr` (one
  handler class each), over :mod:`.endpoint` (what they share) and :mod:`.streaming` (events);
- :mod:`.attachments`: the guard on image and file URLs (``data:``, ``file://`` under
  ``--allow-file-root``, allowed ``http(s)`` hosts, never a private address);
- :mod:`.backend`: the Triton models through tritonclient's asyncio gRPC client;
- :mod:`.models`: the request bodies (pydantic) and OpenAI's error object;
- :mod:`.settings`, :mod:`.metrics`: the settings record, the Prometheus metrics.

Chat templates are rendered by :func:`dash_trt.chat_template.render_chat` (jinja2's sandbox),
the renderer of the document prompt too. ``dash_trt.triton.openai`` and
``dash_trt.triton.openai_models``, this package's former modules, re-export its names.
"""
