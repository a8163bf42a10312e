"""`kuberl` command line: validate, render, run, serve, scale, top, postmortem, export, eval, crds, argocd, operator.

Every user error ends in a one-line message and exit code 1, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kuberl.api import FieldIssue, Resource, RLExperiment, validate_document

from . import serve
from .preflight import data_preflight, experiment_spec, preflight

SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: linear where PyYAML's scanner is not


class PlainDumper(yaml.SafeDumper):
    """YAML without anchors and aliases (``&id001`` / ``*id001``): a manifest a GitOps reviewer
    reads in a diff repeats a shared probe instead of pointing at it."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _describe(doc: Any, index: int) -> str:
    if isinstance(doc, dict):
        kind = doc.get("kind") or "<no kind>"
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
        return f"{kind}/{name or '<no name>'}"
    return f"document {index + 1}"


def load_documents(path: Path) -> Iterator[tuple[str, Any]]:
    """(label, decoded document) for every non-empty YAML document; raises ValueError on bad YAML."""
    try:
        text = path.read_text()
    except OSError as err:
        raise ValueError(f"cannot read: {err.strerror}") from err
    try:
        docs = [d for d in yaml.load_all(text, Loader=SAFE_LOADER) if d is not None]
    except RecursionError as err:
        raise ValueError("invalid YAML: nested too deeply") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(getattr(err, "problem", None) or err).split())  # one line, whatever the parser said
        raise ValueError(f"invalid YAML{where}: {problem}") from err
    for i, doc in enumerate(docs):
        yield _describe(doc, i), doc


def check_file(path: Path, warnings: list[str] | None = None, architecture: bool = False,
               import_rewards: bool = False) -> tuple[list[Resource], list[str]]:
    """Valid objects in ``path`` and one error line per problem (file, object, field, message);
    an RLExperiment's files and reward are also checked on this machine (:mod:`.preflight`; with
    ``architecture``, what its model's config refuses too: ``kuberl validate``), its warnings appended
    to ``warnings``; ``import_rewards``: import reward modules, not only find them."""
    objects: list[Resource] = []
    errors: list[str] = []
    try:
        documents = list(load_documents(path))
    except ValueError as err:
        return [], [f"{path}: {err}"]
    if not documents:
        return [], [f"{path}: no YAML documents found"]
    for label, doc in documents:
        obj, issues = validate_document(doc)
        if (spec := experiment_spec(doc)) is not None:
            local_errors, local_warnings = preflight(spec, architecture, import_rewards)
            issues += local_errors
            obj = None if local_errors else obj
            if warnings is not None:
                warnings += [_line(path, label, w) for w in local_warnings]
        elif obj is None and isinstance(doc, dict) and doc.get("kind") == RLExperiment.KIND:
            issues += data_preflight(doc)  # the schema failed elsewhere: its data is still worth a look
        errors += [_line(path, label, issue) for issue in issues]
        if obj is not None:
            objects.append(obj)
    return objects, errors


def _line(path: Path, label: str, issue: FieldIssue) -> str:
    return f"{path}: {label}: {issue.path}: {issue.message}"


def cmd_validate(args: argparse.Namespace) -> int:
    failed = False
    for path in args.files:
        warnings: list[str] = []
        objects, errors = check_file(Path(path), warnings, architecture=True, import_rewards=args.import_rewards)
        for line in warnings:
            print(f"warning: {line}", file=sys.stderr)
        for line in errors:
            print(line, file=sys.stderr)
        failed |= bool(errors)
        for obj in objects:
            print(f"{path}: {obj.kind}/{obj.metadata.name}: valid")
    return 1 if failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    from kuberl_operator.render import render_resource
    from kuberl_operator.settings import OperatorSettings

    settings = OperatorSettings.from_env().build  # the operator's images etc. (KUBERL_IMAGE_*), as it would
    objects, errors = check_file(Path(args.file), import_rewards=args.import_rewards)
    if errors:
        for line in errors:
            print(line, file=sys.stderr)
        return 1
    manifests = []
    for obj in objects:
        if args.namespace and not obj.metadata.namespace:
            obj.metadata.namespace = args.namespace
        manifests += render_resource(obj, settings)
    sys.stdout.write(yaml.dump_all(manifests, Dumper=PlainDumper, sort_keys=False))
    return 0


