"""Retrieval: the bm25s index, the Search-R1-compatible server (in-process and as the real
``trace-gym serve-retriever`` subprocess), and the client's timeouts."""

from __future__ import annotations

import json
import os
import selectors
import signal
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
    BM25Index,
    Passage,
    RetrievalClient,
    RetrievalError,
    RetrievalServer,
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
    server = RetrievalServer(("127.0.0.1", 0), BM25Index.from_jsonl(DATA / "passages_sample.jsonl"), topk=2)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


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


def test_server_answers_concurrent_clients_consistently(local_server):
    queries = ["Steve Hillage", "Chingford London", "Gong Paris", "Miquette Giraudy keyboard"] * 8
    with RetrievalClient(local_server.url, timeout=5.0) as client:
        serial = [client.search(q, 2) for q in queries]
        with ThreadPoolExecutor(8) as pool:
            parallel = list(pool.map(lambda q: client.search(q, 2), queries))
    assert parallel == serial


def test_client_reads_documents_without_ids_or_scores():
    # Search-R1's BM25 retriever returns {"title", "text", "contents"} documents
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"result": [[{"contents": '"T"\nsome text'}, {"title": "U", "text": "more"}]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    with _serve(Handler) as url, RetrievalClient(url, timeout=5.0) as client:
        hits = client.search("q", 2)
    assert [(p.title, p.text, s) for p, s in hits] == [("T", "some text", 0.0), ("U", "more", 0.0)]


# ----------------------------------------------------------------------------- the real CLI server


def _start_cli(*args: str) -> tuple[subprocess.Popen, str]:
    exe = Path(sys.executable).with_name("trace-gym")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "trace_gym.cli.main"]
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
        proc.terminate()
        proc.wait(timeout=10)


def test_cli_reports_a_missing_corpus(capsys):
    from trace_gym.cli.main import main

    assert main(["serve-retriever", "--passages", "/nonexistent/corpus.jsonl", "--port", "0"]) == 1
    assert "corpus.jsonl" in capsys.readouterr().err


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


class _SleepyHandler(BaseHTTPRequestHandler):
    """Accepts the request, then says nothing for 5 s."""

    def do_POST(self):  # noqa: N802
        time.sleep(5)

    def log_message(self, *a):
        pass


class _TricklingHandler(BaseHTTPRequestHandler):
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

    def log_message(self, *a):
        pass


def _broken(status: int, body: bytes):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

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
    with RetrievalClient("http://127.0.0.1:9/retrieve", timeout=TIMEOUT) as client:  # nothing listens on port 9
        assert client.endpoint == "http://127.0.0.1:9/retrieve"
        with pytest.raises(RetrievalError, match="cannot reach"):
            client.search("x")
