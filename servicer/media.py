"""Safe media fetching: image URLs (data:, http(s), file) -> decoded RGB images, or a MediaError;
video URLs -> their bytes (servicer/video.py decodes them).

Handler side (no MLX): the fetch and the decode run in a small thread pool, never on the event
loop or the engine thread. Every refusal names the item's index, what was wrong and the limit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import http.client
import io
import ipaddress
import os
import re
import socket
import ssl
import stat
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import grpc

if TYPE_CHECKING:
    from PIL import Image

POOL_SIZE = 4  # fetch+decode threads per worker: at most this many images in flight at once

Code = Literal["invalid", "limit"]
UA = "mlx-grpc-worker"
IP = ipaddress.IPv4Address | ipaddress.IPv6Address


class MediaError(Exception):
    """A refused image or video: code "invalid" (INVALID_ARGUMENT) or "limit"
    (RESOURCE_EXHAUSTED)."""

    def __init__(self, index: int, code: Code, message: str, noun: str = "image") -> None:
        super().__init__(f"{noun} {index}: {message}")
        self.index, self.code, self.message = index, code, message

    @property
    def status(self) -> grpc.StatusCode:
        return grpc_status(self.code)


def grpc_status(code: Code) -> grpc.StatusCode:
    return (
        grpc.StatusCode.RESOURCE_EXHAUSTED if code == "limit" else grpc.StatusCode.INVALID_ARGUMENT
    )


class _Refused(Exception):
    """Raised inside one image's fetch; fetch_images adds the index."""

    def __init__(self, code: Code, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class MediaPolicy:
    """What may be fetched. allowed_hosts: names, "*.suffix", "*" (any name) or IP/CIDR strings.

    A name is fetched only if listed; an address that is not global (loopback, private,
    link-local, multicast, reserved, unspecified) only if the exact name or a network holding
    the address is listed ("*" and "*.suffix" never open private addresses).
    """

    allowed_hosts: tuple[str, ...] = ()
    media_dir: Path | None = None
    max_bytes: int = 20 << 20  # 20 MiB
    max_pixels: int = 4096 * 4096
    max_images: int = 8
    # Videos (servicer/video.py): the file, the frames sampled from it, and its length.
    max_videos: int = 2
    max_video_bytes: int = 64 << 20  # 64 MiB
    max_video_frames: int = 64
    max_video_seconds: float = 600.0
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    # PIL decoders tried (a multi-picture JPEG opens through JPEG's)
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
    _names: frozenset[str] = field(init=False, repr=False, compare=False)
    _networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        hosts = tuple(h.strip().strip("[]").lower().rstrip(".") for h in self.allowed_hosts)
        hosts = tuple(h for h in hosts if h)
        names, networks = set(), []
        for host in hosts:
            try:
                networks.append(ipaddress.ip_network(host, strict=False))
            except ValueError:
                names.add(host)
        object.__setattr__(self, "allowed_hosts", hosts)
        object.__setattr__(self, "_names", frozenset(names))
        object.__setattr__(self, "_networks", tuple(networks))

    @property
    def schemes(self) -> frozenset[str]:
        return frozenset(
            {"data"}
            | ({"http", "https"} if self.allowed_hosts else set())
            | ({"file"} if self.media_dir is not None else set())
        )

    def host_allowed(self, host: str) -> bool:
        if host in self._names or "*" in self._names:
            return True
        if any(n.startswith("*.") and host.endswith(n[1:]) for n in self._names):
            return True
        try:  # an IP literal host: inside a listed network
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(ip in net for net in self._networks)

    def address_allowed(self, host: str, ip: IP) -> bool:
        ip = getattr(ip, "ipv4_mapped", None) or ip  # ::ffff:127.0.0.1 is 127.0.0.1
        special = ip.is_loopback or ip.is_link_local or ip.is_private or ip.is_multicast
        special = special or ip.is_reserved or ip.is_unspecified or not ip.is_global
        return not special or host in self._names or any(ip in net for net in self._networks)


@dataclass(frozen=True)
class DecodedImage:
    image: Image.Image  # RGB, the first frame of an animation
    sha256: str  # hex digest of the bytes as fetched: what the image is, for caches
    width: int
    height: int


async def fetch_images(
    urls: list[str],
    policy: MediaPolicy,
    *,
    executor: ThreadPoolExecutor | None = None,
    videos: frozenset[int] = frozenset(),
) -> list[DecodedImage | bytes]:
    """The images in order (the items at indices `videos`: the video file's bytes, up to
    `max_video_bytes`), or the MediaError of the first (lowest index) refused one."""
    images = len(urls) - len(videos)
    if images > policy.max_images:
        too_many = f"too many images: {images} in the request, limit {policy.max_images}"
        raise MediaError(policy.max_images, "limit", too_many)
    if len(videos) > policy.max_videos:
        too_many = f"too many videos: {len(videos)} in the request, limit {policy.max_videos}"
        raise MediaError(max(videos), "limit", too_many, "video")
    deadline = time.monotonic() + policy.fetch_timeout_s  # one deadline for the whole request
    loop = asyncio.get_running_loop()
    pool = executor  # None: the loop's default executor
    jobs = [
        loop.run_in_executor(pool, _fetch_one, i, u, policy, deadline, i in videos)
        for i, u in enumerate(urls)
    ]
    # Every job is bounded by the deadline, so waiting for all keeps the reported error stable.
    results = await asyncio.gather(*jobs, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return list(results)  # type: ignore[arg-type]


def _fetch_one(
    index: int, url: str, policy: MediaPolicy, deadline: float, video: bool = False
) -> DecodedImage | bytes:
    if video:  # a video's bytes, under its own limit
        policy = replace(policy, max_bytes=policy.max_video_bytes)
    try:
        scheme = url.partition(":")[0].lower() if ":" in url else ""
        if not scheme:
            raise _Refused("invalid", "not a URL")
        if scheme not in policy.schemes:
            allowed = ", ".join(sorted(policy.schemes))
            raise _Refused("invalid", f"scheme {scheme!r} not allowed (allowed: {allowed})")
        if scheme == "data":
            raw = _read_data(url, policy, video)
        elif scheme == "file":
            raw = _read_file(url, policy)
        else:
            raw = _read_http(url, policy, deadline, "video/*" if video else "image/*")
        return raw if video else _decode(raw, policy)
    except _Refused as refused:
        noun = "video" if video else "image"
        raise MediaError(index, refused.code, refused.message, noun) from None


def _too_many_bytes(size: int, policy: MediaPolicy, how: str = "") -> _Refused:
    return _Refused("limit", f"too many bytes: {size}{how}, limit {policy.max_bytes}")


def _read_data(url: str, policy: MediaPolicy, video: bool = False) -> bytes:
    header, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise _Refused("invalid", "malformed data URL (no comma)")
    params = [p.strip().lower() for p in header.split(";")]
    media_type = params[0] or "text/plain"  # RFC 2397's default
    if not video and not media_type.startswith("image/"):
        raise _Refused("invalid", f"media type {media_type!r} is not an image")
    if video and not media_type.startswith(("video/", "image/gif")):
        raise _Refused("invalid", f"media type {media_type!r} is not a video")
    if "base64" in params[1:]:
        payload = "".join(urllib.parse.unquote(payload).split())  # %-escapes, line breaks
        payload += "=" * (-len(payload) % 4)  # tolerate missing padding
        size = len(payload) * 3 // 4 - payload[-2:].count("=")
        if size > policy.max_bytes:  # refused before decoding anything
            raise _too_many_bytes(size, policy, " (base64 payload)")
        try:
            raw = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise _Refused("invalid", f"bad base64 in data URL ({e})") from None
    else:
        if len(payload) // 3 > policy.max_bytes:  # "%xx" is the densest a byte gets
            raise _too_many_bytes(len(payload) // 3, policy)
        raw = urllib.parse.unquote_to_bytes(payload)
    if len(raw) > policy.max_bytes:
        raise _too_many_bytes(len(raw), policy)
    return raw


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    assert policy.media_dir is not None  # the scheme check saw to it
    parts = urllib.parse.urlsplit(url)
    name = urllib.parse.unquote(parts.path)
    if parts.netloc not in ("", "localhost"):
        raise _Refused("invalid", f"file URL names a host ({parts.netloc})")
    try:
        # The real path (symlinks and ".." resolved) must lie inside the real media_dir.
        real = Path(os.path.realpath(name))
        if not name.startswith("/") or not real.is_relative_to(policy.media_dir.resolve()):
            raise _Refused("invalid", f"{name} is outside the media directory")
        # O_NONBLOCK: a FIFO planted there cannot hang the open; only regular files are read.
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise _Refused("invalid", f"{name} is not a regular file")
            if info.st_size > policy.max_bytes:
                raise _too_many_bytes(info.st_size, policy)
            raw = f.read(policy.max_bytes + 1)
    except FileNotFoundError:
        raise _Refused("invalid", f"no such file: {name}") from None
    except (OSError, ValueError) as e:
        raise _Refused("invalid", f"cannot read {name}: {e}") from None
    if len(raw) > policy.max_bytes:  # it grew since fstat
        raise _too_many_bytes(len(raw), policy)
    return raw


def _resolve(host: str, port: int) -> list[tuple[int, tuple]]:
    """(family, sockaddr) of every address of host; a seam for tests."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [(family, sockaddr) for family, _, _, _, sockaddr in infos]


def _checked_addresses(host: str, port: int, policy: MediaPolicy) -> list[tuple[int, tuple]]:
    try:
        addresses = _resolve(host, port)
    except (OSError, UnicodeError) as e:
        raise _Refused("invalid", f"unreachable: cannot resolve {host} ({e})") from None
    for _, sockaddr in addresses:  # every one: the connection may land on any of them
        ip = ipaddress.ip_address(sockaddr[0].split("%")[0])
        if not policy.address_allowed(host, ip):
            raise _Refused("invalid", f"host {host} resolves to {ip}, a non-public address")
    if not addresses:
        raise _Refused("invalid", f"unreachable: {host} has no address")
    return addresses


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to an address already checked (no second DNS lookup), Host and SNI the name;
    the socket is shut at the deadline, so no slow peer outlives it."""

    def __init__(self, host: str, port: int, target: tuple[int, tuple], tls: bool, deadline: float):
        super().__init__(host, port, timeout=max(deadline - time.monotonic(), 0.001))
        self.default_port = 443 if tls else 80  # the Host header leaves the default port out
        self._target, self._tls, self._deadline = target, tls, deadline
        self._cutter: socket.socket | None = None
        self._timer: threading.Timer | None = None

    def connect(self) -> None:
        family, sockaddr = self._target
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(sockaddr)
            self._cutter = sock.dup()  # shutdown() on a dup ends reads on the TLS socket too
            self._timer = threading.Timer(self._deadline - time.monotonic(), self._cut)
            self._timer.daemon = True
            self._timer.start()
            if self._tls:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise
        self.sock = sock

    def _cut(self) -> None:
        if self._cutter is not None:
            with contextlib.suppress(OSError):
                self._cutter.shutdown(socket.SHUT_RDWR)

    def release(self) -> None:
        """Not close(): getresponse() closes the connection while its response still reads."""
        if self._timer is not None:
            self._timer.cancel()
        if self._cutter is not None:
            self._cutter.close()


def _read_http(url: str, policy: MediaPolicy, deadline: float, accept: str = "image/*") -> bytes:
    for _ in range(policy.max_redirects + 1):  # each hop passes every check again
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as e:
            raise _Refused("invalid", f"bad URL ({e})") from None
        host = (parts.hostname or "").rstrip(".")
        if parts.scheme not in ("http", "https") or parts.scheme not in policy.schemes:
            raise _Refused("invalid", f"scheme {parts.scheme!r} not allowed (in a redirect)")
        if not host or not policy.host_allowed(host):
            raise _Refused("invalid", f"host {host or '(none)'} not allowed")
        addresses = _checked_addresses(host, port, policy)
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        location, body = _get(
            host, port, path, addresses, parts.scheme == "https", policy, deadline, accept
        )
        if location is None:
            return body
        url = urllib.parse.urljoin(url, location)
    raise _Refused("invalid", f"too many redirects (limit {policy.max_redirects})")


def _get(
    host: str,
    port: int,
    path: str,
    addresses: list,
    tls: bool,
    policy: MediaPolicy,
    deadline: float,
    accept: str = "image/*",
) -> tuple[str | None, bytes]:
    """(redirect location, b"") or (None, body) from the first address that connects."""
    error: Exception = OSError("no address")
    for target in addresses:
        if time.monotonic() >= deadline:
            break
        conn = _PinnedConnection(host, port, target, tls, deadline)
        response: http.client.HTTPResponse | None = None
        try:
            conn.request(
                "GET",
                path,
                headers={"Accept": accept, "User-Agent": UA},
            )
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                return response.getheader("Location"), b""
            if not 200 <= response.status < 300:
                raise _Refused("invalid", f"HTTP {response.status} {response.reason}".strip())
            return None, _read_body(response, policy, deadline)
        except (OSError, ValueError, http.client.HTTPException) as e:  # ValueError: IDNA
            error = e
        finally:  # the response holds the socket open past conn.close()
            if response is not None:
                response.close()
            conn.close()
            conn.release()
    if time.monotonic() >= deadline:
        raise _Refused("invalid", f"unreachable: timed out after {policy.fetch_timeout_s} s")
    raise _Refused("invalid", f"unreachable: {host}:{port} ({error})")


def _read_body(response: http.client.HTTPResponse, policy: MediaPolicy, deadline: float) -> bytes:
    declared = response.getheader("Content-Length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise _too_many_bytes(int(declared), policy, " (Content-Length)")
    body = bytearray()
    while chunk := response.read1(64 * 1024):  # one recv at a time: the limit holds per chunk
        body += chunk
        if len(body) > policy.max_bytes:
            raise _too_many_bytes(len(body), policy, "+ (stopped reading)")
    if time.monotonic() >= deadline:  # the deadline's shutdown ends a body early, not cleanly
        raise _Refused("invalid", f"unreachable: timed out after {policy.fetch_timeout_s} s")
    return bytes(body)


def _decode(raw: bytes, policy: MediaPolicy) -> DecodedImage:
    from PIL import Image  # here: a text-only install has no Pillow (the `vision` extra brings it)

    digest = hashlib.sha256(raw).hexdigest()
    # PIL's own bomb bound holds too: past it Image.open warns (or raises), and catch_warnings()
    # is not thread-safe, so it is enforced here rather than by turning the warning into an error.
    limit = min(policy.max_pixels, Image.MAX_IMAGE_PIXELS or policy.max_pixels)
    try:
        with Image.open(io.BytesIO(raw), formats=policy.formats) as opened:
            width, height = opened.size  # from the header: nothing decoded yet
            if width * height > limit:
                pixels = f"{width}x{height} = {width * height}"
                raise _Refused("limit", f"too many pixels: {pixels}, limit {limit}")
            opened.seek(0)  # an animation's first frame
            image = opened.convert("RGB")
    except _Refused:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        size = re.search(r"\((\d+) pixels\)", str(e))  # PIL names the image's own size
        pixels = size.group(1) if size else f"over {limit}"
        raise _Refused("limit", f"too many pixels: {pixels}, limit {limit}") from None
    except Exception as e:  # any decoder failure is the image's fault, not ours
        raise _Refused("invalid", f"undecodable image ({type(e).__name__}: {e})") from None
    return DecodedImage(image, digest, width, height)
