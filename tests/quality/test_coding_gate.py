"""Coding gate per server config: pass@k on the gate problems, and an acceptance floor.

    pytest -m quality --config-grid smoke          # ids are config ids: b8-k4-w2048-bs8, ar, ...

Grid `quality.mode: completion` (the default, for base models): completions come from the
deployed service's /generate (text prompt, the grid's temperature and max_new_tokens), cut at the
first top-level statement, run in the sandbox. `quality.mode: chat` (chat models): the problem in
the DDTree paper's chat prompt goes to /v1/chat/completions, and the reply's first fenced python
block is run. For DFLASH/DDTREE the token-weighted accept length over the gate's requests (sum
completion_tokens / sum spec_verify_ct, from meta_info or from sglext.spec_tokens_details) must
reach the grid's accept_floor, so a drafter that collapsed to one token per step fails even when
the outputs are still right.

Programs run in namespaces (ddtree/quality/sandbox.py); where those cannot be made the gate refuses
before asking the model for anything, unless --unsafe-exec, and the record's `isolation` says which ran.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ddtree.bench.results import atomic_write_text
from ddtree.config import SpecConfig
from ddtree.quality import gate_problems, run_gate
from ddtree.service.base import http_client
from ddtree.service.manager import ServiceManager
from ddtree.suite.options import SuiteOptions

pytestmark = pytest.mark.quality

GENERATE_TIMEOUT_S = 600.0


class Completer:
    """complete(prompt, n) over /generate, keeping the token counts for the acceptance floor."""

    def __init__(self, base_url: str, temperature: float, max_new_tokens: int) -> None:
        self.url = base_url + "/generate"
        self.temperature = temperature
        self.max_new_tokens = max_new_tokens
        self.tokens = 0
        self.verify_steps = 0

    def __call__(self, prompt: str, n: int) -> list[str]:
        texts = []
        with http_client(GENERATE_TIMEOUT_S) as client:
            for seed in range(n):  # T > 0 needs a different seed per sample; T = 0 ignores it
                body: dict[str, Any] = {"text": prompt, "sampling_params": {
                    "temperature": self.temperature, "max_new_tokens": self.max_new_tokens, "seed": seed}}
                response = client.post(self.url, json=body)
                assert response.status_code == 200, f"/generate answered {response.status_code}: {response.text[:300]}"
                data = response.json()
                meta = data.get("meta_info", {})
                if meta.get("spec_verify_ct"):
                    self.tokens += int(meta.get("completion_tokens", 0))
                    self.verify_steps += int(meta["spec_verify_ct"])
                texts.append(str(data.get("text", "")))
        return texts

    @property
    def accept_length(self) -> float | None:
        return self.tokens / self.verify_steps if self.verify_steps else None


class ChatCompleter(Completer):
    """complete(user message, n) over /v1/chat/completions (SGLang's OpenAI route), the reply's text."""

    def __init__(self, base_url: str, temperature: float, max_new_tokens: int,
                 template_kwargs: dict[str, Any] | None) -> None:
        super().__init__(base_url, temperature, max_new_tokens)
        self.url = base_url + "/v1/chat/completions"
        self.template_kwargs = template_kwargs

    def __call__(self, prompt: str, n: int) -> list[str]:
        texts = []
        with http_client(GENERATE_TIMEOUT_S) as client:
            for seed in range(n):
                body: dict[str, Any] = {"model": "default", "messages": [{"role": "user", "content": prompt}],
                                        "temperature": self.temperature, "max_tokens": self.max_new_tokens,
                                        "seed": seed, "return_spec_tokens_details": True}
                if self.template_kwargs:
                    body["chat_template_kwargs"] = self.template_kwargs
                response = client.post(self.url, json=body)
                assert response.status_code == 200, f"{self.url} answered {response.status_code}: {response.text[:300]}"
                data = response.json()
                details = (data.get("sglext") or {}).get("spec_tokens_details") or {}
                if details.get("spec_verify_ct"):
                    self.tokens += int((data.get("usage") or {}).get("completion_tokens", 0))
                    self.verify_steps += int(details["spec_verify_ct"])
                texts.append(str(data["choices"][0]["message"].get("content") or ""))
        return texts


def test_coding_gate(config_cell: SpecConfig, deployed: ServiceManager, suite: SuiteOptions) -> None:
    q = suite.grid.quality
    problems = gate_problems()[: q.problems]
    base_url = deployed.backend.base_url
    complete = (ChatCompleter(base_url, q.temperature, q.max_new_tokens, q.chat_template_kwargs) if q.mode == "chat"
                else Completer(base_url, q.temperature, q.max_new_tokens))
    report = run_gate(problems, complete, k=q.k, n=q.n, mode=q.mode, unsafe_exec=suite.unsafe_exec)

    accept_ok = not config_cell.speculative or (complete.accept_length or 0) >= q.accept_floor
    record = {"config_id": config_cell.id, "mode": q.mode, "accept_length": complete.accept_length,
              "threshold": q.threshold, "accept_floor": q.accept_floor,
              "passed": report.pass_at_k >= q.threshold and accept_ok, **report.to_dict()}
    atomic_write_text(suite.results_dir / "quality" / f"{config_cell.id}.json", json.dumps(record, indent=2) + "\n")

    failed = [f"{r.task_id}: {r.first_failure[-300:]}" for r in report.per_problem if r.c < r.n]
    assert report.pass_at_k >= q.threshold, (
        f"pass@{q.k} {report.pass_at_k:.2f} < threshold {q.threshold:.2f} on {len(problems)} problems ({q.mode}), "
        f"{config_cell.id}; failing: {failed[:3]}"
    )
    if config_cell.speculative:
        accept = complete.accept_length
        assert accept is not None, f"{config_cell.id}: the service reported no spec_verify_ct while speculating"
        assert accept >= q.accept_floor, (
            f"accept length {accept:.2f} tokens/step < floor {q.accept_floor:.2f}, {config_cell.id} "
            f"(token-weighted over {complete.tokens} tokens)"
        )
