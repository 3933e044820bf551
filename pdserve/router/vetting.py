"""Which URLs may become workers at run time (``POST /workers/register``, ``POST /workers``).

A URL is an http(s) base URL (registration_msg.normalize_worker_url), its host (and a prefill's
KV bootstrap host, which decodes dial with the bootstrap token) is in ``--worker-allow``
(router/worker_allow.py), and it answers pdserve's identity endpoint (``GET /server_info``) in
the role it claims, serving the fleet's model (``--served-model-name``, else the model the
healthy workers serve) with the same weights fingerprint, and for a registration the model and
weights it registered with. Only then is it added to the registry: until it is, no request can
be routed to it. The identity probe is the one request a refused URL may receive, and only
once its host passed the allow-list.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.registration_msg import RegistrationMsg
from pdserve.router.config import RouterConfig
from pdserve.router.health import HealthChecker, ProbeResult
from pdserve.router.worker_allow import WorkerAllowList
from pdserve.router.workers import WorkerManager


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a URL may not be a worker: the 4xx status, a message naming it, and its field."""

    status: int
    message: str
    code: str
    param: str | None = "url"


class WorkerVetting:
    """The checks a URL passes before it becomes a worker (see the module docstring)."""

    def __init__(
        self,
        config: RouterConfig,
        workers: WorkerManager,
        health: HealthChecker,
        allow: WorkerAllowList,
    ) -> None:
        self._config = config
        self._workers = workers
        self._health = health
        self.allow = allow

    async def vet(
        self, url: str, host: str, role: str, claim: RegistrationMsg | None = None
    ) -> ProbeResult | Refusal:
        """The identity probe of a URL that may be a worker, or why it may not."""
        timeout_s = self._config.health_timeout_s
        hosts = [("url", host)]
        if claim is not None and claim.bootstrap_host:
            hosts.append(("bootstrap_host", claim.bootstrap_host))
        for param, name in hosts:
            reason = await self.allow.refusal(name, timeout_s)
            if reason is not None:
                return Refusal(403, f"worker {url} refused: {reason}", "worker_not_allowed", param)
        probe = await self._health.probe(url)
        info = probe.info
        if info is None:
            return Refusal(
                422,
                f"worker {url} refused: it did not answer pdserve's identity endpoint "
                f"(GET /server_info): {probe.error}",
                "worker_unverified",
            )
        problems = []
        if info.role != role:
            problems.append(f"it serves as {info.role}, not {role}")
        if claim is not None and (claim.model, claim.weights) != (info.model, info.weights):
            problems.append(
                f"it registered model {claim.model!r} weights {claim.weights!r} but serves "
                f"{info.model!r} weights {info.weights!r}"
            )
        model, weights = self.fleet_identity()
        if model is not None and info.model != model:
            problems.append(f"it serves model {info.model!r}, the fleet serves {model!r}")
        elif weights and info.weights != weights:
            problems.append(
                f"its weights fingerprint {info.weights or 'is missing'!r}: the fleet's is "
                f"{weights!r}"
            )
        if problems:
            message = f"worker {url} refused: {'; '.join(problems)}"
            return Refusal(409, message, "worker_identity_mismatch", "model")
        return probe

    def fleet_identity(self) -> tuple[str | None, str]:
        """(model, weights fingerprint) a new worker must serve: ``--served-model-name`` (or
        what most healthy workers serve) and the fingerprint most of those workers publish
        ("" if none does; None model: no fleet yet, the first worker sets it)."""
        known = [w.info for w in self._workers.all() if w.info is not None and w.is_healthy]
        model = self._config.served_model_name
        if model is None and known:
            model = Counter(i.model for i in known).most_common(1)[0][0]
        prints = Counter(i.weights for i in known if i.model == model and i.weights)
        return model, prints.most_common(1)[0][0] if prints else ""
