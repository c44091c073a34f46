"""Media identity, guarded fetching and size reads, against a real HTTP origin on 127.0.0.1."""

from __future__ import annotations

import base64
import http.client
import io
import random
import socket
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from PIL import Image

from routing.media.images import (
    DecodedDataUrls,
    KeptPicture,
    MediaError,
    MediaPolicy,
    decode_data_url,
    fetch_bytes,
    pixel_identity,
    probe_image_size,
    read_image_size,
    resolve_images,
    routing_hash,
    url_identity,
)
from tests.image_server import ImageServer

LOCAL = MediaPolicy(allowed_hosts=("127.0.0.1",), connect_timeout=2.0, read_timeout=2.0)


def _noise(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    channels = len(mode)
    return Image.frombytes(mode, (width, height), random.Random(seed).randbytes(width * height * channels))


def _encode(image: Image.Image, fmt: str = "PNG", **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares a size and holds no pixels: what a decompression bomb looks like."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def _refusal(call: object, *args: object, **kwargs: object) -> MediaError:
    with pytest.raises(MediaError) as caught:
        call(*args, **kwargs)  # type: ignore[operator]
    return caught.value


@pytest.fixture
def server() -> Iterator[ImageServer]:
    with ImageServer() as origin:
        yield origin


@pytest.fixture(scope="module")
def small_png() -> bytes:
    return _encode(_noise(64, 48, seed=1))


@pytest.fixture(scope="module")
def large_png() -> bytes:
    """About 12 MiB: an image whose full download would dwarf a header read."""
    return _encode(_noise(2048, 2048, seed=2), compress_level=0)


# --- identities ----------------------------------------------------------------------------------
def test_same_url_gives_the_same_identity_and_one_changed_query_parameter_another() -> None:
    url = "https://images.example/cat.png?w=640&sig=abc"
    assert url_identity(url) == url_identity(str(url))
    assert url_identity(url) != url_identity("https://images.example/cat.png?w=641&sig=abc")
    assert len(url_identity(url)) == 32 and url_identity(url) == url_identity(url).lower()
    int(url_identity(url), 16)


def test_routing_hash_is_the_first_64_bits_of_the_identity() -> None:
    identity = url_identity("https://images.example/cat.png")
    assert routing_hash(identity) == int(identity[:16], 16)
    assert routing_hash(identity) < 2**64
    with pytest.raises(ValueError):
        routing_hash("abc")


def test_a_data_url_identity_hashes_the_whole_uri(small_png: bytes) -> None:
    url = _data_url(small_png)
    other = _data_url(small_png[:-1] + bytes([small_png[-1] ^ 1]))
    assert url_identity(url) != url_identity(other)
    assert url_identity(url) != url_identity(_data_url(small_png, mime="image/x-png"))


def test_url_mode_gives_two_urls_of_the_same_bytes_two_identities_and_reads_their_size(
    server: ImageServer, small_png: bytes
) -> None:
    first, second = server.add("/a.png", small_png), server.add("/b.png", small_png)
    images = resolve_images([first, second, first], LOCAL, frontend_decoding=False)
    assert [image.index for image in images] == [0, 1, 2]
    assert [image.url for image in images] == [first, second, first]
    assert images[0].identity == url_identity(first) == images[2].identity
    assert images[0].identity != images[1].identity
    assert images[0].routing_hash == routing_hash(images[0].identity)
    assert all((image.width, image.height, image.data) == (64, 48, None) for image in images)


def test_frontend_decoding_gives_the_same_pixels_one_identity_under_two_urls_and_as_a_data_url(
    server: ImageServer, small_png: bytes
) -> None:
    urls = [server.add("/a.png", small_png), server.add("/b.png?v=2", small_png), _data_url(small_png)]
    images = resolve_images(urls, LOCAL, frontend_decoding=True)
    assert len({image.identity for image in images}) == 1
    assert images[0].identity == pixel_identity(Image.open(io.BytesIO(small_png)))
    assert all(image.data == small_png for image in images)  # the bytes travel on to the worker
    assert all((image.width, image.height) == (64, 48) for image in images)


def test_frontend_decoding_gives_the_same_picture_in_another_encoding_the_same_identity(
    server: ImageServer,
) -> None:
    picture = _noise(40, 30, seed=5)
    as_png = server.add("/p.png", _encode(picture, "PNG"))
    as_bmp = server.add("/p.bmp", _encode(picture, "BMP"), content_type="image/bmp")
    png, bmp = resolve_images([as_png, as_bmp], LOCAL, frontend_decoding=True)
    assert png.identity == bmp.identity
    assert png.data != bmp.data


def test_frontend_decoding_gives_different_pixels_different_identities(server: ImageServer) -> None:
    picture = _noise(40, 30, seed=6)
    changed = picture.copy()
    changed.putpixel((39, 29), (0, 0, 0) if picture.getpixel((39, 29)) != (0, 0, 0) else (1, 1, 1))
    urls = [server.add("/one.png", _encode(picture)), server.add("/two.png", _encode(changed))]
    one, two = resolve_images(urls, LOCAL, frontend_decoding=True)
    assert one.identity != two.identity


def test_pixel_identity_tells_apart_mode_size_and_palette() -> None:
    gray = _noise(8, 6, seed=7, mode="L")
    assert pixel_identity(gray) != pixel_identity(gray.convert("RGB"))
    assert pixel_identity(gray) != pixel_identity(gray.resize((6, 8)))
    indexed = gray.convert("P")
    recoloured = indexed.copy()
    recoloured.putpalette([255 - value for value in indexed.getpalette() or []])
    assert indexed.tobytes() == recoloured.tobytes()
    assert pixel_identity(indexed) != pixel_identity(recoloured)


# --- fetching ------------------------------------------------------------------------------------
def test_fetch_returns_the_body_and_sends_caller_headers(server: ImageServer, small_png: bytes) -> None:
    url = server.add_variants("/v.png", "X-Variant", {"a": b"first", "b": small_png})
    assert fetch_bytes(url, LOCAL, headers={"X-Variant": "b"}) == small_png
    assert fetch_bytes(url, LOCAL, headers={"X-Variant": "a"}) == b"first"
    assert server.hits("/v.png") == 2


@pytest.mark.parametrize("honour_range", [True, False])
def test_limit_returns_only_the_first_bytes(
    server: ImageServer, large_png: bytes, honour_range: bool
) -> None:
    url = server.add("/large.png", large_png, honour_range=honour_range)
    assert fetch_bytes(url, LOCAL, limit=1000) == large_png[:1000]


def test_allowlisted_cidr_or_hostname_lets_a_loopback_origin_through(
    server: ImageServer, small_png: bytes
) -> None:
    server.add("/a.png", small_png)
    by_cidr = MediaPolicy(allowed_hosts=("127.0.0.0/8",))
    assert fetch_bytes(server.url("/a.png"), by_cidr) == small_png
    by_name = MediaPolicy(allowed_hosts=("LOCALHOST",))
    assert fetch_bytes(server.url("/a.png", host="localhost"), by_name) == small_png


def test_the_connection_goes_to_the_address_vetted_once_with_fake_resolver(
    server: ImageServer, small_png: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fault injection: a resolver that would answer differently on a second lookup (DNS rebinding)
    answers = iter(["127.0.0.1", "10.9.9.9"])
    lookups: list[str] = []

    def rebinding_resolver(host: str, port: int, *args: object, **kwargs: object) -> list[tuple]:
        lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (next(answers), port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding_resolver)
    server.add("/a.png", small_png)
    policy = MediaPolicy(allowed_hosts=("127.0.0.1/32",))
    assert fetch_bytes(server.url("/a.png", host="images.test"), policy) == small_png
    assert lookups == ["images.test"]
    assert server.request_headers("/a.png")[0]["host"] == f"images.test:{server.port}"


def test_redirects_are_followed_each_hop_vetted(server: ImageServer, small_png: bytes) -> None:
    server.add("/final.png", small_png)
    server.add_redirect("/hop2", "/final.png", status=301)
    url = server.add_redirect("/hop1", server.url("/hop2"), status=307)
    assert fetch_bytes(url, LOCAL) == small_png
    assert [server.hits(path) for path in ("/hop1", "/hop2", "/final.png")] == [1, 1, 1]


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["ftp://example.com/cat.png", "file:///etc/passwd", "gopher://x/", "cat.png"])
def test_a_url_of_another_scheme_is_refused_with_400(url: str, small_png: bytes) -> None:
    error = _refusal(resolve_images, [_data_url(small_png), url], LOCAL, frontend_decoding=False)
    assert (error.status, error.code, error.image_index) == (400, "unsupported_scheme", 1)
    assert error.message.startswith("image 1: ") and "not supported" in error.message


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("localhost", "loopback"),
        ("[::1]", "loopback"),
        ("[::ffff:127.0.0.1]", "loopback"),
        ("10.1.2.3", "private"),
        ("192.168.0.5", "private"),
        ("172.16.9.9", "private"),
        ("169.254.10.1", "link-local"),
        ("169.254.169.254", "metadata"),
        ("[fd00:ec2::254]", "metadata"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("100.64.0.1", "not a public address"),
    ],
)
def test_an_internal_address_is_refused_with_403_without_an_allowlist(
    server: ImageServer, small_png: bytes, host: str, reason: str
) -> None:
    server.add("/a.png", small_png)
    url = f"http://{host}:{server.port}/a.png"
    error = _refusal(fetch_bytes, url, MediaPolicy())
    assert (error.status, error.code) == (403, "address_refused")
    assert reason in error.message and "refused" in error.message
    assert server.hits("/a.png") == 0  # refused before any connection


def test_a_refused_internal_address_says_which_setting_allows_it_and_on_which_processes(
    server: ImageServer, small_png: bytes
) -> None:
    server.add("/a.png", small_png)
    error = _refusal(fetch_bytes, server.url("/a.png"), MediaPolicy())
    assert "MEDIA_ALLOWED_HOSTS" in error.message
    # both sides fetch, so an operator must set it on both
    assert "API server" in error.message and "every worker" in error.message


def test_a_redirect_to_a_private_address_is_refused(server: ImageServer) -> None:
    url = server.add_redirect("/r", "http://10.0.0.7/internal.png")
    error = _refusal(fetch_bytes, url, LOCAL)
    assert (error.status, error.code) == (403, "address_refused")
    assert "10.0.0.7" in error.message and "private" in error.message


def test_a_redirect_to_another_scheme_is_refused(server: ImageServer) -> None:
    url = server.add_redirect("/r", "file:///etc/passwd")
    assert _refusal(fetch_bytes, url, LOCAL).status == 400


def test_a_redirect_loop_stops_after_max_redirects_with_502(server: ImageServer) -> None:
    url = server.add_redirect("/loop", "/loop")
    error = _refusal(fetch_bytes, url, MediaPolicy(allowed_hosts=("127.0.0.1",), max_redirects=2))
    assert (error.status, error.code) == (502, "too_many_redirects")
    assert server.hits("/loop") == 3


def test_an_origin_error_status_is_502(server: ImageServer) -> None:
    error = _refusal(fetch_bytes, server.url("/missing.png"), LOCAL)
    assert (error.status, error.code) == (502, "origin_error")
    assert "404" in error.message


def test_a_content_length_over_the_cap_is_refused_with_413_before_the_body_is_read(
    server: ImageServer,
) -> None:
    # the body only comes after 5 s: a prompt refusal proves the header alone decided
    url = server.add("/huge.png", b"x" * 1000, declared_length=2_000_000, body_delay=5.0)
    started = time.monotonic()
    error = _refusal(fetch_bytes, url, MediaPolicy(allowed_hosts=("127.0.0.1",), max_bytes=1_000_000))
    assert time.monotonic() - started < 2.0
    assert (error.status, error.code) == (413, "image_too_large")
    assert "2000000 bytes" in error.message and "1000000" in error.message


def test_a_body_streaming_forever_is_cut_off_with_413_just_past_the_cap(
    server: ImageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    cap = 512 * 1024
    chunk = b"\x89PNG\r\n\x1a\n" + b"\0" * 65528  # the origin writes and counts 64 KiB at a time
    url = server.add_stream_forever("/forever.png", chunk=chunk)
    read = []  # what the fetcher took off the socket, read by read
    read1 = http.client.HTTPResponse.read1

    def counted(response: http.client.HTTPResponse, n: int = -1) -> bytes:
        data = read1(response, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(http.client.HTTPResponse, "read1", counted)
    error = _refusal(fetch_bytes, url, MediaPolicy(allowed_hosts=("127.0.0.1",), max_bytes=cap))
    assert (error.status, error.code) == (413, "image_too_large")
    assert sum(read) == cap + 1  # one byte past the cap tells it was crossed; nothing more is read
    time.sleep(0.3)
    sent = server.bytes_sent("/forever.png")
    time.sleep(0.2)
    assert server.bytes_sent("/forever.png") == sent  # the client hung up: the origin stopped sending
    # The origin's count also holds what the kernel buffered and the fetcher never read: its send
    # buffer and the receiver's window, which TCP autotuning grows up to these limits (on a slow
    # machine, megabytes: the reading thread waits for a core while the origin keeps writing),
    # counted in whole chunks.
    assert cap <= sent <= cap + _kernel_buffer_limit() + len(chunk)


def _kernel_buffer_limit() -> int:
    """The most a TCP connection's send buffer and receive window can hold together here."""
    try:
        limits = [
            int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
            for name in ("tcp_wmem", "tcp_rmem")
        ]
    except (OSError, ValueError, IndexError):  # not Linux: the old allowance
        return 1024 * 1024
    return sum(limits)


def test_an_origin_that_never_answers_times_out_with_504(server: ImageServer) -> None:
    url = server.add("/slow.png", b"x", header_delay=3.0)
    started = time.monotonic()
    error = _refusal(fetch_bytes, url, MediaPolicy(allowed_hosts=("127.0.0.1",), read_timeout=0.2))
    assert time.monotonic() - started < 1.5
    assert (error.status, error.code) == (504, "origin_timeout")


def test_a_body_that_stalls_times_out_with_504(server: ImageServer, small_png: bytes) -> None:
    url = server.add("/stall.png", small_png, body_delay=3.0)
    error = _refusal(fetch_bytes, url, MediaPolicy(allowed_hosts=("127.0.0.1",), read_timeout=0.2))
    assert (error.status, error.code) == (504, "origin_timeout")


@pytest.mark.parametrize("frontend_decoding", [False, True])
def test_undecodable_bytes_are_refused_with_400(server: ImageServer, frontend_decoding: bool) -> None:
    url = server.add("/junk.png", b"this is not an image " * 200)
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=frontend_decoding)
    assert (error.status, error.code, error.image_index) == (400, "not_an_image", 0)
    assert error.message.startswith("image 0: ")


@pytest.mark.parametrize("frontend_decoding", [False, True])
def test_bytes_that_start_like_an_image_but_do_not_decode_are_refused_with_400(
    server: ImageServer, frontend_decoding: bool
) -> None:
    url = server.add("/broken.png", b"\x89PNG\r\n\x1a\n" + b"garbage" * 200)
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=frontend_decoding)
    assert (error.status, error.code, error.image_index) == (400, "image_undecodable", 0)


def test_a_truncated_image_is_refused_with_400_when_decoded(server: ImageServer, large_png: bytes) -> None:
    url = server.add("/cut.png", large_png[: len(large_png) // 2])
    assert probe_image_size(url, LOCAL) == (2048, 2048)  # the header alone is intact
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=True)
    assert (error.status, error.code) == (400, "image_undecodable")


@pytest.mark.parametrize("frontend_decoding", [False, True])
def test_a_decompression_bomb_header_is_refused_with_422(
    server: ImageServer, frontend_decoding: bool
) -> None:
    url = server.add("/bomb.png", _png_header(100_000, 100_000))
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=frontend_decoding)
    assert (error.status, error.code) == (422, "decompression_bomb")
    assert "too many pixels" in error.message


def test_an_image_over_the_policy_pixel_limit_is_refused_with_422_before_decoding(
    server: ImageServer, small_png: bytes
) -> None:
    url = server.add("/a.png", small_png)
    strict = MediaPolicy(allowed_hosts=("127.0.0.1",), max_pixels=64 * 48 - 1)
    for frontend_decoding in (False, True):
        error = _refusal(resolve_images, [url], strict, frontend_decoding=frontend_decoding)
        assert (error.status, error.code) == (422, "decompression_bomb")
        assert "64x48 = 3072 pixels" in error.message
    assert read_image_size(small_png, max_pixels=64 * 48) == (64, 48)


@pytest.mark.parametrize(
    "url",
    [
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png,not-base64",
        "data:image/png;base64,!!!notbase64!!!",
        "data:image/png;base64,",
        "data:image/png;base64",
        "data:;base64,aGVsbG8=",
    ],
)
def test_a_bad_data_url_is_refused_with_400(url: str) -> None:
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=True)
    assert (error.status, error.code, error.image_index) == (400, "invalid_data_url", 0)


