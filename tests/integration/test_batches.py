"""OpenAI's Files and Batch APIs and Anthropic's Message Batches (frontend.batches): two
`sluice frontend`s on the session's engine over one Redis state store, real processes,
through the official clients. A batch made on one frontend is polled and read on the other;
its lines run through the chat route with a bounded number in the engine at once; bad lines
land in the error file; objects belong to the API key that made them; every new field's
bounds are clear 4xx; a store that goes away gives 503s and keeps what it had; a batch whose
frontend is SIGKILLed is finished by the other."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.integration.test_state_store import RedisServer
from tests.servers import metrics, wait_until

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEYS = ("key-a", "key-b")
IN_FLIGHT = 3  # --max-batch-lines-in-flight
MAX_LINES = 60
MAX_BYTES = 40_000
MAX_ACTIVE = 2  # --max-active-batches


class Stack:
    def __init__(self, engine, frontends, redis) -> None:
        self.engine, self.frontends, self.redis = engine, frontends, redis
        self.urls = [f.base_url for f in frontends]

    def client(self, i: int, key: str = KEYS[0]) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.urls[i]}/v1", api_key=key, max_retries=0)

    def anthropic(self, i: int, key: str = KEYS[0]) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.urls[i], api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def stack(shared_engine, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("batches"))
    redis = RedisServer(tmp)
    flags = ("--state-store", redis.url, *(f for key in KEYS for f in ("--api-key", key)),
             "--max-batch-lines-in-flight", str(IN_FLIGHT), "--max-batch-lines",
             str(MAX_LINES), "--max-batch-file-bytes", str(MAX_BYTES),
             "--max-active-batches", str(MAX_ACTIVE))
    frontends = []
    try:
        frontends = shared_engine.frontends(tmp, *((f"batches-{n}", flags) for n in "ab"))
        yield Stack(shared_engine, frontends, redis)
    finally:
        for f in frontends:
            f.stop()
        redis.stop()


def chat_line(custom_id: str, text: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": text}],
                     "max_tokens": 2, "temperature": 0, **body}}


def jsonl(lines) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                    for line in lines)


def upload(client: openai.OpenAI, content: bytes):
    return client.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")


def poll(client: openai.OpenAI, batch_id: str, timeout: float = 240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            return batch
        time.sleep(0.3)
    raise AssertionError(f"{batch_id} still {batch.status}")


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_of_50_completes_with_bad_lines_in_the_error_file(stack):
    a, b = stack.client(0), stack.client(1)
    good = [chat_line(f"req-{i}", f"Say {i}.") for i in range(46)]
    content = jsonl([
        *good[:10],
        b'{"custom_id": "broken", "method": "POST", "url": ',  # not JSON
        {"custom_id": "elsewhere", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": "x"}},  # another endpoint than the batch's
        chat_line("req-0", "a repeated custom_id"),
        chat_line("refused", "x", max_tokens=-1),  # the chat route's own 400
        *good[10:],
    ])
    source = upload(a, content)
    assert (source.purpose, source.bytes, source.object) == ("batch", len(content), "file")
    batch = a.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                             completion_window="24h", metadata={"run": "fifty"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "fifty"}

    # While it runs: never more than IN_FLIGHT of its lines in the engine, and an
    # interactive request is answered meanwhile.
    running, done = [], threading.Event()

    def sample() -> None:
        while not done.is_set():
            running.append(metrics(stack.engine.metrics_url).get(
                "vllm:num_requests_running", 0))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        wait_until(lambda: b.batches.retrieve(batch.id).request_counts.completed > 0, 120,
                   "the batch's first lines")
        started = time.monotonic()
        answer = b.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": "Hi"}])
        interactive_s = time.monotonic() - started
        finished = poll(b, batch.id)  # polled on the other frontend
    finally:
        done.set()
        sampler.join()
    assert answer.choices[0].message.content is not None and interactive_s < 30
    assert 0 < max(running) <= IN_FLIGHT + 1, running  # + 1: the interactive request

    assert finished.status == "completed", finished
    counts = finished.request_counts
    assert (counts.total, counts.completed, counts.failed) == (50, 46, 4)
    assert finished.completed_at >= finished.in_progress_at >= finished.created_at
    output = lines_of(b, finished.output_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(46)]
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200
        assert response["request_id"] == response["body"]["id"]
        assert response["body"]["object"] == "chat.completion"
        assert response["body"]["usage"]["completion_tokens"] <= 2
    errors = {line["custom_id"]: line for line in lines_of(a, finished.error_file_id)}
    assert set(errors) == {None, "elsewhere", "req-0", "refused"}
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert errors[None]["response"] is None
    assert errors["elsewhere"]["error"]["code"] == "invalid_url"
    assert errors["req-0"]["error"]["code"] == "duplicate_custom_id"
    refused = errors["refused"]
    assert refused["error"] is None and refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "max_tokens"

    assert batch.id in [x.id for x in a.batches.list().data]
    output_file = a.files.retrieve(finished.output_file_id)
    assert output_file.purpose == "batch_output"
    assert {source.id, output_file.id} <= {f.id for f in b.files.list().data}
    assert [f.id for f in b.files.list(purpose="batch").data] == [source.id]
    assert a.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        b.files.retrieve(source.id)
    with pytest.raises(openai.ConflictError):  # it is finished
        b.batches.cancel(batch.id)


def test_objects_belong_to_the_key_that_made_them(stack):
    mine = stack.client(0)
    source = upload(mine, jsonl([chat_line("only", "Hi.")]))
    batch = mine.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    other = stack.client(1, KEYS[1])
    for call in (lambda: other.files.retrieve(source.id),
                 lambda: other.files.content(source.id),
                 lambda: other.files.delete(source.id),
                 lambda: other.batches.retrieve(batch.id),
                 lambda: other.batches.cancel(batch.id),
                 lambda: other.batches.create(input_file_id=source.id,
                                              endpoint="/v1/chat/completions",
                                              completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert source.id not in [f.id for f in other.files.list().data]
    assert batch.id not in [x.id for x in other.batches.list().data]
    assert poll(stack.client(1), batch.id).request_counts.completed == 1


def _status(response: httpx.Response) -> tuple[int, str | None]:
    return response.status_code, response.json()["error"]["param"]


def test_every_new_field_has_clear_bounds(stack):
    url, headers = stack.urls[0], {"Authorization": f"Bearer {KEYS[0]}"}

    def post_file(content: bytes, purpose: str = "batch", field: str = "file"):
        return httpx.post(f"{url}/v1/files", headers=headers, timeout=30,
                          data={"purpose": purpose}, files={field: ("f.jsonl", content)})

    one = jsonl([chat_line("x", "Hi.")])
    assert _status(post_file(one, purpose="fine-tune")) == (400, "purpose")
    assert _status(post_file(one, field="upload")) == (400, "file")
    assert _status(post_file(b"\n\n")) == (400, "file")
    assert _status(post_file(b"x" * (MAX_BYTES + 1))) == (413, "file")
    assert _status(post_file(b"{}\n" * (MAX_LINES + 1))) == (400, "file")
    assert post_file(b"{}\n" * MAX_LINES).status_code == 200  # at the bound: taken
    not_form = httpx.post(f"{url}/v1/files", headers=headers, json={"purpose": "batch"},
                          timeout=10)
    assert not_form.status_code == 400

    good = upload(stack.client(0), one).id

    def create(**changes):
        body = {"input_file_id": good, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **changes}
        return httpx.post(f"{url}/v1/batches", headers=headers, json=body, timeout=30)

    assert _status(create(endpoint="/v1/responses")) == (400, "endpoint")
    assert _status(create(endpoint="/v1/embeddings")) == (400, "endpoint")  # no pooling model
    assert _status(create(completion_window="48h")) == (400, "completion_window")
    assert _status(create(input_file_id="file-nope")) == (404, "input_file_id")
    assert _status(create(metadata={f"k{i}": "v" for i in range(17)})) == (400, "metadata")
    assert _status(create(metadata={"k": "v" * 513})) == (400, "metadata.k")
    assert create(metadata={"k": 1}).status_code == 400
    assert _status(create(endpont="/v1/completions"))[0] == 400  # an unknown field
    assert _status(create(input_file_id=None)) == (400, "input_file_id")
    for path in ("/v1/batches/batch_nope", "/v1/batches/batch_nope/cancel",
                 "/v1/files/file-nope", "/v1/files/file-nope/content"):
        method = "POST" if path.endswith("cancel") else "GET"
        answer = httpx.request(method, url + path, headers=headers, timeout=10)
        assert answer.status_code == 404, path
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                         ("after=batch_nope", "after")):
        answer = httpx.get(f"{url}/v1/batches?{query}", headers=headers, timeout=10)
        assert _status(answer) == (400, param), query
    for query, param in (("limit=0", "limit"), ("order=up", "order")):
        answer = httpx.get(f"{url}/v1/files?{query}", headers=headers, timeout=10)
        assert _status(answer) == (400, param), query


def test_a_cancelled_batch_keeps_what_finished(stack):
    a, b = stack.client(0), stack.client(1)
    # Fifteen waves of lines (the in-flight bound is 4): the runner sees a cancel at its
    # keeper's next tick (LEASE_S / 3), and the counts appear at a tick too, so the batch must
    # outlast two ticks by far on a fast machine (four waves finished first there). The lines
    # after the cancel never run, so their number costs no time.
    total = 60  # --max-batch-lines
    lines = [chat_line(f"long-{i}", "Tell a story.", max_tokens=48, ignore_eos=True)
             for i in range(total)]
    source = upload(a, jsonl(lines)).id
    batch, filler = (a.batches.create(input_file_id=source, endpoint="/v1/chat/completions",
                                      completion_window="24h") for _ in range(MAX_ACTIVE))
    with pytest.raises(openai.RateLimitError):  # MAX_ACTIVE unfinished already
        b.batches.create(input_file_id=source, endpoint="/v1/chat/completions",
                         completion_window="24h")
    assert b.batches.cancel(filler.id).status in ("cancelling", "cancelled")
    wait_until(lambda: b.batches.retrieve(batch.id).request_counts.completed > 0, 120,
               "the first lines")
    assert b.batches.cancel(batch.id).status in ("cancelling", "cancelled")
    assert poll(b, filler.id, 60).status == "cancelled"
    done = poll(a, batch.id, 60)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    assert 0 < done.request_counts.completed < total
    output = lines_of(a, done.output_file_id)
    assert len(output) == done.request_counts.completed
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 48
               for line in output)


def test_anthropic_message_batches(stack):
    client = stack.anthropic(1)
    params = {"model": MODEL, "max_tokens": 2,
              "messages": [{"role": "user", "content": "Hi"}]}
    made = client.messages.batches.create(requests=[
        {"custom_id": "ok-1", "params": params},
        {"custom_id": "ok-2", "params": params},
        {"custom_id": "bad", "params": {**params, "max_tokens": 0}}])
    assert made.id.startswith("msgbatch_") and made.processing_status == "in_progress"
    with pytest.raises(anthropic.NotFoundError):
        stack.anthropic(0, KEYS[1]).messages.batches.retrieve(made.id)
    other = stack.anthropic(0)
    deadline = time.monotonic() + 120
    while other.messages.batches.retrieve(made.id).processing_status != "ended":
        assert time.monotonic() < deadline
        time.sleep(0.3)
    ended = other.messages.batches.retrieve(made.id)
    assert (ended.request_counts.succeeded, ended.request_counts.errored) == (2, 1)
    results = {r.custom_id: r.result for r in other.messages.batches.results(made.id)}
    assert results["ok-1"].type == "succeeded" and results["ok-1"].message.usage.output_tokens
    assert results["bad"].type == "errored"
    assert results["bad"].error.error.type == "invalid_request_error"
    assert made.id in [x.id for x in other.messages.batches.list().data]
    for requests in ([], [{"custom_id": "no spaces", "params": params}],
                     [{"custom_id": "twice", "params": params}] * 2,
                     [{"custom_id": "s", "params": {**params, "stream": True}}]):
        with pytest.raises(anthropic.BadRequestError):
            client.messages.batches.create(requests=requests)
    assert other.messages.batches.delete(made.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        other.messages.batches.retrieve(made.id)


def test_a_store_that_goes_away_gives_503s_and_loses_nothing(stack):
    a = stack.client(0)
    kept = upload(a, jsonl([chat_line("kept", "Hi.")]))
    url, headers = stack.urls[1], {"Authorization": f"Bearer {KEYS[0]}"}
    stack.redis.stop()
    try:
        for method, path, body in (
                ("GET", "/v1/files", None), ("GET", f"/v1/files/{kept.id}/content", None),
                ("GET", "/v1/batches", None), ("GET", "/v1/messages/batches", None),
                ("POST", "/v1/batches", {"input_file_id": kept.id, "completion_window": "24h",
                                         "endpoint": "/v1/chat/completions"})):
            answer = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert answer.status_code == 503, (path, answer.text)
    finally:
        stack.redis.start()
    # Once Redis answers, both frontends do at once: a pooled connection from before the
    # restart fails its first command, which the client sends again on a new connection.
    for client in (a, stack.client(1)):
        for _ in range(4):  # more than one pooled connection each
            assert client.files.content(kept.id).text.startswith('{"custom_id": "kept"')


def test_a_batch_outlives_its_frontend(stack):
    """Last: it SIGKILLs frontend a, whose lease runs out; frontend b's sweep resumes the
    batch and runs the lines that have no result yet."""
    a, b = stack.client(0), stack.client(1)
    # Frontend a writes its counts every LEASE_S / 3 (2 s): each line must outlast a
    # third of that interval (3 in flight, 4 rounds), or all 12 can end between two
    # writes and the kill below comes after the last (CI saw that once with 4 tokens).
    # 96 tokens at the batch's lowest priority take about 2 s here (Zen 4).
    lines = [chat_line(f"r-{i}", f"Count to {i}.", max_tokens=96, ignore_eos=True)
             for i in range(12)]
    batch = a.batches.create(input_file_id=upload(a, jsonl(lines)).id,
                             endpoint="/v1/chat/completions", completion_window="24h")
    # Frontend a took it (it had room): kill it once some, not all, lines are done.
    wait_until(lambda: b.batches.retrieve(batch.id).request_counts.completed >= 1, 120,
               "the first lines on frontend a")
    os.killpg(stack.frontends[0].proc.popen.pid, signal.SIGKILL)
    assert b.batches.retrieve(batch.id).request_counts.completed < 12
    done = poll(b, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    output = lines_of(b, done.output_file_id)
    assert [line["custom_id"] for line in output] == [f"r-{i}" for i in range(12)]
