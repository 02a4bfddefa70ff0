"""Passage retrieval: a bm25s index, a Search-R1-compatible HTTP server, and its client.

* :class:`BM25Index` wraps a real `bm25s <https://github.com/xhluca/bm25s>`_ index over
  :class:`Passage` objects (title + text), safe to query from several threads.
* :func:`retrieval_app` is an ASGI app (Starlette) speaking the retrieval API of Search-R1's
  ``retrieval_server.py``: ``POST /retrieve`` with ``{"queries": [...], "topk": k,
  "return_scores": true}`` answers ``{"result": [[{"document": {...}, "score": s}, ...], ...]}``
  (one list per query; without ``return_scores`` each list holds the documents alone).
  A document carries ``id``, ``contents`` (Search-R1's ``"Title"\\ntext`` form), ``title``
  and ``text``. ``GET /health`` reports the passage count. A malformed body is a 400 whose
  ``{"error": ...}`` says what is wrong; an unknown route a 404, a wrong method a 405, a body
  over :data:`MAX_REQUEST_BYTES` a 413. Searches never run on the event loop: concurrent
  requests are queued and answered in batches by a few search threads (see
  :class:`_SearchBatcher`).
* :class:`RetrievalServer` serves that app with uvicorn on a socket bound at construction
  (so :attr:`RetrievalServer.url` is known at once), in-process (``start()``/``shutdown()``
  or a ``with`` block) or in the foreground (``serve_forever()``). uvicorn parses HTTP with
  httptools and runs on uvloop where they are installed (the ``serving`` extra; about 40%
  more requests/s here), and falls back to h11 and asyncio otherwise.
* :class:`RetrievalClient` calls such a server through httpx. Every call ends within the
  configured timeout, whatever the server does (refuses, stalls, trickles bytes): the request
  runs on a worker thread and the caller stops waiting at the deadline. A dropped connection
  (refused, reset, closed before the answer) or a 503 is retried with exponential backoff, at
  most ``retries`` times and never past the deadline. Failures raise :class:`RetrievalError`,
  which the search tool turns into an error observation.
* ``trace-gym serve-retriever`` (:mod:`trace_gym.envs.multihop.serve`) serves the passages of a
  generated MultiHopQA world (``--world-seed``, ``--world-size``) or of a local JSONL corpus
  (``--passages FILE``; lines ``{"id", "contents"}`` as in Search-R1's wiki-18 corpus, or
  ``{"id", "title", "text"}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import bm25s
import httpx
from bm25s.tokenization import Tokenizer
from pydantic import BaseModel, Field, ValidationError

if TYPE_CHECKING:
    from starlette.applications import Starlette

MAX_TOPK = 100
MAX_QUERIES_PER_REQUEST = 256
MAX_QUERY_CHARS = 2000
MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 8 << 20
MAX_BATCH_QUERIES = 512  # queries the server's search thread takes in one go (at least one request)


@dataclass(frozen=True)
class Passage:
    """One retrievable passage."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """The passage in Search-R1's corpus form: the quoted title, a newline, the text."""
        return f'"{self.title}"\n{self.text}'

    def to_document(self) -> dict[str, str]:
        """The document object sent by the server."""
        return {"id": self.id, "contents": self.contents, "title": self.title, "text": self.text}

    @classmethod
    def from_document(cls, doc: Any, fallback_id: str = "") -> "Passage":
        """Read a document in any of the forms Search-R1 servers return (``contents`` with a
        quoted first-line title, or ``title`` + ``text``). Raises ``ValueError`` otherwise."""
        if not isinstance(doc, dict):
            raise ValueError(f"a document must be a JSON object, got {type(doc).__name__}")
        doc_id = str(doc.get("id", fallback_id))
        if isinstance(doc.get("title"), str) and isinstance(doc.get("text"), str):
            return cls(doc_id, doc["title"], doc["text"])
        contents = doc.get("contents")
        if isinstance(contents, str):
            title, _, text = contents.partition("\n")
            return cls(doc_id, title.strip().strip('"'), text)
        raise ValueError("a document needs 'contents' or 'title' and 'text'")


