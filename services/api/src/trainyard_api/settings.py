"""The API's settings: the shared ``ServiceSettings`` plus where to listen and how to page."""

from __future__ import annotations

from pydantic import AliasChoices, Field

from trainyard_common.settings import ServiceSettings


class ApiSettings(ServiceSettings):
    """``TRAINYARD_*`` variables of the API process (parsed once in ``main()``)."""

    api_host: str = Field(default="127.0.0.1", description="interface the HTTP server binds")
    api_port: int = Field(
        default=8080, ge=0, lt=65536, description="HTTP port, 0 picks a free one (TRAINYARD_PORT is read too)",
        validation_alias=AliasChoices("api_port", "TRAINYARD_API_PORT", "TRAINYARD_PORT"),
    )
    api_public_url: str | None = Field(
        default=None, description="base URL clients use, for Location headers; defaults to http://host:port"
    )
    api_page_limit: int = Field(default=50, gt=0, description="list page size when the client gives none")
    api_max_page_limit: int = Field(default=500, gt=0, description="largest page a client may ask for")
    api_max_attempts: int = Field(default=3, gt=0, le=100, description="attempt budget of a new job")
    api_access_log: bool = Field(default=False, description="log every HTTP request (uvicorn access log)")

    @property
    def public_url(self) -> str:
        if self.api_public_url:
            return self.api_public_url.rstrip("/")
        return f"http://{self.api_host}:{self.api_port}"
