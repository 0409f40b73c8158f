"""The chat page at the server's root: plain HTML, JS modules, CSS and an SVG icon from
hearth/server/static, no build step, no library, nothing from a CDN. Every file there is served
at /NAME, index.html also at / and the icon also at /favicon.ico (where browsers look for it).
Served without the API key (the page asks for it when the API answers 401)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter()
STATIC = files("hearth.server") / "static"
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
FILES = {"/": "index.html", "/favicon.ico": "favicon.svg",
         **{"/" + f.name: f.name for f in STATIC.iterdir() if f.name[f.name.rfind("."):] in MEDIA_TYPES}}
PAGE_PATHS = tuple(FILES)


def _route(path: str, name: str) -> None:
    media_type = MEDIA_TYPES[name[name.rfind("."):]]

    @router.get(path, include_in_schema=False)
    async def page_file() -> Response:
        return Response((STATIC / name).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})


for _path, _name in FILES.items():
    _route(_path, _name)
