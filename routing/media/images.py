"""Media identity and guarded fetching: the identity and size of each image in a request, read
without trusting the URL (SSRF guard, size cap, timeouts, decompression-bomb check).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import http.client
import ipaddress
import socket
import ssl
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from io import BytesIO
from typing import Any, NamedTuple
from urllib.parse import quote, unquote_to_bytes, urljoin, urlsplit

import xxhash
from PIL import (  # the decoders allowed on untrusted bytes, registered here (see IMAGE_FORMATS)
    BmpImagePlugin,  # noqa: F401
    GifImagePlugin,  # noqa: F401
    Image,
    JpegImagePlugin,  # noqa: F401
    PngImagePlugin,  # noqa: F401
    TiffImagePlugin,  # noqa: F401
    UnidentifiedImageError,
    WebPImagePlugin,  # noqa: F401
)

from routing.state.expiring import ExpiringLru

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # DYN_MM_MAX_FILE_SIZE_MB's default
HEADER_READ_BYTES = 64 * 1024  # Dynamo's ranged read; enough for nearly every image header
# Decoders Pillow may run on untrusted bytes: the formats a vision model is sent, nothing exotic.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # JPEG also opens MPO (phone photos)

_READ_CHUNK = 64 * 1024
# How the formats in IMAGE_FORMATS begin: a body that starts otherwise is not read any further.
_IMAGE_SIGNATURES: tuple[tuple[int, bytes], ...] = (
    (0, b"\xff\xd8\xff"),  # JPEG (and MPO)
    (0, b"\x89PNG\r\n\x1a\n"),
    (0, b"GIF87a"),
    (0, b"GIF89a"),
    (0, b"BM"),
    (0, b"II*\x00"),  # TIFF, little-endian
    (0, b"MM\x00*"),  # TIFF, big-endian
    (8, b"WEBP"),  # after "RIFF" and the length
)
SIGNATURE_BYTES = 12  # enough of a body to recognise every signature above
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
_URL_UNSAFE_KEEP = "/%:@!$&'()*+,;=-._~?"  # already-legal URL characters left as sent
_DECODE_ERRORS = (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, struct.error)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# What an operator does about a refused internal origin. Both sides fetch: the frontend reads
# each image's header (or the whole image, with frontend decoding) and a worker fetches what the
# frontend did not hand it, so a host allowed on one side only is refused by the other.
ALLOW_HOST_HINT = (
    "To serve images from it, an operator adds the host or its network to MEDIA_ALLOWED_HOSTS "
    "(e.g. MEDIA_ALLOWED_HOSTS=127.0.0.1) in the environment of the API server and of every worker."
)


class MediaError(Exception):
    """An image the platform refuses or cannot get, with the HTTP status the API should answer."""

    def __init__(self, status: int, code: str, message: str, *, image_index: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.image_index = image_index

    def for_image(self, index: int) -> MediaError:
        """The same error naming the image (its 0-based place among the request's images)."""
        if self.image_index is not None:
            return self
        return MediaError(self.status, self.code, f"image {index}: {self.message}", image_index=index)

    def __repr__(self) -> str:
        return f"MediaError({self.status}, {self.code!r}, {self.message!r}, image_index={self.image_index})"


@dataclass(frozen=True)
class MediaPolicy:
    """Limits on fetching and decoding images; the web process builds one from settings."""

    max_bytes: int = DEFAULT_MAX_BYTES
    connect_timeout: float = 5.0
    read_timeout: float = 20.0  # per socket operation, like requests' read timeout
    # One deadline per image for connect, headers and body together (redirects included): an
    # origin dripping a byte a second never holds a request longer than this.
    deadline: float = 30.0
    max_redirects: int = 3
    allowed_hosts: tuple[str, ...] = ()  # hostnames or CIDRs allowed even if private/loopback
    max_pixels: int = 89_478_485  # Pillow's decompression-bomb limit


@dataclass(frozen=True)
class ResolvedImage:
    """One image of a request: its identity, its size and, with frontend decoding, its bytes."""

    index: int
    url: str
    identity: str
    routing_hash: int
    width: int
    height: int
    data: bytes | None  # encoded bytes: fetched with frontend decoding, or a data URL's


# --- identities ----------------------------------------------------------------------------------
def url_identity(url: str) -> str:
    """Identity of an image by its exact URL (query string and whole data URI included)."""
    return xxhash.xxh3_128_hexdigest(url.encode("utf-8", "surrogatepass"))


def pixel_identity(image: Image.Image) -> str:
    """Identity of decoded content: the same picture behind any URL or encoding hashes alike."""
    digest = xxhash.xxh3_128()
    width, height = image.size
    digest.update(f"{image.mode}\0{width}\0{height}\0".encode())
    if image.mode in ("P", "PA"):
        # palette indices alone would make two differently coloured pictures collide
        digest.update(bytes(image.getpalette() or ()))
        digest.update(repr(image.info.get("transparency")).encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def routing_hash(identity: str) -> int:
    """The identity's first 64 bits, folded into block hashes."""
    if len(identity) < 16:
        raise ValueError(f"identity {identity!r} is shorter than 64 bits")
    return int(identity[:16], 16)


# --- the SSRF guard ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Allowlist:
    hostnames: frozenset[str]
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]

    def allows(self, host: str, address: IPAddress) -> bool:
        if host.lower().rstrip(".") in self.hostnames:
            return True
        return any(address.version == net.version and address in net for net in self.networks)


@lru_cache(maxsize=32)
def _allowlist(entries: tuple[str, ...]) -> _Allowlist:
    hostnames, networks = set(), []
    for entry in entries:
        entry = entry.strip()
        try:
            networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
        except ValueError:
            hostnames.add(entry.lower().rstrip("."))
    return _Allowlist(frozenset(hostnames), tuple(networks))


def _refusal_reason(address: IPAddress) -> str | None:
    """Why an origin at this address must not be contacted, or None when it is public."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address in _METADATA_ADDRESSES:
        return "a cloud metadata address"
    for reason, flagged in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("private", address.is_private),
        ("reserved", address.is_reserved),
    ):
        if flagged:
            return f"a {reason} address"
    if not address.is_global:  # shared (CGNAT), documentation and other special-purpose ranges
        return "not a public address"
    return None


@dataclass(frozen=True)
class _Target:
    scheme: str
    host: str
    port: int
    request_path: str


def _parse_http_url(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise MediaError(400, "invalid_url", f"invalid image URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        shown = f"{scheme}://" if scheme else "no scheme"
        raise MediaError(
            400, "unsupported_scheme", f"image URL scheme {shown} is not supported (http, https, data)"
        )
    if not parts.hostname:
        raise MediaError(400, "invalid_url", "image URL has no host")
    path = quote(parts.path or "/", safe=_URL_UNSAFE_KEEP)
    if parts.query:
        path += "?" + quote(parts.query, safe=_URL_UNSAFE_KEEP)
    return _Target(scheme, parts.hostname, port or (443 if scheme == "https" else 80), path)


def _vetted_addresses(target: _Target, policy: MediaPolicy) -> list[tuple[int, tuple]]:
    """Resolve once and vet every address; the connection then goes to one of these, never
    to a fresh resolution (which a rebinding DNS server could point elsewhere)."""
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM)
    except UnicodeError:
        raise MediaError(400, "invalid_url", f"image host {target.host!r} is not a valid host name") from None
    except socket.gaierror as exc:
        if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
            raise MediaError(400, "unknown_host", f"image host {target.host} does not resolve") from None
        raise MediaError(502, "dns_error", f"could not resolve image host {target.host}: {exc}") from None
    allowlist = _allowlist(policy.allowed_hosts)
    vetted = []
    for family, _, _, _, sockaddr in infos:
        address = ipaddress.ip_address(sockaddr[0].split("%", 1)[0])
        reason = _refusal_reason(address)
        # Refuse the host if any of its addresses is internal: picking the public one would still
        # let a host name be used to probe which internal addresses exist.
        if reason is not None and not allowlist.allows(target.host, address):
            raise MediaError(
                403,
                "address_refused",
                f"image host {target.host} resolves to {address}, {reason}; refused. {ALLOW_HOST_HINT}",
            )
        vetted.append((family, sockaddr))
    if not vetted:
        raise MediaError(400, "unknown_host", f"image host {target.host} has no address")
    return vetted


@lru_cache(maxsize=1)
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def _connect(target: _Target, policy: MediaPolicy, deadline: _Deadline) -> http.client.HTTPConnection:
    last_error: OSError | None = None
    for family, sockaddr in _vetted_addresses(target, policy):
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(deadline.wait(policy.connect_timeout, target.host))
        try:
            sock.connect(sockaddr)
        except TimeoutError:
            sock.close()
            raise MediaError(
                504, "origin_timeout", f"connecting to image host {target.host} timed out"
            ) from None
        except OSError as exc:
            sock.close()
            last_error = exc
            continue
        sock.settimeout(deadline.wait(policy.read_timeout, target.host))
        try:
            if target.scheme == "https":
                sock = _tls_context().wrap_socket(sock, server_hostname=target.host)
                connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                    target.host, target.port, timeout=policy.read_timeout, context=_tls_context()
                )
            else:
                connection = http.client.HTTPConnection(target.host, target.port, timeout=policy.read_timeout)
        except TimeoutError:
            sock.close()
            raise MediaError(504, "origin_timeout", f"TLS handshake with {target.host} timed out") from None
        except (ssl.SSLError, ssl.CertificateError, OSError) as exc:
            sock.close()
            raise MediaError(502, "tls_error", f"TLS with image host {target.host} failed: {exc}") from None
        connection.sock = sock  # already connected to the vetted address: http.client won't resolve
        return connection
    raise MediaError(
        502, "origin_unreachable", f"could not connect to image host {target.host}: {last_error}"
    )


def looks_like_an_image(prefix: bytes) -> bool:
    """Whether the first bytes of a body are those of a format the platform decodes."""
    return any(prefix[offset : offset + len(magic)] == magic for offset, magic in _IMAGE_SIGNATURES)


def _not_an_image(host: str) -> MediaError:
    return MediaError(
        400, "not_an_image", f"the body from {host} is not an image (JPEG, PNG, WebP, GIF, BMP or TIFF)"
    )


class _Deadline:
    """One time budget for everything a fetch does; each socket wait gets what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._end = time.monotonic() + seconds

    def left(self) -> float:
        return self._end - time.monotonic()

    def wait(self, per_operation: float, host: str) -> float:
        """The timeout for the next socket operation; 504 once the budget is spent."""
        left = self.left()
        if left <= 0:
            raise self.expired(host)
        return min(per_operation, left)

    def expired(self, host: str) -> MediaError:
        return MediaError(
            504, "origin_timeout", f"image host {host} did not deliver within the {self.seconds:g} s deadline"
        )


def _declared_total(response: http.client.HTTPResponse) -> int | None:
    """The size of the whole resource, as the origin states it."""
    if response.status == 206:
        content_range = response.getheader("Content-Range") or ""
        total = content_range.rpartition("/")[2].strip()
        return int(total) if total.isdigit() else None
    length = (response.getheader("Content-Length") or "").strip()
    return int(length) if length.isdigit() else None


def _read_body(
    response: http.client.HTTPResponse,
    target: _Target,
    policy: MediaPolicy,
    limit: int | None,
    deadline: _Deadline,
    sock: socket.socket,
    expect_image: bool,
    enough: Callable[[bytes], bool] | None,
) -> bytes:
    total = _declared_total(response)
    if total is not None and total > policy.max_bytes:
        raise MediaError(
            413, "image_too_large", f"image is {total} bytes, over the {policy.max_bytes}-byte limit"
        )
    # Read at most one byte past the cap: enough to know it was crossed, never the rest.
    budget = policy.max_bytes + 1 if limit is None else min(limit, policy.max_bytes + 1)
    chunks: list[bytes] = []
    received = 0
    sniffed = not expect_image
    checked_at = 0
    while received < budget:
        sock.settimeout(deadline.wait(policy.read_timeout, target.host))
        # read1: whatever one receive brings, so the deadline is checked between trickles.
        chunk = response.read1(min(_READ_CHUNK, budget - received))
        if not chunk:
            break
        chunks.append(chunk)
        received += len(chunk)
        if not sniffed and received >= SIGNATURE_BYTES:
            if not looks_like_an_image(b"".join(chunks)[:SIGNATURE_BYTES]):
                raise _not_an_image(target.host)
            sniffed = True
        if enough is not None and received >= 2 * checked_at:
            checked_at = received
            if enough(b"".join(chunks)):  # the caller has what it needs (a header): stop reading
                return b"".join(chunks)
    if not sniffed and (limit is None or received < limit) and not looks_like_an_image(b"".join(chunks)):
        raise _not_an_image(target.host)  # a whole body shorter than any signature
    if received > policy.max_bytes:
        raise MediaError(
            413, "image_too_large", f"image from {target.host} is over the {policy.max_bytes}-byte limit"
        )
    return b"".join(chunks)


def fetch_bytes(url: str, policy: MediaPolicy, **options: Any) -> bytes:
    """The body `fetch` reads (same options), without the origin's caching headers."""
    return fetch(url, policy, **options).body


@dataclass(frozen=True)
class Fetched:
    body: bytes
    cache_control: str  # the answering response's Cache-Control header ("" without one)


def fetch(
    url: str,
    policy: MediaPolicy,
    *,
    limit: int | None = None,
    headers: Mapping[str, str] | None = None,
    expect_image: bool = False,
    enough: Callable[[bytes], bool] | None = None,
) -> Fetched:
    """GET an http(s) resource through the SSRF guard, within `policy.deadline` in all.

    With `limit`, only its first `limit` bytes; with `expect_image`, a body whose first bytes are
    not an image's is refused (400) without reading further; with `enough`, reading stops as soon
    as it says the bytes so far suffice (a header that parses). The answer's Cache-Control comes
    with the body (`Fetched`)."""
    deadline = _Deadline(policy.deadline)
    request_headers = {"User-Agent": "mm-kv-router/1", "Accept": "image/*"}
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        request_headers["Range"] = f"bytes=0-{limit - 1}"
    request_headers.update(headers or {})
    current = url
    for _ in range(policy.max_redirects + 1):
        target = _parse_http_url(current)
        connection = _connect(target, policy, deadline)
        response: http.client.HTTPResponse | None = None
        try:
            sock = connection.sock  # the response takes it over from the connection (and may drop it)
            assert sock is not None
            sock.settimeout(deadline.wait(policy.read_timeout, target.host))
            connection.request("GET", target.request_path, headers=request_headers)
            response = connection.getresponse()
            if response.status in _REDIRECT_STATUSES:
                location = response.getheader("Location")
                if not location:
                    raise MediaError(502, "origin_error", f"image host {target.host} redirected nowhere")
                current = urljoin(current, location.strip())
                continue
            if response.status not in (200, 206):
                raise MediaError(502, "origin_error", f"image host {target.host} answered {response.status}")
            body = _read_body(response, target, policy, limit, deadline, sock, expect_image, enough)
            return Fetched(body, response.getheader("Cache-Control") or "")
        except TimeoutError:
            if deadline.left() <= 0:
                raise deadline.expired(target.host) from None
            raise MediaError(504, "origin_timeout", f"image host {target.host} timed out") from None
        except (http.client.HTTPException, OSError) as exc:
            raise MediaError(
                502, "origin_error", f"image host {target.host} failed: {type(exc).__name__}"
            ) from None
        finally:
            # The response owns the socket once http.client sees a closing response: close both,
            # or an unread body keeps arriving until the error (and its frames) is collected.
            if response is not None:
                response.close()
            connection.close()
    raise MediaError(
        502, "too_many_redirects", f"image URL redirected more than {policy.max_redirects} times"
    )


# --- data URLs -----------------------------------------------------------------------------------
def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def decode_data_url(url: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    """The bytes of a base64 `data:image/...` URL; anything else is refused."""
    if not is_data_url(url):
        raise MediaError(400, "invalid_data_url", "not a data URL")
    header, comma, payload = url[5:].partition(",")
    params = [part.strip().lower() for part in header.split(";")]
    if not comma or not params[0].startswith("image/"):
        raise MediaError(
            400, "invalid_data_url", "data URL is not an image (expected data:image/...;base64,)"
        )
    if "base64" not in params[1:]:
        raise MediaError(400, "invalid_data_url", "data URL is not base64-encoded")
    if len(payload) // 4 * 3 > max_bytes + 3:
        raise _data_url_too_large(max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # Tolerate what senders commonly add (line breaks, percent-encoding); still refuse junk.
        cleaned = unquote_to_bytes("".join(payload.split())) if "%" in payload else "".join(payload.split())
        try:
            data = base64.b64decode(cleaned, validate=True)
        except (binascii.Error, ValueError):
            raise MediaError(400, "invalid_data_url", "data URL holds invalid base64") from None
    if not data:
        raise MediaError(400, "invalid_data_url", "data URL is empty")
    if len(data) > max_bytes:
        raise _data_url_too_large(max_bytes)
    return data


def _data_url_too_large(max_bytes: int) -> MediaError:
    return MediaError(413, "image_too_large", f"data URL image is over the {max_bytes}-byte limit")


# --- sizes and decoding --------------------------------------------------------------------------
def _open_image(data: bytes) -> Image.Image:
    """Pillow's lazy open: parses the header, decodes no pixels."""
    try:
        return Image.open(BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise MediaError(422, "decompression_bomb", "image header declares too many pixels") from None


def _check_pixels(width: int, height: int, max_pixels: int | None) -> None:
    if width < 1 or height < 1:
        raise MediaError(400, "image_undecodable", f"image has an empty size {width}x{height}")
    if max_pixels is not None and width * height > max_pixels:
        raise MediaError(
            422,
            "decompression_bomb",
            f"image is {width}x{height} = {width * height} pixels, over the {max_pixels}-pixel limit",
        )


def read_image_size(data: bytes, *, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) from the image header alone; 400 if undecodable, 422 over `max_pixels`."""
    try:
        with _open_image(data) as image:
            width, height = image.size
    except _DECODE_ERRORS:
        raise MediaError(400, "image_undecodable", "image bytes are not a supported image") from None
    _check_pixels(width, height, max_pixels)
    return width, height


def probe_image_size(url: str, policy: MediaPolicy) -> tuple[int, int]:
    """An image's size read from as few of its bytes as its header needs.

    A ranged read of the first HEADER_READ_BYTES comes first; if the header runs past it (a JPEG's
    size can follow a large EXIF block), one more read from the start stops as soon as the header
    parses. The body is never fetched twice, and both reads share the image's one deadline.
    """
    return _probe(url, policy)[0]


def _probe(url: str, policy: MediaPolicy) -> tuple[tuple[int, int], str]:
    """`probe_image_size`, with the origin's Cache-Control for the size it read."""
    if is_data_url(url):
        data = decode_data_url(url, max_bytes=policy.max_bytes)
        return read_image_size(data, max_pixels=policy.max_pixels), ""
    started = time.monotonic()
    limit = min(HEADER_READ_BYTES, policy.max_bytes)
    prefix = fetch(url, policy, limit=limit, expect_image=True)
    try:
        return read_image_size(prefix.body, max_pixels=policy.max_pixels), prefix.cache_control
    except MediaError as error:
        if error.status != 400 or len(prefix.body) < limit:  # refused, or the whole file was seen
            raise
    left = policy.deadline - (time.monotonic() - started)
    if left <= 0:
        raise MediaError(
            504, "origin_timeout", f"image size not read within the {policy.deadline:g} s deadline"
        )
    whole = fetch(url, dataclasses.replace(policy, deadline=left), expect_image=True, enough=_size_is_known)
    return read_image_size(whole.body, max_pixels=policy.max_pixels), whole.cache_control


def _size_is_known(prefix: bytes) -> bool:
    """Whether these first bytes settle the image's size (or its refusal)."""
    try:
        read_image_size(prefix)
    except MediaError as error:
        return error.status != 400
    return True


def decode_image(data: bytes, policy: MediaPolicy) -> Image.Image:
    """Fully decoded image, its pixel count checked from the header before any pixel is decoded."""
    try:
        image = _open_image(data)
        _check_pixels(*image.size, policy.max_pixels)
        image.load()
    except _DECODE_ERRORS:
        raise MediaError(400, "image_undecodable", "image bytes could not be decoded") from None
    return image


# --- a request's images --------------------------------------------------------------------------
def freshness(cache_control: str, longest_s: float) -> float:
    """How long a size read from an answer with this Cache-Control may be used: `longest_s`, less
    where the origin gives a shorter `s-maxage` or `max-age`; 0 for an answer it marks `no-store`,
    `no-cache` or `private` (the picture may be another one at the next look, or another user's)."""
    directives: dict[str, str] = {}
    for part in cache_control.lower().split(","):
        name, _, value = part.strip().partition("=")
        if name:
            directives.setdefault(name, value.strip().strip('"'))
    if {"no-store", "no-cache", "private"} & directives.keys():
        return 0.0
    for name in ("s-maxage", "max-age"):  # the one for shared caches first, as a CDN reads them
        if name in directives:
            value = directives[name]
            return min(longest_s, float(value)) if value.isdigit() else 0.0
    return longest_s


# `manage.py flush_caches` sets this to a new token when it flushes images; each frontend's
# ImageSizes forgets what it kept when it sees the token move (`ImageSizes.follow_flushes`).
SIZES_FLUSHED_KEY = "media:sizes-flushed"


class ImageSizes:
    """The sizes of images read by URL, kept while they are fresh, so that a repeat question about
    a picture is routed without a round trip to its origin first (every request made one, cache
    hits included, before the router could look).

    Entries are per scope (the caller's cache partition and, with session-scoped image caches, the
    session): a size read for one scope never saves another its round trip, so the time an answer
    takes does not tell a caller what others asked about. An entry lives `ttl_s` at most, less
    where the origin's Cache-Control says so (see `freshness`). A size that goes stale within it
    is caught where it matters: a worker loads the picture for any part of it its KV cache lacks,
    refuses one whose size is not the routed one (`IMAGE_CHANGED`), and the frontend then forgets
    that request's sizes. An operator's `flush_caches` of images empties it too, at the frontend's
    next request a second or more after the last look (`follow_flushes`). Thread-safe; the least
    recently used entry goes past `max_entries`.
    """

    _UNSEEN = object()

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = 4096,
        clock: Callable[[], float] | None = None,
        *,
        flush_token: Callable[[], object] | None = None,
        flush_check_s: float = 1.0,
    ) -> None:
        self.ttl_s = ttl_s
        self._entries: ExpiringLru[tuple[int, int]] = ExpiringLru(max_entries, clock)
        self._clock = clock or (lambda: time.monotonic())
        self._flush_lock = threading.Lock()
        self._flush_token = flush_token
        self._flush_check_s = flush_check_s
        self._next_flush_check = -float("inf")
        self._seen_token: object = self._UNSEEN

    def follow_flushes(self) -> None:
        """Forget every size if images were flushed since the last look (`flush_token`, read at
        most once per `flush_check_s`; a read that fails gives None, and costs at most one
        needless round trip per picture)."""
        if self._flush_token is None:
            return
        now = self._clock()
        with self._flush_lock:
            if now < self._next_flush_check:
                return
            self._next_flush_check = now + self._flush_check_s
        token = self._flush_token()
        with self._flush_lock:
            if self._seen_token is not self._UNSEEN and token != self._seen_token:
                self._entries.clear()
            self._seen_token = token

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, scope: Hashable, identity: str) -> tuple[int, int] | None:
        return self._entries.get((scope, identity))

    def put(self, scope: Hashable, identity: str, size: tuple[int, int], cache_control: str = "") -> None:
        self._entries.put((scope, identity), size, freshness(cache_control, self.ttl_s))

    def forget(self, scope: Hashable, identities: Sequence[str]) -> None:
        for identity in identities:
            self._entries.pop((scope, identity))


class KeptPicture(NamedTuple):
    """A data URL's picture as a frontend decoded it: its bytes, its size and, once a request with
    frontend decoding has read its pixels, their identity (`pixel_identity`)."""

    data: bytes
    width: int
    height: int
    pixels: str | None = None


class DecodedDataUrls:
    """The pictures of the data URLs a frontend decoded lately, so that a picture sent again is not
    decoded again. A chat client sends a conversation's pictures with every turn, and
    base64-decoding them (~300 MB/s here: ~2 ms for a 448x448 PNG, ~15 ms for a phone photo) was
    the largest single cost of such a request in the frontend; with frontend decoding, reading
    their pixels costs more again.

    An entry is the data URL's own picture, keyed by its identity (the hash of its whole text), so
    it cannot go stale and needs no expiry or flush. Entries are per scope, as `ImageSizes`' are: a
    picture one caller sent never saves another the decoding, so the time an answer takes does not
    tell a caller what others sent. At most `max_bytes` of pictures are kept, the least recently
    used going first; a picture over a quarter of that is not kept. Thread-safe.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be >= 1")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[Hashable, str], KeptPicture] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held_bytes(self) -> int:
        return self._held

    def get(self, scope: Hashable, identity: str) -> KeptPicture | None:
        """The picture of the data URL whose identity this is, if it is kept."""
        with self._lock:
            kept = self._entries.get((scope, identity))
            if kept is not None:
                self._entries.move_to_end((scope, identity))
            return kept

    def put(self, scope: Hashable, identity: str, picture: KeptPicture) -> None:
        if len(picture.data) * 4 > self.max_bytes:
            return
        with self._lock:
            earlier = self._entries.pop((scope, identity), None)
            if earlier is not None:
                self._held -= len(earlier.data)
            self._entries[(scope, identity)] = picture
            self._held += len(picture.data)
            while self._held > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._held -= len(dropped.data)


def _within_limits(kept: KeptPicture, policy: MediaPolicy) -> KeptPicture:
    """A kept picture, refused as its decoding would be if the limits were lowered since."""
    if len(kept.data) > policy.max_bytes:
        raise _data_url_too_large(policy.max_bytes)
    _check_pixels(kept.width, kept.height, policy.max_pixels)
    return kept


_DEFAULT_EXECUTOR = ThreadPoolExecutor(max_workers=16, thread_name_prefix="media")  # threads start on use


def _check_scheme(url: str) -> None:
    if not is_data_url(url):
        _parse_http_url(url)


def _identify_by_url(
    index: int,
    url: str,
    policy: MediaPolicy,
    sizes: ImageSizes | None = None,
    scope: Hashable = None,
    decoded: DecodedDataUrls | None = None,
) -> ResolvedImage:
    _check_scheme(url)
    identity = url_identity(url)
    if is_data_url(url):  # its bytes are at hand: they travel to the worker by reference, not as text
        kept = decoded.get(scope, identity) if decoded is not None else None
        if kept is not None:
            data, width, height, _ = _within_limits(kept, policy)
        else:
            data = decode_data_url(url, max_bytes=policy.max_bytes)
            width, height = read_image_size(data, max_pixels=policy.max_pixels)
            if decoded is not None:
                decoded.put(scope, identity, KeptPicture(data, width, height))
        return ResolvedImage(index, url, identity, routing_hash(identity), width, height, data)
    known = sizes.get(scope, identity) if sizes is not None else None
    if known is not None:
        width, height = known
        # The pixel limit may have been lowered since the size was read.
        _check_pixels(width, height, policy.max_pixels)
    else:
        (width, height), cache_control = _probe(url, policy)
        if sizes is not None:
            sizes.put(scope, identity, (width, height), cache_control)
    return ResolvedImage(index, url, identity, routing_hash(identity), width, height, None)


def _identify_by_pixels(
    index: int, url: str, policy: MediaPolicy, scope: Hashable = None, decoded: DecodedDataUrls | None = None
) -> ResolvedImage:
    if not is_data_url(url):  # what an origin answers may change: read it each time
        return _read_pixels(index, url, fetch_bytes(url, policy, expect_image=True), policy)
    if decoded is None:
        return _read_pixels(index, url, decode_data_url(url, max_bytes=policy.max_bytes), policy)
    own = url_identity(url)
    kept = decoded.get(scope, own)
    if kept is not None and kept.pixels is not None:
        data, width, height, identity = _within_limits(kept, policy)
        return ResolvedImage(index, url, identity, routing_hash(identity), width, height, data)
    data = (
        _within_limits(kept, policy).data
        if kept is not None  # read at first by URL, whose identity needs no pixels
        else decode_data_url(url, max_bytes=policy.max_bytes)
    )
    image = _read_pixels(index, url, data, policy)
    decoded.put(scope, own, KeptPicture(data, image.width, image.height, image.identity))
    return image


def _read_pixels(index: int, url: str, data: bytes, policy: MediaPolicy) -> ResolvedImage:
    with decode_image(data, policy) as image:
        identity = pixel_identity(image)
        width, height = image.size
    return ResolvedImage(index, url, identity, routing_hash(identity), width, height, data)


def _resolve_one(
    resolve: Callable[[int, str, MediaPolicy], ResolvedImage], index: int, url: str, policy: MediaPolicy
) -> ResolvedImage:
    try:
        return resolve(index, url, policy)
    except MediaError as error:
        raise error.for_image(index) from None


def resolve_images(
    urls: Sequence[str],
    policy: MediaPolicy,
    *,
    frontend_decoding: bool,
    executor: Executor | None = None,
    sizes: ImageSizes | None = None,
    scope: Hashable = None,
    decoded: DecodedDataUrls | None = None,
) -> list[ResolvedImage]:
    """Identity and size of each image, fetched/decoded concurrently; the first failing image
    (in request order) raises its MediaError with `image_index` set. With `sizes`, an image read
    by URL within its freshness (in the same `scope`) is not asked of its origin again; with
    `decoded`, a data URL decoded lately in the same scope is not decoded again (nor its pixels
    read again, with frontend decoding)."""
    # Frontend decoding reads every picture whole (its identity is its pixels): no size to keep.
    resolve = (
        partial(_identify_by_pixels, scope=scope, decoded=decoded)
        if frontend_decoding
        else partial(_identify_by_url, sizes=sizes, scope=scope, decoded=decoded)
    )
    if len(urls) <= 1:  # no thread hop for the common single-image request
        return [_resolve_one(resolve, index, url, policy) for index, url in enumerate(urls)]
    pool = executor or _DEFAULT_EXECUTOR
    futures: list[Future[ResolvedImage]] = [
        pool.submit(_resolve_one, resolve, index, url, policy) for index, url in enumerate(urls)
    ]
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()  # only those not started yet: the request already failed
