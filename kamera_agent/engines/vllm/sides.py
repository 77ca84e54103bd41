"""`Sides`: which half of kamera's connector a process runs, chosen once by vLLM's role.

vLLM builds one connector per process and role: the scheduler's process gets role
``SCHEDULER``, each worker's ``WORKER``. Each process builds only its half (a worker loads no
tokenizer, a scheduler registers no caches), and the facade
(`kamera_agent.engines.vllm.connector`) reaches it through `Sides.scheduler` or `Sides.worker`;
a hook of the other role, which vLLM never calls, fails with the role named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kamera_agent.engines.vllm.common import ConnectorSide
from kamera_agent.engines.vllm.scheduler import ConnectorScheduler
from kamera_agent.engines.vllm.worker import ConnectorWorker

__all__ = ["Sides"]


@dataclass(frozen=True)
class Sides:
    """The half this process runs (``built``), by role."""

    built: ConnectorScheduler | ConnectorWorker

    @classmethod
    def of(cls, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> Sides:
        """The half for ``role``, built from vLLM's config (startup errors raise here)."""
        half = ConnectorScheduler if role == KVConnectorRole.SCHEDULER else ConnectorWorker
        return cls(half(vllm_config, kv_cache_config))

    @property
    def side(self) -> ConnectorSide:
        """The half, whichever it is (for the hooks vLLM calls in both roles)."""
        return self.built

    @property
    def scheduler(self) -> ConnectorScheduler:
        if not isinstance(self.built, ConnectorScheduler):
            raise RuntimeError("a scheduler hook was called on kamera's connector in a worker's role")
        return self.built

    @property
    def worker(self) -> ConnectorWorker:
        if not isinstance(self.built, ConnectorWorker):
            raise RuntimeError("a worker hook was called on kamera's connector in the scheduler's role")
        return self.built
