"""Retrieval: the bm25s index, the Search-R1-compatible server (in-process and as the real
``trace-gym serve-retriever`` subprocess), and the client's timeouts."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from trace_gym.envs.multihop import MultiHopQAEnv
from trace_gym.envs.retrieval import (
    MAX_REQUEST_BYTES,
    BM25Index,
    Passage,
    RetrievalClient,
    RetrievalError,
    RetrievalServer,
    _render,
    _SearchBatcher,
    format_results,
    read_passages,
)

DATA = Path(__file__).parent / "data"
TIMEOUT = 1.0  # the retriever_timeout under test
SLACK = 0.5  # scheduling noise on a shared 2-core machine


def _call(query: str) -> str:
    return '<tool_call>{"name": "search", "arguments": {"query": %s}}</tool_call>' % json.dumps(query)


# ----------------------------------------------------------------------------- index


def test_bm25_index_ranks_and_bounds():
    idx = BM25Index.from_jsonl(DATA / "passages_sample.jsonl")
    assert len(idx) == 4
    hits = idx.search("Steve Hillage guitarist", k=2)
    assert [p.title for p, _ in hits][0] == "Steve Hillage"
    assert len(hits) == 2 and hits[0][1] >= hits[1][1] > 0
    assert len(idx.search("Chingford", k=50)) == 2  # only passages that match, k clamped to the corpus
    assert idx.search("zzqx unknownword", k=3) == []
    assert idx.search("the of a", k=3) == []  # stopwords only
    with pytest.raises(ValueError):
        idx.search("x", k=0)
    with pytest.raises(ValueError):
        BM25Index([])


def test_bm25_index_answers_threads_as_it_answers_one_caller():
    import random

    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(400)]
    idx = BM25Index(Passage(str(i), f"t{i}", " ".join(rng.choices(vocab, k=30))) for i in range(3000))
    queries = [" ".join(rng.choices(vocab, k=3)) for _ in range(400)]
    serial = [idx.search(q, 5) for q in queries]
    with ThreadPoolExecutor(8) as pool:
        parallel = list(pool.map(lambda q: idx.search(q, 5), queries))
        batched = [row for rows in pool.map(lambda i: idx.search_batch(queries[i:i + 40], 5), range(0, 400, 40))
                   for row in rows]
    assert parallel == serial and batched == serial


def test_read_passages_formats_and_errors(tmp_path):
    ps = read_passages(DATA / "passages_sample.jsonl")
    assert ps[0] == Passage("0", "Chingford", "Chingford is a town in east London, England, within the London Borough of Waltham Forest.")
    assert ps[2].title == "Miquette Giraudy" and ps[2].contents.startswith('"Miquette Giraudy"\n')
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "\\"A\\"\\ntext"}\n{"id": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2"):
        read_passages(bad)


def test_format_results_is_search_r1_layout():
    out = format_results([(Passage("1", "A", "alpha text"), 2.0), (Passage("2", "B", "beta"), 1.0)])
    assert out == "Doc 1(Title: A) alpha text\nDoc 2(Title: B) beta"
    assert format_results([]) == "No passages matched the query."


# ----------------------------------------------------------------------------- server protocol


@pytest.fixture()
def local_server():
    with RetrievalServer(("127.0.0.1", 0), BM25Index.from_jsonl(DATA / "passages_sample.jsonl"), topk=2) as server:
        yield server


def test_server_speaks_the_search_r1_api(local_server):
    url = local_server.url
    r = httpx.post(url + "/retrieve", json={"queries": ["Steve Hillage", "Gong band Paris"], "topk": 1, "return_scores": True})
    assert r.status_code == 200
    body = r.json()
    assert list(body) == ["result"] and len(body["result"]) == 2
    first = body["result"][0][0]
    assert set(first) == {"document", "score"} and isinstance(first["score"], float)
    assert first["document"]["contents"] == '"Steve Hillage"\nSteve Hillage is an English musician, best known as a guitarist. He was born in Chingford, London.'
    assert first["document"]["id"] == "1"
    assert body["result"][1][0]["document"]["title"] == "Gong (band)"
    # without scores: lists of documents; without topk: the server's default (2)
    r = httpx.post(url + "/retrieve", json={"queries": ["Steve Hillage Chingford"]})
    docs = r.json()["result"][0]
    assert len(docs) == 2 and "contents" in docs[0] and "score" not in docs[0]
    assert httpx.get(url + "/health").json() == {"status": "ok", "passages": 4}


def test_server_rejects_bad_requests(local_server):
    url = local_server.url + "/retrieve"
    assert httpx.post(url, content=b"{not json").status_code == 400
    assert httpx.post(url, json={"queries": "one string"}).status_code == 400
    assert httpx.post(url, json={"queries": ["a"], "topk": 0}).status_code == 400
    assert httpx.post(url, json={"queries": ["x" * 5000]}).status_code == 400
    assert httpx.post(local_server.url + "/search", json={"queries": ["a"]}).status_code == 404
    assert httpx.post(url, json={"queries": []}).json() == {"result": []}


def test_server_errors_are_json_and_routes_allow_a_trailing_slash(local_server):
    url = local_server.url
    r = httpx.post(url + "/retrieve", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"].startswith("bad request: ") and "JSON" in r.json()["error"]
    r = httpx.post(url + "/retrieve", json={"queries": ["a"], "topk": 1000})
    assert r.status_code == 400 and "100" in r.json()["error"]
    r = httpx.post(url + "/retrieve", json={"queries": ["x" * 5000]})
    assert r.status_code == 400 and r.json() == {"error": "queries are limited to 2000 characters"}
    r = httpx.post(url + "/retrieve", content=b"x" * (MAX_REQUEST_BYTES + 1))
    assert r.status_code == 413 and "bytes" in r.json()["error"]
    r = httpx.get(url + "/nowhere")
    assert r.status_code == 404 and "/nowhere" in r.json()["error"]
    r = httpx.get(url + "/retrieve")
    assert r.status_code == 405 and "POST /retrieve" in r.json()["error"]
    r = httpx.post(url + "/retrieve/", json={"queries": ["Gong"], "topk": 1})
    assert r.status_code == 200 and r.json()["result"][0][0]["title"] == "Gong (band)"
    assert httpx.get(url + "/health/").json()["passages"] == 4


def test_server_answers_concurrent_clients_consistently(local_server):
    queries = ["Steve Hillage", "Chingford London", "Gong Paris", "Miquette Giraudy keyboard"] * 8
    with RetrievalClient(local_server.url, timeout=5.0) as client:
        serial = [client.search(q, 2) for q in queries]
        with ThreadPoolExecutor(8) as pool:
            parallel = list(pool.map(lambda q: client.search(q, 2), queries))
    assert parallel == serial


class _SlowIndex(BM25Index):
    """The sample index, with every ``search_batch`` call taking ``delay`` seconds more
    (``time.sleep`` stands for a long search); it records the size of each call."""

    def __init__(self, delay: float):
        super().__init__(read_passages(DATA / "passages_sample.jsonl"))
        self.delay = delay
        self.calls: list[int] = []
        self.spans: list[tuple[float, float]] = []  # (start, end) of each call, time.monotonic()

    def search_batch(self, queries, k=3):
        self.calls.append(len(queries))
        start = time.monotonic()
        time.sleep(self.delay)
        try:
            return super().search_batch(queries, k)
        finally:
            self.spans.append((start, time.monotonic()))


def test_batcher_answers_mixed_requests_as_if_one_by_one():
    import asyncio

    index = _SlowIndex(0.0)
    requests = [(["Steve Hillage", "Gong Paris"][: 1 + i % 2], 1 + i % 3, i % 2 == 0) for i in range(30)]
    expected = [_render(BM25Index.search_batch(index, q, k), scores) for q, k, scores in requests]
    index.calls.clear()

    async def run():
        batcher = _SearchBatcher(index)
        try:
            return await asyncio.gather(*(batcher.answer(q, k, scores) for q, k, scores in requests))
        finally:
            batcher.close()

    assert asyncio.run(run()) == expected
    assert len(index.calls) == 3, "30 queued requests make one batch: one search per distinct k"
    assert sum(index.calls) == sum(len(q) for q, _, _ in requests)


def test_searches_run_off_the_event_loop_and_queued_requests_share_one():
    index = _SlowIndex(0.6)
    with (RetrievalServer(("127.0.0.1", 0), index, search_threads=1) as server, ThreadPoolExecutor(6) as pool,
          httpx.Client(timeout=10, trust_env=False) as client):
        assert client.get(server.url + "/health").status_code == 200  # connect before timing
        body = {"queries": ["Steve Hillage"], "topk": 1}
        first = pool.submit(client.post, server.url + "/retrieve", json=body)
        while not index.calls:  # the first search has started
            time.sleep(0.01)
        start = time.monotonic()
        assert client.get(server.url + "/health").status_code == 200
        health_s = time.monotonic() - start
        rest = [pool.submit(client.post, server.url + "/retrieve", json=body) for _ in range(5)]
        answers = [f.result().json() for f in [first, *rest]]
    assert health_s < 0.3, f"/health waited {health_s:.2f} s behind a search"
    assert all(a == answers[0] for a in answers) and answers[0]["result"][0][0]["title"] == "Steve Hillage"
    assert len(index.calls) <= 3, f"5 requests queued behind one search were not batched: {index.calls}"


@pytest.mark.parametrize("threads", [1, 2])
def test_search_threads_run_searches_in_parallel(threads):
    index = _SlowIndex(0.5)
    with (RetrievalServer(("127.0.0.1", 0), index, search_threads=threads) as server, ThreadPoolExecutor(2) as pool,
          httpx.Client(timeout=10, trust_env=False) as client):
        first = pool.submit(client.post, server.url + "/retrieve", json={"queries": ["Gong"]})
        while not index.calls:  # the first search has started: the second request cannot join its batch
            time.sleep(0.01)
        second = pool.submit(client.post, server.url + "/retrieve", json={"queries": ["Chingford"]})
        replies = [first.result(), second.result()]
    assert [r.status_code for r in replies] == [200, 200]
    assert replies[0].json()["result"][0][0]["title"] == "Gong (band)"
    (start1, end1), (start2, end2) = sorted(index.spans)
    assert (start2 < end1) == (threads == 2), f"threads={threads}: searches at {sorted(index.spans)}"


def test_server_stops_cleanly_and_finishes_requests_in_flight():
    index = _SlowIndex(0.5)
    server = RetrievalServer(("127.0.0.1", 0), index).start()
    url = server.url
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, url + "/retrieve", json={"queries": ["Gong"]}, timeout=10)
        while not index.calls:
            time.sleep(0.01)
        start = time.monotonic()
        server.shutdown()
        assert time.monotonic() - start < 3.0
        assert pending.result().status_code == 200, "a request in flight is answered before the server stops"
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=2)
    with pytest.raises(RuntimeError, match="shut down"):
        server.start()
    server.server_close()


def test_serve_forever_blocks_until_shutdown_from_another_thread():
    server = RetrievalServer(("127.0.0.1", 0), BM25Index.from_jsonl(DATA / "passages_sample.jsonl"))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    server.start()  # returns once it accepts connections
    assert httpx.get(server.url + "/health", timeout=5).json() == {"status": "ok", "passages": 4}
    assert thread.is_alive()
    server.shutdown()
    thread.join(5)
    assert not thread.is_alive()
    server.server_close()


def test_client_reads_documents_without_ids_or_scores():
    # Search-R1's BM25 retriever returns {"title", "text", "contents"} documents
    class Handler(_QuietHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.reply(200, json.dumps({"result": [[{"contents": '"T"\nsome text'}, {"title": "U", "text": "more"}]]}).encode())

    with _serve(Handler) as url, RetrievalClient(url, timeout=5.0) as client:
        hits = client.search("q", 2)
    assert [(p.title, p.text, s) for p, s in hits] == [("T", "some text", 0.0), ("U", "more", 0.0)]


# ----------------------------------------------------------------------------- the real CLI server


def _start_cli(*args: str) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("trace-gym")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "trace_gym.cli"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([*cmd, "serve-retriever", "--host", "127.0.0.1", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout=60):
        proc.kill()
        raise AssertionError("serve-retriever printed nothing within 60 s")
    line = proc.stdout.readline()
    assert "serving" in line and "/retrieve" in line, line + proc.stderr.read()
    url = line.split(" on ", 1)[1].split("/retrieve")[0]
    return proc, url


def test_cli_server_runs_multihop_episodes_then_stops_cleanly():
    proc, url = _start_cli("--world-seed", "0")
    try:
        remote = MultiHopQAEnv(retriever=url, retriever_timeout=TIMEOUT)
        local = MultiHopQAEnv()
        for i in range(12):
            task = remote.tasks().get(i, "validation")
            remote.reset(options={"task": task})
            local.reset(options={"task": task})
            for turn in remote.demonstrate(task):
                out = remote.step(turn)
                assert out[0] == local.step(turn)[0], "the server returns what the local index returns"
            _, reward, terminated, _, info = out
            assert terminated and reward == 1.0 and info["support_recall"] == 1.0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    # the server is gone: a search is an error observation, promptly, and the episode goes on
    task = remote.tasks().get(0, "validation")
    remote.reset(options={"task": task})
    start = time.monotonic()
    obs, reward, terminated, truncated, info = remote.step(remote.demonstrate(task)[0])
    assert time.monotonic() - start < TIMEOUT + SLACK
    assert obs.startswith("Error: search failed") and "cannot reach" in obs
    assert not terminated and reward == 0.0
    obs, reward, terminated, *_ = remote.step(remote.demonstrate(task)[-1])
    assert terminated and reward == 1.0
    remote.close()


def test_cli_serves_a_local_jsonl_corpus():
    proc, url = _start_cli("--passages", str(DATA / "passages_sample.jsonl"), "--topk", "1")
    try:
        with RetrievalClient(url, timeout=5.0) as client:
            hits = client.search("where was Steve Hillage born", 1)
        assert [p.title for p, _ in hits] == ["Steve Hillage"]
        r = httpx.post(url + "/retrieve", json={"queries": ["Gong"]})
        assert len(r.json()["result"][0]) == 1  # --topk is the default depth
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C stops it cleanly too
        assert proc.wait(timeout=10) == 0


def test_cli_reports_a_missing_corpus(capsys):
    from trace_gym.cli.main import main

    assert main(["serve-retriever", "--passages", "/nonexistent/corpus.jsonl", "--port", "0"]) == 1
    assert "corpus.jsonl" in capsys.readouterr().err


def test_cli_reports_a_port_in_use(capsys):
    from trace_gym.cli.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve-retriever", "--passages", str(DATA / "passages_sample.jsonl"), "--port", str(port)]) == 1
    assert "serve-retriever:" in capsys.readouterr().err


# ----------------------------------------------------------------------------- slow and broken servers


class _serve:
    """Run a stdlib HTTP server with ``handler`` on a free loopback port (a context manager)."""

    def __init__(self, handler):
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True

    def __enter__(self) -> str:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(BaseHTTPRequestHandler):
    """A request handler that logs nothing, with :meth:`reply` for a whole answer."""

    def reply(self, status: int, body: bytes) -> None:
        """Answer ``status`` with ``body`` (and its length)."""
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class _SleepyHandler(_QuietHandler):
    """Accepts the request, then says nothing for 5 s."""

    def do_POST(self):  # noqa: N802
        time.sleep(5)


class _TricklingHandler(_QuietHandler):
    """Sends headers at once, then one body byte every 0.3 s (each read succeeds in time)."""

    def do_POST(self):  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", "100")
        self.end_headers()
        try:
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.3)
        except OSError:
            pass


def _broken(status: int, body: bytes):
    class Handler(_QuietHandler):
        def do_POST(self):  # noqa: N802
            self.reply(status, body)

    return Handler


@pytest.mark.parametrize("handler", [_SleepyHandler, _TricklingHandler], ids=["silent", "trickling"])
def test_slow_server_gives_an_error_observation_within_the_timeout(handler):
    with _serve(handler) as url:
        env = MultiHopQAEnv(retriever=url, retriever_timeout=TIMEOUT)
        env.reset(seed=0)
        start = time.monotonic()
        obs, reward, terminated, truncated, info = env.step(_call("anything"))
        elapsed = time.monotonic() - start
        env.close()
    assert elapsed < TIMEOUT + SLACK, f"took {elapsed:.2f} s"
    assert obs.startswith("Error: search failed") and "within 1 s" in obs
    assert not terminated and not truncated
    assert env.state.tool_state["queries"] == []  # a failed search leaves no trace in the tool state


@pytest.mark.parametrize("status,body,message", [
    (500, b'{"detail": "boom"}', "HTTP 500"),
    (200, b"<html>not json</html>", "not JSON"),
    (200, b'{"results": []}', "'result'"),
    (200, b'{"result": [[{"document": 7}]]}', "malformed document"),
])
def test_broken_server_gives_an_error_observation(status, body, message):
    with _serve(_broken(status, body)) as url:
        env = MultiHopQAEnv(retriever=url, retriever_timeout=TIMEOUT)
        env.reset(seed=0)
        obs, reward, terminated, *_ = env.step(_call("anything"))
        env.close()
    assert obs.startswith("Error: search failed") and message in obs and not terminated


def test_client_errors():
    with pytest.raises(ValueError, match="http"):
        RetrievalClient("ftp://example.org")
    with pytest.raises(ValueError, match="timeout"):
        RetrievalClient("http://127.0.0.1:9", timeout=0)
    with pytest.raises(ValueError, match="retries"):
        RetrievalClient("http://127.0.0.1:9", retries=-1)
    with RetrievalClient("http://127.0.0.1:9/retrieve", timeout=TIMEOUT) as client:  # nothing listens on port 9
        assert client.endpoint == "http://127.0.0.1:9/retrieve"
        start = time.monotonic()
        with pytest.raises(RetrievalError, match="cannot reach.*4 attempts"):  # refused, retried 3 times
            client.search("x")
        assert time.monotonic() - start < TIMEOUT


_ANSWER = json.dumps({"result": [[{"document": {"id": "7", "contents": '"T"\ntext'}, "score": 1.5}]]}).encode()


def _flaky(failures: int, how: str):
    """A handler whose first ``failures`` requests fail ``how`` ("reset": an RST before any
    answer; "close": the connection closes without an answer; an HTTP status such as "503"),
    then answer ``_ANSWER``. ``Handler.seen`` counts the requests."""

    class Handler(_QuietHandler):
        protocol_version = "HTTP/1.1"
        seen = 0
        lock = threading.Lock()

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            with Handler.lock:
                Handler.seen += 1
                n = Handler.seen
            if n <= failures and how == "reset":
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()  # with a zero linger time: RST
                self.close_connection = True
                return
            if n <= failures and how == "close":
                self.close_connection = True
                return
            status, body = (int(how), b'{"error": "busy"}') if n <= failures else (200, _ANSWER)
            self.reply(status, body)

    return Handler


@pytest.mark.parametrize("how", ["reset", "close", "503"])
def test_client_retries_dropped_connections_and_503(how):
    handler = _flaky(2, how)
    with _serve(handler) as url, RetrievalClient(url, timeout=5.0) as client:
        hits = client.search("q", 1)
    assert [(p.id, p.title, s) for p, s in hits] == [("7", "T", 1.5)]
    assert handler.seen == 3, "two failed attempts, then the answer"


@pytest.mark.parametrize("how", ["reset", "close", "503"])
def test_client_retries_are_bounded(how):
    handler = _flaky(10**6, how)
    with _serve(handler) as url, RetrievalClient(url, timeout=5.0, retries=2) as client:
        start = time.monotonic()
        with pytest.raises(RetrievalError, match="3 attempts") as info:
            client.search("q", 1)
        elapsed = time.monotonic() - start
    assert handler.seen == 3 and elapsed < 1.0, f"{handler.seen} attempts in {elapsed:.2f} s"
    assert ("HTTP 503" if how == "503" else "cannot reach") in str(info.value)
    with _serve(_flaky(1, how)) as url, RetrievalClient(url, timeout=5.0, retries=0) as client:
        with pytest.raises(RetrievalError, match=r"1 attempt\)"):
            client.search("q", 1)


def test_client_does_not_retry_other_errors():
    handler = _flaky(10**6, "500")
    with _serve(handler) as url, RetrievalClient(url, timeout=5.0) as client:
        with pytest.raises(RetrievalError, match="HTTP 500"):
            client.search("q", 1)
    assert handler.seen == 1
    seen = []

    class Counting(_SleepyHandler):
        def do_POST(self):  # noqa: N802
            seen.append(1)
            super().do_POST()

    with _serve(Counting) as url, RetrievalClient(url, timeout=TIMEOUT) as client:
        start = time.monotonic()
        with pytest.raises(RetrievalError, match="within 1 s"):
            client.search("q", 1)
        assert time.monotonic() - start < TIMEOUT + SLACK
    assert seen == [1], "a timeout ends the call: no second attempt"