def test_a_data_url_of_a_non_image_payload_is_refused_with_400() -> None:
    url = _data_url(b"just some text, not a picture")
    assert _refusal(resolve_images, [url], LOCAL, frontend_decoding=False).status == 400


def test_a_data_url_tolerates_line_breaks_and_its_size_cap_applies(small_png: bytes) -> None:
    encoded = base64.b64encode(small_png).decode()
    wrapped = "\n".join(encoded[i : i + 76] for i in range(0, len(encoded), 76))
    assert decode_data_url(f"data:image/png;base64,{wrapped}") == small_png
    error = _refusal(decode_data_url, _data_url(small_png), max_bytes=len(small_png) - 1)
    assert (error.status, error.code) == (413, "image_too_large")
    over_cap = MediaPolicy(max_bytes=100)
    assert _refusal(probe_image_size, _data_url(small_png), over_cap).status == 413


def test_a_data_url_sent_again_in_its_scope_is_not_decoded_again(small_png: bytes, monkeypatch) -> None:
    # given a frontend's kept data URLs, and a count of the base64 decodings done
    import routing.media.images as images

    decoded = DecodedDataUrls(max_bytes=1024 * 1024)
    decodings = []
    real_decode = images.decode_data_url
    monkeypatch.setattr(
        images, "decode_data_url", lambda url, **kw: decodings.append(url) or real_decode(url, **kw)
    )
    url = _data_url(small_png)

    def resolve(scope: object, policy: MediaPolicy = LOCAL) -> images.ResolvedImage:
        (image,) = resolve_images([url], policy, frontend_decoding=False, scope=scope, decoded=decoded)
        return image

    # when the same picture is sent twice in one scope
    first, again = resolve("tenant-a"), resolve("tenant-a")

    # then it was decoded once, and the repeat is the same image, bytes and size
    assert len(decodings) == 1
    assert again == first and again.data == small_png and (again.width, again.height) == (64, 48)
    # another scope decodes it for itself: what one caller sent saves no other any time
    assert resolve("tenant-b") == first and len(decodings) == 2
    # and limits lowered since are applied to what was kept, as to a decoding
    assert _refusal(resolve, "tenant-a", MediaPolicy(max_bytes=100)).status == 413
    error = _refusal(resolve, "tenant-a", MediaPolicy(max_pixels=64 * 48 - 1))
    assert (error.status, error.code, error.image_index) == (422, "decompression_bomb", 0)
    assert len(decodings) == 2


