"""Safe media fetching (servicer/media.py): the good paths, and one test per row of the
bad-input table. Real parts: a real HTTP server on 127.0.0.1, real files, real PIL decoding.
Nothing here contacts any address but 127.0.0.1: the other names go through a fake resolver."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import re
import socket
import struct
import threading
import time
import urllib.parse
import warnings
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from PIL import Image

from servicer import media
from servicer.media import MediaError, MediaPolicy, fetch_images


def png(color: tuple[int, int, int], size: tuple[int, int] = (8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def bomb_png(width: int = 20000, height: int = 20000) -> bytes:
    """A small PNG whose header claims width x height pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data)
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 1000)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


RED, BLUE, GREEN = png((255, 0, 0)), png((0, 0, 255)), png((0, 255, 0))


def data_url(raw: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(raw).decode()}"


def run(urls: list[str], policy: MediaPolicy) -> list[media.DecodedImage]:
    return asyncio.run(fetch_images(urls, policy))


def refused(urls: list[str], policy: MediaPolicy) -> MediaError:
    with pytest.raises(MediaError) as caught:
        run(urls, policy)
    return caught.value


def color(decoded: media.DecodedImage) -> tuple[int, int, int]:
    return decoded.image.getpixel((0, 0))


class Handler(BaseHTTPRequestHandler):
    hosts: list[str] = []  # the Host headers seen, in order
    # The paths (stall, trickle) whose answer is about to be whole, noted before its last
    # bytes go: a client that has the whole answer finds its path here.
    answered: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def send_bytes(self, body: bytes, status: int = 200) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        Handler.hosts.append(self.headers["Host"])
        path, _, query = self.path.partition("?")
        # The client stopping to read is the point of several endpoints.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            getattr(self, "get_" + path.strip("/").replace("-", "_"), self.get_missing)(query)

    def get_red(self, _: str) -> None:
        self.send_bytes(RED)

    def get_blue(self, _: str) -> None:
        self.send_bytes(BLUE)

    def get_bomb(self, _: str) -> None:
        self.send_bytes(bomb_png())

    def get_missing(self, _: str) -> None:
        self.send_error(404)

    def get_redirect(self, query: str) -> None:
        self.send_response(302)
        self.send_header("Location", urllib.parse.unquote(query))
        self.send_header("Content-Length", "0")
        self.end_headers()

    def get_loop(self, _: str) -> None:
        self.get_redirect("/loop")

    def get_stall(self, query: str) -> None:
        time.sleep(float(query or 3))  # nothing at all until then
        Handler.answered.append(self.path)
        self.send_bytes(RED)

    def get_trickle(self, _: str) -> None:
        # Headers at once, then a byte every 0.1 s: each read is quick, the whole is not.
        self.send_response(200)
        self.send_header("Content-Length", str(len(RED)))
        self.end_headers()
        for i, byte in enumerate(RED):
            if i == len(RED) - 1:
                Handler.answered.append(self.path)
            self.wfile.write(bytes([byte]))
            self.wfile.flush()
            time.sleep(0.1)

    def get_huge(self, _: str) -> None:
        # No Content-Length and no end (up to 4 GiB): only a reader that stops gets out.
        self.send_response(200)
        self.end_headers()
        block = b"\0" * (1 << 20)
        for _ in range(4096):
            self.wfile.write(block)

    def get_huge_declared(self, _: str) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(10**9))
        self.end_headers()


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def port(server: str) -> int:
    return int(server.rsplit(":", 1)[1])


LOCAL = MediaPolicy(allowed_hosts=("127.0.0.1",))


