"""Hidden states from a serving engine: the target runs in vLLM or SGLang, eyas sends prefills and reads back.

Usage: src = VllmCapture(url, capture_layers, heads)      # or SglangCapture(url, ...)
       features, hidden = src.fetch(input_ids)             # [T, 3H] and [T, H], as eyas's own capture

For a target too large for eyas's engine (a trillion parameters held in INT4 on 8 GPUs) the engine that serves it
computes the hidden states; they land in the same offline format (train/shards.py) that `eyas train fit` reads.
Every request carries eyas's token ids (the engine never re-tokenizes), and the ids the engine reports back are
checked against them. Layer conventions differ and are converted here:

- eyas captures the residual stream *entering* layers 2, L//2, L-3 (or aux_layer_ids + 1), and keeps the final
  hidden state after the model's last norm.
- vLLM's `eagle_aux_hidden_state_layer_ids` also name layer inputs (id L: the stream after the last layer, before
  the norm). Its ExampleHiddenStatesConnector writes the layers listed, in ascending order, to a safetensors file
  ([T, n, H] `hidden_states`, [T] `token_ids`) and returns its path in `kv_transfer_params`; eyas asks for its
  capture layers plus L and applies the final norm to the last one itself.
- SGLang returns `meta_info.hidden_states` from /generate when launched with `--enable-return-hidden-states`: the
  fused EAGLE-3 features of the layers its target captures (set by its draft's config; SGLang's explicit ids name
  layer *outputs*, id + 1 is the layer input) while it runs EAGLE-3, else the final hidden state after the norm.
  One launch cannot give both, so SGLang capture reads features from one endpoint and final states from another.

A greedy check guards the layer bookkeeping: the token the engine generated after the prompt must be the argmax of
the target's LM head over the final hidden state eyas derived.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from eyas.errors import EyasError
from eyas.layers.norm import RMSNorm

LOCK_TIMEOUT_S = 120.0  # how long a written file may stay locked by the engine's writer


def vllm_layer_ids(capture_layers, num_layers: int) -> list[int]:
    """The `eagle_aux_hidden_state_layer_ids` a vLLM server must be launched with for this capture: eyas's layers
    (vLLM's convention is eyas's, layer inputs) and L, the stream the final norm reads."""
    return sorted(set(capture_layers) | {num_layers})


def vllm_launch_flags(capture_layers, num_layers: int, storage: str) -> list[str]:
    """The two `vllm serve` flags that make it write the hidden states eyas reads (see docs/training-large-targets.md)."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids":
                                                 vllm_layer_ids(capture_layers, num_layers)}}}
    kv = {"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
          "kv_connector_extra_config": {"shared_storage_path": storage}}
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]