def test_kept_data_urls_hold_at_most_their_bytes_dropping_the_least_recently_used() -> None:
    decoded = DecodedDataUrls(max_bytes=1000)

    def keep(key: str, size: int, fill: bytes = b"x") -> None:
        decoded.put("s", key, KeptPicture(fill * size, 1, 1))

    for key in "abc":
        keep(key, 250)
    keep("d", 251)  # over a quarter of the budget: not kept
    assert decoded.get("s", "d") is None
    assert decoded.get("s", "a") is not None  # now the most recently used
    keep("e", 250)
    keep("f", 250)  # 1,250 bytes: "b" goes, the least recently used
    assert decoded.get("s", "b") is None
    assert [decoded.get("s", k) is not None for k in "acef"] == [True] * 4
    assert decoded.held_bytes == 1000 and len(decoded) == 4
    keep("a", 100, b"A")  # put again: counted once, with its new bytes
    assert decoded.get("s", "a") == KeptPicture(b"A" * 100, 1, 1) and decoded.held_bytes == 850
    assert decoded.get("other scope", "c") is None


def test_with_frontend_decoding_a_data_url_sent_again_is_not_read_again(
    small_png: bytes, monkeypatch
) -> None:
    # given a frontend that identifies pictures by their pixels, and a count of the pixel reads
    import routing.media.images as images

    decoded = DecodedDataUrls(max_bytes=1024 * 1024)
    reads: list[int] = []
    real_decode_image = images.decode_image
    monkeypatch.setattr(
        images,
        "decode_image",
        lambda data, policy: reads.append(len(data)) or real_decode_image(data, policy),
    )
    url = _data_url(small_png)

    def resolve(frontend_decoding: bool = True) -> images.ResolvedImage:
        (image,) = resolve_images(
            [url], LOCAL, frontend_decoding=frontend_decoding, scope="s", decoded=decoded
        )
        return image

    # when a picture first seen by its URL's identity is sent twice with frontend decoding on
    assert resolve(frontend_decoding=False).identity == url_identity(url)
    first, again = resolve(), resolve()

    # then its pixels were read once, and the repeat has the same pixel identity, size and bytes
    assert reads == [len(small_png)]
    with Image.open(io.BytesIO(small_png)) as picture:
        assert first.identity == pixel_identity(picture)
    assert again == first and (again.width, again.height, again.data) == (64, 48, small_png)
    # and the URL's identity is still what a request without frontend decoding gets
    assert resolve(frontend_decoding=False).identity == url_identity(url)