class RetrievalError(Exception):
    """A search could not be answered (server down, slow, or speaking another protocol)."""


def format_results(results: Sequence[tuple[Passage, float]]) -> str:
    """Search results as the policy sees them, in Search-R1's layout: ``Doc i(Title: t) text``."""
    if not results:
        return "No passages matched the query."
    return "\n".join(f"Doc {i}(Title: {p.title}) {p.text}" for i, (p, _) in enumerate(results, 1))


# ----------------------------------------------------------------------------- index

class BM25Index:
    """A bm25s index over passages (title and text are indexed together).

    ``search`` returns at most ``k`` ``(passage, score)`` pairs with a positive score, best
    first; a query with no indexed word returns nothing.
    """

    def __init__(self, passages: Iterable[Passage], *, k1: float = 1.5, b: float = 0.75):
        self.passages: list[Passage] = list(passages)
        if not self.passages:
            raise ValueError("cannot index an empty passage collection")
        self._tokenizer = Tokenizer(stopwords="en")
        tokens = self._tokenizer.tokenize([f"{p.title} {p.text}" for p in self.passages], return_as="ids",
                                          show_progress=False)
        self._bm25 = bm25s.BM25(k1=k1, b=b)
        self._bm25.index(tokens, show_progress=False)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.passages)

    @classmethod
    def from_jsonl(cls, path: str | Path) -> "BM25Index":
        """Index a JSONL corpus (see :func:`read_passages`)."""
        return cls(read_passages(path))

    def search(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        """The best ``k`` passages for ``query`` (ties broken by passage order)."""
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int = 3) -> list[list[tuple[Passage, float]]]:
        """:meth:`search` for several queries at once."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        k = min(int(k), len(self.passages))
        with self._lock:  # the tokenizer's state is not documented as thread-safe
            ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
        # bm25s' numpy backend only reads the index here (each query's scores are a new array),
        # and numpy's selection releases the GIL: searches on several threads run in parallel
        docs, scores = self._bm25.retrieve(ids, k=k, show_progress=False, n_threads=0)
        out = []
        for row_docs, row_scores in zip(docs, scores):
            out.append([(self.passages[int(d)], float(s)) for d, s in zip(row_docs, row_scores) if s > 0])
        return out


def read_passages(path: str | Path) -> list[Passage]:
    """Read a JSONL corpus: one object a line with ``contents`` (Search-R1) or ``title`` and
    ``text``; ``id`` defaults to the line number. Bad lines raise ``ValueError`` naming the line."""
    passages = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                passages.append(Passage.from_document(json.loads(line), fallback_id=str(lineno - 1)))
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: not a passage ({exc})") from None
    return passages


# ----------------------------------------------------------------------------- server


class RetrieveRequest(BaseModel):
    """The body of ``POST /retrieve`` (Search-R1's ``QueryRequest``)."""

    queries: list[str] = Field(max_length=MAX_QUERIES_PER_REQUEST)
    topk: int | None = Field(default=None, ge=1, le=MAX_TOPK)
    return_scores: bool = False


@dataclass
class _Job:
    queries: list[str]
    k: int
    return_scores: bool
    future: asyncio.Future


class _SearchBatcher:
    """Answers ``/retrieve`` requests off the event loop, in batches, on ``threads`` threads.

    ``await answer(queries, k, return_scores)`` returns the JSON body (bytes) of the answer.
    Requests queue in arrival order. Up to ``threads`` drain tasks each take everything queued
    (up to ``max_queries`` queries, at least one request), hand it to a search thread as one
    :meth:`BM25Index.search_batch` call per distinct ``k``, render the answers there too, and
    repeat while requests wait. An idle server answers a lone request at once; a loaded one
    amortises bm25s' per-call cost over many requests instead of starting one thread per
    request; several threads overlap where numpy releases the GIL. The event loop only
    parses, validates and sends. Batching does not change any answer: bm25s scores each query
    on its own.
    """

    def __init__(self, index: BM25Index, *, max_queries: int = MAX_BATCH_QUERIES, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.index = index
        self.max_queries = int(max_queries)
        self.threads = int(threads)
        self._queue: deque[_Job] = deque()
        self._draining = 0  # drain tasks running or about to; each decrements it as it sees the queue empty
        self._tasks: set[asyncio.Task] = set()  # references keep the tasks alive
        self._executor: ThreadPoolExecutor | None = None

    async def answer(self, queries: list[str], k: int, return_scores: bool) -> bytes:
        loop = asyncio.get_running_loop()
        job = _Job(queries, k, return_scores, loop.create_future())
        self._queue.append(job)
        if self._draining < self.threads:
            self._draining += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await job.future

    def _take_batch(self) -> list[_Job]:
        batch = [self._queue.popleft()]
        n = len(batch[0].queries)
        while self._queue and n + len(self._queue[0].queries) <= self.max_queries:
            n += len(self._queue[0].queries)
            batch.append(self._queue.popleft())
        return [job for job in batch if not job.future.done()]  # drop requests whose client went away

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        batch: list[_Job] = []
        try:
            while self._queue:
                batch = self._take_batch()
                if not batch:
                    continue
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="retrieval-search")
                try:
                    answers = await loop.run_in_executor(self._executor, self._answer_batch, batch)
                except Exception as exc:  # noqa: BLE001 (every request of the batch gets the failure)
                    answers = [exc] * len(batch)
                for job, answer in zip(batch, answers):
                    if job.future.done():
                        continue
                    if isinstance(answer, Exception):
                        job.future.set_exception(answer)
                    else:
                        job.future.set_result(answer)
                batch = []
        finally:
            # no await between the empty-queue check and this decrement, so a request queued
            # later always finds a drain task running or starts one
            self._draining -= 1
            if batch:  # cancelled mid-search (the loop is stopping): release the waiting requests
                for job in [*batch, *self._queue]:
                    if not job.future.done():
                        job.future.cancel()
                self._queue.clear()

    def _answer_batch(self, batch: list[_Job]) -> list[bytes | Exception]:
        """Runs on the search thread: search every job's queries, render every answer."""
        by_k: dict[int, list[int]] = {}
        for i, job in enumerate(batch):
            by_k.setdefault(job.k, []).append(i)
        answers: list[bytes | Exception] = [b""] * len(batch)
        for k, members in by_k.items():
            queries = [q for i in members for q in batch[i].queries]
            try:
                hits = self.index.search_batch(queries, k)
            except Exception as exc:  # noqa: BLE001
                for i in members:
                    answers[i] = exc
                continue
            start = 0
            for i in members:
                job = batch[i]
                rows = hits[start:start + len(job.queries)]
                start += len(job.queries)
                answers[i] = _render(rows, job.return_scores)
        return answers

    def close(self) -> None:
        """Stop the search threads and forget the queue (at the end of serving; the next
        request, on this loop or another, starts afresh)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        for job in self._queue:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits for it
                job.future.get_loop().call_soon_threadsafe(job.future.cancel)
        self._queue.clear()
        self._draining = 0  # a drain task cancelled before it started never counted itself out


def _render(rows: Sequence[Sequence[tuple[Passage, float]]], return_scores: bool) -> bytes:
    """The JSON body answering one request."""
    if return_scores:
        result: list[list[Any]] = [[{"document": p.to_document(), "score": s} for p, s in row] for row in rows]
    else:
        result = [[p.to_document() for p, _ in row] for row in rows]
    return json.dumps({"result": result}, ensure_ascii=False).encode()


def default_search_threads() -> int:
    """Search threads a server uses unless told otherwise: the CPU count, at most 4."""
    return max(1, min(4, os.cpu_count() or 1))


def retrieval_app(index: BM25Index, *, topk: int = 3, search_threads: int | None = None,
                  max_batch_queries: int = MAX_BATCH_QUERIES) -> "Starlette":
    """A Starlette ASGI app answering Search-R1 retrieval requests from ``index`` (the API is
    in the module docstring); ``topk`` is the depth of a request that gives none. Searches run
    in batches on ``search_threads`` threads (default :func:`default_search_threads`), never
    on the event loop.

    Serve it with :class:`RetrievalServer`, or with any ASGI server (``uvicorn``, ...). All
    error answers are JSON objects with one key, ``error``. The app's search threads stop at
    the ASGI lifespan shutdown (and start again if the app is served again).
    """
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    batcher = _SearchBatcher(index, max_queries=max_batch_queries,
                             threads=default_search_threads() if search_threads is None else search_threads)
    default_k = int(topk)

    def error(status: int, message: str) -> Response:
        return JSONResponse({"error": message}, status_code=status)

    async def retrieve(request: Request) -> Response:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_REQUEST_BYTES:
            return error(413, f"the body exceeds {MAX_REQUEST_BYTES} bytes")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_REQUEST_BYTES:
                return error(413, f"the body exceeds {MAX_REQUEST_BYTES} bytes")
        try:
            req = RetrieveRequest.model_validate_json(bytes(body))
        except ValidationError as exc:
            return error(400, "bad request: " + "; ".join(e["msg"] for e in exc.errors()))
        if any(len(q) > MAX_QUERY_CHARS for q in req.queries):
            return error(400, f"queries are limited to {MAX_QUERY_CHARS} characters")
        if not req.queries:
            return Response(b'{"result": []}', media_type="application/json")
        try:
            answer = await batcher.answer(req.queries, req.topk or default_k, req.return_scores)
        except Exception as exc:  # noqa: BLE001 (a bug in the index, reported rather than a dropped connection)
            return error(500, f"search failed ({type(exc).__name__}: {exc})")
        return Response(answer, media_type="application/json")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "passages": len(index)})

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            return error(404, f"no route {request.url.path!r}; POST /retrieve or GET /health")
        if status == 405:
            return error(405, f"{request.method} is not allowed on {request.url.path!r}; POST /retrieve or GET /health")
        return error(status, str(getattr(exc, "detail", exc)))

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        try:
            yield
        finally:
            batcher.close()

    routes = [Route(path, retrieve, methods=["POST"]) for path in ("/retrieve", "/retrieve/")]
    routes += [Route(path, health, methods=["GET"]) for path in ("/health", "/health/")]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.router.redirect_slashes = False
    return app


def _listen(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket. It is made with ``proto=IPPROTO_TCP`` explicitly: asyncio sets
    TCP_NODELAY only on sockets that say so (``socket.create_server`` leaves ``proto`` 0), and
    without it Nagle's algorithm and the client's delayed ACK add ~40 ms to every answer,
    whose headers and body leave in separate writes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class RetrievalServer:
    """Serves :func:`retrieval_app` over ``index`` with uvicorn (``topk`` and
    ``search_threads`` as there).

    ``RetrievalServer((host, port), index, topk=3)`` binds the socket at once (port 0 picks a
    free port; :attr:`url` is then final) with a listen backlog of ``backlog``. Then either

    * ``start()`` serves on a background thread and returns once the server accepts
      connections; ``shutdown()`` stops it (in-process use, tests), or ``with server: ...``; or
    * ``serve_forever()`` serves in the calling thread until ``shutdown()`` (from another
      thread or a signal handler) or ``KeyboardInterrupt``.

    Stopping is graceful and bounded: the socket stops accepting, idle keep-alive connections
    close, and requests in flight get up to ``graceful_timeout`` seconds to finish. A server
    serves once: after ``shutdown()`` its socket is closed. The caller owns signal handling
    (uvicorn's own SIGINT/SIGTERM handlers are not installed). ``verbose`` logs every request
    through the ``uvicorn.access`` logger.

    An idle keep-alive connection is closed after ``keep_alive`` seconds. The default (60 s)
    is longer than clients keep idle connections (httpx: 5 s), so the client closes first: with
    uvicorn's default of 5 s, a starved client's next request could cross the server's close
    and die as a connection reset (seen under load on a busy 2-core machine).
    """

    def __init__(self, address: tuple[str, int], index: BM25Index, *, topk: int = 3, search_threads: int | None = None,
                 verbose: bool = False, backlog: int = 2048, keep_alive: float = 60.0, graceful_timeout: float = 5.0):
        import uvicorn

        self.index = index
        self.topk = int(topk)
        self.verbose = verbose
        self.app = retrieval_app(index, topk=self.topk, search_threads=search_threads)
        config = uvicorn.Config(
            self.app, lifespan="on", log_config=None, log_level="info" if verbose else "warning",
            access_log=verbose, proxy_headers=False, server_header=False, backlog=backlog,
            timeout_keep_alive=keep_alive, timeout_graceful_shutdown=graceful_timeout,
        )
        self._uvicorn = uvicorn.Server(config)
        host, port = address
        self.socket = _listen(host, port, backlog)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        """The base URL clients use (``retriever=`` of the env)."""
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self, timeout: float = 30.0) -> "RetrievalServer":
        """Serve on a daemon thread and return once it accepts connections (at once if it
        already does). ``RuntimeError`` if it does not within ``timeout`` seconds, if it stops
        while starting, or if it was shut down before."""
        with self._lock:
            if self._thread is None and self.socket.fileno() >= 0:
                # uvicorn.Server.run installs no signal handlers off the main thread
                self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self.socket]},
                                                name="retrieval-server", daemon=True)
                self._thread.start()
            elif self._thread is None or not self._thread.is_alive():
                raise RuntimeError("this retrieval server was shut down; create a new one")
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive():
                raise RuntimeError("the retrieval server stopped while starting")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the retrieval server did not start within {timeout:g} s")
            time.sleep(0.005)
        return self

    def serve_forever(self, poll_interval: float = 0.2) -> None:
        """Serve until :meth:`shutdown` (or ``KeyboardInterrupt``, which stops the server and
        propagates). ``poll_interval`` is how often the calling thread checks (so that signal
        handlers run promptly)."""
        self.start()
        assert self._thread is not None
        try:
            while self._thread.is_alive():
                self._thread.join(poll_interval)
        except BaseException:
            self.shutdown()
            raise

    def request_shutdown(self) -> None:
        """Ask the server to stop and return at once (safe from a signal handler)."""
        self._uvicorn.should_exit = True

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop serving and wait for the server thread (at most ``timeout`` seconds; by
        default ``graceful_timeout`` plus a little). On a server never started, close its
        socket. Either way the server cannot start again."""
        self.request_shutdown()
        with self._lock:
            thread = self._thread
            if thread is None:
                self.socket.close()
        if thread is not None and thread is not threading.current_thread():
            limit = self._uvicorn.config.timeout_graceful_shutdown
            thread.join(timeout if timeout is not None else (limit or 5.0) + 2.0)

    def server_close(self) -> None:
        """Close the listening socket (``shutdown`` already does; kept for the stdlib-style API)."""
        self.socket.close()

    def __enter__(self) -> "RetrievalServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
        self.server_close()


# ----------------------------------------------------------------------------- client


class _Retryable(Exception):
    """A failed attempt that may succeed if repeated (the server answered 503)."""


class RetrievalClient:
    """Calls a Search-R1 retrieval server. ``url`` is the server's base URL or its
    ``/retrieve`` endpoint; every call returns or raises :class:`RetrievalError` within
    ``timeout`` seconds (plus scheduling noise), retries included.

    A connection that fails or drops before the answer is complete (refused, reset, closed by
    the server, e.g. an idle keep-alive connection it was closing as the request went out),
    and an HTTP 503, are retried up to ``retries`` times after a backoff of ``backoff`` x 2^i
    seconds (with jitter, at most 1 s, never past the deadline); a search is read-only, so
    repeating it is safe. Timeouts are not retried: the deadline covers every attempt, and a
    stalled server ends the call at the deadline. Other answers (4xx, 500, not JSON, a wrong
    shape) fail at once. ``max_workers`` calls can be in flight at once; more wait for a
    worker, inside their own deadline.
    """

    def __init__(self, url: str, *, timeout: float = 5.0, max_workers: int = 4, retries: int = 3,
                 backoff: float = 0.05):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever must be an http(s) URL, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        if retries < 0 or backoff < 0:
            raise ValueError(f"retries and backoff must be non-negative, got {retries} and {backoff}")
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self._rng = random.Random()  # jitter; the global RNG of a seeded run stays untouched
        limits = httpx.Limits(max_connections=max(max_workers, 1), max_keepalive_connections=max(max_workers, 1))
        self._http = httpx.Client(timeout=httpx.Timeout(self.timeout), limits=limits, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="retrieval-client")

    def _post_once(self, payload: dict[str, Any], deadline: float) -> Any:
        remaining = max(deadline - time.monotonic(), 0.001)
        with self._http.stream("POST", self.endpoint, json=payload, timeout=httpx.Timeout(remaining)) as resp:
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_RESPONSE_BYTES:
                    raise RetrievalError(f"the response exceeds {MAX_RESPONSE_BYTES} bytes")
                if time.monotonic() > deadline:  # a trickling server must not hold the worker forever
                    raise RetrievalError(f"did not answer within {self.timeout:g} s")
            if resp.status_code != 200:
                message = f"the server answered HTTP {resp.status_code}: {bytes(body[:200]).decode(errors='replace')}"
                raise _Retryable(message) if resp.status_code == 503 else RetrievalError(message)
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                raise RetrievalError("the server's answer is not JSON") from None

    def _post(self, payload: dict[str, Any], deadline: float) -> Any:
        """Runs on a worker thread: attempts with backoff until an answer, a final error, the
        retry budget or the deadline."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return self._post_once(payload, deadline)
            except (httpx.NetworkError, httpx.RemoteProtocolError, _Retryable) as exc:
                delay = min(self.backoff * 2 ** (attempt - 1), 1.0) * self._rng.uniform(0.5, 1.0)
                if attempt > self.retries or time.monotonic() + delay >= deadline:
                    attempts = f"{attempt} attempt" + ("s" if attempt > 1 else "")
                    if isinstance(exc, _Retryable):
                        raise RetrievalError(f"{exc} (after {attempts})") from None
                    raise RetrievalError(f"cannot reach the retrieval server at {self.endpoint} "
                                         f"({type(exc).__name__}: {exc}; {attempts})") from None
                time.sleep(delay)

    def search_batch(self, queries: Sequence[str], k: int = 3) -> list[list[tuple[Passage, float]]]:
        """Top-``k`` passages for each query, as ``(passage, score)`` pairs."""
        payload = {"queries": list(queries), "topk": int(k), "return_scores": True}
        deadline = time.monotonic() + self.timeout
        future = self._pool.submit(self._post, payload, deadline)
        try:
            data = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            future.cancel()
            raise RetrievalError(f"the retrieval server at {self.endpoint} did not answer within {self.timeout:g} s") from None
        except httpx.TimeoutException:
            raise RetrievalError(f"the retrieval server at {self.endpoint} did not answer within {self.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise RetrievalError(f"cannot reach the retrieval server at {self.endpoint} ({type(exc).__name__}: {exc})") from None
        except RetrievalError as exc:
            message = str(exc)
            if not message.startswith("cannot reach"):
                message = f"retrieval server at {self.endpoint}: {message}"
            raise RetrievalError(message) from None
        return _parse_result(data, len(queries))

    def search(self, query: str, k: int = 3) -> list[tuple[Passage, float]]:
        """Top-``k`` passages for one query."""
        return self.search_batch([query], k)[0]

    def close(self) -> None:
        """Release the connection pool and worker threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> "RetrievalClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _parse_result(data: Any, n_queries: int) -> list[list[tuple[Passage, float]]]:
    """Read a ``/retrieve`` answer, with or without scores; raise RetrievalError on anything else."""
    result = data.get("result") if isinstance(data, dict) else None
    if not isinstance(result, list) or len(result) != n_queries:
        raise RetrievalError("the server's answer has no 'result' list with one entry per query")
    out = []
    for row in result:
        if not isinstance(row, list):
            raise RetrievalError("each entry of 'result' must be a list of documents")
        hits = []
        for item in row:
            try:
                if isinstance(item, dict) and "document" in item:
                    hits.append((Passage.from_document(item["document"]), float(item.get("score", 0.0))))
                else:
                    hits.append((Passage.from_document(item), 0.0))
            except (TypeError, ValueError) as exc:
                raise RetrievalError(f"malformed document in the answer ({exc})") from None
        out.append(hits)
    return out
