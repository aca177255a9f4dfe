"""`memrl`: the command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

# Errors a user fixes by changing an argument, a file or a setting (each message says what): every
# command prints them as one line and exits 2, as click does for a bad option. Any other exception is
# a bug and keeps its traceback. Named by module so that checking them imports nothing: an exception
# can only be an instance of a class whose module is already loaded.
EXPECTED_ERRORS = (
    "memrl.config:ConfigError", "memrl.data.records:DataError", "memrl.data.records:MissingDependencyError",
    "memrl.data.manifest:ManifestError", "memrl.data.hotpotqa:SelectionError",
    "memrl.data.ruler_hqa:RulerBuildError", "memrl.data.synthetic:SyntheticTaskError",
    "memrl.train.checkpoint:CheckpointError", "memrl.train.controller:TrainingError", "memrl.train.sft:SFTError",
    "memrl.train.report:ReportError", "memrl.train.actor:ActorError", "memrl.train.partition:PartitionError",
    "memrl.eval.runner:EvalError", "memrl.eval.compare:CompareError", "memrl.engines.base:EngineError",
    "memrl.memagent.prompts:PromptError", "memrl.distributed.workers:WorkerError", "memrl.tiny:TinyModelError",
    "memrl.demo:DemoError",
)


def is_expected_error(error: BaseException) -> bool:
    """Whether `error` is one of EXPECTED_ERRORS (or a subclass of one)."""
    for spec in EXPECTED_ERRORS:
        module_name, _, class_name = spec.partition(":")
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and isinstance(error, cls):
            return True
    return False


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


class _Commands(TyperGroup):
    """The app's command group: the one place where expected errors of every command become `_fail`."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as error:
            if not is_expected_error(error):
                raise
            _fail(" ".join(str(error).split()))  # one line, whatever the message's own newlines


app = typer.Typer(help="memrl: train and evaluate MemAgent-style long-document readers with RL.", cls=_Commands,
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config value: section.key=value.")]


@app.command()
def demo(
    run_root: Annotated[Path, typer.Option(help="Output folder (new or empty).")] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(help="A smaller run (~4 min) instead of the full one.")] = False,
) -> None:
    """The CPU demo: warm start, held-out eval, GRPO through the MemAgent loop, eval, compare, plots."""
    from memrl.demo import demo_command

    raise typer.Exit(demo_command(run_root, quick))


