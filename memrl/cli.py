"""`memrl`: the command line. Each command is a thin wrapper over a library function."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer(help="memrl: train and evaluate MemAgent-style long-document readers with RL.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

SetOption = Annotated[list[str] | None, typer.Option("--set", help="Override a config value: section.key=value.")]


def _fail(message: str, code: int = 2) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


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

    from memrl.config import ConfigError, load_config
    from memrl.train.sft import SFTError, SFTOptions, run_sft
    from memrl.train.sft_data import load_demonstrations

    try:
        cfg = load_config(recipe, list(set_ or []))
        tokenizer = AutoTokenizer.from_pretrained(model)
        demos = load_demonstrations(data, tokenizer, cfg.rollout.enable_thinking)
        policy = AutoModelForCausalLM.from_pretrained(model, dtype="float32")
        history = run_sft(policy, tokenizer, cfg, demos, SFTOptions(epochs=epochs, batch_size=batch_size, lr=lr), out)
    except (ConfigError, SFTError, OSError) as e:
        _fail(str(e))
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
    from memrl.config import ConfigError, load_config
    from memrl.train.controller import TrainingError, TrainOptions
    from memrl.train.controller import train as run_train

    overrides = list(set_ or []) + ([f"train.runtime={runtime}"] if runtime else [])
    try:
        cfg = load_config(recipe, overrides)
        options = TrainOptions(run_root=run_root, load=load, start_rollout_id=start_rollout_id,
                               save_rollouts=save_rollouts, replay_rollouts=replay_rollouts, progress=progress)
        if cfg.train.runtime == "ray":
            from memrl.distributed.runtime import run_ray_training
            from memrl.distributed.workers import WorkerError

            try:
                history = run_ray_training(cfg, options, ray_address=ray_address)
            except WorkerError as e:
                _fail(str(e))
        else:
            history = run_train(cfg, options)
    except (ConfigError, TrainingError) as e:
        _fail(str(e))
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
) -> None:
    """Serve a local model over an OpenAI-compatible completions API (token ids in and out, log-probs)."""
    from memrl.engines.server import serve_command

    serve_command(model, port=port, host=host, api_key=api_key, device=device, dtype=dtype,
                  gate_timeout_s=gate_timeout_s)


@app.command("convert-to-hf")
def convert_to_hf(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint folder iter_XXXXXXX (or a run root: latest).")],
    out: Annotated[Path, typer.Argument(help="Output Hugging Face model folder.")],
) -> None:
    """Export a training checkpoint as a plain Hugging Face model folder."""
    from memrl.train.checkpoint import CheckpointError, convert_to_hf_command

    try:
        path = convert_to_hf_command(ckpt, out)
    except CheckpointError as e:
        _fail(str(e))
    typer.echo(f"wrote {path}")


@app.command()
def report(run_root: Annotated[Path, typer.Argument(help="A training run root.")]) -> None:
    """Write PNG plots (reward, KL, log-prob gap, lengths) and a markdown summary of a run."""
    from memrl.train.report import ReportError, report_command

    try:
        paths = report_command(run_root)
    except ReportError as e:
        _fail(str(e))
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
    from memrl.config import ConfigError
    from memrl.data.records import DataError
    from memrl.eval.pass_at_k import pass_at_k_command
    from memrl.eval.runner import EvalError

    try:
        result = pass_at_k_command(model, server_url, recipe, data, out, k, set_, limit, tokenizer)
    except (ConfigError, DataError, EvalError) as e:
        _fail(str(e))
    typer.echo(f"wrote {out}: {len(result['pass_counts'])} questions, {result['mixed']} solved sometimes, "
               f"{result['never']} never, {result['always']} always, {len(result['failed'])} failed")


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
