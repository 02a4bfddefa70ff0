"""Passage retrieval: a bm25s index, a Search-R1-compatible HTTP server, and its client.

* :class:`BM25Index` wraps a real `bm25s <https://github.com/xhluca/bm25s>`_ index over
  :class:`Passage` objects (title + text), safe to query from several threads.
* :class:`RetrievalServer` serves an index over the retrieval API of Search-R1's
  ``retrieval_server.py``: ``POST /retrieve`` with ``{"queries": [...], "topk": k,
  "return_scores": true}`` answers ``{"result": [[{"document": {...}, "score": s}, ...], ...]}``
  (one list per query; without ``return_scores`` each list holds the documents alone).
  A document carries ``id``, ``contents`` (Search-R1's ``"Title"\\ntext`` form), ``title``
  and ``text``. ``GET /health`` reports the passage count. It is a stdlib
  ``ThreadingHTTPServer``, so the core needs no web framework.
* :class:`RetrievalClient` calls such a server through httpx. Every call ends within the
  configured timeout, whatever the server does (refuses, stalls, trickles bytes): the request
  runs on a worker thread and the caller stops waiting at the deadline. Failures raise
  :class:`RetrievalError`, which the search tool turns into an error observation.
* ``trace-gym serve-retriever`` (:func:`configure_serve_retriever`) serves the passages of a
  generated MultiHopQA world (``--world-seed``, ``--world-size``) or of a local JSONL corpus
  (``--passages FILE``; lines ``{"id", "contents"}`` as in Search-R1's wiki-18 corpus, or
  ``{"id", "title", "text"}``).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import bm25s
import httpx
from bm25s.tokenization import Tokenizer
from pydantic import BaseModel, Field, ValidationError

MAX_TOPK = 100
MAX_QUERIES_PER_REQUEST = 256
MAX_QUERY_CHARS = 2000
MAX_REQUEST_BYTES = 1 << 20
MAX_RESPONSE_BYTES = 8 << 20


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
        with self._lock:  # the tokenizer's vocabulary lookups and bm25s' buffers are shared
            ids = self._tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids", show_progress=False)
            docs, scores = self._bm25.retrieve(ids, k=k, show_progress=False, n_threads=1)
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


class _Handler(BaseHTTPRequestHandler):
    server: "RetrievalServer"
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # headers and body leave in separate writes; without TCP_NODELAY, Nagle's algorithm and
        # the client's delayed ACK add ~40 ms to every keep-alive request
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body, ensure_ascii=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (stdlib naming)
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "passages": len(self.server.index)})
        else:
            self._send(404, {"error": f"no route {self.path!r}; POST /retrieve or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/retrieve":
            self._send(404, {"error": f"no route {self.path!r}; POST /retrieve"})
            return
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            length = -1
        if length < 0 or length > MAX_REQUEST_BYTES:
            self.close_connection = True
            self._send(413 if length > 0 else 400, {"error": "missing or oversized Content-Length"})
            return
        try:
            request = RetrieveRequest.model_validate_json(self.rfile.read(length))
        except ValidationError as exc:
            self._send(400, {"error": "bad request: " + "; ".join(e["msg"] for e in exc.errors())})
            return
        if any(len(q) > MAX_QUERY_CHARS for q in request.queries):
            self._send(400, {"error": f"queries are limited to {MAX_QUERY_CHARS} characters"})
            return
        k = request.topk or self.server.topk
        hits = self.server.index.search_batch(request.queries, k) if request.queries else []
        if request.return_scores:
            result = [[{"document": p.to_document(), "score": s} for p, s in row] for row in hits]
        else:
            result = [[p.to_document() for p, _ in row] for row in hits]
        self._send(200, {"result": result})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if self.server.verbose:
            super().log_message(format, *args)


class RetrievalServer(ThreadingHTTPServer):
    """An HTTP server answering Search-R1 retrieval requests from ``index``.

    ``RetrievalServer((host, port), index)``; port 0 picks a free port (see :attr:`url`).
    Run it with ``serve_forever()`` (in a thread if you like) and stop it with ``shutdown()``.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], index: BM25Index, *, topk: int = 3, verbose: bool = False):
        self.index = index
        self.topk = int(topk)
        self.verbose = verbose
        super().__init__(address, _Handler)

    @property
    def url(self) -> str:
        """The base URL clients use (``retriever=`` of the env)."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


# ----------------------------------------------------------------------------- client

class RetrievalClient:
    """Calls a Search-R1 retrieval server. ``url`` is the server's base URL or its
    ``/retrieve`` endpoint; every call returns or raises :class:`RetrievalError` within
    ``timeout`` seconds (plus scheduling noise)."""

    def __init__(self, url: str, *, timeout: float = 5.0, max_workers: int = 4):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"retriever must be an http(s) URL, got {url!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        url = url.rstrip("/")
        self.endpoint = url if url.endswith("/retrieve") else url + "/retrieve"
        self.timeout = float(timeout)
        self._http = httpx.Client(timeout=httpx.Timeout(self.timeout), trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="retrieval-client")

    def _post(self, payload: dict[str, Any], deadline: float) -> Any:
        with self._http.stream("POST", self.endpoint, json=payload) as resp:
            body = bytearray()
            for chunk in resp.iter_bytes():
                body += chunk
                if len(body) > MAX_RESPONSE_BYTES:
                    raise RetrievalError(f"the response exceeds {MAX_RESPONSE_BYTES} bytes")
                if time.monotonic() > deadline:  # a trickling server must not hold the worker forever
                    raise RetrievalError(f"did not answer within {self.timeout:g} s")
            if resp.status_code != 200:
                raise RetrievalError(f"the server answered HTTP {resp.status_code}: {bytes(body[:200]).decode(errors='replace')}")
            try:
                return json.loads(body)
            except json.JSONDecodeError:
                raise RetrievalError("the server's answer is not JSON") from None

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
            raise RetrievalError(f"retrieval server at {self.endpoint}: {exc}") from None
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