@pytest.fixture
def fake_dns(monkeypatch):
    """img.test and other.test -> 127.0.0.1, two.test -> 127.0.0.1 and 10.0.0.1; any other
    lookup beyond localhost fails the test (so no second lookup of a checked name, no network)."""
    table = {
        "img.test": ["127.0.0.1"],
        "other.test": ["127.0.0.1"],
        "two.test": ["127.0.0.1", "10.0.0.1"],
    }
    real = socket.getaddrinfo

    def guard(host, *args, **kwargs):
        assert host in ("127.0.0.1", "localhost"), f"unexpected DNS lookup of {host}"
        return real(host, *args, **kwargs)

    def resolve(host: str, port: int):
        if host in table:
            return [(socket.AF_INET, (ip, port)) for ip in table[host]]
        return [(family, sockaddr) for family, _, _, _, sockaddr in guard(host, port)]

    monkeypatch.setattr(media, "_resolve", resolve)
    monkeypatch.setattr(socket, "getaddrinfo", guard)


# The good paths


def test_good_data_png():
    [image] = run([data_url(RED)], MediaPolicy())
    assert (image.width, image.height, image.image.mode) == (8, 6, "RGB")
    assert color(image) == (255, 0, 0)


def test_good_percent_encoded_data_url():
    url = "data:image/png," + urllib.parse.quote_from_bytes(BLUE)
    assert color(run([url], MediaPolicy())[0]) == (0, 0, 255)


def test_good_http_png(server):
    [image] = run([f"{server}/red"], LOCAL)
    assert color(image) == (255, 0, 0)


def test_good_file_png(tmp_path):
    (tmp_path / "green.png").write_bytes(GREEN)
    [image] = run([(tmp_path / "green.png").as_uri()], MediaPolicy(media_dir=tmp_path))
    assert color(image) == (0, 255, 0)


def test_order_preserved_across_schemes(server, tmp_path):
    (tmp_path / "green.png").write_bytes(GREEN)
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), media_dir=tmp_path)
    urls = [f"{server}/stall?0.3", data_url(BLUE), (tmp_path / "green.png").as_uri(), data_url(RED)]
    images = run(urls, policy)  # the slow first one finishes last, yet stays first
    assert [color(i) for i in images] == [(255, 0, 0), (0, 0, 255), (0, 255, 0), (255, 0, 0)]


def test_content_hash_is_sha256_of_the_bytes():
    red, blue, red_again = run([data_url(RED), data_url(BLUE), data_url(RED)], MediaPolicy())
    assert red.sha256 == hashlib.sha256(RED).hexdigest() == red_again.sha256
    assert blue.sha256 == hashlib.sha256(BLUE).hexdigest() != red.sha256


def test_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (4, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50)
    assert color(run([data_url(out.getvalue(), "image/gif")], MediaPolicy())[0]) == (255, 0, 0)


def test_redirect_followed_on_an_allowed_host(server):
    assert color(run([f"{server}/redirect?/blue"], LOCAL)[0]) == (0, 0, 255)


def test_connects_to_the_checked_address_with_the_name_as_host(port, fake_dns):
    # img.test exists only in the fake resolver: a second lookup (as http.client's own connect
    # would make) fails the test; the server sees the name in Host.
    policy = MediaPolicy(allowed_hosts=("*.test", "127.0.0.0/8"))
    Handler.hosts.clear()
    assert color(run([f"http://img.test:{port}/red"], policy)[0]) == (255, 0, 0)
    assert Handler.hosts == [f"img.test:{port}"]


def test_fetching_runs_off_the_event_loop(server, monkeypatch):
    threads = []
    decode = media._decode
    monkeypatch.setattr(
        media, "_decode", lambda *a: threads.append(threading.current_thread()) or decode(*a)
    )

    async def main() -> int:
        ticks = 0
        fetch = asyncio.ensure_future(fetch_images([f"{server}/stall?1"], LOCAL))
        while not fetch.done():
            await asyncio.sleep(0.05)
            ticks += 1
        await fetch
        return ticks

    assert asyncio.run(main()) >= 5  # the loop kept ticking (~20 times) through a 1 s fetch
    assert threads and threads[0] is not threading.main_thread()


