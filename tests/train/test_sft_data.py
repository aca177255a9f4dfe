import json

import pytest
from typer.testing import CliRunner

from memrl.cli import app
from memrl.tiny import build_tiny_tokenizer
from memrl.train.sft import SFTError
from memrl.train.sft_data import load_demonstrations


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_demonstrations_use_the_chat_template_and_end_of_turn(tmp_path):
    tok = build_tiny_tokenizer()
    path = write(tmp_path / "d.jsonl", [{"turns": [{"prompt": "Which city?", "response": "Paris"}]}])
    ((prompt, response),) = load_demonstrations(path, tok)[0]
    expected_prompt = tok.apply_chat_template([{"role": "user", "content": "Which city?"}], tokenize=False,
                                              add_generation_prompt=True, enable_thinking=False)
    assert tok.decode(prompt) == expected_prompt
    assert response[-1] == tok.eos_token_id and tok.decode(response[:-1]) == "Paris"


def test_malformed_line_is_named(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"turns": [{"prompt": "a", "response": "b"}]}, {"turn": []}])
    with pytest.raises(SFTError, match="line 2"):
        load_demonstrations(path, build_tiny_tokenizer())


def test_sft_command_lowers_the_nll(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["make-tiny-model", str(tmp_path / "m"), "--layers", "1",
                               "--hidden", "32"]).exit_code == 0
    data = write(tmp_path / "d.jsonl", [{"turns": [{"prompt": f"Q{k}", "response": "Paris"}]} for k in range(16)])
    result = runner.invoke(app, ["sft", "--model", str(tmp_path / "m"), "--data", str(data), "--out",
                                 str(tmp_path / "out"), "--epochs", "8", "--batch-size", "8", "--lr", "1e-2"])
    assert result.exit_code == 0, result.output
    first, last = (float(x) for x in result.output.split("NLL ")[1].split(" -> "))
    assert last < first
    assert (tmp_path / "out" / "model" / "config.json").is_file()