# --- size reads ----------------------------------------------------------------------------------
def test_read_image_size_reads_the_header_of_each_common_format() -> None:
    picture = _noise(33, 17, seed=9)
    for fmt in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert read_image_size(_encode(picture, fmt)) == (33, 17), fmt


@pytest.mark.parametrize("honour_range", [True, False])
def test_a_header_only_size_read_reads_far_less_than_the_image(
    server: ImageServer, large_png: bytes, honour_range: bool
) -> None:
    url = server.add("/large.png", large_png, honour_range=honour_range)
    assert probe_image_size(url, LOCAL) == (2048, 2048)
    time.sleep(0.1)  # let the origin notice the closed connection
    assert server.hits("/large.png") == 1
    assert server.request_headers("/large.png")[0]["range"] == "bytes=0-65535"
    sent = server.bytes_sent("/large.png")
    if honour_range:
        assert sent == 64 * 1024
    else:  # the origin ignores Range: the client still stops, only socket buffers got ahead of it
        assert sent < len(large_png) / 8


def test_a_size_read_reads_further_only_when_the_header_needs_more(server: ImageServer) -> None:
    # a 200 KB ICC profile sits before the JPEG's frame header, past the first 64 KiB
    jpeg = _encode(_noise(320, 200, seed=4), "JPEG", icc_profile=random.Random(4).randbytes(200_000))
    url = server.add("/icc.jpg", jpeg, content_type="image/jpeg")
    assert probe_image_size(url, LOCAL) == (320, 200)
    # a ranged read of the header, then one read from the start that stops once the size parses
    requests = server.request_headers("/icc.jpg")
    assert [headers.get("range") for headers in requests] == ["bytes=0-65535", None]


