"""The HTTP layer's own prometheus metrics, created per app in the registry it is given."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

# Errors that are not an OpenAI error type but are worth counting on their own.
CLIENT_DISCONNECTED = "client_disconnected"
# Status label for requests whose client went away before a response (nginx's convention).
STATUS_CLIENT_CLOSED = 499


@dataclass(frozen=True)
class HttpMetrics:
    requests: Counter
    errors: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry) -> HttpMetrics:
        """Register ``pdserve_http_requests_total`` and ``pdserve_http_request_errors_total``."""
        return cls(
            requests=Counter(
                "pdserve_http_requests",
                "HTTP requests by endpoint (route template) and status code.",
                ["endpoint", "status"],
                registry=registry,
            ),
            errors=Counter(
                "pdserve_http_request_errors",
                "HTTP request errors by OpenAI error type (or client_disconnected).",
                ["type"],
                registry=registry,
            ),
        )

    def observe_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_error(self, err_type: str) -> None:
        self.errors.labels(type=err_type).inc()
