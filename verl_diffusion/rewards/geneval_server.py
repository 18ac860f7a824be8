"""A GenEval-protocol reward server (``_protocol.py``) with a pluggable scorer, on the standard library.

``serve(scorer, host, port)`` starts a threaded HTTP server; ``scripts/reward_server.py`` is its CLI.
A scorer is any callable ``scorer(images: list[PIL.Image], meta_datas: list[dict], only_strict: bool)``
returning ``(scores, rewards, strict_rewards, group_rewards, group_strict_rewards)``, the signature of the
deployed detector servers, so a real detector (mmdetection, as in GenEval) plugs in unchanged.

``ColorBlobScorer`` is a programmatic detector for tests and demos: objects are solid rectangles on a
white background; the rectangle's ``border``-pixel (6) frame colour names the class (``class_colors``) and its
interior colour names the attribute colour (GenEval's colour words). It then applies GenEval's checks.
"""

from __future__ import annotations

import io
import threading
import traceback
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from verl_diffusion.rewards._protocol import NOT_IN_GROUP, dumps, safe_loads

GENEVAL_TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")

# GenEval's colour words -> RGB used by ColorBlobScorer (and by tests to draw)
COLOR_RGB = {
    "red": (220, 20, 20), "orange": (255, 140, 0), "yellow": (240, 220, 0), "green": (20, 160, 40),
    "blue": (20, 60, 220), "purple": (130, 30, 170), "pink": (255, 120, 190), "brown": (120, 70, 20),
    "black": (10, 10, 10), "white": (235, 235, 235),
}

Scorer = Callable[[list, list, bool], tuple]


def group_values(values: list[float], metas: list[dict]) -> dict[str, list[float]]:
    """Per-tag lists with ``NOT_IN_GROUP`` (-10) for images of another tag, as the deployed servers reply."""
    tags = list(GENEVAL_TAGS) + sorted({m.get("tag", "") for m in metas} - set(GENEVAL_TAGS) - {""})
    return {t: [v if m.get("tag") == t else NOT_IN_GROUP for v, m in zip(values, metas)] for t in tags}


class ColorBlobScorer:
    """Programmatic GenEval scorer (see module docstring). ``class_colors``: class name -> border RGB."""

    def __init__(
        self, class_colors: Mapping[str, tuple[int, int, int]] | None = None, min_pixels: int = 16, border: int = 6
    ):
        self.class_colors = dict(class_colors or {})
        self.min_pixels = min_pixels
        self.border = border

    @staticmethod
    def _nearest(rgb: np.ndarray, palette: Mapping[str, tuple[int, int, int]]) -> str:
        names = list(palette)
        d = [float(np.sum((rgb.astype(np.float64) - np.array(palette[k])) ** 2)) for k in names]
        return names[int(np.argmin(d))]

    def detect(self, image: np.ndarray) -> list[dict]:
        """Objects: {class, color, box (x0, y0, x1, y1)} of each non-white rectangle (4-connected)."""
        mask = np.any(np.abs(image.astype(int) - 255) > 40, axis=-1)
        seen = np.zeros_like(mask)
        h, w = mask.shape
        objects = []
        for y0, x0 in zip(*np.nonzero(mask)):
            if seen[y0, x0]:
                continue
            stack, pix = [(y0, x0)], []
            seen[y0, x0] = True
            while stack:
                y, x = stack.pop()
                pix.append((y, x))
                for yy, xx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                    if 0 <= yy < h and 0 <= xx < w and mask[yy, xx] and not seen[yy, xx]:
                        seen[yy, xx] = True
                        stack.append((yy, xx))
            if len(pix) < self.min_pixels:
                continue
            ys, xs = np.array(pix).T
            box = (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max()))
            b = self.border // 2  # sample the middle of the border band (JPEG blurs its edges)
            border = image[box[1] + b, box[0] + b : box[2] - b + 1].reshape(-1, 3).mean(0)
            centre = image[(box[1] + box[3]) // 2, (box[0] + box[2]) // 2]
            objects.append({
                "class": self._nearest(border, self.class_colors) if self.class_colors else "object",
                "color": self._nearest(centre, COLOR_RGB),
                "box": box,
            })
        return objects

    @staticmethod
    def _relation_holds(rel: str, a: tuple, b: tuple) -> bool:
        ax, ay = (a[0] + a[2]) / 2, (a[1] + a[3]) / 2
        bx, by = (b[0] + b[2]) / 2, (b[1] + b[3]) / 2
        return {"left of": ax < bx, "right of": ax > bx, "above": ay < by, "below": ay > by}.get(rel, False)

    def evaluate(self, image: np.ndarray, meta: Mapping[str, Any]) -> tuple[float, bool, bool]:
        """(partial credit, accuracy, strict accuracy) of one image. Each include requirement contributes a
        count check plus a colour and a position check when given; each exclude requirement one check.
        Accuracy ignores the exclude checks; strict accuracy needs every check."""
        objs = self.detect(image)
        checks_inc, checks_exc = [], []
        for req in meta.get("include", []):
            found = [o for o in objs if o["class"] == req["class"]]
            checks_inc.append(len(found) >= req["count"])
            if req.get("color"):
                checks_inc.append(sum(o["color"] == req["color"] for o in found) >= req["count"])
            if req.get("position"):
                rel, idx = req["position"]
                ref_cls = meta["include"][idx]["class"]
                refs = [o for o in objs if o["class"] == ref_cls]
                checks_inc.append(bool(found and refs) and all(
                    self._relation_holds(rel, o["box"], r["box"]) for o in found for r in refs))
        for req in meta.get("exclude", []):
            checks_exc.append(sum(o["class"] == req["class"] for o in objs) < req["count"])
        checks = checks_inc + checks_exc
        score = float(np.mean(checks)) if checks else 1.0
        return score, all(checks_inc), all(checks)

    def __call__(self, images: list, meta_datas: list[dict], only_strict: bool) -> tuple:
        results = [self.evaluate(np.asarray(im.convert("RGB")), m) for im, m in zip(images, meta_datas)]
        scores = [r[0] for r in results]
        rewards = [float(r[2] if only_strict else r[1]) for r in results]
        strict = [float(r[2]) for r in results]
        return scores, rewards, strict, group_values(rewards, meta_datas), group_values(strict, meta_datas)


def _handler(scorer: Scorer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # quiet by default
            pass

        def _send(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802
            try:
                from PIL import Image

                data = safe_loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                images = [Image.open(io.BytesIO(b), formats=["JPEG"]) for b in data["images"]]
                metas = list(data["meta_datas"])
                out = scorer(images, metas, bool(data.get("only_strict", False)))
                keys = ("scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards")
                self._send(200, dumps(dict(zip(keys, out))), "application/octet-stream")
            except Exception:
                self._send(500, traceback.format_exc().encode(), "text/plain; charset=utf-8")

    return Handler


def serve(scorer: Scorer, host: str = "127.0.0.1", port: int = 18085) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start the server in a daemon thread; ``port=0`` picks a free port (``server.server_address``).
    Stop it with ``server.shutdown(); server.server_close()``."""
    server = ThreadingHTTPServer((host, port), _handler(scorer))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="geneval-server", daemon=True)
    thread.start()
    return server, thread