# --- a request's images --------------------------------------------------------------------------
def test_the_first_failing_image_names_its_index(server: ImageServer, small_png: bytes) -> None:
    good = server.add("/a.png", small_png)
    urls = [good, good, server.url("/missing.png"), "ftp://x/y.png"]
    error = _refusal(resolve_images, urls, LOCAL, frontend_decoding=False)
    assert (error.status, error.image_index) == (502, 2)
    assert error.message.startswith("image 2: ")


def test_images_of_a_request_are_fetched_concurrently(small_png: bytes) -> None:
    with ImageServer(latency=0.3) as origin:
        urls = [origin.add(f"/{i}.png", small_png) for i in range(4)]
        for frontend_decoding in (False, True):
            started = time.monotonic()
            images = resolve_images(urls, LOCAL, frontend_decoding=frontend_decoding)
            # one after another would take 4 × 0.3 s
            assert time.monotonic() - started < 0.9
            assert [image.url for image in images] == urls


def test_resolve_images_runs_on_the_executor_it_is_given(server: ImageServer, small_png: bytes) -> None:
    urls = [server.add(f"/{i}.png", small_png) for i in range(3)]
    ran_on: list[str] = []

    class RecordingExecutor(ThreadPoolExecutor):
        def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
            def recorded():  # type: ignore[no-untyped-def]
                ran_on.append(threading.current_thread().name)
                return fn(*args, **kwargs)

            return super().submit(recorded)

    with RecordingExecutor(max_workers=2, thread_name_prefix="request-media") as executor:
        images = resolve_images(urls, LOCAL, frontend_decoding=True, executor=executor)
    assert len(ran_on) == 3 and all(name.startswith("request-media") for name in ran_on)
    assert all(image.data == small_png for image in images)


