"""``kuberl eval MODEL``: pass@k and mean reward of any Hugging Face model directory (an export or a
base model), offline, with what training uses — the torch engine behind the replica's own HTTP
server, the run's episode workflow, prompt rendering, reward pool and evaluation set
(:func:`.evaluations.evaluation_parts`, which the in-training evaluation builds from too) — so the
number equals the in-training held-out evaluation's on the same weights, data and sampling.

Reads top-down: the spec says what to evaluate (``spec.evaluation``, else ``spec.rollout``'s sampling
and the run's dataset and reward); the model is loaded and served on loopback under a fresh token;
the evaluation runs as :func:`kuberl.rollout.evaluation.evaluate` does during training.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import torch
from aiohttp import web

from ..api.spec import EvaluationSpec, RLExperimentSpec
from ..devices import compute_dtype, placed
from ..inference.engine import TorchEngine
from ..inference.server import build_app
from ..models.loading import load_model
from ..rollout.client import InferenceClient
from ..rollout.evaluation import EvalResult, evaluate
from ..settings import Settings
from .evaluations import evaluation_parts
from .workflows import PromptCheck

log = logging.getLogger("kuberl.eval")
LOOPBACK = "127.0.0.1"


def evaluate_model(spec: RLExperimentSpec, settings: Settings) -> EvalResult:
    """``spec.model``'s pass@k and mean reward on ``spec.evaluation`` (its defaults if absent)."""
    return asyncio.run(_evaluate(spec, spec.evaluation or EvaluationSpec(), settings))


def eval_device() -> str:
    """Where the engine runs: the first CUDA device when torch sees one, else the CPU."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


async def _evaluate(spec: RLExperimentSpec, ev: EvaluationSpec, settings: Settings) -> EvalResult:
    device = eval_device()
    accelerator = "nvidia" if device.startswith("cuda") else "cpu"
    model, tokenizer = load_model(spec.model, spec.seed, settings)
    model = placed(model, device, compute_dtype(spec.model.dtype, accelerator))
    engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=spec.seed)  # replica 0's seed
    check = PromptCheck.of(spec, tokenizer)
    examples, workflow, reward = evaluation_parts(spec, ev, tokenizer, settings, check.keep, None)
    if not examples:
        await reward.aclose()
        raise ValueError("the evaluation set is empty (every row longer than dataset.maxPromptTokens?)")
    check.rendered(examples[0])  # logs the first prompt as the policy reads it
    token = secrets.token_urlsafe(24)
    runner = web.AppRunner(build_app(engine, tokenizer, token, None, settings), shutdown_timeout=1.0,
                           access_log=None)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, 0).start()  # a port the system picks: nothing else can hold it
    port = runner.addresses[0][1]
    log.info("evaluating %s on %s: %d prompts × %d samples", spec.model.path, device, len(examples),
             ev.samples_per_prompt)
    try:
        async with InferenceClient([f"http://{LOOPBACK}:{port}"], token) as client:
            await client.wait_ready()
            return await evaluate(client, examples, workflow, ev.samples_per_prompt, step=0,
                                  progress=progress_lines(len(examples)))
    finally:
        await reward.aclose()
        await runner.cleanup()



def progress_lines(total: int, parts: int = 10) -> Callable[[int, int], None]:
    """A ``progress`` callback that logs every ``1/parts`` of ``total`` examples done."""
    every = max(1, -(-total // parts))  # ceil

    def report(done: int, of: int) -> None:
        if done % every == 0 or done == of:
            log.info("evaluated %d/%d prompts", done, of)

    return report


def eval_spec(model: str, base: RLExperimentSpec | None, *, data: str | None = None, prompt_key: str | None = None,
              answer_key: str | None = None, reward: str | None = None, samples: int | None = None,
              prompts: int | None = None, temperature: float | None = None,
              max_new_tokens: int | None = None) -> RLExperimentSpec:
    """The spec ``kuberl eval`` runs: ``base`` (an experiment's, so prompts are rendered, sampled and
    scored as in its training) with ``model`` as its model — tokenizer and chat template included, as
    an export carries them — and the options over ``spec.evaluation``. Without ``base``, ``data`` and
    ``reward`` are required. Raises pydantic's ValidationError, naming the field."""
    doc = base.model_dump(by_alias=True, exclude_none=True, mode="json") if base is not None else {}
    model_doc = {k: v for k, v in doc.get("model", {}).items() if k not in ("tokenizer", "initFrom", "sftWarmup")}
    doc["model"] = {**model_doc, "path": model}
    evaluation = doc.setdefault("evaluation", {})
    if data is not None:
        dataset = {"path": data, **({"promptKey": prompt_key} if prompt_key else {}),
                   **({"answerKey": answer_key} if answer_key else {})}
        evaluation["dataset"] = dataset
        doc.setdefault("dataset", dataset)
    if reward is not None:
        evaluation["reward"] = {"function": reward}
        doc.setdefault("reward", {"function": reward})
    for key, value in (("samplesPerPrompt", samples), ("prompts", prompts), ("temperature", temperature),
                       ("maxNewTokens", max_new_tokens)):
        if value is not None:
            evaluation[key] = value
    return RLExperimentSpec.model_validate(doc)
