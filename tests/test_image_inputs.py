"""Images in (issue 58), the client's side: sources under a policy and chat image parts. Real images made with
Pillow, a real HTTP server on 127.0.0.1 and a Qwen-style chat template. The checkpoint's image processor is
tested in test_image_preparer.py."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import zlib

import jinja2
import numpy as np
import pytest
from PIL import Image
from transformers.image_utils import load_image as hf_load_image

from nanostream import InvalidRequestError
from nanostream.multimodal import (
    ImageError,
    ImagePolicy,
    check_count,
    load_image,
    load_images,
    split_image_parts,
)

SERVER = ImagePolicy()
RNG = np.random.default_rng(58)


def _rgb(w, h):
    return Image.fromarray(RNG.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _encode(image, fmt, **kwargs):
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def _refused(source, policy=SERVER, *words):
    with pytest.raises(ImageError) as info:
        load_image(source, policy)
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), str(info.value)
    return str(info.value)


# formats, modes and orientation


@pytest.mark.parametrize("fmt", ["PNG", "BMP", "TIFF", "WEBP"])
@pytest.mark.parametrize("size", [(1, 1), (64, 64), (300, 17), (17, 300)])
def test_lossless_formats_give_the_same_rgb_pixels(fmt, size):
    image = _rgb(*size)
    got = load_image(_encode(image, fmt, **({"lossless": True} if fmt == "WEBP" else {})), SERVER)
    assert got.mode == "RGB" and got.size == size
    assert np.array_equal(np.asarray(got), np.asarray(image))


def test_jpeg_bytearray_memoryview_and_pil_image():
    image = _rgb(80, 50)
    data = _encode(image, "JPEG", quality=95)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for source in (data, bytearray(data), memoryview(data), Image.open(io.BytesIO(data))):
        assert np.array_equal(np.asarray(load_image(source, SERVER)), want)


def test_transparency_is_laid_over_white():
    rgba = np.zeros((4, 6, 4), dtype=np.uint8)  # transparent black ...
    rgba[:2] = (10, 200, 30, 255)  # ... under an opaque green top half
    got = np.asarray(load_image(_encode(Image.fromarray(rgba, "RGBA"), "PNG"), SERVER))
    assert (got[:2] == (10, 200, 30)).all() and (got[2:] == 255).all()
    palette = Image.new("P", (5, 5), 0)
    palette.putpalette([0, 0, 0, 255, 0, 0])
    palette.paste(1, (0, 0, 5, 2))
    got = np.asarray(load_image(_encode(palette, "GIF", transparency=0), SERVER))  # index 0 transparent
    assert (got[:2] == (255, 0, 0)).all() and (got[2:] == 255).all()


def test_grey_sixteen_bit_and_cmyk_modes():
    grey = np.asarray(load_image(_encode(Image.new("L", (3, 2), 77), "PNG"), SERVER))
    assert grey.shape == (2, 3, 3) and (grey == 77).all()
    deep = Image.new("I;16", (4, 4))
    deep.putdata([40000] * 8 + [1000] * 8)
    got = np.asarray(load_image(_encode(deep, "PNG"), SERVER))
    assert (got[:2] == 40000 >> 8).all() and (got[2:] == 1000 >> 8).all()  # Pillow's convert() gives 255 here
    cmyk = np.asarray(load_image(_encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG"), SERVER))
    assert (np.abs(cmyk.astype(int) - (255, 0, 0)) <= 3).all()  # cyan-less, full magenta and yellow: red


def test_an_animation_gives_its_first_frame():
    frames = [Image.new("RGB", (6, 4), c) for c in ((255, 0, 0), (0, 0, 255))]
    for fmt in ("GIF", "WEBP", "PNG"):
        data = _encode(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, lossless=True)
        assert Image.open(io.BytesIO(data)).n_frames == 2
        assert (np.asarray(load_image(data, SERVER)) == (255, 0, 0)).all()


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_as_transformers_does(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = _encode(_rgb(40, 20), "JPEG", exif=exif, quality=95)
    got = load_image(data, SERVER)
    assert got.size == ((40, 20) if orientation == 3 else (20, 40))
    assert np.array_equal(np.asarray(got), np.asarray(hf_load_image(Image.open(io.BytesIO(data)))))


# unreadable data and bombs


def test_broken_data_is_refused_saying_so(tmp_path):
    png = _encode(_rgb(64, 64), "PNG")
    _refused(png[: len(png) // 2], SERVER, "the image", "truncated")
    _refused(RNG.bytes(4096), SERVER, "in no image format", "PNG, JPEG")
    _refused(b"", SERVER, "empty")
    (tmp_path / "notes.txt").write_text("not a picture\n" * 10)
    _refused(tmp_path / "notes.txt", ImagePolicy.trusted(), "in no image format")
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n"
    _refused(eps, SERVER, "in no image format")  # Pillow reads EPS by running Ghostscript: not a format taken here
    _refused(12, SERVER, "is a int")


def _png(width, height, idat):
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)  # 1-bit grey
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + (chunk(b"IDAT", idat) if idat else b"") + chunk(b"IEND", b"")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's own, at over 89 megapixels
def test_a_decompression_bomb_is_refused_from_its_header():
    rows = (b"\x00" + bytes(12000 // 8)) * 9000  # 13.5 MB of zero rows ...
    bomb = _png(12000, 9000, zlib.compress(rows, 9))  # ... in 13 kB: 108 megapixels
    assert len(bomb) < 30_000
    message = _refused(bomb, SERVER, "12000x9000 = 108 megapixels", "limit of 40", "smaller image")
    # no pixel data at all: were it decoded, the refusal would be a truncated file's
    assert _refused(_png(12000, 9000, b""), SERVER) == message
    _refused(_png(100_000, 100_000, b""), SERVER, "too large to decode")  # Pillow's own limit, at open
    _refused(_png(9000, 5000, b""), SERVER, "45 megapixels")  # under Pillow's limit, over the server's
    _refused(_rgb(300, 200), ImagePolicy(max_image_pixels=50_000), "300x200 = 0.06 megapixels")


def test_too_many_images_are_refused_before_any_is_read():
    check_count(16, SERVER)
    with pytest.raises(ImageError, match="holds 1000 images, over the server's limit of 16"):
        load_images([b"not read"] * 1000, SERVER)
    assert len(load_images([_encode(_rgb(8, 8), "PNG")] * 3, ImagePolicy(max_images=3))) == 3


def test_policy_values_are_checked():
    with pytest.raises(ValueError, match="max_images must be a positive int"):
        ImagePolicy(max_images=0)
    with pytest.raises(TypeError, match="set of host names, not one string"):
        ImagePolicy(allowed_domains="example.com")
    with pytest.raises(ValueError, match="host names such as 'example.com'"):
        ImagePolicy(allowed_domains=frozenset({"https://example.com"}))
    with pytest.raises(ValueError, match="is not a directory"):
        ImagePolicy(allowed_local_path="/no/such/dir")
    policy = ImagePolicy(allowed_domains=frozenset({"Example.COM.", "127.0.0.1"}))
    assert policy.allows_host("example.com") and policy.allows_host("cdn.img.example.com")
    assert not policy.allows_host("badexample.com") and not policy.allows_host("example.com.evil.net")
    assert policy.allows_host("127.0.0.1") and not policy.allows_host("1.127.0.0.1")


# data URLs, local files


def test_data_urls():
    png = _encode(_rgb(10, 7), "PNG")
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    assert load_image(url, SERVER).size == (10, 7)
    _refused(url[:-3] + "!==", SERVER, "malformed")
    _refused("data:image/png," + png.hex(), SERVER, "not base64")
    _refused("data:text/plain;base64,aGVsbG8=", SERVER, "data:image/<type>;base64")
    _refused(url, ImagePolicy(max_image_bytes=100), "over the server's limit")


def test_local_files_only_under_the_allowed_directory(tmp_path):
    media, outside = tmp_path / "media", tmp_path / "private"
    media.mkdir(), outside.mkdir()
    (media / "a.png").write_bytes(_encode(_rgb(9, 5), "PNG"))
    (outside / "b.png").write_bytes(_encode(_rgb(9, 5), "PNG"))
    (media / "link.png").symlink_to(outside / "b.png")
    (media / "dir-link").symlink_to(outside)
    policy = ImagePolicy(allowed_local_path=str(media))
    for source in (str(media / "a.png"), media / "a.png", (media / "a.png").as_uri(), f"{media}/../media/a.png"):
        assert load_image(source, policy).size == (9, 5)
    for escape in (outside / "b.png", f"{media}/../private/b.png", media / "link.png", media / "dir-link" / "b.png"):
        _refused(escape, policy, "outside --allowed-local-media-path")
    _refused((outside / "b.png").as_uri(), policy, "outside")
    _refused(media / "a.png", SERVER, "does not read", "--allowed-local-media-path DIR")
    _refused(media / "none.png", policy, "not a file")
    _refused("file://otherhost/a.png", policy, "file:///path")
    _refused(media / "a.png", ImagePolicy(allowed_local_path=str(media), max_image_bytes=50), "over the server's")
    assert load_image(outside / "b.png", ImagePolicy.trusted()).size == (9, 5)


class _Handler(http.server.BaseHTTPRequestHandler):
    png = _encode(_rgb(12, 8), "PNG")

    def do_GET(self):
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{self.server.server_port}/cat.png")
            self.end_headers()
            return
        big = self.png + bytes(4096)
        body = {"/cat.png": self.png, "/big.png": big, "/big-unsized.png": big}.get(self.path)
        self.send_response(200 if body else 404)
        if self.path != "/big-unsized.png":  # without a length, the body ends when the connection closes
            self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    thread.join()


def test_urls_are_fetched_only_from_allowed_domains(server):
    _refused(f"{server}/cat.png", SERVER, "not fetched", "--allowed-media-domains: none")
    _refused("https://example.com@127.0.0.1/cat.png", ImagePolicy(allowed_domains=frozenset({"example.com"})))
    policy = ImagePolicy(allowed_domains=frozenset({"127.0.0.1"}))
    assert np.array_equal(
        np.asarray(load_image(f"{server}/cat.png", policy)), np.asarray(Image.open(io.BytesIO(_Handler.png)))
    )
    _refused(f"{server}/missing.png", policy, "answered 404")
    _refused(f"{server}/redirect", policy, "'localhost' are not fetched")  # a redirect leaves the allow-list
    small = ImagePolicy(allowed_domains=policy.allowed_domains, max_image_bytes=2048)
    for big, size in [("big.png", len(_Handler.png) + 4096), ("big-unsized.png", 2049)]:  # Content-Length, or read
        _refused(f"{server}/{big}", small, f"is {size} bytes or more encoded, over the server's limit of 2048 bytes")
    _refused("ftp://127.0.0.1/cat.png", policy, "ftp: URLs are not read")


# the rule of Qwen's published chat templates for a content part, in a few lines of our own
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' or 'image' in p or 'image_url' in p %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in p %}{{ p.text }}{% endif %}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
)


def test_split_image_parts_leaves_placeholders_for_the_template():
    pil = _rgb(4, 4)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "text", "text": "Compare "},
            {"type": "image_url", "image_url": {"url": "https://a.example/1.png", "detail": "low"}},
            {"type": "image_url", "image_url": "data:image/png;base64,AAAA"},
            {"type": "input_text", "text": " and "},
            {"type": "input_image", "image_url": "https://a.example/2.png", "detail": "auto"},
            {"type": "image", "image": pil},
            {"type": "image", "path": "/tmp/x.png"},
        ]},
    ]  # fmt: skip
    before = repr(messages)
    template_messages, sources = split_image_parts(messages)
    assert repr(messages) == before and template_messages[0] is messages[0]
    assert sources == [
        "https://a.example/1.png",
        "data:image/png;base64,AAAA",
        "https://a.example/2.png",
        pil,
        "/tmp/x.png",
    ]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    rendered = jinja2.Template(TEMPLATE).render(messages=template_messages)
    assert (
        rendered
        == f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare {image * 2} and {image * 3}<|im_end|>\n"
    )
    for bad, words in [
        ({"type": "image_url", "image_url": {}}, '"image_url": {"url"'),
        ({"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
        ({"type": "image", "image": pil, "url": "https://a.example/1.png"}, 'has "image", "url"'),
    ]:
        with pytest.raises(ImageError, match="image 1: "):
            split_image_parts([{"role": "user", "content": [bad]}])
        with pytest.raises(ImageError, match=words.replace("(", r"\(")):
            split_image_parts([{"role": "user", "content": [bad]}])