def test_grpc_status():
    assert MediaError(0, "invalid", "x").status == grpc.StatusCode.INVALID_ARGUMENT
    assert MediaError(0, "limit", "x").status == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(MediaError(2, "invalid", "bad")) == "image 2: bad"


def test_schemes_follow_the_policy(tmp_path):
    assert MediaPolicy().schemes == {"data"}
    assert MediaPolicy(allowed_hosts=["a.b"]).schemes == {"data", "http", "https"}
    assert MediaPolicy(media_dir=tmp_path).schemes == {"data", "file"}


# The bad-input table: one test per row


def expect(error: MediaError, index: int, code: str, *words: str) -> None:
    assert (error.index, error.code) == (index, code), str(error)
    assert str(error).startswith(f"image {index}: ")
    for word in words:
        assert word in str(error), str(error)


def test_bad_url():
    expect(refused([data_url(RED), "no scheme here"], MediaPolicy()), 1, "invalid", "not a URL")


def test_bad_base64():
    expect(refused(["data:image/png;base64,iVBO!!!*"], MediaPolicy()), 0, "invalid", "base64")


def test_non_image_media_type():
    url = "data:text/plain;base64," + base64.b64encode(b"hello").decode()
    expect(refused([url], MediaPolicy()), 0, "invalid", "text/plain", "not an image")
    expect(refused(["data:,hello"], MediaPolicy()), 0, "invalid", "not an image")


def test_undecodable_bytes():
    url = data_url(b"this is not a picture at all")
    expect(refused([data_url(RED), url], MediaPolicy()), 1, "invalid", "undecodable")


def test_truncated_png_is_undecodable():
    expect(refused([data_url(RED[:-30])], MediaPolicy()), 0, "invalid", "undecodable")


def test_too_many_bytes_data_refused_before_decoding(monkeypatch):
    def never(*_):
        raise AssertionError("decoded a payload already known to be too big")

    monkeypatch.setattr(media.base64, "b64decode", never)
    error = refused([data_url(b"\0" * 4000)], MediaPolicy(max_bytes=3000))
    expect(error, 0, "limit", "too many bytes", "4000", "limit 3000")


def test_too_many_bytes_percent_encoded_data():
    url = "data:image/png," + "%00" * 4000
    expect(refused([url], MediaPolicy(max_bytes=3000)), 0, "limit", "limit 3000")


def test_too_many_bytes_http_streamed(server):
    # /huge sends without end and without Content-Length: only stopping at the limit returns,
    # and the reader stops within one read (64 KiB) past it, not at the fetch's deadline.
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), max_bytes=100_000)
    error = refused([f"{server}/huge"], policy)
    expect(error, 0, "limit", "too many bytes", "(stopped reading)", "limit 100000")
    read = int(re.search(r"too many bytes: (\d+)\+", str(error)).group(1))  # type: ignore[union-attr]
    assert 100_000 < read <= 100_000 + 64 * 1024, str(error)


def test_too_many_bytes_http_declared(server):
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), max_bytes=100_000)
    error = refused([f"{server}/huge-declared"], policy)
    expect(error, 0, "limit", "1000000000", "Content-Length", "limit 100000")