# --- hostile origins (each once held a request or pulled far more than needed) -------------------
def test_an_origin_dripping_a_byte_a_second_is_cut_off_at_the_deadline(server: ImageServer) -> None:
    # given an image that arrives one byte every 0.1 s: each read is quick, the whole is not
    url = server.add_drip("/drip.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 400, interval=0.1)
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), read_timeout=5.0, deadline=1.0)
    # when
    started = time.monotonic()
    error = _refusal(fetch_bytes, url, policy)
    # then the request is answered within its deadline
    assert time.monotonic() - started < 2.0
    assert (error.status, error.code) == (504, "origin_timeout")
    assert "1 s deadline" in error.message


@pytest.mark.parametrize("frontend_decoding", [False, True])
def test_an_endless_body_that_is_not_an_image_stops_at_its_first_bytes_and_is_fetched_once(
    server: ImageServer, frontend_decoding: bool
) -> None:
    # given an origin streaming text forever under an image's name
    url = server.add_stream_forever("/forever.png", chunk=b"<html>not an image</html>" * 1000)
    # when the frontend resolves it
    error = _refusal(resolve_images, [url], LOCAL, frontend_decoding=frontend_decoding)
    time.sleep(0.3)
    # then it was refused after one fetch, having read nothing like the 64 MiB cap
    assert (error.status, error.code) == (400, "not_an_image")
    assert server.hits("/forever.png") == 1
    assert server.bytes_sent("/forever.png") < 2 * 1024 * 1024


def test_a_size_read_never_reads_a_body_past_its_header_more_than_once(server: ImageServer) -> None:
    # given an image whose size only shows 1.5 MB in, behind an origin that ignores Range
    jpeg = _encode(_noise(320, 200, seed=5), "JPEG", icc_profile=random.Random(5).randbytes(1_500_000))
    url = server.add("/icc-norange.jpg", jpeg, content_type="image/jpeg", honour_range=False)
    # when
    assert probe_image_size(url, LOCAL) == (320, 200)
    # then at most the ranged read and one more, never the old 64 KiB, 1 MiB, 16 MiB, 64 MiB ladder
    assert server.hits("/icc-norange.jpg") <= 2