def cmd_crds(args: argparse.Namespace) -> int:
    from kuberl.api.crd import main as crd_main

    return crd_main([args.out] if args.out else [])


def cmd_operator(args: argparse.Namespace) -> int:
    from kuberl_operator.main import run_operator

    return run_operator(namespace=args.namespace, verbose=args.verbose, liveness=args.liveness)


def cmd_run(args: argparse.Namespace) -> int:
    from kuberl.local import run_local
    from kuberl.local.processes import RunError

    try:
        summary = run_local(Path(args.file), args.set or [], args.max_steps,
                            Path(args.summary) if args.summary else None,
                            Path(args.workdir) if args.workdir else None, quiet=args.quiet,
                            spec_checkpoints=args.spec_checkpoints)
    except RunError as err:
        print(f"kuberl run: {err}", file=sys.stderr)
        return 1
    per_step = ("rewards", "entropies")  # in --summary's file, too long for a terminal
    print(json.dumps({k: v for k, v in summary.items() if k not in per_step}, indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from kuberl.checkpoint import CheckpointError
    from kuberl.models.loading import ModelLoadError
    from kuberl.settings import from_environment
    from kuberl.trainer.offline_export import export_checkpoint

    try:
        uri = export_checkpoint(args.checkpoint, args.out, args.model, args.dtype, from_environment())
    except (CheckpointError, ModelLoadError, OSError) as err:
        print(f"kuberl export: {err}", file=sys.stderr)
        return 1
    print(uri)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from kuberl.models.loading import ModelLoadError
    from kuberl.settings import from_environment
    from kuberl.trainer.evaluations import evaluation_sampling
    from kuberl.trainer.offline_eval import eval_spec, evaluate_model

    base = None
    if args.file:
        try:
            docs = [doc for _, doc in load_documents(Path(args.file))]
        except ValueError as err:
            print(f"kuberl eval: {args.file}: {err}", file=sys.stderr)
            return 1
        base = next((s for s in map(experiment_spec, docs) if s is not None), None)
        if base is None:
            print(f"kuberl eval: {args.file}: no valid RLExperiment in it (kuberl validate says why)", file=sys.stderr)
            return 1
    elif args.data is None or args.reward is None:
        print("kuberl eval: name the data and the reward (--data, --reward), or an experiment (-f) "
              "whose dataset and reward to use", file=sys.stderr)
        return 1
    try:
        spec = eval_spec(args.model, base, data=args.data, prompt_key=args.prompt_key, answer_key=args.answer_key,
                         reward=args.reward, samples=args.samples, prompts=args.prompts,
                         temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    except ValidationError as err:
        for e in err.errors():
            print(f"kuberl eval: spec.{'.'.join(map(str, e['loc']))}: {e['msg']}", file=sys.stderr)
        return 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        result = evaluate_model(spec, from_environment())
    except (ModelLoadError, ValueError, OSError) as err:
        print(f"kuberl eval: {err}", file=sys.stderr)
        return 1
    ev = spec.evaluation
    assert ev is not None
    print(json.dumps({
        "model": args.model, "dataset": (ev.dataset or spec.dataset).path,
        "reward_function": (ev.reward or spec.reward).function, "prompts": result.prompts,
        "samples_per_prompt": result.k, "temperature": evaluation_sampling(spec, ev)[0],
        "reward": round(result.reward, 4), f"pass@{result.k}": round(result.pass_at_k, 4),
        "length": round(result.length, 2), "seconds": result.seconds}))
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    from kuberl.local.workdir import request_replicas

    try:
        request_replicas(Path(args.workdir), args.replicas)
    except (ValueError, OSError) as err:
        print(f"kuberl scale: {err}", file=sys.stderr)
        return 1
    print(f"asked {args.workdir} for {args.replicas} inference replica(s); its output says when they serve",
          file=sys.stderr)
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from . import top

    try:
        if args.api:
            title = f"{args.namespace}/{args.target}"
            refresh = top.cluster_source(args.api, args.namespace, args.target)
        else:
            refresh, title = top.local_source(Path(args.target)), args.target
        return top.run(refresh, top.View(title), args.interval, args.once, sys.stdout.write)
    except (ValueError, OSError) as err:
        print(f"kuberl top: {err}", file=sys.stderr)
        return 1


def cmd_postmortem(args: argparse.Namespace) -> int:
    from kuberl.checkpoint import CheckpointError
    from kuberl.settings import from_environment

    from . import postmortem

    try:
        data, kept, checkpoint = postmortem.fetch(args.api, args.namespace, args.name)
        out = Path(args.out or f"{args.name}-postmortem.tar.gz")
        places = postmortem.keep(data, kept, out, args.to, checkpoint, from_environment())
    except (ValueError, OSError, CheckpointError) as err:
        print(f"kuberl postmortem: {err}", file=sys.stderr)
        return 1
    print(f"{kept.get('reason', 'post-mortem')} at {kept.get('time')}: {len(data)} bytes", file=sys.stderr)
    print("\n".join(places))
    return 0


def cmd_argocd(args: argparse.Namespace) -> int:
    from kuberl_operator.argocd import argocd_cm_snippet

    Path(args.out).write_text(argocd_cm_snippet())
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


IMPORT_REWARDS_HELP = ("import the reward modules the manifest names (running their code here) to check "
                       "their functions; by default only their files are looked for")


def _manifest_commands(sub: Any) -> None:
    """The commands for the manifest offline: validate, render."""
    p = sub.add_parser("validate", help="check manifests offline (multi-document YAML)")
    p.add_argument("files", nargs="+", metavar="FILE", help="manifests (YAML, several documents each)")
    p.add_argument("--import-rewards", action="store_true", help=IMPORT_REWARDS_HELP)
    p.set_defaults(func=cmd_validate)
    p = sub.add_parser("render", help="print every object the operator would create")
    p.add_argument("file", metavar="FILE", help="the manifest (YAML)")
    p.add_argument("-n", "--namespace", default=None, help="namespace for objects without one")
    p.add_argument("--import-rewards", action="store_true", help=IMPORT_REWARDS_HELP)
    p.set_defaults(func=cmd_render)


def _run_commands(sub: Any) -> None:
    """The commands for a run: locally (run, serve, scale), and what one is doing or why it failed (top, postmortem)."""
    p = sub.add_parser("run", help="run an experiment locally on CPU or NVIDIA GPUs (inference + trainer processes)")
    p.add_argument("file", metavar="FILE", help="the RLExperiment manifest (YAML)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a spec field, e.g. algorithm.maxSteps=20 (repeatable)")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many training steps (default: spec.algorithm.maxSteps)")
    p.add_argument("--summary", metavar="PATH", help="also write the JSON summary here")
    p.add_argument("--workdir", metavar="DIR", help="logs and run files (default: a new /tmp/kuberl-NAME-* directory)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--spec-checkpoints", action="store_true",
                   help="checkpoint to spec.checkpoint.uri (e.g. s3:// on MinIO) instead of the work dir")
    p.set_defaults(func=cmd_run)
    serve.add_parser(sub)
    p = sub.add_parser("scale", help="resize the inference pool of a running kuberl run (on a cluster: kubectl "
                       "scale rlx NAME --replicas N)")
    p.add_argument("workdir", metavar="WORKDIR", help="the run's work dir (kuberl run prints it)")
    p.add_argument("--replicas", type=int, required=True, help="the pool's new number of inference replicas")
    p.set_defaults(func=cmd_scale)
    p = sub.add_parser("top", help="one screen for a running experiment: step, reward, staleness, wait, replicas, "
                       "last weight push (a kuberl run's work dir, or NAME --api through kubectl proxy)")
    p.add_argument("target", metavar="WORKDIR|NAME", help="a kuberl run's work dir, or with --api the RLExperiment")
    p.add_argument("--api", metavar="URL", help="kubectl proxy's URL (e.g. http://127.0.0.1:8001): read the "
                   "experiment from the cluster")
    p.add_argument("-n", "--namespace", default="default", help="the experiment's namespace (with --api)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between screens (default: %(default)s)")
    p.add_argument("--once", action="store_true", help="print one screen and exit (scripts)")
    p.set_defaults(func=cmd_top)
    p = sub.add_parser("postmortem", help="a failed experiment's post-mortem bundle (kept by the operator) to a "
                       "file and, with your storage credentials, beside its checkpoints")
    p.add_argument("name", metavar="NAME", help="the RLExperiment")
    p.add_argument("--api", required=True, metavar="URL", help="kubectl proxy's URL (e.g. http://127.0.0.1:8001)")
    p.add_argument("-n", "--namespace", default="default", help="its namespace (default: %(default)s)")
    p.add_argument("-o", "--out", metavar="FILE", help="where to write it (default: NAME-postmortem.tar.gz)")
    p.add_argument("--to", metavar="URI", help="also upload it under this store URI (s3://…/, file:///…/), or "
                   "'checkpoint': the experiment's spec.checkpoint.uri — as postmortem/<time>/postmortem.tar.gz")
    p.set_defaults(func=cmd_postmortem)


def _model_commands(sub: Any) -> None:
    """The commands for a trained model: export, eval."""
    p = sub.add_parser("export", help="a finished checkpoint as a Hugging Face model directory (offline, CPU)")
    p.add_argument("checkpoint", metavar="CHECKPOINT_URI", help="s3://… or file://…/step-NNNNNNNN/")
    p.add_argument("out", metavar="OUT_URI", help="where the directory goes: s3://bucket/prefix/ or file:///dir/")
    p.add_argument("--model", default=None, help="the model the run trained (its spec.model.path), for "
                   "checkpoints written before they carried the model's config and tokenizer")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the exported weights' dtype (default: %(default)s)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("eval", help="pass@k and mean reward of a Hugging Face model (an export, or a base model)")
    p.add_argument("model", metavar="MODEL", help="file:///dir (or a plain path), s3://prefix/ or hf://ORG/NAME")
    p.add_argument("-f", "--file", metavar="EXPERIMENT", help="take the data, reward, chat template, sampling "
                   "and spec.evaluation of this RLExperiment manifest (what its training evaluates)")
    p.add_argument("--data", help="evaluation dataset (a dataset.path: builtin:NAME, file, s3:// or hf://datasets/)")
    p.add_argument("--prompt-key", help="the data's prompt column (default: prompt)")
    p.add_argument("--answer-key", help="the data's answer column (default: answer)")
    p.add_argument("--reward", help="reward function, e.g. kuberl.rewards:math or my_module:score")
    p.add_argument("--samples", type=int, help="k of pass@k: samples per prompt (default 4)")
    p.add_argument("--prompts", type=int, help="the first N examples (default 64)")
    p.add_argument("--temperature", type=float, help="default: the experiment's rollout temperature (1.0)")
    p.add_argument("--max-new-tokens", type=int, help="default: the experiment's rollout.maxNewTokens")
    p.set_defaults(func=cmd_eval)


def _project_commands(sub: Any) -> None:
    """The commands for the project's generated files and the operator: crds, argocd, operator."""
    p = sub.add_parser("crds", help="regenerate the CRD YAML and docs/reference.md from the API models")
    p.add_argument("out", nargs="?", default=None,
                   help="only the CRDs, into this directory (default: crds/, charts/kuberl/crds/ and the reference)")
    p.set_defaults(func=cmd_crds)
    p = sub.add_parser("argocd", help="regenerate the ArgoCD health checks (deploy/argocd/argocd-cm-health.yaml)")
    p.add_argument("out", nargs="?", default="deploy/argocd/argocd-cm-health.yaml", help="default: %(default)s")
    p.set_defaults(func=cmd_argocd)
    p = sub.add_parser("operator", help="run the operator against the current kube context")
    p.add_argument("-n", "--namespace", action="append", help="watch only these namespaces")
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.add_argument("--liveness", default=None, metavar="URL",
                   help="serve a health endpoint for probes, e.g. http://0.0.0.0:8080/healthz")
    p.set_defaults(func=cmd_operator)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kuberl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_manifest_commands, _run_commands, _model_commands, _project_commands):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kuberl render x.yaml | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141


if __name__ == "__main__":
    sys.exit(main())
