"""Speech to text's form, read by the gateway as the engine reads it
(app/router/multipart_form.py; docs/design/responses-api.md):
the in-process router in front of the vLLM stand-in, whose
form is read by Starlette's own `Request.form()`, as vLLM's is. A form the
two could read two ways is refused before it reaches an engine."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp.test_utils import TestServer
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException

from app.router.multipart_form import Form, form_fields
from app.router.own_answers import Reply
from app.router.published import CatalogEntry, Endpoint, KeyGrant
from tests.fakes import fake_vllm
from tests.fakes.fake_vllm import FakeVLLM, parse_args
from tests.fakes.fake_vllm_responses import starlette_form
from tests.support.proxy_rig import CLIENT_KEY, Rig, hash_key

AUTH = {"Authorization": f"Bearer {CLIENT_KEY}"}
PATH = "/v1/audio/transcriptions"
BOUNDARY = "b0und4ry"
KIND = f"multipart/form-data; boundary={BOUNDARY}"
FILE = (b'Content-Disposition: form-data; name="file"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav", b"RIFF" + b"\0" * 60)


def form(*parts: tuple[bytes, bytes]) -> bytes:
    """A multipart body of (headers, value) parts, headers as written."""
    out = b"".join(b"--%s\r\n%s\r\n\r\n%s\r\n" % (BOUNDARY.encode(), head, value)
                   for head, value in parts)
    return out + b"--%s--\r\n" % BOUNDARY.encode()


def field(disposition: bytes, value: bytes) -> tuple[bytes, bytes]:
    return b"Content-Disposition: " + disposition, value


@contextlib.asynccontextmanager
async def engine(rig: Rig) -> AsyncIterator[list[str]]:
    """The vLLM stand-in serving m1 and m2, behind a key allowed m1 only;
    yields the list of what each request reached it as (model, stream)."""
    fake_vllm._import_aiohttp()  # the stand-in imports aiohttp once its argv is good
    fake = FakeVLLM(parse_args(["serve", "org/m1", "--served-model-name", "m1", "m2"]))
    server = TestServer(fake.make_app(), host="127.0.0.1", handler_cancellation=True)
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    rig.table.set_catalog([CatalogEntry("m1", (), 1), CatalogEntry("m2", (), 2)])
    rig.table.set_endpoints({m: [Endpoint(f"r-{m}", url, "", engine="vllm")]
                             for m in ("m1", "m2")})
    rig.table.set_client_keys({hash_key(CLIENT_KEY): KeyGrant("k1", "t", frozenset({"m1"}))})
    try:
        yield rig.attempts
    finally:
        await server.close()


async def post(rig: Rig, raw: bytes, kind: str = KIND) -> httpx.Response:
    return await rig.http.post(PATH, content=raw, headers={**AUTH, "Content-Type": kind})


async def test_a_second_model_the_key_may_not_use_never_reaches_the_engine(rig: Rig) -> None:
    # Quoted, the gateway's old reader saw m1 alone; unquoted, Starlette reads
    # m2 too, and its FormData keeps the last: the engine would serve m2.
    raw = form(field(b'form-data; name="model"', b"m1"), field(b"form-data; name=model", b"m2"),
               FILE)
    async with engine(rig) as reached:
        r = await post(rig, raw)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "model"
        assert reached == [], "the form reached the engine"


async def test_a_model_named_twice_by_a_second_disposition_line_is_refused(rig: Rig) -> None:
    # Starlette keeps a part's last Content-Disposition (on_header_end).
    raw = form(field(b'form-data; name="model"', b"m1"),
               (b'Content-Disposition: form-data; name="prompt"\r\n'
                b'Content-Disposition: form-data; name="model"', b"m2"), FILE)
    async with engine(rig) as reached:
        r = await post(rig, raw)
        assert r.status_code == 400, r.text
        assert reached == [], "the form reached the engine"


@pytest.mark.parametrize("disposition", [b"form-data; name=stream",
                                         b'form-data; name = "stream"',
                                         b'form-data;NAME="stream"'])
async def test_stream_as_the_engine_reads_it_is_relayed_as_a_stream(rig: Rig,
                                                                    disposition: bytes) -> None:
    # vLLM streams its answer; the gateway, reading no `stream`, read it whole
    # as a plain answer (its length set, its usage looked for in JSON).
    raw = form(field(b'form-data; name="model"', b"m1"), field(disposition, b"true"), FILE)
    async with engine(rig):
        async with rig.http.stream("POST", PATH, content=raw,
                                   headers={**AUTH, "Content-Type": KIND}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            assert "content-length" not in r.headers, "relayed as a plain answer, read whole"
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert form_fields(raw, KIND).stream is True
    assert events[-1] == "data: [DONE]"
    words = "".join(json.loads(e[6:])["choices"][0]["delta"]["content"] for e in events[:-1])
    assert words == "fake-vllm m1 heard 64 bytes of a.wav"


async def test_the_official_client_s_transcription_goes_through(rig: Rig) -> None:
    async with engine(rig):
        client = openai.AsyncOpenAI(
            api_key=CLIENT_KEY, base_url="http://gw/v1", max_retries=0,
            http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=rig.proxy)))
        async with client:
            heard = await client.audio.transcriptions.create(model="m1",
                                                             file=("a.wav", b"RIFF" * 16))
            assert heard.text == "fake-vllm m1 heard 64 bytes of a.wav"
            with pytest.raises(openai.NotFoundError):
                await client.audio.transcriptions.create(model="m2", file=("a.wav", b"RIFF"))


async def _engine_reads(raw: bytes, kind: str) -> tuple[Any, Any, bool] | None:
    """(model, stream, a file) as vLLM's Starlette reads them (FormData.get:
    the last of a name); None where it refuses the form."""
    try:
        got = await starlette_form(raw, kind)
    except MultiPartException:
        return None
    read = (got.get("model"), got.get("stream"), isinstance(got.get("file"), UploadFile))
    await got.close()
    return read


MODEL = field(b'form-data; name="model"', b"m1")
# Forms whose headers two readers could take two ways: each is read as the
# engine reads it, or refused.
TRICKY = [
    [field(b"form-data; name=model", b"m1"), FILE],
    [field(b'form-data; name = "model"', b"m1"), FILE],
    [field(b'form-data; NAME="model"', b"m1"), FILE],
    [field(b'form-data;name="model"', b"m1"), FILE],
    [field(b'attachment; name="model"', b"m1"), FILE],
    [field(b'form-data; name="file"; name="model"', b"m1"), FILE],
    [field(b'form-data; name="model"; name="prompt"', b"m2"), MODEL, FILE],
    [field(b'form-data; name*=utf-8\'\'model; name="prompt"', b"m2"), MODEL, FILE],
    [field(b'form-data; name="mo\\"del"', b"m2"), MODEL, FILE],
    [field(b'form-data; x="; name=model"; name="prompt"', b"m2"), MODEL, FILE],
    [(b'content-disposition: form-data; name="model"', b"m1"), FILE],
    [(b'Content-Disposition:form-data; name="model"', b"m1"), FILE],
    [(b'Content-Disposition: form-data; name="prompt"\r\n'
      b'Content-Disposition: form-data; name="model"', b"m2"), MODEL, FILE],
    [(b'Content-Disposition: form-data; name="model"\r\n'
      b'Content-Disposition: form-data; name="prompt"', b"m2"), FILE],
    [(b'Content-Disposition : form-data; name="model"', b"m1"), FILE],
    [(b'X: y\r\n Content-Disposition: form-data; name="model"', b"m1"), FILE],
    [field(b'form-data; name="model"; filename="m.txt"', b"m1"), FILE],
    [MODEL, field(b'form-data; name="file"', b"RIFF")],
    [MODEL, FILE, field(b'form-data; name="file"', b"RIFF")],
    [MODEL, field(b"form-data; name=stream", b"true"), FILE],
    [MODEL, field(b"form-data; name=stream", b"True"), FILE],
    [MODEL, field(b'form-data; name="stream"', b"true"),
     field(b"form-data; name=stream", b"false"), FILE],
    [MODEL, field(b"form-data", b"x"), FILE],
    [MODEL, (b"X-Other: 1", b"x"), FILE],
]


@pytest.mark.parametrize("parts", TRICKY)
async def test_what_the_gateway_reads_the_engine_reads_the_same(
        parts: list[tuple[bytes, bytes]]) -> None:
    raw = form(*parts)
    engine_reads = await _engine_reads(raw, KIND)
    try:
        ours: Form | None = form_fields(raw, KIND)
    except Reply as refused:
        assert refused.status == 400 and json.loads(refused.body)["error"]["message"]
        ours = None
    if ours is not None:
        assert engine_reads is not None, "the engine refuses a form the gateway passed"
        model, stream, has_file = engine_reads
        assert (model, has_file) == (ours.model, True)
        assert stream in (("true",) if ours.stream else (None, "false"))
        assert raw[slice(*ours.model_at)] == ours.model.encode()


@pytest.mark.parametrize("kind", [
    f'multipart/form-data; xboundary=nope; boundary="{BOUNDARY}"',
    f"multipart/form-data; boundary={BOUNDARY}; charset=latin-1",
    f'Multipart/Form-Data;boundary = "{BOUNDARY}"',
    f"multipart/form-data; boundary=nope; boundary={BOUNDARY}",
])
async def test_the_boundary_is_the_one_the_engine_reads(kind: str) -> None:
    raw = form(MODEL, FILE)
    ours = form_fields(raw, kind)
    assert await _engine_reads(raw, ours.content_type.decode()) == ("m1", None, True)
    assert await _engine_reads(raw, kind) == ("m1", None, True)


def _parts(n: int) -> list[tuple[bytes, bytes]]:
    return [MODEL, FILE] + [field(b'form-data; name="x"', b"v")] * (n - 2)


def _padded(size: int) -> tuple[bytes, bytes]:
    """A part with two headers of `size` bytes (each under python-multipart's
    4,224 a line)."""
    pad = b"X-Pad: " + b"y" * size
    return b'Content-Disposition: form-data; name="x"\r\n' + pad + b"\r\n" + pad, b"v"


@pytest.mark.parametrize(("raw", "why"), [
    # Padding after a boundary (RFC 2046 allows it; no client sends it):
    # python-multipart steps through it byte by byte.
    (form(MODEL, FILE).replace(b"--" + BOUNDARY.encode() + b"\r\n",
                               b"--" + BOUNDARY.encode() + b" " * 64 + b"\r\n", 2), "padded"),
    # The boundary inside the audio, not as a delimiter: likewise.
    (form(MODEL, (FILE[0], b"RIFF\r\n--" + BOUNDARY.encode() + b"x" * 40)), "inside a part"),
    (form(*_parts(101)), "more than 100 parts"),
    (form(MODEL, _padded(4100), FILE), "bytes of headers"),
    (b"junk\r\n" + form(MODEL, FILE), "does not open"),
    (form(MODEL, FILE)[:-len(BOUNDARY) - 6], "not closed"),
])
def test_what_would_make_the_parser_step_byte_by_byte_is_refused_first(raw: bytes,
                                                                       why: str) -> None:
    with pytest.raises(Reply) as refused:
        form_fields(raw, KIND)
    assert refused.value.status == 400
    assert why in json.loads(refused.value.body)["error"]["message"]


def test_a_form_within_the_bounds_is_read() -> None:
    assert form_fields(form(*_parts(100)), KIND).model == "m1"
    assert form_fields(form(MODEL, _padded(3900), FILE), KIND).model == "m1"


@pytest.mark.parametrize("bad", [b"Content-Disposition form-data", b"Content-Disp\x01osition:"])
def test_a_malformed_form_is_refused_without_a_warning_in_the_log(
        bad: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """python-multipart logs a WARNING for each malformed form before it
    raises: the client gets its 400, and the gateway's log is not the
    client's to fill (one line a request)."""
    raw = form(MODEL, FILE).replace(b"Content-Disposition:", bad, 1)
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(Reply) as refused:
            form_fields(raw, KIND)
    assert refused.value.status == 400
    assert [(r.name, r.levelname) for r in caplog.records if r.levelno >= logging.WARNING] == []