@app.command()
def sft(
    model: Annotated[str, typer.Option(help="Model folder to warm-start.")],
    data: Annotated[Path, typer.Option(help='JSONL, one demonstration a line: {"turns": [{"prompt", "response"}]}.')],
    out: Annotated[Path, typer.Option(help="Output folder (metrics.jsonl, model/).")],
    epochs: int = 2, batch_size: int = 32, lr: float = 2e-3,
    recipe: Annotated[Path | None, typer.Option(help="Recipe (templates, thinking, micro-batch budget).")] = None,
    set_: SetOption = None,
) -> None:
    """Supervised warm start through the RL actor (loss on response tokens only)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from memrl.config import load_config, load_pretrained
    from memrl.train.sft import SFTError, SFTOptions, run_sft
    from memrl.train.sft_data import load_demonstrations

    if not data.is_file():
        raise SFTError(f"demonstrations file {data} does not exist; pass --data FILE (JSONL)")
    cfg = load_config(recipe, list(set_ or []))
    tokenizer = load_pretrained(AutoTokenizer, model, "model")
    demos = load_demonstrations(data, tokenizer, cfg.rollout.enable_thinking)
    policy = load_pretrained(AutoModelForCausalLM, model, "model", dtype="float32")
    history = run_sft(policy, tokenizer, cfg, demos, SFTOptions(epochs=epochs, batch_size=batch_size, lr=lr), out)
    nll = [h["nll"] for h in history if "nll" in h]
    typer.echo(f"wrote {out / 'model'}: {len(history)} steps" + (f", NLL {nll[0]:.3f} -> {nll[-1]:.3f}" if nll else ""))


@app.command("make-tiny-model")
def make_tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write.")],
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder to use instead of the built-in one.")] = None,
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
) -> None:
    """Write a random-initialised tiny Qwen3 model folder (for tests and the CPU demo)."""
    from memrl.tiny import make_tiny_model_command

    make_tiny_model_command(out, tokenizer, layers, hidden, heads, kv_heads, intermediate, seed)


@app.command()
def train(
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe (e.g. recipes/qwen3-0.6b-hotpotqa.yaml).")] = None,
    run_root: Annotated[Path, typer.Option(help="Folder for logs, checkpoints, TensorBoard.")] = Path("runs/train"),
    set_: SetOption = None,
    load: Annotated[Path | None, typer.Option(help="Checkpoint (iter_XXXXXXX, or a run root) to resume from.")] = None,
    start_rollout_id: Annotated[int | None, typer.Option(help="First rollout id (default: after the checkpoint).")] = None,
    save_rollouts: Annotated[bool, typer.Option(help="Keep raw trajectories per rollout (debug replay input).")] = False,
    replay_rollouts: Annotated[Path | None, typer.Option(help="Train from saved raw rollouts, no generation.")] = None,
    runtime: Annotated[str | None, typer.Option(help="local (default: one process) or ray.")] = None,
    ray_address: Annotated[str | None, typer.Option(help="Ray cluster to join (HOST:PORT); default: a local one.")] = None,
    progress: Annotated[bool, typer.Option(help="Progress bars.")] = True,
) -> None:
    """Train a MemAgent policy with GRPO (one row per turn)."""
    from memrl.config import load_config
    from memrl.train.controller import TrainOptions
    from memrl.train.controller import train as run_train

    overrides = list(set_ or []) + ([f"train.runtime={runtime}"] if runtime else [])
    cfg = load_config(recipe, overrides)
    options = TrainOptions(run_root=run_root, load=load, start_rollout_id=start_rollout_id,
                           save_rollouts=save_rollouts, replay_rollouts=replay_rollouts, progress=progress)
    try:
        if cfg.train.runtime == "ray":
            from memrl.distributed.runtime import run_ray_training

            history = run_ray_training(cfg, options, ray_address=ray_address)
        else:
            history = run_train(cfg, options)
    except KeyboardInterrupt:
        typer.secho("interrupted: completed steps are logged; resume with --load", err=True)
        raise typer.Exit(130) from None
    if history:
        last = history[-1]
        typer.echo(f"done: {len(history)} steps, last reward {last.get('reward/mean', float('nan')):.3f}, "
                   f"rows saved/transferred/consumed {int(last['rows/saved'])}/{int(last['rows/transferred'])}/"
                   f"{int(last['rows/consumed'])}; logs in {run_root}")


@app.command()
def serve(
    model: Annotated[str, typer.Option(help="Model folder (Hugging Face format).")],
    port: int = 8000,
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    api_key: Annotated[str | None, typer.Option(help="Require this bearer key (or set MEMRL_API_KEY).")] = None,
    device: str = "auto", dtype: str = "auto",
    gate_timeout_s: Annotated[float, typer.Option(
        help="Longest wait of a generation for a weight reload (or of a reload for generations); then 503.")] = 600.0,
    reload_root: Annotated[list[Path] | None, typer.Option(
        help="Folder POST /v1/reload_weights may load weights from (repeatable; symlinks and .. resolved). "
             "Default: none, reloads disabled. To train against this server, give the run root (or a folder "
             "above it): training writes RUN_ROOT/weights_sync and asks for a reload of it every step.")] = None,
) -> None:
    """Serve a local model over an OpenAI-compatible completions API (token ids in and out, log-probs)."""
    from memrl.config import check_model_path
    from memrl.engines.server import serve_command

    check_model_path(model)  # before the server starts, not as a traceback from its startup
    serve_command(model, port=port, host=host, api_key=api_key, device=device, dtype=dtype,
                  gate_timeout_s=gate_timeout_s, reload_roots=reload_root)


@app.command("convert-to-hf")
def convert_to_hf(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint folder iter_XXXXXXX (or a run root: latest).")],
    out: Annotated[Path, typer.Argument(help="Output Hugging Face model folder.")],
) -> None:
    """Export a training checkpoint as a plain Hugging Face model folder."""
    from memrl.train.checkpoint import convert_to_hf_command

    path = convert_to_hf_command(ckpt, out)
    typer.echo(f"wrote {path}")


@app.command()
def report(run_root: Annotated[Path, typer.Argument(help="A training run root.")]) -> None:
    """Write PNG plots (reward, KL, log-prob gap, lengths) and a markdown summary of a run."""
    from memrl.train.report import report_command

    paths = report_command(run_root)
    for p in paths:
        typer.echo(str(p))


@app.command("pass-at-k")
def pass_at_k(
    data: Annotated[Path, typer.Option(help="Candidate questions (prepared JSONL).")],
    out: Annotated[Path, typer.Option(help="Pass-count JSON to write (input of prepare-data --pass-counts).")],
    k: Annotated[int, typer.Option(min=1, help="Samples per question.")] = 8,
    model: Annotated[str | None, typer.Option(help="Model folder (local engine).")] = None,
    server_url: Annotated[str | None, typer.Option(help="OpenAI-compatible server.")] = None,
    recipe: Annotated[Path | None, typer.Option(help="Recipe whose rollout settings are used.")] = None,
    set_: SetOption = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N candidates.")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer folder (required with --server-url).")] = None,
) -> None:
    """Count how often a model solves each candidate in k samples (for Pass@k training-set selection)."""
    from memrl.eval.pass_at_k import pass_at_k_command

    result = pass_at_k_command(model, server_url, recipe, data, out, k, set_, limit, tokenizer)
    typer.echo(f"wrote {out}: {len(result['pass_counts'])} questions, {result['mixed']} solved sometimes, "
               f"{result['never']} never, {result['always']} always, {len(result['failed'])} failed")


@app.command("config")
def config_cmd(
    recipe: Annotated[Path | None, typer.Option(help="Recipe to validate and show (default: the defaults).")] = None,
    set_: SetOption = None,
    yaml_: Annotated[bool, typer.Option("--yaml", help="Print the resolved configuration as YAML instead.")] = False,
) -> None:
    """Every config field with its type, value (default, or the recipe's) and description; validates --recipe."""
    from memrl.config import load_config
    from memrl.config_doc import describe_config

    cfg = load_config(recipe, list(set_ or []))
    typer.echo(cfg.to_yaml() if yaml_ else describe_config(cfg), nl=False)


def _register_optional() -> None:
    from memrl.data.prepare import register as register_prepare
    from memrl.eval.runner import register as register_eval

    register_prepare(app)
    register_eval(app)


_register_optional()


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `memrl ... | head`
        sys.exit(0)


if __name__ == "__main__":
    main()
