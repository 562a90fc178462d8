"""The web dashboard: static pages (plain ES modules, no build step, nothing from a CDN) served by the API
itself under ``/ui/``, on the same origin and with the same tokens as the JSON routes they read."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.staticfiles import StaticFiles

PAGES = Path(__file__).with_name("ui")
"""index.html, the modules and the style sheet (package data of trainyard-api)."""
PREFIX = "/ui"


class _Pages(StaticFiles):
    """The dashboard's files, revalidated on every load so a new version of the API serves its own pages."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


def install_dashboard(app: FastAPI) -> None:
    """``/ui/`` serves the pages; ``/`` redirects there (neither is part of the OpenAPI document)."""

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    @app.get(PREFIX, include_in_schema=False)
    async def ui_without_slash() -> RedirectResponse:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:  # what a browser asks for on any page of the origin (the JSON ones too)
        return FileResponse(PAGES / "icon.svg", media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    app.mount(PREFIX, _Pages(directory=PAGES, html=True), name="dashboard")
