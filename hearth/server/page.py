"""The chat page at the server's root: plain HTML, JS and CSS from hearth/server/static, no build
step. Served without the API key (the page asks for it when the API answers 401)."""

from __future__ import annotations

from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import Response

router = APIRouter()
STATIC = files("hearth.server") / "static"
FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/chat.js": ("chat.js", "text/javascript; charset=utf-8"),
         "/chat.css": ("chat.css", "text/css; charset=utf-8")}
PAGE_PATHS = tuple(FILES)


def _route(path: str, name: str, media_type: str) -> None:
    @router.get(path, include_in_schema=False)
    async def page_file() -> Response:
        return Response((STATIC / name).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})


for _path, (_name, _type) in FILES.items():
    _route(_path, _name, _type)