def test_too_many_bytes_file(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    policy = MediaPolicy(media_dir=tmp_path, max_bytes=len(RED) - 1)
    expect(refused([(tmp_path / "red.png").as_uri()], policy), 0, "limit", "too many bytes")


def test_too_many_pixels_from_the_header():
    # Small files claiming many pixels: refused from the header, nothing decoded.
    bomb = bomb_png(5000, 5000)
    assert len(bomb) < 200
    error = refused([data_url(RED), data_url(bomb)], MediaPolicy())
    expect(error, 1, "limit", "5000x5000", f"limit {4096 * 4096}")
    # 20000x20000 is past PIL's own hard bound, whose error fires inside Image.open: a limit too.
    error = refused([data_url(bomb_png(20000, 20000))], MediaPolicy())
    expect(error, 0, "limit", "too many pixels", "400000000", f"limit {4096 * 4096}")


def test_too_many_pixels_over_http(server):
    expect(refused([f"{server}/bomb"], LOCAL), 0, "limit", "too many pixels")


def test_max_pixels_is_configurable():
    expect(refused([data_url(RED)], MediaPolicy(max_pixels=47)), 0, "limit", "8x6", "limit 47")
    assert run([data_url(RED)], MediaPolicy(max_pixels=48))


@pytest.mark.parametrize("action", ["ignore", "error"])
def test_pil_bomb_bound_holds_above_max_pixels(action):
    # 12000x12000 is past PIL's warning bound (MAX_IMAGE_PIXELS), not its error bound: a limit
    # even with max_pixels set higher, whatever the process does with the warning.
    big = bomb_png(12000, 12000)
    with warnings.catch_warnings():
        warnings.simplefilter(action, Image.DecompressionBombWarning)
        error = refused([data_url(big)], MediaPolicy(max_pixels=10**10))
    expect(error, 0, "limit", "pixels", f"limit {Image.MAX_IMAGE_PIXELS}")


def test_too_many_images():
    error = refused([data_url(RED)] * 9, MediaPolicy())
    expect(error, 8, "limit", "too many images", "9", "limit 8")
    assert len(run([data_url(RED)] * 8, MediaPolicy())) == 8


def test_http_not_allowed_without_allowed_hosts(server):
    error = refused([f"{server}/red"], MediaPolicy())
    expect(error, 0, "invalid", "scheme 'http' not allowed", "allowed: data")


def test_file_not_allowed_without_media_dir(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    error = refused([(tmp_path / "red.png").as_uri()], MediaPolicy())
    expect(error, 0, "invalid", "scheme 'file' not allowed")


def test_ftp_not_allowed(tmp_path):
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), media_dir=tmp_path)
    expect(refused(["ftp://127.0.0.1/red.png"], policy), 0, "invalid", "scheme 'ftp'")


def test_host_not_allowed(port):
    policy = MediaPolicy(allowed_hosts=("images.example",))
    error = refused([f"http://127.0.0.1:{port}/red"], policy)
    expect(error, 0, "invalid", "host 127.0.0.1 not allowed")


def test_loopback_refused_unless_listed(port, fake_dns):
    # img.test is allowed by name ("*.test") but resolves to 127.0.0.1, which is not listed.
    policy = MediaPolicy(allowed_hosts=("*.test",))
    error = refused([f"http://img.test:{port}/red"], policy)
    expect(error, 0, "invalid", "img.test resolves to 127.0.0.1")
    # "*" allows any name, yet never a non-public address.
    error = refused([f"http://127.0.0.1:{port}/red"], MediaPolicy(allowed_hosts=("*",)))
    expect(error, 0, "invalid", "resolves to 127.0.0.1")


def test_every_resolved_address_is_checked(port, fake_dns):
    # two.test -> 127.0.0.1 (listed) and 10.0.0.1 (not): refused, though the first would do.
    policy = MediaPolicy(allowed_hosts=("*.test", "127.0.0.0/8"))
    expect(refused([f"http://two.test:{port}/red"], policy), 0, "invalid", "10.0.0.1")


def test_exact_listed_name_opens_its_private_address(port, fake_dns):
    policy = MediaPolicy(allowed_hosts=("img.test",))
    assert color(run([f"http://img.test:{port}/red"], policy)[0]) == (255, 0, 0)


def test_redirect_to_unlisted_host_refused(server, port):
    to = f"http://localhost:{port}/red"
    error = refused([f"{server}/redirect?{to}"], LOCAL)
    expect(error, 0, "invalid", "host localhost not allowed")


