"""A second architecture: a tiny Llama shaped like SmolLM2-135M-Instruct (tied embeddings, RoPE theta 1e5,
pad = eos = <|im_end|>, a ChatML template with a default system prompt and no `enable_thinking`) through
memrl's prompts, engine (dynamic and static decode), LoRA, SFT, and the whole train -> convert-to-hf ->
eval flow: the places where memrl could have assumed Qwen3."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from typer.testing import CliRunner

from memrl.cli import app
from memrl.config import Config, LoraConfig
from memrl.data.manifest import write_manifest
from memrl.data.records import QuestionRecord, write_jsonl
from memrl.engines.base import GenerationRequest
from memrl.engines.hf import HFEngine
from memrl.memagent.prompts import PromptBuilder
from memrl.task import chat_stop_token_ids
from memrl.tiny import build_tiny_tokenizer

# SmolLM2-135M-Instruct's own template (from its GGUF): a default system turn, no thinking switch.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def smollm2_like_tokenizer():
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = SMOLLM2_CHAT_TEMPLATE
    tokenizer.pad_token = tokenizer.eos_token  # SmolLM2: pad = eos = <|im_end|>
    return tokenizer


def tiny_llama(tokenizer, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_like_tokenizer()


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, tokenizer):
    out = tmp_path_factory.mktemp("llama") / "model"
    tiny_llama(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(autouse=True)
def _quiet_weight_loading():
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


def test_prompts_through_a_template_without_enable_thinking(tokenizer):
    chunk = tokenizer("Paris is the capital of France.", add_special_tokens=False)["input_ids"]
    prompts = []
    for thinking in (False, True):
        cfg = Config.model_validate({"task": {"enable_thinking": thinking}}).task
        prompts.append(PromptBuilder(tokenizer, cfg).memory_prompt_ids("Which city?", None, chunk))
    assert prompts[0] == prompts[1]  # the template ignores the switch; nothing else may depend on it
    text = tokenizer.decode(prompts[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_stop_ids_when_pad_is_eos(tokenizer):
    stops = chat_stop_token_ids(tokenizer)
    assert stops == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]


@pytest.mark.parametrize("static_kv", ["off", "on"])
def test_the_engine_serves_a_llama_on_both_decode_paths(tokenizer, static_kv):
    model = tiny_llama(tokenizer)
    engine = HFEngine(model, tokenizer, static_kv=static_kv)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]

    async def run():
        requests = [GenerationRequest(p, max_tokens=6, temperature=0.0) for p in prompts]
        try:
            return await engine.generate(requests)
        finally:
            await engine.close()

    results = asyncio.run(run())
    for prompt, result in zip(prompts, results, strict=True):
        assert result.error is None
        ids = torch.tensor([prompt + result.output_ids])
        with torch.no_grad():
            logp = model(ids).logits[0].log_softmax(-1)
        positions = range(len(prompt) - 1, ids.shape[1] - 1)
        assert result.output_ids == [int(logp[t].argmax()) for t in positions]  # greedy = argmax
        teacher = [float(logp[t, ids[0, t + 1]]) for t in positions]
        # Float32, two forwards of different batch shapes through 2 layers of width 64: ~1e-6 apart.
        assert result.log_probs == pytest.approx(teacher, abs=1e-4)


def test_lora_all_linear_finds_the_llama_projections(tokenizer):
    pytest.importorskip("peft")
    from memrl.train.lora import add_adapters

    model = add_adapters(tiny_llama(tokenizer), LoraConfig(rank=2, alpha=4, target_modules="all-linear"))
    names = {n.split(".")[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def _train_data(root):
    records = [QuestionRecord(f"q{i}", "What is fact3?", ["alpha3"], "fact3 is alpha3. " * 6) for i in range(4)]
    write_jsonl(root / "data" / "hotpotqa_train.jsonl", records)
    write_jsonl(root / "data" / "hotpotqa_dev.jsonl", records[:2])
    write_manifest(root / "data", {"hotpotqa_train.jsonl": 4, "hotpotqa_dev.jsonl": 2}, "test", {})
    return root / "data"


def test_train_convert_and_eval_a_llama(tmp_path, llama_folder):
    runner = CliRunner()
    data = _train_data(tmp_path)
    sets = ["task.chunk_tokens=16", "task.memory_tokens=8", "task.final_tokens=8", "sampling.n_samples=2",
            "train.rollout_batch_size=2", "train.num_rollout=1", "train.save_interval=1",
            f"model.path={llama_folder}", f"data.dir={data}"]
    args = ["train", "--run-root", str(tmp_path / "run"), "--no-progress", *[x for s in sets for x in ("--set", s)]]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    checkpoints = sorted((tmp_path / "run").rglob("iter_*"))
    assert checkpoints, result.output
    out = tmp_path / "hf"
    result = runner.invoke(app, ["convert-to-hf", str(checkpoints[-1]), str(out)])
    assert result.exit_code == 0, (result.output, result.exception)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    trained = AutoModelForCausalLM.from_pretrained(str(out))
    assert trained.lm_head.weight.data_ptr() == trained.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == SMOLLM2_CHAT_TEMPLATE
    result = runner.invoke(app, ["eval", "--model", str(out), "--data", str(data / "hotpotqa_dev.jsonl"),
                                 "--out", str(tmp_path / "eval"), "--set", "task.chunk_tokens=16",
                                 "--set", "task.memory_tokens=8", "--set", "task.final_tokens=8"])
    assert result.exit_code == 0, (result.output, result.exception)
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert (summary["total"], summary["succeeded"]) == (2, 2)
    assert AutoTokenizer.from_pretrained(str(out)).eos_token_id in summary["format"]["stop_token_ids"]


def test_sft_warm_starts_a_llama_whose_pad_is_its_eos(tmp_path, llama_folder, tokenizer):
    from memrl.train.sft_data import load_demonstrations

    data = tmp_path / "demos.jsonl"
    data.write_text("".join(json.dumps({"turns": [{"prompt": f"What is fact{i}?", "response": f"alpha{i}"}]}) + "\n"
                            for i in range(4)))
    (prompt, response), = load_demonstrations(data, tokenizer)[0]
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert response[-1] == tokenizer.eos_token_id == tokenizer.pad_token_id  # the stop the rollout expects
    result = CliRunner().invoke(app, ["sft", "--model", str(llama_folder), "--data", str(data), "--out",
                                      str(tmp_path / "sft"), "--epochs", "8", "--batch-size", "4", "--lr", "1e-2"])
    assert result.exit_code == 0, (result.output, result.exception)
    history = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    nll = [h["nll"] for h in history if "nll" in h]
    assert nll[-1] < nll[0]
    # The final <|im_end|> is trained although it is also the pad id: padding is masked by position, not by id.
    ids = torch.tensor([[*prompt, *response[:-1]]])

    def stop_log_prob(folder) -> float:
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(str(folder))(ids).logits[0, -1]
        return float(logits.log_softmax(-1)[tokenizer.eos_token_id])

    assert stop_log_prob(tmp_path / "sft" / "model") > stop_log_prob(llama_folder) + 1.0