class _EngineCapture:
    """What the vLLM and SGLang clients share: the HTTP client, the final norm, the greedy check."""

    source = ""

    def __init__(self, url: str, capture_layers, heads, timeout: float = 600.0, transport=None):
        cfg = heads.config
        self.capture_layers = tuple(capture_layers)
        self.num_layers, self.hidden_size = cfg.num_layers, cfg.hidden_size
        self.heads = heads
        self.url = url.rstrip("/").removesuffix("/v1")
        # `transport`: an httpx transport in place of the network (tests)
        self.client = httpx.Client(base_url=self.url, timeout=timeout, trust_env=False, transport=transport)

    def _post(self, route: str, body: dict, client: httpx.Client | None = None) -> dict:
        client = client or self.client
        try:
            r = client.post(route, json=body)
        except httpx.HTTPError as e:
            raise EyasError(f"{self.source} at {client.base_url} cannot be reached ({e.__class__.__name__}: {e})") from None
        if r.status_code != 200:
            raise EyasError(f"{self.source} at {client.base_url}{route} answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def check_greedy(self, hidden: torch.Tensor, generated: int | None, what: str) -> None:
        if generated is None:
            return
        logits = self.heads.logits(hidden[-1:].to(self.heads.lm_head_weight.dtype)).float()
        if int(logits.argmax(-1)) != generated:
            raise EyasError(f"{self.source}: the final hidden state of {what} does not predict the token the engine "
                            f"generated ({generated}): is the server launched for this target with the capture "
                            "layers eyas asks for? (docs/training-large-targets.md)")

    def close(self) -> None:
        self.client.close()


class VllmCapture(_EngineCapture):
    """A vLLM server launched with `extract_hidden_states` and ExampleHiddenStatesConnector (vllm_launch_flags).
    Its files are read from the filesystem the server writes to (the same machine, or shared storage) and deleted."""

    source = "vllm"

    def __init__(self, url: str, capture_layers, heads, model: str | None = None, timeout: float = 600.0,
                 transport=None):
        super().__init__(url, capture_layers, heads, timeout, transport)
        if heads.norm_weight is None:
            raise EyasError("the target checkpoint has no model.norm.weight: its final hidden state cannot be derived "
                            "from vLLM's layer outputs")
        self.norm = RMSNorm(self.hidden_size, heads.config.rms_norm_eps)
        self.norm.weight.data = heads.norm_weight.detach().float().cpu()
        self.layer_ids = vllm_layer_ids(self.capture_layers, self.num_layers)
        self.model = model or self._served_model()

    def _served_model(self) -> str:
        try:
            models = self.client.get("/v1/models").json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise EyasError(f"vllm at {self.url}: no model list at /v1/models ({e})") from None
        return models[0]["id"]

    def fetch(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        body = {"model": self.model, "prompt": list(input_ids), "max_tokens": 1, "temperature": 0.0,
                "return_token_ids": True}
        res = self._post("/v1/completions", body)
        choice = res["choices"][0]
        if choice.get("prompt_token_ids") not in (None, list(input_ids)):
            raise EyasError("vllm: the prompt token ids it ran differ from the ids eyas sent")
        path = (res.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            flags = " ".join(f"'{f}'" if f.startswith("{") else f for f in
                             vllm_launch_flags(self.capture_layers, self.num_layers, "/tmp/hidden_states"))
            raise EyasError(f"vllm at {self.url} returned no hidden_states_path: launch it with {flags}")
        data = _read_locked(Path(path))
        states, ids = data["hidden_states"], data["token_ids"]
        if ids.tolist() != list(input_ids):
            raise EyasError(f"vllm: {path} holds hidden states of other tokens than eyas sent")
        if states.shape[1:] != (len(self.layer_ids), self.hidden_size):
            raise EyasError(f"vllm: {path} holds {tuple(states.shape[1:])} hidden states per token; eyas needs layers "
                            f"{self.layer_ids} of width {self.hidden_size}: relaunch vLLM with "
                            f"eagle_aux_hidden_state_layer_ids {self.layer_ids}")
        slot = {layer: i for i, layer in enumerate(self.layer_ids)}
        features = torch.cat([states[:, slot[layer]] for layer in self.capture_layers], dim=-1)
        with torch.no_grad():
            hidden = self.norm(states[:, slot[self.num_layers]].float())
        generated = (choice.get("token_ids") or [None])[0]
        self.check_greedy(hidden, generated, f"{len(input_ids)} tokens")
        return features, hidden


def _read_locked(path: Path) -> dict:
    """The connector writes the file from a thread after answering and holds an exclusive lock on PATH.lock until
    it is complete; wait for that lock (bounded), read, then delete both: they are the server's scratch files."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + LOCK_TIMEOUT_S
    if lock.exists():
        fd = os.open(lock, os.O_RDONLY)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise EyasError(f"vllm: {path} still being written after {LOCK_TIMEOUT_S:.0f} s") from None
                    time.sleep(0.01)
        finally:
            os.close(fd)
    if not path.is_file():
        raise EyasError(f"vllm wrote its hidden states to {path}, which this machine cannot read: run the capture "
                        "where the server's shared_storage_path is mounted")
    data = load_file(str(path))
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)
    return data


class SglangCapture(_EngineCapture):
    """SGLang servers launched with `--enable-return-hidden-states`: `url` runs EAGLE-3 with a draft whose layers
    are eyas's capture layers (its /generate hidden states are the fused features), `hidden_url` runs the target
    alone (its hidden states are the final ones, after the norm)."""

    source = "sglang"

    def __init__(self, url: str, hidden_url: str, capture_layers, heads, timeout: float = 600.0, transport=None):
        super().__init__(url, capture_layers, heads, timeout, transport)
        if not hidden_url:
            raise EyasError("sglang capture needs two servers: --engine-url (EAGLE-3, features) and "
                            "--engine-hidden-url (the target alone, final hidden states)")
        self.hidden_client = httpx.Client(base_url=hidden_url.rstrip("/"), timeout=timeout, trust_env=False,
                                          transport=transport)

    def _prompt_states(self, client, input_ids: list[int], width: int, what: str):
        body = {"input_ids": list(input_ids), "return_hidden_states": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        res = self._post("/generate", body, client)
        res = res[0] if isinstance(res, list) else res
        meta = res.get("meta_info") or {}
        states = meta.get("hidden_states")
        if not states:
            raise EyasError(f"sglang at {client.base_url} returned no hidden states: launch it with "
                            "--enable-return-hidden-states")
        # The prefill's entry holds every prompt position; later entries (one per decoded token) are not inputs.
        prompt = torch.tensor(states[0], dtype=torch.float32)
        if prompt.dim() != 2 or prompt.shape != (len(input_ids), width):
            raise EyasError(f"sglang at {client.base_url}: {what} of shape {tuple(prompt.shape)}, eyas expects "
                            f"({len(input_ids)}, {width})")
        if meta.get("prompt_tokens", len(input_ids)) != len(input_ids):
            raise EyasError("sglang: the prompt it ran is not the token ids eyas sent")
        return prompt, (res.get("output_ids") or [None])[0]

    def fetch(self, input_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        width = len(self.capture_layers) * self.hidden_size
        features, _ = self._prompt_states(self.client, input_ids, width, "features")
        hidden, generated = self._prompt_states(self.hidden_client, input_ids, self.hidden_size, "final states")
        self.check_greedy(hidden, generated, f"{len(input_ids)} tokens")
        return features, hidden

    def close(self) -> None:
        super().close()
        self.hidden_client.close()