def test_redirect_to_private_address_refused(port, fake_dns):
    # img.test is listed by its exact name, so its loopback address is open; other.test is
    # allowed by name ("*.test") but its loopback address is not. A redirect from img.test to
    # other.test is checked again and refused; one back to img.test is followed.
    policy = MediaPolicy(allowed_hosts=("img.test", "*.test"))
    start = f"http://img.test:{port}/redirect?"
    assert color(run([start + "/red"], policy)[0]) == (255, 0, 0)
    error = refused([start + f"http://other.test:{port}/red"], policy)
    expect(error, 0, "invalid", "other.test resolves to 127.0.0.1")


def test_redirect_to_another_scheme_refused(server):
    error = refused([f"{server}/redirect?{data_url(RED)}"], LOCAL)
    expect(error, 0, "invalid", "scheme 'data' not allowed")


def test_too_many_redirects(server):
    expect(refused([f"{server}/loop"], LOCAL), 0, "invalid", "too many redirects", "limit 3")


def test_unreachable_closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    expect(refused([f"http://127.0.0.1:{closed}/red"], LOCAL), 0, "invalid", "unreachable")


@pytest.mark.parametrize("path", ["stall?3", "trickle"])
def test_timeout(server, path):
    # stall: no answer at all; trickle: every read is quick, the whole fetch is not.
    # The refusal comes at the deadline, while the server is still stalling (it answers at
    # 3 s) or trickling (it ends at ~7 s): not once its answer is whole.
    policy = MediaPolicy(allowed_hosts=("127.0.0.1",), fetch_timeout_s=0.5)
    expect(refused([f"{server}/{path}"], policy), 0, "invalid", "timed out after 0.5 s")
    assert f"/{path}" not in Handler.answered, Handler.answered


def test_http_404(server):
    expect(refused([f"{server}/nothing-here"], LOCAL), 0, "invalid", "HTTP 404")


def test_file_outside_media_dir_by_dotdot(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (tmp_path / "secret.png").write_bytes(RED)
    url = "file://" + str(inside) + "/../secret.png"
    policy = MediaPolicy(media_dir=inside)
    expect(refused([url], policy), 0, "invalid", "outside the media directory")


def test_file_outside_media_dir_by_symlink(tmp_path):
    inside = tmp_path / "media"
    inside.mkdir()
    (tmp_path / "secret.png").write_bytes(RED)
    (inside / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(media_dir=inside)
    expect(refused([(inside / "link.png").as_uri()], policy), 0, "invalid", "outside")


def test_file_symlink_inside_media_dir_is_fine(tmp_path):
    (tmp_path / "red.png").write_bytes(RED)
    (tmp_path / "alias.png").symlink_to(tmp_path / "red.png")
    assert run([(tmp_path / "alias.png").as_uri()], MediaPolicy(media_dir=tmp_path))


def test_file_missing(tmp_path):
    url = (tmp_path / "absent.png").as_uri()
    expect(refused([url], MediaPolicy(media_dir=tmp_path)), 0, "invalid", "no such file")


def test_file_not_regular(tmp_path):
    (tmp_path / "dir.png").mkdir()
    url = (tmp_path / "dir.png").as_uri()
    expect(refused([url], MediaPolicy(media_dir=tmp_path)), 0, "invalid", "dir.png")


def test_lowest_index_error_reported(server):
    urls = [data_url(RED), f"{server}/nothing-here", "data:text/plain,x"]
    expect(refused(urls, LOCAL), 1, "invalid", "HTTP 404")


def test_an_image_of_a_format_not_taken_says_it_cannot_be_identified():
    """A TIFF (a format not in the policy's list) is refused by what is wrong with it."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 4)).save(out, format="TIFF")
    with pytest.raises(media._Refused) as caught:
        media._decode(out.getvalue(), MediaPolicy())
    assert "cannot identify" in str(caught.value)
    assert "KeyError" not in str(caught.value)
